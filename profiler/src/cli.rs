//! Command-line interface: clap definitions only. `main.rs` turns these into
//! the library's configuration and runs it.

use std::{ffi::OsString, path::PathBuf};

use clap::{Parser, Subcommand};

use crate::export::{frame_names::FrameNames, output::OutputFormat};

/// clrbpf: whole-host CPU profiles of .NET (and everything else) on Linux,
/// with kernel, native and managed frames, without restarting anything.
#[derive(Debug, Parser)]
#[command(name = "clrbpf", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// Log level for diagnostics on stderr (error, warn, info, debug, trace).
    #[arg(long, global = true, default_value = "warn", env = "CLRBPF_LOG")]
    pub log_level: String,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Record a CPU profile of the host, some processes, or a command.
    ///
    /// With no -p and no COMMAND: every process on the host, until Ctrl-C.
    /// With -p: those processes (all their threads), until they all exit.
    /// With -- COMMAND: runs it (as the invoking user under sudo) with
    /// DOTNET_PerfMapEnabled=1, profiles it and every process it starts, and
    /// stops when it exits.
    Record(RecordArgs),
    /// List the .NET processes on this host.
    Ps,
    /// Report the kernel features clrbpf uses.
    SystemInfo,
    /// Time loading a perf map of N entries (for `cargo xtask bench`).
    #[command(hide = true)]
    BenchPerfMap {
        #[arg(long, default_value_t = 100_000)]
        entries: usize,
        #[arg(long, default_value_t = 11)]
        runs: usize,
    },
    /// Time parsing and decoding a nettrace capture (gzip or raw), repeated
    /// COPIES times, on one core (for `cargo xtask bench`).
    #[command(hide = true)]
    BenchClrIntake {
        #[arg(long)]
        file: PathBuf,
        #[arg(long, default_value_t = 200)]
        copies: usize,
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
}

#[derive(Debug, clap::Args)]
pub struct RecordArgs {
    /// Profile this process (repeatable); stops when all of them exit.
    #[arg(short = 'p', long = "pid", value_name = "PID")]
    pub pids: Vec<u32>,

    /// Profile the whole host as well as the given COMMAND or -p processes.
    #[arg(short = 'a', long = "all-cpus")]
    pub all: bool,

    /// Samples per second on each CPU.
    #[arg(short = 'F', long = "frequency", value_name = "HZ", default_value_t = 99,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub frequency: u64,

    /// Stop after this many seconds.
    #[arg(short = 'd', long = "duration", value_name = "SECONDS")]
    pub duration: Option<f64>,

    /// Where to write the profile. The format follows the extension
    /// (.pb.gz pprof, .folded/.collapsed folded stacks, .svg flame graph)
    /// unless --format is given.
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        default_value = "profile.pb.gz"
    )]
    pub output: PathBuf,

    /// Output format.
    #[arg(long, value_enum)]
    pub format: Option<OutputFormat>,

    /// How managed (.NET) frames are named in every output format: short
    /// `Namespace.Type.Method` (the full signature with its JIT tier is the
    /// pprof system_name, the assembly its filename), or the runtime's full
    /// signature `int64 [App] App.Worker::Spin(int64)`.
    #[arg(long, value_enum, value_name = "FORM", default_value = "short")]
    pub frame_names: FrameNames,

    /// Keep the perf map and jitdump files clrbpf made a running .NET
    /// process write (by default they are removed when recording ends).
    #[arg(long)]
    pub keep_perf_maps: bool,

    /// Do not ask running .NET 8+ processes to write perf maps (their JIT
    /// frames stay unnamed unless they already write them).
    #[arg(long)]
    pub no_perf_map_attach: bool,

    /// Walk user stacks by frame pointers only: native code built without
    /// them (glibc, most distribution binaries) then loses frames. By
    /// default they are walked in the kernel with unwind tables built from
    /// each file's `.eh_frame`.
    #[arg(long, visible_alias = "no-dwarf-unwind")]
    pub frame_pointers_only: bool,

    /// Accepted for scripts written when DWARF unwinding was opt-in; it is
    /// the default now.
    #[arg(long, hide = true, conflicts_with = "frame_pointers_only")]
    pub dwarf_unwind: bool,

    /// Kernel memory reserved for unwind tables (unless
    /// --frame-pointers-only),
    /// allocated in full when recording starts (24 bytes per table row;
    /// the least-recently-used tables are evicted when it is full).
    #[arg(long, value_name = "MB", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub unwind_table_memory_mb: u64,

    /// CLR events to collect from .NET processes over EventPipe, as extra
    /// sample types in the profile: contention (contentions/count,
    /// delay/nanoseconds, with the lock owner on .NET 8+), exceptions
    /// (exceptions/count, by exception.type), waits (.NET 9+). Sampled per
    /// minute, with exact totals.
    #[arg(
        long,
        value_name = "KINDS",
        default_value = "contention,exceptions,waits",
        conflicts_with = "no_clr_events"
    )]
    pub clr_events: String,

    /// No EventPipe session: CPU samples only.
    #[arg(long)]
    pub no_clr_events: bool,

    /// Write one file per kind: <stem>.cpu.pb.gz, <stem>.contention.pb.gz,
    /// <stem>.exceptions.pb.gz.
    #[arg(long)]
    pub split: bool,

    /// Also record off-CPU time: where the profiled threads block (locks,
    /// sleeps, I/O, page faults), for how long, and who woke them. Adds the
    /// sample types off_cpu/nanoseconds (the stack at the moment a thread
    /// blocked, labelled wait.kind) and wakeup/nanoseconds (the waker's
    /// stack on top of the blocked one, as bcc's offwaketime).
    #[arg(long)]
    pub off_cpu: bool,

    /// Off-CPU intervals at least this long (milliseconds) are all kept;
    /// shorter ones are sampled with probability interval/min and weighted
    /// min, so totals stay exact on average while the records stay few.
    #[arg(long, value_name = "MS", default_value_t = 1.0)]
    pub off_cpu_min: f64,

    /// Most stacks taken per CPU per second when threads block (each costs
    /// a stack walk in the kernel, a few microseconds). Above it, stacks are
    /// taken at random with the probability that keeps to it, and the waits
    /// that have one are upscaled by its inverse; every wait still counts in
    /// the exact per-thread totals.
    #[arg(long, value_name = "N", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(10..=1_000_000))]
    pub off_cpu_max_stacks: u64,

    /// Wall time: a wall/nanoseconds sample type with each thread's CPU
    /// plus off-CPU time, the view that shows where a thread's whole time
    /// went (implies --off-cpu; shown first by pprof viewers).
    #[arg(long)]
    pub wall: bool,

    /// clrbpf raises its own priority so that it keeps up, and loses no
    /// samples, on the saturated hosts where a profile is most needed: the
    /// loop that drains the samples runs SCHED_RR (priority 1; it sleeps
    /// most of the time), its background threads (unwind tables, CLR
    /// sessions) at this nice value. Needs CAP_SYS_NICE (root has it);
    /// without it clrbpf warns and runs as started.
    #[arg(long, value_name = "N", default_value_t = -10, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub nice: i32,

    /// Keep clrbpf's scheduling priority as it was started.
    #[arg(long, conflicts_with = "nice")]
    pub no_priority_boost: bool,

    /// No progress line and no summary.
    #[arg(short, long)]
    pub quiet: bool,

    /// The command to run and profile.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn record_parses_perf_like_arguments() {
        let cli = Cli::try_parse_from([
            "clrbpf", "record", "-p", "1", "-p", "2", "-F", "499", "-d", "2.5", "-o", "x.svg",
            "--", "dotnet", "a.dll",
        ])
        .expect("valid arguments");
        let Command::Record(args) = cli.command else {
            panic!("not record")
        };
        assert_eq!(args.pids, vec![1, 2]);
        assert_eq!(args.frequency, 499);
        assert_eq!(args.duration, Some(2.5));
        assert_eq!(
            args.command,
            vec![OsString::from("dotnet"), OsString::from("a.dll")]
        );
        assert_eq!(args.frame_names, FrameNames::Short);
        assert!(Cli::try_parse_from(["clrbpf", "record", "-F", "0"]).is_err());
        let cli = Cli::try_parse_from(["clrbpf", "record", "--frame-names", "full"])
            .expect("valid arguments");
        let Command::Record(args) = cli.command else {
            panic!("not record")
        };
        assert_eq!(args.frame_names, FrameNames::Full);
    }
}
