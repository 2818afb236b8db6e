//! The pipeline that `record` drives: raw samples from the kernel in,
//! aggregated, symbolized samples out.
//!
//! 1. [`Pipeline::accept`] takes the raw samples a tick drained and learns
//!    each new process once ([`tracked::TrackedProcess`]: who it is, its
//!    mappings, and its runtime behind the seam of [`crate::runtime`]: for
//!    .NET, perf maps and EventPipe session).
//! 2. [`Pipeline::process_pending`] symbolizes them a little after they
//!    were taken (the runtime writes a method's perf map line right after
//!    compiling it): [`crate::symbolize::stack`] turns a raw stack into
//!    frames, `labels` gives it its labels and the value layout
//!    ([`crate::profile::layout`]) its values in the [`Aggregator`];
//!    off-CPU samples and their wakers are composed in `wakers`. CLR
//!    events enter there too, as samples of their own kinds ([`resolve`]).
//! 3. At the end, the .NET processes are restored (perf maps off, the
//!    perf files clrbpf asked for removed; [`perf_maps`] sees that none is
//!    forgotten, even by a killed run) and the profile goes to the export
//!    stage; [`summary`] says what was collected.

pub mod driver;
mod labels;
pub mod perf_maps;
pub mod raw_stacks;
pub mod resolve;
mod reuse;
pub mod selection;
mod stack_copies;
pub mod start_tables;
pub mod summary;
pub mod tracked;
mod visits;
mod wakers;

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
};

use self::{
    raw_stacks::RawStacks,
    resolve::add_clr_samples,
    summary::{ClrProcessTotals, RecordSummary},
    tracked::TrackedProcess,
};
use crate::{
    bpf::UnwindWorker,
    clr::{
        collector::ClrSettings,
        counters::{ProcessRuntimeMetrics, ProcessUsage},
        instance::{DotnetDetached, DotnetEventsEnd},
        perf_map_attach::PerfMapAttach,
        session::ClrEventKinds,
    },
    process::{ProcFs, list_pids},
    profile::{Aggregator, Profile, RawSample, ValueType, layout::ValueLayout},
    runtime::{RuntimeInstance, RuntimeLoader},
    symbolize::{
        native::NativeSymbolizer,
        stack::{FrameCounts, StackNamer},
    },
    unwind::stack_copy::CopiedSample,
};

/// How long the end of a recording waits for the EventPipe sessions (all
/// of them together) to deliver their last events after StopTracing.
const CLR_STOP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(1);

/// How long after a sample was taken it is symbolized: the runtime writes a
/// method's perf map line right after JIT-compiling it, and we read the
/// file on a timer.
pub const SYMBOLIZE_DELAY: std::time::Duration = std::time::Duration::from_millis(300);

/// How long the end of a recording waits for the runtimes (all of them
/// together) to turn their perf maps off again.
const DETACH_DEADLINE: std::time::Duration = std::time::Duration::from_secs(1);

/// The one frame of the CPU stacks the end of a recording had no time to
/// name ([`Pipeline::process_all`]).
pub const NOT_NAMED_IN_TIME: &str = "[not named: the end of the recording ran out of time]";

/// Most samples held back for a late perf map (about 4 KiB each at most).
const MAX_RETRY_SAMPLES: usize = 200_000;

/// Where raw samples come from: the kernel ([`crate::bpf::Sampler`]) or,
/// in tests, a fake.
pub trait SampleSource {
    /// Moves the samples taken since the last call into `out`, and the
    /// process exits and execs into `events` (in the order the kernel
    /// reported them); returns how many malformed records were skipped.
    fn drain(
        &mut self,
        out: &mut Vec<RawSample>,
        events: &mut Vec<crate::bpf::ProcessEventAt>,
    ) -> u64;

    /// The samples drained so far whose user stack the kernel copied
    /// (their processes were not indexed yet).
    fn take_stack_copies(&mut self) -> Vec<CopiedSample> {
        Vec::new()
    }
}

impl SampleSource for crate::bpf::Sampler {
    fn drain(
        &mut self,
        out: &mut Vec<RawSample>,
        events: &mut Vec<crate::bpf::ProcessEventAt>,
    ) -> u64 {
        self.drain_with_events(out, events)
    }

    fn take_stack_copies(&mut self) -> Vec<CopiedSample> {
        crate::bpf::Sampler::take_stack_copies(self)
    }
}

/// The span of one window: CLOCK_MONOTONIC bounds (the clock of sample
/// times), `[start_ns, end_ns)`, and the wall-clock time of its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowSpan {
    pub start_ns: u64,
    pub end_ns: u64,
    pub start_unix_ns: i64,
}

/// Turns raw samples into aggregated, symbolized ones.
pub struct Pipeline {
    procfs: ProcFs,
    attach_perf_maps: bool,
    /// What each .NET process's runtime is asked for: CLR events, the
    /// `System.Runtime` EventCounters (the agent's `dotnet_*` series,
    /// [`Self::runtime_metrics`]) and the exception budget
    /// ([`crate::clr::budget`]).
    clr: ClrSettings,
    native: NativeSymbolizer,
    processes: HashMap<u32, TrackedProcess>,
    aggregator: Aggregator,
    pending: VecDeque<RawSample>,
    summary: RecordSummary,
    stack: Vec<u32>,
    /// Names one raw stack at a time.
    namer: StackNamer,
    /// Memory for managed symbols, shared by every process: the least
    /// recently used processes' tables go first.
    managed_budget: crate::symbolize::managed::ManagedSymbolBudget,
    /// Process exits and execs reported by the kernel, in ring order: each
    /// is applied once every sample taken before it has been added.
    lifecycle: VecDeque<crate::bpf::ProcessEvent>,
    /// The kernel's count of records it could not write, at the last look.
    losses_seen: u64,
    /// Whether perf files of processes clrbpf asked for are kept.
    keep_perf_files: bool,
    /// How long the end waits for debug files being downloaded.
    pub symbol_download_wait: std::time::Duration,
    /// Which sources name managed frames (`--managed-names`).
    pub managed_names: crate::clr::name_sources::ManagedNames,
    /// Parsed assemblies every process shares (ReadyToRun names, metadata).
    assemblies: crate::symbolize::ready_to_run::AssemblyCache,
    /// The jitdumps' ReadyToRun entries, shared by every .NET process.
    image_code: crate::symbolize::managed::SharedImageCode,
    /// Makes each .NET process's reader of JIT-compiled code in memory.
    pub jit_memory: crate::clr::name_sources::JitMemoryFactory,
    /// Tells which processes' jitdumps grew since they were last read.
    file_watch: crate::symbolize::file_watch::FileWatch,
    /// The processes whose samples are wanted (`None`: all of them).
    selection: Option<Box<dyn selection::ProcessFilter>>,
    /// Abandoned attaches and the ledger of perf maps turned on.
    perf_maps: perf_maps::PerfMapKeeper,
    /// CPU samples of the current window counted by raw stack, named when
    /// the window closes.
    raw_cpu: RawStacks,
    /// Samples waiting for a perf map that names their JIT frames.
    retry: Vec<RawSample>,
    unwind: Option<UnwindWorker>,
    layout: ValueLayout,
    /// Thread names seen in samples, for the off-CPU totals.
    thread_names: HashMap<u32, Arc<str>>,
    /// Off-CPU nanoseconds (upscaled) and waits the profile holds, per tid.
    off_cpu_recorded: HashMap<u32, (u64, u64)>,
    /// Pids [`Self::track_dotnet_processes`] looked at without finding a
    /// runtime, and how many times.
    dotnet_scanned: HashMap<u32, u8>,
    /// When [`Self::log_sizes`] last wrote its debug line.
    sizes_logged_at: std::time::Instant,
    /// Tracked pids without a `/proc` entry at the last check, and when it
    /// was ([`Self::retire_vanished`]).
    vanished: (HashSet<u32>, std::time::Instant),
    /// The processes whose runtimes the next tick polls ([`Self::poll_clr`]).
    clr_visits: visits::Visits,
    /// The processes whose new JIT code the next tick takes
    /// ([`Self::send_new_jit_code`]).
    jit_visits: visits::Visits,
    /// When the perf map ledger was last brought up to date
    /// ([`Self::keep_perf_map_ledger`]).
    ledger_kept_at: std::time::Instant,
    /// When the raw stacks that need no runtime were last named
    /// ([`Self::name_native_stacks`]).
    native_stacks_named_at: std::time::Instant,
}

/// How often the raw CPU stacks that need no runtime to be named (kernel
/// and file-backed code of processes without one) are named and added,
/// rather than held to the window's end: `record`'s one window would
/// otherwise hold every distinct raw stack of the host's long-lived
/// processes for the whole recording, each larger than its named sample.
const NATIVE_STACKS_NAMED_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// How long after its exit event a process's late samples are still its
/// own (see [`Pipeline::apply_lifecycle`]).
const EXIT_GRACE_NS: u64 = 50_000_000;

/// How often tracked processes are checked for having vanished without an
/// exit event seen for them ([`Pipeline::retire_vanished`]).
const VANISHED_CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// How often every tracked process's runtime is polled and its new JIT
/// code taken, besides the ticks where something marks it
/// ([`visits::Visits`]): how late time-driven work can be (a CLR sampling
/// window closing, code found by polling a perf map or the runtime's
/// memory, itself checked every second).
const VISIT_ALL_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// How many scans a process that shows no .NET runtime gets (a `dotnet`
/// host maps `libcoreclr.so` a moment after it starts).
const DOTNET_SCANS: u8 = 3;

impl Pipeline {
    /// How many processes have been seen.
    pub fn process_count(&self) -> usize {
        self.summary.processes
    }

    /// Processes tracked now (exited ones are let go of), and how many of
    /// them run .NET.
    pub fn live_processes(&self) -> (usize, usize) {
        let dotnet = self
            .processes
            .values()
            .filter(|p| p.runtime().is_some_and(RuntimeInstance::names_code))
            .count();
        (self.processes.len(), dotnet)
    }

    pub fn new(attach_perf_maps: bool, clr_events: ClrEventKinds, layout: ValueLayout) -> Self {
        Self {
            procfs: ProcFs::default(),
            attach_perf_maps,
            clr: ClrSettings {
                kinds: clr_events,
                counters_interval_sec: None,
                exceptions_per_second: None,
                allocations_per_second: None,
            },
            native: NativeSymbolizer::new(),
            processes: HashMap::new(),
            aggregator: Aggregator::new(layout.types.clone()),
            pending: VecDeque::new(),
            summary: RecordSummary::default(),
            stack: Vec::with_capacity(256),
            namer: StackNamer::default(),
            managed_budget: crate::symbolize::managed::ManagedSymbolBudget::new(
                crate::memory_budget::current().managed_symbol_bytes(),
            ),
            lifecycle: VecDeque::new(),
            losses_seen: 0,
            keep_perf_files: false,
            symbol_download_wait: std::time::Duration::from_secs(20),
            managed_names: crate::clr::name_sources::ManagedNames::default(),
            assemblies: crate::symbolize::ready_to_run::AssemblyCache::new(
                usize::try_from(crate::memory_budget::current().assembly_bytes())
                    .unwrap_or(usize::MAX),
            ),
            image_code: crate::symbolize::managed::SharedImageCode::new(
                crate::memory_budget::current().shared_image_code_bytes(),
            ),
            jit_memory: crate::clr::memory::names::jit_memory_reader,
            file_watch: crate::symbolize::file_watch::FileWatch::new(),
            selection: None,
            perf_maps: perf_maps::PerfMapKeeper::default(),
            raw_cpu: RawStacks::default(),
            retry: Vec::new(),
            unwind: None,
            layout,
            thread_names: HashMap::new(),
            off_cpu_recorded: HashMap::new(),
            dotnet_scanned: HashMap::new(),
            sizes_logged_at: std::time::Instant::now(),
            vanished: (HashSet::new(), std::time::Instant::now()),
            clr_visits: visits::Visits::new(VISIT_ALL_EVERY, std::time::Instant::now()),
            jit_visits: visits::Visits::new(VISIT_ALL_EVERY, std::time::Instant::now()),
            ledger_kept_at: std::time::Instant::now(),
            native_stacks_named_at: std::time::Instant::now(),
        }
    }

    /// `--keep-unnamed-frames`: every unnamed native frame its own
    /// ([`StackNamer::group_unnamed`] off).
    pub fn keep_unnamed_frames(&mut self, keep: bool) {
        self.namer.group_unnamed = !keep;
    }

    /// Debug files asked of `servers`, downloaded into `cache_dir`, which
    /// keeps `max_cache_bytes` of them.
    pub fn set_symbol_servers(
        &mut self,
        servers: Vec<crate::symbolize::symbol_server::SymbolServer>,
        cache_dir: &std::path::Path,
        max_cache_bytes: u64,
    ) {
        let limits = crate::symbolize::symbol_server::DownloadLimits {
            max_cache_bytes,
            ..Default::default()
        };
        self.native.set_symbol_servers(servers, cache_dir, limits);
    }

    /// The time naming CPU stacks took so far.
    pub fn naming_time(&self) -> summary::NamingTime {
        self.summary.naming
    }

    /// What the symbol servers' downloads came to so far (`None`: no
    /// server set).
    pub fn debug_download_stats(&self) -> Option<crate::symbolize::symbol_server::DownloadStats> {
        self.native.download_stats()
    }

    /// Waits (at most `symbol_download_wait`) for debug files being
    /// downloaded, so the end of a recording names their frames.
    pub fn wait_for_debug_downloads(&self) {
        let deadline = std::time::Instant::now() + self.symbol_download_wait;
        self.native.wait_for_downloads(deadline);
    }

    /// `--debug-dir`s: looked in first for native debug files.
    pub fn set_debug_dirs(&mut self, dirs: Vec<std::path::PathBuf>) {
        self.native.set_debug_dirs(dirs);
    }

    /// Names kernel frames from this boot's table of kallsyms kept in
    /// `cache_dir` (`--cache-dir`; `None`: the live file every time).
    pub fn keep_kernel_symbols_in(&mut self, cache_dir: Option<std::path::PathBuf>) {
        self.native.keep_kernel_symbols_in(cache_dir);
    }

    /// Tracks the host's .NET processes that no sample has brought in yet
    /// (an idle service), so that the agent's runtime metrics cover every
    /// .NET process, busy or not. Reads the mappings of processes not
    /// tracked yet, each a few times at most; returns how many were added.
    pub fn track_dotnet_processes(&mut self) -> usize {
        let live: HashSet<u32> = list_pids(&self.procfs).into_iter().collect();
        self.dotnet_scanned.retain(|pid, _| live.contains(pid));
        let me = std::process::id();
        let mut added = 0;
        for pid in live {
            if pid == me || self.processes.contains_key(&pid) {
                continue;
            }
            let scans = self.dotnet_scanned.entry(pid).or_insert(0);
            if *scans >= DOTNET_SCANS {
                continue;
            }
            *scans += 1;
            let loader = self.loader();
            let is_dotnet = self
                .procfs
                .maps(pid)
                .is_ok_and(|maps| loader.recognises(&maps));
            if is_dotnet {
                self.dotnet_scanned.remove(&pid);
                self.track(pid);
                added += 1;
            }
        }
        added
    }

    /// The runtime metrics of every .NET process whose session carries
    /// EventCounters (see [`Self::clr`]), with its CPU
    /// time and memory read from `/proc` now.
    pub fn runtime_metrics(&mut self) -> Vec<ProcessRuntimeMetrics> {
        let procfs = &self.procfs;
        self.processes
            .values_mut()
            .filter_map(|process| {
                let (pid, executable) = (process.pid, process.exe_name.to_string());
                let k8s = labels::metric_k8s_labels(process);
                let counters = process.runtime_mut()?.runtime_counters()?;
                counters.set_usage(ProcessUsage::read(procfs, pid));
                Some(ProcessRuntimeMetrics {
                    pid,
                    executable,
                    k8s,
                    snapshot: counters.snapshot().clone(),
                })
            })
            .collect()
    }

    pub fn track(&mut self, pid: u32) {
        if !self.processes.contains_key(&pid) {
            let loader = self.loader();
            let process = TrackedProcess::discover(
                &self.procfs,
                pid,
                &mut self.native,
                loader,
                self.selection.as_deref(),
            );
            self.processes.insert(pid, process);
            self.summary.processes += 1;
            self.clr_visits.mark(pid);
            self.jit_visits.mark(pid);
            if let Some(unwind) = self.unwind.as_ref() {
                unwind.track_process(pid);
            }
        }
    }

    /// What a process's runtime is recognised by, and asked for.
    fn loader(&self) -> tracked::Loader {
        crate::clr::instance::DotnetLoader {
            attach: self.attach_perf_maps,
            clr: self.clr,
            managed_budget: self.managed_budget.clone(),
            managed_names: self.managed_names,
            assemblies: self.assemblies.clone(),
            image_code: self.image_code.clone(),
            jit_memory: self.jit_memory,
            file_watch: self.file_watch.clone(),
        }
    }

    /// Polls the runtimes that have something to do ([`visits`]): those
    /// whose sessions delivered, those busy (starting, attaching, stopping
    /// a session), every one at the backstop; a runtime still starting has
    /// its mappings read again first. Returns the pids polled.
    pub fn poll_clr(&mut self) -> Vec<u32> {
        for pid in crate::clr::session_reader::take_delivered() {
            self.clr_visits.mark(pid);
        }
        let Self {
            processes,
            procfs,
            native,
            clr_visits,
            jit_visits,
            ..
        } = self;
        let visit = clr_visits.take(std::time::Instant::now());
        let mut polled = Vec::new();
        for pid in visits::pids(visit, processes) {
            let Some(process) = processes.get_mut(&pid) else {
                continue;
            };
            let Some(runtime) = process.runtime() else {
                continue;
            };
            if runtime.needs_mappings() {
                process.refresh_maps(procfs, native);
            }
            let events = process.runtime_mut().map_or(0, RuntimeInstance::poll);
            if events > 0 {
                // Their threads' host ids and names, while they run.
                process.threads.refresh(procfs, pid);
            }
            if process.runtime().is_some_and(RuntimeInstance::busy) {
                clr_visits.mark(pid);
            }
            // Its method events may have named new code.
            jit_visits.mark(pid);
            polled.push(pid);
        }
        polled
    }

    /// Copies the bounded caches' eviction counts into the summary.
    pub fn count_evictions(&mut self) {
        let managed = self.managed_budget.stats();
        let native = self.native.stats;
        self.summary.evictions = summary::Evictions {
            managed_tables: managed.evictions,
            managed_bytes: managed.evicted_bytes,
            native_files: native.files_evicted,
            native_frames: native.frames_evicted,
            shared_image_code: self.image_code.stats(),
        };
        self.summary.debug_files = summary::DebugFileSummary {
            found: native.debug_files_found,
            frames_named: native.named_by_debug_file,
            wrong_build_id: native.debug_lookup.wrong_build_id,
            missing: self.native.missing_debug.clone(),
            missing_count: native.debug_files_missing,
            downloads: self.native.download_stats(),
        };
        self.summary.over_budget = crate::memory_budget::drops().snapshot();
        self.summary.memory_naming = crate::clr::memory::budget::global().counts.snapshot();
        self.summary.unknown_frames_over_share = self.aggregator.unknown_over_share();
    }

    /// The end of the recording: stops every session, then adds the kept
    /// CLR events, symbolized like CPU samples' user stacks at their own
    /// time and weighted so the totals are exact.
    pub fn finish_clr(&mut self) {
        // Every session is asked to stop at once, then all are drained
        // against one deadline: the end of a recording waits for the
        // slowest runtime once, not for each in turn.
        for process in self.processes.values_mut() {
            if let Some(runtime) = process.runtime_mut() {
                runtime.begin_stop();
            }
        }
        let until = std::time::Instant::now() + CLR_STOP_DEADLINE;
        let ended: Vec<(u32, DotnetEventsEnd)> = self
            .processes
            .iter_mut()
            .filter_map(|(&pid, process)| Some((pid, process.runtime_mut()?.stop_events(until)?)))
            .collect();
        for (pid, end) in ended {
            self.close_clr(pid, end);
        }
    }

    /// Takes a stopped (or ended) session's totals into the summary and
    /// adds its kept CLR samples, symbolized at their own times and
    /// weighted so the totals are exact.
    fn close_clr(&mut self, pid: u32, end: DotnetEventsEnd) {
        let Self {
            native,
            processes,
            aggregator,
            summary,
            stack,
            procfs,
            layout,
            ..
        } = self;
        let Some(process) = processes.get_mut(&pid) else {
            return;
        };
        if process.selected {
            process.refresh_names(true);
        }
        let DotnetEventsEnd {
            warnings,
            totals,
            kept,
        } = end;
        summary.warnings.extend(warnings);
        if let Some((counters, incomplete)) = totals {
            summary.clr.push(ClrProcessTotals {
                pid,
                exe_name: process.exe_name.clone(),
                counters,
                incomplete,
            });
        }
        // An unselected process's event samples are dropped unnamed; its
        // exact totals above stay.
        if process.selected {
            add_clr_samples(native, procfs, layout, aggregator, stack, process, kept);
        }
    }

    /// Adds the CLR samples of the sampling windows closed so far in the
    /// processes `pids` (those just polled: a window closes in a poll), so
    /// a long recording holds at most one window of them per process.
    pub fn flush_clr_windows(&mut self, pids: &[u32]) {
        let Self {
            native,
            processes,
            aggregator,
            stack,
            procfs,
            layout,
            ..
        } = self;
        for pid in pids {
            let Some(process) = processes.get_mut(pid) else {
                continue;
            };
            let Some(kept) = process.runtime_mut().map(RuntimeInstance::take_events) else {
                continue;
            };
            if !kept.is_empty() && process.selected {
                process.refresh_names(true);
                add_clr_samples(native, procfs, layout, aggregator, stack, process, kept);
            }
        }
    }

    /// One tick of a recording: drain the kernel's samples, queue the
    /// processes whose stacks met unindexed code for a rescan, start and
    /// drain the EventPipe sessions, add the CLR samples of closed sampling
    /// windows, and symbolize the samples taken [`SYMBOLIZE_DELAY`] ago or
    /// earlier. Returns whether it found work: samples or process events
    /// in the ring, or a runtime with work due at the next tick
    /// ([`visits`]).
    pub fn tick(
        &mut self,
        sampler: &mut crate::bpf::Sampler,
        scratch: &mut Vec<RawSample>,
    ) -> bool {
        let drained = self.pull(sampler, scratch);
        self.end_reused_after_losses(sampler);
        if let Some(unwind) = self.unwind.as_ref() {
            for pid in sampler.take_pids_to_rescan() {
                unwind.refresh_process(pid);
            }
            unwind.code_mapped(sampler.take_code_mapped());
        }
        let polled = self.poll_clr();
        self.flush_clr_windows(&polled);
        let delay = u64::try_from(SYMBOLIZE_DELAY.as_nanos()).unwrap_or(u64::MAX);
        self.process_pending(crate::profile::monotonic_ns().saturating_sub(delay));
        self.send_new_jit_code();
        self.name_native_stacks();
        self.retire_vanished();
        // An attach starts when a process is tracked or its runtime seen,
        // and runs while its runtime is busy: those mark it for the next
        // tick. The rest (an attach that failed, a process gone) waits for
        // the backstop.
        let runtimes_busy = self.clr_visits.any_marked();
        if runtimes_busy || self.ledger_kept_at.elapsed() >= VISIT_ALL_EVERY {
            self.ledger_kept_at = std::time::Instant::now();
            self.keep_perf_map_ledger();
        }
        self.log_sizes();
        drained || runtimes_busy
    }

    /// Retires the tracked processes that have had no `/proc` entry at two
    /// checks in a row ([`VANISHED_CHECK_EVERY`] apart): their exit event
    /// was lost (a full ring), or a sample taken as they exited came after
    /// it. By the second check, every sample they left has been added.
    fn retire_vanished(&mut self) {
        if self.vanished.1.elapsed() < VANISHED_CHECK_EVERY {
            return;
        }
        self.end_reused();
        let gone: HashSet<u32> = self
            .processes
            .keys()
            .copied()
            .filter(|pid| !self.procfs.pid_dir(*pid).exists())
            .collect();
        let earlier = std::mem::replace(
            &mut self.vanished,
            (HashSet::new(), std::time::Instant::now()),
        )
        .0;
        for &pid in gone.intersection(&earlier) {
            tracing::debug!(
                pid,
                "retiring a process that vanished without an exit event"
            );
            self.summary.processes_vanished += 1;
            self.retire(pid);
        }
        self.vanished.0 = gone.difference(&earlier).copied().collect();
    }

    /// Every 10 s, a debug line with the size of every table that grows
    /// with processes, threads or stacks (`--log-level clrbpf=debug`):
    /// what to look at first when memory grows on a long run.
    fn log_sizes(&mut self) {
        if self.sizes_logged_at.elapsed() < std::time::Duration::from_secs(10) {
            return;
        }
        self.sizes_logged_at = std::time::Instant::now();
        let managed = self.managed_budget.stats();
        let shared = self.image_code.stats();
        let (raw_processes, busiest) = self.raw_cpu.processes();
        let busiest = busiest.map(|(pid, stacks)| {
            let exe = self.processes.get(&pid).map_or("?", |p| &*p.exe_name);
            format!("{pid} ({exe}): {stacks}")
        });
        tracing::debug!(
            processes = self.processes.len(),
            managed_symbol_bytes = managed.used_bytes,
            shared_image_code_bytes = shared.bytes,
            shared_image_code_tables = shared.tables,
            shared_image_code_entries = shared.entries,
            frames = self.aggregator.frame_count(),
            samples = self.aggregator.distinct_samples(),
            raw_stacks = self.raw_cpu.len(),
            raw_stack_processes = raw_processes,
            raw_stacks_most = busiest.as_deref().unwrap_or("-"),
            pending = self.pending.len(),
            retry = self.retry.len(),
            thread_names = self.thread_names.len(),
            off_cpu_threads = self.off_cpu_recorded.len(),
            dotnet_scanned = self.dotnet_scanned.len(),
            native_files = self.native.open_files(),
            native_processes = self.native.processes(),
            mapping_modules = self.native.mapping_modules(),
            "pipeline sizes"
        );
    }

    /// Hands the code of the methods compiled since the last call (as the
    /// perf maps, jitdumps and MethodLoad events name them) to the unwind
    /// worker, which gives the frameless ones rows.
    /// Without the worker (frame pointers only), the ranges are dropped.
    /// Only the processes marked for it ([`visits`]) are looked at, and
    /// every one at the backstop.
    fn send_new_jit_code(&mut self) {
        self.file_watch.drain();
        let visit = self.jit_visits.take(std::time::Instant::now());
        for pid in visits::pids(visit, &self.processes) {
            let Some(process) = self.processes.get_mut(&pid) else {
                continue;
            };
            // Samples of an unselected process are dropped unnamed: its
            // JIT code needs no rows, and its files no reads for them.
            let selected = process.selected;
            let runtime = process.runtime_mut();
            match self.unwind.as_ref().filter(|_| selected) {
                Some(unwind) => {
                    let (ranges, dropped) =
                        runtime.map_or((Vec::new(), 0), |r| r.take_new_code(true));
                    unwind.add_jit_code(pid, ranges, dropped);
                }
                None => {
                    if let Some(runtime) = runtime {
                        runtime.take_new_code(false);
                    }
                }
            }
        }
    }

    /// Drains `source` into the pending samples (see [`Self::accept`]);
    /// returns whether it held any sample or process event.
    pub fn pull(&mut self, source: &mut impl SampleSource, scratch: &mut Vec<RawSample>) -> bool {
        let mut events = Vec::new();
        self.summary.malformed_records += source.drain(scratch, &mut events);
        let drained = !scratch.is_empty() || !events.is_empty();
        // Before the samples' processes are asked for: a process exec'd
        // and sampled in this drain is followed from its exec.
        if let Some(unwind) = self.unwind.as_ref() {
            for event in &events {
                if let crate::bpf::ProcessEvent::Exec { pid, time_ns } = event.event {
                    unwind.process_exec(pid, time_ns);
                }
            }
        }
        self.accept(scratch);
        self.take_stack_copies(source.take_stack_copies());
        self.lifecycle.extend(events.into_iter().map(|e| e.event));
        drained
    }

    /// Closes the window `span`: every sample taken before its end is
    /// symbolized (the held-back ones named as well as they can be now) and
    /// the profile of the window is handed out, with `period_ns` per CPU
    /// sample; the next window starts empty. Samples taken after the end
    /// stay pending for the next window.
    pub fn take_window(&mut self, span: WindowSpan, period_ns: u64) -> Profile {
        let naming = std::time::Instant::now();
        self.process_pending(span.end_ns);
        let (due, later): (Vec<RawSample>, Vec<RawSample>) = std::mem::take(&mut self.retry)
            .into_iter()
            .partition(|s| s.time_ns < span.end_ns);
        self.retry = later;
        for sample in &due {
            self.add_sample(sample, true);
        }
        self.name_raw_stacks(None);
        self.summary.naming.before_end += naming.elapsed();
        let mut profile = self.aggregator.take(
            Some(ValueType::new("cpu", "nanoseconds")),
            i64::try_from(period_ns).unwrap_or(i64::MAX),
            span.start_unix_ns,
            i64::try_from(span.end_ns.saturating_sub(span.start_ns)).unwrap_or(i64::MAX),
        );
        self.summary.unknown_frames_over_share = self.aggregator.unknown_over_share();
        profile.default_sample_type = Some(self.layout.default_index());
        profile
    }

    pub fn accept(&mut self, samples: &mut Vec<RawSample>) {
        for sample in samples.drain(..) {
            self.track(sample.pid);
            self.pending.push_back(sample);
        }
    }

    /// Symbolizes and aggregates the samples taken before `until_ns`
    /// (`u64::MAX`: all of them).
    pub fn process_pending(&mut self, until_ns: u64) {
        // The jitdumps written to since the last tick are read for these
        // samples; the others hold nothing new.
        self.file_watch.drain();
        let due: HashSet<u32> = self
            .pending
            .iter()
            .take_while(|s| s.time_ns < until_ns)
            .map(|s| s.pid)
            .collect();
        for pid in due {
            if let Some(p) = self.processes.get_mut(&pid).filter(|p| p.selected) {
                p.refresh_names(false);
                // What the read found goes to the unwinder at once.
                self.jit_visits.mark(pid);
            }
        }
        while self.pending.front().is_some_and(|s| s.time_ns < until_ns) {
            let Some(sample) = self.pending.pop_front() else {
                break;
            };
            self.apply_lifecycle(sample.time_ns);
            // A new process under a pid whose earlier process just exited.
            self.track(sample.pid);
            self.count_or_add(sample, false);
        }
        self.apply_lifecycle(until_ns);
    }

    /// Applies the process events that happened before `time_ns`: an exit
    /// releases everything the process held (after its last samples are
    /// added), an exec makes its mappings and runtime be read again.
    fn apply_lifecycle(&mut self, time_ns: u64) {
        use crate::bpf::ProcessEvent;
        while let Some(&event) = self.lifecycle.front() {
            let (ProcessEvent::Exited { time_ns: at, .. } | ProcessEvent::Exec { time_ns: at, .. }) =
                event;
            // An exit is reported when the process starts to exit: it still
            // runs (closes its files, unmaps its memory) and is sampled for
            // a moment, and those samples must not find it gone.
            let due = match event {
                ProcessEvent::Exited { .. } => at.saturating_add(EXIT_GRACE_NS),
                ProcessEvent::Exec { .. } => at,
            };
            if due > time_ns {
                break;
            }
            self.lifecycle.pop_front();
            match event {
                ProcessEvent::Exited { pid, .. } => self.retire(pid),
                ProcessEvent::Exec { pid, .. } => {
                    // An exec keeps the start time: a different one is
                    // another process under the pid (an exit lost).
                    if self
                        .processes
                        .get(&pid)
                        .is_some_and(|p| p.pid_reused(&self.procfs))
                    {
                        self.summary.processes_vanished += 1;
                        self.retire(pid);
                    } else if let Some(process) = self.processes.get_mut(&pid) {
                        process.exec_seen();
                    }
                }
            }
        }
    }

    /// A process exited: its held-back samples are added as they can be
    /// named now, its CLR totals and samples taken, the perf maps clrbpf
    /// turned on in it released (its files removed unless kept), and its
    /// symbols, open files and unwind index dropped.
    fn retire(&mut self, pid: u32) {
        if !self.processes.contains_key(&pid) {
            return;
        }
        let (mine, others): (Vec<RawSample>, Vec<RawSample>) = std::mem::take(&mut self.retry)
            .into_iter()
            .partition(|s| s.pid == pid);
        self.retry = others;
        for sample in &mine {
            self.add_sample(sample, true);
        }
        // Its CPU stacks of this window are named now, while its symbols
        // and files are still there.
        if let Some(process) = self.processes.get_mut(&pid).filter(|p| p.selected) {
            process.refresh_names(true);
        }
        for stack in self.raw_cpu.take_pid(pid) {
            self.add_counted(&stack.sample, stack.count, true);
        }
        let end = self
            .processes
            .get_mut(&pid)
            .and_then(TrackedProcess::runtime_mut)
            .and_then(|runtime| {
                runtime.begin_stop();
                runtime.stop_events(std::time::Instant::now() + CLR_STOP_DEADLINE)
            });
        if let Some(end) = end {
            self.close_clr(pid, end);
        }
        let Some(mut process) = self.processes.remove(&pid) else {
            return;
        };
        if let Some(handle) = release_process(
            &mut self.summary,
            &mut self.perf_maps,
            &self.procfs,
            &mut process,
            Release::Exited(self.keep_perf_files),
        ) {
            // Only the files are left to remove (DisablePerfMap fails), once
            // its last thread is gone; their warnings come with the next
            // reap ([`Self::keep_perf_map_ledger`]).
            self.perf_maps
                .finish_exited(&self.procfs, pid, handle, self.keep_perf_files);
        }
        self.native.forget_process(pid);
        if let Some(unwind) = self.unwind.as_ref() {
            unwind.forget_process(pid);
        }
        self.summary.processes_exited += 1;
    }

    /// A CPU sample is counted under its raw stack (named when its window
    /// closes); any other is symbolized and added now.
    fn count_or_add(&mut self, sample: RawSample, final_pass: bool) {
        if self.drop_unselected(&sample) {
            return;
        }
        if sample.off_cpu.is_some() {
            self.add_sample(&sample, final_pass);
            return;
        }
        let Self {
            raw_cpu,
            processes,
            native,
            procfs,
            clr_visits,
            ..
        } = self;
        // A new stack is named later, maybe after its process exited: read
        // the mappings it needs (and open their files) while it lives.
        if let Some(new) = raw_cpu.add(sample)
            && let Some(process) = processes.get_mut(&new.pid)
            && new
                .user_stack
                .iter()
                .any(|&addr| process.mapping_for(addr).is_none())
        {
            process.refresh_maps(procfs, native);
            // Its runtime may show now: polled at the next tick.
            clr_visits.mark(new.pid);
        }
    }

    /// Samples taken so far: those added, those counted by raw stack and
    /// those still pending, for the progress line.
    pub fn samples_seen(&self) -> u64 {
        self.summary.samples + self.raw_cpu.samples() + self.pending.len() as u64
    }

    /// The end of the recording: every perf map read one last time, then
    /// every sample symbolized, the held-back ones included; the CPU
    /// stacks as many as can be by `until` (see [`Self::name_raw_stacks`]).
    pub fn process_all(&mut self, until: std::time::Instant) {
        let started = std::time::Instant::now();
        self.file_watch.drain();
        for process in self.processes.values_mut() {
            process.refresh_names(true);
        }
        let pending: Vec<RawSample> = self.pending.drain(..).collect();
        let retry = std::mem::take(&mut self.retry);
        for sample in pending.into_iter().chain(retry) {
            self.count_or_add(sample, true);
        }
        self.name_raw_stacks(Some(until));
        self.summary.naming.end += started.elapsed();
    }

    /// Symbolizes one sample and adds it. Before the final pass, a sample
    /// with a JIT frame its process's perf map does not name yet goes to the
    /// retry queue instead: runtimes before .NET 5 buffer their perf map and
    /// write most of it late, so the final read names it.
    pub fn add_sample(&mut self, sample: &RawSample, final_pass: bool) {
        self.add_counted(sample, 1, final_pass);
    }

    /// [`Self::add_sample`] for `count` samples of one raw stack, whose
    /// [`RawSample::value`] is their summed period.
    fn add_counted(&mut self, sample: &RawSample, count: u64, final_pass: bool) {
        let Self {
            native,
            processes,
            aggregator,
            summary,
            stack,
            procfs,
            namer,
            retry,
            layout,
            ..
        } = self;
        let Some(process) = processes.get_mut(&sample.pid) else {
            return;
        };
        let unnamed_jit = namer.name_user(native, procfs, process, sample);
        if unnamed_jit && !final_pass && retry.len() < MAX_RETRY_SAMPLES {
            retry.push(sample.clone());
            return;
        }
        summary.samples += count;
        let counts = namer.intern(native, sample, aggregator, stack).times(count);
        count_frames(summary, counts);
        if let Some(runtime) = process.runtime_mut() {
            runtime.count_names(namer.user_frames(), count);
        }
        let tid = i64::from(sample.tid);
        let labels = labels::sample_labels(process, Some(tid), Some(&sample.thread_name));
        match &sample.off_cpu {
            None => aggregator.add(stack, labels, &layout.on_cpu(count, sample.value)),
            Some(off_cpu) => self.add_off_cpu(sample, off_cpu, labels),
        }
    }

    /// Turns perf maps off again in the processes where we turned them on,
    /// and removes the perf files of the processes the command started.
    pub fn restore_processes(&mut self, keep_files: bool) {
        let mut detaching = Vec::new();
        for process in self.processes.values_mut() {
            if let Some(handle) = release_process(
                &mut self.summary,
                &mut self.perf_maps,
                &self.procfs,
                process,
                Release::RunEnd(keep_files),
            ) {
                // Every process at once, on threads of their own: a stopped
                // or overloaded runtime answers DisablePerfMap late or never.
                let pid = process.pid;
                match std::thread::Builder::new()
                    .name(format!("clrbpf-detach-{pid}"))
                    .spawn(move || {
                        // Started by the real-time loop, it would run at
                        // nice 0: on a saturated host it then finishes, and
                        // lets clrbpf exit, seconds late.
                        crate::process::priority::enter_background_thread();
                        handle.finish(keep_files)
                    }) {
                    Ok(job) => detaching.push((pid, job)),
                    Err(e) => self.summary.warnings.push(format!(
                        "pid {pid}: cannot start a thread to turn perf maps off again: {e}"
                    )),
                }
            }
        }
        // One deadline for these and for the attaches still under way
        // ([`perf_maps::PerfMapKeeper::abandon`]): what misses it stays in
        // the ledger, for the next start to turn off.
        let until = std::time::Instant::now() + DETACH_DEADLINE;
        crate::stop::wait_until(until, || {
            detaching.iter().all(|(_, job)| job.is_finished()) && self.perf_maps.all_finished()
        });
        let mut still_on = Vec::new();
        for (pid, job) in detaching {
            if !job.is_finished() {
                self.summary.warnings.push(format!(
                    "pid {pid}: its runtime did not answer DisablePerfMap in time (stopped or overloaded?): it may keep writing perf maps, and their files stay"
                ));
                still_on.push(pid);
                continue;
            }
            let Ok(cleanup) = job.join() else {
                continue;
            };
            // A process that exited has nothing left to turn off.
            if let Err(e) = cleanup.disable
                && self.procfs.is_running(pid)
            {
                self.summary
                    .warnings
                    .push(format!("pid {pid}: turning perf maps off again: {e}"));
            }
            self.summary.warnings.extend(cleanup.files.warnings(pid));
        }
        let warnings = self.perf_maps.drain();
        self.summary.warnings.extend(warnings);
        self.perf_maps.sync(&self.procfs, still_on);
    }
}

/// Adds how one stack's frames were named to the summary.
fn count_frames(summary: &mut RecordSummary, counts: FrameCounts) {
    let FrameCounts {
        kernel,
        managed,
        native,
        unnamed,
        unknown,
        truncated_stacks,
    } = counts;
    summary.kernel_frames += kernel;
    summary.managed_frames += managed;
    summary.native_frames += native;
    summary.unnamed_frames += unnamed;
    summary.unknown_frames += unknown;
    summary.truncated_stacks += truncated_stacks;
}

/// Why a process is released, with whether its perf files are kept.
#[derive(Clone, Copy)]
enum Release {
    /// Its exit was reported (its last threads may still run).
    Exited(bool),
    /// The recording ends while it runs.
    RunEnd(bool),
}

/// What ends with a process, at its exit or at the end of the recording,
/// besides its perf maps: its runtime detaches (an attach still under way
/// is abandoned, the perf files of a process the command launched are
/// removed unless kept), and its warnings go to the summary. Returns the
/// perf maps clrbpf turned on in it (counted), for the caller to turn off.
fn release_process(
    summary: &mut RecordSummary,
    perf_maps: &mut perf_maps::PerfMapKeeper,
    procfs: &ProcFs,
    process: &mut TrackedProcess,
    release: Release,
) -> Option<PerfMapAttach> {
    let (Release::Exited(keep_files) | Release::RunEnd(keep_files)) = release;
    summary
        .warnings
        .extend(std::mem::take(&mut process.warnings));
    let pid = process.pid;
    let DotnetDetached {
        attach_job,
        perf_maps: handle,
        warnings,
        name_counts,
    } = process.runtime_mut()?.detach(keep_files);
    summary.add_name_sources(pid, name_counts);
    if let Some(job) = attach_job {
        let exiting = matches!(release, Release::Exited(_));
        perf_maps.abandon(procfs, pid, job, keep_files, exiting);
    }
    summary.warnings.extend(warnings);
    summary.perf_maps_enabled += usize::from(handle.is_some());
    handle
}

#[cfg(test)]
mod tests;
