//! `clrbpf record`: wires the stages together for one recording.
//!
//! 1. Check the host ([`crate::bpf::system::prepare`]), load and attach the
//!    kernel side with the chosen target set.
//! 2. Optionally launch the command (as the invoking user, with
//!    `DOTNET_PerfMapEnabled=1`); the kernel side follows its children.
//! 3. Every tick, drain raw samples; learn each new process once (name,
//!    container, mappings, .NET runtime; for a running .NET 8+ process, ask
//!    it for perf maps over its diagnostic socket); symbolize samples a
//!    little after they were taken, so the perf map lines for code JIT-ted
//!    just before a sample have been written; aggregate.
//! 4. On duration, Ctrl-C, SIGTERM, the command's exit or the exit of every
//!    `-p` process: drain what is left, restore the .NET processes, write
//!    the profile, print the summary.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    ffi::{CString, OsString},
    io::{IsTerminal as _, Write as _},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};
use clrbpf_common::offcpu::OffCpuThreadTotals;
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    bpf::{
        KernelCounters, OffCpuConfig, ProgramStats, Sampler, SamplerConfig, UnwindReport,
        UnwindWorker, system,
    },
    clr::{
        collector::ClrCollector,
        intake::{ClrCounters, ClrSampleKind},
        ipc::{PerfMapAttach, PerfMapAttachOutcome, PerfMapUnsupported},
        session::ClrEventKinds,
    },
    export::output::{OutputFormat, write_profile},
    process::{
        ProcFs,
        dotnet::DotnetRuntime,
        maps::{Mapping, MappingTable},
    },
    profile::{
        Aggregator, Frame, FrameKind, Label, Module, RawSample, ValueType, label_keys, wait_kind,
    },
    symbolize::{
        managed::{ManagedSymbols, TargetLocation, remove_perf_files_at},
        native::{FileKey, MappedFile, NativeSymbolizer},
    },
};

/// How long after a sample was taken it is symbolized: the runtime writes a
/// method's perf map line right after JIT-compiling it, and we read the
/// file on a timer.
const SYMBOLIZE_DELAY: Duration = Duration::from_millis(300);
const TICK: Duration = Duration::from_millis(50);
/// How often a process's perf map / jitdump are re-read at most.
const MANAGED_REFRESH_EVERY: Duration = Duration::from_millis(200);
/// How often a process's mappings are re-read at most when an address is
/// not covered by the ones we have.
const MAPS_REFRESH_EVERY: Duration = Duration::from_millis(200);
/// Most samples held back for a late perf map (about 4 KiB each at most).
const MAX_RETRY_SAMPLES: usize = 200_000;
/// After the command exits, keep draining this long for its last samples.
const EXIT_GRACE: Duration = Duration::from_millis(100);

/// Everything `record` needs, already validated.
#[derive(Clone, Debug)]
pub struct RecordConfig {
    pub pids: Vec<u32>,
    pub all: bool,
    pub frequency_hz: u64,
    pub duration: Option<Duration>,
    pub output: PathBuf,
    pub format: OutputFormat,
    pub keep_perf_maps: bool,
    pub perf_map_attach: bool,
    /// Walk user stacks with `.eh_frame` unwind tables in the kernel.
    pub dwarf_unwind: bool,
    /// Kernel memory for unwind tables, allocated in full at load when
    /// [`Self::dwarf_unwind`] is on.
    pub unwind_table_memory_bytes: u64,
    pub command: Vec<OsString>,
    /// Progress line and summary on stderr.
    pub verbose: bool,
    /// CLR events collected from .NET processes (none: no EventPipe session).
    pub clr_events: ClrEventKinds,
    /// One output file per kind (`<stem>.cpu.pb.gz`, ...) instead of one.
    pub split: bool,
    /// Off-CPU intervals of the profiled threads, with their wakers.
    pub off_cpu: Option<OffCpuConfig>,
    /// A `wall/nanoseconds` sample type: CPU plus off-CPU time per thread
    /// (needs [`Self::off_cpu`]).
    pub wall: bool,
}

/// What one recording collected, for the summary line and for tests.
#[derive(Clone, Debug, Default)]
pub struct RecordSummary {
    pub duration: Duration,
    pub samples: u64,
    pub samples_lost: u64,
    pub malformed_records: u64,
    pub processes: usize,
    pub kernel_frames: u64,
    pub managed_frames: u64,
    pub native_frames: u64,
    /// Frames in a known file without a symbol (`libcoreclr.so+0x1234`).
    pub unnamed_frames: u64,
    pub unknown_frames: u64,
    pub truncated_stacks: u64,
    pub perf_maps_enabled: usize,
    pub kernel: KernelCounters,
    pub bpf_stats: ProgramStats,
    /// Kernel-side user-stack walks ended by each error kind.
    /// Kernel-side unwinding (`--dwarf-unwind`): walks ended early by
    /// kind, table memory, processes indexed.
    pub unwind: Option<UnwindReport>,
    pub command_status: Option<std::process::ExitStatus>,
    pub stopped_by: &'static str,
    pub warnings: Vec<String>,
    /// Exact CLR event counters per process that had an EventPipe session.
    pub clr: Vec<(u32, Arc<str>, ClrCounters)>,
    /// Files written (more than one with `split`).
    pub outputs: Vec<PathBuf>,
    /// Exact off-CPU totals of every thread that blocked, most blocked first.
    pub off_cpu_threads: Vec<OffCpuThread>,
    /// BPF stats of the `sched_switch` program (every switch on the host).
    pub off_cpu_bpf_stats: ProgramStats,
}

/// One thread's exact off-CPU totals, for the summary.
#[derive(Clone, Debug, Default)]
pub struct OffCpuThread {
    pub pid: u32,
    pub tid: u32,
    pub thread_name: Arc<str>,
    pub totals: OffCpuThreadTotals,
    /// Off-CPU nanoseconds the profile holds for it (upscaled), and from
    /// how many waits.
    pub recorded_ns: u64,
    pub recorded: u64,
}

/// What we know of one profiled process.
struct TrackedProcess {
    pid: u32,
    exe_name: Arc<str>,
    container_id: Option<Arc<str>>,
    /// Pod and container names (k8s/), looked up once.
    pod: Option<Arc<crate::k8s::PodLabels>>,
    mappings: MappingTable,
    maps_read_at: Option<Instant>,
    managed: Option<ManagedSymbols>,
    managed_read_at: Option<Instant>,
    perf_map: Option<PerfMapAttach>,
    /// Started by the command clrbpf launched, in clrbpf's own mount and
    /// PID namespaces: its perf files are ours to remove.
    launched_here: bool,
    /// Whether to ask the runtime for perf maps once it is seen.
    attach: bool,
    warnings: Vec<String>,
    jit_module: Arc<Module>,
    clr: Option<ClrCollector>,
    clr_events: ClrEventKinds,
    /// CLR events arrived since the perf map was last read.
    clr_symbols_stale: bool,
    /// Name methods from the session's MethodLoad events (no perf map).
    methods_from_events: bool,
}

impl TrackedProcess {
    fn discover(
        procfs: &ProcFs,
        pid: u32,
        native: &mut NativeSymbolizer,
        attach: bool,
        clr_events: ClrEventKinds,
    ) -> Self {
        let info = procfs.process_info(pid).ok();
        let launched_here = info.as_ref().is_some_and(|i| i.ns_pid == pid)
            && is_descendant_of_self(procfs, pid)
            && same_mount_namespace(pid);
        let exe_name: Arc<str> = info
            .as_ref()
            .map_or_else(|| format!("pid-{pid}"), |i| i.exe_name.clone())
            .into();
        let container_id = info
            .as_ref()
            .and_then(|i| i.container_id.clone())
            .map(Arc::from);
        let pod = info.as_ref().and_then(|i| {
            crate::k8s::PodMetadata::global()
                .labels_for(i.container_id.as_deref(), i.pod_uid.as_deref())
        });
        let mut process = Self {
            pid,
            exe_name,
            container_id,
            pod,
            mappings: MappingTable::default(),
            maps_read_at: None,
            managed: None,
            managed_read_at: None,
            perf_map: None,
            launched_here,
            attach,
            warnings: Vec::new(),
            jit_module: Arc::new(Module {
                path: "[jit]".into(),
                build_id: None,
                memory_start: 0,
                memory_limit: 0,
                file_offset: 0,
                has_functions: true,
            }),
            clr: None,
            clr_events,
            clr_symbols_stale: false,
            methods_from_events: false,
        };
        process.refresh_maps(procfs, native);
        process
    }

    fn refresh_maps(&mut self, procfs: &ProcFs, native: &mut NativeSymbolizer) {
        if self
            .maps_read_at
            .is_some_and(|t| t.elapsed() < MAPS_REFRESH_EVERY)
        {
            return;
        }
        self.maps_read_at = Some(Instant::now());
        let Ok(mappings) = procfs.maps(self.pid) else {
            return;
        };
        self.mappings = mappings;
        // A process is often first seen before it maps libcoreclr.so (the
        // `dotnet` host loads it late), so the runtime is looked for at
        // every refresh until found.
        if self.managed.is_none() {
            self.detect_runtime(procfs);
        }
        // Open every executable file now, while the process is alive.
        for m in self.mappings.iter() {
            if let Some(mapped) = mapped_file(self.pid, m) {
                native.prepare(&mapped);
            }
        }
    }

    fn detect_runtime(&mut self, procfs: &ProcFs) {
        let Some(runtime) = DotnetRuntime::detect(&self.mappings) else {
            return;
        };
        let pid = self.pid;
        tracing::debug!(pid, version = ?runtime.version, "found a .NET runtime");
        self.managed = Some(ManagedSymbols::new(pid));
        // Runtimes before .NET 8 cannot be asked for perf maps: a process we
        // did not start gets its JIT frames named from method rundown and
        // MethodLoad events.
        self.methods_from_events =
            self.attach && !self.launched_here && runtime.major().is_some_and(|m| m < 8);
        if self.clr_events.any() {
            self.clr = Some(ClrCollector::new(
                pid,
                self.clr_events,
                runtime.major(),
                self.methods_from_events,
            ));
        }
        if !self.attach {
            return;
        }
        match PerfMapAttach::attach(procfs, pid) {
            Ok(PerfMapAttachOutcome::Enabled(handle)) => self.perf_map = Some(*handle),
            Ok(PerfMapAttachOutcome::AlreadyEnabled { .. }) => {}
            Ok(PerfMapAttachOutcome::Unsupported(PerfMapUnsupported::BeforeNet8 { .. }))
                if self.methods_from_events && self.clr.is_some() =>
            {
                tracing::debug!(
                    pid,
                    "no EnablePerfMap before .NET 8: naming methods by rundown"
                );
            }
            Ok(PerfMapAttachOutcome::Unsupported(PerfMapUnsupported::BeforeNet8 { .. })) => {
                let version = runtime.version.as_deref().unwrap_or("before 8");
                self.warnings.push(format!(
                    "pid {pid} runs .NET {version}, which cannot turn perf maps on at run time: its JIT frames are named only if it was started with DOTNET_PerfMapEnabled=1 (COMPlus_PerfMapEnabled=1 before .NET 5)"
                ));
            }
            Ok(PerfMapAttachOutcome::Unsupported(other)) => {
                self.warnings.push(format!("pid {pid}: {other}"))
            }
            Err(e) => self
                .warnings
                .push(format!("pid {pid}: could not turn on perf maps: {e}")),
        }
    }

    fn refresh_managed(&mut self, force: bool) {
        let Some(managed) = self.managed.as_mut() else {
            return;
        };
        if !force
            && self
                .managed_read_at
                .is_some_and(|t| t.elapsed() < MANAGED_REFRESH_EVERY)
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
    }

    /// Starts or drains this process's EventPipe session.
    fn poll_clr(&mut self, procfs: &ProcFs) {
        let Some(clr) = self.clr.as_mut() else {
            return;
        };
        let mut managed = self.managed.as_mut().filter(|_| self.methods_from_events);
        let taken = clr.poll(procfs, &mut |method, time_ns| {
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
            self.refresh_managed(true);
        }
    }

    /// Stops this process's EventPipe session, if any.
    fn stop_clr(&mut self) {
        let Some(clr) = self.clr.as_mut() else {
            return;
        };
        let mut managed = self.managed.as_mut().filter(|_| self.methods_from_events);
        clr.stop(&mut |method, time_ns| {
            if let Some(managed) = managed.as_deref_mut() {
                add_event_method(managed, method, time_ns);
            }
        });
    }

    fn mapping_for(&self, addr: u64) -> Option<&Mapping> {
        self.mappings.find(addr)
    }
}

/// Sample types added after `samples/count` and `cpu/nanoseconds` when CLR
/// events are collected.
const CLR_SAMPLE_TYPES: [(&str, &str); 3] = [
    ("contentions", "count"),
    ("delay", "nanoseconds"),
    ("exceptions", "count"),
];

/// Names a method from a MethodLoad or rundown event, as a perf map line
/// would (so frames look the same whichever source named them).
fn add_event_method(
    managed: &mut ManagedSymbols,
    method: &crate::clr::events::MethodLoad,
    time_ns: u64,
) {
    use crate::clr::events::MethodEventKind;
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

fn mapped_file(pid: u32, m: &Mapping) -> Option<MappedFile<'_>> {
    if !m.is_executable() || m.is_anonymous() || m.inode == 0 {
        return None;
    }
    let path = m.file_path()?;
    Some(MappedFile {
        pid,
        start: m.start,
        end: m.end,
        offset: m.offset,
        key: FileKey {
            dev_major: m.dev_major,
            dev_minor: m.dev_minor,
            inode: m.inode,
        },
        path,
    })
}

/// Which value of a profile sample is which: positions in the sample types.
#[derive(Clone, Debug)]
struct ValueLayout {
    types: Vec<ValueType>,
    samples: usize,
    cpu: usize,
    off_cpu: Option<usize>,
    wakeup: Option<usize>,
    wall: Option<usize>,
    /// First of [`CLR_SAMPLE_TYPES`] (contentions, delay, exceptions).
    clr: Option<usize>,
}

impl ValueLayout {
    fn new(off_cpu: bool, wall: bool, clr: bool) -> Self {
        let mut types = vec![
            ValueType::new("samples", "count"),
            ValueType::new("cpu", "nanoseconds"),
        ];
        let mut push = |on: bool, t: &[(&str, &str)]| {
            on.then(|| {
                let at = types.len();
                types.extend(t.iter().map(|(t, u)| ValueType::new(t, u)));
                at
            })
        };
        let off_cpu_at = push(off_cpu, &[("off_cpu", "nanoseconds")]);
        let wakeup = push(off_cpu, &[("wakeup", "nanoseconds")]);
        let wall = push(wall, &[("wall", "nanoseconds")]);
        let clr = push(clr, &CLR_SAMPLE_TYPES);
        Self {
            types,
            samples: 0,
            cpu: 1,
            off_cpu: off_cpu_at,
            wakeup,
            wall,
            clr,
        }
    }

    fn zeros(&self) -> Vec<i64> {
        vec![0; self.types.len()]
    }

    /// The sample type a viewer opens on: wall when there is one, else CPU.
    fn default_index(&self) -> usize {
        self.wall.unwrap_or(self.cpu)
    }

    /// The one value folded stacks and flame graphs show: wall time, else
    /// off-CPU time, else (as perf's) CPU sample counts.
    fn folded_index(&self) -> usize {
        self.wall.or(self.off_cpu).unwrap_or(self.samples)
    }
}

/// Turns raw samples into aggregated, symbolized ones.
struct Pipeline {
    procfs: ProcFs,
    attach_perf_maps: bool,
    clr_events: ClrEventKinds,
    native: NativeSymbolizer,
    processes: HashMap<u32, TrackedProcess>,
    aggregator: Aggregator,
    pending: VecDeque<RawSample>,
    summary: RecordSummary,
    stack: Vec<u32>,
    user_frames: Vec<Arc<Frame>>,
    /// Samples waiting for a perf map that names their JIT frames.
    retry: Vec<RawSample>,
    unwind: Option<UnwindWorker>,
    layout: ValueLayout,
    /// Kernel frame names of the sample being added (for `wait.kind`).
    kernel_names: Vec<Arc<str>>,
    /// Thread names seen in samples, for the off-CPU totals.
    thread_names: HashMap<u32, Arc<str>>,
    /// Off-CPU nanoseconds (upscaled) and waits the profile holds, per tid.
    off_cpu_recorded: HashMap<u32, (u64, u64)>,
}

impl Pipeline {
    fn new(attach_perf_maps: bool, clr_events: ClrEventKinds, layout: ValueLayout) -> Self {
        Self {
            procfs: ProcFs::default(),
            attach_perf_maps,
            clr_events,
            native: NativeSymbolizer::new(),
            processes: HashMap::new(),
            aggregator: Aggregator::new(layout.types.clone()),
            pending: VecDeque::new(),
            summary: RecordSummary::default(),
            stack: Vec::with_capacity(256),
            user_frames: Vec::with_capacity(256),
            retry: Vec::new(),
            unwind: None,
            layout,
            kernel_names: Vec::with_capacity(128),
            thread_names: HashMap::new(),
            off_cpu_recorded: HashMap::new(),
        }
    }

    fn track(&mut self, pid: u32) {
        if !self.processes.contains_key(&pid) {
            let process = TrackedProcess::discover(
                &self.procfs,
                pid,
                &mut self.native,
                self.attach_perf_maps,
                self.clr_events,
            );
            self.processes.insert(pid, process);
            if let Some(unwind) = self.unwind.as_ref() {
                unwind.track_process(pid);
            }
        }
    }

    /// Starts, drains (and notices the end of) every EventPipe session.
    fn poll_clr(&mut self) {
        for process in self.processes.values_mut() {
            process.poll_clr(&self.procfs);
        }
    }

    /// The end of the recording: stops every session, then adds the kept
    /// CLR events, symbolized like CPU samples' user stacks at their own
    /// time and weighted so the totals are exact.
    fn finish_clr(&mut self) {
        for process in self.processes.values_mut() {
            process.stop_clr();
        }
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
        for process in processes.values_mut() {
            let Some(mut clr) = process.clr.take() else {
                continue;
            };
            process.refresh_managed(true);
            summary.warnings.append(&mut clr.take_warnings());
            if clr.had_session() {
                summary
                    .clr
                    .push((process.pid, process.exe_name.clone(), clr.counters()));
            }
            let kept = clr.finish();
            add_clr_samples(native, procfs, layout, aggregator, stack, process, kept);
        }
    }

    /// Adds the CLR samples of the sampling windows closed so far, so a
    /// long recording holds at most one window of them per process.
    fn flush_clr_windows(&mut self) {
        let Self {
            native,
            processes,
            aggregator,
            stack,
            procfs,
            layout,
            ..
        } = self;
        for process in processes.values_mut() {
            let Some(kept) = process.clr.as_mut().map(ClrCollector::take_completed) else {
                continue;
            };
            if !kept.is_empty() {
                process.refresh_managed(true);
                add_clr_samples(native, procfs, layout, aggregator, stack, process, kept);
            }
        }
    }

    fn accept(&mut self, samples: &mut Vec<RawSample>) {
        for sample in samples.drain(..) {
            self.track(sample.pid);
            self.pending.push_back(sample);
        }
    }

    /// Symbolizes and aggregates the samples taken before `until_ns`
    /// (`u64::MAX`: all of them).
    fn process_pending(&mut self, until_ns: u64) {
        let due: HashSet<u32> = self
            .pending
            .iter()
            .take_while(|s| s.time_ns < until_ns)
            .map(|s| s.pid)
            .collect();
        for pid in due {
            if let Some(p) = self.processes.get_mut(&pid) {
                p.refresh_managed(false);
            }
        }
        while self.pending.front().is_some_and(|s| s.time_ns < until_ns) {
            let Some(sample) = self.pending.pop_front() else {
                break;
            };
            self.add_sample(&sample, false);
        }
    }

    /// The end of the recording: every perf map read one last time, then
    /// every sample symbolized, the held-back ones included.
    fn process_all(&mut self) {
        for process in self.processes.values_mut() {
            process.refresh_managed(true);
        }
        let pending: Vec<RawSample> = self.pending.drain(..).collect();
        let retry = std::mem::take(&mut self.retry);
        for sample in pending.iter().chain(&retry) {
            self.add_sample(sample, true);
        }
    }

    /// Symbolizes one sample and adds it. Before the final pass, a sample
    /// with a JIT frame its process's perf map does not name yet goes to the
    /// retry queue instead: runtimes before .NET 5 buffer their perf map and
    /// write most of it late, so the final read names it.
    fn add_sample(&mut self, sample: &RawSample, final_pass: bool) {
        let Self {
            native,
            processes,
            aggregator,
            summary,
            stack,
            procfs,
            user_frames,
            retry,
            layout,
            kernel_names,
            thread_names,
            off_cpu_recorded,
            ..
        } = self;
        user_frames.clear();
        if let Some(process) = processes.get_mut(&sample.pid) {
            for (i, &addr) in sample.user_stack.iter().enumerate() {
                let is_return_address = i > 0;
                user_frames.push(user_frame(
                    native,
                    procfs,
                    process,
                    addr,
                    is_return_address,
                    sample.time_ns,
                ));
            }
            let unresolved_jit = process.managed.is_some()
                && user_frames
                    .iter()
                    .any(|f| f.kind == FrameKind::Unknown && f.module.is_none());
            if unresolved_jit && !final_pass && retry.len() < MAX_RETRY_SAMPLES {
                retry.push(sample.clone());
                return;
            }
        }
        let Some(process) = processes.get(&sample.pid) else {
            return;
        };
        summary.samples += 1;
        stack.clear();
        kernel_names.clear();
        for &addr in &sample.kernel_stack {
            let frame = native.symbolize_kernel(addr);
            summary.kernel_frames += 1;
            if sample.off_cpu.is_some() {
                kernel_names.push(frame.name.clone());
            }
            stack.push(aggregator.intern(&frame));
        }
        if sample.kernel_stack_truncated {
            stack.push(aggregator.intern(&Frame::synthetic("[truncated kernel stack]")));
        }
        for frame in user_frames.iter() {
            match (frame.kind, &frame.module) {
                (FrameKind::Managed, _) => summary.managed_frames += 1,
                (FrameKind::Native, _) => summary.native_frames += 1,
                (_, Some(_)) => summary.unnamed_frames += 1,
                (_, None) => summary.unknown_frames += 1,
            }
            stack.push(aggregator.intern(frame));
        }
        if sample.user_stack_truncated {
            summary.truncated_stacks += 1;
            stack.push(aggregator.intern(&Frame::synthetic("[truncated]")));
        }
        crate::profile::gc::add_gc_root(&sample.thread_name, stack, aggregator);
        let mut labels = vec![
            Label::num(label_keys::PROCESS_PID, i64::from(sample.pid)),
            Label::str(
                label_keys::PROCESS_EXECUTABLE_NAME,
                process.exe_name.clone(),
            ),
            Label::num(label_keys::THREAD_ID, i64::from(sample.tid)),
            Label::str(label_keys::THREAD_NAME, sample.thread_name.clone()),
        ];
        if let Some(id) = &process.container_id {
            labels.push(Label::str(label_keys::CONTAINER_ID, id.clone()));
        }
        labels.extend(process.pod.iter().flat_map(|pod| pod.sample_labels()));
        let value = i64::try_from(sample.value).unwrap_or(i64::MAX);
        let mut values = layout.zeros();
        let Some(off_cpu) = &sample.off_cpu else {
            values[layout.samples] = 1;
            values[layout.cpu] = value;
            if let Some(wall) = layout.wall {
                values[wall] = value;
            }
            aggregator.add(stack, labels, &values);
            return;
        };
        // The latest name: a new thread blocks before it names itself.
        thread_names.insert(sample.tid, sample.thread_name.clone());
        let waker_kernel: Vec<Arc<Frame>> = off_cpu
            .waker_kernel_stack
            .iter()
            .map(|&addr| native.symbolize_kernel(addr))
            .collect();
        let kind = wait_kind::classify(
            off_cpu.syscall,
            wait_kind::woken_by_timer(waker_kernel.iter().map(|f| &*f.name)),
            kernel_names.iter().map(|n| &**n),
        );
        labels.push(Label::str(label_keys::WAIT_KIND, kind.name()));
        if let Some(at) = layout.off_cpu {
            values[at] = value;
        }
        if let Some(wall) = layout.wall {
            values[wall] = value;
        }
        if off_cpu.stack_not_taken {
            stack.insert(
                0,
                aggregator.intern(&Frame::synthetic("[stack not taken: --off-cpu-max-stacks]")),
            );
        }
        let recorded = off_cpu_recorded.entry(sample.tid).or_default();
        recorded.0 += sample.value;
        recorded.1 += 1;
        let Some(wakeup) = layout.wakeup else {
            aggregator.add(stack, labels, &values);
            return;
        };
        let blocked = stack.clone();
        aggregator.add(stack, labels.clone(), &values);
        if off_cpu.waker.is_none() && waker_kernel.is_empty() {
            return;
        }
        // As bcc's offwaketime: the waker's stack, root first, on top of a
        // `--` frame on top of the blocked stack, so a flame graph reads
        // "blocked in X (below), released by Y (above)".
        stack.clear();
        let in_interrupt = wait_kind::woken_in_interrupt(waker_kernel.iter().map(|f| &*f.name));
        match &off_cpu.waker {
            Some(waker) if !in_interrupt => {
                stack.push(aggregator.intern(&Frame::synthetic(&format!(
                    "{} (pid {})",
                    waker.thread_name, waker.pid
                ))));
                if let Some(process) = processes.get_mut(&waker.pid) {
                    for (i, &addr) in waker.user_stack.iter().enumerate().rev() {
                        let frame =
                            user_frame(native, procfs, process, addr, i > 0, sample.time_ns);
                        stack.push(aggregator.intern(&frame));
                    }
                } else {
                    stack.push(aggregator.intern(&Frame::synthetic("[process not profiled]")));
                }
                labels.push(Label::num(
                    label_keys::WAKER_PROCESS_PID,
                    i64::from(waker.pid),
                ));
                labels.push(Label::num(
                    label_keys::WAKER_THREAD_ID,
                    i64::from(waker.tid),
                ));
                labels.push(Label::str(
                    label_keys::WAKER_THREAD_NAME,
                    waker.thread_name.clone(),
                ));
            }
            _ => stack.push(aggregator.intern(&Frame::synthetic("[interrupt]"))),
        }
        for frame in waker_kernel.iter().rev() {
            stack.push(aggregator.intern(frame));
        }
        stack.push(aggregator.intern(&Frame::synthetic("--")));
        stack.extend_from_slice(&blocked);
        let mut waker_values = layout.zeros();
        waker_values[wakeup] = value;
        aggregator.add(stack, labels, &waker_values);
    }

    /// Turns perf maps off again in the processes where we turned them on,
    /// and removes the perf files of the processes the command started.
    fn restore_processes(&mut self, keep_files: bool) {
        for process in self.processes.values_mut() {
            self.summary.warnings.append(&mut process.warnings);
            if !keep_files
                && process.launched_here
                && let Some(managed) = process.managed.as_ref()
            {
                // The process may be gone, and /proc/PID/root with it: it
                // shared our mount namespace, so our root is its root.
                let location = TargetLocation {
                    root: "/".into(),
                    ..managed.location().clone()
                };
                if let Err(e) = remove_perf_files_at(&location) {
                    self.summary
                        .warnings
                        .push(format!("pid {}: removing its perf map: {e}", process.pid));
                }
            }
            if let Some(handle) = process.perf_map.take() {
                self.summary.perf_maps_enabled += 1;
                let cleanup = handle.finish(keep_files);
                // A process that exited has nothing left to turn off.
                if let Err(e) = cleanup.disable
                    && process_exists(process.pid)
                {
                    self.summary.warnings.push(format!(
                        "pid {}: turning perf maps off again: {e}",
                        process.pid
                    ));
                }
                for (path, e) in cleanup.failed {
                    self.summary.warnings.push(format!(
                        "pid {}: removing {}: {e}",
                        process.pid,
                        path.display()
                    ));
                }
            }
        }
    }
}

fn user_frame(
    native: &mut NativeSymbolizer,
    procfs: &ProcFs,
    process: &mut TrackedProcess,
    addr: u64,
    is_return_address: bool,
    time_ns: u64,
) -> Arc<Frame> {
    let lookup = if is_return_address {
        addr.saturating_sub(1)
    } else {
        addr
    };
    if let Some(managed) = process.managed.as_ref()
        && let Some(symbol) = managed.lookup(lookup, time_ns)
    {
        return Arc::new(Frame {
            kind: FrameKind::Managed,
            name: symbol.name.clone(),
            system_name: (symbol.raw_name != symbol.name).then(|| symbol.raw_name.clone()),
            jit_tier: symbol.jit_tier.clone(),
            module: Some(process.jit_module.clone()),
            address: addr,
            file: None,
            line: 0,
            inlined: Vec::new(),
        });
    }
    if process.mapping_for(addr).is_none() {
        process.refresh_maps(procfs, native);
    }
    let pid = process.pid;
    match process.mapping_for(addr) {
        Some(m) => match mapped_file(pid, m) {
            Some(mapped) => native.symbolize_user(&mapped, addr, is_return_address),
            None => Arc::new(crate::symbolize::native::unnamed_frame(None, addr, 0)),
        },
        None => Arc::new(crate::symbolize::native::unnamed_frame(None, addr, 0)),
    }
}

/// Symbolizes weighted CLR samples (their stacks like CPU samples' user
/// stacks, at the event's time) and adds them with their exact shares.
fn add_clr_samples(
    native: &mut NativeSymbolizer,
    procfs: &ProcFs,
    layout: &ValueLayout,
    aggregator: &mut Aggregator,
    stack: &mut Vec<u32>,
    process: &mut TrackedProcess,
    kept: Vec<crate::profile::clr_sampling::Weighted<crate::clr::intake::ClrSample>>,
) {
    for weighted in kept {
        let crate::profile::clr_sampling::Weighted {
            item,
            count,
            delay_ns,
        } = weighted;
        stack.clear();
        for &addr in &item.stack {
            let frame = user_frame(native, procfs, process, addr, true, item.time_ns);
            stack.push(aggregator.intern(&frame));
        }
        if item.stack.is_empty() {
            stack.push(aggregator.intern(&Frame::synthetic("[no stack]")));
        }
        let mut labels = vec![
            Label::num(label_keys::PROCESS_PID, i64::from(process.pid)),
            Label::str(
                label_keys::PROCESS_EXECUTABLE_NAME,
                process.exe_name.clone(),
            ),
            Label::num(
                label_keys::THREAD_ID,
                i64::try_from(item.thread_id).unwrap_or(i64::MAX),
            ),
        ];
        if let Some(id) = &process.container_id {
            labels.push(Label::str(label_keys::CONTAINER_ID, id.clone()));
        }
        labels.extend(process.pod.iter().flat_map(|pod| pod.sample_labels()));
        labels.extend(item.labels);
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        let delay = i64::try_from(delay_ns).unwrap_or(i64::MAX);
        let Some(clr) = layout.clr else {
            continue;
        };
        let mut values = layout.zeros();
        match item.kind {
            ClrSampleKind::Contention => {
                values[clr] = count;
                values[clr + 1] = delay;
            }
            ClrSampleKind::Exception => values[clr + 2] = count,
        }
        aggregator.add(stack, labels, &values);
    }
}

/// The invoking user under sudo: (uid, gid, name).
fn sudo_user() -> Option<(u32, u32, CString)> {
    let uid = std::env::var("SUDO_UID").ok()?.parse().ok()?;
    let gid = std::env::var("SUDO_GID").ok()?.parse().ok()?;
    let name = CString::new(std::env::var("SUDO_USER").ok()?).ok()?;
    (uid != 0).then_some((uid, gid, name))
}

fn spawn_command(command: &[OsString]) -> anyhow::Result<tokio::process::Child> {
    let (program, args) = command.split_first().context("no command given")?;
    let mut cmd = tokio::process::Command::new(program);
    // .NET 5+ reads DOTNET_ settings; .NET Core 3.x only COMPlus_ ones.
    cmd.args(args)
        .env("DOTNET_PerfMapEnabled", "1")
        .env("COMPlus_PerfMapEnabled", "1")
        .kill_on_drop(false);
    if let Some((uid, gid, name)) = sudo_user() {
        // SAFETY: only async-signal-safe libc calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::initgroups(name.as_ptr(), gid) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd.spawn()
        .with_context(|| format!("cannot run {}", program.to_string_lossy()))
}

/// Whether `pid` descends from this process (the launched command's tree).
fn is_descendant_of_self(procfs: &ProcFs, pid: u32) -> bool {
    let me = std::process::id();
    let mut current = pid;
    // Bounded: a process tree deeper than this is not ours to clean up.
    for _ in 0..64 {
        match procfs.process_info(current) {
            Ok(info) if info.ppid == me => return true,
            Ok(info) if info.ppid > 1 => current = info.ppid,
            _ => return false,
        }
    }
    false
}

fn same_mount_namespace(pid: u32) -> bool {
    let ns = |p: &str| {
        std::fs::metadata(p)
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .ok()
    };
    let theirs = ns(&format!("/proc/{pid}/ns/mnt"));
    theirs.is_some() && theirs == ns("/proc/self/ns/mnt")
}

fn process_exists(pid: u32) -> bool {
    // A zombie still answers kill(0); its stat state is Z.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// Runs one recording to its end and writes the output file.
pub async fn record(config: RecordConfig) -> anyhow::Result<RecordSummary> {
    let RecordConfig {
        pids,
        all,
        frequency_hz,
        duration,
        output,
        format,
        keep_perf_maps,
        perf_map_attach,
        dwarf_unwind,
        unwind_table_memory_bytes,
        command,
        verbose,
        clr_events,
        split,
        off_cpu,
        wall,
    } = config;
    if wall && off_cpu.is_none() {
        bail!("--wall needs off-CPU time: add --off-cpu");
    }
    for &pid in &pids {
        if !process_exists(pid) {
            bail!(
                "process {pid} does not exist (not running): check the pid with `ps` or `clrbpf ps`"
            );
        }
    }
    let mut warnings = system::prepare()?;
    let whole_host = all || (pids.is_empty() && command.is_empty());
    let mut initial_targets = pids.clone();
    if !command.is_empty() && !whole_host {
        // The command is forked by this process: following our own forks
        // until the child is in the set means none of its children escape.
        initial_targets.push(std::process::id());
    }
    let mut sampler = Sampler::start(&SamplerConfig {
        frequency_hz,
        target_pids: (!whole_host).then_some(initial_targets),
        user_unwind: dwarf_unwind,
        unwind_table_memory_bytes,
        off_cpu,
        ..SamplerConfig::default()
    })?;
    let layout = ValueLayout::new(off_cpu.is_some(), wall, clr_events.any());
    let mut pipeline = Pipeline::new(perf_map_attach, clr_events, layout.clone());
    pipeline.unwind = match sampler.take_unwind_maps() {
        Some(maps) => Some(UnwindWorker::spawn(maps).context("start the unwind table thread")?),
        None => None,
    };
    for &pid in &pids {
        pipeline.track(pid);
    }
    let start_unix_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    let started = Instant::now();

    let mut child = if command.is_empty() {
        None
    } else {
        let child = spawn_command(&command)?;
        if let Some(pid) = child.id()
            && !whole_host
        {
            sampler.add_target(pid)?;
            sampler.remove_target(std::process::id());
        }
        Some(child)
    };

    let mut sigint = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let progress = verbose && std::io::stderr().is_terminal();
    let mut last_progress = Instant::now();
    let mut raw = Vec::with_capacity(4096);
    let mut command_exited_at: Option<Instant> = None;

    let stopped_by = loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = sigint.recv() => break "Ctrl-C",
            _ = sigterm.recv() => {
                if let Some(child) = child.as_mut() {
                    // Best effort: the command may have exited already.
                    let _ = child.start_kill();
                }
                break "SIGTERM";
            }
            status = async { child.as_mut().expect("guarded").wait().await }, if child.is_some() && command_exited_at.is_none() => {
                pipeline.summary.command_status = status.ok();
                command_exited_at = Some(Instant::now());
            }
        }
        pipeline.summary.malformed_records += sampler.drain(&mut raw);
        pipeline.accept(&mut raw);
        if let Some(unwind) = pipeline.unwind.as_ref() {
            for pid in sampler.take_pids_to_rescan() {
                unwind.refresh_process(pid);
            }
        }
        pipeline.poll_clr();
        pipeline.flush_clr_windows();
        pipeline.process_pending(
            crate::profile::monotonic_ns().saturating_sub(SYMBOLIZE_DELAY.as_nanos() as u64),
        );
        if command_exited_at.is_some_and(|t| t.elapsed() >= EXIT_GRACE) {
            break "command exited";
        }
        if duration.is_some_and(|d| started.elapsed() >= d) {
            break "duration";
        }
        if child.is_none() && !pids.is_empty() && !pids.iter().any(|&p| process_exists(p)) {
            break "processes exited";
        }
        if progress && last_progress.elapsed() >= Duration::from_secs(1) {
            last_progress = Instant::now();
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\rclrbpf: recording {:>5.1} s, {} samples, {} processes (Ctrl-C to stop) ",
                started.elapsed().as_secs_f64(),
                pipeline.summary.samples + pipeline.pending.len() as u64,
                pipeline.processes.len()
            );
            let _ = err.flush();
        }
    };
    if progress {
        eprint!("\r{:80}\r", "");
    }
    let elapsed = started.elapsed();
    pipeline.summary.malformed_records += sampler.drain(&mut raw);
    pipeline.accept(&mut raw);
    let mut blocked_now = sampler.still_blocked(crate::profile::monotonic_ns());
    let mut off_cpu_totals = sampler.off_cpu_totals();
    add_still_blocked(&mut off_cpu_totals, &blocked_now);
    pipeline.accept(&mut blocked_now);
    pipeline.summary.kernel = sampler.counters();
    pipeline.summary.bpf_stats = sampler.on_cpu_program_stats();
    pipeline.summary.off_cpu_bpf_stats = sampler.off_cpu_program_stats();
    if let Some(unwind) = pipeline.unwind.take() {
        pipeline.summary.unwind = unwind.finish();
    }
    let period_ns = sampler.period_ns;
    drop(sampler);
    pipeline.finish_clr();
    pipeline.process_all();
    pipeline.restore_processes(keep_perf_maps);

    let mut summary = std::mem::take(&mut pipeline.summary);
    summary.off_cpu_threads = off_cpu_threads(
        off_cpu_totals,
        &pipeline.thread_names,
        &pipeline.off_cpu_recorded,
    );
    summary.processes = pipeline.processes.len();
    summary.duration = elapsed;
    summary.samples_lost = summary.kernel.samples_lost;
    summary.stopped_by = stopped_by;
    warnings.append(&mut summary.warnings);
    summary.warnings = warnings;

    let mut profile = pipeline.aggregator.finish(
        Some(ValueType::new("cpu", "nanoseconds")),
        period_ns as i64,
        start_unix_ns,
        elapsed.as_nanos() as i64,
    );
    profile.default_sample_type = Some(layout.default_index());
    profile
        .comments
        .push(format!("clrbpf {}", env!("CARGO_PKG_VERSION")));
    profile
        .comments
        .push(format!("frequency {frequency_hz} Hz"));
    let owner = sudo_user().map(|(uid, gid, _)| (uid, gid));
    let sample_type_index = match format {
        OutputFormat::Pprof => layout.default_index(),
        OutputFormat::Collapsed | OutputFormat::Svg => layout.folded_index(),
    };
    if split {
        for (path, types, index) in split_outputs(&output, format, &layout) {
            let mut part = select_sample_types(&profile, &types);
            part.default_sample_type = Some(index);
            write_profile(&part, format, index, &path, owner)
                .with_context(|| format!("write {}", path.display()))?;
            summary.outputs.push(path);
        }
    } else {
        write_profile(&profile, format, sample_type_index, &output, owner)
            .with_context(|| format!("write {}", output.display()))?;
        summary.outputs.push(output);
    }
    Ok(summary)
}

/// `--split`: for `out.pb.gz`, `out.cpu.pb.gz` (samples, cpu),
/// `out.offcpu.pb.gz` (off_cpu, wakeup), `out.wall.pb.gz`,
/// `out.contention.pb.gz` (contentions, delay) and `out.exceptions.pb.gz`,
/// those the recording has, with the sample types each keeps (indices
/// into the combined profile) and the one folded stacks and flame graphs
/// show (an index into the kept ones).
fn split_outputs(
    output: &std::path::Path,
    format: OutputFormat,
    layout: &ValueLayout,
) -> Vec<(PathBuf, Vec<usize>, usize)> {
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (stem, extension) = match name.strip_suffix(".pb.gz") {
        Some(stem) => (stem.to_owned(), ".pb.gz".to_owned()),
        None => match name.rsplit_once('.') {
            Some((stem, ext)) if !stem.is_empty() => (stem.to_owned(), format!(".{ext}")),
            _ => (name.clone(), String::new()),
        },
    };
    let folded = !matches!(format, OutputFormat::Pprof);
    let mut parts = vec![(
        "cpu",
        vec![layout.samples, layout.cpu],
        if folded { 0 } else { 1 },
    )];
    if let (Some(off_cpu), Some(wakeup)) = (layout.off_cpu, layout.wakeup) {
        parts.push(("offcpu", vec![off_cpu, wakeup], 0));
    }
    if let Some(wall) = layout.wall {
        parts.push(("wall", vec![wall], 0));
    }
    if let Some(clr) = layout.clr {
        parts.push(("contention", vec![clr, clr + 1], 1));
        parts.push(("exceptions", vec![clr + 2], 0));
    }
    parts
        .into_iter()
        .map(|(kind, types, index)| {
            (
                output.with_file_name(format!("{stem}.{kind}{extension}")),
                types,
                index,
            )
        })
        .collect()
}

/// The part of `profile` with only the sample types `types`, and only the
/// samples with a value in one of them.
fn select_sample_types(
    profile: &crate::profile::Profile,
    types: &[usize],
) -> crate::profile::Profile {
    let mut part = profile.clone();
    part.sample_types = types
        .iter()
        .filter_map(|&i| profile.sample_types.get(i).cloned())
        .collect();
    part.samples = profile
        .samples
        .iter()
        .filter_map(|sample| {
            let values: Vec<i64> = types
                .iter()
                .map(|&i| sample.values.get(i).copied().unwrap_or(0))
                .collect();
            values
                .iter()
                .any(|&v| v != 0)
                .then(|| crate::profile::ProfileSample {
                    values,
                    ..sample.clone()
                })
        })
        .collect();
    let keeps_cpu = types.contains(&1);
    if !keeps_cpu {
        part.period_type = None;
        part.period = 0;
    }
    part
}

/// Adds the intervals of the threads still blocked at the end, which no
/// switch-in measured, to the exact totals.
fn add_still_blocked(totals: &mut Vec<(u32, OffCpuThreadTotals)>, blocked: &[RawSample]) {
    for sample in blocked {
        let interval = sample.off_cpu.as_ref().map_or(0, |o| o.interval_ns);
        let at = match totals.iter().position(|(tid, _)| *tid == sample.tid) {
            Some(at) => at,
            None => {
                totals.push((
                    sample.tid,
                    OffCpuThreadTotals {
                        pid: sample.pid,
                        ..Default::default()
                    },
                ));
                totals.len() - 1
            }
        };
        let t = &mut totals[at].1;
        t.blocked_ns += interval;
        t.intervals += 1;
    }
}

/// The totals as summary rows, most blocked first, with what the profile
/// holds of each thread (`recorded`).
fn off_cpu_threads(
    totals: Vec<(u32, OffCpuThreadTotals)>,
    names: &HashMap<u32, Arc<str>>,
    recorded: &HashMap<u32, (u64, u64)>,
) -> Vec<OffCpuThread> {
    let mut rows: Vec<OffCpuThread> = totals
        .into_iter()
        .map(|(tid, totals)| {
            let (recorded_ns, recorded) = recorded.get(&tid).copied().unwrap_or_default();
            OffCpuThread {
                pid: totals.pid,
                tid,
                thread_name: names.get(&tid).cloned().unwrap_or_else(|| "?".into()),
                totals,
                recorded_ns,
                recorded,
            }
        })
        .collect();
    rows.sort_by_key(|t| std::cmp::Reverse(t.totals.blocked_ns));
    rows
}

/// Threads listed by name in the off-CPU part of the summary.
const OFF_CPU_SUMMARY_THREADS: usize = 10;

/// The off-CPU headline: exact totals against what the profile holds.
fn off_cpu_summary(summary: &RecordSummary) -> Option<String> {
    let k = &summary.kernel;
    if k.off_cpu_blocked == 0 && summary.off_cpu_threads.is_empty() {
        return None;
    }
    let sum = |f: fn(&OffCpuThread) -> u64| -> u64 { summary.off_cpu_threads.iter().map(f).sum() };
    let blocked = sum(|t| t.totals.blocked_ns);
    let recorded = sum(|t| t.recorded_ns);
    let stats = &summary.off_cpu_bpf_stats;
    let per_switch = if stats.run_count > 0 {
        format!(
            ", sched_switch BPF {:.2} us per switch over {} switches",
            stats.run_time_ns as f64 / stats.run_count as f64 / 1000.0,
            stats.run_count
        )
    } else {
        String::new()
    };
    Some(format!(
        "clrbpf: off-CPU: {:.1} ms blocked (exact) in {} waits of {} threads; the profile holds {:.1} ms ({:+.1}%) from {} kept waits; {} stacks skipped by the rate limit, {} lost to a full ring, {} not tracked (pending map full), {} wakers recorded{per_switch}",
        blocked as f64 / 1e6,
        sum(|t| t.totals.intervals),
        summary.off_cpu_threads.len(),
        recorded as f64 / 1e6,
        if blocked == 0 {
            0.0
        } else {
            100.0 * (recorded as f64 - blocked as f64) / blocked as f64
        },
        sum(|t| t.recorded),
        k.off_cpu_stacks_skipped,
        sum(|t| t.totals.lost),
        k.off_cpu_pending_full,
        k.off_cpu_wakers,
    ))
}

/// The end-of-recording summary, for a person.
pub fn print_summary(
    summary: &RecordSummary,
    output: &std::path::Path,
    mut w: impl std::io::Write,
) -> std::io::Result<()> {
    let user_frames = summary.managed_frames
        + summary.native_frames
        + summary.unnamed_frames
        + summary.unknown_frames;
    let share = |n: u64| {
        if user_frames == 0 {
            0.0
        } else {
            100.0 * n as f64 / user_frames as f64
        }
    };
    writeln!(
        w,
        "clrbpf: recorded {:.1} s ({}), {} samples from {} processes, {} lost, written to {}",
        summary.duration.as_secs_f64(),
        summary.stopped_by,
        summary.samples,
        summary.processes,
        summary.samples_lost,
        output.display()
    )?;
    writeln!(
        w,
        "clrbpf: user frames: {:.1}% managed, {:.1}% native named, {:.1}% native without symbols (file+offset), {:.1}% unknown ({} frames); {} kernel frames",
        share(summary.managed_frames),
        share(summary.native_frames),
        share(summary.unnamed_frames),
        share(summary.unknown_frames),
        user_frames,
        summary.kernel_frames
    )?;
    if summary.truncated_stacks > 0 || summary.malformed_records > 0 {
        writeln!(
            w,
            "clrbpf: {} stacks deeper than the limit (marked [truncated]), {} malformed records",
            summary.truncated_stacks, summary.malformed_records
        )?;
    }
    if summary.perf_maps_enabled > 0 {
        writeln!(
            w,
            "clrbpf: turned perf maps on and off again in {} running .NET processes",
            summary.perf_maps_enabled
        )?;
    }
    for (pid, name, counters) in &summary.clr {
        writeln!(
            w,
            "clrbpf: pid {pid} ({name}): {} exceptions thrown, {} contentions, {:.1} ms contention time",
            counters.exceptions,
            counters.contentions,
            counters.contention_ns as f64 / 1e6
        )?;
    }
    if summary.outputs.len() > 1 {
        for path in &summary.outputs {
            writeln!(w, "clrbpf: wrote {}", path.display())?;
        }
    }
    if let Some(line) = off_cpu_summary(summary) {
        writeln!(w, "{line}")?;
        for t in summary.off_cpu_threads.iter().take(OFF_CPU_SUMMARY_THREADS) {
            writeln!(
                w,
                "clrbpf:   tid {} ({}, pid {}): {:.1} ms off-CPU in {} waits; the profile holds {:.1} ms from {} of them",
                t.tid,
                t.thread_name,
                t.pid,
                t.totals.blocked_ns as f64 / 1e6,
                t.totals.intervals,
                t.recorded_ns as f64 / 1e6,
                t.recorded
            )?;
        }
        if summary.off_cpu_threads.len() > OFF_CPU_SUMMARY_THREADS {
            writeln!(
                w,
                "clrbpf:   ... and {} more threads",
                summary.off_cpu_threads.len() - OFF_CPU_SUMMARY_THREADS
            )?;
        }
    }
    if summary.bpf_stats.run_count > 0 {
        writeln!(
            w,
            "clrbpf: BPF time per sample {:.2} us",
            summary.bpf_stats.run_time_ns as f64 / summary.bpf_stats.run_count as f64 / 1000.0
        )?;
    }
    if let Some(unwind) = &summary.unwind {
        let errors: Vec<String> = unwind
            .errors
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(e, n)| format!("{} {n}", e.name()))
            .collect();
        let memory = &unwind.memory;
        writeln!(
            w,
            "clrbpf: unwind tables {:.1} MiB in {} files, {} processes indexed (cap {:.0} MiB); {} user stacks walked with them, {} by frame pointers (process not indexed yet); walks ended early: {}",
            memory.table_bytes as f64 / 1048576.0,
            memory.tables,
            unwind.stats.processes_indexed,
            memory.capacity_bytes as f64 / 1048576.0,
            summary.kernel.user_stacks_unwound,
            summary.kernel.unwind_process_unknown,
            if errors.is_empty() {
                "none".to_owned()
            } else {
                errors.join(", ")
            }
        )?;
    }
    for warning in &summary.warnings {
        writeln!(w, "clrbpf: warning: {warning}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::OffCpuDetail;

    fn blocked(pid: u32, tid: u32, interval_ns: u64) -> RawSample {
        RawSample {
            time_ns: 0,
            pid,
            tid,
            cpu: 0,
            kind: clrbpf_common::SampleKind::OffCpu,
            value: interval_ns,
            thread_name: "t".into(),
            kernel_stack: Vec::new(),
            user_stack: Vec::new(),
            kernel_stack_truncated: false,
            user_stack_truncated: false,
            off_cpu: Some(OffCpuDetail {
                interval_ns,
                syscall: Some(202),
                woken_tid: 0,
                waker: None,
                waker_kernel_stack: Vec::new(),
                stack_not_taken: false,
            }),
        }
    }

    #[test]
    fn still_blocked_threads_join_the_exact_totals() {
        let mut totals = vec![(
            7,
            OffCpuThreadTotals {
                blocked_ns: 1_000,
                intervals: 3,
                pid: 5,
                ..Default::default()
            },
        )];
        add_still_blocked(&mut totals, &[blocked(5, 7, 500), blocked(5, 8, 40)]);
        assert_eq!(totals.len(), 2);
        assert_eq!(totals[0].1.blocked_ns, 1_500);
        assert_eq!(totals[0].1.intervals, 4);
        assert_eq!(totals[1].0, 8);
        assert_eq!(totals[1].1.pid, 5);
        assert_eq!(totals[1].1.blocked_ns, 40);
        let rows = off_cpu_threads(
            totals,
            &HashMap::from([(8, Arc::from("Worker"))]),
            &HashMap::from([(7, (2_000, 2))]),
        );
        assert_eq!(rows[0].recorded_ns, 2_000, "the profile's figure");
        assert_eq!(rows[0].recorded, 2);
        assert_eq!(rows[1].recorded_ns, 0);
        assert_eq!(rows[0].tid, 7, "most blocked first");
        assert_eq!(&*rows[1].thread_name, "Worker");
    }

    #[test]
    fn value_layout_places_each_kind_once() {
        let layout = ValueLayout::new(true, true, true);
        let names: Vec<&str> = layout.types.iter().map(|t| &*t.r#type).collect();
        assert_eq!(
            names,
            [
                "samples",
                "cpu",
                "off_cpu",
                "wakeup",
                "wall",
                "contentions",
                "delay",
                "exceptions"
            ]
        );
        assert_eq!(layout.default_index(), 4);
        assert_eq!(layout.folded_index(), 4);
        let cpu_only = ValueLayout::new(false, false, false);
        assert_eq!(cpu_only.types.len(), 2);
        assert_eq!(cpu_only.default_index(), 1);
        assert_eq!(cpu_only.folded_index(), 0);
        let parts = split_outputs(
            std::path::Path::new("/x/out.pb.gz"),
            OutputFormat::Pprof,
            &layout,
        );
        let files: Vec<String> = parts
            .iter()
            .map(|(p, _, _)| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            files,
            [
                "out.cpu.pb.gz",
                "out.offcpu.pb.gz",
                "out.wall.pb.gz",
                "out.contention.pb.gz",
                "out.exceptions.pb.gz"
            ]
        );
        assert_eq!(parts[1].1, vec![2, 3]);
        assert_eq!(parts[4].1, vec![7]);
    }
}
