//! `cargo xtask bench`, allocation storm part (issue 24,
//! `CLRBPF_BENCH_ONLY=allocstorm`): the throughput of an allocation-heavy
//! .NET 8 app (Allocs.dll unthrottled: several GB/s, tens of thousands
//! of allocation ticks a second; held to 1 GB/s it has slack and no
//! profiler shows a loss) alone, under `record` without allocations, under `record
//! --alloc` with every tick's stack, under `record --alloc` with its
//! default budget, and under the agent with allocations and its default
//! budget; interleaved rounds, medians. The runtime offers no stackless
//! ticks per session before CollectTracing3, so "ticks without stacks" has
//! no row.

use std::{
    fs,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::Context as _;

use crate::bench::{BenchInputs, median, spawn_agent};

const ROUNDS: usize = 3;
/// Megabytes a second the workload aims at (more than it can: unthrottled),
/// and for how long.
const RATE_MB: &str = "100000";
const SECONDS: &str = "6";
/// Seconds before it allocates: `record` attaches as the runtime starts,
/// the agent looks for new .NET processes every 5 s.
const DELAY: &str = "3";
const DELAY_AGENT: &str = "8";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Alone,
    Record,
    RecordAllocAll,
    RecordAlloc,
    Agent,
}

impl Mode {
    const ALL: [Self; 5] = [
        Self::Alone,
        Self::Record,
        Self::RecordAllocAll,
        Self::RecordAlloc,
        Self::Agent,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Alone => "no profiler",
            Self::Record => "clrbpf record (no --alloc)",
            Self::RecordAllocAll => "clrbpf record --alloc --allocs-per-second 0",
            Self::RecordAlloc => "clrbpf record --alloc (1000 ticks/s)",
            Self::Agent => "clrbpf agent --clr-events ...,allocations (1000 ticks/s)",
        }
    }
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    fs::create_dir_all(inputs.scratch)
        .with_context(|| format!("create {}", inputs.scratch.display()))?;
    let dll = inputs.workloads.join("net8").join("Allocs.dll");
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); Mode::ALL.len()];
    for round in 1..=ROUNDS {
        for (i, &mode) in Mode::ALL.iter().enumerate() {
            let rate = run_once(inputs, &dll, mode)
                .with_context(|| format!("allocation storm, round {round}, {}", mode.name()))?;
            println!(
                "bench: allocstorm round {round} {:<56} {:>8.1} MB/s",
                mode.name(),
                rate / 1e6
            );
            rates[i].push(rate);
        }
    }
    let baseline = median(&mut rates[0].clone());
    for (i, &mode) in Mode::ALL.iter().enumerate() {
        let m = median(&mut rates[i]);
        let budget = if mode == Mode::Agent {
            "<= 5% loss"
        } else {
            ""
        };
        println!(
            "| allocation storm (unthrottled), {} (median MB/s) | {:.0} ({:+.1}%) | {budget} |",
            mode.name(),
            m / 1e6,
            100.0 * (m / baseline - 1.0)
        );
    }
    Ok(())
}

/// One run: the bytes a second the workload allocated.
fn run_once(inputs: &BenchInputs<'_>, dll: &std::path::Path, mode: Mode) -> anyhow::Result<f64> {
    let profile = inputs.scratch.join("allocstorm.pb.gz");
    let agent_dir = inputs.scratch.join("allocstorm-agent");
    let _ = fs::remove_dir_all(&agent_dir);
    let mut cmd = match mode {
        Mode::Alone | Mode::Agent => Command::new(inputs.dotnet8),
        Mode::Record | Mode::RecordAllocAll | Mode::RecordAlloc => {
            let mut c = Command::new(inputs.clrbpf);
            c.args(["record", "-q", "-o"]).arg(&profile);
            match mode {
                Mode::RecordAllocAll => {
                    c.args(["--alloc", "--allocs-per-second", "0"]);
                }
                Mode::RecordAlloc => {
                    c.arg("--alloc");
                }
                _ => {}
            }
            c.arg("--").arg(inputs.dotnet8);
            c
        }
    };
    let agent = if mode == Mode::Agent {
        let agent = spawn_agent(
            inputs,
            &agent_dir,
            18000,
            &[
                "--upload-interval",
                "5s",
                "--clr-events",
                "contention,exceptions,waits,allocations",
            ],
        )?;
        thread::sleep(Duration::from_millis(1500));
        Some(agent)
    } else {
        None
    };
    let delay = if mode == Mode::Agent {
        DELAY_AGENT
    } else {
        DELAY
    };
    let out = cmd
        .arg(dll)
        .args([delay, SECONDS, RATE_MB])
        .stdin(Stdio::null())
        .output()
        .context("run the allocation storm")?;
    if let Some(mut agent) = agent {
        // SAFETY: kill has no memory preconditions; the pid is our child's.
        unsafe { libc::kill(agent.id() as libc::pid_t, libc::SIGTERM) };
        agent.wait().context("wait for the agent")?;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("BYTES_PER_S ")?.trim().parse().ok())
        .context("the workload printed no BYTES_PER_S")
}
