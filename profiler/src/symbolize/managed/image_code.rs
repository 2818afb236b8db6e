//! ReadyToRun code named once for every process that maps the same image.
//! Part of the managed half of the `symbolize/` stage: a process's jitdump
//! lists every precompiled method it runs (`[PreJIT]`, most of an idle
//! service's ~3,000 entries, nearly all of them in `System.Private.CoreLib`),
//! and those are the same file bytes, with the same names, in every .NET
//! process of the host, only at other addresses.
//!
//! 1. [`ProcessImageCode`] keeps a process's executable mappings of
//!    assemblies (`.dll`, `.exe`), from its mappings table.
//! 2. A jitdump entry whose code lies inside one of them is turned into a
//!    file offset (`addr - start + offset`) and declared to the
//!    [`ImageCodeTable`] of that file, found in the run's
//!    [`SharedImageCode`] by the file's identity (device, inode, size,
//!    mtime of the file mapped, read through `/proc/PID/map_files`). The
//!    first process to declare an offset adds the entry; the others find
//!    the same size and name there and only set a bit in their own set of
//!    declared entries (a few hundred bytes a process instead of ~300 bytes
//!    a method).
//! 3. A lookup that the process's own index does not answer looks in its
//!    image mappings and gives the shared entry back at the process's
//!    address, only if the process itself declared it: a process that writes
//!    other names into its jitdump cannot rename another process's frames.
//!    An entry that disagrees with the shared one (another name or size at
//!    the same offset, or overlapping one) stays in the process's own index.
//! 4. Tables are reference counted: the last process to let go of one (its
//!    exit, or the budget dropping its symbols) frees it. The shared entries
//!    are bounded in bytes ([`SharedImageCode::new`]); past the bound, entries
//!    stay in their process's own index (counted), as before this cache.
//!
//! The code of an image mapping is not handed to the JIT unwinder: the image
//! has its own unwind table, shared by every process that maps it
//! (`crate::bpf::unwind_maps`). Names of image code carry no time: the
//! bytes of a mapped file do not change while it is mapped, and a new
//! mapping at the same place is a new entry of the mappings table.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use super::{ManagedSymbol, SharedNames, SymbolInterner, arc_str_bytes};
use crate::process::{
    MappingTable, ProcFs,
    mapped_file::{MappedFileRef, open_mapped},
};

/// Bytes counted for a table besides its entries: the table, its map slot.
const TABLE_BYTES: u64 = 256;
/// Bytes counted for an entry besides its strings: the symbol and its slot
/// in the offset map.
const ENTRY_BYTES: u64 = size_of::<ManagedSymbol>() as u64 + 48;
/// Executable assembly mappings a process keeps at most (a hostile process
/// may map many; past it, their code is indexed per process as before).
const MAX_IMAGE_MAPPINGS: usize = 4096;

/// A mapped file's identity: its table is shared only with processes
/// mapping this very file, unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ImageKey {
    pub dev: u64,
    pub inode: u64,
    pub size: u64,
    pub mtime_ns: i64,
}

/// What the shared tables hold and did, for the summary and the logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedImageCodeStats {
    pub limit_bytes: u64,
    /// Held now, over all tables.
    pub bytes: u64,
    pub tables: u64,
    pub entries: u64,
    /// Tables freed when the last process using them let go.
    pub tables_freed: u64,
    /// Entries kept in their process's index because the tables were full.
    pub refused_full: u64,
    /// Entries kept in their process's index because they disagreed with
    /// the shared entry at their offset.
    pub conflicts: u64,
}

#[derive(Debug, Default)]
struct Counters {
    bytes: AtomicU64,
    entries: AtomicU64,
    tables_freed: AtomicU64,
    refused_full: AtomicU64,
    conflicts: AtomicU64,
}

/// The ReadyToRun code tables every process of a run shares. Cheap to
/// clone: clones share the tables.
#[derive(Clone, Debug)]
pub struct SharedImageCode {
    tables: Arc<Mutex<HashMap<ImageKey, Weak<ImageCodeTable>>>>,
    counters: Arc<Counters>,
    limit_bytes: u64,
    /// Method names of JIT-compiled code, shared by the processes' symbols.
    names: SharedNames,
}

impl SharedImageCode {
    /// Tables holding at most `limit_bytes` of entries in all.
    pub fn new(limit_bytes: u64) -> Self {
        Self {
            tables: Arc::default(),
            counters: Arc::default(),
            limit_bytes,
            names: SharedNames::default(),
        }
    }

    /// The method names every process's symbols share.
    pub fn names(&self) -> &SharedNames {
        &self.names
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<ImageKey, Weak<ImageCodeTable>>> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The table of the file `key`, made empty if no process holds it.
    fn table(&self, key: ImageKey) -> Option<Arc<ImageCodeTable>> {
        let mut tables = self.lock();
        if let Some(table) = tables.get(&key).and_then(Weak::upgrade) {
            return Some(table);
        }
        if !self.reserve(TABLE_BYTES) {
            return None;
        }
        // Forget the tables freed since (their `Weak`s only).
        tables.retain(|_, t| t.strong_count() > 0);
        let table = Arc::new(ImageCodeTable {
            counters: Arc::clone(&self.counters),
            inner: Mutex::new(TableInner {
                bytes: TABLE_BYTES,
                ..TableInner::default()
            }),
        });
        tables.insert(key, Arc::downgrade(&table));
        Some(table)
    }

    /// Adds `bytes` to the tables' total if it stays within the limit.
    fn reserve(&self, bytes: u64) -> bool {
        let limit = self.limit_bytes;
        let reserved = self
            .counters
            .bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(bytes).filter(|&after| after <= limit)
            })
            .is_ok();
        if !reserved {
            self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
        }
        reserved
    }

    pub fn stats(&self) -> SharedImageCodeStats {
        let tables = self
            .lock()
            .values()
            .filter(|t| t.strong_count() > 0)
            .count();
        let c = &self.counters;
        SharedImageCodeStats {
            limit_bytes: self.limit_bytes,
            bytes: c.bytes.load(Ordering::Relaxed),
            tables: tables as u64,
            entries: c.entries.load(Ordering::Relaxed),
            tables_freed: c.tables_freed.load(Ordering::Relaxed),
            refused_full: c.refused_full.load(Ordering::Relaxed),
            conflicts: c.conflicts.load(Ordering::Relaxed),
        }
    }
}

/// The named code of one image file, by file offset.
#[derive(Debug)]
pub struct ImageCodeTable {
    counters: Arc<Counters>,
    inner: Mutex<TableInner>,
}

#[derive(Debug, Default)]
struct TableInner {
    /// File offset of each entry's start -> its index in `symbols`.
    by_offset: BTreeMap<u64, u32>,
    /// `start` is the file offset.
    symbols: Vec<ManagedSymbol>,
    interner: SymbolInterner,
    bytes: u64,
}

impl Drop for ImageCodeTable {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner);
        let c = &self.counters;
        c.bytes.fetch_sub(inner.bytes, Ordering::Relaxed);
        c.entries
            .fetch_sub(inner.symbols.len() as u64, Ordering::Relaxed);
        c.tables_freed.fetch_add(1, Ordering::Relaxed);
    }
}

/// Why an entry was not shared.
enum Declined {
    Full,
    Conflict,
}

impl ImageCodeTable {
    fn lock(&self) -> MutexGuard<'_, TableInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The id of the entry at `[offset, offset + size)` named `raw_name`,
    /// added if new.
    fn declare(
        &self,
        shared: &SharedImageCode,
        offset: u64,
        size: u64,
        raw_name: &str,
    ) -> Result<u32, Declined> {
        let mut inner = self.lock();
        let end = offset.checked_add(size).ok_or(Declined::Conflict)?;
        if let Some((&start, &id)) = inner.by_offset.range(..end).next_back() {
            let known = &inner.symbols[id as usize];
            if start == offset && known.size == size && &*known.raw_name == raw_name {
                return Ok(id);
            }
            if start + known.size > offset {
                return Err(Declined::Conflict);
            }
        }
        let id = u32::try_from(inner.symbols.len()).map_err(|_| Declined::Full)?;
        let TableInner { interner, .. } = &mut *inner;
        let symbol = ManagedSymbol::from_raw_name(raw_name, offset, size, interner);
        let bytes = ENTRY_BYTES + symbol_string_bytes(&symbol);
        if !shared.reserve(bytes) {
            return Err(Declined::Full);
        }
        inner.bytes += bytes;
        inner.by_offset.insert(offset, id);
        inner.symbols.push(symbol);
        self.counters.entries.fetch_add(1, Ordering::Relaxed);
        Ok(id)
    }

    /// The entry holding `offset`, if it is `declared`.
    fn lookup(&self, offset: u64, declared: &[u64]) -> Option<ManagedSymbol> {
        let inner = self.lock();
        let (&start, &id) = inner.by_offset.range(..=offset).next_back()?;
        let symbol = &inner.symbols[id as usize];
        let is_declared = declared
            .get(id as usize / 64)
            .is_some_and(|word| word & (1 << (id % 64)) != 0);
        (offset - start < symbol.size && is_declared).then(|| symbol.clone())
    }
}

/// Heap bytes of a symbol's own strings (the interned tier and assembly
/// are counted by the interner, not here).
fn symbol_string_bytes(symbol: &ManagedSymbol) -> u64 {
    let mut bytes = arc_str_bytes(symbol.name.len());
    if !Arc::ptr_eq(&symbol.short_name, &symbol.name) {
        bytes += arc_str_bytes(symbol.short_name.len());
    }
    if !Arc::ptr_eq(&symbol.raw_name, &symbol.name) {
        bytes += arc_str_bytes(symbol.raw_name.len());
    }
    bytes
}

/// Where a mapping's table stands.
#[derive(Debug)]
enum TableState {
    /// Not looked for yet: no entry of the mapping was declared.
    Unresolved,
    Shared(Arc<ImageCodeTable>),
    /// The file could not be identified, or the tables are full: its code
    /// is indexed per process.
    Unusable,
}

/// One executable mapping of an assembly file.
#[derive(Debug)]
struct ImageMapping {
    start: u64,
    end: u64,
    offset: u64,
    dev_major: u32,
    dev_minor: u32,
    inode: u64,
    path: Arc<str>,
    table: TableState,
    /// Bit `id` set: this process declared the table's entry `id`.
    declared: Vec<u64>,
}

impl ImageMapping {
    fn same_place(&self, other: &Self) -> bool {
        (
            self.start,
            self.end,
            self.offset,
            self.inode,
            self.dev_major,
            self.dev_minor,
        ) == (
            other.start,
            other.end,
            other.offset,
            other.inode,
            other.dev_major,
            other.dev_minor,
        )
    }
}

/// A process's view of the shared tables: its assembly mappings and the
/// entries it declared in each.
#[derive(Debug)]
pub struct ProcessImageCode {
    pid: u32,
    shared: SharedImageCode,
    /// Sorted by start.
    mappings: Vec<ImageMapping>,
}

impl ProcessImageCode {
    pub fn new(pid: u32, shared: SharedImageCode) -> Self {
        Self {
            pid,
            shared,
            mappings: Vec::new(),
        }
    }

    /// Takes the executable assembly mappings from a new read of the
    /// process's mappings; unchanged ones keep their table and declared
    /// entries.
    pub fn sync_mappings(&mut self, mappings: &MappingTable) {
        let mut old = std::mem::take(&mut self.mappings);
        for m in mappings.iter() {
            let Some(path) = m.path.as_ref() else {
                continue;
            };
            if !m.is_executable() || m.is_anonymous() || m.inode == 0 || !is_assembly_path(path) {
                continue;
            }
            if self.mappings.len() >= MAX_IMAGE_MAPPINGS {
                break;
            }
            let mapping = ImageMapping {
                start: m.start,
                end: m.end,
                offset: m.offset,
                dev_major: m.dev_major,
                dev_minor: m.dev_minor,
                inode: m.inode,
                path: path.clone(),
                table: TableState::Unresolved,
                declared: Vec::new(),
            };
            let kept = old
                .iter()
                .position(|o| o.same_place(&mapping))
                .map(|i| old.swap_remove(i));
            self.mappings.push(kept.unwrap_or(mapping));
        }
        self.mappings.sort_by_key(|m| m.start);
    }

    /// Lets go of every shared entry (the budget dropped the process's
    /// symbols: its jitdump is read again from the start).
    pub fn forget_declared(&mut self) {
        for m in &mut self.mappings {
            m.table = TableState::Unresolved;
            m.declared = Vec::new();
        }
    }

    fn mapping_index(&self, addr: u64) -> Option<usize> {
        let index = self.mappings.partition_point(|m| m.start <= addr);
        let i = index.checked_sub(1)?;
        (addr < self.mappings[i].end).then_some(i)
    }

    /// Declares the code `[addr, addr + size)` named `raw_name` (as the
    /// jitdump spells it) to its image's shared table. False when it is no
    /// image's code or could not be shared: the caller indexes it itself.
    pub fn declare(&mut self, addr: u64, size: u64, raw_name: &str) -> bool {
        let Some(i) = self.mapping_index(addr) else {
            return false;
        };
        let pid = self.pid;
        let shared = &self.shared;
        let m = &mut self.mappings[i];
        if size == 0 || addr.checked_add(size).is_none_or(|end| end > m.end) {
            return false;
        }
        if matches!(m.table, TableState::Unresolved) {
            m.table = match image_key(pid, m).and_then(|key| shared.table(key)) {
                Some(table) => TableState::Shared(table),
                None => TableState::Unusable,
            };
        }
        let TableState::Shared(table) = &m.table else {
            return false;
        };
        let Some(offset) = (addr - m.start).checked_add(m.offset) else {
            return false;
        };
        match table.declare(shared, offset, size, raw_name) {
            Ok(id) => {
                let word = id as usize / 64;
                if m.declared.len() <= word {
                    m.declared.resize(word + 1, 0);
                }
                m.declared[word] |= 1 << (id % 64);
                true
            }
            Err(Declined::Full) => false,
            Err(Declined::Conflict) => {
                shared.counters.conflicts.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// The symbol of the image code at `addr`, at that address, if this
    /// process declared it.
    pub fn lookup(&self, addr: u64) -> Option<ManagedSymbol> {
        let m = &self.mappings[self.mapping_index(addr)?];
        let TableState::Shared(table) = &m.table else {
            return None;
        };
        let offset = (addr - m.start).checked_add(m.offset)?;
        let mut symbol = table.lookup(offset, &m.declared)?;
        symbol.start = m.start.checked_add(symbol.start.checked_sub(m.offset)?)?;
        Some(symbol)
    }

    pub fn shared(&self) -> &SharedImageCode {
        &self.shared
    }

    /// Entries this process declared (its share of the tables).
    pub fn declared(&self) -> u64 {
        self.mappings
            .iter()
            .flat_map(|m| &m.declared)
            .map(|w| u64::from(w.count_ones()))
            .sum()
    }

    /// Heap bytes this process holds (its mappings and declared sets; the
    /// shared tables are the run's).
    pub fn memory_bytes(&self) -> u64 {
        let sets: usize = self
            .mappings
            .iter()
            .map(|m| m.declared.capacity() * 8)
            .sum();
        (self.mappings.capacity() * size_of::<ImageMapping>() + sets) as u64
    }
}

/// Whether a mapped file's name is an assembly's.
fn is_assembly_path(path: &str) -> bool {
    let ends = |suffix: &str| {
        path.len() >= suffix.len()
            && path.as_bytes()[path.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
    };
    ends(".dll") || ends(".exe")
}

/// The identity of the file mapped, opened by
/// [`crate::process::mapped_file`], only if it is the inode and device
/// mapped.
fn image_key(pid: u32, m: &ImageMapping) -> Option<ImageKey> {
    let mapped = MappedFileRef {
        start: m.start,
        end: m.end,
        dev_major: m.dev_major,
        dev_minor: m.dev_minor,
        inode: m.inode,
        path: &m.path,
    };
    let file = open_mapped(&ProcFs::default(), pid, &mapped).ok()?;
    let meta = file.metadata().ok()?;
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    if meta.ino() != m.inode || (major, minor) != (m.dev_major, m.dev_minor) {
        return None;
    }
    Some(ImageKey {
        dev,
        inode: meta.ino(),
        size: meta.size(),
        mtime_ns: meta
            .mtime()
            .saturating_mul(1_000_000_000)
            .saturating_add(meta.mtime_nsec()),
    })
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;

    /// An executable mapping of a real `.dll` file in this process, at an
    /// address of its own each time.
    struct MappedImage {
        addr: *mut libc::c_void,
        len: usize,
    }

    impl MappedImage {
        fn map(file: &File, len: usize) -> Self {
            use std::os::fd::AsRawFd as _;
            // SAFETY: a fresh private read-only mapping of an open file; it
            // is unmapped on drop and never dereferenced.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE,
                    file.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(addr, libc::MAP_FAILED, "mmap");
            Self { addr, len }
        }

        fn start(&self) -> u64 {
            self.addr as u64
        }

        /// This process's mappings table with only this mapping of its files.
        fn table(&self) -> MappingTable {
            let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
            let line = maps
                .lines()
                .find(|l| l.starts_with(&format!("{:x}-", self.start())))
                .expect("the mapping");
            MappingTable::parse(std::io::Cursor::new(format!("{line}\n"))).expect("parse")
        }
    }

    impl Drop for MappedImage {
        fn drop(&mut self) {
            // SAFETY: unmaps what `map` mapped.
            unsafe { libc::munmap(self.addr, self.len) };
        }
    }

    fn image_file() -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("System.Private.CoreLib.dll");
        std::fs::write(&path, vec![0xccu8; 8192]).expect("write");
        let file = File::open(&path).expect("open");
        (dir, file)
    }

    /// Two processes (of this test's pid) mapping the same image, and the
    /// table they share.
    fn two_processes() -> (
        tempfile::TempDir,
        [MappedImage; 2],
        SharedImageCode,
        [ProcessImageCode; 2],
    ) {
        let (dir, file) = image_file();
        let maps = [MappedImage::map(&file, 8192), MappedImage::map(&file, 8192)];
        let shared = SharedImageCode::new(1 << 20);
        let processes = maps.each_ref().map(|map| {
            let mut process = ProcessImageCode::new(std::process::id(), shared.clone());
            process.sync_mappings(&map.table());
            process
        });
        (dir, maps, shared, processes)
    }

    const SLEEP: &str =
        "void [System.Private.CoreLib] System.Threading.Thread::Sleep(int32)[PreJIT]";

    #[test]
    fn two_processes_share_one_entry_at_their_own_addresses() {
        let (_dir, [a_map, b_map], shared, [mut a, mut b]) = two_processes();

        assert!(a.declare(a_map.start() + 0x100, 0x40, SLEEP));
        assert!(b.declare(b_map.start() + 0x100, 0x40, SLEEP));
        let stats = shared.stats();
        assert_eq!((stats.tables, stats.entries), (1, 1), "{stats:?}");
        for (process, start) in [(&a, a_map.start()), (&b, b_map.start())] {
            let symbol = process.lookup(start + 0x120).expect("named");
            assert_eq!(&*symbol.short_name, "System.Threading.Thread.Sleep");
            assert_eq!(symbol.jit_tier.as_deref(), Some("PreJIT"));
            assert_eq!((symbol.start, symbol.size), (start + 0x100, 0x40));
            assert!(process.lookup(start + 0x140).is_none(), "past the end");
        }
        // Code outside the image is not the table's.
        assert!(!a.declare(0x1000, 0x40, SLEEP));
        assert!(!a.declare(a_map.start() + 8192 - 0x10, 0x40, SLEEP));

        drop(a);
        assert_eq!(shared.stats().tables_freed, 0, "b still holds it");
        drop(b);
        let stats = shared.stats();
        assert_eq!((stats.tables, stats.entries, stats.bytes), (0, 0, 0));
        assert_eq!(stats.tables_freed, 1);
    }

    #[test]
    fn a_process_sees_only_what_it_declared_and_cannot_rename_others() {
        let (_dir, [a_map, b_map], shared, [mut a, mut b]) = two_processes();
        assert!(a.declare(a_map.start() + 0x100, 0x40, SLEEP));
        assert!(
            b.lookup(b_map.start() + 0x100).is_none(),
            "b never listed this code"
        );
        // Another name or size at the same place, or an overlap: b keeps
        // its own entry, a's name is untouched.
        let fake = "void [Evil] Evil::Sleep(int32)[PreJIT]";
        assert!(!b.declare(b_map.start() + 0x100, 0x40, fake));
        assert!(!b.declare(b_map.start() + 0x100, 0x20, SLEEP));
        assert!(!b.declare(b_map.start() + 0x120, 0x40, fake));
        assert_eq!(shared.stats().conflicts, 3);
        let symbol = a.lookup(a_map.start() + 0x100).expect("named");
        assert_eq!(&*symbol.short_name, "System.Threading.Thread.Sleep");
        assert!(b.lookup(b_map.start() + 0x100).is_none());
        // The budget dropping a's symbols lets go of its share.
        a.forget_declared();
        assert!(a.lookup(a_map.start() + 0x100).is_none());
        assert_eq!(shared.stats().tables_freed, 0, "b looked it up");
        drop(b);
        assert_eq!(shared.stats().tables_freed, 1);
    }

    #[test]
    fn the_tables_stay_within_their_bound() {
        let (_dir, file) = image_file();
        let map = MappedImage::map(&file, 8192);
        let entry = ENTRY_BYTES + 3 * arc_str_bytes(SLEEP.len());
        let shared = SharedImageCode::new(TABLE_BYTES + 2 * entry + 600);
        let mut process = ProcessImageCode::new(std::process::id(), shared.clone());
        process.sync_mappings(&map.table());
        let declared: Vec<bool> = (0..10)
            .map(|i| process.declare(map.start() + i * 0x100, 0x40, SLEEP))
            .collect();
        let stats = shared.stats();
        assert!(declared[0] && declared[1], "{declared:?}");
        assert!(!declared[9], "{declared:?}");
        assert!(stats.bytes <= stats.limit_bytes, "{stats:?}");
        assert!(stats.refused_full > 0, "{stats:?}");
        // Entries already there are still shared.
        assert!(process.declare(map.start(), 0x40, SLEEP));
    }

    /// Two processes' jitdumps list the same ReadyToRun method at their own
    /// addresses and a JIT-compiled one each: the first is held once, named
    /// in both, and not handed to the JIT unwinder; the second stays each
    /// process's own.
    #[test]
    fn jitdumps_share_their_ready_to_run_code() {
        use super::super::tests::{Target, code_load, jitdump_header};
        use super::super::{ManagedSymbols, ManagedSymbolsConfig};
        let (_dir, file) = image_file();
        let shared = SharedImageCode::new(1 << 20);
        let maps = [MappedImage::map(&file, 8192), MappedImage::map(&file, 8192)];
        let targets = [Target::new(), Target::new()];
        let mut all = Vec::new();
        for (i, (map, target)) in maps.iter().zip(&targets).enumerate() {
            let jit = 0x7f00_0000_0000 + i as u64 * 0x1000;
            let mut dump = jitdump_header();
            dump.extend(code_load(10, map.start() + 0x100, 0x40, SLEEP));
            dump.extend(code_load(
                11,
                jit,
                0x20,
                "void [App] App::Run()[QuickJitted]",
            ));
            dump.extend(code_load(12, jit + 0x800, 0x100, "stub<5> FixupPrecode"));
            target.append("jit-7.dump", &dump);
            let mut location = target.location.clone();
            location.pid = std::process::id();
            let mut symbols = ManagedSymbols::at(location, ManagedSymbolsConfig::default());
            symbols.share_image_code(shared.clone());
            symbols.sync_mappings(&map.table());
            let stats = symbols.refresh(20);
            assert_eq!(
                (stats.jitdump.symbols_added, stats.jitdump.symbols_shared),
                (3, 1)
            );
            let name = |addr| symbols.lookup(addr, 30).map(|s| s.short_name.to_string());
            assert_eq!(
                name(map.start() + 0x110).as_deref(),
                Some("System.Threading.Thread.Sleep")
            );
            assert_eq!(name(jit + 4).as_deref(), Some("App.Run"));
            assert_eq!(name(jit + 0x810).as_deref(), Some("stub<5> FixupPrecode"));
            let (new_code, _) = symbols.take_new_code();
            assert_eq!(new_code.len(), 1, "only the JIT-compiled method");
            assert_eq!(new_code[0].start, jit);
            assert_eq!(symbols.len(), 3);
            all.push(symbols);
        }
        assert_eq!(shared.stats().entries, 1);
        drop(all);
        assert_eq!(shared.stats().bytes, 0);
    }
}
