//! Managed (.NET) frame names for one process, from the files its runtime
//! writes when perf maps are enabled: `jit-NSPID.dump` (JIT'd and
//! ReadyToRun code, each with the time it was compiled) and
//! `perf-NSPID.map` (JIT'd code only, no times). This is the managed half of
//! the `symbolize/` stage: a raw sample's user addresses that fall in no ELF
//! mapping are looked up here with the sample's timestamp.
//!
//! Strategy:
//! 1. Locate the files as the target sees them: its namespace pid (`NSpid`)
//!    and perf directory (`DOTNET_PerfMapJitDumpPath`, default `/tmp`; for
//!    runtimes before .NET 8 the perf map is in `$TMPDIR`), read through
//!    `/proc/PID/root` with [`super::target_fs`] (no symlink escapes).
//!    Files last modified before the process started belong to an earlier
//!    process with the same pid (the runtime never deletes them): ignored.
//! 2. On each [`ManagedSymbols::refresh`], read only the bytes appended since
//!    the last one and feed them to the incremental parsers. A file that was
//!    replaced or truncated (different inode, shorter, or different first
//!    bytes) is parsed again from the start.
//! 3. Prefer the jitdump: CoreCLR writes every perf map line to it too, with
//!    a CLOCK_MONOTONIC timestamp (the clock of `bpf_ktime_get_ns`). The perf
//!    map is read only while the jitdump is missing or unusable
//!    (`DOTNET_PerfMapEnabled=3`, or a corrupt jitdump); its lines are
//!    stamped with the refresh time, which is after the code became valid.
//! 4. Index every range with that time in a [`JitCodeIndex`] and resolve a
//!    sample by address and time (addresses are reused by tiering).
//!
//! 5. Memory: every process's tables are charged to one
//!    [`ManagedSymbolBudget`] shared by all processes of a run. Past it, the
//!    least recently used processes' tables are dropped (counted) and read
//!    again from their perf files at their next [`ManagedSymbols::refresh`]
//!    (the pipeline refreshes a process when it is sampled again).
//!
//! Limits: a process in a time namespace has its own CLOCK_MONOTONIC
//! offset, not corrected here. Memory grows with the number of methods
//! (about 300 bytes each); caps per file and the budget bound it. Methods
//! named from runtime events ([`ManagedSymbols::insert_method`]) are not in
//! the files: a process holding any is never dropped (but still charged).

use std::collections::HashSet;
use std::fs::File;
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use super::file_watch::{FileWatch, WatchedPerfFile};
use super::jit_index::JitCodeIndex;
use super::jitdump::{JitDumpCounts, JitDumpError, JitDumpLimits, JitDumpParser};
use super::method_name::parse_method_name;
use super::perf_files::perf_file_names;
use super::perf_map::{PerfMapCounts, PerfMapLimits, PerfMapParser};
use super::target_fs::{self, TargetFsError};
use crate::process::{ProcFs, identity::FsIdentity};

/// A named range of managed code.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ManagedSymbol {
    /// Full signature without the tier, as the runtime writes it:
    /// `int64 [Hot] Hot::Spin(int64)`.
    pub name: Arc<str>,
    /// `Namespace.Type.Method` ([`super::method_name`]); the same `Arc`
    /// as `name` when the name has no short form (stubs).
    pub short_name: Arc<str>,
    /// JIT tier from the `[Tier]` suffix: `OptimizedTier1`, `PreJIT`, ...
    pub jit_tier: Option<Arc<str>>,
    /// The name exactly as written (the same `Arc` as `name` when there is
    /// no tier).
    pub raw_name: Arc<str>,
    /// Assembly from the `[...]` before the type: `Hot`.
    pub assembly: Option<Arc<str>>,
    /// Runtime stub (precode, dispatch, ...), not a method.
    pub is_stub: bool,
    pub start: u64,
    pub size: u64,
}

/// Tiers CoreCLR appends (`GetJitOptimizationTierStr`, plus the jitdump's
/// ReadyToRun ones).
pub const KNOWN_JIT_TIERS: &[&str] = &[
    "MinOptJitted",
    "Optimized",
    "QuickJitted",
    "OptimizedTier1",
    "OptimizedTier1OSR",
    "InstrumentedTier",
    "InstrumentedTierOptimized",
    "PreJIT",
    "PreJit-cold",
];

/// Splits a trailing `[Tier]` off a runtime name: a known tier, or any
/// `[Word]` of letters, digits and '-' right after the signature's `)`
/// (tolerant of tiers added by later runtimes). Anything else is left in the
/// name: `Dictionary`2[System.__Canon,System.__Canon]` is not a tier.
pub fn split_tier(raw: &str) -> (&str, Option<&str>) {
    let Some(body) = raw.strip_suffix(']') else {
        return (raw, None);
    };
    let Some(open) = body.rfind('[') else {
        return (raw, None);
    };
    let (name, tier) = (&raw[..open], &body[open + 1..]);
    let is_word = !tier.is_empty() && tier.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let is_tier = KNOWN_JIT_TIERS.contains(&tier) || (is_word && name.ends_with(')'));
    if is_tier && !name.is_empty() {
        (name, Some(tier))
    } else {
        (raw, None)
    }
}

/// The assembly of a runtime method name: the first `[Name]` that stands
/// alone (after a blank or at the start, followed by a blank) before the
/// argument list. `class [System.Runtime]System.String` in a signature is
/// IL syntax for a type, not the method's assembly.
pub fn assembly_of(name: &str) -> Option<&str> {
    let head = name.find('(').map_or(name, |paren| &name[..paren]);
    let bytes = head.as_bytes();
    let mut from = 0;
    while let Some(offset) = head[from..].find('[') {
        let open = from + offset;
        from = open + 1;
        if open > 0 && bytes[open - 1] != b' ' {
            continue;
        }
        let len = head[open + 1..].find(']')?;
        let inner = &head[open + 1..open + 1 + len];
        let after = bytes.get(open + 1 + len + 1);
        if !inner.is_empty() && !inner.contains([' ', '[']) && after == Some(&b' ') {
            return Some(inner);
        }
    }
    None
}

/// Whether a runtime name is a stub (`stub<12> AllocateTemporaryEntryPoints<PRECODE_STUB>`).
pub fn is_stub_name(raw: &str) -> bool {
    raw.starts_with("stub<") || raw.starts_with("stub ")
}

/// Shares the few distinct tier and assembly strings among all symbols,
/// and, when made with [`Self::sharing`], method names with other
/// processes' symbols.
#[derive(Debug, Default)]
pub struct SymbolInterner {
    strings: HashSet<Arc<str>, BuildHasherDefault<FnvHasher>>,
    names: Option<SharedNames>,
}

/// FNV-1a: the interned strings are short and few, SipHash's DoS
/// resistance buys nothing here (a hostile target only slows its own
/// symbols) and costs a large share of a perf map load.
#[derive(Debug)]
struct FnvHasher(u64);

impl Default for FnvHasher {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for FnvHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl SymbolInterner {
    /// An interner whose method names are shared through `names`.
    pub fn sharing(names: SharedNames) -> Self {
        Self {
            names: Some(names),
            ..Self::default()
        }
    }

    /// Forgets the interned strings, still sharing names.
    pub fn clear(&mut self) {
        self.strings = HashSet::default();
    }

    /// A method name: the one another process's symbols hold, if shared.
    pub fn name(&mut self, text: &str) -> Arc<str> {
        match &self.names {
            Some(names) => names.get(text),
            None => text.into(),
        }
    }

    pub fn intern(&mut self, text: &str) -> Arc<str> {
        if let Some(known) = self.strings.get(text) {
            return known.clone();
        }
        let shared: Arc<str> = text.into();
        self.strings.insert(shared.clone());
        shared
    }

    /// Heap bytes held, estimated: each string's allocation and its slot.
    pub fn memory_bytes(&self) -> u64 {
        let slots = self.strings.capacity() as u64 * (size_of::<Arc<str>>() as u64 + 1);
        let strings: u64 = self.strings.iter().map(|s| arc_str_bytes(s.len())).sum();
        slots + strings
    }
}

/// Heap bytes of one `Arc<str>` of `len` bytes as glibc's malloc gives
/// them: the two reference counts, the text and the chunk header, rounded
/// up to 16 bytes, at least 32.
pub(crate) fn arc_str_bytes(len: usize) -> u64 {
    let chunk = (len as u64 + 16 + 8).div_ceil(16) * 16;
    chunk.max(32)
}

impl ManagedSymbol {
    /// A symbol from a name as the runtime writes it (tier suffix included).
    pub fn from_raw_name(raw: &str, start: u64, size: u64, interner: &mut SymbolInterner) -> Self {
        let raw_name = interner.name(raw);
        let (name, tier) = split_tier(raw);
        let jit_tier = tier.map(|tier| interner.intern(tier));
        let name = if tier.is_some() {
            interner.name(name)
        } else {
            raw_name.clone()
        };
        let assembly = assembly_of(&name).map(|assembly| interner.intern(assembly));
        let short_name = match parse_method_name(&name) {
            Some(method) if !is_stub_name(raw) => interner.name(&method.short()),
            _ => name.clone(),
        };
        Self {
            is_stub: is_stub_name(raw),
            short_name,
            name,
            jit_tier,
            raw_name,
            assembly,
            start,
            size,
        }
    }

    /// One past the last byte of the range (saturating).
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.size)
    }
}

/// Paths of a runtime's perf files as the target process sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerfFilePaths {
    pub perf_map: PathBuf,
    pub jitdump: PathBuf,
    /// `perfinfo-N.map` (image loads, .NET 8 and older); not parsed here.
    pub perfinfo: PathBuf,
    /// Where an older runtime writes the perf map instead, when that is
    /// another directory (see [`target_fs::PerfDirs`]). Once the perf map is
    /// found there, `perf_map` and `perfinfo` point there and this is `None`.
    pub legacy_perf_map: Option<PathBuf>,
}

impl PerfFilePaths {
    pub fn new(location: &TargetLocation) -> Self {
        let [perf_map, jitdump, perfinfo] =
            perf_file_names(location.ns_pid).map(|name| location.perf_dir.join(name));
        let legacy_perf_map = (location.legacy_perf_map_dir != location.perf_dir).then(|| {
            location
                .legacy_perf_map_dir
                .join(&perf_file_names(location.ns_pid)[0])
        });
        Self {
            perf_map,
            jitdump,
            perfinfo,
            legacy_perf_map,
        }
    }

    /// The perf map was found in the legacy directory: use it from now on.
    fn switch_to_legacy(&mut self) {
        if let Some(legacy) = self.legacy_perf_map.take() {
            if let Some(dir) = legacy.parent() {
                self.perfinfo = dir.join(self.perfinfo.file_name().unwrap_or_default());
            }
            self.perf_map = legacy;
        }
    }
}

/// Where a process's perf files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetLocation {
    /// Host pid.
    pub pid: u32,
    /// Pid in the process's own namespace: the number in the file names.
    pub ns_pid: u32,
    /// The process's root directory as we reach it (`/proc/PID/root`).
    pub root: PathBuf,
    /// The perf directory as the process sees it (`/tmp`).
    pub perf_dir: PathBuf,
    /// Where runtimes before .NET 8 write the perf map (`$TMPDIR` or `/tmp`).
    pub legacy_perf_map_dir: PathBuf,
    /// The process's filesystem identity: a perf file is read only when
    /// this uid owns it (the names are the target's to choose, so a file of
    /// that name may be another user's). `None` (unreadable): none is read.
    pub owner: Option<FsIdentity>,
    /// When the process started. The runtime never deletes its perf files,
    /// so `/tmp` keeps those of dead processes, and pids are reused: a file
    /// last modified before this (minus [`STALE_FILE_SLACK`]) belongs to an
    /// earlier process and is ignored. `None` disables the check.
    pub started_at: Option<SystemTime>,
}

/// Tolerance of the stale-file check: the start time is known to about a
/// second (boot time is whole seconds), file times to a clock tick.
pub const STALE_FILE_SLACK: Duration = Duration::from_secs(2);

impl TargetLocation {
    /// Reads the namespace pid and perf directory of a live process.
    pub fn of_process(pid: u32) -> Self {
        let dirs = target_fs::target_perf_dirs(pid);
        Self {
            pid,
            ns_pid: ProcFs::default().ns_pid(pid).unwrap_or(pid),
            root: target_fs::proc_root(pid),
            perf_dir: dirs.perf_dir,
            legacy_perf_map_dir: dirs.legacy_perf_map_dir,
            owner: FsIdentity::of_process(&ProcFs::default(), pid).ok(),
            started_at: target_fs::process_start_time(pid),
        }
    }
}

/// Bounds for one process's managed symbols.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManagedSymbolsConfig {
    pub perf_map: PerfMapLimits,
    pub jitdump: JitDumpLimits,
    /// Bytes read per file and refresh; the rest waits for the next one.
    /// Bounds the time of one refresh (a jitdump also carries code bytes).
    pub max_bytes_per_refresh: u64,
    /// Bytes the process's own tables may take ([`JitCodeIndex::memory_bytes`]);
    /// later entries are dropped and counted. The entry caps alone would
    /// let names of 64 KiB each pass the budget a thousandfold.
    pub max_table_bytes: u64,
}

impl Default for ManagedSymbolsConfig {
    fn default() -> Self {
        Self {
            perf_map: PerfMapLimits::default(),
            jitdump: JitDumpLimits::default(),
            max_bytes_per_refresh: 256 * 1024 * 1024,
            max_table_bytes: u64::MAX,
        }
    }
}

/// What happened to one file in one refresh.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FileStatus {
    /// Not there (yet): not an error.
    #[default]
    Missing,
    /// Opened and read up to its end or the byte bound.
    Read,
    /// Not read: the perf map while the jitdump is usable.
    NotNeeded,
    /// Stopped on an earlier parse error; see [`ManagedSymbolErrors::jitdump_stop`].
    Stopped,
    /// Left by an earlier process with the same pid: ignored.
    Stale,
    /// Open or read failed; counted in [`ManagedSymbolErrors`].
    Failed,
}

/// One file's part of a refresh.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileRefresh {
    pub status: FileStatus,
    pub bytes_read: u64,
    pub symbols_added: u64,
    /// Entries dropped because the process's tables were at
    /// [`ManagedSymbolsConfig::max_table_bytes`].
    pub symbols_over_budget: u64,
    /// Parsed again from the start: the file was replaced or truncated.
    pub restarted: bool,
    /// Of `symbols_added`, the ReadyToRun code found in the run's shared
    /// image tables ([`SharedImageCode`]) instead of this process's index.
    pub symbols_shared: u64,
}

/// What [`ManagedSymbols::refresh`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefreshStats {
    pub perf_map: FileRefresh,
    pub jitdump: FileRefresh,
}

/// Problems met so far, per kind (cumulative).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ManagedSymbolErrors {
    pub perf_map: PerfMapCounts,
    pub jitdump: JitDumpCounts,
    /// Why the jitdump parser stopped, if it did.
    pub jitdump_stop: Option<JitDumpError>,
    /// Opens that failed for another reason than a missing file.
    pub open_errors: u64,
    pub read_errors: u64,
    /// Files parsed again from the start after being replaced or truncated.
    pub restarts: u64,
    /// Distinct files ignored as left by an earlier process with the same pid.
    pub stale_files: u64,
    /// Ranges the index refused (empty, overflowing, oversized).
    pub rejected_ranges: u64,
    /// Lookups cut short by overlapping ranges.
    pub lookup_step_limit_hits: u64,
    /// The last open or read error, for a log line.
    pub last_io_error: Option<String>,
}

impl ManagedSymbolErrors {
    /// What went wrong with the perf files, in a few words for the summary;
    /// `None` when nothing did. A refused, symlinked or corrupt file leaves
    /// frames unnamed, and the user must be told why.
    pub fn problems(&self) -> Option<String> {
        let mut parts = Vec::new();
        if self.open_errors + self.read_errors > 0 {
            parts.push(format!(
                "{} perf file opens or reads refused or failed (last: {})",
                self.open_errors + self.read_errors,
                self.last_io_error.as_deref().unwrap_or("unknown")
            ));
        }
        let bad_lines = self.perf_map.malformed_lines + self.perf_map.long_lines;
        if bad_lines > 0 {
            parts.push(format!("{bad_lines} malformed perf map lines skipped"));
        }
        let bad_loads = self.jitdump.bad_code_loads + self.jitdump.long_names;
        if bad_loads > 0 {
            parts.push(format!("{bad_loads} malformed jitdump records skipped"));
        }
        if let Some(stop) = &self.jitdump_stop {
            parts.push(format!("jitdump unusable: {stop}"));
        }
        let over_cap = self.perf_map.entries_over_cap + self.jitdump.code_loads_over_cap;
        if over_cap > 0 {
            parts.push(format!(
                "{over_cap} methods over the per-process cap dropped"
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// Bytes compared to tell a rewritten file from a grown one.
const FINGERPRINT_LEN: usize = 64;
/// Bytes read per `pread`.
const READ_CHUNK: usize = 1024 * 1024;
/// The read buffer a process keeps between refreshes, at most.
const KEPT_READ_BUFFER: usize = 64 * 1024;

/// What we know of one file between refreshes.
#[derive(Debug, Default)]
struct TrackedFile {
    /// `(st_dev, st_ino)` of the file last read.
    identity: Option<(u64, u64)>,
    /// Its first bytes (up to [`FINGERPRINT_LEN`]).
    fingerprint: Vec<u8>,
    /// The last file found stale, so it is counted once.
    stale: Option<(u64, u64)>,
}

/// What [`open_tracked`] found.
#[derive(Debug)]
enum Opened {
    Missing,
    Stale { first_seen: bool },
    File { file: File, restarted: bool },
}

/// The offset/reset contract both parsers share.
trait IncrementalParser {
    fn offset(&self) -> u64;
    fn reset(&mut self);
}

impl IncrementalParser for PerfMapParser {
    fn offset(&self) -> u64 {
        PerfMapParser::offset(self)
    }
    fn reset(&mut self) {
        PerfMapParser::reset(self)
    }
}

impl IncrementalParser for JitDumpParser {
    fn offset(&self) -> u64 {
        JitDumpParser::offset(self)
    }
    fn reset(&mut self) {
        JitDumpParser::reset(self)
    }
}

/// Managed symbols of one process, kept in sync with its perf files.
#[derive(Debug)]
pub struct ManagedSymbols {
    location: TargetLocation,
    paths: PerfFilePaths,
    config: ManagedSymbolsConfig,
    perf_map: PerfMapParser,
    perf_map_file: TrackedFile,
    jitdump: JitDumpParser,
    jitdump_file: TrackedFile,
    /// Whether the jitdump was written to since its last read.
    jitdump_watch: WatchedPerfFile,
    /// The index and the interner, shared with the budget that may drop them.
    tables: Arc<Mutex<SymbolTables>>,
    /// The budget charged, and this process's place in it.
    budget: Option<(ManagedSymbolBudget, u64)>,
    io: FileIoCounters,
    read_buf: Vec<u8>,
}

/// What a [`ManagedSymbolBudget`] may drop: everything read from the files.
#[derive(Debug, Default)]
struct SymbolTables {
    index: JitCodeIndex,
    interner: SymbolInterner,
    /// The process's ReadyToRun code named in the run's shared tables, when
    /// it was given them ([`ManagedSymbols::share_image_code`]).
    images: Option<ProcessImageCode>,
    /// The runtime's stub blocks, compact.
    stubs: StubIndex,
    /// Dropped by the budget since the last refresh: the files are read
    /// again from the start.
    evicted: bool,
}

impl SymbolTables {
    fn memory_bytes(&self) -> u64 {
        let images = self
            .images
            .as_ref()
            .map_or(0, ProcessImageCode::memory_bytes);
        self.index.memory_bytes()
            + self.interner.memory_bytes()
            + self.stubs.memory_bytes()
            + images
    }
}

fn lock_tables(tables: &Mutex<SymbolTables>) -> MutexGuard<'_, SymbolTables> {
    // A panic while holding the lock leaves tables that are at worst
    // incomplete: still safe to read.
    tables.lock().unwrap_or_else(PoisonError::into_inner)
}

mod budget;
mod image_code;
pub use budget::{
    DEFAULT_MANAGED_SYMBOL_BUDGET_BYTES, ManagedSymbolBudget, ManagedSymbolBudgetStats,
    TYPICAL_ENTRY_BYTES,
};
mod shared_names;
mod stubs;
pub use image_code::{ImageKey, ProcessImageCode, SharedImageCode, SharedImageCodeStats};
pub use shared_names::SharedNames;
use stubs::StubIndex;

impl Drop for ManagedSymbols {
    fn drop(&mut self) {
        if let Some((budget, id)) = &self.budget {
            budget.leave(*id);
        }
        // The names only this process held are freed now: forget them.
        let tables = std::mem::take(&mut *lock_tables(&self.tables));
        let names = tables.images.as_ref().map(|i| i.shared().names().clone());
        drop(tables);
        if let Some(names) = names {
            names.sweep();
        }
    }
}

/// What opening and reading the perf files went through, shared by the
/// perf map and the jitdump paths.
#[derive(Debug, Default)]
struct FileIoCounters {
    open_errors: u64,
    read_errors: u64,
    restarts: u64,
    stale_files: u64,
    last_io_error: Option<String>,
}

impl FileIoCounters {
    /// The file to read, or `None` with `refresh` saying why not.
    fn opened(
        &mut self,
        opened: Result<Opened, TargetFsError>,
        refresh: &mut FileRefresh,
    ) -> Option<File> {
        match opened {
            Ok(Opened::File { file, restarted }) => {
                refresh.restarted = restarted;
                self.restarts += u64::from(restarted);
                Some(file)
            }
            Ok(Opened::Missing) => None,
            Ok(Opened::Stale { first_seen }) => {
                self.stale_files += u64::from(first_seen);
                refresh.status = FileStatus::Stale;
                None
            }
            Err(error) => {
                self.open_errors += 1;
                self.last_io_error = Some(error.to_string());
                refresh.status = FileStatus::Failed;
                None
            }
        }
    }

    /// Records the outcome of one incremental read of `path`.
    fn read(&mut self, result: io::Result<u64>, path: &Path, refresh: &mut FileRefresh) {
        match result {
            Ok(bytes) => refresh.bytes_read = bytes,
            Err(error) => {
                self.read_errors += 1;
                self.last_io_error = Some(format!("cannot read {}: {error}", path.display()));
                refresh.status = FileStatus::Failed;
            }
        }
    }
}

impl ManagedSymbols {
    /// Symbols of live process `pid` (host pid), default bounds. Reads the
    /// process's namespace pid and environment now; no file is read before
    /// the first [`Self::refresh`].
    pub fn new(pid: u32) -> Self {
        Self::at(
            TargetLocation::of_process(pid),
            ManagedSymbolsConfig::default(),
        )
    }

    /// Symbols of live process `pid` (host pid), default bounds, charged
    /// to `budget` (one per run, shared by every process).
    pub fn with_budget(pid: u32, budget: &ManagedSymbolBudget) -> Self {
        Self::at_with_budget(
            TargetLocation::of_process(pid),
            ManagedSymbolsConfig::default(),
            budget,
        )
    }

    /// [`Self::at`], charged to `budget`. The per-file entry caps shrink
    /// to what fits in the whole budget, so one process alone cannot pass
    /// it by much (the process being charged is never the one dropped).
    pub fn at_with_budget(
        location: TargetLocation,
        mut config: ManagedSymbolsConfig,
        budget: &ManagedSymbolBudget,
    ) -> Self {
        let limit_bytes = budget.stats().limit_bytes;
        let fits = limit_bytes / TYPICAL_ENTRY_BYTES;
        config.perf_map.max_entries = config.perf_map.max_entries.min(fits);
        config.jitdump.max_code_loads = config.jitdump.max_code_loads.min(fits);
        config.max_table_bytes = config.max_table_bytes.min(limit_bytes);
        let mut symbols = Self::at(location, config);
        let id = budget.join(&symbols.tables);
        symbols.budget = Some((budget.clone(), id));
        symbols
    }

    /// Symbols of the process at `location` (a fake root in tests), not
    /// charged to any budget.
    pub fn at(location: TargetLocation, config: ManagedSymbolsConfig) -> Self {
        let paths = PerfFilePaths::new(&location);
        Self {
            location,
            paths,
            config,
            perf_map: PerfMapParser::new(config.perf_map),
            perf_map_file: TrackedFile::default(),
            jitdump: JitDumpParser::new(config.jitdump),
            jitdump_file: TrackedFile::default(),
            jitdump_watch: WatchedPerfFile::default(),
            tables: Arc::new(Mutex::new(SymbolTables::default())),
            budget: None,
            io: FileIoCounters::default(),
            read_buf: Vec::new(),
        }
    }

    pub fn location(&self) -> &TargetLocation {
        &self.location
    }

    /// Names the process's ReadyToRun code (jitdump entries inside its
    /// assembly mappings) in the run's `shared` tables instead of its own
    /// index; see [`image_code`](self::image_code). Its mappings come with
    /// [`Self::sync_mappings`].
    pub fn share_image_code(&mut self, shared: SharedImageCode) {
        let pid = self.location.pid;
        let mut tables = lock_tables(&self.tables);
        tables.interner = SymbolInterner::sharing(shared.names().clone());
        tables.images = Some(ProcessImageCode::new(pid, shared));
    }

    /// Watches the jitdump with the run's `watch`, so that
    /// [`Self::jit_code_unchanged`] can tell an idle process from one that
    /// compiles without opening its file.
    pub fn watch_files(&mut self, watch: FileWatch) {
        self.jitdump_watch = WatchedPerfFile::new(watch);
    }

    /// Whether a refresh now would find no new code for sure: the jitdump
    /// is usable and watched, was read to its end and not written since.
    /// `false` means "read to know" (no watch: the file is polled).
    pub fn jit_code_unchanged(&self) -> bool {
        self.jitdump.header().is_some()
            && self.jitdump.error().is_none()
            && !self.is_evicted()
            && self.jitdump_watch.unchanged()
    }

    /// Takes the process's assembly mappings from a new read of its
    /// mappings (for [`Self::share_image_code`]).
    pub fn sync_mappings(&mut self, mappings: &crate::process::MappingTable) {
        if let Some(images) = lock_tables(&self.tables).images.as_mut() {
            images.sync_mappings(mappings);
        }
    }

    /// The perf files' paths inside the target.
    pub fn files(&self) -> &PerfFilePaths {
        &self.paths
    }

    /// Reads what the runtime appended since the last refresh (all of it
    /// again if the budget dropped this process's tables), then charges the
    /// tables to the budget, which may drop other processes'. `now_ns` is
    /// CLOCK_MONOTONIC: the validity time of perf map lines read now.
    pub fn refresh(&mut self, now_ns: u64) -> RefreshStats {
        let tables = Arc::clone(&self.tables);
        let stats = {
            let mut tables = lock_tables(&tables);
            if std::mem::take(&mut tables.evicted) {
                self.start_over();
                if let Some((budget, _)) = &self.budget {
                    budget.count_reload();
                }
            }
            let jitdump = self.refresh_jitdump(&mut tables, now_ns);
            let jitdump_usable = self.jitdump.header().is_some() && self.jitdump.error().is_none();
            let perf_map = if jitdump_usable {
                FileRefresh {
                    status: FileStatus::NotNeeded,
                    ..FileRefresh::default()
                }
            } else {
                self.refresh_perf_map(&mut tables, now_ns)
            };
            tables.index.commit();
            tables.stubs.commit();
            RefreshStats { perf_map, jitdump }
        };
        let over = stats.perf_map.symbols_over_budget + stats.jitdump.symbols_over_budget;
        if over > 0 {
            use crate::memory_budget::{self, Drops, OverBudget};
            Drops::count(&memory_budget::drops().managed_symbols, over);
            let (pid, limit) = (self.location.pid, self.config.max_table_bytes);
            memory_budget::warn_once(pid, OverBudget::ManagedSymbols, || {
                format!(
                    "pid {pid}'s perf map or jitdump names more than the {limit} bytes of managed symbols one process may hold: later methods are unnamed"
                )
            });
        }
        self.charge();
        stats
    }

    /// Forgets how far the files were read, so the next read starts over
    /// with fresh parsers: their entry caps count what the (now empty)
    /// index holds. Their parse counts restart too.
    fn start_over(&mut self) {
        self.perf_map = PerfMapParser::new(self.config.perf_map);
        self.perf_map_file = TrackedFile::default();
        self.jitdump = JitDumpParser::new(self.config.jitdump);
        self.jitdump_file = TrackedFile::default();
    }

    fn charge(&self) {
        if let Some((budget, id)) = &self.budget {
            let bytes = lock_tables(&self.tables).memory_bytes();
            budget.charge(*id, bytes);
        }
    }

    /// Adds a method the runtime reported itself (EventPipe MethodLoad or
    /// rundown MethodDCEnd events), `raw_name` spelled like a perf map name
    /// (tier suffix included), valid from `valid_from_ns`. Returns false for
    /// a rejected range. Charged to the budget at the next refresh; the
    /// budget never drops a process holding such methods (no file could
    /// give them back).
    pub fn insert_method(
        &mut self,
        start: u64,
        size: u64,
        raw_name: &str,
        valid_from_ns: u64,
    ) -> bool {
        let inserted = {
            let mut tables = lock_tables(&self.tables);
            let SymbolTables {
                index, interner, ..
            } = &mut *tables;
            let symbol = ManagedSymbol::from_raw_name(raw_name, start, size, interner);
            index.insert(symbol, valid_from_ns)
        };
        if inserted && let Some((budget, id)) = &self.budget {
            budget.pin(*id);
        }
        inserted
    }

    /// The symbol that owned `addr` at `time_ns` (CLOCK_MONOTONIC). `None`
    /// also while the budget has dropped the tables ([`Self::is_evicted`]):
    /// [`Self::refresh`] reads them again.
    pub fn lookup(&self, addr: u64, time_ns: u64) -> Option<ManagedSymbol> {
        let found = {
            let tables = lock_tables(&self.tables);
            tables
                .index
                .lookup(addr, time_ns)
                .cloned()
                .or_else(|| tables.stubs.lookup(addr))
                .or_else(|| {
                    tables
                        .images
                        .as_ref()
                        .and_then(|images| images.lookup(addr))
                })
        };
        if let Some((budget, id)) = &self.budget {
            budget.touch(*id);
        }
        found
    }

    /// Whether the budget dropped the tables since the last refresh.
    pub fn is_evicted(&self) -> bool {
        lock_tables(&self.tables).evicted
    }

    /// Estimated heap bytes of the tables (what the budget is charged).
    pub fn memory_bytes(&self) -> u64 {
        lock_tables(&self.tables).memory_bytes()
    }

    /// The methods added since the last call (in the order added), for
    /// their unwind rows, and how many more were dropped.
    pub fn take_new_code(&mut self) -> (Vec<crate::unwind::jit_code::JitMethod>, u64) {
        lock_tables(&self.tables).index.take_new_code()
    }

    /// Symbols held, the shared ones this process declared included.
    pub fn len(&self) -> usize {
        let tables = lock_tables(&self.tables);
        let shared = tables.images.as_ref().map_or(0, ProcessImageCode::declared);
        tables.index.len() + tables.stubs.len() + usize::try_from(shared).unwrap_or(usize::MAX)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn errors(&self) -> ManagedSymbolErrors {
        let (rejected_ranges, lookup_step_limit_hits) = {
            let tables = lock_tables(&self.tables);
            (
                tables.index.rejected_ranges(),
                tables.index.lookup_step_limit_hits(),
            )
        };
        ManagedSymbolErrors {
            perf_map: self.perf_map.counts(),
            jitdump: self.jitdump.counts(),
            jitdump_stop: self.jitdump.error().cloned(),
            open_errors: self.io.open_errors,
            read_errors: self.io.read_errors,
            restarts: self.io.restarts,
            stale_files: self.io.stale_files,
            rejected_ranges,
            lookup_step_limit_hits,
            last_io_error: self.io.last_io_error.clone(),
        }
    }

    fn refresh_jitdump(&mut self, tables: &mut SymbolTables, now_ns: u64) -> FileRefresh {
        let Self {
            location,
            paths,
            config,
            jitdump,
            jitdump_file,
            jitdump_watch,
            read_buf,
            io,
            ..
        } = self;
        let SymbolTables {
            index,
            interner,
            images,
            stubs,
            ..
        } = tables;
        let mut refresh = FileRefresh::default();
        let opened = open_tracked(location, &paths.jitdump, jitdump_file, jitdump);
        let Some(file) = io.opened(opened, &mut refresh) else {
            jitdump_watch.lost();
            return refresh;
        };
        jitdump_watch.before_read(&file, jitdump_file.identity);
        if jitdump.error().is_some() {
            // Nothing after the bad record can be framed; wait for the file
            // to be replaced.
            refresh.status = FileStatus::Stopped;
            return refresh;
        }
        let result = read_incrementally(
            &file,
            jitdump,
            read_buf,
            config.max_bytes_per_refresh,
            |parser, bytes| {
                parser.feed(bytes, |load| {
                    if let Some(images) = images.as_mut()
                        && images.declare(load.code_addr, load.code_size, &load.name)
                    {
                        refresh.symbols_added += 1;
                        refresh.symbols_shared += 1;
                        return;
                    }
                    if index.memory_bytes() + stubs.memory_bytes() >= config.max_table_bytes {
                        refresh.symbols_over_budget += 1;
                        return;
                    }
                    if stubs.insert(load.code_addr, load.code_size, &load.name) {
                        refresh.symbols_added += 1;
                        return;
                    }
                    let valid_from = if load.monotonic_time {
                        load.timestamp_ns
                    } else {
                        now_ns
                    };
                    let symbol = ManagedSymbol::from_raw_name(
                        &load.name,
                        load.code_addr,
                        load.code_size,
                        interner,
                    );
                    refresh.symbols_added += u64::from(index.insert(symbol, valid_from));
                })
            },
        );
        refresh.status = if jitdump.error().is_some() {
            FileStatus::Stopped
        } else {
            FileStatus::Read
        };
        io.read(result, &paths.jitdump, &mut refresh);
        jitdump_watch.after_read(
            refresh.status == FileStatus::Read && refresh.bytes_read < config.max_bytes_per_refresh,
        );
        refresh
    }

    fn refresh_perf_map(&mut self, tables: &mut SymbolTables, now_ns: u64) -> FileRefresh {
        let Self {
            location,
            paths,
            config,
            perf_map,
            perf_map_file,
            read_buf,
            io,
            ..
        } = self;
        let SymbolTables {
            index, interner, ..
        } = tables;
        let mut refresh = FileRefresh::default();
        let mut opened = open_tracked(location, &paths.perf_map, perf_map_file, perf_map);
        // Look in the legacy directory while the perf map was never found.
        if let Some(legacy) = &paths.legacy_perf_map
            && perf_map_file.identity.is_none()
            && matches!(opened, Ok(Opened::Missing | Opened::Stale { .. }))
        {
            let mut legacy_file = TrackedFile::default();
            let in_legacy = open_tracked(location, legacy, &mut legacy_file, perf_map);
            if matches!(in_legacy, Ok(Opened::File { .. })) {
                paths.switch_to_legacy();
                *perf_map_file = legacy_file;
                opened = in_legacy;
            }
        }
        let Some(file) = io.opened(opened, &mut refresh) else {
            return refresh;
        };
        let result = read_incrementally(
            &file,
            perf_map,
            read_buf,
            config.max_bytes_per_refresh,
            |parser, bytes| {
                let (added, over) = ingest_perf_map(
                    parser,
                    index,
                    interner,
                    bytes,
                    now_ns,
                    config.max_table_bytes,
                );
                refresh.symbols_added += added;
                refresh.symbols_over_budget += over;
            },
        );
        refresh.status = FileStatus::Read;
        io.read(result, &paths.perf_map, &mut refresh);
        refresh
    }
}

/// Parses perf map bytes into the index while it holds less than
/// `max_table_bytes`; returns the symbols added and those dropped.
fn ingest_perf_map(
    parser: &mut PerfMapParser,
    index: &mut JitCodeIndex,
    interner: &mut SymbolInterner,
    bytes: &[u8],
    now_ns: u64,
    max_table_bytes: u64,
) -> (u64, u64) {
    let (mut added, mut over) = (0, 0);
    parser.feed(bytes, |entry| {
        if index.memory_bytes() >= max_table_bytes {
            over += 1;
            return;
        }
        let symbol = ManagedSymbol::from_raw_name(&entry.name, entry.start, entry.size, interner);
        added += u64::from(index.insert(symbol, now_ns));
    });
    (added, over)
}

/// Opens a perf file and decides whether its parser must start over.
fn open_tracked(
    location: &TargetLocation,
    path: &Path,
    tracked: &mut TrackedFile,
    parser: &mut impl IncrementalParser,
) -> Result<Opened, TargetFsError> {
    let root = &location.root;
    let file = match target_fs::open_in_root_dir(root, path) {
        Ok(file) => file,
        Err(error) if error.is_not_found() => return Ok(Opened::Missing),
        Err(error) => return Err(error),
    };
    // Checked on the open file, before a byte is read.
    let owner = file.metadata().map(|m| m.uid()).ok();
    let expected = location.owner.as_ref().map(|o| o.uid);
    if owner.is_none() || owner != expected {
        return Err(TargetFsError::NotOwned {
            root: root.to_owned(),
            path: path.to_owned(),
            owner,
            expected,
        });
    }
    let open_error = |source: io::Error| TargetFsError::Open {
        root: root.to_owned(),
        path: path.to_owned(),
        source,
    };
    let metadata = file.metadata().map_err(open_error)?;
    let identity = (metadata.dev(), metadata.ino());
    if let (Some(started), Ok(modified)) = (location.started_at, metadata.modified())
        && modified
            .checked_add(STALE_FILE_SLACK)
            .is_some_and(|m| m < started)
    {
        let first_seen = tracked.stale != Some(identity);
        tracked.stale = Some(identity);
        return Ok(Opened::Stale { first_seen });
    }
    let mut prefix = [0u8; FINGERPRINT_LEN];
    let prefix_len = read_prefix(&file, &mut prefix).map_err(open_error)?;
    let prefix = &prefix[..prefix_len];
    let common = prefix.len().min(tracked.fingerprint.len());
    let replaced = tracked.identity.is_some_and(|known| known != identity)
        || metadata.len() < parser.offset()
        || prefix[..common] != tracked.fingerprint[..common];
    if replaced {
        parser.reset();
    }
    tracked.identity = Some(identity);
    if replaced || prefix.len() > tracked.fingerprint.len() {
        tracked.fingerprint = prefix.to_vec();
    }
    Ok(Opened::File {
        file,
        restarted: replaced,
    })
}

fn read_prefix(file: &File, prefix: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < prefix.len() {
        match file.read_at(&mut prefix[filled..], filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(filled)
}

/// Reads `file` from `parser`'s offset in chunks and feeds each one, until
/// the end, `max_bytes`, or the parser stops consuming. Returns the bytes read.
fn read_incrementally<P: IncrementalParser>(
    file: &File,
    parser: &mut P,
    buf: &mut Vec<u8>,
    max_bytes: u64,
    mut feed: impl FnMut(&mut P, &[u8]),
) -> io::Result<u64> {
    // An idle process's files do not grow: one fstat says so, where a read
    // would first zero a chunk of buffer for nothing.
    let len = file.metadata()?.len();
    let mut total = 0u64;
    while total < max_bytes && parser.offset() < len {
        buf.clear();
        let before = parser.offset();
        // No more than the file holds past the parser: the buffer is
        // zeroed up to what is asked for, and a few new lines must not
        // cost a chunk's worth of fresh pages every refresh.
        let left = (max_bytes - total).min(len - before);
        let want = usize::try_from(left).map_or(READ_CHUNK, |left| left.min(READ_CHUNK));
        let n = target_fs::read_from_offset(file, before, buf, want)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        feed(parser, buf);
        if parser.offset() != before + n as u64 {
            break; // a stopped parser consumes nothing: do not spin
        }
    }
    // The buffer of a big first read would otherwise stay with the process
    // for its life: about 1 MiB per .NET process on a node of them.
    if buf.capacity() > KEPT_READ_BUFFER {
        *buf = Vec::new();
    }
    Ok(total)
}

/// The perf map benchmark and the synthetic perf map it loads (also the
/// input of the unit tests here).
#[cfg(any(test, feature = "bench"))]
pub mod bench;

#[cfg(test)]
mod watch_tests;

#[cfg(test)]
mod tests {
    use super::bench::{bench_perf_map_load, synthetic_perf_map};
    use super::*;
    use std::io::Write;

    #[test]
    fn split_tier_strips_only_tiers() {
        let cases = [
            (
                "int64 [Hot] Hot::Spin(int64)[QuickJitted]",
                ("int64 [Hot] Hot::Spin(int64)", Some("QuickJitted")),
            ),
            (
                "int64 [App] Hot::Spin(int64)[OptimizedTier1OSR]",
                ("int64 [App] Hot::Spin(int64)", Some("OptimizedTier1OSR")),
            ),
            (
                "void [System.Private.CoreLib] System.AppContext::Setup(char**,char**,int32)[PreJIT]",
                (
                    "void [System.Private.CoreLib] System.AppContext::Setup(char**,char**,int32)",
                    Some("PreJIT"),
                ),
            ),
            ("f()[PreJit-cold]", ("f()", Some("PreJit-cold"))),
            ("f()[FutureTier2]", ("f()", Some("FutureTier2"))),
            // A known tier after a name that does not end in ')'.
            ("odd[Optimized]", ("odd", Some("Optimized"))),
            // Not tiers.
            (
                "stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>",
                ("stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>", None),
            ),
            ("Foo`1[System.__Canon]", ("Foo`1[System.__Canon]", None)),
            ("f()[two words]", ("f()[two words]", None)),
            ("f()[]", ("f()[]", None)),
            ("[QuickJitted]", ("[QuickJitted]", None)),
            ("x]", ("x]", None)),
            ("", ("", None)),
            ("f()[Tier\u{e9}]", ("f()[Tier\u{e9}]", None)),
        ];
        for (raw, want) in cases {
            assert_eq!(split_tier(raw), want, "{raw}");
        }
    }

    #[test]
    fn assembly_is_the_bracket_before_the_type() {
        let cases = [
            ("int64 [Hot] Hot::Spin(int64)", Some("Hot")),
            (
                "instance void [System.Private.CoreLib] System.Collections.Generic.Dictionary`2[System.__Canon,System.__Canon]::.ctor(int32)",
                Some("System.Private.CoreLib"),
            ),
            (
                "valuetype System.ReadOnlySpan`1<!!1> [System.Private.CoreLib] System.Runtime.InteropServices.MemoryMarshal::Cast(valuetype System.ReadOnlySpan`1<!!0>)",
                Some("System.Private.CoreLib"),
            ),
            (
                "class [System.Runtime]System.String [App] App::Name(class [System.Runtime]System.Object)",
                Some("App"),
            ),
            ("int32[] [App] Hot::Arr(int32)", Some("App")),
            ("[Lead] X::Y()", Some("Lead")),
            ("stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>", None),
            ("f(class [A] B)", None),
            ("x [unterminated", None),
            ("x [] y()", None),
        ];
        for (name, want) in cases {
            assert_eq!(assembly_of(name), want, "{name}");
        }
    }

    #[test]
    fn symbol_from_a_real_name() {
        let mut interner = SymbolInterner::default();
        let symbol = ManagedSymbol::from_raw_name(
            "int64 [Hot] Hot::Spin(int64)[QuickJitted]",
            0x7f3684c12170,
            0x9a,
            &mut interner,
        );
        assert_eq!(&*symbol.name, "int64 [Hot] Hot::Spin(int64)");
        assert_eq!(symbol.jit_tier.as_deref(), Some("QuickJitted"));
        assert_eq!(
            &*symbol.raw_name,
            "int64 [Hot] Hot::Spin(int64)[QuickJitted]"
        );
        assert_eq!(symbol.assembly.as_deref(), Some("Hot"));
        assert!(!symbol.is_stub);
        assert_eq!(symbol.end(), 0x7f3684c1220a);
        let stub = ManagedSymbol::from_raw_name(
            "stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>",
            0x7f3684b50000,
            0xd8,
            &mut interner,
        );
        assert!(stub.is_stub);
        assert!(Arc::ptr_eq(&stub.name, &stub.raw_name));
        assert_eq!(stub.jit_tier, None);
        let other = ManagedSymbol::from_raw_name(
            "void [Hot] Hot::Main()[QuickJitted]",
            1,
            1,
            &mut interner,
        );
        let (Some(a), Some(b)) = (&symbol.jit_tier, &other.jit_tier) else {
            panic!("tiers expected");
        };
        assert!(Arc::ptr_eq(a, b), "tiers are interned");
    }

    /// A fake target: `<root>/tmp` with writable perf files.
    pub(super) struct Target {
        _dir: tempfile::TempDir,
        pub(super) location: TargetLocation,
    }

    impl Target {
        pub(super) fn new() -> Self {
            let dir = tempfile::tempdir().expect("temp dir");
            let root = dir.path().join("root");
            std::fs::create_dir_all(root.join("tmp")).expect("mkdir");
            Self {
                _dir: dir,
                location: TargetLocation {
                    pid: 4242,
                    ns_pid: 7,
                    root,
                    perf_dir: PathBuf::from("/tmp"),
                    legacy_perf_map_dir: PathBuf::from("/tmp"),
                    owner: Some(FsIdentity::current()),
                    started_at: None,
                },
            }
        }

        fn host_path(&self, name: &str) -> PathBuf {
            self.location.root.join("tmp").join(name)
        }

        pub(super) fn append(&self, name: &str, bytes: &[u8]) {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.host_path(name))
                .expect("open");
            file.write_all(bytes).expect("write");
        }

        fn symbols(&self) -> ManagedSymbols {
            ManagedSymbols::at(self.location.clone(), ManagedSymbolsConfig::default())
        }
    }

    /// First stub and first method of [`synthetic_perf_map`].
    const SYNTHETIC_STUB: u64 = 0x7f5c_2d98_0000;
    const SYNTHETIC_METHOD: u64 = 0x7f5c_2da4_0000;

    fn synthetic_targets(n: usize, entries: usize) -> Vec<Target> {
        let map = synthetic_perf_map(entries);
        (0..n)
            .map(|_| {
                let target = Target::new();
                target.append("perf-7.map", &map);
                target
            })
            .collect()
    }

    fn perf_map_config(entries: usize) -> ManagedSymbolsConfig {
        ManagedSymbolsConfig {
            perf_map: PerfMapLimits {
                max_entries: entries as u64,
                ..PerfMapLimits::default()
            },
            ..ManagedSymbolsConfig::default()
        }
    }

    #[test]
    fn many_large_perf_maps_stay_within_the_budget() {
        const ENTRIES: usize = 20_000;
        let targets = synthetic_targets(8, ENTRIES);
        // One process's tables, measured without a budget.
        let mut alone = ManagedSymbols::at(targets[0].location.clone(), perf_map_config(ENTRIES));
        alone.refresh(1);
        let one = alone.memory_bytes();
        assert!(
            one > (ENTRIES * 100) as u64,
            "{one} bytes for {ENTRIES} entries"
        );
        // Room for about two and a half processes.
        let budget = ManagedSymbolBudget::new(one * 5 / 2);
        let mut all: Vec<ManagedSymbols> = targets
            .iter()
            .map(|t| {
                ManagedSymbols::at_with_budget(
                    t.location.clone(),
                    perf_map_config(ENTRIES),
                    &budget,
                )
            })
            .collect();
        for (i, symbols) in all.iter_mut().enumerate() {
            symbols.refresh(10 + i as u64);
            assert_eq!(symbols.len(), ENTRIES);
            let stats = budget.stats();
            assert!(stats.used_bytes <= stats.limit_bytes, "{stats:?}");
        }
        let stats = budget.stats();
        let held: u64 = all.iter().map(ManagedSymbols::memory_bytes).sum();
        assert_eq!(stats.used_bytes, held, "the book matches the tables");
        assert_eq!(stats.processes, 8);
        assert_eq!(stats.evictions, 6, "{stats:?}");
        assert!(stats.peak_bytes <= stats.limit_bytes);
        // The least recently used went first: the last two are whole.
        let evicted: Vec<bool> = all.iter().map(ManagedSymbols::is_evicted).collect();
        assert_eq!(evicted, [true, true, true, true, true, true, false, false]);
        assert!(all[7].lookup(SYNTHETIC_STUB + 1, 0).is_some());
        assert!(all[0].lookup(SYNTHETIC_STUB + 1, 0).is_none());
        drop(all);
        let stats = budget.stats();
        assert_eq!((stats.used_bytes, stats.processes), (0, 0));
    }

    #[test]
    fn an_evicted_process_resolves_again_after_a_refresh() {
        const ENTRIES: usize = 5_000;
        let targets = synthetic_targets(3, ENTRIES);
        let mut probe = ManagedSymbols::at(targets[0].location.clone(), perf_map_config(ENTRIES));
        probe.refresh(1);
        // Room for one process, not two.
        let budget = ManagedSymbolBudget::new(probe.memory_bytes() * 3 / 2);
        let mut all: Vec<ManagedSymbols> = targets
            .iter()
            .map(|t| {
                ManagedSymbols::at_with_budget(
                    t.location.clone(),
                    perf_map_config(ENTRIES),
                    &budget,
                )
            })
            .collect();
        all[0].refresh(1);
        let method = all[0].lookup(SYNTHETIC_METHOD + 1, 1).expect("a method");
        // Charging the second drops the first.
        all[1].refresh(2);
        assert!(all[0].is_evicted());
        assert!(all[0].lookup(SYNTHETIC_METHOD + 1, 1).is_none());
        assert_eq!(all[0].len(), 0);
        all[0].refresh(3);
        assert!(!all[0].is_evicted());
        assert_eq!(all[0].len(), ENTRIES, "the whole perf map was read again");
        assert_eq!(all[0].lookup(SYNTHETIC_METHOD + 1, 1), Some(method));
        assert!(all[1].is_evicted());
        let stats = budget.stats();
        assert_eq!(stats.evictions, 2);
        assert_eq!(stats.reloads, 1);
        assert!(stats.evicted_bytes > 0);
        // A lookup counts as use: the one looked up outlives the other.
        all[2].refresh(4);
        assert!(all[0].is_evicted());
        all[1].refresh(5);
        all[2].refresh(6);
        let _ = all[2].lookup(SYNTHETIC_METHOD + 1, 1);
        all[0].refresh(7);
        assert!(all[1].is_evicted() && all[2].is_evicted());
        assert_eq!(budget.stats().used_bytes, all[0].memory_bytes());
    }

    #[test]
    fn a_process_with_methods_from_events_is_never_dropped() {
        const ENTRIES: usize = 2_000;
        let targets = synthetic_targets(2, ENTRIES);
        let budget = ManagedSymbolBudget::new(1 << 20);
        let mut from_events = ManagedSymbols::at_with_budget(
            targets[0].location.clone(),
            perf_map_config(ENTRIES),
            &budget,
        );
        assert!(from_events.insert_method(0x1000, 0x10, "void [A] A::B()[PreJIT]", 0));
        from_events.refresh(1);
        let mut other = ManagedSymbols::at_with_budget(
            targets[1].location.clone(),
            perf_map_config(ENTRIES),
            &budget,
        );
        other.refresh(2);
        other.refresh(3);
        assert!(!from_events.is_evicted());
        assert!(from_events.lookup(0x1008, 1).is_some());
    }

    #[test]
    fn lookups_mark_a_process_as_used() {
        const ENTRIES: usize = 2_000;
        let targets = synthetic_targets(3, ENTRIES);
        let mut probe = ManagedSymbols::at(targets[0].location.clone(), perf_map_config(ENTRIES));
        probe.refresh(1);
        // Room for two processes, not three.
        let budget = ManagedSymbolBudget::new(probe.memory_bytes() * 5 / 2);
        let mut all: Vec<ManagedSymbols> = targets
            .iter()
            .map(|t| {
                ManagedSymbols::at_with_budget(
                    t.location.clone(),
                    perf_map_config(ENTRIES),
                    &budget,
                )
            })
            .collect();
        all[0].refresh(1);
        all[1].refresh(2);
        assert!(all[0].lookup(SYNTHETIC_STUB, 1).is_some());
        all[2].refresh(3);
        assert!(!all[0].is_evicted(), "looked up after the second was read");
        assert!(all[1].is_evicted());
    }

    pub(super) fn jitdump_header() -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&0x4A69_5444u32.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&40u32.to_le_bytes());
        out.extend_from_slice(&62u32.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&7u32.to_le_bytes());
        out.extend_from_slice(&1000u64.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out
    }

    pub(super) fn code_load(timestamp_ns: u64, addr: u64, code_size: u64, name: &str) -> Vec<u8> {
        let total = 56 + name.len() + 1 + code_size as usize;
        let mut out = Vec::new();
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(total as u32).to_le_bytes());
        out.extend_from_slice(&timestamp_ns.to_le_bytes());
        out.extend_from_slice(&7u32.to_le_bytes());
        out.extend_from_slice(&8u32.to_le_bytes());
        out.extend_from_slice(&addr.to_le_bytes());
        out.extend_from_slice(&addr.to_le_bytes());
        out.extend_from_slice(&code_size.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.resize(total, 0xcc);
        out
    }

    fn lookup_name(symbols: &ManagedSymbols, addr: u64, time: u64) -> Option<String> {
        symbols.lookup(addr, time).map(|s| s.raw_name.to_string())
    }

    #[test]
    fn missing_files_are_not_errors() {
        let target = Target::new();
        let mut symbols = target.symbols();
        let stats = symbols.refresh(1);
        assert_eq!(stats.perf_map.status, FileStatus::Missing);
        assert_eq!(stats.jitdump.status, FileStatus::Missing);
        assert_eq!(symbols.errors(), ManagedSymbolErrors::default());
        assert_eq!(symbols.files().perf_map, Path::new("/tmp/perf-7.map"));
        assert_eq!(symbols.files().jitdump, Path::new("/tmp/jit-7.dump"));
        // A process that is gone: its root does not exist either.
        let mut gone = ManagedSymbols::at(
            TargetLocation {
                root: target.location.root.join("nope"),
                ..target.location.clone()
            },
            ManagedSymbolsConfig::default(),
        );
        assert_eq!(gone.refresh(1).perf_map.status, FileStatus::Missing);
    }

    #[test]
    fn perf_map_lines_are_read_incrementally_and_stamped_when_read() {
        let target = Target::new();
        let mut symbols = target.symbols();
        target.append(
            "perf-7.map",
            b"0x1000 10 void [A] A::F()[QuickJitted]\n0x2000 10 void [A] A::",
        );
        let stats = symbols.refresh(100);
        assert_eq!(stats.perf_map.status, FileStatus::Read);
        assert_eq!(stats.perf_map.symbols_added, 1);
        assert_eq!(
            lookup_name(&symbols, 0x1005, 100).as_deref(),
            Some("void [A] A::F()[QuickJitted]")
        );
        assert_eq!(
            lookup_name(&symbols, 0x2005, 100),
            None,
            "partial line waits"
        );
        target.append("perf-7.map", b"G()[OptimizedTier1]\n");
        let stats = symbols.refresh(200);
        assert_eq!(stats.perf_map.symbols_added, 1);
        assert_eq!(stats.perf_map.bytes_read, 20);
        let g = symbols.lookup(0x2005, 300).expect("G");
        assert_eq!(&*g.name, "void [A] A::G()");
        assert_eq!(g.jit_tier.as_deref(), Some("OptimizedTier1"));
        // Re-JIT of F at G's freed address, read at t=300.
        target.append("perf-7.map", b"0x2000 8 void [A] A::F()[OptimizedTier1]\n");
        symbols.refresh(300);
        assert_eq!(
            lookup_name(&symbols, 0x2005, 250).as_deref(),
            Some("void [A] A::G()[OptimizedTier1]")
        );
        assert_eq!(
            lookup_name(&symbols, 0x2005, 300).as_deref(),
            Some("void [A] A::F()[OptimizedTier1]")
        );
        // Before anything was read: the oldest entry.
        assert_eq!(
            lookup_name(&symbols, 0x2005, 5).as_deref(),
            Some("void [A] A::G()[OptimizedTier1]")
        );
        assert_eq!(symbols.len(), 3);
        assert_eq!(symbols.refresh(400).perf_map.bytes_read, 0);
    }

    #[test]
    fn jitdump_is_preferred_and_uses_its_timestamps() {
        let target = Target::new();
        let mut symbols = target.symbols();
        target.append("perf-7.map", b"0x1000 10 from perf map()\n");
        let mut dump = jitdump_header();
        dump.extend(code_load(
            5_000,
            0x1000,
            0x10,
            "void [A] A::F()[QuickJitted]",
        ));
        dump.extend(code_load(6_000, 0x3000, 0x10, "void [B] B::R2R()[PreJIT]"));
        target.append("jit-7.dump", &dump[..dump.len() - 3]);
        let stats = symbols.refresh(1_000_000);
        assert_eq!(stats.jitdump.status, FileStatus::Read);
        assert_eq!(
            stats.jitdump.symbols_added, 2,
            "the name is complete, code bytes may lag"
        );
        assert_eq!(stats.perf_map.status, FileStatus::NotNeeded);
        let f = symbols.lookup(0x1008, 5_000).expect("F");
        assert_eq!(&*f.name, "void [A] A::F()");
        let r2r = symbols.lookup(0x3000, 7_000).expect("R2R");
        assert_eq!(r2r.jit_tier.as_deref(), Some("PreJIT"));
        assert_eq!(r2r.assembly.as_deref(), Some("B"));
        target.append("jit-7.dump", &dump[dump.len() - 3..]);
        // Same address reused later.
        target.append(
            "jit-7.dump",
            &code_load(9_000, 0x1000, 0x10, "void [A] A::H()[QuickJitted]"),
        );
        let stats = symbols.refresh(2_000_000);
        assert_eq!(stats.jitdump.symbols_added, 1);
        assert_eq!(
            lookup_name(&symbols, 0x1008, 8_999).as_deref(),
            Some("void [A] A::F()[QuickJitted]")
        );
        assert_eq!(
            lookup_name(&symbols, 0x1008, 9_000).as_deref(),
            Some("void [A] A::H()[QuickJitted]")
        );
        assert_eq!(
            symbols.errors().perf_map,
            PerfMapCounts::default(),
            "perf map not read"
        );
    }

    #[test]
    fn a_corrupt_jitdump_falls_back_to_the_perf_map() {
        let target = Target::new();
        let mut symbols = target.symbols();
        let mut dump = jitdump_header();
        dump.extend(code_load(
            5_000,
            0x1000,
            0x10,
            "void [A] A::F()[QuickJitted]",
        ));
        let mut bad = code_load(6_000, 0x2000, 0x10, "void [A] A::G()[QuickJitted]");
        bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        dump.extend(bad);
        target.append("jit-7.dump", &dump);
        target.append(
            "perf-7.map",
            b"0x1000 10 void [A] A::F()[QuickJitted]\n0x2000 10 void [A] A::G()[QuickJitted]\n",
        );
        let stats = symbols.refresh(10_000);
        assert_eq!(stats.jitdump.status, FileStatus::Stopped);
        assert_eq!(stats.jitdump.symbols_added, 1);
        assert_eq!(stats.perf_map.status, FileStatus::Read);
        assert_eq!(stats.perf_map.symbols_added, 2);
        assert!(matches!(
            symbols.errors().jitdump_stop,
            Some(JitDumpError::RecordTooLarge { .. })
        ));
        // F keeps its jitdump time; G comes from the perf map.
        assert_eq!(symbols.lookup(0x1000, 5_000).map(|s| s.start), Some(0x1000));
        assert_eq!(
            lookup_name(&symbols, 0x2000, 20_000).as_deref(),
            Some("void [A] A::G()[QuickJitted]")
        );
        // Stopped stays stopped (no spinning on the same bytes).
        let stats = symbols.refresh(20_000);
        assert_eq!(stats.jitdump.status, FileStatus::Stopped);
        assert_eq!(stats.jitdump.bytes_read, 0);
    }

    #[test]
    fn a_replaced_or_truncated_file_is_parsed_again() {
        let target = Target::new();
        let mut symbols = target.symbols();
        target.append("perf-7.map", b"0x1000 10 first()\n0x1100 10 second()\n");
        symbols.refresh(100);
        // Rewritten shorter (truncated), then a new file (new inode).
        std::fs::write(target.host_path("perf-7.map"), b"0x5000 10 third()\n").expect("write");
        let stats = symbols.refresh(200);
        assert!(stats.perf_map.restarted);
        assert_eq!(
            lookup_name(&symbols, 0x5000, 200).as_deref(),
            Some("third()")
        );
        std::fs::remove_file(target.host_path("perf-7.map")).expect("rm");
        target.append(
            "perf-7.map",
            b"0x6000 10 fourth()\n0x7000 10 fifth()\n0x8000 10 sixth()\n",
        );
        let stats = symbols.refresh(300);
        assert!(stats.perf_map.restarted);
        assert_eq!(stats.perf_map.symbols_added, 3);
        // Same length or longer but different first bytes.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(target.host_path("perf-7.map"))
            .expect("open");
        file.write_all(
            b"0x9000 10 other1()\n0x9100 10 other2()\n0x9200 10 other3()\n0x9300 10 x()\n",
        )
        .expect("write");
        let stats = symbols.refresh(400);
        assert!(stats.perf_map.restarted);
        assert_eq!(stats.perf_map.symbols_added, 4);
        assert_eq!(symbols.errors().restarts, 3);
        // Old entries stay for the time they were valid.
        assert_eq!(
            lookup_name(&symbols, 0x1000, 150).as_deref(),
            Some("first()")
        );
    }

    #[test]
    fn a_removed_jitdump_is_reported_missing_and_read_again_when_recreated() {
        // Another recorder attached to the same process ends: it turns the
        // runtime's perf maps off and removes the files under this reader.
        let target = Target::new();
        let mut symbols = target.symbols();
        let mut bytes = jitdump_header();
        bytes.extend(code_load(
            100,
            0x1000,
            16,
            "void [A] A::F()[OptimizedTier1]",
        ));
        target.append("jit-7.dump", &bytes);
        assert_eq!(symbols.refresh(200).jitdump.symbols_added, 1);
        std::fs::remove_file(target.host_path("jit-7.dump")).expect("rm");
        let stats = symbols.refresh(300);
        assert_eq!(
            stats.jitdump.status,
            FileStatus::Missing,
            "what the pipeline re-enables on"
        );
        // Turned on again: a new file with every method replayed.
        let mut bytes = jitdump_header();
        bytes.extend(code_load(
            400,
            0x1000,
            16,
            "void [A] A::F()[OptimizedTier1]",
        ));
        bytes.extend(code_load(
            400,
            0x2000,
            16,
            "void [A] A::G()[OptimizedTier1]",
        ));
        target.append("jit-7.dump", &bytes);
        let stats = symbols.refresh(500);
        assert!(stats.jitdump.restarted);
        assert_eq!(stats.jitdump.symbols_added, 2);
        assert_eq!(
            lookup_name(&symbols, 0x2000, 500).as_deref(),
            Some("void [A] A::G()[OptimizedTier1]")
        );
    }

    #[test]
    fn a_symlinked_perf_map_is_not_followed() {
        let target = Target::new();
        let outside = target
            .location
            .root
            .parent()
            .expect("parent")
            .join("outside.map");
        std::fs::write(&outside, b"0x1000 10 secret()\n").expect("write");
        std::os::unix::fs::symlink(&outside, target.host_path("perf-7.map")).expect("symlink");
        let mut symbols = target.symbols();
        let stats = symbols.refresh(1);
        assert_eq!(stats.perf_map.status, FileStatus::Failed);
        assert!(symbols.lookup(0x1000, 1).is_none());
        let errors = symbols.errors();
        assert_eq!(errors.open_errors, 1);
        assert!(errors.last_io_error.is_some());
    }

    #[test]
    fn the_byte_bound_spreads_a_big_file_over_refreshes() {
        let target = Target::new();
        let config = ManagedSymbolsConfig {
            max_bytes_per_refresh: 10,
            ..ManagedSymbolsConfig::default()
        };
        let mut symbols = ManagedSymbols::at(target.location.clone(), config);
        target.append("perf-7.map", b"0x1000 10 a()\n0x2000 10 b()\n");
        assert_eq!(symbols.refresh(1).perf_map.bytes_read, 10);
        assert_eq!(symbols.refresh(2).perf_map.symbols_added, 1);
        assert_eq!(symbols.refresh(3).perf_map.symbols_added, 1);
        assert_eq!(symbols.len(), 2);
    }

    #[test]
    fn one_process_of_long_names_is_bounded_in_bytes() {
        let target = Target::new();
        let config = ManagedSymbolsConfig {
            max_table_bytes: 256 << 10,
            ..ManagedSymbolsConfig::default()
        };
        let mut symbols = ManagedSymbols::at(target.location.clone(), config);
        // 1,000 distinct names of 4 KiB: about 8 MiB held without the bound.
        let text: String = (0..1000)
            .map(|i| format!("{:x} 10 M{i}{}()\n", 0x1000 + i * 0x10, "x".repeat(4096)))
            .collect();
        target.append("perf-7.map", text.as_bytes());
        let refresh = symbols.refresh(1).perf_map;
        assert!(refresh.symbols_over_budget > 900, "{refresh:?}");
        assert_eq!(refresh.symbols_added + refresh.symbols_over_budget, 1000);
        // The entry that crossed the bound is kept whole.
        assert!(
            symbols.memory_bytes() < (256 << 10) + (64 << 10),
            "{}",
            symbols.memory_bytes()
        );
    }

    #[test]
    fn perf_map_of_an_older_runtime_is_found_in_tmpdir() {
        let mut target = Target::new();
        std::fs::create_dir_all(target.location.root.join("var/tmp")).expect("mkdir");
        target.location.legacy_perf_map_dir = PathBuf::from("/var/tmp");
        let mut symbols = target.symbols();
        assert_eq!(
            symbols.files().legacy_perf_map.as_deref(),
            Some(Path::new("/var/tmp/perf-7.map"))
        );
        assert_eq!(symbols.refresh(1).perf_map.status, FileStatus::Missing);
        // .NET Core 3.1 writes upper-case addresses without 0x.
        std::fs::write(
            target.location.root.join("var/tmp/perf-7.map"),
            b"00007F7ECE058150 24 int64 [App] Hot::Spin(int64)[Optimized]\n",
        )
        .expect("write");
        let stats = symbols.refresh(2);
        assert_eq!(stats.perf_map.symbols_added, 1);
        assert_eq!(symbols.files().perf_map, Path::new("/var/tmp/perf-7.map"));
        assert_eq!(
            symbols.files().perfinfo,
            Path::new("/var/tmp/perfinfo-7.map")
        );
        assert_eq!(symbols.files().legacy_perf_map, None);
        let spin = symbols.lookup(0x7F7ECE058160, 2).expect("Spin");
        assert_eq!(spin.jit_tier.as_deref(), Some("Optimized"));
        // The choice sticks: a later file in /tmp is not read.
        target.append("perf-7.map", b"0x1000 10 other()\n");
        assert_eq!(symbols.refresh(3).perf_map.bytes_read, 0);
    }

    #[test]
    fn files_left_by_an_earlier_process_are_ignored() {
        let mut target = Target::new();
        target.append("perf-7.map", b"0x1000 10 old()\n");
        let mut dump = jitdump_header();
        dump.extend(code_load(5, 0x1000, 0x10, "old()"));
        target.append("jit-7.dump", &dump);
        let long_ago = SystemTime::now() - Duration::from_secs(3600);
        for name in ["perf-7.map", "jit-7.dump"] {
            File::options()
                .write(true)
                .open(target.host_path(name))
                .expect("open")
                .set_modified(long_ago)
                .expect("set mtime");
        }
        target.location.started_at = Some(SystemTime::now() - Duration::from_secs(10));
        let mut symbols = target.symbols();
        let stats = symbols.refresh(1);
        assert_eq!(stats.jitdump.status, FileStatus::Stale);
        assert_eq!(stats.perf_map.status, FileStatus::Stale);
        assert!(symbols.is_empty());
        symbols.refresh(2);
        assert_eq!(symbols.errors().stale_files, 2, "each file counted once");
        // The new process enables perf maps later: the file is rewritten.
        std::fs::write(target.host_path("perf-7.map"), b"0x2000 10 new()\n").expect("write");
        let stats = symbols.refresh(3);
        assert_eq!(stats.perf_map.symbols_added, 1);
        assert_eq!(lookup_name(&symbols, 0x2000, 3).as_deref(), Some("new()"));
        assert!(symbols.lookup(0x1000, 3).is_none());
    }

    #[test]
    fn perf_files_of_another_owner_are_not_read() {
        let mut target = Target::new();
        target.append("perf-7.map", b"0x1000 10 secret()\n");
        target.location.owner = Some(FsIdentity {
            uid: FsIdentity::current().uid.wrapping_add(1),
            ..FsIdentity::current()
        });
        let mut symbols = target.symbols();
        let stats = symbols.refresh(1);
        assert_eq!(stats.perf_map.status, FileStatus::Failed);
        assert!(symbols.is_empty());
        let errors = symbols.errors();
        assert_eq!(errors.open_errors, 1);
        assert!(
            errors
                .last_io_error
                .as_deref()
                .is_some_and(|e| e.contains("not by the process's uid")),
            "{errors:?}"
        );
        target.location.owner = None;
        assert_eq!(
            target.symbols().refresh(1).perf_map.status,
            FileStatus::Failed
        );
    }

    #[test]
    fn synthetic_perf_map_parses_completely() {
        let text = synthetic_perf_map(1000);
        let mut parser = PerfMapParser::new(PerfMapLimits::default());
        let mut names = Vec::new();
        parser.feed(&text, |entry| names.push(entry.name.into_owned()));
        assert_eq!(names.len(), 1000);
        assert_eq!(parser.counts().malformed_lines, 0);
        assert!(
            names
                .iter()
                .any(|n| split_tier(n).1 == Some("OptimizedTier1"))
        );
        // The benchmark itself runs (its time is not asserted).
        bench_perf_map_load(1000);
    }
}
