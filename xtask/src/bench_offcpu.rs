//! `cargo xtask bench`, off-CPU part (issue 4): the cost of `record
//! --off-cpu` on a context-switch-heavy workload (PingPong.dll: two threads
//! handing a token through two AutoResetEvents, every handoff a blocking
//! switch and a wakeup), next to `perf record -e sched:sched_switch -g`, the
//! classic perf way to get off-CPU stacks, and bcc's `offcputime` when it
//! can run. Interleaved rounds, medians, ratios to the no-profiler runs.
//!
//! The workload is pinned to CPU 0 (`taskset -c 0`): both threads then
//! hand off on one CPU, every handoff is two context switches there and
//! nothing else, so the rate is stable (unpinned, it swings between about
//! 20k and 100k handoffs/s with where the scheduler puts the threads) and
//! the probes' cost shows in it directly.

use std::process::{Command, Stdio};

use anyhow::Context as _;

use crate::bench::{BenchInputs, median};

/// Seconds PingPong runs per measurement.
const SECONDS: &str = "5";
const ROUNDS: usize = 5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Baseline,
    Clrbpf,
    PerfSchedSwitch,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Baseline => "no profiler",
            Self::Clrbpf => "clrbpf record --off-cpu",
            Self::PerfSchedSwitch => "perf record -e sched:sched_switch -g",
        }
    }
}

/// What one clrbpf run's summary says about the off-CPU path.
#[derive(Default)]
struct OffCpuFigures {
    switches: f64,
    us_per_switch: f64,
    waits: f64,
    kept: f64,
    dropped: f64,
    seconds: f64,
}

fn number_before(line: &str, marker: &str) -> Option<f64> {
    line.split(marker)
        .next()?
        .rsplit(' ')
        .next()?
        .trim_end_matches(',')
        .parse()
        .ok()
}

fn number_after(line: &str, marker: &str) -> Option<f64> {
    line.split(marker)
        .nth(1)?
        .split_whitespace()
        .next()?
        .trim_end_matches([',', ';'])
        .parse()
        .ok()
}

fn parse_summary(stderr: &str) -> OffCpuFigures {
    let mut f = OffCpuFigures::default();
    for line in stderr.lines() {
        if let Some(s) = number_after(line, "clrbpf: recorded ") {
            f.seconds = s;
        }
        if line.starts_with("clrbpf: off-CPU:") {
            f.switches = number_before(line, " switches").unwrap_or(0.0);
            f.us_per_switch = number_after(line, "sched_switch BPF ").unwrap_or(0.0);
            f.waits = number_after(line, "blocked (exact) in ").unwrap_or(0.0);
            f.kept = number_before(line, " kept waits").unwrap_or(0.0);
            f.dropped = number_before(line, " lost to a full ring").unwrap_or(0.0)
                + number_before(line, " not tracked").unwrap_or(0.0);
        }
    }
    f
}

fn handoffs(stdout: &[u8]) -> Option<f64> {
    String::from_utf8_lossy(stdout).lines().find_map(|l| {
        l.strip_prefix("HANDOFFS_PER_SEC ")
            .and_then(|v| v.trim().parse().ok())
    })
}

pub fn run(inputs: &BenchInputs<'_>, have_perf: bool) -> anyhow::Result<()> {
    let dll = inputs.workloads.join("net8").join("PingPong.dll");
    let modes: Vec<Mode> = [Mode::Baseline, Mode::Clrbpf, Mode::PerfSchedSwitch]
        .into_iter()
        .filter(|m| *m != Mode::PerfSchedSwitch || have_perf)
        .collect();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut figures = Vec::new();
    for round in 1..=ROUNDS {
        for (i, &mode) in modes.iter().enumerate() {
            let mut cmd = match mode {
                Mode::Baseline => {
                    let mut c = Command::new("taskset");
                    c.args(["-c", "0"]).arg(inputs.dotnet8);
                    c
                }
                Mode::Clrbpf => {
                    let mut c = Command::new(inputs.clrbpf);
                    c.args(["record", "-v", "--off-cpu", "--no-clr-events", "-o"])
                        .arg(inputs.scratch.join("offcpu.pb.gz"))
                        .args(["--", "taskset", "-c", "0"])
                        .arg(inputs.dotnet8);
                    c
                }
                Mode::PerfSchedSwitch => {
                    let mut c = Command::new("perf");
                    c.args(["record", "-q", "-e", "sched:sched_switch", "-g", "-o"])
                        .arg(inputs.scratch.join("offcpu.perf.data"))
                        .args(["--", "taskset", "-c", "0"])
                        .arg(inputs.dotnet8);
                    c
                }
            };
            let out = cmd
                .arg(&dll)
                .arg(SECONDS)
                .stdin(Stdio::null())
                .output()
                .with_context(|| format!("run PingPong under {}", mode.name()))?;
            let rate = handoffs(&out.stdout).with_context(|| {
                format!(
                    "PingPong under {} printed no HANDOFFS_PER_SEC: {}",
                    mode.name(),
                    String::from_utf8_lossy(&out.stderr)
                )
            })?;
            println!(
                "bench: off-CPU round {round} {:<38} {rate:>10.0} handoffs/s",
                mode.name()
            );
            rates[i].push(rate);
            if mode == Mode::Clrbpf {
                figures.push(parse_summary(&String::from_utf8_lossy(&out.stderr)));
            }
        }
    }
    let baseline = median(&mut rates[0].clone());
    println!();
    println!("| off-CPU measure (PingPong.dll, context-switch heavy) | value | |");
    println!("| --- | --- | --- |");
    for (i, &mode) in modes.iter().enumerate() {
        let m = median(&mut rates[i]);
        println!(
            "| handoffs/s under {} (median) | {m:.0} ({:+.1}%) | |",
            mode.name(),
            100.0 * (m / baseline - 1.0)
        );
    }
    let med =
        |f: &dyn Fn(&OffCpuFigures) -> f64| median(&mut figures.iter().map(f).collect::<Vec<_>>());
    println!(
        "| clrbpf: context switches handled by the sched_switch program | {:.0}/s | |",
        med(&|f| f.switches / f.seconds.max(1e-9))
    );
    println!(
        "| clrbpf: blocking waits of the profiled process measured | {:.0}/s | |",
        med(&|f| f.waits / f.seconds.max(1e-9))
    );
    println!(
        "| clrbpf: waits kept (records written, the rest sampled out and upscaled) | {:.0}/s | |",
        med(&|f| f.kept / f.seconds.max(1e-9))
    );
    println!(
        "| clrbpf: waits dropped (ring full or pending map full) | {:.0} | |",
        med(&|f| f.dropped)
    );
    println!(
        "| clrbpf: sched_switch BPF time per switch (median) | {:.2} us | |",
        med(&|f| f.us_per_switch)
    );
    println!(
        "| clrbpf: sched_switch BPF time, share of one CPU (median) | {:.2}% | |",
        med(&|f| 100.0 * f.us_per_switch * f.switches / 1e6 / f.seconds.max(1e-9))
    );
    let bcc = Command::new("offcputime-bpfcc")
        .args(["-d", "1"])
        .stdin(Stdio::null())
        .output();
    match bcc {
        Ok(out) if out.status.success() => println!(
            "\nbench: bcc offcputime ran; compare by hand: `offcputime-bpfcc -p PID` next to clrbpf"
        ),
        Ok(out) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr.lines().last().unwrap_or("no output");
            println!(
                "\nbench: bcc's offcputime cannot run here ({last}): it compiles its BPF at run time against kernel headers this kernel does not ship"
            );
        }
        Err(e) => println!("\nbench: bcc's offcputime is not installed ({e})"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_line_is_read() {
        let text = "clrbpf: recorded 5.4 s (command exited), 857 samples\n\
clrbpf: off-CPU: 100.0 ms blocked (exact) in 230433 waits of 10 threads; the profile holds 99.0 ms (-0.1%) from 1614 kept waits; 3 lost to a full ring, 2 not tracked (pending map full), 20 wakers recorded, sched_switch BPF 2.02 us per switch over 461360 switches\n";
        let f = parse_summary(text);
        assert_eq!(f.seconds, 5.4);
        assert_eq!(f.switches, 461360.0);
        assert_eq!(f.us_per_switch, 2.02);
        assert_eq!(f.waits, 230433.0);
        assert_eq!(f.kept, 1614.0);
        assert_eq!(f.dropped, 5.0);
    }
}
