//! The `clrbpf` binary: parse arguments, build the configuration, run, map
//! errors to an exit code.

use std::{process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::Parser as _;
use clrbpf::{
    bpf::OffCpuConfig,
    cli::{Cli, Command, RecordArgs},
    clr::session::ClrEventKinds,
    export::output::OutputFormat,
    pipeline::summary::print_summary,
    record::{RecordConfig, record},
};

fn main() -> ExitCode {
    return_freed_memory_promptly();
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    clrbpf::memory_budget::configure(clrbpf::memory_budget::MemoryBudget::from_mb(
        cli.memory_budget_mb,
    ));
    match run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("clrbpf: error: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// clrbpf reads whole files of several MiB to build unwind tables (a
/// ReadyToRun framework image is 10-30 MiB) and frees them at once. glibc's
/// adaptive threshold would soon serve such buffers from the heap, where
/// what is freed stays resident between live allocations: under process
/// churn that grew RSS by a third in a minute. A fixed threshold keeps
/// every buffer of 256 KiB or more in a mapping of its own, returned to the
/// kernel when freed.
fn return_freed_memory_promptly() {
    // SAFETY: mallopt only changes the allocator's tuning; it is called
    // before any thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
}

/// The exit code of `clrbpf`: that of the command `record` ran, when it ran
/// one (as `time`, `perf record` and `strace` do), else success.
fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Record(args) => run_record(args),
        Command::Agent(args) => run_agent(*args).map(|()| ExitCode::SUCCESS),
        Command::Ps => {
            let procfs = clrbpf::process::ProcFs::default();
            let rows = clrbpf::process::ps::dotnet_processes(&procfs);
            clrbpf::process::ps::print_ps_table(&rows, std::io::stdout().lock())
                .context("write the process table")?;
            Ok(ExitCode::SUCCESS)
        }
        Command::SystemInfo => {
            clrbpf::bpf::system::print_system_info(std::io::stdout().lock()).context("write")?;
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchClrIntake { file, copies, runs } => {
            bench_clr_intake(&file, copies, runs)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchPerfMap { entries, runs } => {
            let mut times: Vec<Duration> = (0..runs.max(1))
                .map(|_| clrbpf::symbolize::bench_perf_map_load(entries))
                .collect();
            times.sort();
            println!(
                "perf map load, {entries} entries: median {:.2} ms over {} runs",
                times[times.len() / 2].as_secs_f64() * 1e3,
                times.len()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn run_agent(args: clrbpf::cli::AgentArgs) -> anyhow::Result<()> {
    // Checked first, so a malformed configuration is refused at start
    // with the option's name.
    let host_name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned());
    let config = clrbpf::agent::config::AgentConfig::from_args(args, host_name)?;
    tracing::debug!(?config, "agent configuration");
    clrbpf::agent::install_tls_provider();
    // One worker for the HTTP endpoint and the uploads; the sampling loop
    // runs on this thread.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("start the runtime")?;
    runtime.block_on(clrbpf::agent::run::run(config))
}

/// Longest `--off-cpu-min` (the kernel side's keep rule takes up to 2^32 ns).
const MAX_OFF_CPU_MIN_MS: f64 = 4000.0;
/// Longest `--duration`: about ten years; for longer, leave it out and stop
/// with Ctrl-C.
const MAX_DURATION_SECONDS: f64 = 315_360_000.0;

fn run_record(args: RecordArgs) -> anyhow::Result<ExitCode> {
    let RecordArgs {
        pids,
        all,
        frequency,
        duration,
        output,
        format,
        frame_names,
        keep_perf_maps,
        no_perf_map_attach,
        frame_pointers_only,
        dwarf_unwind: _,
        unwind_table_memory_mb,
        cache_dir,
        no_cache,
        clr_events,
        no_clr_events,
        exceptions_per_second,
        split,
        off_cpu,
        off_cpu_min,
        off_cpu_max_stacks,
        wall,
        nice,
        no_priority_boost,
        start_wait,
        quiet,
        command,
    } = args;
    if !(off_cpu_min.is_finite() && off_cpu_min > 0.0 && off_cpu_min <= MAX_OFF_CPU_MIN_MS) {
        anyhow::bail!("--off-cpu-min must be more than 0 and at most {MAX_OFF_CPU_MIN_MS} ms");
    }
    // --wall is CPU plus off-CPU time: it turns off-CPU on.
    let off_cpu = (off_cpu || wall).then_some(OffCpuConfig {
        min_ns: (off_cpu_min * 1e6) as u64,
        max_stacks_per_cpu_second: off_cpu_max_stacks,
    });
    let clr_events = if no_clr_events {
        ClrEventKinds::NONE
    } else {
        ClrEventKinds::parse(&clr_events).map_err(|e| anyhow::anyhow!("--clr-events: {e}"))?
    };
    let format = match format.or_else(|| OutputFormat::from_path(&output)) {
        Some(format) => format,
        None => anyhow::bail!(
            "cannot tell the output format from {}: use an extension (.pb.gz, .folded, .svg) or --format",
            output.display()
        ),
    };
    let duration = match duration {
        Some(d) if !(d.is_finite() && d > 0.0) => {
            anyhow::bail!("--duration must be a positive number of seconds")
        }
        Some(d) if d > MAX_DURATION_SECONDS => anyhow::bail!(
            "--duration {d} is longer than {MAX_DURATION_SECONDS} seconds (ten years): leave it out to record until Ctrl-C"
        ),
        d => d.map(Duration::from_secs_f64),
    };
    let config = RecordConfig {
        pids,
        all,
        frequency_hz: frequency,
        duration,
        output: output.clone(),
        format,
        frame_names,
        keep_perf_maps,
        perf_map_attach: !no_perf_map_attach,
        dwarf_unwind: !frame_pointers_only,
        unwind_table_memory_bytes: unwind_table_memory_mb << 20,
        unwind_cache_dir: (!no_cache).then_some(cache_dir),
        command,
        verbose: !quiet,
        clr_events,
        exceptions_per_second: exceptions_per_second.filter(|&n| n > 0),
        split,
        off_cpu,
        wall,
        nice: (!no_priority_boost).then_some(nice),
        start_wait: Duration::from_secs_f64(start_wait),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the runtime")?;
    let summary = runtime.block_on(record(config))?;
    if !quiet {
        print_summary(&summary, &output, std::io::stderr().lock()).context("write the summary")?;
    }
    Ok(summary.command_status.map_or(ExitCode::SUCCESS, |status| {
        ExitCode::from(exit_code_of(status))
    }))
}

/// A command's status as a shell reports it: its exit code, or 128 + N
/// when signal N ended it.
fn exit_code_of(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(signal)) => (128 + signal).clamp(0, 255) as u8,
        (None, None) => 1,
    }
}

fn bench_clr_intake(file: &std::path::Path, copies: usize, runs: usize) -> anyhow::Result<()> {
    use std::io::Read as _;
    let raw = std::fs::read(file).with_context(|| format!("read {}", file.display()))?;
    let capture = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .with_context(|| format!("gunzip {}", file.display()))?;
        out
    } else {
        raw
    };
    let stream = clrbpf::clr::nettrace::replicate_nettrace(&capture, copies.max(1))
        .with_context(|| format!("replicate {}", file.display()))?;
    let mut rates = Vec::new();
    let mut events = 0;
    for _ in 0..runs.max(1) {
        let (n, elapsed) = clrbpf::clr::nettrace::bench_clr_event_intake(&stream);
        events = n;
        rates.push(n as f64 / elapsed.as_secs_f64().max(1e-9));
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "clr event intake: median {:.0} events/s over {} runs of {events} events, one core",
        rates[rates.len() / 2],
        rates.len()
    );
    Ok(())
}
