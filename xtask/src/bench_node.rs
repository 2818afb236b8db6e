//! `cargo xtask bench`, node scale: what the agent costs beside 1, 20 and
//! 50 idle .NET 8 services (tests/workloads/Idle.cs), as on a Kubernetes
//! node full of them. For each count a fresh agent at its defaults starts
//! after the services are up, and its CPU time is read from /proc/PID/stat
//! every [`STEP`]:
//!
//! - the start: CPU seconds over the first [`START`] (indexing the host's
//!   processes, attaching to the services, their runtimes' tier-1
//!   compiles of the counter code the agent asks for);
//! - the warm-up: CPU in each of the [`WARM_UP`] windows (30-60 s and
//!   60-90 s after the start), in % of one core: the budget holds from
//!   30 s on (issue 34);
//! - the steady state: CPU from [`STEADY_FROM`] to [`STEADY_TO`] after the
//!   start, in % of one core. The 10 s steps are printed too, to show
//!   where the start ends.
//!
//! RSS, threads and fds are read at the end. The agent is limited to
//! `dotnet` processes (`--exe dotnet`) so that the rest of the host's work
//! does not move the figures much (it still indexes the host's new
//! processes: the host's load is printed with each row). The marginal
//! cost is the slope from 1 to 50 processes. Budget at 50: <= 128 MiB,
//! <= 1% of one core in the steady state.

use std::{
    fs,
    process::{Child, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::bench::{BenchInputs, cpu_seconds};

/// How often the agent's CPU time is read.
const STEP: Duration = Duration::from_secs(10);
/// The start: its CPU seconds are reported apart.
const START: Duration = Duration::from_secs(60);
/// The steady-state window, after the agent's start.
const STEADY_FROM: Duration = Duration::from_secs(80);
const STEADY_TO: Duration = Duration::from_secs(120);
/// The warm-up windows, after the agent's start: at most 1% of a core in
/// each at 50 processes.
const WARM_UP: [(Duration, Duration); 2] = [
    (Duration::from_secs(30), Duration::from_secs(60)),
    (Duration::from_secs(60), Duration::from_secs(90)),
];
const COUNTS: [usize; 3] = [1, 20, 50];

/// One agent beside `processes` .NET processes.
struct NodeRow {
    processes: usize,
    /// CPU seconds over the first [`START`].
    start_cpu_s: f64,
    /// % of one core in each [`WARM_UP`] window.
    warm_up_percent: [f64; 2],
    /// % of one core from [`STEADY_FROM`] to [`STEADY_TO`].
    steady_percent: f64,
    /// % of one core in each [`STEP`] from the start.
    steps: Vec<f64>,
    rss_mib: f64,
    threads: u64,
    fds: usize,
    /// The host's 1-minute load average at the end.
    load: f64,
}

/// A `/proc/PID/status` field as a number (`Threads:`; kB fields in kB).
fn status_field(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// The host's 1-minute load average.
fn load_average() -> f64 {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn measure(inputs: &BenchInputs<'_>, processes: usize) -> anyhow::Result<NodeRow> {
    let windows = inputs.scratch.join(format!("node-{processes}"));
    let _ = fs::remove_dir_all(&windows);
    let started = Instant::now();
    let mut agent = crate::bench::spawn_agent(inputs, &windows, 21000, &["--exe", "dotnet"])?;
    let pid = agent.id();
    // CPU seconds at 0, STEP, 2 STEP, ... STEADY_TO after the start.
    let mut readings = vec![0.0];
    for n in 1..=STEADY_TO.as_secs() / STEP.as_secs() {
        thread::sleep((STEP * n as u32).saturating_sub(started.elapsed()));
        readings.push(cpu_seconds(pid).context("the agent exited early")?);
    }
    let at = |t: Duration| readings[(t.as_secs() / STEP.as_secs()) as usize];
    let percent =
        |from: Duration, to: Duration| 100.0 * (at(to) - at(from)) / (to - from).as_secs_f64();
    let row = NodeRow {
        processes,
        start_cpu_s: at(START),
        warm_up_percent: WARM_UP.map(|(from, to)| percent(from, to)),
        steady_percent: percent(STEADY_FROM, STEADY_TO),
        steps: readings
            .windows(2)
            .map(|w| 100.0 * (w[1] - w[0]) / STEP.as_secs_f64())
            .collect(),
        rss_mib: status_field(pid, "VmRSS:").unwrap_or(0) as f64 / 1024.0,
        threads: status_field(pid, "Threads:").unwrap_or(0),
        fds: fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count()),
        load: load_average(),
    };
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let _ = agent.wait();
    let _ = fs::remove_dir_all(&windows);
    Ok(row)
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    println!(
        "\nbench: node scale: the agent (defaults, --exe dotnet) beside idle .NET 8 services; start: CPU seconds over its first {} s; warm-up: CPU from 30 s to 60 s and from 60 s to 90 s; steady state: CPU from {} s to {} s after its start",
        START.as_secs(),
        STEADY_FROM.as_secs(),
        STEADY_TO.as_secs()
    );
    let mut apps: Vec<Child> = Vec::new();
    let mut rows = Vec::new();
    let result = (|| -> anyhow::Result<()> {
        for count in COUNTS {
            while apps.len() < count {
                apps.push(
                    inputs
                        .dotnet8_workload("Idle")
                        .args(["900", "1000"])
                        .stdout(Stdio::null())
                        .spawn()
                        .context("start Idle.dll")?,
                );
            }
            thread::sleep(Duration::from_secs(3));
            rows.push(measure(inputs, count)?);
        }
        Ok(())
    })();
    for mut app in apps {
        let _ = app.kill();
        let _ = app.wait();
    }
    result?;
    print_rows(&rows);
    Ok(())
}

fn print_rows(rows: &[NodeRow]) {
    println!(
        "| .NET processes | start: CPU s over {} s | 30-60 s: % of one core | 60-90 s | steady: % of one core | RSS | threads | fds | host load |",
        START.as_secs()
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in rows {
        println!(
            "| {} | {:.2} s | {:.3}% | {:.3}% | {:.3}% | {:.1} MiB | {} | {} | {:.1} |",
            row.processes,
            row.start_cpu_s,
            row.warm_up_percent[0],
            row.warm_up_percent[1],
            row.steady_percent,
            row.rss_mib,
            row.threads,
            row.fds,
            row.load
        );
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let n = (last.processes - first.processes).max(1) as f64;
        println!(
            "| per process (slope from {} to {}) | {:.3} s | {:.4}% | {:.4}% | {:.4}% | {:.2} MiB | {:.2} | {:.2} | |",
            first.processes,
            last.processes,
            (last.start_cpu_s - first.start_cpu_s) / n,
            (last.warm_up_percent[0] - first.warm_up_percent[0]) / n,
            (last.warm_up_percent[1] - first.warm_up_percent[1]) / n,
            (last.steady_percent - first.steady_percent) / n,
            (last.rss_mib - first.rss_mib) / n,
            (last.threads as f64 - first.threads as f64) / n,
            (last.fds as f64 - first.fds as f64) / n,
        );
        println!(
            "| budget at {} | | <= 1% | <= 1% | <= 1% | <= 128 MiB | | | |",
            last.processes
        );
    }
    println!(
        "\nagent CPU per {} s step from its start, % of one core:",
        STEP.as_secs()
    );
    for row in rows {
        let steps: Vec<String> = row.steps.iter().map(|p| format!("{p:.2}")).collect();
        println!("- {} processes: {}", row.processes, steps.join(" "));
    }
}
