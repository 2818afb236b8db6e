//! One memory budget for everything a profiled process can make clrbpf
//! hold (`--memory-budget-mb`, shared by `record` and `agent`).
//!
//! Any process on the host controls some of clrbpf's input: the text of
//! its `/proc/PID/maps` (one line per mapping, paths it chose), the files
//! it maps executable (sparse files cost it nothing on disk), its perf map
//! and jitdump, and the EventPipe stream its runtime writes. Each structure
//! grown from such input is bounded in bytes, and the bounds are shares of
//! this one budget ([`MemoryBudget`]):
//!
//! 1. mapping tables of every tracked process ([`Pool::Mappings`], with
//!    interned paths, see [`crate::process::maps`]),
//! 2. managed symbols of every process
//!    ([`crate::symbolize::managed::ManagedSymbolBudget`]),
//!    and the ReadyToRun code their jitdumps share
//!    ([`crate::symbolize::managed::SharedImageCode`]),
//! 3. the parts of one file read to build its unwind table
//!    ([`MemoryBudget::file_read_bytes`], one file at a time),
//! 4. EventPipe sessions: metadata and stack caches of every stream
//!    ([`Pool::Nettrace`]) and the number of sessions,
//! 5. the memory path's caches: code blocks and method names of every
//!    process ([`Pool::MemoryNames`], names cut at
//!    [`MAX_MEMORY_NAME_BYTES`]), and the image metadata they name methods
//!    from ([`Pool::Metadata`], once per file, an image over
//!    [`MemoryBudget::image_share_bytes`] refused and remembered).
//!
//! The rest of the budget is left for what clrbpf sizes itself (aggregated
//! stacks of a window, native symbol caches). Whatever would go over is
//! dropped, counted here ([`drops`]), shown in the summary and on
//! `/metrics`, and warned about once per process ([`warn_once`]).

use clrbpf_parse::{
    budget::{BudgetDrop, StreamBudget},
    nettrace::{NettraceLimits, NettraceParser},
};
use std::{
    collections::HashSet,
    sync::{
        Mutex, OnceLock, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

/// Default of `--memory-budget-mb`. The chart's 512 MiB limit holds it, the
/// unwind tables (64 MiB of kernel memory) and clrbpf's own working set.
pub const DEFAULT_MEMORY_BUDGET_MB: u64 = 256;

/// The budget and its shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryBudget {
    pub total_bytes: u64,
}

impl Default for MemoryBudget {
    fn default() -> Self {
        Self::from_mb(DEFAULT_MEMORY_BUDGET_MB)
    }
}

impl MemoryBudget {
    pub fn from_mb(mb: u64) -> Self {
        Self {
            total_bytes: mb.saturating_mul(1 << 20),
        }
    }

    /// Managed symbols of every process (a quarter).
    pub fn managed_symbol_bytes(&self) -> u64 {
        self.total_bytes / 4
    }

    /// The ReadyToRun code named in jitdumps that every .NET process shares
    /// (a sixteenth, on top of [`Self::managed_symbol_bytes`]; an idle
    /// .NET 8 service declares about 2,000 entries of 400 bytes, and other
    /// services mostly the same ones).
    pub fn shared_image_code_bytes(&self) -> u64 {
        self.total_bytes / 16
    }

    /// What native debug files cost once parsed (an eighth).
    pub fn debug_file_bytes(&self) -> u64 {
        self.total_bytes / 8
    }

    /// Mapping tables of every tracked process (an eighth).
    pub fn mapping_bytes(&self) -> u64 {
        self.total_bytes / 8
    }

    /// Bytes read of one file to build its unwind table (a quarter): its
    /// headers and unwind sections, or a ReadyToRun image's sections. The
    /// largest real ones (`System.Private.CoreLib.dll`, a composite
    /// framework image) are tens of MiB.
    pub fn file_read_bytes(&self) -> u64 {
        self.total_bytes / 4
    }

    /// Parsed .NET assemblies (metadata and ReadyToRun method tables) every
    /// process shares (a sixteenth; System.Private.CoreLib takes 3 MiB).
    pub fn assembly_bytes(&self) -> u64 {
        self.total_bytes / 16
    }

    /// Code blocks and method names the memory path caches, every
    /// process's (a thirty-second: 8 MiB at the default budget, 65,536
    /// names of 128 bytes).
    pub fn memory_name_bytes(&self) -> u64 {
        self.total_bytes / 32
    }

    /// Image metadata the memory path names methods from, held once per
    /// file for every process (a sixteenth; CoreLib's is about 2 MiB).
    pub fn memory_metadata_bytes(&self) -> u64 {
        self.total_bytes / 16
    }

    /// The most one image may hold of [`Self::memory_metadata_bytes`] or
    /// [`Self::assembly_bytes`] (half of either): a bigger one is refused
    /// rather than let it evict every other tenant's images.
    pub fn image_share_bytes(&self) -> u64 {
        self.assembly_bytes().min(self.memory_metadata_bytes()) / 2
    }

    /// Metadata and stack caches of every EventPipe stream (an eighth).
    pub fn nettrace_bytes(&self) -> u64 {
        self.total_bytes / 8
    }

    /// .NET processes with EventPipe sessions at once: each holds two or
    /// three sockets, their channels of decoded events (a few KiB) and
    /// their share of [`Self::nettrace_bytes`] (its stack caches start at
    /// 32 KiB, see `nettrace::blocks`); one per 256 KiB of that share, 128
    /// at the default budget, a node's worth of pods. (They had a reader
    /// thread each, and one per MiB.)
    pub fn max_sessions(&self) -> usize {
        usize::try_from(self.nettrace_bytes() >> 18)
            .unwrap_or(usize::MAX)
            .max(1)
    }
}

static BUDGET: OnceLock<MemoryBudget> = OnceLock::new();

/// Sets the run's budget (once, at start; later calls are ignored) and
/// sizes the pools from it.
pub fn configure(budget: MemoryBudget) {
    if BUDGET.set(budget).is_ok() {
        MAPPINGS
            .limit
            .store(budget.mapping_bytes(), Ordering::Relaxed);
        NETTRACE
            .limit
            .store(budget.nettrace_bytes(), Ordering::Relaxed);
        MEMORY_NAMES
            .limit
            .store(budget.memory_name_bytes(), Ordering::Relaxed);
        METADATA
            .limit
            .store(budget.memory_metadata_bytes(), Ordering::Relaxed);
        DEBUG_FILES
            .limit
            .store(budget.debug_file_bytes(), Ordering::Relaxed);
    }
}

/// The run's budget ([`MemoryBudget::default`] until configured).
pub fn current() -> MemoryBudget {
    BUDGET.get().copied().unwrap_or_default()
}

/// A share of the budget that many owners charge at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// Mapping tables of tracked processes.
    Mappings,
    /// EventPipe stream state (metadata, stack caches).
    Nettrace,
    /// Code blocks and method names the memory path caches.
    MemoryNames,
    /// Image metadata the memory path holds.
    Metadata,
    /// What blazesym parses of native files' debug files (an estimate
    /// per file, see [`crate::symbolize::native`]).
    DebugFiles,
}

/// Most bytes of one name the memory path keeps (a dynamic method's name
/// is the target's to choose, and grows up to 3x when made UTF-8).
pub const MAX_MEMORY_NAME_BYTES: usize = 512;

struct PoolState {
    used: AtomicU64,
    peak: AtomicU64,
    limit: AtomicU64,
}

impl PoolState {
    const fn new(limit: u64) -> Self {
        Self {
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
        }
    }
}

static MAPPINGS: PoolState = PoolState::new(DEFAULT_MEMORY_BUDGET_MB << 20 >> 3);
static NETTRACE: PoolState = PoolState::new(DEFAULT_MEMORY_BUDGET_MB << 20 >> 3);
static MEMORY_NAMES: PoolState = PoolState::new(DEFAULT_MEMORY_BUDGET_MB << 20 >> 5);
static METADATA: PoolState = PoolState::new(DEFAULT_MEMORY_BUDGET_MB << 20 >> 4);
static DEBUG_FILES: PoolState = PoolState::new(DEFAULT_MEMORY_BUDGET_MB << 20 >> 3);

impl Pool {
    fn state(self) -> &'static PoolState {
        match self {
            Self::Mappings => &MAPPINGS,
            Self::Nettrace => &NETTRACE,
            Self::MemoryNames => &MEMORY_NAMES,
            Self::Metadata => &METADATA,
            Self::DebugFiles => &DEBUG_FILES,
        }
    }

    /// Bytes charged now, the most ever, and the limit.
    pub fn usage(self) -> (u64, u64, u64) {
        let s = self.state();
        (
            s.used.load(Ordering::Relaxed),
            s.peak.load(Ordering::Relaxed),
            s.limit.load(Ordering::Relaxed),
        )
    }
}

/// Bytes charged to a [`Pool`], given back when dropped. Cloning charges
/// the clone's bytes again (without a limit: it is a copy of what was
/// already admitted).
#[derive(Debug)]
pub struct Charge {
    pool: Pool,
    bytes: u64,
}

impl Charge {
    /// Nothing charged yet.
    pub fn new(pool: Pool) -> Self {
        Self { pool, bytes: 0 }
    }

    /// Adds `bytes` if the pool has room for them; `false` (nothing added)
    /// when it has not.
    pub fn try_add(&mut self, bytes: u64) -> bool {
        let state = self.pool.state();
        let limit = state.limit.load(Ordering::Relaxed);
        let added = state
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|&after| after <= limit)
            });
        match added {
            Ok(before) => {
                state.peak.fetch_max(before + bytes, Ordering::Relaxed);
                self.bytes += bytes;
                true
            }
            Err(_) => false,
        }
    }

    /// Gives back up to `bytes`.
    pub fn release(&mut self, bytes: u64) {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        self.pool.state().used.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds `bytes` whatever the pool holds: for what was admitted before
    /// and given back for a while (see [`Self::release`]).
    pub fn add_admitted(&mut self, bytes: u64) {
        let state = self.pool.state();
        let before = state.used.fetch_add(bytes, Ordering::Relaxed);
        state.peak.fetch_max(before + bytes, Ordering::Relaxed);
        self.bytes += bytes;
    }
}

impl Clone for Charge {
    fn clone(&self) -> Self {
        let mut clone = Self::new(self.pool);
        clone.add_admitted(self.bytes);
        clone
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let bytes = self.bytes;
        self.release(bytes);
    }
}

static SESSIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One of the [`MemoryBudget::max_sessions`] EventPipe sessions a run may
/// hold at once, given back when dropped.
#[derive(Debug)]
pub struct SessionSlot(());

impl SessionSlot {
    /// A slot, or `None` (counted) when every one is taken.
    pub fn take() -> Option<Self> {
        let max = current().max_sessions();
        let taken = SESSIONS.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            (n < max).then_some(n + 1)
        });
        match taken {
            Ok(_) => Some(Self(())),
            Err(_) => {
                Drops::count(&drops().sessions, 1);
                None
            }
        }
    }
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        SESSIONS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a target's input would have grown past the budget, dropped.
#[derive(Debug, Default)]
pub struct Drops {
    /// Mappings of `/proc/PID/maps` not kept (past the per-process count,
    /// path bytes, the mapping pool, or the bytes read of the file).
    pub mappings: AtomicU64,
    /// Maps files read only up to their byte cap.
    pub maps_files_truncated: AtomicU64,
    /// Executable files not read for an unwind table, or assemblies not
    /// read for their names (over the share for reading one file).
    pub files: AtomicU64,
    /// Bytes those files (or their sections) would have taken.
    pub file_bytes: AtomicU64,
    /// EventPipe metadata records dropped (per-stream bytes or the pool).
    pub nettrace_metadata: AtomicU64,
    /// Stack caches of EventPipe streams emptied early (the pool was full).
    pub nettrace_stack_resets: AtomicU64,
    /// .NET processes given no EventPipe session (too many open).
    pub sessions: AtomicU64,
    /// Perf map / jitdump entries not kept: their process's managed
    /// symbols were at the managed-symbol share.
    pub managed_symbols: AtomicU64,
    /// Code blocks and method names the memory path did not cache (the
    /// pool was full even after the process's own caches were emptied).
    pub memory_names: AtomicU64,
    /// Images refused, once per file: their metadata or parsed assembly is
    /// over [`MemoryBudget::image_share_bytes`], or the pool was full.
    pub images: AtomicU64,
}

/// A copy of [`Drops`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropCounts {
    pub mappings: u64,
    pub maps_files_truncated: u64,
    pub files: u64,
    pub file_bytes: u64,
    pub nettrace_metadata: u64,
    pub nettrace_stack_resets: u64,
    pub sessions: u64,
    pub managed_symbols: u64,
    pub memory_names: u64,
    pub images: u64,
}

impl DropCounts {
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

static DROPS: OnceLock<Drops> = OnceLock::new();

/// The run's drop counters.
pub fn drops() -> &'static Drops {
    DROPS.get_or_init(Drops::default)
}

impl Drops {
    pub fn count(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> DropCounts {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DropCounts {
            mappings: get(&self.mappings),
            maps_files_truncated: get(&self.maps_files_truncated),
            files: get(&self.files),
            file_bytes: get(&self.file_bytes),
            nettrace_metadata: get(&self.nettrace_metadata),
            nettrace_stack_resets: get(&self.nettrace_stack_resets),
            sessions: get(&self.sessions),
            managed_symbols: get(&self.managed_symbols),
            memory_names: get(&self.memory_names),
            images: get(&self.images),
        }
    }
}

/// What went over the budget, for [`warn_once`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OverBudget {
    Maps,
    File,
    Nettrace,
    Sessions,
    ManagedSymbols,
    MemoryNames,
    Images,
    DebugFiles,
}

/// (pid, kind) pairs warned about; past this many, no more warnings (the
/// counters go on).
const MAX_WARNED: usize = 4096;

static WARNED: Mutex<Option<HashSet<(u32, OverBudget)>>> = Mutex::new(None);

/// Logs `message` (about process `pid`) at warn level the first time
/// `pid` goes over the budget in this way; `true` when it was logged, so
/// the caller can also put it in its summary.
pub fn warn_once(pid: u32, kind: OverBudget, message: impl FnOnce() -> String) -> bool {
    let mut warned = WARNED.lock().unwrap_or_else(PoisonError::into_inner);
    let warned = warned.get_or_insert_with(HashSet::new);
    if warned.len() >= MAX_WARNED || !warned.insert((pid, kind)) {
        return false;
    }
    tracing::warn!(pid, "{}", message());
    true
}

/// What one EventPipe stream's parser keeps (metadata, stack cache),
/// charged to [`Pool::Nettrace`], with what it drops counted in [`drops`].
#[derive(Debug)]
struct StreamCharge(Charge);

impl StreamBudget for StreamCharge {
    fn try_add(&mut self, bytes: u64) -> bool {
        self.0.try_add(bytes)
    }

    fn release(&mut self, bytes: u64) {
        self.0.release(bytes);
    }

    fn count_drop(&self, drop: BudgetDrop) {
        let counter = match drop {
            BudgetDrop::NettraceMetadata => &drops().nettrace_metadata,
            BudgetDrop::NettraceStackReset => &drops().nettrace_stack_resets,
        };
        Drops::count(counter, 1);
    }
}

/// The parser of a target's EventPipe stream: default limits, its state
/// charged to [`Pool::Nettrace`].
pub fn nettrace_parser() -> NettraceParser {
    NettraceParser::with_budget(
        NettraceLimits::default(),
        Box::new(StreamCharge(Charge::new(Pool::Nettrace))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_stay_within_the_budget() {
        let b = MemoryBudget::from_mb(256);
        let shares = b.managed_symbol_bytes()
            + b.mapping_bytes()
            + b.file_read_bytes()
            + b.nettrace_bytes()
            + b.assembly_bytes()
            + b.shared_image_code_bytes()
            + b.memory_name_bytes()
            + b.memory_metadata_bytes();
        assert!(shares < b.total_bytes, "{shares}");
        assert_eq!(b.max_sessions(), 128);
        assert_eq!(MemoryBudget::from_mb(1).max_sessions(), 1);
    }

    #[test]
    fn charges_are_refused_past_the_limit_and_given_back() {
        let (used0, _, limit) = Pool::Nettrace.usage();
        let mut a = Charge::new(Pool::Nettrace);
        assert!(a.try_add(10));
        assert!(!a.try_add(limit), "more than the limit is refused");
        assert_eq!(a.bytes(), 10);
        let b = a.clone();
        a.release(4);
        assert_eq!(a.bytes(), 6);
        drop(a);
        drop(b);
        // Other tests may charge the pool at the same time: only what this
        // one charged is checked to be gone.
        assert!(Pool::Nettrace.usage().0 <= used0 + 100);
    }

    #[test]
    fn warns_once_per_process_and_kind() {
        assert!(warn_once(4_000_001, OverBudget::Maps, || "x".into()));
        assert!(!warn_once(4_000_001, OverBudget::Maps, || "x".into()));
        assert!(warn_once(4_000_001, OverBudget::File, || "x".into()));
        assert!(warn_once(4_000_002, OverBudget::Maps, || "x".into()));
    }
}
