//! `cargo xtask bench`, allocation part (issue 24,
//! `CLRBPF_BENCH_ONLY=allocstorm`): what allocation profiles cost an
//! allocation-heavy .NET 8 app (Allocs.dll), interleaved rounds, medians
//! (5 rounds at 1 GB/s, 3 unthrottled).
//!
//! 1. Held to about 1 GB/s (some 10,000 allocation ticks a second), the
//!    workload has slack: every profiler keeps its rate, so the cost is
//!    the CPU time the whole target process (its GC and EventPipe threads
//!    too) spends for the same bytes, which the workload measures itself
//!    (`CPU_S`). The loss is what a CPU-bound app at that allocation rate
//!    would lose: 1 - CPU alone / CPU under the profiler. Rows: no
//!    profiler; `record` without allocations; ticks without stacks
//!    (`record --alloc --allocs-per-second 0` on a target started with
//!    `DOTNET_EventPipeEnableStackwalk=0`: the runtime walks no stack for
//!    any session); ticks with stacks (`record --alloc --allocs-per-second
//!    0`); `record --alloc` (its budget); the agent's default; the agent
//!    with allocations on.
//! 2. Unthrottled (several GB/s, tens of thousands of ticks a second), a
//!    stress row set: the workload's throughput alone and under each
//!    profiler.

use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::Context as _;

use crate::bench::{BenchInputs, median, spawn_agent};

const SECONDS: u32 = 6;
/// Seconds before it allocates: `record` attaches as the runtime starts,
/// the agent looks for new .NET processes every 5 s.
const DELAY: &str = "3";
const DELAY_AGENT: &str = "8";
/// The runtime's switch for EventPipe stack walks, process-wide.
const STACKWALK_ENV: &str = "DOTNET_EventPipeEnableStackwalk";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Alone,
    Record,
    TicksWithoutStacks,
    TicksWithStacks,
    RecordAlloc,
    AgentDefault,
    AgentAlloc,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Alone => "no profiler",
            Self::Record => "clrbpf record (no --alloc)",
            Self::TicksWithoutStacks => "ticks without stacks (record --alloc, every tick)",
            Self::TicksWithStacks => "ticks with stacks (record --alloc, every tick)",
            Self::RecordAlloc => "clrbpf record --alloc (1000 ticks/s)",
            Self::AgentDefault => "clrbpf agent, default --clr-events",
            Self::AgentAlloc => "clrbpf agent --clr-events ...,allocations (1000 ticks/s)",
        }
    }

    fn is_agent(self) -> bool {
        matches!(self, Self::AgentDefault | Self::AgentAlloc)
    }
}

/// One row set: the workload's rate and the modes it runs under.
struct RowSet {
    title: &'static str,
    /// Megabytes a second the workload aims at.
    rate_mb: &'static str,
    /// Whether the workload keeps its rate (cost = CPU time) or runs flat
    /// out (cost = throughput).
    throttled: bool,
    rounds: usize,
    modes: &'static [Mode],
}

const SETS: [RowSet; 2] = [
    RowSet {
        title: "allocations at 1 GB/s",
        rate_mb: "1000",
        throttled: true,
        rounds: 5,
        modes: &[
            Mode::Alone,
            Mode::Record,
            Mode::TicksWithoutStacks,
            Mode::TicksWithStacks,
            Mode::RecordAlloc,
            Mode::AgentDefault,
            Mode::AgentAlloc,
        ],
    },
    RowSet {
        title: "allocation storm (unthrottled)",
        rate_mb: "100000",
        throttled: false,
        rounds: 3,
        modes: &[
            Mode::Alone,
            Mode::Record,
            Mode::TicksWithStacks,
            Mode::RecordAlloc,
            Mode::AgentAlloc,
        ],
    },
];

/// What one run of the workload reports.
#[derive(Clone, Copy, Debug)]
struct Run {
    bytes_per_s: f64,
    cpu_s: f64,
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    fs::create_dir_all(inputs.scratch)
        .with_context(|| format!("create {}", inputs.scratch.display()))?;
    let dll = inputs.workloads.join("net8").join("Allocs.dll");
    for set in &SETS {
        run_set(inputs, &dll, set)?;
    }
    Ok(())
}

fn run_set(inputs: &BenchInputs<'_>, dll: &Path, set: &RowSet) -> anyhow::Result<()> {
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); set.modes.len()];
    for round in 1..=set.rounds {
        for (i, &mode) in set.modes.iter().enumerate() {
            let run = run_once(inputs, dll, mode, set.rate_mb)
                .with_context(|| format!("{}, round {round}, {}", set.title, mode.name()))?;
            println!(
                "bench: allocstorm {} round {round} {:<58} {:>8.1} MB/s {:>6.3} s CPU",
                set.rate_mb,
                mode.name(),
                run.bytes_per_s / 1e6,
                run.cpu_s
            );
            runs[i].push(run);
        }
    }
    // Medians of each run's rate and CPU time per gigabyte.
    let medians: Vec<[f64; 2]> = runs
        .iter()
        .map(|runs| {
            let of = |f: fn(&Run) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
            [
                of(|r| r.bytes_per_s),
                of(|r| r.cpu_s / (r.bytes_per_s * SECONDS as f64 / 1e9)),
            ]
        })
        .collect();
    let [base_rate, base_per_gb] = medians[0];
    for (&mode, &[rate, per_gb]) in set.modes.iter().zip(&medians) {
        let budget = if mode == Mode::AgentDefault || (mode == Mode::AgentAlloc && !set.throttled) {
            "<= 5% loss"
        } else {
            ""
        };
        // What a CPU-bound app at this allocation rate would lose: the
        // same bytes for more CPU time.
        let cpu_loss = 100.0 * (1.0 - base_per_gb / per_gb);
        if set.throttled {
            println!(
                "| {}, {} (median MB/s; target CPU s per GB) | {:.0}; {per_gb:.3} ({:+.1}%) | {budget} |",
                set.title,
                mode.name(),
                rate / 1e6,
                -cpu_loss
            );
        } else {
            // On a shared machine the target does not always get a whole
            // core: CPU per GB is the steadier figure.
            println!(
                "| {}, {} (median MB/s; target CPU s per GB) | {:.0} ({:+.1}%); {per_gb:.3} ({:+.1}%) | {budget} |",
                set.title,
                mode.name(),
                rate / 1e6,
                100.0 * (rate / base_rate - 1.0),
                -cpu_loss
            );
        }
    }
    Ok(())
}

/// One run of the workload under `mode`.
fn run_once(
    inputs: &BenchInputs<'_>,
    dll: &Path,
    mode: Mode,
    rate_mb: &str,
) -> anyhow::Result<Run> {
    let profile = inputs.scratch.join("allocstorm.pb.gz");
    let agent_dir = inputs.scratch.join("allocstorm-agent");
    let _ = fs::remove_dir_all(&agent_dir);
    let mut cmd = if mode == Mode::Alone || mode.is_agent() {
        Command::new(inputs.dotnet8)
    } else {
        let mut c = Command::new(inputs.clrbpf);
        c.args(["record", "-q", "-o"]).arg(&profile);
        match mode {
            Mode::TicksWithoutStacks => {
                c.args(["--alloc", "--allocs-per-second", "0"]);
                c.env(STACKWALK_ENV, "0");
            }
            Mode::TicksWithStacks => {
                c.args(["--alloc", "--allocs-per-second", "0"]);
            }
            Mode::RecordAlloc => {
                c.arg("--alloc");
            }
            _ => {}
        }
        c.arg("--").arg(inputs.dotnet8);
        c
    };
    let agent = if mode.is_agent() {
        let mut extra = vec!["--upload-interval", "5s"];
        if mode == Mode::AgentAlloc {
            extra.extend(["--clr-events", "contention,exceptions,waits,allocations"]);
        }
        let agent = spawn_agent(inputs, &agent_dir, 18000, &extra)?;
        thread::sleep(Duration::from_millis(1500));
        Some(agent)
    } else {
        None
    };
    let delay = if mode.is_agent() { DELAY_AGENT } else { DELAY };
    let out = cmd
        .arg(dll)
        .args([delay, &SECONDS.to_string(), rate_mb])
        .stdin(Stdio::null())
        .output()
        .context("run the allocation workload")?;
    if let Some(mut agent) = agent {
        // SAFETY: kill has no memory preconditions; the pid is our child's.
        unsafe { libc::kill(agent.id() as libc::pid_t, libc::SIGTERM) };
        agent.wait().context("wait for the agent")?;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let value = |key: &str| -> anyhow::Result<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .with_context(|| format!("the workload printed no {key}"))
    };
    Ok(Run {
        bytes_per_s: value("BYTES_PER_S ")?,
        cpu_s: value("CPU_S ")?,
    })
}
