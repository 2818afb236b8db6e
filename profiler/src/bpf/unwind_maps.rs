//! Keeps the kernel-side unwind maps in step with the profiled processes:
//! the user half of the in-kernel DWARF unwinder (`profiler-ebpf/src/unwind.rs`).
//!
//! 1. When a process is first seen, its `/proc/PID/maps` is read; each
//!    executable file mapping is opened through `/proc/PID/map_files` (the
//!    very file mapped, wherever its path points) and known by (device,
//!    inode, size, mtime), then by [`FileIdentity`] (build id): a file mapped
//!    by many processes gets one table.
//! 2. A file's table ([`UnwindTableCache`]) is copied once into the shared
//!    row array (mmap-ed: a copy, no syscall per row) at a range the
//!    [`RowArena`] gives; the process's index ([`ProcessMappings`]) is
//!    written with one map update. The array grows by chunks of 1.5 MiB
//!    (`UNWIND_ROW_CHUNKS`, an array of maps) as tables need them.
//! 3. At the memory cap (`--unwind-table-memory-mb`), the least recently used
//!    tables are evicted whole, unused ones first; processes still using an
//!    evicted table are rewritten to the frame-pointer rule for it first, so
//!    the kernel never reads rows that are being replaced.
//! 4. A sample whose walk met a pc in no indexed mapping (a `dlopen` or a
//!    new JIT code heap after the scan; the kernel stepped it by frame
//!    pointer and flagged the sample) makes the record loop call
//!    [`UnwindMaps::refresh_process`]. A process that maps executable
//!    memory (`mmap`/`mprotect` with `PROT_EXEC`: a library, a ReadyToRun
//!    image, a code heap) is rescanned right after, as the kernel reports
//!    it ([`UnwindMaps::code_mapped`]), so a runtime's code is indexed as
//!    it is mapped; without those events (no syscall tracepoints), a
//!    process is rescanned every second for its first ten
//!    ([`UnwindMaps::rescan_young`]). Exited processes are dropped by
//!    [`UnwindMaps::forget_process`] or [`UnwindMaps::forget_exited`].
//! 5. JIT-compiled code has no file to read rows from: the pipeline sends
//!    the code ranges of new methods (perf map, jitdump, MethodLoad
//!    events) with [`super::UnwindWorker::add_jit_code`]; each method's prologue
//!    is read through `/proc/PID/mem` and decoded
//!    ([`crate::unwind::jit_code`]), and the frameless ones make one table
//!    per process, rebuilt at most every [`JIT_REBUILD_EVERY`], which the
//!    process's mappings without a file table (anonymous memory, .NET 8's
//!    `/memfd:doublemapper`) use from its first method on. Methods with an
//!    rbp frame need no rows: the table's gaps keep the frame-pointer rule.
//! 6. All of it runs on its own thread ([`super::UnwindWorker`]): indexing a .NET
//!    process reads and parses ~20 files (seconds on a loaded machine), and
//!    the record loop must keep draining samples and reading the maps of
//!    short-lived processes meanwhile.

use std::{
    collections::{HashMap, HashSet},
    fs::{self, File},
    os::unix::fs::MetadataExt as _,
    time::{Duration, Instant},
};

use aya::maps::{ArrayOfMaps, HashMap as BpfHashMap, MapData, PerCpuArray};
use clrbpf_common::{
    UNWIND_ERROR_SLOTS,
    unwind::{MappingEntry, ProcessMappings, RowIndex, UnwindError, UnwindRow},
};

use super::{
    BpfError,
    table_times::{Stopwatch, TableSource, TableTimes},
    unwind_rows::{CHUNK_BYTES, CHUNK_ROWS, RowChunks},
};
use crate::process::maps::MappingTable;
use crate::unwind::{
    FileIdentity, LoadSegment, RowArena, UnwindTableCache, build_process_mappings,
    disk_cache::DiskTableCache,
    jit_code::{self, JitCodeRows, JitMethod, MethodFrame, PROLOGUE_BYTES},
    load_bias,
    table::{UnwindTable, build_row_index, pack_index_words, read_build_id, read_elf_file},
};

/// The path of the memfd through which .NET 7+ maps its JIT code (W^X).
const DOUBLE_MAPPED_CODE: &str = "/memfd:doublemapper";
/// A process is rescanned at most this often.
const RESCAN_EVERY: Duration = Duration::from_millis(500);
/// A process whose maps file did not fit the memory budget is rescanned
/// at most this often: reading it is slow, and pcs in what was left out
/// would ask for a rescan at every sample.
const OVER_BUDGET_RESCAN_EVERY: Duration = Duration::from_secs(10);
/// For this long after a process is first indexed, it is rescanned every
/// [`YOUNG_RESCAN_EVERY`] without waiting for a walk to meet an unindexed
/// pc: a runtime maps its code (.NET's ReadyToRun images, `libclrjit`) in
/// its first second, often after the first sample indexed it, and until a
/// sample's walk lands in that code nothing asks for a rescan. Off-CPU
/// stacks of the first waits would be walked without those tables.
const YOUNG_FOR: Duration = Duration::from_secs(10);
/// See [`YOUNG_FOR`].
const YOUNG_RESCAN_EVERY: Duration = Duration::from_secs(1);
/// A young process that maps code is rescanned at most this often (a
/// runtime maps tens of files in its first second, in bursts).
const CODE_MAPPED_RESCAN_EVERY: Duration = Duration::from_millis(20);
/// A process past [`YOUNG_FOR`] that maps code is rescanned at most this
/// often. A .NET runtime keeps mapping executable views of its code heap
/// as it tiers methods up, for a minute or more after an agent's sessions
/// start: beside 50 idle services, rescans every [`RESCAN_EVERY`] made
/// most of the agent's CPU over that minute (issue 34). A library loaded
/// late gets its table this much later at most.
const OLD_CODE_MAPPED_RESCAN_EVERY: Duration = Duration::from_secs(2);
/// Rescans of processes past [`YOUNG_FOR`] for the code they mapped, a
/// second, across all of them: a node whose runtimes all tier up at once
/// (an agent's restart) costs a bounded rate of `/proc/PID/maps` reads;
/// the others wait their turn, oldest due first. Young processes are not
/// held back.
const OLD_CODE_MAPPED_RESCANS_PER_SECOND: u32 = 10;
/// The heap is trimmed at most this often (see
/// [`UnwindMaps::trim_heap_after_loads`]).
const TRIM_EVERY: Duration = Duration::from_secs(2);
/// Exited processes are looked for at most this often.
const EXIT_CHECK_EVERY: Duration = Duration::from_secs(1);
/// Bytes of built tables kept in userspace to avoid re-parsing a file whose
/// rows were evicted from the kernel and are needed again (only after an
/// eviction: a table loaded once is shared by every process mapping the
/// file). Small, as it counts against the agent's memory budget.
const BUILD_CACHE_BYTES: usize = 8 << 20;
/// A process's JIT table is rebuilt at most this often while its methods
/// change (tiering compiles in bursts). Until then a method just tiered up
/// without an rbp frame hides its caller: a thread that blocks in it every
/// 30 ms loses a wait's caller per 30 ms of delay.
const JIT_REBUILD_EVERY: Duration = Duration::from_millis(100);
/// How long the worker sleeps when no JIT table waits for a rebuild: its
/// periodic work (exit checks, young processes' rescans) is per second.
const IDLE_WAKE_EVERY: Duration = Duration::from_millis(500);
/// Files remembered by identity at most: past it, those without a table
/// are forgotten (a churning host maps many one-off files: each .NET
/// process's double-mapped code heap is a memfd of its own).
const MAX_KNOWN_FILES: usize = 16_384;

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The high bit of a JIT table's key (with a generation and the pid below
/// it), apart from the file tables' hashes.
const JIT_TABLE_KEY: u64 = 1 << 63;

/// What identifies a mapped file cheaply, before reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FileStatKey {
    dev: u64,
    inode: u64,
    size: u64,
    mtime_ns: i64,
}

#[derive(Clone, Copy, Debug)]
enum FileState {
    /// A table exists, keyed by [`FileIdentity::key`].
    Table(u64),
    /// Not ELF, no `.eh_frame`, or unreadable: the frame-pointer rule.
    NoTable,
}

/// A file mapping as a process's maps line shows it. The same line in a
/// later scan is the same mapping (a file stays open, its inode taken,
/// while it is mapped), so its table is known without opening
/// `/proc/PID/map_files` again: a .NET process has about 110 executable
/// file mappings and is scanned 10-20 times while it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct MappedFile {
    start: u64,
    end: u64,
    offset: u64,
    dev: (u32, u32),
    inode: u64,
}

impl MappedFile {
    fn of(m: &crate::process::maps::Mapping) -> Self {
        Self {
            start: m.start,
            end: m.end,
            offset: m.offset,
            dev: (m.dev_major, m.dev_minor),
            inode: m.inode,
        }
    }
}

/// A table in the kernel's row array: `rows` rows, then its row index, `len`
/// slots in all.
struct LoadedTable {
    offset: u32,
    len: u32,
    rows: u32,
    index: RowIndex,
    /// [`MappingEntry::table_serial`].
    serial: u16,
    segments: Box<[LoadSegment]>,
    /// Processes whose index points at it.
    users: u32,
    last_used: u64,
}

/// The JIT-compiled methods of one process that need rows, and the table
/// made of them.
struct ProcessJitCode {
    /// `/proc/PID/mem`, opened at the first methods; `None` when it could
    /// not be.
    mem: Option<File>,
    methods: JitCodeRows,
    built_at: Instant,
    /// The loaded table's key and its first pc (where the rows begin).
    table: Option<(u64, u64)>,
}

struct ProcessIndex {
    /// Table keys used by the process's index.
    tables: HashSet<u64>,
    /// The table (or none) each file mapping of the last scan gave, by
    /// what the maps line says of it: a later scan takes an unchanged
    /// mapping's from here instead of opening its `map_files` entry again.
    /// Empty once the process is no longer young ([`YOUNG_FOR`]).
    files: HashMap<MappedFile, Option<u64>>,
    /// The index entries with the table each came from.
    entries: Vec<(MappingEntry, Option<u64>)>,
    scanned_at: Instant,
    /// When the process was first indexed ([`YOUNG_FOR`]).
    first_scanned_at: Instant,
    /// Its maps file did not fit the memory budget: rescanned at most
    /// every [`OVER_BUDGET_RESCAN_EVERY`].
    over_budget: bool,
}

impl ProcessIndex {
    /// Indexed less than [`YOUNG_FOR`] ago.
    fn is_young(&self) -> bool {
        self.first_scanned_at.elapsed() < YOUNG_FOR
    }
}

/// Counters of the userspace side of unwinding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindMapsStats {
    pub processes_indexed: u64,
    /// Indexes dropped because their process exited.
    pub processes_forgotten: u64,
    pub tables_loaded: u64,
    pub tables_evicted: u64,
    /// Files whose table could not be built (not ELF, no CFI, unreadable).
    pub files_without_table: u64,
    /// Tables larger than the whole memory cap.
    pub tables_too_large: u64,
    /// Executable mappings beyond the per-process bound.
    pub mappings_dropped: u64,
    pub map_update_errors: u64,
    /// JIT-compiled methods whose prologue was decoded.
    pub jit_methods: u64,
    /// Of those, the ones without an rbp frame, which got rows.
    pub jit_frameless: u64,
    /// Of those, the ones with an rbp frame, whose prologue got rows.
    pub jit_prologues: u64,
    /// Of those, OSR methods, unwound through their tier-0 frame.
    pub jit_osr: u64,
    /// Prologues the decoder did not recognise: walked by frame pointer.
    pub jit_unrecognised: u64,
    /// Methods not decoded (code unreadable, or past a bound): walked by
    /// frame pointer.
    pub jit_not_decoded: u64,
    /// Per-process JIT tables loaded (each rebuild is one).
    pub jit_tables_loaded: u64,
    /// The kernel refused a new chunk of the row array (memory): the cap
    /// became what was there.
    pub chunk_refused: bool,
}

/// Memory the unwind tables take in the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindMemory {
    /// Rows of loaded tables, in bytes.
    pub table_bytes: u64,
    pub tables: usize,
    /// The cap of the row array.
    pub capacity_bytes: u64,
    /// The row array's chunks created so far (kernel memory, and mapped
    /// into clrbpf).
    pub allocated_bytes: u64,
    /// Per-process indexes, in bytes.
    pub index_bytes: u64,
    pub processes: usize,
}

/// The unwind maps of the loaded kernel side. Built by
/// [`super::Sampler::take_unwind_maps`].
pub struct UnwindMaps {
    rows: RowChunks,
    process_mappings: BpfHashMap<MapData, u32, ProcessMappings>,
    errors: PerCpuArray<MapData, u64>,
    arena: RowArena,
    tables: HashMap<u64, LoadedTable>,
    files: HashMap<FileStatKey, FileState>,
    processes: HashMap<u32, ProcessIndex>,
    jit: HashMap<u32, ProcessJitCode>,
    /// Makes each JIT table's key unique.
    jit_generation: u32,
    /// Processes first seen after [`super::UnwindWorker::hold_new_processes`] are
    /// indexed only this long after (0: at once), and when each was first
    /// asked for.
    pub(super) hold_new: Duration,
    held: HashMap<u32, Instant>,
    pub(super) builder: UnwindTableCache,
    clock: u64,
    /// The last [`MappingEntry::table_serial`] given.
    table_serial: u16,
    /// The last [`ProcessMappings::generation`] given.
    mappings_generation: u32,
    exits_checked_at: Instant,
    pub(super) stats: UnwindMapsStats,
    /// [`UnwindMapsStats::tables_loaded`] at the last heap trim, and when.
    loads_at_trim: u64,
    trimmed_at: Instant,
    /// How long processes exec'd meanwhile waited for their tables.
    pub(super) times: TableTimes,
    /// The kernel reports when a process maps executable memory
    /// ([`Self::code_mapped`]): young processes need no timed rescans.
    pub(super) rescan_on_code_mapped: bool,
    /// Indexed processes that mapped code, and when (CLOCK_MONOTONIC ns)
    /// their rescan is due.
    code_mapped: HashMap<u32, u64>,
    /// Rescans of processes past [`YOUNG_FOR`] for code they mapped, in
    /// the second that began at `.0`: at most
    /// [`OLD_CODE_MAPPED_RESCANS_PER_SECOND`].
    old_rescans: (Instant, u32),
}

impl UnwindMaps {
    /// `max_chunks` chunks of rows at most (the memory cap); none is
    /// created before a table needs it. Tables are read from and written
    /// to `disk` when there is one.
    pub(super) fn new(
        row_chunks: ArrayOfMaps<MapData, MapData>,
        max_chunks: u32,
        process_mappings: BpfHashMap<MapData, u32, ProcessMappings>,
        errors: PerCpuArray<MapData, u64>,
        disk: Option<DiskTableCache>,
    ) -> Result<Self, BpfError> {
        let builder = UnwindTableCache::new(BUILD_CACHE_BYTES);
        Ok(Self {
            rows: RowChunks::new(row_chunks, max_chunks),
            process_mappings,
            errors,
            arena: RowArena::new(0),
            tables: HashMap::new(),
            files: HashMap::new(),
            processes: HashMap::new(),
            jit: HashMap::new(),
            jit_generation: 0,
            hold_new: Duration::ZERO,
            held: HashMap::new(),
            builder: match disk {
                Some(disk) => builder.with_disk(disk),
                None => builder,
            },
            clock: 0,
            table_serial: 0,
            mappings_generation: 0,
            exits_checked_at: Instant::now(),
            stats: UnwindMapsStats::default(),
            loads_at_trim: 0,
            trimmed_at: Instant::now(),
            times: TableTimes::default(),
            rescan_on_code_mapped: false,
            code_mapped: HashMap::new(),
            old_rescans: (Instant::now(), 0),
        })
    }

    /// Indexes a process seen for the first time (no effect if it is
    /// indexed already). Returns false when the process is gone.
    pub fn track_process(&mut self, pid: u32) -> bool {
        if self.processes.contains_key(&pid) {
            return true;
        }
        if !self.hold_new.is_zero() {
            let first = *self.held.entry(pid).or_insert_with(Instant::now);
            if first.elapsed() < self.hold_new {
                return true;
            }
            self.held.remove(&pid);
        }
        self.scan(pid)
    }

    /// Re-reads a process's mappings (a sample's pc was in none of them:
    /// `dlopen`, new JIT memory), at most every [`RESCAN_EVERY`].
    pub fn refresh_process(&mut self, pid: u32) -> bool {
        if !self.processes.contains_key(&pid) {
            return self.track_process(pid);
        }
        if self.processes.get(&pid).is_some_and(|p| {
            let every = if p.over_budget {
                OVER_BUDGET_RESCAN_EVERY
            } else {
                RESCAN_EVERY
            };
            p.scanned_at.elapsed() < every
        }) {
            return true;
        }
        self.scan(pid)
    }

    /// Rescans the processes indexed less than [`YOUNG_FOR`] ago whose last
    /// scan is older than [`YOUNG_RESCAN_EVERY`] (when the kernel does not
    /// report their new code mappings).
    pub fn rescan_young(&mut self) {
        if self.rescan_on_code_mapped {
            return;
        }
        let due: Vec<u32> = self
            .processes
            .iter()
            .filter(|(_, p)| {
                p.is_young() && !p.over_budget && p.scanned_at.elapsed() >= YOUNG_RESCAN_EVERY
            })
            .map(|(pid, _)| *pid)
            .collect();
        for pid in due {
            self.scan(pid);
        }
    }

    /// `pid` mapped executable memory at `at_ns` (the kernel's
    /// [`clrbpf_common::ProcessEventKind::CodeMapped`]): an indexed process
    /// is rescanned once the kernel's interval is over, and at most every
    /// [`CODE_MAPPED_RESCAN_EVERY`] while young ([`OLD_CODE_MAPPED_RESCAN_EVERY`] after).
    pub fn code_mapped(&mut self, pid: u32, at_ns: u64) {
        let Some(index) = self.processes.get(&pid) else {
            return;
        };
        let every = if index.is_young() {
            CODE_MAPPED_RESCAN_EVERY
        } else {
            OLD_CODE_MAPPED_RESCAN_EVERY
        };
        let since_scan = u64::try_from(index.scanned_at.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let now = crate::profile::monotonic_ns();
        let due = (at_ns + clrbpf_common::CODE_MAPPED_EVERY_NS)
            .max((now + nanos(every)).saturating_sub(since_scan));
        let slot = self.code_mapped.entry(pid).or_insert(due);
        *slot = (*slot).min(due);
    }

    /// Rescans the processes whose code mappings are due
    /// ([`Self::code_mapped`]).
    pub fn rescan_code_mapped(&mut self) {
        if self.code_mapped.is_empty() {
            return;
        }
        let now = crate::profile::monotonic_ns();
        let mut due: Vec<(u64, u32)> = self
            .code_mapped
            .iter()
            .filter(|&(_, &at)| at <= now)
            .map(|(&pid, &at)| (at, pid))
            .collect();
        due.sort_unstable();
        if self.old_rescans.0.elapsed() >= Duration::from_secs(1) {
            self.old_rescans = (Instant::now(), 0);
        }
        for (_, pid) in due {
            let Some(index) = self.processes.get(&pid) else {
                self.code_mapped.remove(&pid);
                continue;
            };
            if !index.is_young() {
                if self.old_rescans.1 >= OLD_CODE_MAPPED_RESCANS_PER_SECOND {
                    // Its turn comes in a later second: it stays due.
                    continue;
                }
                self.old_rescans.1 += 1;
            }
            self.scan(pid);
            self.code_mapped.remove(&pid);
        }
    }

    /// Drops a process's index (it exited): its entry in the kernel's
    /// `PROCESS_MAPPINGS` and its use of each table (the tables' user
    /// counts). Its tables stay loaded until memory is needed: another
    /// process may map the same files, and unused tables are evicted first.
    pub fn forget_process(&mut self, pid: u32) {
        // Absent is fine: it may never have been indexed.
        let _ = self.process_mappings.remove(&pid);
        if let Some((key, _)) = self.jit.remove(&pid).and_then(|j| j.table) {
            self.free_table(key);
        }
        self.times.forget(pid);
        self.code_mapped.remove(&pid);
        if let Some(index) = self.processes.remove(&pid) {
            self.stats.processes_forgotten += 1;
            for key in index.tables {
                if let Some(t) = self.tables.get_mut(&key) {
                    t.users = t.users.saturating_sub(1);
                }
            }
        }
    }

    /// The index of `pid` the kernel holds now, and when the process was
    /// last scanned; `None` before it is indexed.
    pub(super) fn kernel_index(&self, pid: u32) -> Option<(ProcessMappings, Instant)> {
        let scanned_at = self.processes.get(&pid)?.scanned_at;
        Some((self.process_mappings.get(&pid, 0).ok()?, scanned_at))
    }

    /// A reader of the kernel's row array.
    pub(super) fn row_reader(&self) -> super::unwind_rows::RowReader<'_> {
        self.rows.reader()
    }

    /// Whether the kernel's `PROCESS_MAPPINGS` holds an index for `pid`
    /// (for tests and checks that eviction reached the kernel).
    pub fn kernel_has_index(&self, pid: u32) -> bool {
        self.process_mappings.get(&pid, 0).is_ok()
    }

    /// Forgets indexed processes that no longer exist, at most every
    /// [`EXIT_CHECK_EVERY`].
    pub fn forget_exited(&mut self) {
        if self.exits_checked_at.elapsed() < EXIT_CHECK_EVERY {
            return;
        }
        self.exits_checked_at = Instant::now();
        let gone: Vec<u32> = self
            .processes
            .keys()
            .copied()
            .filter(|pid| fs::metadata(format!("/proc/{pid}")).is_err())
            .collect();
        for pid in gone {
            self.forget_process(pid);
        }
    }

    /// Decodes the prologues of methods compiled in `pid` (an OSR method's
    /// with its tier-0 code's); the process's JIT table is rebuilt by
    /// [`Self::rebuild_jit_tables`].
    pub fn add_jit_code(&mut self, pid: u32, methods: &[JitMethod]) {
        self.times.jit_code(pid);
        let jit = self.jit.entry(pid).or_insert_with(|| ProcessJitCode {
            mem: File::open(format!("/proc/{pid}/mem")).ok(),
            methods: JitCodeRows::default(),
            // The first table is loaded at once: the process's first
            // methods are its start's, which are all it runs for a while.
            built_at: Instant::now()
                .checked_sub(JIT_REBUILD_EVERY)
                .unwrap_or_else(Instant::now),
            table: None,
        });
        let mut code = [0u8; PROLOGUE_BYTES];
        let mut base_code = [0u8; PROLOGUE_BYTES];
        let read_at = |buf: &mut [u8], at: u64| -> usize {
            use std::os::unix::fs::FileExt as _;
            jit.mem
                .as_ref()
                .and_then(|mem| mem.read_at(buf, at).ok())
                .unwrap_or(0)
        };
        for &JitMethod {
            start,
            end,
            osr_base,
        } in methods
        {
            let want = usize::try_from(end.saturating_sub(start))
                .unwrap_or(usize::MAX)
                .min(PROLOGUE_BYTES);
            let n = read_at(&mut code[..want], start);
            let frame = match osr_base {
                _ if n == 0 => {
                    self.stats.jit_not_decoded += 1;
                    // Whatever was there before is gone or unreadable.
                    MethodFrame::FramePointer
                }
                None => jit_code::method_frame(&code[..n], start),
                Some(base) => {
                    self.stats.jit_osr += 1;
                    let base_n = read_at(&mut base_code, base);
                    jit_code::osr_method_frame(&code[..n], start, &base_code[..base_n], base)
                }
            };
            match &frame {
                MethodFrame::Rows(_) => self.stats.jit_frameless += 1,
                MethodFrame::Prologue(_) => self.stats.jit_prologues += 1,
                MethodFrame::Unrecognised => self.stats.jit_unrecognised += 1,
                MethodFrame::FramePointer => {}
            }
            self.stats.jit_methods += 1;
            if !jit.methods.insert(start, end, &frame) {
                self.stats.jit_not_decoded += 1;
            }
        }
    }

    /// How long the worker may sleep: until the first JIT table with
    /// changes is due for its rebuild, else [`IDLE_WAKE_EVERY`].
    /// Indexes the held processes whose time has come.
    pub(super) fn index_held(&mut self) {
        let due: Vec<u32> = self
            .held
            .iter()
            .filter(|(_, first)| first.elapsed() >= self.hold_new)
            .map(|(pid, _)| *pid)
            .collect();
        for pid in due {
            self.track_process(pid);
        }
    }

    pub(super) fn next_wake(&self) -> Duration {
        if !self.held.is_empty() {
            return Duration::from_millis(20);
        }
        let now = crate::profile::monotonic_ns();
        // A rescan still due once they ran was held back by the rate of
        // old processes' rescans: it waits for the next second.
        let next_second = Duration::from_secs(1).saturating_sub(self.old_rescans.0.elapsed());
        let held = |pid: &u32| {
            self.old_rescans.1 >= OLD_CODE_MAPPED_RESCANS_PER_SECOND
                && self.processes.get(pid).is_some_and(|p| !p.is_young())
        };
        let code_mapped =
            self.code_mapped.iter().map(move |(pid, &due)| {
                match Duration::from_nanos(due.saturating_sub(now)) {
                    Duration::ZERO if held(pid) => next_second,
                    wait => wait,
                }
            });
        self.jit
            .values()
            .filter(|j| j.methods.is_changed())
            .map(|j| JIT_REBUILD_EVERY.saturating_sub(j.built_at.elapsed()))
            .chain(code_mapped)
            .min()
            .unwrap_or(IDLE_WAKE_EVERY)
            .max(Duration::from_millis(1))
    }

    /// Loads a new table for each process whose JIT methods changed and
    /// whose table is older than [`JIT_REBUILD_EVERY`].
    pub fn rebuild_jit_tables(&mut self) {
        let due: Vec<u32> = self
            .jit
            .iter_mut()
            .filter(|(_, j)| j.built_at.elapsed() >= JIT_REBUILD_EVERY)
            .filter_map(|(pid, j)| j.methods.take_changed().then_some(*pid))
            .collect();
        for pid in due {
            self.load_jit_table(pid);
        }
    }

    /// Loads `pid`'s JIT table now if its methods changed (the start of a
    /// recording waits for it, not for [`JIT_REBUILD_EVERY`]).
    pub(super) fn load_jit_table_now(&mut self, pid: u32) {
        if self
            .jit
            .get_mut(&pid)
            .is_some_and(|j| j.methods.take_changed())
        {
            self.load_jit_table(pid);
        }
    }

    /// Replaces `pid`'s JIT table by one of its current methods: the new
    /// rows are written and the process's index pointed at them before the
    /// old rows are freed.
    fn load_jit_table(&mut self, pid: u32) {
        let Some(jit) = self.jit.get_mut(&pid) else {
            return;
        };
        jit.built_at = Instant::now();
        let rows = jit.methods.rows();
        let old = jit.table;
        let new = match rows.first() {
            None => None,
            Some(first) => {
                self.jit_generation = self.jit_generation.wrapping_add(1);
                let key = JIT_TABLE_KEY | u64::from(self.jit_generation) << 32 | u64::from(pid);
                let (index, words) = build_row_index(&rows);
                let first_pc = first.pc;
                self.load_rows(key, &rows, index, &pack_index_words(&words), &[])
                    .then_some((key, first_pc))
            }
        };
        if new.is_some() {
            self.stats.jit_tables_loaded += 1;
        }
        self.times.jit_table(pid, new.is_some());
        let Some(jit) = self.jit.get_mut(&pid) else {
            return;
        };
        jit.table = new;
        if let Some(index) = self.processes.remove(&pid) {
            self.write_index(pid, &index);
            self.processes.insert(pid, index);
        }
        // (Loading may have evicted the old table already: then this
        // finds nothing.)
        if let Some((key, _)) = old {
            self.free_table(key);
        }
    }

    /// Frees a table no process index points at any more.
    fn free_table(&mut self, key: u64) {
        if let Some(table) = self.tables.remove(&key) {
            self.arena.free(table.offset, table.len);
        }
    }

    pub fn memory(&self) -> UnwindMemory {
        UnwindMemory {
            table_bytes: self.arena.used() * size_of::<UnwindRow>() as u64,
            tables: self.tables.len(),
            capacity_bytes: u64::from(self.rows.max_rows()) * size_of::<UnwindRow>() as u64,
            allocated_bytes: (self.rows.chunks() * CHUNK_BYTES) as u64,
            index_bytes: (self.processes.len() * size_of::<ProcessMappings>()) as u64,
            processes: self.processes.len(),
        }
    }

    /// Bytes of kernel memory in use for unwinding: loaded rows and indexes.
    pub fn memory_bytes(&self) -> u64 {
        let m = self.memory();
        m.table_bytes + m.index_bytes
    }

    /// Kernel-side walks that ended with each error, summed over CPUs.
    pub fn error_counts(&self) -> Vec<(UnwindError, u64)> {
        UnwindError::ALL
            .iter()
            .map(|&e| {
                let n = self
                    .errors
                    .get(&(e as u32), 0)
                    .map(|v| v.iter().sum())
                    .unwrap_or(0);
                (e, n)
            })
            .filter(|&(e, _)| (e as u32) < UNWIND_ERROR_SLOTS)
            .collect()
    }

    pub fn stats(&self) -> UnwindMapsStats {
        self.stats
    }

    fn scan(&mut self, pid: u32) -> bool {
        // Read within the memory budget, as the pipeline reads it: a
        // process controls how long its maps file is.
        let Ok(maps) = File::open(format!("/proc/{pid}/maps"))
            .and_then(|f| MappingTable::parse(std::io::BufReader::new(f)))
        else {
            self.forget_process(pid);
            return false;
        };
        // A code mapping is covered by a scan from its due time on (the
        // kernel's interval is over), not before.
        let now_ns = crate::profile::monotonic_ns();
        let mapped = self.code_mapped.get(&pid).is_some_and(|&due| due <= now_ns);
        if mapped {
            self.code_mapped.remove(&pid);
        }
        self.times.scan_began(pid, mapped);
        self.clock += 1;
        let now = self.clock;
        let mut entries = Vec::new();
        let mut used = HashSet::new();
        let mut files = HashMap::new();
        let known = self
            .processes
            .get_mut(&pid)
            .map(|p| std::mem::take(&mut p.files));
        for m in maps.iter() {
            if !m.is_executable() {
                continue;
            }
            // .NET's W^X views of its code heap (`/memfd:doublemapper`)
            // hold JIT code, never an ELF file: they use the JIT table,
            // and opening each new view to find that out cost an idle
            // runtime's rescans most of their time.
            let table = if m
                .path
                .as_deref()
                .is_none_or(|p| p.starts_with('[') || p.starts_with(DOUBLE_MAPPED_CODE))
            {
                None
            } else {
                let file = MappedFile::of(m);
                let table = self.table_for_piece(pid, file, known.as_ref());
                files.insert(file, table);
                table
            };
            let mut entry = MappingEntry {
                start: m.start,
                end: m.end,
                ..MappingEntry::default()
            };
            let mut source = None;
            if let Some(key) = table
                && let Some(t) = self.tables.get_mut(&key)
                && let Some(bias) = load_bias(&t.segments, m.start, m.offset)
            {
                t.last_used = now;
                entry =
                    MappingEntry { bias, ..entry }.with_table(t.offset, t.rows, t.index, t.serial);
                source = Some(key);
                used.insert(key);
            }
            entries.push((entry, source));
        }
        // A table loaded late in this scan may have evicted one loaded
        // earlier in it: keep only entries whose table is still there.
        for (entry, source) in &mut entries {
            if let Some(key) = *source
                && !self
                    .tables
                    .get(&key)
                    .is_some_and(|t| t.offset == entry.row_offset && t.rows == entry.row_count)
            {
                entry.row_count = 0;
                *source = None;
                used.remove(&key);
            }
        }
        let old = self.processes.remove(&pid);
        let new_files = used
            .iter()
            .filter(|k| old.as_ref().is_none_or(|o| !o.tables.contains(k)))
            .count();
        let first_scanned_at = old
            .as_ref()
            .map_or_else(Instant::now, |old| old.first_scanned_at);
        for key in &used {
            if let Some(t) = self.tables.get_mut(key) {
                t.users += 1;
            }
        }
        if let Some(old) = old {
            for key in old.tables {
                if let Some(t) = self.tables.get_mut(&key) {
                    t.users = t.users.saturating_sub(1);
                }
            }
        } else {
            self.stats.processes_indexed += 1;
        }
        let index = ProcessIndex {
            tables: used,
            // Kept while the process is young, when its scans come in
            // bursts; an old process is rescanned rarely, and a node of
            // idle processes would hold ~7 KB each for nothing.
            files: if first_scanned_at.elapsed() < YOUNG_FOR {
                files
            } else {
                HashMap::new()
            },
            entries,
            scanned_at: Instant::now(),
            first_scanned_at,
            over_budget: maps.stats().over_budget(),
        };
        self.write_index(pid, &index);
        self.times.scanned(pid, index.tables.len(), new_files);
        self.processes.insert(pid, index);
        true
    }

    /// Writes `pid`'s index to the kernel: its mappings, those without a
    /// file table given the process's JIT table from its first pc on.
    fn write_index(&mut self, pid: u32, index: &ProcessIndex) {
        let jit = self
            .jit
            .get(&pid)
            .and_then(|j| j.table)
            .and_then(|(key, first_pc)| Some((self.tables.get(&key)?, first_pc)));
        let mut entries = Vec::with_capacity(index.entries.len() + 1);
        for &(entry, source) in &index.entries {
            match jit {
                Some((t, first_pc))
                    if source.is_none() && entry.row_count == 0 && entry.end > first_pc =>
                {
                    let with_jit = |start| {
                        MappingEntry {
                            start,
                            bias: 0,
                            ..entry
                        }
                        .with_table(t.offset, t.rows, t.index, t.serial)
                    };
                    if entry.start < first_pc {
                        entries.push(MappingEntry {
                            end: first_pc,
                            ..entry
                        });
                        entries.push(with_jit(first_pc));
                    } else {
                        entries.push(with_jit(entry.start));
                    }
                }
                _ => entries.push(entry),
            }
        }
        let (mut value, dropped) = build_process_mappings(entries);
        self.stats.mappings_dropped += dropped as u64;
        // A new generation for every write: the kernel then never keeps
        // entries of an index it no longer holds (a table evicted, moved).
        self.mappings_generation = self.mappings_generation.wrapping_add(1).max(1);
        value.generation = self.mappings_generation;
        if self.process_mappings.insert(pid, *value, 0).is_err() {
            self.stats.map_update_errors += 1;
        }
    }

    /// The table key of a piece of a file `pid` maps: the one its last scan
    /// found (`known`) while that table is loaded, else looked for.
    fn table_for_piece(
        &mut self,
        pid: u32,
        file: MappedFile,
        known: Option<&HashMap<MappedFile, Option<u64>>>,
    ) -> Option<u64> {
        match known.and_then(|k| k.get(&file)) {
            // A table evicted since is loaded again the usual way.
            Some(&Some(key)) if self.tables.contains_key(&key) => Some(key),
            Some(&None) => None,
            _ => {
                self.times.file_opened(pid);
                self.table_for_mapping(pid, file.start, file.end)
            }
        }
    }

    /// The table key of the file mapped at `[start, end)` in `pid`, loading
    /// its rows into the kernel when needed.
    fn table_for_mapping(&mut self, pid: u32, start: u64, end: u64) -> Option<u64> {
        let file = File::open(format!("/proc/{pid}/map_files/{start:x}-{end:x}")).ok()?;
        let meta = file.metadata().ok()?;
        let stat_key = FileStatKey {
            dev: meta.dev(),
            inode: meta.ino(),
            size: meta.size(),
            mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
        };
        match self.files.get(&stat_key) {
            Some(FileState::NoTable) => return None,
            Some(FileState::Table(key)) if self.tables.contains_key(key) => return Some(*key),
            _ => {}
        }
        let watch = Stopwatch::start();
        let disk_hits = |maps: &Self| maps.builder.disk_stats().map_or(0, |d| d.hits);
        let (loaded, hits) = (self.stats.tables_loaded, disk_hits(self));
        let state = self.load_file(pid, &file);
        if matches!(state, FileState::Table(_)) {
            let source = match () {
                () if self.stats.tables_loaded == loaded => TableSource::Loaded,
                () if disk_hits(self) > hits => TableSource::Read,
                () => TableSource::Built,
            };
            self.times.file_done(pid, source, watch.took());
        }
        if self.files.len() >= MAX_KNOWN_FILES {
            self.files
                .retain(|_, state| matches!(state, FileState::Table(_)));
        }
        self.files.insert(stat_key, state);
        match state {
            FileState::Table(key) => Some(key),
            FileState::NoTable => None,
        }
    }

    fn load_file(&mut self, pid: u32, file: &File) -> FileState {
        // A file with a build id whose table is loaded, or kept in memory
        // or on disk, needs nothing more read.
        if let Some(identity) = read_build_id(file) {
            let key = identity.key();
            if self.tables.contains_key(&key) {
                return FileState::Table(key);
            }
            if let Some(table) = self.builder.get_kept(&identity) {
                return self.load_table(key, &table);
            }
        }
        let data = match read_elf_file(file) {
            Ok(data) => data,
            Err(e) => {
                if let crate::unwind::UnwindTableError::OverBudget { limit }
                | crate::unwind::UnwindTableError::TooLarge { limit } = e
                {
                    let drops = crate::memory_budget::drops();
                    crate::memory_budget::Drops::count(&drops.files, 1);
                    let size = file.metadata().map_or(limit, |m| m.len());
                    crate::memory_budget::Drops::count(&drops.file_bytes, size);
                    crate::memory_budget::warn_once(
                        pid,
                        crate::memory_budget::OverBudget::File,
                        || {
                            format!(
                                "pid {pid} maps an executable file of {size} bytes whose unwind sections are over the {limit}-byte share for one file: its native frames are walked by frame pointers"
                            )
                        },
                    );
                }
                self.stats.files_without_table += 1;
                return FileState::NoTable;
            }
        };
        let Ok(identity) = FileIdentity::of_elf_bytes(&data) else {
            self.stats.files_without_table += 1;
            return FileState::NoTable;
        };
        let key = identity.key();
        if self.tables.contains_key(&key) {
            return FileState::Table(key);
        }
        let Ok(table) = self.builder.get_or_build(&data) else {
            self.stats.files_without_table += 1;
            return FileState::NoTable;
        };
        self.load_table(key, &table)
    }

    /// Loads `table`'s rows into the kernel under `key`.
    fn load_table(&mut self, key: u64, table: &UnwindTable) -> FileState {
        if table.rows().is_empty()
            || !self.load_rows(
                key,
                table.rows(),
                table.row_index(),
                table.index_slots(),
                table.segments(),
            )
        {
            self.stats.files_without_table += 1;
            return FileState::NoTable;
        }
        self.stats.tables_loaded += 1;
        FileState::Table(key)
    }

    /// Copies a table's rows and index slots into the row array and
    /// records it under `key`. False when it does not fit (counted) or the
    /// array cannot be written.
    fn load_rows(
        &mut self,
        key: u64,
        rows: &[UnwindRow],
        index: RowIndex,
        index_slots: &[UnwindRow],
        segments: &[LoadSegment],
    ) -> bool {
        let (Ok(len), Ok(row_count)) = (
            u32::try_from(rows.len() + index_slots.len()),
            u32::try_from(rows.len()),
        ) else {
            self.stats.tables_too_large += 1;
            return false;
        };
        let Some(offset) = self.allocate_rows(len) else {
            self.stats.tables_too_large += 1;
            return false;
        };
        let watch = Stopwatch::start();
        let written = self
            .rows
            .write(offset, rows)
            .and_then(|()| self.rows.write(offset + row_count, index_slots));
        self.times.rows_written(watch.took());
        if let Err(error) = written {
            tracing::debug!(%error, "could not map an unwind row chunk to write a table");
            self.arena.free(offset, len);
            return false;
        }
        let serial = self.next_serial();
        self.tables.insert(
            key,
            LoadedTable {
                offset,
                len,
                rows: row_count,
                index,
                serial,
                segments: segments.into(),
                users: 0,
                last_used: self.clock,
            },
        );
        true
    }

    /// Hands the heap memory that building tables freed back to the kernel
    /// (at most every [`TRIM_EVERY`], and only after a table was loaded):
    /// file buffers and table builds free tens of MiB in pieces that
    /// otherwise stay resident between smaller live allocations.
    pub(super) fn trim_heap_after_loads(&mut self) {
        if self.stats.tables_loaded == self.loads_at_trim || self.trimmed_at.elapsed() < TRIM_EVERY
        {
            return;
        }
        self.loads_at_trim = self.stats.tables_loaded;
        self.trimmed_at = Instant::now();
        crate::release_freed_heap();
    }

    /// The next [`MappingEntry::table_serial`], never 0.
    fn next_serial(&mut self) -> u16 {
        self.table_serial = self.table_serial.wrapping_add(1).max(1);
        self.table_serial
    }

    /// A free range of `len` rows: the row array grows by chunks up to the
    /// cap, then least recently used tables are evicted (unused ones first,
    /// never one used in the current scan) until it fits.
    fn allocate_rows(&mut self, len: u32) -> Option<u32> {
        if len > self.rows.max_rows() {
            return None;
        }
        loop {
            if let Some(offset) = self.arena.allocate(len) {
                return Some(offset);
            }
            match self.rows.grow() {
                Ok(true) => {
                    self.arena.grow(CHUNK_ROWS);
                    continue;
                }
                Ok(false) => {}
                Err(e) => {
                    // The kernel refused the memory: work within what is
                    // there, as at the cap.
                    if !self.stats.chunk_refused {
                        tracing::warn!("unwind tables cannot grow: {e}");
                    }
                    self.stats.chunk_refused = true;
                    self.rows.stop_growing();
                }
            }
            let victim = self
                .tables
                .iter()
                .filter(|(_, t)| t.last_used < self.clock)
                .min_by_key(|(_, t)| (t.users > 0, t.last_used))
                .map(|(k, _)| *k)?;
            self.evict(victim);
        }
    }

    fn evict(&mut self, key: u64) {
        let Some(table) = self.tables.remove(&key) else {
            return;
        };
        // First point every process that uses it at the frame-pointer rule,
        // then free the rows for reuse.
        let mut users: Vec<u32> = self
            .processes
            .iter()
            .filter(|(_, p)| p.tables.contains(&key))
            .map(|(pid, _)| *pid)
            .collect();
        for (pid, jit) in &mut self.jit {
            if jit.table.is_some_and(|(k, _)| k == key) {
                jit.table = None;
                // Rebuilt at its next change.
                users.push(*pid);
            }
        }
        for pid in users {
            let Some(mut index) = self.processes.remove(&pid) else {
                continue;
            };
            index.tables.remove(&key);
            for (entry, source) in &mut index.entries {
                if *source == Some(key) {
                    entry.row_count = 0;
                    *source = None;
                }
            }
            self.write_index(pid, &index);
            self.processes.insert(pid, index);
        }
        self.files
            .retain(|_, state| !matches!(state, FileState::Table(k) if *k == key));
        self.arena.free(table.offset, table.len);
        self.stats.tables_evicted += 1;
    }
}
