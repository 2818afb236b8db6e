//! The .NET runtime of one profiled process, behind the runtime seam
//! ([`crate::runtime`]): [`DotnetLoader`] recognises CoreCLR in the
//! mappings, and the [`DotnetInstance`] it makes does everything the
//! profiler asks of that runtime.
//!
//! 1. It waits until the runtime has started (asking earlier can crash
//!    it), then finds its diagnostic socket once ([`DiagnosticPort`]).
//! 2. It asks for perf maps ([`super::perf_map_attach`], .NET 8+) from a
//!    thread of its own, and turns them on again if another recorder
//!    removed their files.
//! 3. It names JIT-compiled and ReadyToRun frames from its name sources
//!    ([`super::name_sources`]): the perf map and jitdump, or, on runtimes
//!    that cannot write them on request, method rundown and MethodLoad
//!    events ([`ManagedSymbols`]); the ReadyToRun images it maps
//!    ([`ReadyToRunNames`]); the runtime's memory ([`JitMemoryNames`]).
//! 4. It runs the EventPipe session(s) ([`ClrCollector`]) under the
//!    memory budget's session slots.
//! 5. At the process's or the run's end it stops them and hands back what
//!    is left to undo (perf maps to turn off, files to remove).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use super::{
    collector::{ClrCollector, ClrSettings},
    counters::RuntimeCounters,
    intake::{ClrCounters, ClrSample},
    ipc::{DiagnosticPort, IpcError},
    name_sources::{
        JitMemoryContext, JitMemoryFactory, JitMemoryNames, ManagedNames, NameSourceCounts,
    },
    perf_map_attach::{PerfMapAttach, PerfMapAttachOutcome, PerfMapUnsupported},
};
use crate::{
    process::{MappingTable, ProcFs, ProcessInfo, dotnet::DotnetRuntime, root::TargetRoot},
    profile::{Frame, FrameKind, Module, clr_sampling::Weighted},
    runtime::{ProcessContext, RuntimeInstance, RuntimeLoader, RuntimeSummary},
    symbolize::{
        file_watch::FileWatch,
        managed::{
            FileStatus, ManagedSymbolBudget, ManagedSymbols, RefreshStats, SharedImageCode,
            TargetLocation,
        },
        perf_files::remove_perf_files,
        ready_to_run::{AssemblyCache, ReadyToRunNames},
    },
    unwind::jit_code::JitMethod,
};

/// A perf map attach running on the job pool ([`super::jobs`]).
pub type AttachJob = super::jobs::Job<Result<PerfMapAttachOutcome, IpcError>>;

/// Whether something other than the runtime's memory names a process's
/// JIT code, as far as the perf map attach tells: the memory path's
/// problems are worth a warning only when nothing does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum JitNamesElsewhere {
    /// Not known (yet): the attach has not answered, or failed otherwise.
    Unknown,
    /// Perf maps are on, or method events name its methods.
    Yes,
    /// It has no diagnostic socket: nothing can turn perf maps on.
    NoSocket,
}

/// How often a process's perf map / jitdump are re-read at most (only the
/// bytes added since the last read). It is also how late a method's unwind
/// rows can be after it was compiled (see `JIT_REBUILD_EVERY`).
const MANAGED_REFRESH_EVERY: Duration = Duration::from_millis(100);
/// How often a process's perf map / jitdump are read for new JIT code even
/// when none of its samples is due: a method compiled while the process is
/// idle needs its unwind rows before the samples that run it.
const JIT_CODE_REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How often a watched jitdump nothing was written to since its last read
/// ([`ManagedSymbols::jit_code_unchanged`]) is read all the same, for
/// samples or new code: a backstop for writes inotify does not report, so
/// an idle process costs next to nothing.
const WATCHED_JIT_CODE_REFRESH_EVERY: Duration = Duration::from_secs(30);
/// How long a runtime that maps no `System.Private.CoreLib.dll` (a
/// single-file app keeps it in its bundle) is given to start before it is
/// talked to anyway.
const RUNTIME_START_GRACE: Duration = Duration::from_secs(2);
/// How many times the perf maps of one process are turned on again, and
/// how far apart at least: each time, the runtime replays every method.
const MAX_PERF_MAP_REENABLES: u32 = 3;
const PERF_MAP_REENABLE_EVERY: Duration = Duration::from_secs(5);

/// Recognises CoreCLR in a process ([`DotnetRuntime::detect`]) and makes
/// its [`DotnetInstance`] with what every .NET process is asked for.
#[derive(Clone, Debug)]
pub struct DotnetLoader {
    /// Whether to ask runtimes for perf maps.
    pub attach: bool,
    /// CLR events, runtime metrics and the exception and allocation
    /// budgets.
    pub clr: ClrSettings,
    /// The budget every process's managed symbols share.
    pub managed_budget: ManagedSymbolBudget,
    /// Which sources name managed frames.
    pub managed_names: ManagedNames,
    /// Parsed assemblies every process shares.
    pub assemblies: AssemblyCache,
    /// The jitdump's ReadyToRun entries every process shares.
    pub image_code: SharedImageCode,
    /// Makes a process's reader of JIT-compiled code in its memory.
    pub jit_memory: JitMemoryFactory,
    /// Tells which processes' jitdumps grew (one inotify for all).
    pub file_watch: FileWatch,
}

impl DotnetLoader {
    /// A loader that asks runtimes for nothing, for `clrbpf ps`.
    pub fn for_listing() -> Self {
        Self {
            attach: false,
            clr: ClrSettings {
                kinds: super::session::ClrEventKinds::NONE,
                counters_interval_sec: None,
                exceptions_per_second: None,
                allocations_per_second: None,
            },
            managed_budget: ManagedSymbolBudget::new(0),
            managed_names: ManagedNames::PerfMap,
            assemblies: AssemblyCache::new(0),
            image_code: SharedImageCode::new(0),
            jit_memory: super::name_sources::no_jit_memory_reader,
            file_watch: FileWatch::unavailable(),
        }
    }
}

impl RuntimeLoader for DotnetLoader {
    type Instance = DotnetInstance;

    fn recognises(&self, mappings: &MappingTable) -> bool {
        DotnetRuntime::detect(mappings).is_some()
    }

    fn describe(
        &self,
        procfs: &ProcFs,
        info: &ProcessInfo,
        mappings: &MappingTable,
    ) -> Option<RuntimeSummary> {
        super::describe::describe(procfs, info, mappings)
    }

    fn load(
        &self,
        process: &ProcessContext<'_>,
        mappings: &MappingTable,
    ) -> Option<DotnetInstance> {
        if !self.recognises(mappings) {
            return None;
        }
        let ready_to_run = self
            .managed_names
            .uses_memory()
            .then(|| ReadyToRunNames::new(process.pid, self.assemblies.clone()));
        let module = |path: &str| {
            Arc::new(Module {
                path: path.into(),
                build_id: None,
                memory_start: 0,
                memory_limit: 0,
                file_offset: 0,
                has_functions: true,
            })
        };
        Some(DotnetInstance {
            pid: process.pid,
            launched_here: process.launched_here,
            loader: self.clone(),
            port: DiagnosticPort::new(process.procfs, process.pid),
            starting_since: None,
            managed: None,
            managed_read_at: None,
            jit_checked_at: None,
            jit_module: module("[jit]"),
            ready_to_run,
            jit_memory: None,
            // The same path: a frame shows no difference; the summary
            // tells the sources apart by this `Arc`.
            jit_memory_module: module("[jit]"),
            name_counts: NameSourceCounts::default(),
            jit_names: JitNamesElsewhere::Unknown,
            methods_from_events: false,
            clr_symbols_stale: false,
            perf_map: None,
            attach_job: None,
            perf_maps_reenabled: 0,
            perf_maps_reenabled_at: None,
            jitdump_seen: false,
            clr: None,
            clr_slot: None,
            warnings: Vec::new(),
        })
    }
}

/// The .NET runtime of one process; see the module doc.
pub struct DotnetInstance {
    pid: u32,
    launched_here: bool,
    loader: DotnetLoader,
    /// The diagnostic socket, found once for the attach, the sessions and
    /// the rundown.
    port: DiagnosticPort,
    /// When `libcoreclr.so` was first seen mapped, while the runtime has
    /// not started yet ([`DotnetRuntime::started`]): the mappings are read
    /// again on every tick until it has.
    starting_since: Option<Instant>,
    /// The name sources (perf map and jitdump, or method events), once the
    /// runtime has started.
    managed: Option<ManagedSymbols>,
    managed_read_at: Option<Instant>,
    /// When [`RuntimeInstance::take_new_code`] last checked the name
    /// sources for new code (read or found unchanged).
    jit_checked_at: Option<Instant>,
    /// The module of the frames [`Self::managed`] names.
    jit_module: Arc<Module>,
    /// Names ReadyToRun code from the images it maps (unless
    /// `--managed-names perf-map`).
    ready_to_run: Option<ReadyToRunNames>,
    /// Names JIT-compiled code from the runtime's memory, once it has
    /// started (when the loader's factory makes a reader).
    jit_memory: Option<Box<dyn JitMemoryNames>>,
    /// The module of the frames [`Self::jit_memory`] names.
    jit_memory_module: Arc<Module>,
    /// Managed frames of CPU samples named by each source.
    name_counts: NameSourceCounts,
    /// What the perf map attach says of naming JIT code without the
    /// runtime's memory.
    jit_names: JitNamesElsewhere,
    /// Name methods from the session's MethodLoad events (no perf map).
    methods_from_events: bool,
    /// CLR events arrived since the perf map was last read.
    clr_symbols_stale: bool,
    /// The perf maps clrbpf turned on.
    perf_map: Option<PerfMapAttach>,
    /// The perf map attach under way on its own thread, with the runtime
    /// version seen in the mappings.
    attach_job: Option<(AttachJob, Option<String>)>,
    /// Times the perf maps clrbpf turned on were turned on again after
    /// their files vanished ([`Self::reenable_if_files_vanished`]).
    perf_maps_reenabled: u32,
    perf_maps_reenabled_at: Option<Instant>,
    /// Whether the jitdump was there since perf maps were last turned on:
    /// only a file seen can have vanished. The runtime creates the perf map
    /// first and the jitdump a moment later, so a process that exits as its
    /// perf map appears may never have one.
    jitdump_seen: bool,
    clr: Option<ClrCollector>,
    /// The session slot of the memory budget `clr` holds.
    clr_slot: Option<crate::memory_budget::SessionSlot>,
    warnings: Vec<String>,
}

/// How a process's CLR events ended ([`RuntimeInstance::stop_events`]).
pub struct DotnetEventsEnd {
    pub warnings: Vec<String>,
    /// The session's totals and why they miss events, if a session ran.
    pub totals: Option<(ClrCounters, Option<String>)>,
    /// The event samples not taken yet.
    pub kept: Vec<Weighted<ClrSample>>,
}

/// What is left to undo in a process ([`RuntimeInstance::detach`]).
pub struct DotnetDetached {
    /// An EnablePerfMap not answered yet: let it finish and undo it.
    pub attach_job: Option<AttachJob>,
    /// The perf maps clrbpf turned on, to turn off.
    pub perf_maps: Option<PerfMapAttach>,
    pub warnings: Vec<String>,
    /// Managed frames of CPU samples named by each source.
    pub name_counts: NameSourceCounts,
}

impl RuntimeInstance for DotnetInstance {
    type Events = Vec<Weighted<ClrSample>>;
    type EventsEnd = DotnetEventsEnd;
    type Detached = DotnetDetached;

    fn sync_mappings(&mut self, mappings: &MappingTable) {
        // A process is often first seen before it maps libcoreclr.so (the
        // `dotnet` host loads it late), and its runtime starts a moment
        // after: it is looked at on every read until it has.
        if let Some(images) = self.ready_to_run.as_mut() {
            images.sync_mappings(mappings);
        }
        if let Some(jit) = self.jit_memory.as_mut() {
            jit.sync_mappings(mappings);
        }
        if let Some(managed) = self.managed.as_mut() {
            managed.sync_mappings(mappings);
            return;
        }
        let Some(runtime) = DotnetRuntime::detect(mappings) else {
            return;
        };
        // A runtime asked for perf maps (or a session) before its startup
        // has set them up can crash: wait until it has started.
        let since = *self.starting_since.get_or_insert_with(Instant::now);
        if !runtime.started && since.elapsed() < RUNTIME_START_GRACE {
            tracing::debug!(pid = self.pid, "the .NET runtime is still starting");
            return;
        }
        self.starting_since = None;
        self.start(runtime, mappings);
    }

    fn needs_mappings(&self) -> bool {
        self.starting_since.is_some()
    }

    fn names_code(&self) -> bool {
        self.managed.is_some()
    }

    fn frame(&self, lookup: u64, addr: u64, time_ns: u64) -> Option<Arc<Frame>> {
        let symbol = self
            .managed
            .as_ref()
            .filter(|_| self.loader.managed_names.uses_perf_maps())
            .and_then(|managed| managed.lookup(lookup, time_ns));
        let Some(symbol) = symbol else {
            return self.frame_from_memory(lookup, addr, time_ns);
        };
        Some(Arc::new(Frame {
            kind: FrameKind::Managed,
            name: symbol.short_name.clone(),
            system_name: (symbol.raw_name != symbol.short_name).then(|| symbol.raw_name.clone()),
            jit_tier: symbol.jit_tier,
            module: Some(self.jit_module.clone()),
            address: addr,
            file: symbol.assembly,
            line: 0,
            inlined: Vec::new(),
        }))
    }

    fn count_names(&mut self, frames: &[Arc<Frame>], samples: u64) {
        self.name_counts
            .count(frames, samples, &self.jit_module, &self.jit_memory_module);
    }

    fn refresh_names(&mut self, force: bool) {
        let Some(managed) = self.managed.as_mut() else {
            return;
        };
        let since_read = self.managed_read_at.map(|t| t.elapsed());
        if !force && since_read.is_some_and(|d| d < MANAGED_REFRESH_EVERY) {
            return;
        }
        // A watched jitdump nothing was written to since its last read
        // holds nothing new: an idle process costs no open, no fstat.
        if managed.jit_code_unchanged()
            && since_read.is_some_and(|d| d < WATCHED_JIT_CODE_REFRESH_EVERY)
        {
            return;
        }
        self.managed_read_at = Some(Instant::now());
        let stats = managed.refresh(crate::profile::monotonic_ns());
        tracing::debug!(
            pid = self.pid,
            ?stats,
            symbols = managed.len(),
            "read perf map and jitdump"
        );
        self.reenable_if_files_vanished(&stats);
    }

    /// See [`ManagedSymbols::take_new_code`]. With `read_first`, the perf
    /// map and jitdump are read first if they were not for
    /// [`JIT_CODE_REFRESH_EVERY`] (and, if watched, written to: see
    /// [`Self::refresh_names`]; unless the symbol budget dropped the
    /// process's tables: reading them again is for its samples to ask), and
    /// a process with no perf map gets the methods its runtime's memory
    /// shows ([`Self::code_from_memory`]).
    fn take_new_code(&mut self, read_first: bool) -> (Vec<JitMethod>, u64) {
        let Some(managed) = self.managed.as_ref() else {
            return (Vec::new(), 0);
        };
        // Checked at most once a second, even when the check finds the
        // watched jitdump unchanged and reads nothing: a node of idle
        // processes costs a few atomic loads a second each.
        let due = |at: Option<Instant>| at.is_none_or(|t| t.elapsed() >= JIT_CODE_REFRESH_EVERY);
        if read_first
            && due(self.managed_read_at)
            && due(self.jit_checked_at)
            && !managed.is_evicted()
        {
            self.jit_checked_at = Some(Instant::now());
            self.refresh_names(true);
        }
        let (mut code, dropped) = self
            .managed
            .as_mut()
            .map_or((Vec::new(), 0), ManagedSymbols::take_new_code);
        if read_first
            && self.code_from_memory()
            && let Some(memory) = self.jit_memory.as_mut()
        {
            code.extend(memory.take_new_code());
        }
        (code, dropped)
    }

    /// Takes the perf map attach's answer, then starts or drains the
    /// EventPipe session.
    fn poll(&mut self) -> usize {
        self.poll_attach();
        let Some(clr) = self.clr.as_mut() else {
            return 0;
        };
        let mut managed = self.managed.as_mut().filter(|_| self.methods_from_events);
        let taken = clr.poll(&mut |method, time_ns| {
            if let Some(managed) = managed.as_deref_mut() {
                add_event_method(managed, method, time_ns);
            }
        });
        // Event stacks are symbolized later, maybe after the process
        // exited: read its perf map while it is there, once more after the
        // last events (the rate limit may have skipped the read they need).
        self.clr_symbols_stale |= taken > 0;
        if self.clr_symbols_stale
            && self
                .managed_read_at
                .is_none_or(|t| t.elapsed() >= MANAGED_REFRESH_EVERY)
        {
            self.clr_symbols_stale = false;
            self.refresh_names(true);
        }
        taken
    }

    fn busy(&self) -> bool {
        self.starting_since.is_some()
            || self.attach_job.is_some()
            || self.clr_symbols_stale
            || self.clr.as_ref().is_some_and(ClrCollector::busy)
    }

    fn take_events(&mut self) -> Vec<Weighted<ClrSample>> {
        self.clr
            .as_mut()
            .map(ClrCollector::take_completed)
            .unwrap_or_default()
    }

    fn begin_stop(&mut self) {
        if let Some(clr) = self.clr.as_mut() {
            clr.begin_stop();
        }
    }

    fn stop_events(&mut self, until: Instant) -> Option<DotnetEventsEnd> {
        let mut clr = self.clr.take()?;
        self.clr_slot = None;
        let mut managed = self.managed.as_mut().filter(|_| self.methods_from_events);
        clr.stop(until, &mut |method, time_ns| {
            if let Some(managed) = managed.as_deref_mut() {
                add_event_method(managed, method, time_ns);
            }
        });
        let warnings = clr.take_warnings();
        let totals = clr
            .had_session()
            .then(|| (clr.counters(), clr.incomplete().map(str::to_owned)));
        Some(DotnetEventsEnd {
            warnings,
            totals,
            kept: clr.finish(),
        })
    }

    /// An attach still under way is handed back to let finish and undo;
    /// the perf files of a process the command launched are removed
    /// (unless `keep_files`); the perf maps clrbpf turned on are handed
    /// back to turn off.
    fn detach(&mut self, keep_files: bool) -> DotnetDetached {
        let attach_job = self.abandon_attach();
        let mut warnings = std::mem::take(&mut self.warnings);
        let memory_problems = self.jit_memory.as_ref().and_then(|m| m.problems());
        match (memory_problems, self.jit_names) {
            // Perf maps or method events name its JIT code.
            (_, JitNamesElsewhere::Yes) | (None, _) => {}
            (Some(problems), JitNamesElsewhere::NoSocket) => warnings.push(format!(
                "pid {}: its JIT-compiled frames are not named: {problems}, and with no diagnostic socket no perf map can be turned on (start it with DOTNET_PerfMapEnabled=1, COMPlus_PerfMapEnabled=1 before .NET 5, to name them); its ReadyToRun frames are named from the image files",
                self.pid
            )),
            (Some(problems), JitNamesElsewhere::Unknown) => warnings.push(format!(
                "pid {}: some JIT-compiled frames may be unnamed: {problems}",
                self.pid
            )),
        }
        if let Some(problems) = self.managed.as_ref().and_then(|m| m.errors().problems()) {
            warnings.push(format!(
                "pid {}: some managed frames may be unnamed: {problems}",
                self.pid
            ));
        }
        if !keep_files
            && self.launched_here
            && let Some(managed) = self.managed.as_ref()
        {
            warnings.extend(remove_launched_perf_files(managed.location()));
        }
        DotnetDetached {
            attach_job,
            perf_maps: self.perf_map.take(),
            warnings,
            name_counts: std::mem::take(&mut self.name_counts),
        }
    }
}

impl DotnetInstance {
    /// The frame of code no perf map names: ReadyToRun code from its image,
    /// JIT-compiled code from the runtime's memory.
    fn frame_from_memory(&self, lookup: u64, addr: u64, time_ns: u64) -> Option<Arc<Frame>> {
        if let Some(frame) = self
            .ready_to_run
            .as_ref()
            .and_then(|images| images.frame(lookup, addr))
        {
            return Some(frame);
        }
        let name = self.jit_memory.as_ref()?.name(lookup, time_ns)?;
        Some(Arc::new(Frame {
            kind: FrameKind::Managed,
            name: name.name,
            system_name: name.system_name,
            jit_tier: name.jit_tier,
            module: Some(self.jit_memory_module.clone()),
            address: addr,
            file: name.assembly,
            line: 0,
            inlined: Vec::new(),
        }))
    }

    /// Whether the unwinder's JIT methods come from the runtime's memory:
    /// names come from it alone (`--managed-names memory`), or no perf map
    /// is there or on its way (no socket, attach refused or failed).
    fn code_from_memory(&self) -> bool {
        self.jit_memory.is_some()
            && (!self.loader.managed_names.uses_perf_maps()
                || (self.perf_map.is_none()
                    && self.attach_job.is_none()
                    && !self.launched_here
                    && !self.methods_from_events))
    }

    /// The runtime has started: its name sources, its session and its
    /// perf maps.
    fn start(&mut self, runtime: DotnetRuntime, mappings: &MappingTable) {
        let pid = self.pid;
        tracing::debug!(pid, version = ?runtime.version, "found a .NET runtime");
        let DotnetLoader {
            attach,
            clr: settings,
            ref managed_budget,
            managed_names,
            ref assemblies,
            ref image_code,
            jit_memory,
            ref file_watch,
        } = self.loader;
        let mut managed = ManagedSymbols::with_budget(pid, managed_budget);
        managed.share_image_code(image_code.clone());
        managed.watch_files(file_watch.clone());
        managed.sync_mappings(mappings);
        self.managed = Some(managed);
        if managed_names.uses_memory() {
            self.jit_memory = jit_memory(&JitMemoryContext {
                procfs: &ProcFs::default(),
                pid,
                runtime: &runtime,
                mappings,
                assemblies,
            });
        }
        // Without perf maps (`--managed-names memory`) the runtime is asked
        // for none, and for no method events either.
        let attach = attach && managed_names.uses_perf_maps();
        // Runtimes before .NET 8 cannot be asked for perf maps: a process we
        // did not start gets its JIT frames named from method rundown and
        // MethodLoad events.
        self.methods_from_events =
            attach && !self.launched_here && runtime.major().is_some_and(|m| m < 8);
        self.start_events(settings, runtime.major());
        if attach {
            self.start_attach(runtime.version);
        }
    }

    /// The EventPipe session, if any kind of event is asked for and the
    /// memory budget has a session slot left.
    fn start_events(&mut self, settings: ClrSettings, major: Option<u32>) {
        let pid = self.pid;
        let slot = settings
            .kinds
            .any()
            .then(crate::memory_budget::SessionSlot::take);
        if slot.as_ref().is_some_and(Option::is_none) {
            let message = || {
                format!(
                    "pid {pid}: no CLR events: the memory budget's {} EventPipe sessions are all in use (raise --memory-budget-mb)",
                    crate::memory_budget::current().max_sessions()
                )
            };
            if crate::memory_budget::warn_once(
                pid,
                crate::memory_budget::OverBudget::Sessions,
                message,
            ) {
                self.warnings.push(message());
            }
        }
        if let Some(Some(slot)) = slot {
            self.clr_slot = Some(slot);
            self.clr = Some(
                ClrCollector::new(
                    self.port.clone(),
                    settings.kinds,
                    major,
                    self.methods_from_events,
                )
                .with_runtime_metrics(settings.counters_interval_sec)
                .with_exception_budget(settings.exceptions_per_second)
                .with_allocation_budget(settings.allocations_per_second),
            );
        }
    }

    /// Asks for perf maps. The runtime may be slow, stopped or hostile (a
    /// process that maps a file named libcoreclr.so and never answers):
    /// ask from a thread of its own, bounded by the client's deadline, and
    /// take the answer on a later poll ([`Self::poll_attach`]).
    fn start_attach(&mut self, version: Option<String>) {
        let pid = self.pid;
        let port = self.port.clone();
        let job = super::jobs::spawn(move || {
            tracing::trace!(pid, "perf map attach");
            PerfMapAttach::attach(&port)
        });
        self.attach_job = Some((job, version));
    }

    /// Whether a perf map attach (or a turn-on-again) is under way.
    pub fn attach_pending(&self) -> bool {
        self.attach_job.is_some()
    }

    /// Whether clrbpf turned perf maps on in the process, or is asking.
    pub fn asks_perf_maps(&self) -> bool {
        self.perf_map.is_some() || self.attach_job.is_some()
    }

    /// The runtime counters received so far, when runtime metrics are
    /// asked for and a session runs or ran.
    pub fn runtime_counters(&mut self) -> Option<&mut RuntimeCounters> {
        self.clr.as_mut()?.runtime_counters()
    }

    /// Takes the outcome of the perf map attach once it is there.
    pub fn poll_attach(&mut self) {
        if !self
            .attach_job
            .as_ref()
            .is_some_and(|(job, _)| job.is_finished())
        {
            return;
        }
        let Some((job, version)) = self.attach_job.take() else {
            return;
        };
        let pid = self.pid;
        let outcome = match job.join() {
            Ok(outcome) => outcome,
            Err(e) => {
                self.warnings
                    .push(format!("pid {pid}: the perf map attach failed: {e}"));
                return;
            }
        };
        match outcome {
            Ok(PerfMapAttachOutcome::Enabled(handle)) => {
                self.perf_map = Some(*handle);
                self.jit_names = JitNamesElsewhere::Yes;
            }
            Ok(PerfMapAttachOutcome::AlreadyEnabled { .. }) => {
                self.jit_names = JitNamesElsewhere::Yes;
            }
            Ok(PerfMapAttachOutcome::Unsupported(PerfMapUnsupported::BeforeNet8 { .. }))
                if self.methods_from_events && self.clr.is_some() =>
            {
                self.jit_names = JitNamesElsewhere::Yes;
                tracing::debug!(
                    pid,
                    "no EnablePerfMap before .NET 8: naming methods by rundown"
                );
            }
            Ok(PerfMapAttachOutcome::Unsupported(PerfMapUnsupported::BeforeNet8 { .. })) => {
                let version = version.as_deref().unwrap_or("before 8");
                self.warnings.push(format!(
                    "pid {pid} runs .NET {version}, which cannot turn perf maps on at run time: its JIT frames are named only if it was started with DOTNET_PerfMapEnabled=1 (COMPlus_PerfMapEnabled=1 before .NET 5)"
                ));
            }
            Ok(PerfMapAttachOutcome::Unsupported(other)) => {
                self.warnings.push(format!("pid {pid}: {other}"))
            }
            // No socket: the images and the runtime's memory name its
            // frames (the summary says how many), the CLR events warning
            // says why there is no socket, and the memory path's warning
            // says if its JIT frames stay unnamed.
            Err(e @ (IpcError::DiagnosticsDisabled { .. } | IpcError::SocketNotFound { .. }))
                if self.ready_to_run.is_some() =>
            {
                self.jit_names = JitNamesElsewhere::NoSocket;
                tracing::debug!(pid, "no perf maps: {e}");
            }
            Err(e) => self
                .warnings
                .push(format!("pid {pid}: could not turn on perf maps: {e}")),
        }
    }

    /// At the process's or the run's end: an attach still under way is
    /// reported and handed back, for the caller to let it finish and undo
    /// what it did.
    fn abandon_attach(&mut self) -> Option<AttachJob> {
        self.poll_attach();
        let (job, _) = self.attach_job.take()?;
        self.warnings.push(format!(
            "pid {}: its runtime had not answered EnablePerfMap when the recording ended: its JIT frames may be unnamed",
            self.pid
        ));
        Some(job)
    }

    /// The perf maps clrbpf turned on are there for the whole recording
    /// (the runtime creates the jitdump before it answers EnablePerfMap and
    /// never removes it): a missing jitdump means another recorder attached
    /// to the same process turned them off and removed the files (a second
    /// clrbpf ending; the runtime keeps one perf map state per process).
    /// Left so, no method would be named again for the rest of the
    /// recording, and a read made before the files came back would find
    /// nothing at all. Turned off and on again from a thread (the runtime
    /// replays every method into new files), a few times at most.
    fn reenable_if_files_vanished(&mut self, stats: &RefreshStats) {
        let last = (
            self.perf_maps_reenabled,
            self.perf_maps_reenabled_at.map(|t| t.elapsed()),
        );
        self.jitdump_seen |= matches!(
            stats.jitdump.status,
            FileStatus::Read | FileStatus::Stopped | FileStatus::Failed
        );
        // A process that exited has no files to read either: nothing vanished.
        let alive = std::path::Path::new(&format!("/proc/{}/root", self.pid)).exists();
        let ours = self.perf_map.is_some() && self.jitdump_seen;
        if !alive || !perf_files_vanished(stats, ours, last) {
            return;
        }
        self.jitdump_seen = false;
        let Some(mut handle) = self.perf_map.take() else {
            return;
        };
        self.perf_maps_reenabled += 1;
        self.perf_maps_reenabled_at = Some(Instant::now());
        let pid = self.pid;
        tracing::debug!(pid, "perf files vanished: turning perf maps on again");
        if self.perf_maps_reenabled == 1 {
            self.warnings.push(format!(
                "pid {pid}: its perf files were gone after clrbpf turned perf maps on (removed by another recorder attached to it?): turned on again; methods compiled in between may be unnamed"
            ));
        }
        let job = super::jobs::spawn(move || {
            // The handle is kept whatever the answer: it is what removes
            // the files clrbpf made the runtime write when the recording
            // ends (a process that exited meanwhile cannot answer, and its
            // files must still go).
            if let Err(error) = handle.reenable() {
                tracing::debug!(pid, %error, "perf maps not turned on again");
            }
            Ok(PerfMapAttachOutcome::Enabled(Box::new(handle)))
        });
        self.attach_job = Some((job, None));
    }
}

/// Whether a refresh found the files of perf maps clrbpf turned on (`ours`:
/// and whose jitdump was seen since) gone: the jitdump (always written with
/// type All) is missing. `last` is
/// how many times they were turned on again so far and how long ago the
/// last was: bounded, so a runtime that cannot write its files is not
/// asked again and again.
fn perf_files_vanished(stats: &RefreshStats, ours: bool, last: (u32, Option<Duration>)) -> bool {
    let (done, since) = last;
    ours && stats.jitdump.status == FileStatus::Missing
        && done < MAX_PERF_MAP_REENABLES
        && since.is_none_or(|since| since >= PERF_MAP_REENABLE_EVERY)
}

/// Names a method from a MethodLoad or rundown event, as a perf map line
/// would (so frames look the same whichever source named them).
fn add_event_method(
    managed: &mut ManagedSymbols,
    method: &clrbpf_parse::events::MethodLoad,
    time_ns: u64,
) {
    use clrbpf_parse::events::MethodEventKind;
    let valid_from = match method.kind {
        MethodEventKind::Load => time_ns,
        // Rundown describes code that existed before the session.
        MethodEventKind::RundownStart | MethodEventKind::RundownEnd => 0,
        MethodEventKind::Unload => return,
    };
    let raw = format!(
        "{}[{}]",
        method.display_name(),
        method.tier().perf_map_name()
    );
    managed.insert_method(method.start, u64::from(method.size), &raw, valid_from);
}

/// Removes the perf files of a process the launched command started. The
/// process may be gone, and /proc/PID/root with it: it shared our mount
/// namespace, so our root is its root. Its files were all written after it
/// started. Returns the warnings.
fn remove_launched_perf_files(location: &TargetLocation) -> Vec<String> {
    let pid = location.pid;
    let (Some(owner), Some(started_at)) = (&location.owner, location.started_at) else {
        return vec![format!(
            "pid {pid}: its perf files were left in place: its user or start time could not be read"
        )];
    };
    let root = match TargetRoot::at_host_path(std::path::Path::new("/")) {
        Ok(root) => root,
        Err(e) => return vec![format!("pid {pid}: removing its perf files: {e}")],
    };
    let dirs = [
        location.perf_dir.as_path(),
        location.legacy_perf_map_dir.as_path(),
    ];
    match remove_perf_files(&root, &dirs, location.ns_pid, owner, started_at) {
        Ok(cleanup) => cleanup.warnings(pid),
        Err(e) => vec![format!("pid {pid}: removing its perf files: {e}")],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbolize::managed::FileRefresh;

    fn jitdump(status: FileStatus) -> RefreshStats {
        RefreshStats {
            jitdump: FileRefresh {
                status,
                ..FileRefresh::default()
            },
            ..RefreshStats::default()
        }
    }

    #[test]
    fn perf_maps_are_turned_on_again_only_when_ours_and_gone() {
        let gone = jitdump(FileStatus::Missing);
        assert!(perf_files_vanished(&gone, true, (0, None)));
        // Not turned on by clrbpf (set by the environment, or not .NET 8).
        assert!(!perf_files_vanished(&gone, false, (0, None)));
        // A runtime that cannot write them is not asked again and again.
        let long_ago = Some(PERF_MAP_REENABLE_EVERY);
        assert!(perf_files_vanished(&gone, true, (1, long_ago)));
        assert!(!perf_files_vanished(
            &gone,
            true,
            (1, Some(Duration::from_secs(1)))
        ));
        assert!(!perf_files_vanished(
            &gone,
            true,
            (MAX_PERF_MAP_REENABLES, long_ago)
        ));
        for status in [
            FileStatus::Read,
            FileStatus::Stale,
            FileStatus::Failed,
            FileStatus::Stopped,
        ] {
            assert!(
                !perf_files_vanished(&jitdump(status), true, (0, None)),
                "{status:?}"
            );
        }
    }
}
