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

    /// Memory that profiled processes can make clrbpf hold, in MiB: their
    /// mapping tables, the parts of their files read for unwind tables,
    /// their managed symbols and EventPipe streams, each a share of it.
    /// What would go over is dropped, counted in the summary and on
    /// /metrics, and warned about once per process. Keep it under the
    /// agent's container memory limit (the chart does).
    #[arg(long, global = true, value_name = "MB",
          default_value_t = crate::memory_budget::DEFAULT_MEMORY_BUDGET_MB,
          value_parser = clap::value_parser!(u64).range(32..=65_536))]
    pub memory_budget_mb: u64,

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
    Record(Box<RecordArgs>),
    /// Profile continuously and ship one profile per service every
    /// interval to Pyroscope, an OpenTelemetry collector or a directory;
    /// serve metrics (with .NET runtime metrics) and health on --listen.
    ///
    /// Runs until SIGTERM or SIGINT, then ships the last window (within
    /// --grace-period) and exits 0. SIGHUP is ignored: nothing is reloaded.
    Agent(Box<AgentArgs>),
    /// List the .NET processes on this host.
    Ps,
    /// Report the kernel features clrbpf uses.
    SystemInfo,
}

/// Options of `clrbpf agent`. Durations are written `500ms`, `10s`, `1m`,
/// `24h`; sizes `500MB`, `2GiB` or bytes.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Sampling")]
pub struct AgentArgs {
    /// Samples per second on each CPU.
    #[arg(short = 'F', long = "frequency", value_name = "HZ", default_value_t = 19,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub frequency: u64,

    /// How often a window is cut and shipped, aligned to the wall clock
    /// (5s to 5m).
    #[arg(long, value_name = "DURATION", default_value = "15s",
          value_parser = parse_upload_interval)]
    pub upload_interval: std::time::Duration,

    /// Exception events taken with their stacks per second and process at
    /// most. The runtime walks a stack for each one it sends; above this
    /// rate it is told to stop sending them for a back-off (10s, doubling
    /// up to 5m while the storm lasts), and its exception counter keeps
    /// the totals exact. 0: no limit.
    #[arg(long, value_name = "N", default_value_t = crate::clr::budget::DEFAULT_EXCEPTIONS_PER_SECOND)]
    pub exceptions_per_second: u32,

    /// How often each .NET runtime sends its counters (1s to 60s): the
    /// dotnet_* series, and the exceptions counted while their events are
    /// off. Each reading costs every .NET process some work; a process
    /// that exits within this long of throwing while its exception events
    /// are off loses those throws from its profile (1s keeps nearly all).
    #[arg(long, value_name = "DURATION", default_value = "5s",
          value_parser = parse_runtime_counters_interval)]
    pub runtime_counters_interval: std::time::Duration,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    /// Only processes whose executable name (comm or file name) is NAME
    /// (repeatable). Without any selection option: every process.
    #[arg(long = "exe", value_name = "NAME", help_heading = "Process selection")]
    pub executables: Vec<String>,

    /// Only processes in the container with this id (64 hex digits, or a
    /// unique prefix of at least 12; repeatable).
    #[arg(long = "container-id", value_name = "ID", value_parser = parse_container_id,
          help_heading = "Process selection")]
    pub container_ids: Vec<String>,

    /// Only processes of pods in this Kubernetes namespace (repeatable).
    #[arg(long = "k8s-namespace", value_name = "NAMESPACE", value_parser = parse_k8s_namespace,
          help_heading = "Process selection")]
    pub k8s_namespaces: Vec<String>,

    /// Series (service plus pod labels) shipped per window at most. A
    /// process picks its own service name (OTEL_SERVICE_NAME), so one user
    /// could otherwise flood the backends with new series; over the cap,
    /// the busiest keep their names and the rest are shipped as one
    /// service, clrbpf-overflow (counted, with a warning).
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(2..=100_000),
          help_heading = "Process selection")]
    pub max_services: u64,

    /// Push profiles to Pyroscope (or Grafana Cloud Profiles, or Alloy's
    /// pyroscope.receive_http) at this base URL, e.g. http://pyroscope:4040.
    #[arg(long, value_name = "URL", value_parser = HttpUrlParser,
          help_heading = "Sinks")]
    pub pyroscope_url: Option<String>,

    /// Pyroscope basic-auth user.
    #[arg(
        long,
        value_name = "USER",
        env = "CLRBPF_PYROSCOPE_BASIC_AUTH_USER",
        requires = "pyroscope_url",
        help_heading = "Sinks"
    )]
    pub pyroscope_basic_auth_user: Option<String>,

    /// Pyroscope basic-auth password (prefer the environment variable or
    /// --pyroscope-basic-auth-password-file: a command line is visible to
    /// every user of the host).
    #[arg(
        long,
        value_name = "PASSWORD",
        env = "CLRBPF_PYROSCOPE_BASIC_AUTH_PASSWORD",
        hide_env_values = true,
        requires = "pyroscope_basic_auth_user",
        conflicts_with = "pyroscope_basic_auth_password_file",
        help_heading = "Sinks"
    )]
    pub pyroscope_basic_auth_password: Option<String>,

    /// Read the Pyroscope basic-auth password from this file.
    #[arg(
        long,
        value_name = "FILE",
        requires = "pyroscope_basic_auth_user",
        help_heading = "Sinks"
    )]
    pub pyroscope_basic_auth_password_file: Option<PathBuf>,

    /// Pyroscope bearer token (same caveat as the password).
    #[arg(long, value_name = "TOKEN", env = "CLRBPF_PYROSCOPE_BEARER_TOKEN",
          hide_env_values = true, requires = "pyroscope_url",
          conflicts_with_all = ["pyroscope_bearer_token_file", "pyroscope_basic_auth_user"],
          help_heading = "Sinks")]
    pub pyroscope_bearer_token: Option<String>,

    /// Read the Pyroscope bearer token from this file.
    #[arg(
        long,
        value_name = "FILE",
        requires = "pyroscope_url",
        conflicts_with = "pyroscope_basic_auth_user",
        help_heading = "Sinks"
    )]
    pub pyroscope_bearer_token_file: Option<PathBuf>,

    /// Pyroscope tenant, sent as X-Scope-OrgID.
    #[arg(
        long,
        value_name = "TENANT",
        env = "CLRBPF_PYROSCOPE_TENANT_ID",
        requires = "pyroscope_url",
        help_heading = "Sinks"
    )]
    pub pyroscope_tenant_id: Option<String>,

    /// Export OTLP profiles over HTTP to this base URL (an OpenTelemetry
    /// collector's OTLP/HTTP receiver, e.g. http://otel-collector:4318).
    #[arg(long, value_name = "URL", value_parser = HttpUrlParser,
          help_heading = "Sinks")]
    pub otlp_url: Option<String>,

    /// Write rolling .pb.gz files here. The default sink when no URL is
    /// given (then /var/lib/clrbpf/profiles unless set).
    #[arg(long, value_name = "DIR", help_heading = "Sinks")]
    pub output_dir: Option<PathBuf>,

    /// Remove files of --output-dir older than this.
    #[arg(long, value_name = "DURATION", default_value = "24h",
          value_parser = parse_duration, help_heading = "Sinks")]
    pub retention: std::time::Duration,

    /// Remove the oldest files of --output-dir while they total more.
    #[arg(long, value_name = "SIZE", default_value = "1GiB",
          value_parser = parse_size, help_heading = "Sinks")]
    pub retention_size: u64,

    /// How long the last window may take to ship at shutdown.
    #[arg(long, value_name = "DURATION", default_value = "10s",
          value_parser = parse_duration, help_heading = "Sinks")]
    pub grace_period: std::time::Duration,

    /// Serve /metrics, /healthz, /readyz (and /debug/pprof/profile with
    /// --enable-pull) here. /metrics carries no profile data and needs no
    /// credentials.
    #[arg(
        long,
        value_name = "ADDR:PORT",
        default_value = "127.0.0.1:7071",
        help_heading = "HTTP endpoint"
    )]
    pub listen: std::net::SocketAddr,

    /// Serve /debug/pprof/profile?seconds=N: a profile of the selected
    /// processes on demand. Off by default (404). Needs --http-token-file
    /// unless --listen is a loopback address.
    #[arg(long, help_heading = "HTTP endpoint")]
    pub enable_pull: bool,

    /// Every /debug/pprof/profile request must carry `Authorization:
    /// Bearer TOKEN`, TOKEN being this file's content (401 otherwise).
    #[arg(
        long,
        value_name = "FILE",
        requires = "enable_pull",
        help_heading = "HTTP endpoint"
    )]
    pub http_token_file: Option<PathBuf>,

    /// Longest profile /debug/pprof/profile?seconds=N takes.
    #[arg(long, value_name = "SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=3600),
          help_heading = "HTTP endpoint")]
    pub max_pull_seconds: u64,
}

/// A duration such as `500ms`, `10s`, `1m`, `24h` (humantime syntax).
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let duration = humantime::parse_duration(text.trim())
        .map_err(|error| format!("{error} (write a duration like 500ms, 10s, 1m, 24h)"))?;
    if duration.is_zero() {
        return Err("must be more than zero".to_owned());
    }
    Ok(duration)
}

/// `--start-wait`: seconds from 0 to 600.
fn parse_start_wait(text: &str) -> Result<f64, String> {
    let seconds: f64 = text
        .trim()
        .parse()
        .map_err(|_| "must be a number of seconds".to_owned())?;
    if !(0.0..=600.0).contains(&seconds) {
        return Err("must be from 0 to 600 seconds".to_owned());
    }
    Ok(seconds)
}

/// `--runtime-counters-interval`: whole seconds from 1 to 60.
fn parse_runtime_counters_interval(text: &str) -> Result<std::time::Duration, String> {
    let duration = parse_duration(text)?;
    let (min, max) = (
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(60),
    );
    if !(min..=max).contains(&duration) || duration.subsec_nanos() != 0 {
        return Err("must be a whole number of seconds from 1s to 1m".to_owned());
    }
    Ok(duration)
}

/// `--upload-interval`: a duration from 5 s to 5 min.
fn parse_upload_interval(text: &str) -> Result<std::time::Duration, String> {
    let duration = parse_duration(text)?;
    let (min, max) = (
        std::time::Duration::from_secs(5),
        std::time::Duration::from_secs(300),
    );
    if !(min..=max).contains(&duration) {
        return Err("must be from 5s to 5m".to_owned());
    }
    if duration.subsec_nanos() != 0 {
        return Err("must be a whole number of seconds".to_owned());
    }
    Ok(duration)
}

/// A size: bytes, or a number with `KB`, `MB`, `GB` (powers of 1000) or
/// `KiB`, `MiB`, `GiB` (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size (write 500MB, 2GiB or bytes)"))?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1000,
        "mb" => 1000 * 1000,
        "gb" => 1000 * 1000 * 1000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit `{other}` (use KB, MB, GB, KiB, MiB, GiB)"
            ));
        }
    };
    number
        .checked_mul(multiplier)
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| format!("`{text}` is zero or too large"))
}

/// Parses a sink's URL with [`parse_http_url`]. Unlike a plain function
/// parser, whose error clap prints with the value given, its error shows
/// the value through [`crate::agent::redact_url`]: a URL that fails to
/// parse may still hold a user, a password or a `?token=`, and the error
/// lands in pod logs.
#[derive(Clone, Copy, Debug)]
struct HttpUrlParser;

impl clap::builder::TypedValueParser for HttpUrlParser {
    type Value = String;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        let text = value.to_string_lossy();
        parse_http_url(&text).map_err(|reason| {
            let flag = arg.map_or_else(|| "URL".to_owned(), ToString::to_string);
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!(
                    "invalid value '{}' for '{flag}': {reason}\n",
                    crate::agent::redact_url(&text)
                ),
            )
        })
    }
}

/// An http or https URL with a host.
fn parse_http_url(text: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(text.trim()).map_err(|error| format!("not a URL: {error}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err("must be an http:// or https:// URL with a host".to_owned());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("must not have a query or fragment".to_owned());
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

/// A container id: lower-case hex, 12 to 64 digits.
fn parse_container_id(text: &str) -> Result<String, String> {
    let id = text.trim().to_ascii_lowercase();
    let id = id
        .rsplit_once("://")
        .map_or(id.as_str(), |(_, id)| id)
        .to_owned();
    let min = crate::agent::config::CONTAINER_ID_PREFIX_MIN;
    if !(min..=64).contains(&id.len()) || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(
            "must be 12 to 64 hex digits (a docker://, containerd:// prefix is fine)".to_owned(),
        );
    }
    Ok(id)
}

/// A Kubernetes namespace name (RFC 1123 label).
fn parse_k8s_namespace(text: &str) -> Result<String, String> {
    let valid = (1..=63).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !text.starts_with('-')
        && !text.ends_with('-');
    if valid {
        Ok(text.to_owned())
    } else {
        Err("must be a Kubernetes namespace name (lower-case letters, digits, `-`)".to_owned())
    }
}

/// Options `record` and `agent` share: what is collected besides CPU
/// samples, and how stacks are walked. Checked into
/// [`crate::pipeline::driver::SamplingConfig`].
#[derive(Debug, clap::Args)]
pub struct SamplingArgs {
    /// CLR events to collect from .NET processes over EventPipe, as extra
    /// sample types in the profile: contention (contentions/count,
    /// delay/nanoseconds, with the lock owner on .NET 8+), exceptions
    /// (exceptions/count, by exception.type), waits (.NET 9+: waits/count,
    /// wait_delay/nanoseconds, by wait.source), allocations (as `record
    /// --alloc`). Sampled per minute, with exact totals.
    #[arg(
        long,
        value_name = "KINDS",
        default_value = "contention,exceptions,waits",
        conflicts_with = "no_clr_events"
    )]
    pub clr_events: String,

    /// No EventPipe session for CLR events: CPU samples only (and, in the
    /// agent, the runtime counters).
    #[arg(long)]
    pub no_clr_events: bool,

    /// Allocation events taken with their stacks per second and process at
    /// most. The runtime walks a stack for each one; above this rate their
    /// session stops for a back-off (10s, doubling up to 5m) and the
    /// runtime's alloc-rate counter keeps the bytes exact. 0: every one.
    #[arg(long, value_name = "N", default_value_t = crate::clr::alloc_session::DEFAULT_ALLOCATIONS_PER_SECOND)]
    pub allocs_per_second: u32,

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

    /// Walk user stacks by frame pointers only: native code built without
    /// them (glibc, most distribution binaries) then loses frames. By
    /// default they are walked in the kernel with unwind tables built from
    /// each file's `.eh_frame`.
    #[arg(long, visible_alias = "no-dwarf-unwind")]
    pub frame_pointers_only: bool,

    /// Bytes per second, for the whole host, of user-stack copies taken
    /// while a new process's unwind tables are being built (16 KiB per
    /// sample at most, unwound once the tables exist, as `perf
    /// --call-graph dwarf` does); past it, those samples are walked by
    /// frame pointers and counted. 0: no copies.
    #[arg(long, value_name = "KIB", default_value_t = 8192,
          value_parser = clap::value_parser!(u64).range(0..=1_048_576))]
    pub stack_copy_kib_per_second: u64,

    /// Copy the user stack of every on-CPU sample and walk it in
    /// userspace, as if no process had tables in the kernel (for `cargo
    /// xtask bench`, which compares the copies' cost with the walk's).
    #[arg(long, hide = true)]
    pub stack_copy_every_sample: bool,

    /// Index the processes that appear after sampling started only this
    /// many milliseconds after they are first seen, as a busy unwind
    /// worker or a cold cache does (for tests of their first stacks).
    #[arg(long, hide = true, value_name = "MS", default_value_t = 0)]
    pub hold_new_processes_ms: u64,

    /// Kernel memory unwind tables may take at most (unless
    /// --frame-pointers-only): allocated in 1.5 MiB chunks as tables are
    /// loaded (24 bytes per table row); at the cap the least-recently-used
    /// tables are evicted.
    #[arg(long, value_name = "MB", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub unwind_table_memory_mb: u64,

    /// Where unwind tables (and this boot's kernel symbols) are kept
    /// between runs, so the next run does not build them again: a
    /// directory of clrbpf's own (created mode 0700; not used unless owned
    /// by the user clrbpf runs as and closed to others), at most 256 MiB of
    /// tables, oldest removed first.
    #[arg(long, value_name = "DIR", default_value = crate::unwind::disk_cache::DEFAULT_DIR,
          env = "CLRBPF_CACHE_DIR")]
    pub cache_dir: PathBuf,

    /// Build unwind tables and read kallsyms every run; keep nothing
    /// between runs.
    #[arg(long)]
    pub no_cache: bool,

    /// Where .NET frames get their names. auto: perf maps where the
    /// runtime can write them (asked over its diagnostic socket), and for
    /// the rest (no socket, as with DOTNET_EnableDiagnostics=0, or a
    /// read-only /tmp) ReadyToRun code from its image files and JIT code
    /// from the runtime's memory. memory: only those; nothing is asked of
    /// the runtime or written into the target. perf-map: only perf maps
    /// and runtime events.
    #[arg(long, value_enum, value_name = "SOURCE", default_value = "auto")]
    pub managed_names: crate::clr::name_sources::ManagedNames,

    /// Keep every unnamed native frame (in a file nothing names, such as
    /// the stripped libcoreclr.so) as a frame of its own, each pprof
    /// location with its address. By default a run of consecutive unnamed
    /// frames of one module is one frame `[libcoreclr.so]`, as perf shows
    /// it, whose location keeps the run's innermost address.
    #[arg(long)]
    pub keep_unnamed_frames: bool,
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

    /// Accepted for scripts written when DWARF unwinding was opt-in; it is
    /// the default now.
    #[arg(long, hide = true, conflicts_with = "frame_pointers_only")]
    pub dwarf_unwind: bool,

    /// Exception events taken with their stacks per second and process at
    /// most. Above it the runtime stops sending them for a back-off and its
    /// exception counter gives the totals. 0: every one.
    #[arg(long, value_name = "N", default_value_t = crate::clr::budget::DEFAULT_EXCEPTIONS_PER_SECOND)]
    pub exceptions_per_second: u32,

    /// Also profile allocations of .NET processes: alloc_samples/count and
    /// alloc_size/bytes, by allocation.type (also the leaf frame) and
    /// allocation.heap (soh, loh, poh), from the runtime's allocation
    /// ticks (one per ~100 KiB allocated) with their stacks.
    #[arg(long, conflicts_with = "no_clr_events")]
    pub alloc: bool,

    /// Write one file per kind: <stem>.cpu.pb.gz, <stem>.contention.pb.gz,
    /// <stem>.exceptions.pb.gz, <stem>.waits.pb.gz, and with --off-cpu,
    /// --wall or --alloc <stem>.offcpu.pb.gz, <stem>.wall.pb.gz,
    /// <stem>.allocations.pb.gz.
    #[arg(long)]
    pub split: bool,

    #[command(flatten)]
    pub sampling: SamplingArgs,

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

    /// Before sampling starts, wait at most this long for the unwind tables
    /// of the -p processes (whole host: the running .NET processes; the
    /// others are indexed right after), so that their first stacks are whole. Tables come
    /// from --cache-dir, or are built. Processes not ready by then are
    /// walked by frame pointers until they are (named in the summary).
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0,
          value_parser = parse_start_wait)]
    pub start_wait: f64,

    /// No progress line and no summary.
    #[arg(short, long)]
    pub quiet: bool,

    /// Add clrbpf's own figures to the summary: BPF time per sample,
    /// unwind tables and their cache, JIT prologues decoded, cache
    /// evictions.
    #[arg(short, long, conflicts_with = "quiet")]
    pub verbose: bool,

    /// The command to run and profile.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_bad_sink_url_is_never_echoed_with_its_credentials() {
        for bad in [
            "http://user:s3cret@ho st:4040/?token=t0ken",
            "ftp://user:s3cret@host/?token=t0ken",
            "http://user:s3cret@host:4040/push?token=t0ken",
        ] {
            for flag in ["--pyroscope-url", "--otlp-url"] {
                let error = Cli::try_parse_from(["clrbpf", "agent", flag, bad])
                    .expect_err("a bad URL is refused");
                let text = error.to_string();
                assert!(
                    !text.contains("s3cret") && !text.contains("t0ken") && !text.contains("user"),
                    "{text}"
                );
                assert!(text.contains("[redacted]") && text.contains(flag), "{text}");
            }
        }
    }

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

    fn agent(args: &[&str]) -> Result<AgentArgs, clap::Error> {
        let cli = Cli::try_parse_from(["clrbpf", "agent"].iter().chain(args))?;
        match cli.command {
            Command::Agent(args) => Ok(*args),
            _ => panic!("not agent"),
        }
    }

    fn agent_error(args: &[&str]) -> String {
        agent(args).expect_err("refused").to_string()
    }

    #[test]
    fn agent_defaults() {
        let args = agent(&[]).expect("defaults");
        assert_eq!(args.frequency, 19);
        assert_eq!(args.upload_interval, std::time::Duration::from_secs(15));
        assert_eq!(
            args.runtime_counters_interval,
            std::time::Duration::from_secs(5)
        );
        assert_eq!(args.grace_period, std::time::Duration::from_secs(10));
        assert_eq!(args.retention, std::time::Duration::from_secs(24 * 3600));
        assert_eq!(args.retention_size, 1 << 30);
        assert_eq!(args.listen, "127.0.0.1:7071".parse().unwrap());
        assert_eq!(args.max_pull_seconds, 60);
        assert_eq!(args.max_services, 256);
        assert!(!args.enable_pull && args.http_token_file.is_none());
        assert!(args.pyroscope_url.is_none() && args.otlp_url.is_none());
    }

    #[test]
    fn agent_parses_durations_sizes_urls_and_selections() {
        let args = agent(&[
            "--upload-interval",
            "1m",
            "--grace-period",
            "500ms",
            "--retention",
            "2h",
            "--retention-size",
            "500MB",
            "--pyroscope-url",
            "https://profiles.example.com/",
            "--otlp-url",
            "http://collector:4318",
            "--exe",
            "dotnet",
            "--container-id",
            "containerd://0123456789ABcdef",
            "--k8s-namespace",
            "shop",
            "-F",
            "49",
        ])
        .expect("valid");
        assert_eq!(args.upload_interval, std::time::Duration::from_secs(60));
        assert_eq!(args.grace_period, std::time::Duration::from_millis(500));
        assert_eq!(args.retention_size, 500_000_000);
        assert_eq!(
            args.pyroscope_url.as_deref(),
            Some("https://profiles.example.com")
        );
        assert_eq!(args.otlp_url.as_deref(), Some("http://collector:4318"));
        assert_eq!(args.container_ids, ["0123456789abcdef"]);
        assert_eq!(args.k8s_namespaces, ["shop"]);
        assert_eq!(args.frequency, 49);
    }

    #[test]
    fn malformed_agent_config_is_refused_naming_the_option() {
        for (args, option) in [
            (&["--upload-interval", "4s"][..], "--upload-interval"),
            (&["--upload-interval", "6m"], "--upload-interval"),
            (&["--upload-interval", "15"], "--upload-interval"),
            (
                &["--runtime-counters-interval", "500ms"],
                "--runtime-counters-interval",
            ),
            (
                &["--runtime-counters-interval", "2m"],
                "--runtime-counters-interval",
            ),
            (&["--upload-interval", "5500ms"], "--upload-interval"),
            (&["--grace-period", "0s"], "--grace-period"),
            (&["--retention", "soon"], "--retention"),
            (&["--retention-size", "12XB"], "--retention-size"),
            (&["--pyroscope-url", "ftp://x"], "--pyroscope-url"),
            (&["--otlp-url", "not a url"], "--otlp-url"),
            (&["--container-id", "xyz"], "--container-id"),
            (&["--container-id", "0123456789a"], "--container-id"),
            (&["--k8s-namespace", "Shop_1"], "--k8s-namespace"),
            (&["--listen", "localhost"], "--listen"),
            (&["--max-pull-seconds", "0"], "--max-pull-seconds"),
            (&["--http-token-file", "/t"], "--enable-pull"),
            (&["-F", "0"], "--frequency"),
            (&["--pyroscope-tenant-id", "t"], "--pyroscope-url"),
        ] {
            let message = agent_error(args);
            assert!(message.contains(option), "{args:?}: {message}");
        }
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("99999999999999999999GB").is_err());
    }
}
