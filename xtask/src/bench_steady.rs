//! `cargo xtask bench`, steady state: what a profiler that stays on costs
//! once it has started. The rounds of the main table are 6 s long, so they
//! pay in full for what happens once (loading the BPF programs, building
//! the unwind tables of the workload's files); a recording of hours or the
//! agent pays it once. Here a warm CPU-bound .NET app runs while each
//! profiler records the whole host for 40 s, and its CPU is read from
//! /proc/PID/stat between 10 s and 40 s, after its start.

use std::{
    fs,
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::Context as _;

use crate::bench::{BenchInputs, cpu_seconds};

const SETTLE: Duration = Duration::from_secs(10);
const MEASURE: Duration = Duration::from_secs(30);

/// VmRSS of `pid`, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

fn rss_mib(pid: u32) -> Option<f64> {
    rss_kib(pid).map(|kib| kib as f64 / 1024.0)
}

/// Runs `profiler` for SETTLE + MEASURE and returns its CPU share of one
/// core over MEASURE and its RSS at the end.
fn measure(mut profiler: Child) -> anyhow::Result<(f64, f64)> {
    let pid = profiler.id();
    thread::sleep(SETTLE);
    let before = cpu_seconds(pid).context("the profiler exited early")?;
    thread::sleep(MEASURE);
    let after = cpu_seconds(pid).context("the profiler exited early")?;
    let rss = rss_mib(pid).unwrap_or(f64::NAN);
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
    let _ = profiler.wait();
    Ok((100.0 * (after - before) / MEASURE.as_secs_f64(), rss))
}

pub fn run(inputs: &BenchInputs<'_>, have_perf: bool) -> anyhow::Result<()> {
    println!(
        "\nbench: steady state: record -a -F 99 and the agent on a warm CPU-bound .NET app, CPU from {} s to {} s after the profiler started",
        SETTLE.as_secs(),
        (SETTLE + MEASURE).as_secs()
    );
    let mut app = inputs
        .dotnet8_workload("CpuBound")
        .args(["600", "1"])
        .stdout(Stdio::null())
        .spawn()
        .context("start CpuBound.dll")?;
    thread::sleep(Duration::from_secs(3));
    println!("| steady state: profiler | own CPU, % of one core | RSS |");
    println!("| --- | --- | --- |");
    let out = inputs.scratch.join("steady.pb.gz");
    let mut rows = Vec::new();
    for (name, extra) in [
        ("clrbpf record -a -F 99", &[][..]),
        (
            "clrbpf record -a -F 99 --frame-pointers-only",
            &["--frame-pointers-only"][..],
        ),
    ] {
        let child = Command::new(inputs.clrbpf)
            .args(["record", "-a", "-F", "99", "-o"])
            .arg(&out)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start clrbpf")?;
        rows.push((name, measure(child)?));
    }
    // Always-on: the agent at its defaults (19 Hz, CLR events, windows to
    // a directory), next to perf at the same rate.
    let agent =
        crate::bench::spawn_agent(inputs, &inputs.scratch.join("steady-agent"), 19000, &[])?;
    rows.push((
        "clrbpf agent (defaults: 19 Hz, CLR events; budget <= 1% of one core, <= 100 MiB)",
        measure(agent)?,
    ));
    if have_perf {
        for (rate, name) in [
            ("99", "perf record -F 99 -g -a"),
            ("19", "perf record -F 19 -g -a"),
        ] {
            let child = Command::new("perf")
                .args(["record", "-F", rate, "-g", "-a", "-q", "-o"])
                .arg(inputs.scratch.join("steady.perf.data"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("start perf")?;
            rows.push((name, measure(child)?));
        }
    }
    let _ = app.kill();
    let _ = app.wait();
    for (name, (cpu, rss)) in rows {
        println!("| {name} | {cpu:.2}% | {rss:.1} MiB |");
    }
    Ok(())
}
