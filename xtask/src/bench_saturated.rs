//! `cargo xtask bench`, saturated-host part (issue 9): a profiler is most
//! needed on an overloaded host. 400 busy processes, in the same session
//! (so the same scheduling autogroup) as the profiler, then
//! `record -a -F 999 -d 5` with clrbpf's default priority boost, with
//! `--no-priority-boost`, and `perf record -F 999 -g -a` for the same
//! 5 s: how long each takes from start to exit, and what it loses.

use std::{
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::bench::BenchInputs;

const BUSY_PROCESSES: usize = 400;
const SECONDS: &str = "5";

/// Busy shell loops, killed when dropped.
struct Load(Vec<Child>);

impl Load {
    fn start() -> anyhow::Result<Self> {
        let mut children = Vec::with_capacity(BUSY_PROCESSES);
        for _ in 0..BUSY_PROCESSES {
            children.push(
                Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .spawn()
                    .context("start a busy loop")?,
            );
        }
        Ok(Self(children))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
        }
        for child in &mut self.0 {
            let _ = child.wait();
        }
    }
}

/// `N samples from P processes, L lost` of clrbpf's summary.
fn samples_and_lost(stderr: &str) -> Option<(u64, u64)> {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("clrbpf: recorded "))?;
    let before = |word: &str| -> Option<u64> {
        line[..line.find(word)?]
            .split_whitespace()
            .last()?
            .trim_end_matches(',')
            .parse()
            .ok()
    };
    Some((before(" samples from")?, before(" lost")?))
}

pub fn run(inputs: &BenchInputs<'_>, have_perf: bool) -> anyhow::Result<()> {
    println!(
        "\nbench: saturated host: {BUSY_PROCESSES} busy processes in the profiler's session, record -a -F 999 for {SECONDS} s"
    );
    println!("| saturated host: mode | start to exit | samples kept | samples lost |");
    println!("| --- | --- | --- | --- |");
    let out = inputs.scratch.join("saturated.pb.gz");
    for (name, extra) in [
        ("clrbpf (default priority boost)", &[][..]),
        ("clrbpf --no-priority-boost", &["--no-priority-boost"][..]),
    ] {
        let load = Load::start()?;
        thread::sleep(Duration::from_secs(2));
        let started = Instant::now();
        let output = Command::new(inputs.clrbpf)
            .args(["record", "-a", "-F", "999", "-d", SECONDS, "-o"])
            .arg(&out)
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .context("run clrbpf record on the saturated host")?;
        let took = started.elapsed();
        drop(load);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let (kept, lost) = samples_and_lost(&stderr).unwrap_or_default();
        let lost_share = 100.0 * lost as f64 / (kept + lost).max(1) as f64;
        println!(
            "| {name} | {:.1} s | {kept} | {lost} ({lost_share:.0}%) |",
            took.as_secs_f64()
        );
    }
    if have_perf {
        let load = Load::start()?;
        thread::sleep(Duration::from_secs(2));
        let started = Instant::now();
        let perf_out = inputs.scratch.join("saturated.perf.data");
        let output = Command::new("perf")
            .args(["record", "-F", "999", "-g", "-a", "-o"])
            .arg(&perf_out)
            .args(["--", "sleep", SECONDS])
            .stdin(Stdio::null())
            .output()
            .context("run perf record on the saturated host")?;
        let took = started.elapsed();
        drop(load);
        // perf reports what it lost as `lost N chunks` or `LOST N events`.
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lost = stderr
            .lines()
            .find(|l| l.contains("lost") || l.contains("LOST"))
            .unwrap_or("none reported");
        println!(
            "| perf record -F 999 -g -a | {:.1} s | (perf.data) | {lost} |",
            took.as_secs_f64()
        );
    }
    Ok(())
}
