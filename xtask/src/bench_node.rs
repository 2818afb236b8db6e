//! `cargo xtask bench`, node scale: what the agent costs beside 1, 20 and
//! 50 idle .NET 8 services (tests/workloads/Idle.cs), as on a Kubernetes
//! node full of them. For each count a fresh agent at its defaults starts
//! after the services are up; its CPU is read from /proc/PID/stat between
//! [`SETTLE`] and [`SETTLE`] + [`MEASURE`] after its start, its RSS,
//! threads and fds at the end. The agent is limited to `dotnet` processes
//! (`--exe dotnet`) so that the rest of the host's work does not move the
//! figures. The marginal cost is the slope from 1 to 50 processes.
//! Budget at 50: <= 128 MiB, <= 1% of one core.

use std::{
    fs,
    process::{Child, Stdio},
    thread,
    time::Duration,
};

use anyhow::Context as _;

use crate::bench::BenchInputs;

const SETTLE: Duration = Duration::from_secs(20);
const MEASURE: Duration = Duration::from_secs(30);
const COUNTS: [usize; 3] = [1, 20, 50];

/// One agent's steady state beside `processes` .NET processes.
struct NodeRow {
    processes: usize,
    cpu_percent: f64,
    rss_mib: f64,
    threads: u64,
    fds: usize,
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

/// user + system CPU seconds of `pid` so far.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace().skip(11);
    let utime: f64 = fields.next()?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((utime + stime) / ticks)
}

fn measure(inputs: &BenchInputs<'_>, processes: usize) -> anyhow::Result<NodeRow> {
    let windows = inputs.scratch.join(format!("node-{processes}"));
    let _ = fs::remove_dir_all(&windows);
    let mut agent = crate::bench::spawn_agent(inputs, &windows, 21000, &["--exe", "dotnet"])?;
    let pid = agent.id();
    thread::sleep(SETTLE);
    let before = cpu_seconds(pid).context("the agent exited early")?;
    thread::sleep(MEASURE);
    let after = cpu_seconds(pid).context("the agent exited early")?;
    let row = NodeRow {
        processes,
        cpu_percent: 100.0 * (after - before) / MEASURE.as_secs_f64(),
        rss_mib: status_field(pid, "VmRSS:").unwrap_or(0) as f64 / 1024.0,
        threads: status_field(pid, "Threads:").unwrap_or(0),
        fds: fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count()),
    };
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let _ = agent.wait();
    let _ = fs::remove_dir_all(&windows);
    Ok(row)
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    println!(
        "\nbench: node scale: the agent (defaults, --exe dotnet) beside idle .NET 8 services, CPU from {} s to {} s after its start",
        SETTLE.as_secs(),
        (SETTLE + MEASURE).as_secs()
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
    println!("| .NET processes | agent CPU, % of one core | RSS | threads | fds |");
    println!("| --- | --- | --- | --- | --- |");
    for row in &rows {
        println!(
            "| {} | {:.2}% | {:.1} MiB | {} | {} |",
            row.processes, row.cpu_percent, row.rss_mib, row.threads, row.fds
        );
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let n = (last.processes - first.processes).max(1) as f64;
        println!(
            "| per process (slope from {} to {}) | {:.4}% | {:.2} MiB | {:.2} | {:.2} |",
            first.processes,
            last.processes,
            (last.cpu_percent - first.cpu_percent) / n,
            (last.rss_mib - first.rss_mib) / n,
            (last.threads as f64 - first.threads as f64) / n,
            (last.fds as f64 - first.fds as f64) / n,
        );
        println!("| budget at {} | <= 1% | <= 128 MiB | | |", last.processes);
    }
    Ok(())
}
