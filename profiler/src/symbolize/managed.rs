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
use super::method_name::parse_method_name;
use super::perf_files::perf_file_names;
use super::target_fs::{self, TargetFsError};
use crate::process::{ProcFs, identity::FsIdentity};
use clrbpf_parse::jitdump::{JitDumpCounts, JitDumpError, JitDumpLimits, JitDumpParser};
use clrbpf_parse::perf_map::{PerfMapCounts, PerfMapLimits, PerfMapParser};

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
mod tests;
