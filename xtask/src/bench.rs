//! `cargo xtask bench`: the budgets of docs/performance.md measured in one run, with
//! `perf` doing the same job next to clrbpf. These machines are noisy, so
//! every figure is a median over rounds whose modes are interleaved
//! (baseline, clrbpf, clrbpf with frame pointers only, perf, baseline,
//! ...), and losses are ratios to the baseline of the same run. The BPF
//! time per sample of the default (DWARF unwinding in the kernel) and of
//! `--frame-pointers-only` come from the same rounds, so their ratio holds
//! even when the machine's load moves the absolute figures.

use std::{
    fs,
    os::unix::process::ExitStatusExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

/// Seconds the CPU-bound workload runs per measurement.
const WORKLOAD_SECONDS: u32 = 6;
/// Rounds per mode; the median is reported.
const ROUNDS: usize = 5;
/// Give the profiler time to load and attach before the workload starts.
const PROFILER_WARMUP: Duration = Duration::from_millis(1500);
/// How long the warm agent runs before the workload: its own start (the
/// host's processes indexed, its .NET processes attached) is over by then.
const AGENT_WARM_UP: Duration = Duration::from_secs(10);

pub struct BenchInputs<'a> {
    pub repo_root: &'a Path,
    pub clrbpf: &'a Path,
    /// `target/release/examples/bench`: perf map load and CLR intake.
    pub micro_benches: &'a Path,
    pub dotnet8: &'a Path,
    pub workloads: &'a Path,
    pub scratch: &'a Path,
}

impl BenchInputs<'_> {
    /// The one launcher of the bench's .NET 8 workloads:
    /// `dotnet tests/workloads/bin/net8/NAME.dll`, stdin closed.
    pub fn dotnet8_workload(&self, name: &str) -> Command {
        let mut command = Command::new(self.dotnet8);
        command
            .arg(self.workloads.join("net8").join(format!("{name}.dll")))
            .stdin(Stdio::null());
        command
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Baseline,
    /// The default: DWARF unwinding in the kernel.
    Clrbpf,
    ClrbpfFramePointers,
    Perf,
    /// `clrbpf agent` with its defaults (19 Hz, CLR events on), for
    /// always-on profiling, next to perf at the same rate: started, like
    /// the others, 1.5 s before the workload, so its start is in the round.
    Agent,
    /// The same agent started [`AGENT_WARM_UP`] before the workload: what
    /// a service pays under an agent that is already running (the new
    /// workload process is still indexed and attached in the round).
    AgentWarm,
    Perf19,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Baseline => "no profiler",
            Self::Clrbpf => "clrbpf record -a -F 99",
            Self::ClrbpfFramePointers => "clrbpf record -a -F 99 --frame-pointers-only",
            Self::Perf => "perf record -F 99 -g -a",
            Self::Agent => "clrbpf agent (defaults: 19 Hz, CLR events)",
            Self::AgentWarm => "clrbpf agent, warm (started 10 s before)",
            Self::Perf19 => "perf record -F 19 -g -a",
        }
    }

    fn clrbpf_flags(self) -> Option<&'static [&'static str]> {
        match self {
            Self::Clrbpf => Some(&[]),
            Self::ClrbpfFramePointers => Some(&["--frame-pointers-only"]),
            Self::Baseline | Self::Perf | Self::Agent | Self::AgentWarm | Self::Perf19 => None,
        }
    }
}

/// Resource use of a finished child, from wait4(2).
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub cpu: Duration,
    pub max_rss_kib: u64,
}

pub fn wait_with_usage(child: &mut Child) -> anyhow::Result<(std::process::ExitStatus, Usage)> {
    let pid = i32::try_from(child.id()).context("pid out of range")?;
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid value for the kernel to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own unreaped child; pointers are valid.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if rc != pid {
        bail!("wait4({pid}) failed: {}", std::io::Error::last_os_error());
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    Ok((
        std::process::ExitStatus::from_raw(status),
        Usage {
            cpu: tv(usage.ru_utime) + tv(usage.ru_stime),
            max_rss_kib: usage.ru_maxrss as u64,
        },
    ))
}

fn interrupt(child: &Child) {
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
}

/// Runs the CPU-bound workload once and returns its own ops/s figure.
fn run_workload(inputs: &BenchInputs<'_>, threads: usize) -> anyhow::Result<f64> {
    let out = inputs
        .dotnet8_workload("CpuBound")
        .arg(WORKLOAD_SECONDS.to_string())
        .arg(threads.to_string())
        .output()
        .context("run CpuBound.dll")?;
    if !out.status.success() {
        bail!(
            "CpuBound.dll failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| {
            l.strip_prefix("OPS_PER_SEC ")
                .and_then(|v| v.trim().parse().ok())
        })
        .with_context(|| format!("CpuBound.dll printed no OPS_PER_SEC line: {text}"))
}

struct ProfilerRun {
    ops: f64,
    usage: Usage,
    wall: Duration,
    /// The profiler's CPU seconds while the workload ran.
    cpu_in_workload: Option<f64>,
    bpf_us_per_sample: Option<f64>,
    samples: Option<u64>,
    unwind: Option<UnwindSummary>,
}

/// The summary's `unwind tables` line.
#[derive(Clone, Copy, Debug, PartialEq)]
struct UnwindSummary {
    table_mib: f64,
    files: u64,
    processes: u64,
}

impl UnwindSummary {
    /// From `clrbpf: unwind tables 7.0 MiB in 19 files, 5 processes indexed ...`.
    fn parse(stderr: &str) -> Option<Self> {
        let rest = stderr
            .lines()
            .find_map(|l| l.split("unwind tables ").nth(1))?;
        let mut words = rest.split_whitespace();
        let table_mib = words.next()?.parse().ok()?;
        let files = words.nth(2)?.parse().ok()?;
        let processes = words.nth(1)?.parse().ok()?;
        Some(Self {
            table_mib,
            files,
            processes,
        })
    }
}

fn run_profiled(
    inputs: &BenchInputs<'_>,
    mode: Mode,
    threads: usize,
) -> anyhow::Result<ProfilerRun> {
    let mut profiler = match mode {
        Mode::Baseline => None,
        Mode::Clrbpf | Mode::ClrbpfFramePointers => Some(
            Command::new(inputs.clrbpf)
                .args(["record", "-v", "-a", "-F", "99"])
                .args(mode.clrbpf_flags().unwrap_or_default())
                .arg("-o")
                .arg(inputs.scratch.join("bench.pb.gz"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(
                    fs::File::create(inputs.scratch.join("clrbpf.stderr"))
                        .context("create stderr file")?,
                )
                .spawn()
                .context("start clrbpf")?,
        ),
        Mode::Agent | Mode::AgentWarm => Some(spawn_agent(
            inputs,
            &inputs.scratch.join("agent-windows"),
            18000,
            &[],
        )?),
        Mode::Perf | Mode::Perf19 => Some(
            Command::new("perf")
                .arg("record")
                .args(["-F", if mode == Mode::Perf { "99" } else { "19" }])
                .args(["-g", "-a", "-q", "-o"])
                .arg(inputs.scratch.join("perf.data"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("start perf (apt-get install linux-perf)")?,
        ),
    };
    let started = Instant::now();
    if profiler.is_some() {
        thread::sleep(if mode == Mode::AgentWarm {
            AGENT_WARM_UP
        } else {
            PROFILER_WARMUP
        });
    }
    let cpu_before = profiler.as_ref().and_then(|p| cpu_seconds(p.id()));
    let ops = run_workload(inputs, threads);
    let cpu_in_workload = profiler
        .as_ref()
        .and_then(|p| Some(cpu_seconds(p.id())? - cpu_before?));
    let mut usage = Usage::default();
    let mut bpf_us_per_sample = None;
    let mut samples = None;
    let mut unwind = None;
    if let Some(child) = profiler.as_mut() {
        interrupt(child);
        let (status, u) = wait_with_usage(child)?;
        usage = u;
        // perf re-raises the SIGINT it handled once its data is written.
        let perf_interrupted =
            matches!(mode, Mode::Perf | Mode::Perf19) && status.signal() == Some(libc::SIGINT);
        if !(status.success() || perf_interrupted) {
            bail!("{} exited with {status}", mode.name());
        }
        if mode.clrbpf_flags().is_some() {
            let stderr =
                fs::read_to_string(inputs.scratch.join("clrbpf.stderr")).unwrap_or_default();
            bpf_us_per_sample = bpf_us_per_sample_of(&stderr);
            samples = stderr.lines().find_map(|l| {
                l.split(" samples from ")
                    .next()?
                    .rsplit(' ')
                    .next()?
                    .parse()
                    .ok()
            });
            unwind = UnwindSummary::parse(&stderr);
        }
        if matches!(mode, Mode::Perf | Mode::Perf19) {
            samples = perf_samples(&inputs.scratch.join("perf.data"));
        }
    }
    Ok(ProfilerRun {
        ops: ops?,
        usage,
        wall: started.elapsed(),
        cpu_in_workload,
        bpf_us_per_sample,
        samples,
        unwind,
    })
}

/// user + system CPU seconds of process `pid` so far.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace().skip(11);
    let utime: f64 = fields.next()?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((utime + stime) / ticks)
}

/// `BPF time per sample X us` of a clrbpf summary.
pub fn bpf_us_per_sample_of(stderr: &str) -> Option<f64> {
    stderr.lines().find_map(|l| {
        l.split("BPF time per sample ")
            .nth(1)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Samples in a perf.data file: one line each from `perf script -F pid`.
fn perf_samples(data: &Path) -> Option<u64> {
    let output = Command::new("perf")
        .args(["script", "-F", "pid", "-i"])
        .arg(data)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output.status.success().then(|| {
        output
            .stdout
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .count() as u64
    })
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Restores `kernel.bpf_stats_enabled` when dropped.
struct BpfStatsGuard(Option<String>);

impl BpfStatsGuard {
    const PATH: &str = "/proc/sys/kernel/bpf_stats_enabled";

    fn enable() -> Self {
        let old = fs::read_to_string(Self::PATH).ok();
        if fs::write(Self::PATH, "1").is_err() {
            eprintln!(
                "bench: cannot enable kernel.bpf_stats_enabled; BPF time per sample will be missing"
            );
        }
        Self(old)
    }
}

impl Drop for BpfStatsGuard {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = fs::write(Self::PATH, old.trim());
        }
    }
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    fs::create_dir_all(inputs.scratch)
        .with_context(|| format!("create {}", inputs.scratch.display()))?;
    let _stats = BpfStatsGuard::enable();
    let have_perf = Command::new("perf")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    // `CLRBPF_BENCH_ONLY=cpu,alloc,steady,churn,storm,first,allocstorm,node,names,naming` runs
    // only those parts.
    if let Ok(only) = std::env::var("CLRBPF_BENCH_ONLY") {
        for part in only.split(',') {
            match part.trim() {
                "steady" => crate::bench_steady::run(inputs, have_perf)?,
                "churn" => crate::bench_churn::run(inputs)?,
                "storm" => exception_storm(inputs)?,
                "cpu" => cpu_table(inputs, have_perf)?,
                "alloc" => crate::bench_alloc::run(inputs)?,
                "first" => {
                    crate::bench_first::run(inputs)?;
                    crate::bench_new_process::run(inputs)?;
                    crate::bench_stack_copy::run(inputs)?;
                }
                "allocstorm" => crate::bench_alloc_storm::run(inputs)?,
                "node" => crate::bench_node::run(inputs)?,
                "names" => crate::bench_names::run(inputs)?,
                "naming" => crate::bench_naming::run(inputs, have_perf)?,
                other => {
                    bail!(
                        "CLRBPF_BENCH_ONLY: no bench part {other:?} (cpu, alloc, steady, churn, storm, first, allocstorm, node, names, naming)"
                    )
                }
            }
        }
        return Ok(());
    }
    cpu_table(inputs, have_perf)?;
    crate::bench_alloc::run(inputs)?;
    crate::bench_steady::run(inputs, have_perf)?;
    crate::bench_first::run(inputs)?;
    crate::bench_new_process::run(inputs)?;

    let perf_map = Command::new(inputs.micro_benches)
        .args(["perf-map", "--entries", "100000"])
        .output()
        .context("run the perf-map bench")?;
    let perf_map_line = String::from_utf8_lossy(&perf_map.stdout);
    let perf_map_ms = perf_map_line
        .split("median ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or("?");
    println!("| perf map load, 100,000 entries (median) | {perf_map_ms} ms | <= 50 ms |");
    // The estimate the managed-symbol budget charges, against the real RSS
    // (a process of its own, so nothing else grows it).
    let memory = Command::new(inputs.micro_benches)
        .args(["managed-symbol-memory"])
        .output()
        .context("run the managed-symbol-memory bench")?;
    let memory_line = String::from_utf8_lossy(&memory.stdout);
    let figures = memory_line.split(": ").nth(1).unwrap_or("?").trim();
    println!(
        "| managed symbols, 6 x 200,000 perf map entries, default budget | {figures} | estimate within 10% of RSS |"
    );
    clr_benches(inputs)?;
    crate::bench_offcpu::run(inputs, have_perf)?;
    crate::bench_saturated::run(inputs, have_perf)?;
    crate::bench_churn::run(inputs)?;
    crate::bench_node::run(inputs)?;
    crate::bench_names::run(inputs)?;
    crate::bench_naming::run(inputs, have_perf)?;
    if !have_perf {
        println!("\nbench: perf is not installed (apt-get install linux-perf): no comparison row");
    }
    println!(
        "\nbench: bcc's `profile` is not compared: it compiles its BPF at run time and needs kernel headers, which this kernel (no CONFIG_IKHEADERS) does not ship"
    );
    Ok(())
}

/// The main table: the CPU-bound workload alone and under each profiler
/// (interleaved rounds), with each profiler's own CPU, RSS and BPF time.
fn cpu_table(inputs: &BenchInputs<'_>, have_perf: bool) -> anyhow::Result<()> {
    let threads = thread::available_parallelism().map_or(2, |n| n.get());
    let modes: Vec<Mode> = [
        Mode::Baseline,
        Mode::Clrbpf,
        Mode::ClrbpfFramePointers,
        Mode::Perf,
        Mode::Agent,
        Mode::AgentWarm,
        Mode::Perf19,
    ]
    .into_iter()
    .filter(|m| !matches!(m, Mode::Perf | Mode::Perf19) || have_perf)
    .collect();

    println!(
        "bench: CpuBound.dll on .NET 8, {threads} threads, {WORKLOAD_SECONDS} s per run, {ROUNDS} rounds of {} modes",
        modes.len()
    );
    let mut runs: Vec<(Mode, ProfilerRun)> = Vec::new();
    for round in 1..=ROUNDS {
        // Every other round runs frame pointers before DWARF: on this VM
        // what ran just before a run moves its BPF time (of two DWARF/FP
        // pairs run back to back, the second had the higher ratio in 11
        // of 12 rounds, whichever build ran first), which a fixed order
        // would book against one mode.
        let mut order = modes.clone();
        if round % 2 == 0
            && let Some(i) = order.iter().position(|&m| m == Mode::Clrbpf)
            && order.get(i + 1) == Some(&Mode::ClrbpfFramePointers)
        {
            order.swap(i, i + 1);
        }
        for &mode in &order {
            let run = run_profiled(inputs, mode, threads)
                .with_context(|| format!("round {round}, {}", mode.name()))?;
            println!(
                "bench: round {round} {:<26} {:>14.0} ops/s",
                mode.name(),
                run.ops
            );
            runs.push((mode, run));
        }
    }

    let of = |mode: Mode| runs.iter().filter(move |(m, _)| *m == mode).map(|(_, r)| r);
    let baseline = median(&mut of(Mode::Baseline).map(|r| r.ops).collect::<Vec<_>>());

    println!();
    println!("| measure | value | budget |");
    println!("| --- | --- | --- |");
    println!("| workload throughput, no profiler (median ops/s) | {baseline:.0} | |");
    for &mode in modes.iter().filter(|m| **m != Mode::Baseline) {
        let ops = median(&mut of(mode).map(|r| r.ops).collect::<Vec<_>>());
        let loss = 100.0 * (1.0 - ops / baseline);
        let cpu_share = median(
            &mut of(mode)
                .map(|r| 100.0 * r.usage.cpu.as_secs_f64() / r.wall.as_secs_f64())
                .collect::<Vec<_>>(),
        );
        let rss = median(
            &mut of(mode)
                .map(|r| r.usage.max_rss_kib as f64 / 1024.0)
                .collect::<Vec<_>>(),
        );
        let budget = match mode {
            _ if mode.clrbpf_flags().is_some() => "<= 1%",
            Mode::Agent | Mode::AgentWarm => "<= 0.5%",
            _ => "",
        };
        println!(
            "| throughput loss under {} | {loss:.2}% | {budget} |",
            mode.name()
        );
        let cpu_budget = if mode == Mode::Agent {
            "<= 1% of one core"
        } else {
            ""
        };
        println!(
            "| {} own CPU (user+sys, % of one core) | {cpu_share:.2}% | {cpu_budget} |",
            mode.name()
        );
        if matches!(mode, Mode::Agent | Mode::AgentWarm) {
            // What the agent took while the workload ran: its start and
            // the new process's attach, or (warm) the attach alone.
            let in_workload = median(
                &mut of(mode)
                    .filter_map(|r| r.cpu_in_workload)
                    .map(|s| 1000.0 * s)
                    .collect::<Vec<_>>(),
            );
            println!(
                "| {} own CPU while the workload ran (median) | {in_workload:.0} ms | |",
                mode.name()
            );
        }
        let rss_budget = if matches!(mode, Mode::Clrbpf | Mode::Agent) {
            "<= 100 MiB"
        } else {
            ""
        };
        println!("| {} peak RSS | {rss:.1} MiB | {rss_budget} |", mode.name());
        let mut per_sample: Vec<f64> = of(mode)
            .filter_map(|r| Some(1e6 * r.usage.cpu.as_secs_f64() / r.samples?.max(1) as f64))
            .collect();
        if !per_sample.is_empty() {
            println!(
                "| {} own CPU per sample (median) | {:.1} us | |",
                mode.name(),
                median(&mut per_sample)
            );
        }
    }
    // The direct cost, which the machine's noise does not blur: clrbpf's
    // own CPU plus the kernel time of its BPF program, as a share of all
    // CPUs over the run.
    for mode in [Mode::Clrbpf, Mode::ClrbpfFramePointers] {
        let mut direct: Vec<f64> = of(mode)
            .filter_map(|r| {
                let bpf_s = r.bpf_us_per_sample? * r.samples? as f64 / 1e6;
                Some(
                    100.0 * (r.usage.cpu.as_secs_f64() + bpf_s)
                        / (r.wall.as_secs_f64() * threads as f64),
                )
            })
            .collect();
        if !direct.is_empty() {
            println!(
                "| {} direct cost (own CPU + BPF time, % of all {threads} CPUs, median) | {:.2}% | <= 1% |",
                mode.name(),
                median(&mut direct)
            );
        }
    }
    bpf_time_rows(&runs);
    unwind_memory_rows(inputs, &runs)?;
    Ok(())
}

/// BPF time per on-CPU sample (kernel BPF stats: run time / run count of
/// `on_cpu_sample`) with DWARF unwinding and with frame pointers only, and
/// their ratio per round (both modes of a round ran back to back).
fn bpf_time_rows(runs: &[(Mode, ProfilerRun)]) {
    let of = |mode: Mode| -> Vec<f64> {
        runs.iter()
            .filter(|(m, _)| *m == mode)
            .filter_map(|(_, r)| r.bpf_us_per_sample)
            .collect()
    };
    let (dwarf, fp) = (of(Mode::Clrbpf), of(Mode::ClrbpfFramePointers));
    for (name, mut values, budget) in [
        // No absolute budget: these machines differ several-fold in
        // speed; the ratio below is the verdict.
        ("DWARF unwinding, the default", dwarf.clone(), ""),
        ("--frame-pointers-only", fp.clone(), ""),
    ] {
        if values.is_empty() {
            println!(
                "| BPF time per on-CPU sample, {name} (kernel BPF stats) | unavailable | {budget} |"
            );
        } else {
            println!(
                "| BPF time per on-CPU sample, {name} (kernel BPF stats, median of {}) | {:.2} us | {budget} |",
                values.len(),
                median(&mut values)
            );
        }
    }
    let mut ratios: Vec<f64> = dwarf.iter().zip(&fp).map(|(d, f)| d / f).collect();
    if !ratios.is_empty() {
        // Each round's ratio too: on a noisy machine the spread says more
        // than one median.
        let rounds: Vec<String> = ratios.iter().map(|r| format!("{r:.2}x")).collect();
        println!(
            "| BPF time per sample, DWARF / frame pointers (same round, median; rounds: {}) | {:.2}x | <= 1.2x |",
            rounds.join(", "),
            median(&mut ratios)
        );
    }
}

/// Kernel memory of the unwind tables: for the whole host (the `-a` rounds)
/// and for one .NET process profiled alone.
fn unwind_memory_rows(
    inputs: &BenchInputs<'_>,
    runs: &[(Mode, ProfilerRun)],
) -> anyhow::Result<()> {
    let host: Vec<UnwindSummary> = runs
        .iter()
        .filter(|(m, _)| *m == Mode::Clrbpf)
        .filter_map(|(_, r)| r.unwind)
        .collect();
    let mut mib: Vec<f64> = host.iter().map(|u| u.table_mib).collect();
    if let Some(last) = host.last() {
        println!(
            "| unwind tables, whole host (-a; median; last round: {} files, {} processes) | {:.1} MiB | |",
            last.files,
            last.processes,
            median(&mut mib)
        );
    }
    let out = Command::new(inputs.clrbpf)
        .args(["record", "-v", "-F", "99", "-o"])
        .arg(inputs.scratch.join("one.pb.gz"))
        .arg("--")
        .arg(inputs.dotnet8)
        .arg(inputs.workloads.join("net8").join("CpuBound.dll"))
        .args(["3", "1"])
        .stdin(Stdio::null())
        .output()
        .context("profile one .NET process")?;
    match UnwindSummary::parse(&String::from_utf8_lossy(&out.stderr)) {
        Some(u) => println!(
            "| unwind tables, one .NET 8 process (CpuBound.dll, {} files) | {:.1} MiB | |",
            u.files, u.table_mib
        ),
        None => println!("| unwind tables, one .NET 8 process | unavailable | |"),
    }
    Ok(())
}

/// CLR events: intake rate of the nettrace parser and decoders on a real
/// capture, and the target's exception throughput with and without the
/// EventPipe session (interleaved rounds, medians).
fn clr_benches(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    let fixture = inputs
        .repo_root
        .join("profiler-parse/src/nettrace/testdata/net8.nettrace.gz");
    let out = Command::new(inputs.micro_benches)
        .args(["clr-intake", "--file"])
        .arg(&fixture)
        .output()
        .context("run the clr-intake bench")?;
    let line = String::from_utf8_lossy(&out.stdout);
    let rate = line
        .split("median ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or("?");
    println!(
        "| CLR event intake, parse + decode (median, one core) | {rate} events/s | >= 200000 events/s |"
    );

    exception_storm(inputs)?;
    crate::bench_alloc_storm::run(inputs)
}

/// How the exception storm runs in [`exception_storm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StormMode {
    Alone,
    /// `record`, every exception event with its stack.
    Record,
    /// `record --exceptions-per-second 200`.
    RecordBudget,
    /// `clrbpf agent` with its defaults (CLR events on, 200 exceptions/s).
    Agent,
}

impl StormMode {
    const ALL: [Self; 4] = [Self::Alone, Self::Record, Self::RecordBudget, Self::Agent];

    fn name(self) -> &'static str {
        match self {
            Self::Alone => "no profiler",
            Self::Record => "clrbpf record, CLR events on",
            Self::RecordBudget => "clrbpf record --exceptions-per-second 200",
            Self::Agent => "clrbpf agent (defaults: CLR events on, 200 exceptions/s)",
        }
    }
}

/// Exceptions the storm throws (three types, 1000000 + 300 + 1).
const STORM: [&str; 3] = ["1000000", "300", "1"];
/// Seconds before the storm starts: `record` attaches as the runtime
/// starts, the agent looks for new .NET processes every 5 s.
const STORM_DELAY: &str = "3";
const STORM_DELAY_AGENT: &str = "8";

/// The target's exception throughput alone, under `record` with every
/// exception event, under `record` with the budget, and under the agent
/// (interleaved rounds, medians), with the exception totals each profile
/// holds against the workload's own count.
fn exception_storm(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    let dll = inputs.workloads.join("net8").join("Exceptions.dll");
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); StormMode::ALL.len()];
    let mut totals: Vec<Option<(u64, u64)>> = vec![None; StormMode::ALL.len()];
    for round in 1..=ROUNDS {
        for (i, &mode) in StormMode::ALL.iter().enumerate() {
            let (rate, total) = storm_run(inputs, &dll, mode)
                .with_context(|| format!("exception storm, round {round}, {}", mode.name()))?;
            println!(
                "bench: storm round {round} {:<58} {rate:>8.0} throws/s",
                mode.name()
            );
            rates[i].push(rate);
            if total.is_some() {
                totals[i] = total;
            }
        }
    }
    let baseline = median(&mut rates[0].clone());
    for (i, &mode) in StormMode::ALL.iter().enumerate() {
        let m = median(&mut rates[i]);
        let exact = match totals[i] {
            Some((profile, thrown)) if profile == thrown => {
                format!(", {profile} exceptions: exact")
            }
            Some((profile, thrown)) => format!(", {profile} exceptions of {thrown} thrown"),
            None => String::new(),
        };
        let budget = if mode == StormMode::Agent {
            "<= 10% loss"
        } else {
            ""
        };
        println!(
            "| exception storm (1M throws), {} (median throws/s) | {m:.0} ({:+.1}%{exact}) | {budget} |",
            mode.name(),
            100.0 * (m / baseline - 1.0)
        );
    }
    Ok(())
}

/// One storm: its throws per second, and (profiled) the exceptions the
/// profile holds next to those the workload threw.
fn storm_run(
    inputs: &BenchInputs<'_>,
    dll: &Path,
    mode: StormMode,
) -> anyhow::Result<(f64, Option<(u64, u64)>)> {
    let profile = inputs.scratch.join("storm.pb.gz");
    let agent_dir = inputs.scratch.join("storm-agent");
    let _ = fs::remove_dir_all(&agent_dir);
    let mut agent = None;
    let mut cmd = match mode {
        StormMode::Alone | StormMode::Agent => Command::new(inputs.dotnet8),
        StormMode::Record | StormMode::RecordBudget => {
            let mut c = Command::new(inputs.clrbpf);
            c.args(["record", "-q", "-o"]).arg(&profile);
            if mode == StormMode::RecordBudget {
                c.args(["--exceptions-per-second", "200"]);
            }
            c.arg("--").arg(inputs.dotnet8);
            c
        }
    };
    if mode == StormMode::Agent {
        agent = Some(spawn_agent(
            inputs,
            &agent_dir,
            17000,
            &["--upload-interval", "5s"],
        )?);
        thread::sleep(PROFILER_WARMUP);
    }
    let delay = if mode == StormMode::Agent {
        STORM_DELAY_AGENT
    } else {
        STORM_DELAY
    };
    let out = cmd
        .arg(dll)
        .arg(delay)
        .args(STORM)
        .stdin(Stdio::null())
        .output()
        .context("run the exception storm")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let value = |key: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
    };
    let rate = value("THROWS_PER_S ").context("the storm printed no THROWS_PER_S")?;
    let thrown = [
        "THROWN_System.InvalidOperationException ",
        "THROWN_System.ArgumentException ",
        "THROWN_System.TimeoutException ",
    ]
    .iter()
    .filter_map(|k| value(k))
    .sum::<f64>() as u64;
    let files: Vec<PathBuf> = match agent {
        Some(mut agent) => {
            // Let it see the exit and take the last events, then close its
            // window.
            thread::sleep(Duration::from_secs(2));
            // SAFETY: kill has no memory preconditions; the pid is our child's.
            unsafe { libc::kill(agent.id() as libc::pid_t, libc::SIGTERM) };
            agent.wait().context("wait for the agent")?;
            fs::read_dir(&agent_dir)
                .map(|dir| {
                    dir.filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|p| p.to_string_lossy().contains(".exception."))
                        .collect()
                })
                .unwrap_or_default()
        }
        None if mode == StormMode::Alone => Vec::new(),
        None => vec![profile],
    };
    let total = (!files.is_empty())
        .then(|| exceptions_in(&files))
        .flatten()
        .map(|n| (n, thrown));
    Ok((rate, total))
}

/// The exceptions/count total of profiles, as `go tool pprof` reads them.
fn exceptions_in(files: &[PathBuf]) -> Option<u64> {
    let out = Command::new("go")
        .args([
            "tool",
            "pprof",
            "-sample_index=exceptions",
            "-top",
            "-nodecount=1",
        ])
        .args(files)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("Total samples = ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `clrbpf agent` at its defaults plus `extra`, its windows in `windows`,
/// on a loopback port of its own (`port_base` + this process's pid modulo
/// 1000), quiet.
pub fn spawn_agent(
    inputs: &BenchInputs<'_>,
    windows: &Path,
    port_base: u32,
    extra: &[&str],
) -> anyhow::Result<Child> {
    Command::new(inputs.clrbpf)
        .arg("agent")
        .args(extra)
        .arg("--output-dir")
        .arg(windows)
        .args([
            "--listen",
            &format!("127.0.0.1:{}", port_base + std::process::id() % 1000),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start clrbpf agent")
}

/// Where bench keeps its scratch files.
pub fn scratch_dir(target: &Path) -> PathBuf {
    target.join("bench")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_bpf_time_of_a_summary() {
        let stderr = "clrbpf: recorded 1186 samples from 9 processes, 0 lost\n\
                      clrbpf: BPF time per sample 9.35 us\n";
        assert_eq!(bpf_us_per_sample_of(stderr), Some(9.35));
        assert_eq!(bpf_us_per_sample_of("clrbpf: recorded 3 samples\n"), None);
    }

    #[test]
    fn cpu_seconds_of_a_live_process_and_of_none() {
        // Burn a little CPU so the figure is more than zero ticks.
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(50) {
            std::hint::black_box(started.elapsed());
        }
        let own = cpu_seconds(std::process::id()).expect("our own /proc/PID/stat");
        assert!(own > 0.0 && own < 3600.0, "{own}");
        // Above the kernel's pid_max: never a process.
        assert_eq!(cpu_seconds(u32::MAX), None);
    }

    #[test]
    fn unwind_summary_line() {
        let stderr = "clrbpf: BPF time per sample 2.10 us\n\
            clrbpf: unwind tables 7.3 MiB in 19 files, 5 processes indexed (cap 64 MiB); 589 user stacks walked with them, 461 by frame pointers (process not indexed yet); walks ended early: none\n";
        assert_eq!(
            UnwindSummary::parse(stderr),
            Some(UnwindSummary {
                table_mib: 7.3,
                files: 19,
                processes: 5
            })
        );
        assert_eq!(UnwindSummary::parse("clrbpf: unwind tables ? MiB"), None);
        assert_eq!(UnwindSummary::parse(""), None);
    }
}
