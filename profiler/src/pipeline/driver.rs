//! The driver: the one loop around the [`Pipeline`] that `record` and the
//! agent both run, from the kernel's rings to the sinks.
//!
//! 1. [`prepare_host`]: raise clrbpf's priority, check the host.
//! 2. [`Driver::load`]: load the BPF programs ([`Sampler::load`]), make
//!    the [`Pipeline`] and its unwind-table thread ([`UnwindWorker`]),
//!    install the stop signals (Ctrl-C, SIGTERM); `record` then waits for
//!    the tables of the processes known at start
//!    ([`Driver::wait_for_start_tables`]) before
//!    [`Driver::start_sampling`] attaches the sampling programs.
//! 3. [`Driver::run`]: every tick, or when the ring wakes it,
//!    [`Pipeline::tick`] drains, learns processes and symbolizes; the
//!    command's [`Front`] takes its own events (the launched command's exit,
//!    a pull request) and, through a [`Cutter`], cuts the windows its
//!    [`WindowPolicy`] says are due and hands them to its
//!    [`ProfileSink`]. A stop signal or the front ends the loop.
//! 4. [`Driver::finish`]: drain what is left, stop the CLR sessions,
//!    symbolize everything, restore the .NET processes, cut the last
//!    window and hand back the [`RecordSummary`].
//!
//! The window policies: [`OneWindow`] for `record` (one window, the
//! whole recording), [`crate::agent::cuts::Cuts`] for the agent (windows
//! aligned to the wall clock, plus on-demand cuts for a pull).
//!
//! The options `record` and the agent share are [`SamplingConfig`],
//! checked from [`crate::cli::SamplingArgs`].

use std::{
    future::Future,
    path::PathBuf,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use tokio::signal::unix::{Signal, SignalKind, signal};

use super::{
    Pipeline, WindowSpan, start_tables,
    summary::{RecordSummary, add_still_blocked, off_cpu_threads},
};
use crate::{
    bpf::{OffCpuConfig, Sampler, SamplerConfig, UnwindWorker, system},
    cli::SamplingArgs,
    clr::session::ClrEventKinds,
    export::sink::{ClosedWindow, ProfileSink},
    profile::{Profile, RawSample},
};

/// How often the loop runs when the ring does not wake it first, while
/// the last tick found work (and always for a [`Front`] that keeps it:
/// `record`).
const TICK: Duration = Duration::from_millis(50);

/// How long the end of a recording names CPU stacks after a stop signal
/// (Ctrl-C, SIGTERM): the user waits, and a process whose every stack is new
/// and costly must not make the end take seconds. What is left is kept
/// unnamed ([`Pipeline::process_all`]).
pub const NAMING_AFTER_SIGNAL: Duration = Duration::from_millis(500);

/// The same at any other end (`--duration`, the command's exit): more, for
/// a whole profile, still bounded.
pub const NAMING_AT_END: Duration = Duration::from_secs(2);

/// Longest `--off-cpu-min` (the kernel side's keep rule takes up to 2^32 ns).
pub const MAX_OFF_CPU_MIN: Duration = Duration::from_secs(4);

/// An option the shared schema refuses; the message names the option.
#[derive(Debug, thiserror::Error)]
pub enum SamplingOptionError {
    #[error("--off-cpu-min must be more than 0 and at most 4s")]
    OffCpuMin,
    #[error("--clr-events: {0}")]
    ClrEvents(String),
}

/// What `record` and the agent collect besides CPU samples, and how they
/// walk stacks: [`SamplingArgs`], checked.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingConfig {
    /// CLR events collected from .NET processes (none: no EventPipe
    /// session).
    pub clr_events: ClrEventKinds,
    /// Allocation events with stacks per second and process at most
    /// ([`crate::clr::alloc_session`]); `None`: every one.
    pub allocations_per_second: Option<u32>,
    /// Off-CPU intervals of the profiled threads, with their wakers.
    pub off_cpu: Option<OffCpuConfig>,
    /// A `wall/nanoseconds` sample type: CPU plus off-CPU time per thread
    /// (implies [`Self::off_cpu`]).
    pub wall: bool,
    /// Walk user stacks with `.eh_frame` unwind tables in the kernel.
    pub dwarf_unwind: bool,
    /// Kernel memory for unwind tables at most.
    pub unwind_table_memory_bytes: u64,
    /// Bytes per second of user-stack copies of processes not indexed
    /// yet (`--stack-copy-kib-per-second`).
    pub stack_copy_bytes_per_second: u64,
    /// Copy every sample's user stack (`--stack-copy-every-sample`).
    pub stack_copy_always: bool,
    /// `--hold-new-processes-ms` (tests).
    pub hold_new_processes: Duration,
    /// Where unwind tables and this boot's kallsyms are kept between runs
    /// (`None`: nowhere).
    pub unwind_cache_dir: Option<PathBuf>,
    /// Which sources name managed frames.
    pub managed_names: crate::clr::name_sources::ManagedNames,
    /// `--keep-unnamed-frames`: no run of unnamed native frames grouped.
    pub keep_unnamed_frames: bool,
    /// `--debug-dir`s, searched first for native debug files.
    pub debug_dirs: Vec<PathBuf>,
    /// `--symbol-server`s and debuginfod servers (`--debuginfod-url`,
    /// else `DEBUGINFOD_URLS`).
    pub symbol_servers: Vec<crate::symbolize::symbol_server::SymbolServer>,
    /// `--symbol-download-wait`.
    pub symbol_download_wait: Duration,
    /// `--symbol-cache-mb`, in bytes.
    pub symbol_cache_bytes: u64,
}

impl SamplingConfig {
    /// Checks the shared options.
    pub fn from_args(args: SamplingArgs) -> Result<Self, SamplingOptionError> {
        let SamplingArgs {
            clr_events,
            no_clr_events,
            allocs_per_second,
            off_cpu,
            off_cpu_min,
            off_cpu_max_stacks,
            wall,
            frame_pointers_only,
            unwind_table_memory_mb,
            stack_copy_kib_per_second,
            stack_copy_every_sample,
            hold_new_processes_ms,
            cache_dir,
            no_cache,
            managed_names,
            keep_unnamed_frames,
            debug_dirs,
            symbol_servers,
            debuginfod_urls,
            symbol_download_wait,
            symbol_cache_mb,
        } = args;
        use crate::symbolize::symbol_server::{self, SymbolServer};
        let debuginfod_urls = if debuginfod_urls.is_empty() {
            symbol_server::debuginfod_urls_from_env(
                std::env::var(symbol_server::DEBUGINFOD_URLS_ENV)
                    .ok()
                    .as_deref(),
            )
        } else {
            debuginfod_urls
        };
        let symbol_servers = debuginfod_urls
            .into_iter()
            .map(SymbolServer::Debuginfod)
            .chain(symbol_servers.into_iter().map(SymbolServer::Ssqp))
            .collect();
        if off_cpu_min.is_zero() || off_cpu_min > MAX_OFF_CPU_MIN {
            return Err(SamplingOptionError::OffCpuMin);
        }
        let clr_events = if no_clr_events {
            ClrEventKinds::NONE
        } else {
            ClrEventKinds::parse(&clr_events).map_err(SamplingOptionError::ClrEvents)?
        };
        Ok(Self {
            clr_events,
            allocations_per_second: (allocs_per_second > 0).then_some(allocs_per_second),
            // --wall is CPU plus off-CPU time: it turns off-CPU on.
            off_cpu: (off_cpu || wall).then_some(OffCpuConfig {
                min_ns: u64::try_from(off_cpu_min.as_nanos()).unwrap_or(u64::MAX),
                max_stacks_per_cpu_second: off_cpu_max_stacks,
            }),
            wall,
            dwarf_unwind: !frame_pointers_only,
            unwind_table_memory_bytes: unwind_table_memory_mb << 20,
            stack_copy_bytes_per_second: stack_copy_kib_per_second << 10,
            stack_copy_always: stack_copy_every_sample,
            hold_new_processes: Duration::from_millis(hold_new_processes_ms),
            unwind_cache_dir: (!no_cache).then_some(cache_dir),
            managed_names,
            keep_unnamed_frames,
            debug_dirs,
            symbol_servers,
            symbol_download_wait,
            symbol_cache_bytes: symbol_cache_mb << 20,
        })
    }

    /// The sample types these options give the profile.
    ///
    /// Any CLR event kind gives it the sample types of the main session's
    /// three (contention, exceptions, waits), so that profiles of one
    /// host's processes keep one layout whatever each runtime has.
    pub fn layout(&self) -> crate::profile::layout::ValueLayout {
        use crate::profile::kinds::EventKind;
        let mut events = Vec::new();
        if self.clr_events.any() {
            events.extend([EventKind::Contention, EventKind::Exception, EventKind::Wait]);
        }
        if self.clr_events.contains(EventKind::Allocation) {
            events.push(EventKind::Allocation);
        }
        crate::profile::layout::ValueLayout::new(self.off_cpu.is_some(), self.wall, &events)
    }
}

/// Raises clrbpf's priority (`nice`: the nice value of its background
/// threads; `None`: leave it) so that the thread that drains the rings
/// keeps up on a saturated host, and checks the host
/// ([`system::prepare`]). Returns the warnings for the user.
pub fn prepare_host(nice: Option<i32>) -> anyhow::Result<Vec<String>> {
    let priority_warning =
        nice.and_then(|nice| crate::process::priority::boost_sampling_thread(nice).err());
    let mut warnings = system::prepare()?;
    warnings.extend(priority_warning);
    Ok(warnings)
}

/// What [`Driver::load`] loads and how the pipeline runs.
#[derive(Clone, Debug)]
pub struct DriverSetup {
    pub sampling: SamplingConfig,
    pub frequency_hz: u64,
    /// The processes profiled (`None`: the whole host).
    pub target_pids: Option<Vec<u32>>,
    /// Ask running .NET 8+ processes for perf maps.
    pub attach_perf_maps: bool,
    /// Keep the perf files clrbpf made processes write.
    pub keep_perf_maps: bool,
    /// Exception events with stacks per second and process at most.
    pub exceptions_per_second: Option<u32>,
    /// How often the runtime's EventCounters come (`None`: not asked for).
    pub counters_interval_sec: Option<u32>,
    /// At the end, count the waits of threads still blocked up to then
    /// (`record`: the profile and the exact totals agree).
    pub count_still_blocked: bool,
}

/// The stop signals every command honours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM.
    Terminate,
}

/// The kernel side, the pipeline and the stop signals of one run.
pub struct Driver {
    pipeline: Pipeline,
    sampler: Sampler,
    raw: Vec<RawSample>,
    sigint: Signal,
    sigterm: Signal,
    keep_perf_maps: bool,
    count_still_blocked: bool,
    /// The period of one CPU sample, as the kernel side stamps it.
    period_ns: u64,
    /// Sample time against the wall clock, from [`Self::start_sampling`].
    clock: Clock,
    started: Instant,
    /// `--hold-new-processes-ms`, applied once sampling starts.
    hold_new_processes: Duration,
    /// Whether a stop signal ended the loop: the end's naming then has
    /// [`NAMING_AFTER_SIGNAL`], not [`NAMING_AT_END`].
    signalled: bool,
}

impl Driver {
    /// Loads the BPF programs, makes the pipeline and the unwind-table
    /// thread, installs the stop signals.
    pub fn load(setup: DriverSetup) -> anyhow::Result<Self> {
        let DriverSetup {
            sampling,
            frequency_hz,
            target_pids,
            attach_perf_maps,
            keep_perf_maps,
            exceptions_per_second,
            counters_interval_sec,
            count_still_blocked,
        } = setup;
        // First: a stop asked for while the programs load (or while the
        // ledger of a killed run is undone) ends the run cleanly, rather
        // than killing clrbpf by the signal's default action.
        let sigint = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
        let sigterm = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
        tracing::debug!("loading the BPF programs");
        let mut sampler = Sampler::load(&SamplerConfig {
            frequency_hz,
            target_pids,
            user_unwind: sampling.dwarf_unwind,
            unwind_table_memory_bytes: sampling.unwind_table_memory_bytes,
            stack_copy_bytes_per_second: sampling.stack_copy_bytes_per_second,
            stack_copy_always: sampling.stack_copy_always,
            unwind_cache_dir: sampling.unwind_cache_dir.clone(),
            off_cpu: sampling.off_cpu,
            ..SamplerConfig::default()
        })?;
        let attach_perf_maps = attach_perf_maps && sampling.managed_names.uses_perf_maps();
        let mut pipeline = Pipeline::new(attach_perf_maps, sampling.clr_events, sampling.layout());
        pipeline.managed_names = sampling.managed_names;
        pipeline.keep_unnamed_frames(sampling.keep_unnamed_frames);
        pipeline.set_debug_dirs(sampling.debug_dirs.clone());
        match &sampling.unwind_cache_dir {
            Some(dir) => pipeline.set_symbol_servers(
                sampling.symbol_servers.clone(),
                dir,
                sampling.symbol_cache_bytes,
            ),
            None if !sampling.symbol_servers.is_empty() => {
                tracing::warn!("symbol servers need the cache directory (no --no-cache): not used");
            }
            None => {}
        }
        pipeline.symbol_download_wait = sampling.symbol_download_wait;
        pipeline.keep_perf_files = keep_perf_maps;
        pipeline.keep_perf_map_ledger_in(sampling.unwind_cache_dir.as_deref());
        pipeline.keep_kernel_symbols_in(sampling.unwind_cache_dir);
        pipeline.clr.exceptions_per_second = exceptions_per_second;
        pipeline.clr.allocations_per_second = sampling.allocations_per_second;
        pipeline.clr.counters_interval_sec = counters_interval_sec;
        pipeline.unwind = match sampler.take_unwind_maps() {
            Some(maps) => Some(UnwindWorker::spawn(maps).context("start the unwind table thread")?),
            None => None,
        };
        let period_ns = sampler.period_ns;
        let hold_new_processes = sampling.hold_new_processes;
        Ok(Self {
            pipeline,
            sampler,
            raw: Vec::with_capacity(4096),
            sigint,
            sigterm,
            keep_perf_maps,
            count_still_blocked,
            period_ns,
            clock: Clock::now(),
            started: Instant::now(),
            hold_new_processes,
            signalled: false,
        })
    }

    /// The processes given on the command line, tracked from the start.
    pub fn track(&mut self, pids: &[u32]) {
        for &pid in pids {
            self.pipeline.track(pid);
        }
    }

    /// Before sampling starts, waits at most `limit` for the unwind tables
    /// of `targets` ([`start_tables::start_targets`]), so that their first
    /// stacks are whole, drawing progress on stderr when `progress`.
    /// Returns the stop signal's reason if one came meanwhile.
    pub async fn wait_for_start_tables(
        &mut self,
        targets: (Vec<u32>, usize),
        limit: Duration,
        progress: bool,
    ) -> Option<&'static str> {
        self.pipeline.unwind.as_ref()?;
        let Self {
            pipeline,
            sigint,
            sigterm,
            ..
        } = self;
        let stop = async {
            tokio::select! {
                _ = sigint.recv() => "Ctrl-C",
                _ = sigterm.recv() => "SIGTERM",
            }
        };
        let (tables, stopped) =
            start_tables::wait_for_tables(pipeline, targets, limit, progress, stop).await;
        self.signalled |= stopped.is_some();
        tracing::debug!(?tables, "unwind tables at start");
        pipeline.summary.warnings.extend(tables.warning());
        pipeline.summary.tables_at_start = Some(tables);
        stopped
    }

    /// Attaches the sampling programs: samples are taken from now on, the
    /// start of the first window.
    pub fn start_sampling(&mut self) -> anyhow::Result<()> {
        self.sampler.start_sampling()?;
        if let Some(unwind) = self.pipeline.unwind.as_ref() {
            unwind.hold_new_processes(self.hold_new_processes);
        }
        self.clock = Clock::now();
        self.started = Instant::now();
        tracing::debug!("sampling started");
        Ok(())
    }

    /// When sampling started, on the wall clock.
    pub fn started_at(&self) -> SystemTime {
        self.clock.wall
    }

    /// How long since sampling started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn sampler(&mut self) -> &mut Sampler {
        &mut self.sampler
    }

    pub fn pipeline(&mut self) -> &mut Pipeline {
        &mut self.pipeline
    }

    /// Resolves on the first stop signal, with it.
    pub async fn stop_requested(&mut self) -> StopSignal {
        tokio::select! {
            _ = self.sigint.recv() => StopSignal::Interrupt,
            _ = self.sigterm.recv() => StopSignal::Terminate,
        }
    }

    /// The loop: ticks until a stop signal or `front` ends it; returns why
    /// it ended.
    pub async fn run(&mut self, front: &mut impl Front) -> &'static str {
        let mut next_tick = tokio::time::Instant::now();
        let ring = self.sampler.ring_wakeups();
        if let Err(error) = &ring {
            tracing::debug!(%error, "the sample ring cannot be polled: drained on the timer only");
        }
        loop {
            let stop = tokio::select! {
                () = tokio::time::sleep_until(next_tick) => None,
                () = async { ring.as_ref().expect("guarded").woken().await }, if ring.is_ok() => None,
                // A CLR session's channel is full: drain it now.
                () = crate::clr::session_reader::channel_full() => None,
                _ = self.sigint.recv() => Some(StopSignal::Interrupt),
                _ = self.sigterm.recv() => Some(StopSignal::Terminate),
                () = front.event() => None,
            };
            if let Some(signal) = stop {
                self.signalled = true;
                return front.stop_signal(signal);
            }
            let busy = self.pipeline.tick(&mut self.sampler, &mut self.raw);
            // A quiet host wakes the loop less often; the ring (a quarter
            // full) and a full CLR session channel still wake it at once.
            let period = if busy { TICK } else { front.quiet_tick() };
            next_tick = tokio::time::Instant::now() + period;
            let mut cutter = Cutter {
                pipeline: &mut self.pipeline,
                clock: &self.clock,
                period_ns: self.period_ns,
                parts: 0,
            };
            if let Some(reason) = front.after_tick(&mut cutter, &self.sampler) {
                return reason;
            }
        }
    }

    /// The end: drains what is left, stops the CLR sessions, symbolizes
    /// everything, restores the .NET processes, lets `front` cut its last
    /// window, and returns what the run collected (its
    /// [`RecordSummary::stopped_by`] is `stopped_by`).
    pub fn finish(
        self,
        front: &mut impl Front,
        stopped_by: &'static str,
    ) -> anyhow::Result<RecordSummary> {
        let elapsed = self.started.elapsed();
        let end = self.clock.wall + elapsed;
        // From here on, a second Ctrl-C or SIGTERM ends every wait on the
        // targets at once; the profile is still written.
        if let Err(e) = crate::stop::arm_second_request() {
            tracing::debug!(error = %e, "no handler for a second stop request");
        }
        front.stopped();
        tracing::debug!(?elapsed, "sampling stopped");
        let Self {
            mut pipeline,
            mut sampler,
            mut raw,
            sigint: _,
            sigterm: _,
            keep_perf_maps,
            count_still_blocked,
            period_ns,
            clock,
            started: _,
            hold_new_processes: _,
            signalled,
        } = self;
        // Each stage's time goes to the debug log: on a saturated host the
        // end is where a recording's time went unseen.
        let mut stage = StageClock::start();
        pipeline.pull(&mut sampler, &mut raw);
        let mut off_cpu_totals = sampler.off_cpu_totals();
        if count_still_blocked {
            let mut blocked_now = sampler.still_blocked(crate::profile::monotonic_ns());
            add_still_blocked(&mut off_cpu_totals.threads, &blocked_now);
            pipeline.accept(&mut blocked_now);
        }
        pipeline.summary.kernel = sampler.counters();
        pipeline.summary.bpf_stats = sampler.on_cpu_program_stats();
        pipeline.summary.off_cpu_bpf_stats = sampler.off_cpu_program_stats();
        stage.done("last drain");
        pipeline.flush_stack_copies();
        pipeline.finish_unwind();
        stage.done("copied stacks back, unwind thread stopped");
        // Closing the programs' perf events and maps takes the kernel a
        // few hundred ms (RCU grace periods): done meanwhile, on a thread.
        let detach = detach_in_background(sampler);
        pipeline.wait_for_debug_downloads();
        tracing::debug!("finishing CLR sessions and symbolizing");
        pipeline.finish_clr();
        stage.done("CLR sessions stopped");
        let naming_time = if signalled {
            NAMING_AFTER_SIGNAL
        } else {
            NAMING_AT_END
        };
        pipeline.process_all(Instant::now() + naming_time);
        pipeline.summary.not_named_in_time.limit = naming_time;
        pipeline.summary.not_named_in_time.hurried = crate::stop::hurry();
        stage.done("symbolized");
        pipeline.restore_processes(keep_perf_maps);
        stage.done(".NET processes restored");
        pipeline.count_evictions();
        let mut cutter = Cutter {
            pipeline: &mut pipeline,
            clock: &clock,
            period_ns,
            parts: 0,
        };
        let written = front.finish(&mut cutter, end);
        stage.done("profile written");
        if let Some(detach) = detach {
            let _ = detach.join();
            stage.done("programs detached");
        }
        // What is left is to report and exit: no thread of clrbpf is to
        // keep the process waiting for the CPU to end.
        crate::process::exit::hurry_threads_to_exit();
        written?;
        let mut summary = std::mem::take(&mut pipeline.summary);
        summary.off_cpu_other_threads = (off_cpu_totals.other_threads, off_cpu_totals.others);
        summary.off_cpu_threads = off_cpu_threads(
            off_cpu_totals.threads,
            &pipeline.thread_names,
            &pipeline.off_cpu_recorded,
        );
        summary.duration = elapsed;
        summary.samples_lost = summary.kernel.samples_lost;
        summary.stopped_by = stopped_by;
        Ok(summary)
    }
}

/// Drops `sampler` (detaches its programs, closes its maps) on a thread of
/// its own, returned to be joined; if no thread can be started, the
/// closure is dropped, and the sampler with it, here.
fn detach_in_background(sampler: Sampler) -> Option<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("clrbpf-detach".to_owned())
        .spawn(move || drop(sampler))
        .ok()
}

/// Times the stages of [`Driver::finish`] for the debug log.
struct StageClock(Instant);

impl StageClock {
    fn start() -> Self {
        Self(Instant::now())
    }

    /// Logs the time since the last stage ended as `stage`'s.
    fn done(&mut self, stage: &str) {
        tracing::debug!(took = ?self.0.elapsed(), "end of the recording: {stage}");
        self.0 = Instant::now();
    }
}

impl Pipeline {
    /// Samples added to the profile so far.
    pub fn samples_added(&self) -> u64 {
        self.summary.samples
    }

    /// Of those, the samples of processes outside the selection, dropped
    /// before they were named ([`Self::select_processes`]).
    pub fn samples_not_selected(&self) -> u64 {
        self.summary.samples_not_selected
    }

    /// The warnings gathered since the last call (the agent logs them).
    pub fn take_warnings(&mut self) -> super::summary::Warnings {
        std::mem::take(&mut self.summary.warnings)
    }

    /// Kernel memory the unwind tables take (`None`: frame pointers only).
    pub fn unwind_table_bytes(&self) -> Option<u64> {
        self.unwind.as_ref().map(UnwindWorker::kernel_memory_bytes)
    }

    /// Notes when the first sample came, after `since_ns` (sample time),
    /// for the summary. The samples are held back [`super::SYMBOLIZE_DELAY`]
    /// before they are added: the first ones are still pending.
    pub fn note_first_sample(&mut self, since_ns: u64) {
        if self.summary.first_sample_after.is_none() {
            self.summary.first_sample_after = self
                .pending
                .iter()
                .map(|s| s.time_ns)
                .min()
                .map(|t| Duration::from_nanos(t.saturating_sub(since_ns)));
        }
    }

    /// Stops the unwind-table thread and takes its report into the
    /// summary (before the sampler, which owns the maps, is dropped).
    fn finish_unwind(&mut self) {
        if let Some(unwind) = self.unwind.take() {
            self.summary.stack_copies = unwind.stack_copy_stats();
            self.summary.unwind = unwind.finish();
            if self.summary.unwind.is_none() {
                self.summary.warnings.push(
                    "the unwind-table thread was still building tables when the recording ended (a saturated host?): stacks of the processes it had not indexed were walked by frame pointers".to_owned(),
                );
            }
        }
    }
}

/// What a command adds to the driver's loop: its own events, when it
/// stops, and the windows it cuts (by its [`WindowPolicy`]) for its
/// [`ProfileSink`]s.
pub trait Front {
    /// Waits for an event of the command's own (the launched command's
    /// exit, a pull request, SIGHUP) and takes it in; never resolves if
    /// there is none. Must be cancel safe: the loop drops it when
    /// something else wakes first.
    fn event(&mut self) -> impl Future<Output = ()>;

    /// A stop signal came: what ends the loop, in the user's words.
    fn stop_signal(&mut self, signal: StopSignal) -> &'static str;

    /// How long the loop waits after a tick that found nothing to do (no
    /// samples, no runtime with work due) before the next, unless
    /// something wakes it first. By default the busy tick: a front that
    /// checks its own clock after each tick (`record --duration`) keeps
    /// its precision.
    fn quiet_tick(&self) -> Duration {
        TICK
    }

    /// After every tick: cuts what is due; `Some(why)` ends the loop.
    fn after_tick(&mut self, cutter: &mut Cutter<'_>, sampler: &Sampler) -> Option<&'static str>;

    /// The loop ended (the samples are not all in yet).
    fn stopped(&mut self) {}

    /// Every sample is in: cuts the last window, up to `end`.
    fn finish(&mut self, cutter: &mut Cutter<'_>, end: SystemTime) -> anyhow::Result<()>;
}

/// When windows are cut.
pub trait WindowPolicy {
    /// Cuts the windows due at `now` (their samples all in), each part
    /// `[from, to)` taken with `take`, and returns those that closed.
    fn due(
        &mut self,
        now: SystemTime,
        take: &mut dyn FnMut(SystemTime, SystemTime) -> Profile,
    ) -> Vec<ClosedWindow>;

    /// At the end: the last window, up to `end`.
    fn last(
        &mut self,
        end: SystemTime,
        take: &mut dyn FnMut(SystemTime, SystemTime) -> Profile,
    ) -> ClosedWindow;
}

/// `record`'s policy: one window, from the start of sampling to its end.
pub struct OneWindow {
    pub start: SystemTime,
}

impl WindowPolicy for OneWindow {
    fn due(
        &mut self,
        _now: SystemTime,
        _take: &mut dyn FnMut(SystemTime, SystemTime) -> Profile,
    ) -> Vec<ClosedWindow> {
        Vec::new()
    }

    fn last(
        &mut self,
        end: SystemTime,
        take: &mut dyn FnMut(SystemTime, SystemTime) -> Profile,
    ) -> ClosedWindow {
        ClosedWindow {
            profile: take(self.start, end),
            start: self.start,
            duration: end.duration_since(self.start).unwrap_or_default(),
        }
    }
}

/// Cuts the pipeline's samples into windows, for a [`Front`].
pub struct Cutter<'a> {
    pipeline: &'a mut Pipeline,
    clock: &'a Clock,
    /// The period of one CPU sample.
    period_ns: u64,
    /// Parts taken since this cutter was made.
    parts: usize,
}

impl Cutter<'_> {
    /// Cuts what `policy` says is due at `now` and submits each closed
    /// window to `sink`.
    pub fn cut_due(
        &mut self,
        policy: &mut impl WindowPolicy,
        sink: &mut impl ProfileSink,
        now: SystemTime,
    ) -> anyhow::Result<()> {
        let closed = policy.due(now, &mut |from, to| self.take(from, to));
        for window in closed {
            sink.submit(window)?;
        }
        Ok(())
    }

    /// Cuts the last window, up to `end`, and submits it to `sink`.
    pub fn cut_last(
        &mut self,
        policy: &mut impl WindowPolicy,
        sink: &mut impl ProfileSink,
        end: SystemTime,
    ) -> anyhow::Result<()> {
        let last = policy.last(end, &mut |from, to| self.take(from, to));
        sink.submit(last).context("write the profile")
    }

    /// The profile of `[from, to)`.
    fn take(&mut self, from: SystemTime, to: SystemTime) -> Profile {
        self.parts += 1;
        self.pipeline
            .take_window(self.clock.span(from, to), self.period_ns)
    }

    /// Parts cut so far by this cutter (of windows or pulls).
    pub fn parts(&self) -> usize {
        self.parts
    }

    pub fn pipeline(&mut self) -> &mut Pipeline {
        self.pipeline
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
