//! Command-line interface: clap definitions only. `main.rs` turns these into
//! the library's configuration and runs it.

use std::{ffi::OsString, path::PathBuf};

use clap::{Args, Parser, Subcommand};

use crate::export::{frame_names::FrameNames, output::OutputFormat};

mod values;
pub use values::{
    LOG_LEVELS, parse_duration, parse_duration_in, parse_duration_range, parse_log_filter,
    parse_size,
};

/// clrbpf: whole-host CPU profiles of .NET (and everything else) on Linux,
/// with kernel, native and managed frames, without restarting anything.
#[derive(Debug, Parser)]
#[command(name = "clrbpf", version, about, long_about = None, propagate_version = true,
          after_help = DOCS_LINE)]
pub struct Cli {
    /// Diagnostics shown on stderr: off, error, warn, info, debug, trace.
    ///
    /// A level, or a comma-separated list of levels by module such as
    /// `warn,clrbpf::agent=debug`. Anything else is an error.
    #[arg(long, global = true, value_name = "LEVEL", default_value = "warn",
          env = "CLRBPF_LOG", value_parser = parse_log_filter,
          help_heading = "Global options")]
    pub log_level: String,

    /// How diagnostics are written on stderr: text or json.
    ///
    /// text: one line per event, coloured only when stderr is a terminal.
    /// json: one JSON object per line (timestamp, level, fields, target),
    /// for log collectors such as `kubectl logs` pipelines.
    #[arg(
        long,
        global = true,
        value_enum,
        value_name = "FORMAT",
        default_value = "text",
        env = "CLRBPF_LOG_FORMAT",
        help_heading = "Global options"
    )]
    pub log_format: LogFormat,

    /// Memory, in MiB, that profiled processes can make clrbpf hold.
    ///
    /// Their mapping tables, the parts of their files read for unwind
    /// tables, their managed symbols and EventPipe streams, each a share of
    /// it. What would go over is dropped, counted in the summary and on
    /// /metrics, and warned about once per process. Keep it under the
    /// agent's container memory limit (the chart does).
    #[arg(long, global = true, value_name = "MB",
          default_value_t = crate::memory_budget::DEFAULT_MEMORY_BUDGET_MB,
          value_parser = clap::value_parser!(u64).range(32..=65_536),
          allow_negative_numbers = true, hide_short_help = true,
          help_heading = "Global options")]
    pub memory_budget_mb: u64,

    #[command(subcommand)]
    pub command: Command,
}

/// Where the user documentation is, shown under every help.
const DOCS_LINE: &str = "Documentation: docs/record.md, docs/agent.md and docs/security.md in the \
clrbpf source tree (README.md lists them all).";

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines, coloured on a terminal.
    Text,
    /// One JSON object per line.
    Json,
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
    #[command(after_help = RECORD_SHORT_AFTER_HELP, after_long_help = RECORD_EXAMPLES)]
    Record(Box<RecordArgs>),
    /// Profile continuously and ship one profile per service every
    /// interval to Pyroscope, an OpenTelemetry collector or a directory;
    /// serve metrics (with .NET runtime metrics) and health on --listen.
    ///
    /// Runs until SIGTERM or SIGINT, then ships the last window (within
    /// --grace-period) and exits 0. SIGHUP is ignored: nothing is reloaded.
    #[command(after_help = AGENT_SHORT_AFTER_HELP, after_long_help = AGENT_EXAMPLES)]
    Agent(Box<AgentArgs>),
    /// List the .NET processes on this host, and how each will be profiled.
    ///
    /// For each: its user, runtime version, the service name the agent
    /// would give it, where its managed frames get their names (perf map:
    /// files the runtime writes already; socket: clrbpf asks the runtime
    /// through its diagnostic socket; memory: clrbpf reads them from the
    /// runtime's memory), its pod and container. Run as a user who is not
    /// root, it lists that user's processes only and says how many it could
    /// not read.
    Ps(PsArgs),
    /// Say whether profiling will work here, and if not why and the fix.
    ///
    /// Loads and attaches a trivial BPF program to a perf event and reads
    /// the kernel's BTF (nothing stays loaded), then shows the version, the
    /// container and cgroup clrbpf sees, and the kernel features it uses.
    /// Exits 1 when profiling will not work.
    SystemInfo,
}

/// Options of `clrbpf ps`.
#[derive(Debug, clap::Args)]
pub struct PsArgs {
    /// Write one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
}

const RECORD_SHORT_AFTER_HELP: &str = "\
'clrbpf record --help' shows every option (tuning knobs included), examples and where the \
documentation is.";

const RECORD_EXAMPLES: &str = "\
Examples:
  sudo clrbpf record -d 30s                       # the whole host for 30 s: profile.pb.gz
  sudo clrbpf record -p 1234 -o app.svg           # one process until it exits, as a flame graph
  sudo clrbpf record -p 1234,5678 -d 2m           # two processes for two minutes
  sudo clrbpf record --off-cpu -- dotnet App.dll  # run a command, with where it blocks
  sudo clrbpf record -p 1234 --alloc --split      # also allocations: profile.allocations.pb.gz
  go tool pprof -http=: profile.pb.gz             # look at the result

Durations are written 30 (seconds), 30s, 2m or 500ms. -g is accepted as perf's: stacks are
always recorded.

Documentation: docs/record.md in the clrbpf source tree (README.md lists the others).";

const AGENT_SHORT_AFTER_HELP: &str = "\
'clrbpf agent --help' shows every option (tuning knobs included), examples and where the \
documentation is.";

const AGENT_EXAMPLES: &str = "\
Examples:
  sudo clrbpf agent --pyroscope-url http://pyroscope:4040
  sudo clrbpf agent --otlp-url http://otel-collector:4318 --upload-interval 1m
  sudo clrbpf agent --output-dir /var/lib/clrbpf/profiles --k8s-namespace shop
  sudo clrbpf agent --log-format json --listen 0.0.0.0:7071

Durations are written 30 (seconds), 30s, 2m or 500ms; sizes 500MB, 2GiB or bytes.

Documentation: docs/agent.md in the clrbpf source tree; the Helm chart in deploy/helm.";

/// Options of `clrbpf agent`. Durations are written `30` (seconds), `500ms`,
/// `10s`, `1m`, `24h`; sizes `500MB`, `2GiB` or bytes.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Sampling")]
pub struct AgentArgs {
    /// Samples per second on each CPU.
    #[arg(short = 'F', long = "frequency", value_name = "HZ", default_value_t = 19,
          value_parser = clap::value_parser!(u64).range(1..=10_000), allow_negative_numbers = true)]
    pub frequency: u64,

    /// How often a window is cut and shipped, aligned to the wall clock
    /// (5s to 5m).
    #[arg(long, value_name = "DURATION", default_value = "15s",
          value_parser = parse_upload_interval, allow_negative_numbers = true)]
    pub upload_interval: std::time::Duration,

    /// Exception events taken with their stacks per second and process at
    /// most. The runtime walks a stack for each one it sends; above this
    /// rate it is told to stop sending them for a back-off (10s, doubling
    /// up to 5m while the storm lasts), and its exception counter keeps
    /// the totals exact. 0: no limit.
    #[arg(long, value_name = "N", default_value_t = crate::clr::budget::DEFAULT_EXCEPTIONS_PER_SECOND,
          allow_negative_numbers = true, conflicts_with = "no_clr_events", hide_short_help = true)]
    pub exceptions_per_second: u32,

    /// How often each .NET runtime sends its counters (1s to 60s): the
    /// dotnet_* series, and the exceptions counted while their events are
    /// off. Each reading costs every .NET process some work; a process
    /// that exits within this long of throwing while its exception events
    /// are off loses those throws from its profile (1s keeps nearly all).
    #[arg(long, value_name = "DURATION", default_value = "5s",
          value_parser = parse_runtime_counters_interval, allow_negative_numbers = true)]
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
          allow_negative_numbers = true, help_heading = "Process selection")]
    pub max_services: u64,

    /// A label on every series this agent ships, KEY=VALUE, such as
    /// cluster=prod-eu or environment=staging (repeatable, at most 16).
    ///
    /// A Pyroscope label and an OTLP resource attribute. KEY is lower-case
    /// letters, digits, `_` and `.`, starting with a letter; it cannot be
    /// one clrbpf sets itself (service_name, service.name, pod, namespace,
    /// ...).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_static_label,
          help_heading = "Sinks")]
    pub labels: Vec<(String, String)>,

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
          value_parser = parse_duration, allow_negative_numbers = true, help_heading = "Sinks")]
    pub retention: std::time::Duration,

    /// Remove the oldest files of --output-dir while they total more.
    #[arg(long, value_name = "SIZE", default_value = "1GiB",
          value_parser = parse_size, allow_negative_numbers = true, help_heading = "Sinks")]
    pub retention_size: u64,

    /// How long the last window may take to ship at shutdown.
    #[arg(long, value_name = "DURATION", default_value = "10s",
          value_parser = parse_duration, allow_negative_numbers = true, help_heading = "Sinks")]
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
    #[arg(long, value_name = "DURATION", default_value = "60",
          value_parser = parse_max_pull, allow_negative_numbers = true,
          help_heading = "HTTP endpoint")]
    pub max_pull_seconds: u64,
}

/// `--upload-interval`: a whole number of seconds from 5 s to 5 min.
fn parse_upload_interval(text: &str) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    parse_duration_range(text, Duration::from_secs(5), Duration::from_secs(300), true)
}

/// `--runtime-counters-interval`: a whole number of seconds from 1 s to 60 s.
fn parse_runtime_counters_interval(text: &str) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    parse_duration_range(text, Duration::from_secs(1), Duration::from_secs(60), true)
}

/// `--start-wait`: from 0 to 600 s.
fn parse_start_wait(text: &str) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    parse_duration_range(text, Duration::ZERO, Duration::from_secs(600), false)
}

/// `--duration`: more than zero, at most about ten years (for longer,
/// leave it out and stop with Ctrl-C).
fn parse_record_duration(text: &str) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    let ten_years = Duration::from_secs(315_360_000);
    let duration = parse_duration(text)?;
    if duration > ten_years {
        return Err("is longer than ten years: leave -d out to record until Ctrl-C".to_owned());
    }
    Ok(duration)
}

/// `--off-cpu-min`: a plain number is milliseconds (`1`, `0.5`), or a
/// duration with its unit (`500us`, `2ms`); more than zero, at most 4 s.
fn parse_off_cpu_min(text: &str) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    let duration = parse_duration_in(text, Duration::from_millis(1))?;
    if duration.is_zero() || duration > crate::pipeline::driver::MAX_OFF_CPU_MIN {
        return Err("must be more than 0 and at most 4s".to_owned());
    }
    Ok(duration)
}

/// `--max-pull-seconds`: a whole number of seconds from 1 s to 1 h.
fn parse_max_pull(text: &str) -> Result<u64, String> {
    use std::time::Duration;
    parse_duration_range(
        text,
        Duration::from_secs(1),
        Duration::from_secs(3600),
        true,
    )
    .map(|duration| duration.as_secs())
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
/// Keys a static label cannot take: those the agent sets on a series.
const RESERVED_LABEL_KEYS: [&str; 8] = [
    "service_name",
    "service.name",
    "__name__",
    "pod",
    "namespace",
    "container",
    "process.executable.name",
    "host.name",
];

/// `--label KEY=VALUE`.
fn parse_static_label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| "must be KEY=VALUE, e.g. cluster=prod-eu".to_owned())?;
    let key_ok = (1..=64).contains(&key.len())
        && key.starts_with(|c: char| c.is_ascii_lowercase())
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'.');
    if !key_ok {
        return Err(format!(
            "key `{key}` must be 1 to 64 lower-case letters, digits, `_` or `.`, starting with a letter"
        ));
    }
    if RESERVED_LABEL_KEYS.contains(&key) || key.starts_with("k8s.") {
        return Err(format!("key `{key}` is set by clrbpf itself: pick another"));
    }
    if value.is_empty() || value.len() > 256 || value.chars().any(char::is_control) {
        return Err(
            "the value must be 1 to 256 characters, none of them control characters".to_owned(),
        );
    }
    Ok((key.to_owned(), value.to_owned()))
}

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
#[command(group = clap::ArgGroup::new("off_cpu_mode").args(["off_cpu", "wall"]).multiple(true))]
pub struct SamplingArgs {
    /// CLR events collected from .NET processes, as extra sample types.
    ///
    /// Over EventPipe: contention (contentions/count, delay/nanoseconds,
    /// with the lock owner on .NET 8+), exceptions (exceptions/count, by
    /// exception.type), waits (.NET 9+: waits/count, wait_delay/nanoseconds,
    /// by wait.source), allocations (as `record --alloc`). Sampled per
    /// minute, with exact totals.
    #[arg(
        long,
        value_name = "KINDS",
        default_value = "contention,exceptions,waits",
        conflicts_with = "no_clr_events",
        help_heading = "What to collect"
    )]
    pub clr_events: String,

    /// No EventPipe session for CLR events: CPU samples only.
    ///
    /// In the agent, the runtime counters are still read.
    #[arg(long, help_heading = "What to collect")]
    pub no_clr_events: bool,

    /// Allocation events taken with their stacks per second and process at
    /// most (0: every one).
    ///
    /// The runtime walks a stack for each one; above this rate their
    /// session stops for a back-off (10s, doubling up to 5m) and the
    /// runtime's alloc-rate counter keeps the bytes exact.
    #[arg(long, value_name = "N",
          default_value_t = crate::clr::alloc_session::DEFAULT_ALLOCATIONS_PER_SECOND,
          allow_negative_numbers = true, conflicts_with = "no_clr_events",
          help_heading = "Tuning", hide_short_help = true)]
    pub allocs_per_second: u32,

    /// Also record off-CPU time: where threads block, for how long, and
    /// who woke them.
    ///
    /// Locks, sleeps, I/O, page faults. Adds the sample types
    /// off_cpu/nanoseconds (the stack at the moment a thread blocked,
    /// labelled wait.kind) and wakeup/nanoseconds (the waker's stack on top
    /// of the blocked one, as bcc's offwaketime).
    #[arg(long, help_heading = "What to collect")]
    pub off_cpu: bool,

    /// Off-CPU intervals at least this long are all kept (needs --off-cpu
    /// or --wall; a plain number is milliseconds).
    ///
    /// Shorter ones are sampled with probability interval/min and weighted
    /// min, so totals stay exact on average while the records stay few.
    /// Written `1`, `0.5`, `500us` or `2ms`; at most 4s.
    #[arg(long, value_name = "DURATION", default_value = "1", value_parser = parse_off_cpu_min,
          allow_negative_numbers = true, requires = "off_cpu_mode",
          help_heading = "Tuning", hide_short_help = true)]
    pub off_cpu_min: std::time::Duration,

    /// Most stacks taken per CPU per second when threads block (needs
    /// --off-cpu or --wall).
    ///
    /// Each costs a stack walk in the kernel, a few microseconds. Above
    /// it, stacks are taken at random with the probability that keeps to
    /// it, and the waits that have one are upscaled by its inverse; every
    /// wait still counts in the exact per-thread totals.
    #[arg(long, value_name = "N", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(10..=1_000_000),
          allow_negative_numbers = true, requires = "off_cpu_mode",
          help_heading = "Tuning", hide_short_help = true)]
    pub off_cpu_max_stacks: u64,

    /// Wall time: each thread's CPU plus off-CPU time (implies --off-cpu).
    ///
    /// A wall/nanoseconds sample type, the view that shows where a
    /// thread's whole time went (shown first by pprof viewers).
    #[arg(long, help_heading = "What to collect")]
    pub wall: bool,

    /// Walk user stacks by frame pointers only.
    ///
    /// Native code built without them (glibc, most distribution binaries)
    /// then loses frames. By default they are walked in the kernel with
    /// unwind tables built from each file's `.eh_frame`.
    #[arg(
        long,
        visible_alias = "no-dwarf-unwind",
        help_heading = "Tuning",
        hide_short_help = true
    )]
    pub frame_pointers_only: bool,

    /// Bytes per second (KiB), for the whole host, of user-stack copies
    /// taken while a new process's unwind tables are being built.
    ///
    /// 16 KiB per sample at most, unwound once the tables exist, as `perf
    /// --call-graph dwarf` does; past it, those samples are walked by
    /// frame pointers and counted. 0: no copies. No effect with
    /// --frame-pointers-only (an error).
    #[arg(long, value_name = "KIB", default_value_t = 8192,
          value_parser = clap::value_parser!(u64).range(0..=1_048_576),
          allow_negative_numbers = true, conflicts_with = "frame_pointers_only",
          help_heading = "Tuning", hide_short_help = true)]
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

    /// Kernel memory unwind tables may take at most, in MiB.
    ///
    /// Allocated in 1.5 MiB chunks as tables are loaded (24 bytes per table
    /// row); at the cap the least-recently-used tables are evicted. No
    /// effect with --frame-pointers-only (an error).
    #[arg(long, value_name = "MB", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=4096),
          allow_negative_numbers = true, conflicts_with = "frame_pointers_only",
          help_heading = "Tuning", hide_short_help = true)]
    pub unwind_table_memory_mb: u64,

    /// Where unwind tables (and this boot's kernel symbols) are kept
    /// between runs.
    ///
    /// So the next run does not build them again: a directory of clrbpf's
    /// own (created mode 0700; not used unless owned by the user clrbpf
    /// runs as and closed to others), at most 256 MiB of tables, oldest
    /// removed first. Given with --no-cache, an error.
    #[arg(long, value_name = "DIR", default_value = crate::unwind::disk_cache::DEFAULT_DIR,
          env = "CLRBPF_CACHE_DIR", conflicts_with = "no_cache",
          help_heading = "Tuning", hide_short_help = true)]
    pub cache_dir: PathBuf,

    /// Build unwind tables and read kallsyms every run; keep nothing
    /// between runs.
    #[arg(long, help_heading = "Tuning", hide_short_help = true)]
    pub no_cache: bool,

    /// Where .NET frames get their names: auto, memory or perf-map.
    ///
    /// auto: perf maps where the runtime can write them (asked over its
    /// diagnostic socket), and for the rest (no socket, as with
    /// DOTNET_EnableDiagnostics=0, or a read-only /tmp) ReadyToRun code from
    /// its image files and JIT code from the runtime's memory. memory: only
    /// those; nothing is asked of the runtime or written into the target.
    /// perf-map: only perf maps and runtime events.
    #[arg(
        long,
        value_enum,
        value_name = "SOURCE",
        default_value = "auto",
        help_heading = "Tuning",
        hide_short_help = true
    )]
    pub managed_names: crate::clr::name_sources::ManagedNames,

    /// Keep every unnamed native frame (in a file nothing names, such as
    /// the stripped libcoreclr.so) as a frame of its own, each pprof
    /// location with its address. By default a run of consecutive unnamed
    /// frames of one module is one frame `[libcoreclr.so]`, as perf shows
    /// it, whose location keeps the run's innermost address.
    #[arg(long, help_heading = "Output", hide_short_help = true)]
    pub keep_unnamed_frames: bool,

    /// Look for native debug files in DIR first (repeatable, up to 16):
    /// DIR/.build-id/xx/rest.debug, or the symbol-store layout
    /// dotnet-symbol writes (DIR/libcoreclr.so.dbg/elf-buildid-sym-ID/libcoreclr.so.dbg).
    /// A debug file is used only when its build id is the library's.
    #[arg(
        long = "debug-dir",
        value_name = "DIR",
        help_heading = "Tuning",
        hide_short_help = true
    )]
    pub debug_dirs: Vec<PathBuf>,

    /// Download debug files no local place has from this symbol server
    /// (repeatable), in Microsoft's symbol server layout
    /// (URL/libcoreclr.so.dbg/elf-buildid-sym-ID/libcoreclr.so.dbg), as
    /// https://msdl.microsoft.com/download/symbols serves the .NET
    /// runtime's. Off the sampling path, into the cache directory; a file is
    /// used only when its build id is the library's. Credentials belong in
    /// the URL's environment, never on the command line.
    #[arg(
        long = "symbol-server",
        value_name = "URL",
        help_heading = "Tuning",
        hide_short_help = true
    )]
    pub symbol_servers: Vec<String>,

    /// Download debug files from this debuginfod server (repeatable;
    /// default: the servers of DEBUGINFOD_URLS).
    #[arg(
        long = "debuginfod-url",
        value_name = "URL",
        help_heading = "Tuning",
        hide_short_help = true
    )]
    pub debuginfod_urls: Vec<String>,

    /// How long the end of a recording waits for debug files being
    /// downloaded.
    #[arg(long, value_name = "DURATION", default_value = "20s",
          value_parser = parse_duration, help_heading = "Tuning", hide_short_help = true)]
    pub symbol_download_wait: std::time::Duration,

    /// Most megabytes of downloaded debug files the cache directory keeps
    /// (the oldest go first).
    #[arg(long, value_name = "MB", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..=1 << 20),
          help_heading = "Tuning", hide_short_help = true)]
    pub symbol_cache_mb: u64,
}

#[derive(Debug, clap::Args)]
pub struct RecordArgs {
    /// Profile these processes (comma-separated or repeated); stops when
    /// all of them exit.
    #[arg(short = 'p', long = "pid", value_name = "PID", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..), allow_negative_numbers = true)]
    pub pids: Vec<u32>,

    /// Profile the whole host as well as the given COMMAND or -p processes.
    #[arg(short = 'a', long = "all-cpus")]
    pub all: bool,

    /// Samples per second on each CPU.
    #[arg(short = 'F', long = "frequency", value_name = "HZ", default_value_t = 99,
          value_parser = clap::value_parser!(u64).range(1..=10_000), allow_negative_numbers = true)]
    pub frequency: u64,

    /// Stop after this long: 30 (seconds), 30s, 2m, 500ms.
    #[arg(short = 'd', long = "duration", value_name = "DURATION",
          value_parser = parse_record_duration, allow_negative_numbers = true)]
    pub duration: Option<std::time::Duration>,

    /// Where to write the profile; the format follows the extension.
    ///
    /// .pb.gz pprof, .folded/.collapsed folded stacks, .svg flame graph,
    /// unless --format is given.
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        default_value = "profile.pb.gz"
    )]
    pub output: PathBuf,

    /// Call stacks: always recorded, kernel, native and managed (accepted
    /// for perf's habit).
    #[arg(short = 'g')]
    pub call_graph: bool,

    /// No progress line and no summary.
    #[arg(short, long)]
    pub quiet: bool,

    /// Add clrbpf's own figures to the summary.
    ///
    /// BPF time per sample, unwind tables and their cache, JIT prologues
    /// decoded, cache evictions.
    #[arg(short, long, conflicts_with = "quiet")]
    pub verbose: bool,

    /// Also profile allocations of .NET processes.
    ///
    /// alloc_samples/count and alloc_size/bytes, by allocation.type (also
    /// the leaf frame) and allocation.heap (soh, loh, poh), from the
    /// runtime's allocation ticks (one per ~100 KiB allocated) with their
    /// stacks.
    #[arg(
        long,
        conflicts_with = "no_clr_events",
        help_heading = "What to collect"
    )]
    pub alloc: bool,

    /// Output format, when the extension of -o does not say it.
    #[arg(long, value_enum, help_heading = "Output")]
    pub format: Option<OutputFormat>,

    /// How managed (.NET) frames are named: short or full.
    ///
    /// short: `Namespace.Type.Method` (the full signature with its JIT tier
    /// is the pprof system_name, the assembly its filename). full: the
    /// runtime's signature `int64 [App] App.Worker::Spin(int64)`. In every
    /// output format.
    #[arg(
        long,
        value_enum,
        value_name = "FORM",
        default_value = "short",
        help_heading = "Output"
    )]
    pub frame_names: FrameNames,

    /// Write one file per kind: <stem>.cpu.pb.gz, <stem>.allocations.pb.gz...
    ///
    /// <stem>.cpu.pb.gz, <stem>.contention.pb.gz, <stem>.exceptions.pb.gz,
    /// <stem>.waits.pb.gz, and with --off-cpu, --wall or --alloc
    /// <stem>.offcpu.pb.gz, <stem>.wall.pb.gz, <stem>.allocations.pb.gz
    /// (<stem>: -o without its extension, `profile` by default).
    #[arg(long, help_heading = "Output")]
    pub split: bool,

    /// Keep the perf map and jitdump files clrbpf made a running .NET
    /// process write (by default they are removed when recording ends).
    #[arg(long, help_heading = "Output", hide_short_help = true)]
    pub keep_perf_maps: bool,

    #[command(flatten)]
    pub flame_graph: FlameGraphArgs,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    /// Exception events taken with their stacks per second and process at
    /// most (0: every one).
    ///
    /// Above it the runtime stops sending them for a back-off and its
    /// exception counter gives the totals.
    #[arg(long, value_name = "N", default_value_t = crate::clr::budget::DEFAULT_EXCEPTIONS_PER_SECOND,
          allow_negative_numbers = true, conflicts_with = "no_clr_events",
          help_heading = "Tuning", hide_short_help = true)]
    pub exceptions_per_second: u32,

    /// Do not ask running .NET 8+ processes to write perf maps (their JIT
    /// frames stay unnamed unless they already write them).
    #[arg(long, help_heading = "Tuning", hide_short_help = true)]
    pub no_perf_map_attach: bool,

    /// Accepted for scripts written when DWARF unwinding was opt-in; it is
    /// the default now.
    #[arg(long, hide = true, conflicts_with = "frame_pointers_only")]
    pub dwarf_unwind: bool,

    /// Nice value of clrbpf's background threads (its sampling loop runs
    /// SCHED_RR).
    ///
    /// clrbpf raises its own priority so that it keeps up, and loses no
    /// samples, on the saturated hosts where a profile is most needed: the
    /// loop that drains the samples runs SCHED_RR (priority 1; it sleeps
    /// most of the time), its background threads (unwind tables, CLR
    /// sessions) at this nice value. Needs CAP_SYS_NICE (root has it);
    /// without it clrbpf warns and runs as started.
    #[arg(long, value_name = "N", default_value_t = -10, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19),
          help_heading = "Tuning", hide_short_help = true)]
    pub nice: i32,

    /// Keep clrbpf's scheduling priority as it was started.
    #[arg(
        long,
        conflicts_with = "nice",
        help_heading = "Tuning",
        hide_short_help = true
    )]
    pub no_priority_boost: bool,

    /// Before sampling starts, wait at most this long (0 to 10m) for the
    /// unwind tables of the profiled processes.
    ///
    /// -p processes, or on the whole host the running .NET processes (the
    /// others are indexed right after), so that their first stacks are
    /// whole. Tables come from --cache-dir, or are built. Processes not
    /// ready by then are walked by frame pointers until they are (named in
    /// the summary).
    #[arg(long, value_name = "DURATION", default_value = "5", value_parser = parse_start_wait,
          allow_negative_numbers = true, help_heading = "Tuning", hide_short_help = true)]
    pub start_wait: std::time::Duration,

    /// The command to run and profile, after `--`.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// How an .svg output is drawn (inferno's options of the same names).
#[derive(Args, Debug, Clone, Default)]
pub struct FlameGraphArgs {
    /// The flame graph's title [default: what it measures].
    #[arg(
        long,
        value_name = "TEXT",
        help_heading = "Flame graph (.svg)",
        hide_short_help = true
    )]
    pub title: Option<String>,

    /// Leaf functions at the base, their callers above them: the hottest
    /// functions and every path to them.
    #[arg(long, help_heading = "Flame graph (.svg)", hide_short_help = true)]
    pub reverse: bool,

    /// An icicle graph: roots at the top, stacks growing down.
    #[arg(long, help_heading = "Flame graph (.svg)", hide_short_help = true)]
    pub inverted: bool,

    /// One tower per thread under each process (`[name tid=N]`).
    #[arg(long, help_heading = "Flame graph (.svg)", hide_short_help = true)]
    pub per_thread: bool,

    /// Leave out frames narrower than this percentage of the width
    /// [default: 0.01].
    #[arg(long, value_name = "PERCENT", value_parser = parse_min_width,
          help_heading = "Flame graph (.svg)", hide_short_help = true)]
    pub min_width: Option<f64>,
}

impl FlameGraphArgs {
    /// Whether any of these options was given.
    pub fn any(&self) -> bool {
        self.title.is_some()
            || self.reverse
            || self.inverted
            || self.per_thread
            || self.min_width.is_some()
    }
}

/// `--min-width`: a percentage, 0 to 100 (`%` allowed).
fn parse_min_width(text: &str) -> Result<f64, String> {
    let number = text.trim().trim_end_matches('%');
    let percent: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a percentage of the width (e.g. 0.5)"))?;
    if !(0.0..=100.0).contains(&percent) {
        return Err(format!(
            "{text} is not between 0 and 100 (percent of the width)"
        ));
    }
    Ok(percent)
}

#[cfg(test)]
mod tests;
