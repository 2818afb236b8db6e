//! Kernel side, user half: loads the eBPF object embedded at build time,
//! attaches `on_cpu_sample` to a `cpu-clock` perf event on every online CPU
//! and the process-tree tracepoints, and turns ring-buffer records into
//! [`RawSample`]s and [`ProcessEvent`]s (exits and execs, in order with the
//! samples) for the rest of the pipeline.

pub mod probe;
mod stack_copies;
pub mod start_tables;
pub mod system;
pub mod table_times;
pub mod unwind_maps;
mod unwind_rows;
mod unwind_worker;

pub use stack_copies::StackCopyStats;
pub use unwind_maps::{UnwindMaps, UnwindMapsStats, UnwindMemory};
pub use unwind_worker::{UnwindReport, UnwindWorker};

use std::{
    fs, io,
    os::fd::{AsFd, AsRawFd},
    sync::Arc,
    time::Instant,
};

use aya::{
    Ebpf, EbpfError, EbpfLoader,
    maps::{HashMap, MapData, MapError, PerCpuArray, RingBuf},
    programs::{
        PerfEvent, ProgramError, ProgramInfo, TracePoint,
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
    },
};
use clrbpf_common::{
    COUNTER_SLOTS, Counter, ProcessEventKind, ProcessEventRecord, RawSampleEvent, SampleKind,
    names,
    offcpu::{ExitedThreadTotals, OffCpuThreadTotals, upscale_by_stack_p},
    sample_flags,
    unwind::{UNWIND_ROWS_PER_CHUNK, UnwindError, UnwindRow},
};

use crate::profile::{OffCpuDetail, RawSample, Waker};
use crate::unwind::{disk_cache::DiskTableCache, stack_copy::CopiedSample};

/// The eBPF object built by `build.rs`; empty when built with `AYA_BUILD_SKIP`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/clrbpf"));

/// Errors of loading and running the kernel side. Each message names the fix.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error(
        "this clrbpf was built without its eBPF object (AYA_BUILD_SKIP was set): rebuild with `cargo xtask build`"
    )]
    NoObject,
    #[error("loading the eBPF object failed: {source}")]
    Load {
        #[source]
        source: EbpfError,
    },
    #[error("the kernel verifier rejected `{program}`: {reason}\n{log}")]
    Verifier {
        program: &'static str,
        reason: String,
        log: String,
    },
    #[error("program `{program}`: {source}")]
    Program {
        program: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("map `{map}`: {source}")]
    Map {
        map: &'static str,
        #[source]
        source: MapError,
    },
    #[error("eBPF object has no `{name}`: the embedded object does not match this binary")]
    Missing { name: &'static str },
    #[error("mapping `{map}` into memory failed: {source}")]
    Mmap {
        map: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the online CPUs: {0}")]
    OnlineCpus(#[source] io::Error),
    #[error(
        "opening a cpu-clock perf event on CPU {cpu} failed: {source} (needs root or CAP_PERFMON; check /proc/sys/kernel/perf_event_paranoid)"
    )]
    PerfEvent {
        cpu: u32,
        #[source]
        source: ProgramError,
    },
}

/// What the kernel side samples. Fixed at load time.
#[derive(Clone, Debug)]
pub struct SamplerConfig {
    pub frequency_hz: u64,
    /// `None`: every process on the host. `Some`: only these tgids and the
    /// processes they start.
    pub target_pids: Option<Vec<u32>>,
    /// Ring buffer size in bytes (a power of two multiple of the page size).
    pub ring_buffer_bytes: u32,
    /// Walk user stacks in the kernel with `.eh_frame` unwind tables (for
    /// processes indexed through [`Sampler::take_unwind_maps`]); false:
    /// frame pointers only.
    pub user_unwind: bool,
    /// Kernel memory for unwind tables (the `--unwind-table-memory-mb`
    /// cap). The rows live in chunks of BPF array maps created as tables
    /// need them, up to this cap.
    pub unwind_table_memory_bytes: u64,
    /// Where unwind tables are kept between runs (`--cache-dir`); `None`:
    /// built every run (`--no-cache`).
    pub unwind_cache_dir: Option<std::path::PathBuf>,
    /// Off-CPU intervals of the profiled threads (`None`: not recorded).
    pub off_cpu: Option<OffCpuConfig>,
    /// Bytes per second, for the whole host, of user-stack copies of
    /// processes not indexed yet (with [`Self::user_unwind`]), shared
    /// evenly by the CPUs; 0: none, frame pointers until they are.
    pub stack_copy_bytes_per_second: u64,
    /// Copy every on-CPU sample's user stack, indexed process or not, for
    /// userspace to walk (a benchmark's measure of the copies).
    pub stack_copy_always: bool,
}

/// How off-CPU intervals are kept ([`clrbpf_common::offcpu::keep_interval`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffCpuConfig {
    /// Intervals at least this long are always kept; shorter ones with
    /// probability interval/min, weighted min.
    pub min_ns: u64,
    /// Most stacks taken per CPU per second at blocking switches; above
    /// it, stacks are taken with the probability that keeps to it and the
    /// waits that have one are upscaled.
    pub max_stacks_per_cpu_second: u64,
}

/// Default of [`SamplerConfig::unwind_table_memory_bytes`].
pub const DEFAULT_UNWIND_TABLE_MEMORY_BYTES: u64 = 64 << 20;

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            frequency_hz: 99,
            target_pids: None,
            ring_buffer_bytes: 8 * 1024 * 1024,
            user_unwind: false,
            unwind_table_memory_bytes: DEFAULT_UNWIND_TABLE_MEMORY_BYTES,
            unwind_cache_dir: None,
            off_cpu: None,
            stack_copy_bytes_per_second: 0,
            stack_copy_always: false,
        }
    }
}

/// Kernel-side counters, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCounters {
    pub samples_submitted: u64,
    pub samples_lost: u64,
    pub idle_ticks: u64,
    pub filtered: u64,
    pub kernel_stack_errors: u64,
    pub user_stack_errors: u64,
    pub forks_followed: u64,
    pub user_stacks_unwound: u64,
    pub unwind_process_unknown: u64,
    /// Waker stacks walked by frame pointers: their process had no index.
    pub waker_process_unknown: u64,
    pub user_regs_unavailable: u64,
    pub off_cpu_blocked: u64,
    pub off_cpu_intervals: u64,
    pub off_cpu_kept: u64,
    pub off_cpu_pending_full: u64,
    pub off_cpu_wakers: u64,
    pub off_cpu_stacks_skipped: u64,
    /// Process exits and execs the kernel side wrote, and those it could
    /// not (ring buffer full).
    pub process_exits: u64,
    pub process_execs: u64,
    pub process_events_lost: u64,
    /// On-CPU samples of processes not indexed yet whose user stack was
    /// copied, the bytes of those records, and the samples not copied
    /// because the second's byte budget was spent.
    pub stack_copies: u64,
    pub stack_copy_bytes: u64,
    pub stack_copies_over_budget: u64,
}

/// A process lifecycle event from the kernel side, for a process in the
/// profiled set (every process in whole-host mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessEvent {
    /// The whole process ended at `time_ns` (`bpf_ktime_get_ns`, the
    /// samples' clock). No sample of it follows this event in the ring;
    /// a later sample with the same pid is of a new process.
    Exited { pid: u32, time_ns: u64 },
    /// The process replaced its image at `time_ns`: samples before the
    /// event ran the old image's mappings, samples after it the new one's.
    Exec { pid: u32, time_ns: u64 },
}

impl ProcessEvent {
    pub fn pid(&self) -> u32 {
        match *self {
            Self::Exited { pid, .. } | Self::Exec { pid, .. } => pid,
        }
    }

    pub fn time_ns(&self) -> u64 {
        match *self {
            Self::Exited { time_ns, .. } | Self::Exec { time_ns, .. } => time_ns,
        }
    }
}

/// A [`ProcessEvent`] with its place among the samples drained with it
/// ([`Sampler::drain_with_events`]): the ring buffer is one queue in the
/// order records were written, so every sample at an index below
/// `samples_before` was taken before the event, and every one at or
/// above it after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessEventAt {
    pub event: ProcessEvent,
    pub samples_before: usize,
}

/// Userspace counts of process events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessEventCounts {
    pub exits: u64,
    pub execs: u64,
}

/// Run-time statistics of one BPF program from the kernel's BPF stats
/// (`kernel.bpf_stats_enabled`): both are 0 when the stats are off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgramStats {
    pub run_time_ns: u64,
    pub run_count: u64,
}

/// The loaded and attached kernel side.
pub struct Sampler {
    samples: RingBuf<MapData>,
    targets: HashMap<MapData, u32, u8>,
    counters: PerCpuArray<MapData, u64>,
    // Keeps the programs (and so their links) alive; dropping detaches.
    ebpf: Ebpf,
    /// The perf event period as the kernel side stamps it, in nanoseconds.
    pub period_ns: u64,
    frequency_hz: u64,
    /// Whether [`Self::start_sampling`] has attached the sampling programs.
    sampling: bool,
    pub cpus: Vec<u32>,
    thread_names: std::collections::HashMap<[u8; 16], Arc<str>>,
    unwind_maps: Option<UnwindMaps>,
    /// Processes with samples whose pc was in no indexed mapping.
    rescan: std::collections::HashSet<u32>,
    /// Processes that mapped executable memory, with when, until
    /// [`Self::take_code_mapped`].
    code_mapped: Vec<(u32, u64)>,
    /// Samples with a copy of their user stack (processes not indexed
    /// yet), until [`Self::take_stack_copies`].
    stack_copies: Vec<CopiedSample>,
    off_cpu: Option<OffCpuMaps>,
    process_event_counts: ProcessEventCounts,
}

/// The sample ring's wakeups, for a `tokio::select!` loop
/// ([`Sampler::ring_wakeups`]).
pub struct RingWakeups {
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl RingWakeups {
    /// Resolves when the kernel side has woken userspace since the last
    /// call (never, if the ring cannot be polled).
    pub async fn woken(&self) {
        match self.fd.readable().await {
            Ok(mut guard) => guard.clear_ready(),
            Err(_) => std::future::pending().await,
        }
    }
}

/// The off-CPU maps userspace reads, and the waker records waiting for the
/// off-CPU record they belong to (the kernel side writes the waker first).
struct OffCpuMaps {
    pending: HashMap<MapData, u32, RawSampleEvent>,
    totals: HashMap<MapData, u32, OffCpuThreadTotals>,
    /// Woken tid -> its waker and the wakeup's kernel stack.
    wakers: std::collections::HashMap<u32, (Waker, Vec<u64>)>,
    /// `--off-cpu-min`.
    min_ns: u64,
    /// Totals of threads that exited, handed over by the kernel side.
    exited: ExitedThreads,
}

/// The exact off-CPU totals of exited threads, by tid up to
/// [`MAX_EXITED_THREADS`], summed beyond: a host that starts threads for
/// weeks must not grow this without end.
#[derive(Debug, Default)]
struct ExitedThreads {
    by_tid: std::collections::HashMap<u32, OffCpuThreadTotals>,
    others: OffCpuThreadTotals,
    other_threads: u64,
}

/// Exited threads whose off-CPU totals are kept one by one.
const MAX_EXITED_THREADS: usize = 65_536;

impl ExitedThreads {
    fn add(&mut self, tid: u32, totals: OffCpuThreadTotals) {
        let len = self.by_tid.len();
        let into = match self.by_tid.get_mut(&tid) {
            Some(kept) => kept,
            None if len < MAX_EXITED_THREADS => self.by_tid.entry(tid).or_default(),
            None => {
                self.other_threads += 1;
                &mut self.others
            }
        };
        into.add(&totals);
    }
}

/// The exact off-CPU totals of a recording: per thread, and the sum of the
/// exited threads beyond the per-thread bound.
#[derive(Clone, Debug, Default)]
pub struct OffCpuTotals {
    /// Thread id and its totals; a tid appears once.
    pub threads: Vec<(u32, OffCpuThreadTotals)>,
    /// How many exited threads were summed into `others`.
    pub other_threads: u64,
    pub others: OffCpuThreadTotals,
}

/// Most waker records held for their off-CPU record (each is followed by it
/// at once; a lost off-CPU record must not leave them forever).
const MAX_HELD_WAKERS: usize = 4096;

/// The eBPF object loaded with what is fixed at load time: its globals and
/// its map sizes, from the sampler's configuration.
struct LoadedObject {
    ebpf: Ebpf,
    period_ns: u64,
    off_cpu_min_ns: u64,
    unwind_chunks: u32,
}

impl LoadedObject {
    fn load(config: &SamplerConfig) -> Result<Self, BpfError> {
        if EBPF_OBJECT.is_empty() {
            return Err(BpfError::NoObject);
        }
        let period_ns = 1_000_000_000 / config.frequency_hz.max(1);
        let filter: u32 = u32::from(config.target_pids.is_some());
        let self_tgid = std::process::id();
        let user_unwind = u32::from(config.user_unwind);
        let stack_copy_per_cpu = if config.user_unwind {
            config.stack_copy_bytes_per_second
                / aya::util::online_cpus().map_or(1, |cpus| cpus.len().max(1) as u64)
        } else {
            0
        };
        let off_cpu = u32::from(config.off_cpu.is_some());
        let off_cpu_min_ns = config.off_cpu.map_or(0, |c| c.min_ns);
        let stacks_per_window = config.off_cpu.map_or(0, |c| {
            (c.max_stacks_per_cpu_second * clrbpf_common::offcpu::STACK_RATE_WINDOW_NS
                / 1_000_000_000)
                .max(1)
        });
        let chunk_bytes = (UNWIND_ROWS_PER_CHUNK * size_of::<UnwindRow>()) as u64;
        let unwind_chunks = u32::try_from(
            config
                .unwind_table_memory_bytes
                .div_ceil(chunk_bytes)
                .max(1),
        )
        .unwrap_or(u32::MAX);
        let ebpf = EbpfLoader::new()
            .override_global(names::GLOBAL_FILTER_PIDS, &filter, true)
            .override_global(names::GLOBAL_SELF_TGID, &self_tgid, true)
            .override_global(names::GLOBAL_ON_CPU_PERIOD_NS, &period_ns, true)
            .override_global(names::GLOBAL_USER_UNWIND, &user_unwind, true)
            .override_global(names::GLOBAL_OFF_CPU, &off_cpu, true)
            .override_global(
                names::GLOBAL_STACK_COPY_BYTES_PER_CPU,
                &stack_copy_per_cpu,
                true,
            )
            .override_global(
                names::GLOBAL_STACK_COPY_ALWAYS,
                &u32::from(config.stack_copy_always && config.user_unwind),
                true,
            )
            .override_global(
                names::GLOBAL_EXIT_GROUP_DEAD_OFFSET,
                &exit_group_dead_offset(),
                true,
            )
            .override_global(names::GLOBAL_OFF_CPU_MIN_NS, &off_cpu_min_ns, true)
            .override_global(
                names::GLOBAL_OFF_CPU_STACKS_PER_WINDOW,
                &stacks_per_window,
                true,
            )
            .map_max_entries(names::MAP_SAMPLES, config.ring_buffer_bytes)
            .map_max_entries(
                names::MAP_UNWIND_ROW_CHUNKS,
                if config.user_unwind { unwind_chunks } else { 1 },
            )
            .load(EBPF_OBJECT)
            .map_err(|source| BpfError::Load { source })?;
        Ok(Self {
            ebpf,
            period_ns,
            off_cpu_min_ns,
            unwind_chunks,
        })
    }
}

impl Sampler {
    /// Loads the programs, fills the target set, and attaches everything.
    pub fn start(config: &SamplerConfig) -> Result<Self, BpfError> {
        let mut sampler = Self::load(config)?;
        sampler.start_sampling()?;
        Ok(sampler)
    }

    /// Loads the programs, fills the target set and follows the process
    /// tree, but takes no sample yet: [`Self::start_sampling`] attaches the
    /// sampling programs. Between the two, the unwind tables of the
    /// processes known at start can be loaded ([`Self::take_unwind_maps`]),
    /// so that their first stacks are walked with them.
    pub fn load(config: &SamplerConfig) -> Result<Self, BpfError> {
        let LoadedObject {
            mut ebpf,
            period_ns,
            off_cpu_min_ns,
            unwind_chunks,
        } = LoadedObject::load(config)?;
        let mut targets: HashMap<MapData, u32, u8> = take_map(&mut ebpf, names::MAP_TARGET_PIDS)?;
        for &pid in config.target_pids.iter().flatten() {
            targets.insert(pid, 1, 0).map_err(|source| BpfError::Map {
                map: names::MAP_TARGET_PIDS,
                source,
            })?;
        }
        let samples: RingBuf<MapData> = take_map(&mut ebpf, names::MAP_SAMPLES)?;
        let counters: PerCpuArray<MapData, u64> = take_map(&mut ebpf, names::MAP_COUNTERS)?;
        let mut unwind_maps = if config.user_unwind {
            let row_chunks = take_map(&mut ebpf, names::MAP_UNWIND_ROW_CHUNKS)?;
            let process_mappings = take_map(&mut ebpf, names::MAP_PROCESS_MAPPINGS)?;
            let errors = take_map(&mut ebpf, names::MAP_UNWIND_ERRORS)?;
            let disk = config.unwind_cache_dir.as_deref().and_then(|dir| {
                DiskTableCache::open(dir)
                    .inspect_err(|error| tracing::warn!("{error}"))
                    .ok()
            });
            Some(UnwindMaps::new(
                row_chunks,
                unwind_chunks,
                process_mappings,
                errors,
                disk,
            )?)
        } else {
            None
        };

        // Follow the process tree before sampling starts, so no child is missed.
        for (program, category, name) in [
            (names::PROG_FOLLOW_FORK, "task", "task_newtask"),
            (names::PROG_FORGET_EXIT, "sched", "sched_process_exit"),
            (names::PROG_PROCESS_EXEC, "sched", "sched_process_exec"),
        ] {
            let tp: &mut TracePoint = program_mut(&mut ebpf, program)?;
            let started = Instant::now();
            load_program(program, tp.load())?;
            log_verified(program, tp.info(), started);
            tp.attach(category, name)
                .map_err(|source| BpfError::Program { program, source })?;
        }
        if let Some(maps) = unwind_maps.as_mut() {
            maps.rescan_on_code_mapped = attach_code_mapped(&mut ebpf);
        }

        let off_cpu = if config.off_cpu.is_some() {
            let maps = OffCpuMaps {
                pending: take_map(&mut ebpf, names::MAP_OFF_CPU_PENDING)?,
                totals: take_map(&mut ebpf, names::MAP_OFF_CPU_TOTALS)?,
                wakers: Default::default(),
                min_ns: off_cpu_min_ns,
                exited: ExitedThreads::default(),
            };
            for program in [names::PROG_OFF_CPU_WAKING, names::PROG_OFF_CPU_SWITCH] {
                let tp: &mut TracePoint = program_mut(&mut ebpf, program)?;
                let started = Instant::now();
                load_program(program, tp.load())?;
                log_verified(program, tp.info(), started);
            }
            Some(maps)
        } else {
            None
        };

        let cpus = aya::util::online_cpus().map_err(|(_, e)| BpfError::OnlineCpus(e))?;
        let prog: &mut PerfEvent = program_mut(&mut ebpf, names::PROG_ON_CPU_SAMPLE)?;
        let started = Instant::now();
        load_program(names::PROG_ON_CPU_SAMPLE, prog.load())?;
        log_verified(names::PROG_ON_CPU_SAMPLE, prog.info(), started);
        Ok(Self {
            samples,
            targets,
            counters,
            ebpf,
            period_ns,
            frequency_hz: config.frequency_hz,
            sampling: false,
            cpus,
            thread_names: Default::default(),
            unwind_maps,
            rescan: Default::default(),
            code_mapped: Vec::new(),
            stack_copies: Vec::new(),
            off_cpu,
            process_event_counts: ProcessEventCounts::default(),
        })
    }

    /// Attaches the sampling programs loaded by [`Self::load`]: off-CPU
    /// switches (when configured) and the `cpu-clock` event on every
    /// online CPU. No effect the second time.
    pub fn start_sampling(&mut self) -> Result<(), BpfError> {
        if std::mem::replace(&mut self.sampling, true) {
            return Ok(());
        }
        if self.off_cpu.is_some() {
            for (program, name) in [
                (names::PROG_OFF_CPU_WAKING, "sched_waking"),
                (names::PROG_OFF_CPU_SWITCH, "sched_switch"),
            ] {
                let tp: &mut TracePoint = program_mut(&mut self.ebpf, program)?;
                tp.attach("sched", name)
                    .map_err(|source| BpfError::Program { program, source })?;
            }
        }
        let prog: &mut PerfEvent = program_mut(&mut self.ebpf, names::PROG_ON_CPU_SAMPLE)?;
        for &cpu in &self.cpus {
            prog.attach(
                PerfEventConfig::Software(SoftwareEvent::CpuClock),
                PerfEventScope::AllProcessesOneCpu { cpu },
                SamplePolicy::Frequency(self.frequency_hz),
                false,
            )
            .map_err(|source| BpfError::PerfEvent { cpu, source })?;
        }
        Ok(())
    }

    /// Adds a process to the profiled set (no effect in whole-host mode).
    pub fn add_target(&mut self, pid: u32) -> Result<(), BpfError> {
        self.targets
            .insert(pid, 1, 0)
            .map_err(|source| BpfError::Map {
                map: names::MAP_TARGET_PIDS,
                source,
            })
    }

    /// The unwind maps to keep in step with the profiled processes (once;
    /// `None` when [`SamplerConfig::user_unwind`] is off).
    pub fn take_unwind_maps(&mut self) -> Option<UnwindMaps> {
        self.unwind_maps.take()
    }

    /// What wakes the loop early: the kernel side wakes userspace once the
    /// sample ring is over a quarter full (below that, records are drained
    /// on the loop's timer). Needs a tokio runtime; drop it before the
    /// sampler.
    pub fn ring_wakeups(&self) -> io::Result<RingWakeups> {
        // A descriptor of its own on the ring, open as long as it is.
        let fd = self.samples.as_fd().try_clone_to_owned()?;
        // SAFETY: `fd` is owned by the AsyncFd, so it stays open and names
        // the same ring until the AsyncFd is dropped.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        }
        .map_err(io::Error::from)?;
        Ok(RingWakeups { fd })
    }

    /// Processes that had samples with a pc in no indexed mapping since the
    /// last call: rescan them with [`UnwindMaps::refresh_process`].
    pub fn take_pids_to_rescan(&mut self) -> Vec<u32> {
        self.rescan.drain().collect()
    }

    /// The samples drained since the last call whose user stack the
    /// kernel copied: unwind them once their process is indexed
    /// ([`UnwindWorker::replay_stack_copies`]).
    /// The processes that mapped executable memory since the last call,
    /// with when ([`ProcessEventKind::CodeMapped`]).
    pub fn take_code_mapped(&mut self) -> Vec<(u32, u64)> {
        std::mem::take(&mut self.code_mapped)
    }

    pub fn take_stack_copies(&mut self) -> Vec<CopiedSample> {
        std::mem::take(&mut self.stack_copies)
    }

    /// Removes a process from the profiled set.
    pub fn remove_target(&mut self, pid: u32) {
        // Absent is fine: the exit tracepoint may have removed it already.
        let _ = self.targets.remove(&pid);
    }

    pub fn process_event_counts(&self) -> ProcessEventCounts {
        self.process_event_counts
    }

    /// Moves every record waiting in the ring buffer into `samples` and
    /// `events`, each event with its place among the samples (indices into
    /// `samples`, which may hold samples already). Returns how many records
    /// were malformed (and skipped).
    ///
    /// The kernel writes a process's exit after all of its samples, so a
    /// stage that handles an [`ProcessEvent::Exited`] after the samples
    /// before it (`samples[..samples_before]`) has every sample of the
    /// process in hand: it can name them, then let go of the process's
    /// symbols, mappings and files.
    pub fn drain_with_events(
        &mut self,
        samples: &mut Vec<RawSample>,
        events: &mut Vec<ProcessEventAt>,
    ) -> u64 {
        let mut malformed = 0;
        while let Some(item) = self.samples.next() {
            if item.len() == size_of::<ExitedThreadTotals>() {
                match (decode_exited_thread(&item), self.off_cpu.as_mut()) {
                    (Some(exited), Some(maps)) => maps.exited.add(exited.tid, exited.totals),
                    (Some(_), None) => {}
                    (None, _) => malformed += 1,
                }
                continue;
            }
            if item.len() == size_of::<ProcessEventRecord>() {
                if let Some(mapped) = decode_code_mapped(&item) {
                    self.code_mapped.push(mapped);
                    continue;
                }
                match decode_process_event(&item) {
                    Some(event) => {
                        match event {
                            ProcessEvent::Exited { .. } => self.process_event_counts.exits += 1,
                            ProcessEvent::Exec { .. } => self.process_event_counts.execs += 1,
                        }
                        events.push(ProcessEventAt {
                            event,
                            samples_before: samples.len(),
                        });
                    }
                    None => malformed += 1,
                }
                continue;
            }
            if item.len() > size_of::<RawSampleEvent>() {
                match stack_copies::decode(&item, &mut self.thread_names) {
                    Some(copy) => self.stack_copies.push(copy),
                    None => malformed += 1,
                }
                continue;
            }
            match decode_event(&item, &mut self.thread_names) {
                Some((sample, _, _)) if sample.kind == SampleKind::Waker => {
                    if let Some(maps) = self.off_cpu.as_mut() {
                        if maps.wakers.len() >= MAX_HELD_WAKERS {
                            maps.wakers.clear();
                        }
                        let woken = sample.off_cpu.as_ref().map_or(0, |o| o.woken_tid);
                        maps.wakers.insert(
                            woken,
                            (
                                Waker {
                                    pid: sample.pid,
                                    tid: sample.tid,
                                    thread_name: sample.thread_name,
                                    user_stack: sample.user_stack,
                                },
                                sample.kernel_stack,
                            ),
                        );
                    }
                }
                Some((mut sample, unwind_error, unindexed)) => {
                    if let (Some(detail), Some(maps)) =
                        (sample.off_cpu.as_mut(), self.off_cpu.as_mut())
                        && let Some((waker, kernel)) = maps.wakers.remove(&sample.tid)
                    {
                        detail.waker = Some(waker);
                        detail.waker_kernel_stack = kernel;
                    }
                    if unindexed || unwind_error == Some(UnwindError::NoMapping) {
                        self.rescan.insert(sample.pid);
                    }
                    samples.push(sample);
                }
                None => malformed += 1,
            }
        }
        malformed
    }

    /// The records the kernel could not write to the ring (samples and
    /// process events), summed: two map reads, cheap enough for each tick.
    pub fn losses(&self) -> u64 {
        [Counter::SamplesLost, Counter::ProcessEventsLost]
            .into_iter()
            .filter_map(|c| self.counters.get(&(c as u32), 0).ok())
            .map(|values| values.iter().fold(0u64, |a, v| a.saturating_add(*v)))
            .fold(0, u64::saturating_add)
    }

    pub fn counters(&self) -> KernelCounters {
        let mut sum = [0u64; COUNTER_SLOTS as usize];
        for (slot, total) in sum.iter_mut().enumerate() {
            if let Ok(values) = self.counters.get(&(slot as u32), 0) {
                *total = values.iter().sum();
            }
        }
        let get = |c: Counter| sum[c as usize];
        KernelCounters {
            samples_submitted: get(Counter::SamplesSubmitted),
            samples_lost: get(Counter::SamplesLost),
            idle_ticks: get(Counter::IdleTicks),
            filtered: get(Counter::Filtered),
            kernel_stack_errors: get(Counter::KernelStackErrors),
            user_stack_errors: get(Counter::UserStackErrors),
            forks_followed: get(Counter::ForksFollowed),
            user_stacks_unwound: get(Counter::UserStacksUnwound),
            unwind_process_unknown: get(Counter::UnwindProcessUnknown),
            waker_process_unknown: get(Counter::WakerProcessUnknown),
            user_regs_unavailable: get(Counter::UserRegsUnavailable),
            off_cpu_blocked: get(Counter::OffCpuBlocked),
            off_cpu_intervals: get(Counter::OffCpuIntervals),
            off_cpu_kept: get(Counter::OffCpuKept),
            off_cpu_pending_full: get(Counter::OffCpuPendingFull),
            off_cpu_wakers: get(Counter::OffCpuWakers),
            off_cpu_stacks_skipped: get(Counter::OffCpuStacksSkipped),
            process_exits: get(Counter::ProcessExits),
            process_execs: get(Counter::ProcessExecs),
            process_events_lost: get(Counter::ProcessEventsLost),
            stack_copies: get(Counter::StackCopies),
            stack_copy_bytes: get(Counter::StackCopyBytes),
            stack_copies_over_budget: get(Counter::StackCopiesOverBudget),
        }
    }

    /// Exact off-CPU totals of the threads alive now (in the kernel's map)
    /// and of those that exited (handed over as they exited; call after
    /// the last [`Self::drain_with_events`]). Empty without off-CPU.
    pub fn off_cpu_totals(&self) -> OffCpuTotals {
        let Some(maps) = self.off_cpu.as_ref() else {
            return OffCpuTotals::default();
        };
        let mut by_tid = maps.exited.by_tid.clone();
        for (tid, live) in maps.totals.iter().filter_map(Result::ok) {
            by_tid.entry(tid).or_default().add(&live);
        }
        OffCpuTotals {
            threads: by_tid.into_iter().collect(),
            other_threads: maps.exited.other_threads,
            others: maps.exited.others,
        }
    }

    /// The threads the kernel's off-CPU totals map holds now: those alive
    /// (exited ones leave it when their totals reach userspace).
    pub fn off_cpu_threads_in_kernel(&self) -> Vec<u32> {
        self.off_cpu.as_ref().map_or_else(Vec::new, |maps| {
            maps.totals.keys().filter_map(Result::ok).collect()
        })
    }

    /// The threads still blocked now, as off-CPU samples ending now (their
    /// intervals are cut at the end of the recording, as a wall-clock
    /// profiler does), kept whole. They are in no kernel total: the caller
    /// adds them to [`Self::off_cpu_totals`].
    pub fn still_blocked(&mut self, now_ns: u64) -> Vec<RawSample> {
        let Some(maps) = self.off_cpu.as_mut() else {
            return Vec::new();
        };
        let parked: Vec<RawSampleEvent> = maps
            .pending
            .iter()
            .filter_map(Result::ok)
            .map(|(_, event)| event)
            // Parked now.
            .filter(|e| e.time_ns != 0)
            .collect();
        let mut out = Vec::with_capacity(parked.len());
        for mut event in parked {
            let interval = now_ns.saturating_sub(event.time_ns);
            // The kernel side's rule at switch-in: a long wait is kept
            // whole, a short one only with its stack and upscaled by 1/p
            // (here without the keep draw: one per thread at most).
            if interval >= maps.min_ns {
                event.stack_p = clrbpf_common::offcpu::STACK_P_ALWAYS;
            } else if event.flags & sample_flags::OFF_CPU_NO_STACK != 0 {
                continue;
            }
            event.value = interval;
            event.kind = SampleKind::OffCpu as u32;
            event.interval_ns = interval;
            if let Some((sample, _, _)) = decode_record(&event, &mut self.thread_names) {
                out.push(sample);
            }
        }
        out
    }

    /// BPF run-time stats of the sampling program, from its fdinfo.
    pub fn on_cpu_program_stats(&self) -> ProgramStats {
        self.program_stats(names::PROG_ON_CPU_SAMPLE)
    }

    /// BPF run-time stats of the `sched_switch` program (every switch on the
    /// host runs it), zero without off-CPU.
    pub fn off_cpu_program_stats(&self) -> ProgramStats {
        if self.off_cpu.is_none() {
            return ProgramStats::default();
        }
        self.program_stats(names::PROG_OFF_CPU_SWITCH)
    }

    fn program_stats(&self, name: &str) -> ProgramStats {
        let Some(prog) = self.ebpf.program(name) else {
            return ProgramStats::default();
        };
        let Ok(fd) = prog.fd() else {
            return ProgramStats::default();
        };
        let path = format!("/proc/self/fdinfo/{}", fd.as_fd().as_raw_fd());
        fs::read_to_string(path)
            .map(|s| parse_prog_fdinfo(&s))
            .unwrap_or_default()
    }
}

/// Where the kernel's `sched_process_exit` record holds `group_dead`
/// (0 when it has none: kernels before 6.16), from the tracepoint's format
/// file.
fn exit_group_dead_offset() -> u32 {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .find_map(|root| {
            fs::read_to_string(format!("{root}/events/sched/sched_process_exit/format")).ok()
        })
        .map_or(0, |format| group_dead_offset(&format))
}

/// The offset of a one-byte `group_dead` field in a tracepoint format text.
fn group_dead_offset(format: &str) -> u32 {
    format
        .lines()
        .find(|line| line.contains(" group_dead;"))
        .and_then(|line| {
            let field = |name: &str| {
                line.split(';')
                    .find_map(|part| part.trim().strip_prefix(name))
                    .and_then(|v| v.trim().parse::<u32>().ok())
            };
            (field("size:") == Some(1))
                .then(|| field("offset:"))
                .flatten()
        })
        .unwrap_or(0)
}

/// Attaches [`names::PROG_CODE_MAPPED`] to the `mmap` and `mprotect`
/// syscall tracepoints; false (logged) where the kernel has no syscall
/// tracepoints: young processes are then rescanned on a timer.
fn attach_code_mapped(ebpf: &mut Ebpf) -> bool {
    let attached = (|| -> Result<(), BpfError> {
        let program = names::PROG_CODE_MAPPED;
        let tp: &mut TracePoint = program_mut(ebpf, program)?;
        load_program(program, tp.load())?;
        for name in ["sys_enter_mmap", "sys_enter_mprotect"] {
            tp.attach("syscalls", name)
                .map_err(|source| BpfError::Program { program, source })?;
        }
        Ok(())
    })();
    if let Err(error) = &attached {
        tracing::debug!(%error, "no mmap events: new processes' mappings are rescanned on a timer");
    }
    attached.is_ok()
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, BpfError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(BpfError::Missing { name })?;
    T::try_from(map).map_err(|source| BpfError::Map { map: name, source })
}

fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, BpfError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    let prog = ebpf.program_mut(name).ok_or(BpfError::Missing { name })?;
    prog.try_into().map_err(|source| BpfError::Program {
        program: name,
        source,
    })
}

fn load_program(program: &'static str, result: Result<(), ProgramError>) -> Result<(), BpfError> {
    match result {
        Ok(()) => Ok(()),
        Err(ProgramError::LoadError {
            io_error,
            verifier_log,
        }) => Err(BpfError::Verifier {
            program,
            reason: io_error.to_string(),
            log: useful_verifier_log(&verifier_log.to_string()),
        }),
        Err(source) => Err(BpfError::Program { program, source }),
    }
}

/// A debug line per program loaded: what the verifier walked and how long
/// the load took (the verifier is most of a short recording's start-up).
fn log_verified(program: &'static str, info: Result<ProgramInfo, ProgramError>, started: Instant) {
    let verified = info.ok().and_then(|info| info.verified_instruction_count());
    tracing::debug!(
        program,
        verified_instructions = verified,
        load_ms = started.elapsed().as_secs_f64() * 1e3,
        "BPF program loaded"
    );
}

/// The part of a verifier log a person can act on: the last lines, where
/// the verifier says what it rejected.
fn useful_verifier_log(log: &str) -> String {
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(20);
    lines[start..].join("\n")
}

fn parse_prog_fdinfo(text: &str) -> ProgramStats {
    let mut stats = ProgramStats::default();
    for line in text.lines() {
        let mut parts = line.split(':');
        let (Some(key), Some(value)) = (parts.next(), parts.next()) else {
            continue;
        };
        let value = value.trim().parse().unwrap_or(0);
        match key.trim() {
            "run_time_ns" => stats.run_time_ns = value,
            "run_cnt" => stats.run_count = value,
            _ => {}
        }
    }
    stats
}

/// Decodes one ring-buffer record, with the error that ended its user-stack
/// walk and whether the walk met a pc in no indexed mapping. `None` when the record is not a whole [`RawSampleEvent`] or names
/// an unknown kind.
fn decode_event(
    bytes: &[u8],
    names: &mut std::collections::HashMap<[u8; 16], Arc<str>>,
) -> Option<(RawSample, Option<UnwindError>, bool)> {
    if bytes.len() < size_of::<RawSampleEvent>() {
        return None;
    }
    // SAFETY: the length is checked above and `RawSampleEvent` is plain old
    // data; `read_unaligned` because ring-buffer records are only 8-aligned
    // by convention.
    let event: RawSampleEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    decode_record(&event, names)
}

/// Decodes an [`ExitedThreadTotals`]; `None` for a wrong length.
fn decode_exited_thread(bytes: &[u8]) -> Option<ExitedThreadTotals> {
    if bytes.len() != size_of::<ExitedThreadTotals>() {
        return None;
    }
    // SAFETY: the length is checked above and the record is plain old data.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
}

/// Decodes a [`ProcessEventRecord`]; `None` for a wrong length or an
/// unknown kind.
fn decode_process_event(bytes: &[u8]) -> Option<ProcessEvent> {
    if bytes.len() != size_of::<ProcessEventRecord>() {
        return None;
    }
    // SAFETY: the length is checked above and the record is plain old data.
    let record: ProcessEventRecord = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    let ProcessEventRecord { time_ns, pid, kind } = record;
    Some(match ProcessEventKind::from_u32(kind)? {
        ProcessEventKind::Exit => ProcessEvent::Exited { pid, time_ns },
        ProcessEventKind::Exec => ProcessEvent::Exec { pid, time_ns },
        ProcessEventKind::CodeMapped => return None,
    })
}

/// The pid and time of a [`ProcessEventKind::CodeMapped`] record; `None`
/// for any other record.
fn decode_code_mapped(bytes: &[u8]) -> Option<(u32, u64)> {
    if bytes.len() != size_of::<ProcessEventRecord>() {
        return None;
    }
    // SAFETY: the length is checked above and the record is plain old data.
    let record: ProcessEventRecord = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    (record.kind == ProcessEventKind::CodeMapped as u32).then_some((record.pid, record.time_ns))
}

/// [`decode_event`] of a record already read (or a parked one from a map).
fn decode_record(
    event: &RawSampleEvent,
    names: &mut std::collections::HashMap<[u8; 16], Arc<str>>,
) -> Option<(RawSample, Option<UnwindError>, bool)> {
    let kind = SampleKind::from_u32(event.kind)?;
    let kernel_len = (event.kernel_stack_len as usize).min(event.kernel_stack.len());
    let user_len = (event.user_stack_len as usize).min(event.user_stack.len());
    tracing::trace!(
        kind = event.kind,
        pid = event.pid,
        tid = event.tid,
        flags = event.flags,
        user_frames = event.user_stack_len,
        unwind_error = event.user_unwind_error,
        "ring-buffer record"
    );
    let thread_name = intern_comm(names, event.comm);
    let value = match kind {
        SampleKind::OffCpu => upscale_by_stack_p(event.value, event.stack_p),
        SampleKind::OnCpu | SampleKind::Waker => event.value,
    };
    let off_cpu = match kind {
        SampleKind::OnCpu => None,
        SampleKind::OffCpu | SampleKind::Waker => Some(OffCpuDetail {
            interval_ns: event.interval_ns,
            syscall: u32::try_from(event.syscall).ok(),
            woken_tid: if kind == SampleKind::Waker {
                event.waker_tid
            } else {
                0
            },
            waker: None,
            waker_kernel_stack: Vec::new(),
            stack_not_taken: event.flags & sample_flags::OFF_CPU_NO_STACK != 0,
        }),
    };
    let sample = RawSample {
        time_ns: event.time_ns,
        pid: event.pid,
        tid: event.tid,
        cpu: event.cpu,
        kind,
        value,
        thread_name,
        kernel_stack: event.kernel_stack[..kernel_len].to_vec(),
        user_stack: event.user_stack[..user_len].to_vec(),
        kernel_stack_truncated: event.flags & sample_flags::KERNEL_STACK_TRUNCATED != 0,
        user_stack_truncated: event.flags & sample_flags::USER_STACK_TRUNCATED != 0,
        off_cpu,
    };
    Some((
        sample,
        UnwindError::from_u32(event.user_unwind_error),
        event.flags & sample_flags::USER_PC_UNINDEXED != 0,
    ))
}

fn intern_comm(
    names: &mut std::collections::HashMap<[u8; 16], Arc<str>>,
    comm: [u8; 16],
) -> Arc<str> {
    names
        .entry(comm)
        .or_insert_with(|| {
            let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
            String::from_utf8_lossy(&comm[..end]).into()
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exited_threads_are_kept_by_tid_up_to_the_bound_then_summed() {
        let totals = |pid, blocked_ns| OffCpuThreadTotals {
            blocked_ns,
            intervals: 1,
            lost: 0,
            pid,
            _pad: 0,
        };
        let mut exited = ExitedThreads::default();
        for tid in 0..MAX_EXITED_THREADS as u32 {
            exited.add(tid, totals(7, 10));
        }
        // A reused tid adds to its row; new tids beyond the bound are summed.
        exited.add(3, totals(8, 5));
        exited.add(1_000_000, totals(9, 100));
        exited.add(1_000_001, totals(9, 200));
        assert_eq!(exited.by_tid.len(), MAX_EXITED_THREADS);
        assert_eq!(exited.by_tid[&3].blocked_ns, 15);
        assert_eq!(exited.by_tid[&3].intervals, 2);
        assert_eq!(exited.by_tid[&3].pid, 8);
        assert_eq!(exited.other_threads, 2);
        assert_eq!(exited.others.blocked_ns, 300);
        assert_eq!(exited.others.intervals, 2);
    }

    #[test]
    fn an_exited_thread_record_is_decoded_by_its_size() {
        let record = ExitedThreadTotals {
            totals: OffCpuThreadTotals {
                blocked_ns: 5,
                intervals: 2,
                lost: 1,
                pid: 40,
                _pad: 0,
            },
            tid: 41,
            _pad: 0,
        };
        // SAFETY: a plain-old-data record viewed as its bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&raw const record).cast::<u8>(),
                size_of::<ExitedThreadTotals>(),
            )
        };
        assert_eq!(decode_exited_thread(bytes), Some(record));
        assert_eq!(decode_exited_thread(&bytes[1..]), None);
    }

    #[test]
    fn fdinfo_stats_are_parsed() {
        let text = "pos:\t0\nflags:\t02000002\nprog_type:\t20\nrun_time_ns:\t123456\nrun_cnt:\t42\nverified_insns:\t99\n";
        assert_eq!(
            parse_prog_fdinfo(text),
            ProgramStats {
                run_time_ns: 123_456,
                run_count: 42
            }
        );
        assert_eq!(parse_prog_fdinfo("garbage"), ProgramStats::default());
    }

    #[test]
    fn short_or_unknown_records_are_rejected() {
        let mut names = Default::default();
        assert!(decode_event(&[0u8; 10], &mut names).is_none());
        let mut event: RawSampleEvent = unsafe { std::mem::zeroed() };
        event.kind = 99;
        let bytes = unsafe {
            std::slice::from_raw_parts((&raw const event).cast::<u8>(), size_of::<RawSampleEvent>())
        };
        assert!(decode_event(bytes, &mut names).is_none());
    }

    #[test]
    fn stack_lengths_are_clamped_and_names_interned() {
        let mut event: RawSampleEvent = unsafe { std::mem::zeroed() };
        event.kind = SampleKind::OnCpu as u32;
        event.pid = 7;
        event.tid = 8;
        event.kernel_stack_len = 10_000;
        event.user_stack_len = 2;
        event.user_unwind_error = 77; // unknown: decoded as no error
        event.user_stack[0] = 0x1000;
        event.user_stack[1] = 0x2000;
        event.comm[..4].copy_from_slice(b"main");
        event.flags = sample_flags::KERNEL_STACK_TRUNCATED;
        let bytes = unsafe {
            std::slice::from_raw_parts((&raw const event).cast::<u8>(), size_of::<RawSampleEvent>())
        };
        let mut names = Default::default();
        let (sample, error, unindexed) = decode_event(bytes, &mut names).expect("valid record");
        assert_eq!(error, None);
        assert!(!unindexed);
        assert_eq!(sample.kernel_stack.len(), clrbpf_common::MAX_STACK_DEPTH);
        assert_eq!(sample.user_stack, vec![0x1000, 0x2000]);
        assert_eq!(&*sample.thread_name, "main");
        assert!(sample.kernel_stack_truncated && !sample.user_stack_truncated);
        let (again, _, _) = decode_event(bytes, &mut names).expect("valid record");
        assert!(Arc::ptr_eq(&sample.thread_name, &again.thread_name));
    }

    fn record_bytes(record: &ProcessEventRecord) -> Vec<u8> {
        // SAFETY: plain old data without padding.
        unsafe {
            std::slice::from_raw_parts(
                (&raw const *record).cast::<u8>(),
                size_of::<ProcessEventRecord>(),
            )
        }
        .to_vec()
    }

    #[test]
    fn process_events_are_decoded() {
        let exit = ProcessEventRecord {
            time_ns: 123,
            pid: 42,
            kind: ProcessEventKind::Exit as u32,
        };
        assert_eq!(
            decode_process_event(&record_bytes(&exit)),
            Some(ProcessEvent::Exited {
                pid: 42,
                time_ns: 123
            })
        );
        let exec = ProcessEventRecord {
            kind: ProcessEventKind::Exec as u32,
            ..exit
        };
        let event = decode_process_event(&record_bytes(&exec)).expect("an exec");
        assert_eq!(
            event,
            ProcessEvent::Exec {
                pid: 42,
                time_ns: 123
            }
        );
        assert_eq!((event.pid(), event.time_ns()), (42, 123));
    }

    #[test]
    fn bad_process_events_are_rejected() {
        let mut record = ProcessEventRecord {
            time_ns: 1,
            pid: 2,
            kind: SampleKind::OnCpu as u32,
        };
        assert_eq!(decode_process_event(&record_bytes(&record)), None);
        record.kind = 99;
        assert_eq!(decode_process_event(&record_bytes(&record)), None);
        record.kind = ProcessEventKind::Exit as u32;
        let mut long = record_bytes(&record);
        long.push(0);
        assert_eq!(decode_process_event(&long), None);
        assert_eq!(decode_process_event(&long[..8]), None);
        // A sample record is never taken for a process event.
        assert!(decode_event(&record_bytes(&record), &mut Default::default()).is_none());
    }

    #[test]
    fn group_dead_is_found_in_the_format_file() {
        let format = "name: sched_process_exit\nformat:\n\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;\n\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n";
        assert_eq!(group_dead_offset(format), 32);
        let old = "\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;\n";
        assert_eq!(group_dead_offset(old), 0);
        assert_eq!(
            group_dead_offset("field:int group_dead;\toffset:32;\tsize:4;"),
            0
        );
    }

    #[test]
    fn verifier_log_keeps_the_tail() {
        let log: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let useful = useful_verifier_log(&log);
        assert!(useful.starts_with("line 80") && useful.ends_with("line 99"));
    }
}
