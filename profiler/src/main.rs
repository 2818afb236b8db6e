//! The `clrbpf` binary: parse arguments, build the configuration, run, map
//! errors to an exit code.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use clrbpf::{
    cli::{Cli, Command, LogFormat, RecordArgs},
    pipeline::summary::print_summary,
    record::{RecordConfig, Report, record},
};

fn main() -> ExitCode {
    return_freed_memory_promptly();
    let cli = Cli::parse();
    let log_format = cli.log_format;
    if let Err(err) = init_logging(&cli.log_level, log_format) {
        eprintln!("clrbpf: error: {err:#}");
        return ExitCode::from(2);
    }
    clrbpf::memory_budget::configure(clrbpf::memory_budget::MemoryBudget::from_mb(
        cli.memory_budget_mb,
    ));
    match run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            if log_format == LogFormat::Json {
                // A log collector keeps the reason with the other lines.
                tracing::error!(error = format!("{err:#}"), "clrbpf exits");
            } else {
                eprintln!("clrbpf: error: {err:#}");
            }
            ExitCode::from(2)
        }
    }
}

/// Diagnostics on stderr: the filter `--log-level` checked, as text
/// (coloured only on a terminal: `kubectl logs` and files get no escape
/// codes) or one JSON object per line.
fn init_logging(filter: &str, format: LogFormat) -> anyhow::Result<()> {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .with_context(|| format!("--log-level {filter}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_ansi(false)
            .init(),
    }
    Ok(())
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
        Command::Record(args) => run_record(*args),
        Command::Agent(args) => run_agent(*args).map(|()| ExitCode::SUCCESS),
        Command::Ps(args) => {
            run_ps(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::SystemInfo => {
            // 1 when it will not work, so a script or an init container can
            // stop there.
            let works = clrbpf::bpf::system::print_system_info(std::io::stdout().lock())
                .context("write")?;
            Ok(if works {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}

/// `clrbpf ps`: the table (or JSON) on stdout; what could not be seen, on
/// stderr, with success: a partial list is still the right answer.
fn run_ps(args: &clrbpf::cli::PsArgs) -> anyhow::Result<()> {
    use clrbpf::ps::{UserNames, list_dotnet_processes, print_ps_json, print_ps_table};
    let listing = list_dotnet_processes(&clrbpf::process::ProcFs::default());
    let users = UserNames::from_host();
    let out = std::io::stdout().lock();
    if args.json {
        print_ps_json(&listing, &users, out).context("write the process list")?;
    } else {
        print_ps_table(&listing.rows, &users, out).context("write the process table")?;
    }
    if let Some(note) = listing.hidden_note() {
        eprintln!("clrbpf: note: {note}");
    }
    Ok(())
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

fn run_record(args: RecordArgs) -> anyhow::Result<ExitCode> {
    let config = RecordConfig::from_args(args)?;
    let (output, report) = (config.output.clone(), config.report);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the runtime")?;
    let summary = runtime.block_on(record(config))?;
    if report != Report::Quiet {
        let verbose = report == Report::Verbose;
        print_summary(&summary, &output, verbose, std::io::stderr().lock())
            .context("write the summary")?;
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
