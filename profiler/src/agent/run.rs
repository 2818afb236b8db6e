//! `clrbpf agent`: the continuous front end over the
//! [driver](crate::pipeline::driver) that `record` runs too.
//!
//! 1. Load the kernel side for the whole host at `-F` (19 Hz by default),
//!    start the sinks' delivery queues and the HTTP endpoint.
//! 2. Every tick, [`Pipeline::tick`] drains, learns processes, runs the
//!    CLR sessions and symbolizes, as in `record`.
//! 3. Every `--upload-interval`, aligned to the wall clock, once the
//!    samples of the window are all in
//!    ([`SYMBOLIZE_DELAY`](crate::pipeline::SYMBOLIZE_DELAY) after its
//!    end), [`AgentFront`] cuts the window ([`Cuts`] also cuts at the ends
//!    of on-demand `/debug/pprof/profile` spans and merges the parts) and
//!    hands it to [`ServiceSinks`], which splits it per service and profile
//!    type and submits it to the backends, never blocking the loop.
//! 4. On SIGTERM or SIGINT: the .NET processes are restored, the current
//!    window is closed and submitted, the sinks and the HTTP endpoint's
//!    connections get `--grace-period` (together) to finish, and the agent
//!    exits 0. SIGHUP reloads nothing and is ignored.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Context as _;
use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    sync::mpsc,
};

use super::{
    config::{AgentConfig, build_sinks},
    cuts::{Cuts, LoopPuller, PullRequest},
    http::{AgentHealth, HttpState, PullEndpoint, PullProfiler},
    metrics::AgentMetrics,
    queue::RetryPolicy,
    server::{HttpServer, ServerLimits},
    ship::ServiceSinks,
};
use crate::{
    bpf::Sampler,
    export::sink::ProfileSink as _,
    pipeline::{
        Pipeline,
        driver::{Cutter, Driver, DriverSetup, Front, StopSignal, prepare_host},
    },
};

/// Nice value of the agent's background threads.
const AGENT_NICE: i32 = -5;

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(config: AgentConfig) -> anyhow::Result<()> {
    raise_open_files_limit();
    for warning in prepare_host(Some(AGENT_NICE))? {
        tracing::warn!("{warning}");
    }
    let metrics = AgentMetrics::new();
    let health = Arc::new(AgentHealth::new(config.upload_interval * 3));
    let queues = build_sinks(&config, &metrics, RetryPolicy::default())?;
    let (http, pulls) = start_http(&config, &metrics, &health)?;
    let mut driver = Driver::load(DriverSetup {
        sampling: config.sampling.clone(),
        frequency_hz: config.frequency_hz,
        target_pids: None,
        attach_perf_maps: true,
        keep_perf_maps: false,
        exceptions_per_second: config.exceptions_per_second,
        // By default once per update of the `dotnet_*` series, which is
        // also how often the exception (and allocation) totals of a
        // back-off are brought up to date.
        counters_interval_sec: Some(config.runtime_counters_interval_sec),
        count_still_blocked: false,
    })?;
    if !config.selection.is_everything() {
        // The other processes' samples would be named only to be dropped.
        driver
            .pipeline()
            .select_processes(Box::new(config.selection.clone()));
    }
    driver.start_sampling()?;
    health.set_bpf_attached(true);
    // The run time of the BPF programs (`clrbpf_agent_bpf_run_seconds`) is
    // counted by the kernel only while stats are on: on while this fd is
    // open, whatever the `kernel.bpf_stats_enabled` sysctl says.
    let _bpf_stats = match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
        Ok(fd) => Some(fd),
        Err(error) => {
            tracing::warn!(%error, "no BPF run-time stats: clrbpf_agent_bpf_run_seconds stays 0");
            None
        }
    };
    let mut front = AgentFront {
        cuts: Cuts::new(
            SystemTime::now(),
            config.upload_interval,
            config.selection.clone(),
        ),
        sinks: ServiceSinks::new(
            queues,
            metrics.clone(),
            config.selection.clone(),
            config.max_services,
        )
        .with_static_labels(config.static_labels.clone()),
        pulls,
        sighup: signal(SignalKind::hangup()).context("install the SIGHUP handler")?,
        health,
        metrics,
        samples_cut: 0,
        not_selected_cut: 0,
        bpf_seen_ns: 0,
        last_metrics: Instant::now(),
        last_runtime_metrics: Instant::now(),
        // At once, then every DISCOVER_EVERY.
        last_discovery: Instant::now()
            .checked_sub(DISCOVER_EVERY)
            .unwrap_or_else(Instant::now),
    };
    let stopped_by = driver.run(&mut front).await;
    tracing::info!("{stopped_by}: closing the last window");
    let stopping = Instant::now();
    driver.finish(&mut front, stopped_by)?;
    // The sinks and the HTTP connections share the grace period: a client
    // holding a connection open cannot hold the exit.
    let (report, ()) = tokio::join!(front.sinks.flush(config.grace_period), http.stop());
    if report.abandoned > 0 {
        tracing::warn!(
            windows = report.abandoned,
            "windows not delivered within the grace period were dropped"
        );
    }
    tracing::debug!(took = ?stopping.elapsed(), "stopped");
    Ok(())
}

/// The agent's part of the loop: windows aligned to the wall clock and
/// on-demand pulls ([`Cuts`]), shipped to the backends ([`ServiceSinks`]),
/// health, metrics, and the discovery of idle .NET processes.
struct AgentFront {
    cuts: Cuts,
    sinks: ServiceSinks,
    /// Pull requests from `/debug/pprof/profile` (`None`: no pulls).
    pulls: Option<mpsc::Receiver<PullRequest>>,
    sighup: Signal,
    health: Arc<AgentHealth>,
    metrics: AgentMetrics,
    /// The pipeline's sample count at the last cut.
    samples_cut: u64,
    /// The same for the samples outside the selection.
    not_selected_cut: u64,
    /// BPF run time already counted in the metrics.
    bpf_seen_ns: u64,
    last_metrics: Instant,
    last_runtime_metrics: Instant,
    last_discovery: Instant,
}

impl Front for AgentFront {
    async fn event(&mut self) {
        tokio::select! {
            Some(request) = async { self.pulls.as_mut().expect("guarded").recv().await }, if self.pulls.is_some() => {
                self.cuts.add_pull(SystemTime::now(), request);
            }
            _ = self.sighup.recv() => tracing::info!("SIGHUP ignored: the agent reloads nothing"),
        }
    }

    fn stop_signal(&mut self, signal: StopSignal) -> &'static str {
        match signal {
            StopSignal::Interrupt => "SIGINT",
            StopSignal::Terminate => "SIGTERM",
        }
    }

    fn quiet_tick(&self) -> Duration {
        QUIET_TICK
    }

    fn after_tick(&mut self, cutter: &mut Cutter<'_>, sampler: &Sampler) -> Option<&'static str> {
        self.health.beat();
        // Never fails: the sinks queue what they are given.
        let _ = cutter.cut_due(&mut self.cuts, &mut self.sinks, SystemTime::now());
        self.count_cut(cutter);
        self.metrics
            .pulls_running
            .set(i64::try_from(self.cuts.running_pulls()).unwrap_or(i64::MAX));
        let pipeline = cutter.pipeline();
        if self.last_discovery.elapsed() >= DISCOVER_EVERY {
            self.last_discovery = Instant::now();
            pipeline.track_dotnet_processes();
        }
        if self.last_metrics.elapsed() >= METRICS_EVERY {
            self.last_metrics = Instant::now();
            let runtime = self.last_runtime_metrics.elapsed() >= RUNTIME_METRICS_EVERY;
            if runtime {
                self.last_runtime_metrics = Instant::now();
            }
            update_metrics(
                &self.metrics,
                pipeline,
                sampler,
                &mut self.bpf_seen_ns,
                runtime,
            );
        }
        None
    }

    fn finish(&mut self, cutter: &mut Cutter<'_>, end: SystemTime) -> anyhow::Result<()> {
        let shipped = cutter.cut_last(&mut self.cuts, &mut self.sinks, end);
        self.count_cut(cutter);
        shipped
    }
}

impl AgentFront {
    /// After a cut: counts the samples it took, and logs the pipeline's
    /// warnings (`record` prints them at the end; the agent logs those of
    /// each cut, grouped: one line per kind, not per process).
    fn count_cut(&mut self, cutter: &mut Cutter<'_>) {
        if cutter.parts() == 0 {
            return;
        }
        let pipeline = cutter.pipeline();
        let samples = pipeline.samples_added();
        let taken = samples.saturating_sub(self.samples_cut);
        self.samples_cut = samples;
        let not_selected = pipeline.samples_not_selected();
        let dropped = not_selected.saturating_sub(self.not_selected_cut);
        self.not_selected_cut = not_selected;
        for warning in pipeline.take_warnings().lines() {
            tracing::warn!("{warning}");
        }
        self.metrics
            .samples
            .get_or_create(&vec![("kind", "all")])
            .inc_by(taken);
        if dropped > 0 {
            self.metrics
                .samples
                .get_or_create(&vec![("kind", "not_selected")])
                .inc_by(dropped);
        }
    }
}

/// Starts the HTTP endpoint on `--listen`; with `--enable-pull`, also the
/// receiver of the pulls the loop must take (no pull machinery at all
/// without it).
fn start_http(
    config: &AgentConfig,
    metrics: &AgentMetrics,
    health: &Arc<AgentHealth>,
) -> anyhow::Result<(HttpServer, Option<mpsc::Receiver<PullRequest>>)> {
    let listener = std::net::TcpListener::bind(config.listen)
        .with_context(|| format!("--listen {}: cannot listen there", config.listen))?;
    let (pull, pulls) = match &config.pull {
        Some(pull) => {
            let (puller, requests) = LoopPuller::new();
            let profiler = Arc::new(puller) as Arc<dyn PullProfiler>;
            let endpoint = PullEndpoint::new(profiler, pull.max_seconds, pull.token.clone());
            (Some(endpoint), Some(requests))
        }
        None => (None, None),
    };
    let http = HttpServer::start(
        listener,
        super::http::router(HttpState::new(metrics.clone(), Arc::clone(health), pull)),
        ServerLimits::agent(config.grace_period),
        metrics.shed_connections(),
    )
    .context("start the HTTP endpoint")?;
    Ok((http, pulls))
}

/// Raises the soft limit on open files to the hard one: the agent holds
/// perf events, BPF maps and /proc files, and a busy node's connections
/// must not run it out of descriptors at the usual soft limit of 1024.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit write and read the struct passed.
    let raised = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && {
            let soft = limit.rlim_cur;
            limit.rlim_cur = limit.rlim_max;
            soft >= limit.rlim_max || libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0
        }
    };
    if !raised {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot raise the open files limit (RLIMIT_NOFILE) to its hard limit"
        );
    }
}

/// How long the loop waits after a tick that found nothing to do: beside
/// idle processes the agent wakes four times a second, not twenty. A
/// window is cut at most this much later; pulls, stop signals, a quarter
/// full ring and a full CLR session channel wake the loop at once.
const QUIET_TICK: Duration = Duration::from_millis(250);

/// How often the agent looks for .NET processes that no sample brought in
/// (idle services still get their `dotnet_*` series).
const DISCOVER_EVERY: Duration = Duration::from_secs(5);

/// How often the agent's own gauges are updated.
const METRICS_EVERY: Duration = Duration::from_secs(1);

/// How often the `dotnet_*` series are updated: each update reads every
/// .NET process's `/proc` CPU time and memory and copies its counters
/// (0.23% of a core a second beside 50 idle processes); a scrape every
/// 15 s or more sees them at most this much older.
const RUNTIME_METRICS_EVERY: Duration = Duration::from_secs(5);

/// Copies the sampler's and the pipeline's state into the agent's own
/// series and, with `runtime_series`, publishes each .NET process's
/// runtime metrics (a process that exited leaves the `dotnet_*` series).
fn update_metrics(
    metrics: &AgentMetrics,
    pipeline: &mut Pipeline,
    sampler: &Sampler,
    bpf_seen_ns: &mut u64,
    runtime_series: bool,
) {
    let counters = sampler.counters();
    metrics
        .samples_lost
        .inner()
        .store(counters.samples_lost, std::sync::atomic::Ordering::Relaxed);
    let bpf_ns =
        sampler.on_cpu_program_stats().run_time_ns + sampler.off_cpu_program_stats().run_time_ns;
    metrics
        .bpf_run_seconds
        .inc_by(bpf_ns.saturating_sub(*bpf_seen_ns) as f64 / 1e9);
    *bpf_seen_ns = bpf_ns.max(*bpf_seen_ns);
    let naming = pipeline.naming_time();
    metrics.stack_naming_seconds.inner().store(
        naming.before_end.as_secs_f64().to_bits(),
        std::sync::atomic::Ordering::Relaxed,
    );
    metrics
        .stacks_named
        .inner()
        .store(naming.stacks, std::sync::atomic::Ordering::Relaxed);
    if let Some(downloads) = pipeline.debug_download_stats() {
        let crate::symbolize::symbol_server::DownloadStats {
            requested,
            downloaded,
            missing,
            refused,
            dropped,
        } = downloads;
        for (outcome, count) in [
            ("requested", requested),
            ("downloaded", downloaded),
            ("missing", missing),
            ("refused", refused),
            ("dropped", dropped),
        ] {
            metrics
                .symbol_downloads
                .get_or_create(&vec![("outcome", outcome)])
                .inner()
                .store(count, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let (live, dotnet) = pipeline.live_processes();
    metrics
        .processes_tracked
        .set(i64::try_from(live).unwrap_or(i64::MAX));
    metrics
        .dotnet_processes_tracked
        .set(i64::try_from(dotnet).unwrap_or(i64::MAX));
    if let Some(bytes) = pipeline.unwind_table_bytes() {
        metrics
            .unwind_table_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
    if !runtime_series {
        return;
    }
    let runtime = metrics.runtime();
    let fresh = pipeline.runtime_metrics();
    for pid in runtime.pids() {
        if !fresh.iter().any(|m| m.pid == pid) {
            runtime.remove(pid);
        }
    }
    for process in fresh {
        runtime.update(process);
    }
}
