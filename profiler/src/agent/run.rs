//! `clrbpf agent`: the continuous front end over the same pipeline as
//! `record`.
//!
//! 1. Load the kernel side for the whole host at `-F` (19 Hz by default),
//!    start the sinks' delivery queues and the HTTP endpoint.
//! 2. Every tick, [`Pipeline::tick`] drains, learns processes, runs the
//!    CLR sessions and symbolizes, as in `record`.
//! 3. Every `--upload-interval`, aligned to the wall clock, once the
//!    samples of the window are all in ([`SYMBOLIZE_DELAY`] after its end),
//!    [`Pipeline::take_window`] hands out the window's profile ([`Cuts`]
//!    also cuts at the ends of on-demand `/debug/pprof/profile` spans and
//!    merges the parts); it is split per service and profile type
//!    ([`window_batch`]) and submitted to the sinks, which never block the
//!    loop.
//! 4. On SIGTERM or SIGINT: the current window is closed and submitted,
//!    the .NET processes are restored, the sinks and the HTTP endpoint's
//!    connections get `--grace-period` (together) to finish, and the agent
//!    exits 0. SIGHUP reloads nothing and is ignored.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use tokio::{
    signal::unix::{SignalKind, signal},
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
    bpf::{Sampler, SamplerConfig, UnwindWorker, system},
    export::sink::{ClosedWindow, ProfileSink as _},
    pipeline::{Pipeline, SYMBOLIZE_DELAY, WindowSpan},
    profile::Profile,
};

/// How often the loop runs, as in `record`.
const TICK: Duration = Duration::from_millis(50);
/// Nice value of the agent's background threads.
const AGENT_NICE: i32 = -5;

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(config: AgentConfig) -> anyhow::Result<()> {
    raise_open_files_limit();
    if let Err(warning) = crate::process::priority::boost_sampling_thread(AGENT_NICE) {
        tracing::warn!("{warning}");
    }
    for warning in system::prepare()? {
        tracing::warn!("{warning}");
    }
    let metrics = AgentMetrics::new();
    let health = Arc::new(AgentHealth::new(config.upload_interval * 3));
    let sinks = build_sinks(&config, &metrics, RetryPolicy::default())?;
    let (http, mut pulls) = start_http(&config, &metrics, &health)?;

    let sampling = &config.sampling;
    let mut sampler = Sampler::start(&SamplerConfig {
        frequency_hz: config.frequency_hz,
        target_pids: None,
        user_unwind: sampling.dwarf_unwind,
        unwind_table_memory_bytes: sampling.unwind_table_memory_bytes,
        unwind_cache_dir: sampling.unwind_cache_dir.clone(),
        off_cpu: sampling.off_cpu,
        ..SamplerConfig::default()
    })?;
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
    let mut pipeline = Pipeline::new(true, sampling.clr_events, sampling.layout());
    pipeline.keep_perf_map_ledger_in(sampling.unwind_cache_dir.as_deref());
    pipeline.keep_kernel_symbols_in(sampling.unwind_cache_dir.clone());
    // The runtime's EventCounters come once per window: `dotnet_*` series
    // as fresh as the profiles (every second with an exception budget,
    // whose totals come from the exception counter).
    pipeline.clr.counters_interval_sec = Some(
        u32::try_from(config.upload_interval.as_secs())
            .unwrap_or(u32::MAX)
            .max(1),
    );
    pipeline.clr.exceptions_per_second = config.exceptions_per_second;
    pipeline.unwind = match sampler.take_unwind_maps() {
        Some(maps) => Some(UnwindWorker::spawn(maps).context("start the unwind table thread")?),
        None => None,
    };
    let clock = Clock::now();
    let mut cuts = Cuts::new(
        SystemTime::now(),
        config.upload_interval,
        config.selection.clone(),
    );
    let mut shipper = Shipper {
        sinks: ServiceSinks::new(
            sinks,
            metrics.clone(),
            config.selection.clone(),
            config.max_services,
        ),
        metrics: &metrics,
        period_ns: sampler.period_ns,
        samples_cut: 0,
    };

    let mut sigint = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let mut sighup = signal(SignalKind::hangup()).context("install the SIGHUP handler")?;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut raw = Vec::with_capacity(4096);
    let mut last_metrics = Instant::now();
    // At once, then every DISCOVER_EVERY.
    let mut last_discovery = Instant::now()
        .checked_sub(DISCOVER_EVERY)
        .unwrap_or_else(Instant::now);
    let mut bpf_seen_ns = 0u64;
    let ring = sampler.ring_wakeups();
    if let Err(error) = &ring {
        tracing::warn!(%error, "the sample ring cannot be polled: drained on the timer only");
    }
    let stopped_by = loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = async { ring.as_ref().expect("guarded").woken().await }, if ring.is_ok() => {}
            Some(request) = async { pulls.as_mut().expect("guarded").recv().await }, if pulls.is_some() => {
                cuts.add_pull(SystemTime::now(), request);
            }
            _ = sigint.recv() => break "SIGINT",
            _ = sigterm.recv() => break "SIGTERM",
            _ = sighup.recv() => tracing::info!("SIGHUP ignored: the agent reloads nothing"),
        }
        pipeline.tick(&mut sampler, &mut raw);
        health.beat();
        let closed = cuts.cut_due(SystemTime::now(), SYMBOLIZE_DELAY, &mut |from, to| {
            shipper.take(&mut pipeline, clock.span(from, to))
        });
        metrics
            .pulls_running
            .set(i64::try_from(cuts.running_pulls()).unwrap_or(i64::MAX));
        for window in closed {
            shipper.ship(window);
        }
        if last_discovery.elapsed() >= DISCOVER_EVERY {
            last_discovery = Instant::now();
            pipeline.track_dotnet_processes();
        }
        if last_metrics.elapsed() >= METRICS_EVERY {
            last_metrics = Instant::now();
            update_metrics(&metrics, &mut pipeline, &sampler, &mut bpf_seen_ns);
        }
    };
    tracing::info!("{stopped_by}: closing the last window");
    let stopping = Instant::now();
    crate::stop::arm_second_request().ok();
    pipeline.pull(&mut sampler, &mut raw);
    let end = SystemTime::now();
    if let Some(unwind) = pipeline.unwind.take() {
        let _ = unwind.finish();
    }
    drop(ring);
    drop(sampler);
    pipeline.finish_clr();
    pipeline.process_all();
    let last = cuts.finish(end, &mut |from, to| {
        shipper.take(&mut pipeline, clock.span(from, to))
    });
    shipper.ship(last);
    pipeline.restore_processes(false);
    // The sinks and the HTTP connections share the grace period: a client
    // holding a connection open cannot hold the exit.
    let (report, ()) = tokio::join!(shipper.sinks.flush(config.grace_period), http.stop());
    if report.abandoned > 0 {
        tracing::warn!(
            windows = report.abandoned,
            "windows not delivered within the grace period were dropped"
        );
    }
    tracing::debug!(took = ?stopping.elapsed(), "stopped");
    Ok(())
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

/// How often the agent looks for .NET processes that no sample brought in
/// (idle services still get their `dotnet_*` series).
const DISCOVER_EVERY: Duration = Duration::from_secs(5);

/// How often the agent's own gauges and the `dotnet_*` series are updated.
const METRICS_EVERY: Duration = Duration::from_secs(1);

/// Copies the sampler's and the pipeline's state into the agent's own
/// series, and publishes each .NET process's runtime metrics (a process
/// that exited leaves the `dotnet_*` series).
fn update_metrics(
    metrics: &AgentMetrics,
    pipeline: &mut Pipeline,
    sampler: &Sampler,
    bpf_seen_ns: &mut u64,
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
    let (live, dotnet) = pipeline.live_processes();
    metrics
        .processes_tracked
        .set(i64::try_from(live).unwrap_or(i64::MAX));
    metrics
        .dotnet_processes_tracked
        .set(i64::try_from(dotnet).unwrap_or(i64::MAX));
    if let Some(unwind) = pipeline.unwind.as_ref() {
        metrics
            .unwind_table_bytes
            .set(i64::try_from(unwind.kernel_memory_bytes()).unwrap_or(i64::MAX));
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

/// What closing a window needs besides the pipeline.
struct Shipper<'a> {
    sinks: ServiceSinks,
    metrics: &'a AgentMetrics,
    period_ns: u64,
    /// The pipeline's sample count at the last cut.
    samples_cut: u64,
}

impl Shipper<'_> {
    /// The pipeline's profile of `span` (a part of a window), counting its
    /// samples.
    fn take(&mut self, pipeline: &mut Pipeline, span: WindowSpan) -> Profile {
        let profile = pipeline.take_window(span, self.period_ns);
        let taken = pipeline.summary.samples.saturating_sub(self.samples_cut);
        self.samples_cut = pipeline.summary.samples;
        // `record` prints its warnings at the end; the agent logs those of
        // each window (grouped: one line per kind, not per process).
        for warning in std::mem::take(&mut pipeline.summary.warnings).lines() {
            tracing::warn!("{warning}");
        }
        self.metrics
            .samples
            .get_or_create(&vec![("kind", "all")])
            .inc_by(taken);
        profile
    }

    /// Submits a closed window's profiles, one per service and profile
    /// type.
    fn ship(&mut self, window: ClosedWindow) {
        // Never fails: the queues drop what they cannot deliver.
        let _ = self.sinks.submit(window);
    }
}

/// CLOCK_MONOTONIC (the clock of sample times) against the wall clock, to
/// turn wall-clock window bounds into sample-time bounds.
struct Clock {
    wall: SystemTime,
    mono_ns: u64,
}

impl Clock {
    fn now() -> Self {
        Self {
            wall: SystemTime::now(),
            mono_ns: crate::profile::monotonic_ns(),
        }
    }

    fn mono_of(&self, wall: SystemTime) -> u64 {
        match wall.duration_since(self.wall) {
            Ok(after) => self
                .mono_ns
                .saturating_add(u64::try_from(after.as_nanos()).unwrap_or(u64::MAX)),
            Err(before) => self
                .mono_ns
                .saturating_sub(u64::try_from(before.duration().as_nanos()).unwrap_or(u64::MAX)),
        }
    }

    /// The window `[from, to)`, in both clocks.
    fn span(&self, from: SystemTime, to: SystemTime) -> WindowSpan {
        let start_unix_ns = from
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        WindowSpan {
            start_ns: self.mono_of(from),
            end_ns: self.mono_of(to),
            start_unix_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_bounds_map_to_sample_time() {
        let clock = Clock {
            wall: UNIX_EPOCH + Duration::from_secs(100),
            mono_ns: 5_000_000_000,
        };
        let span = clock.span(
            UNIX_EPOCH + Duration::from_secs(99),
            UNIX_EPOCH + Duration::from_secs(115),
        );
        assert_eq!(span.start_ns, 4_000_000_000);
        assert_eq!(span.end_ns, 20_000_000_000);
        assert_eq!(span.start_unix_ns, 99_000_000_000);
    }
}
