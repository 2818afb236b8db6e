//! Unwind tables kept between runs: one file per table in a directory of
//! clrbpf's own (`--cache-dir`, `/var/cache/clrbpf` by default), named by
//! the file's [`FileIdentity`]. A `record` of a few seconds otherwise
//! spends a good part of its CPU rebuilding the tables of libcoreclr, libc
//! and the framework that the last run built already; perf keeps its
//! build-id cache in `~/.debug` for the same reason.
//!
//! Place in the data flow: [`super::UnwindTableCache`] asks here on a miss
//! before building a table, and stores what it built.
//!
//! The directory is trusted only when it is clrbpf's: a real directory (a
//! symlink is not followed) owned by the user clrbpf runs as, with no
//! access for group or others. Anything else turns the cache off with a
//! warning that says what to fix. Entries are opened without following
//! symlinks, bounded in size ([`MAX_ENTRY_BYTES`]) and checked whole: the
//! magic, the build of clrbpf that wrote them (a new build rebuilds its
//! tables: the rows' meaning may have changed), the identity and every
//! length. A bad entry is removed and its table rebuilt. Entries are
//! written under a temporary name and renamed, so a reader never sees half
//! of one; the directory stays under [`DEFAULT_BUDGET_BYTES`], oldest
//! entries removed first.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::{Read as _, Write as _};
use std::path::Path;
use std::time::{Duration, SystemTime};

use clrbpf_common::unwind::{RowIndex, UnwindRow};

use super::table::{FileIdentity, LoadSegment, UnwindTable};
use crate::process::root::{EntryKind, PrivateDirError, TargetDir, WiderMode};

/// Where tables are kept unless `--cache-dir` says otherwise.
pub const DEFAULT_DIR: &str = "/var/cache/clrbpf";
/// Bytes of entries the directory keeps at most.
pub const DEFAULT_BUDGET_BYTES: u64 = 256 << 20;
/// Largest entry read: a table at `MAX_TABLE_ROWS` rows is 384 MiB, but no
/// real file comes near; larger entries are not written either.
pub const MAX_ENTRY_BYTES: u64 = 128 << 20;

const MAGIC: &[u8; 8] = b"CLRBPFU1";
const ENTRY_PREFIX: &str = "unwind-";
const TEMP_PREFIX: &str = ".tmp-";
/// Age past which a temporary file is a dead writer's and removed. A write
/// takes milliseconds, and another clrbpf may share the directory (the
/// agent and a `record`, or two pid namespaces, where a pid in the name
/// tells nothing), so a fresh one may be another writer's work in
/// progress.
const STALE_TEMP_SECS: u64 = 3600;
const ROW_BYTES: usize = 24;
const SEGMENT_BYTES: usize = 24;
/// Longest build id (of clrbpf or of a file) an entry holds.
const MAX_ID_BYTES: usize = 64;

/// What the cache did, for the summary and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCacheStats {
    /// Tables read from the cache.
    pub hits: u64,
    /// Tables not there (built, then written).
    pub misses: u64,
    pub written: u64,
    /// Entries that failed the checks (removed).
    pub rejected: u64,
    /// Entries removed to stay within the budget.
    pub evicted: u64,
    /// Writes that failed (a full disk): the table is still used.
    pub write_errors: u64,
}

/// Why the cache is off.
#[derive(Debug, thiserror::Error)]
pub enum DiskCacheError {
    #[error(
        "cannot create or open the cache directory {path}: {source}; pick another with --cache-dir, or --no-cache"
    )]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the cache directory {path} is {problem}: it must be a directory owned by uid {uid} with mode 0700 (fix it, pick another with --cache-dir, or --no-cache)"
    )]
    Untrusted {
        path: String,
        problem: String,
        uid: u32,
    },
    #[error(
        "this clrbpf binary has no GNU build id to tell its cache entries from another build's: unwind table cache off"
    )]
    NoBuildId,
}

/// The directory of cached tables.
pub struct DiskTableCache {
    dir: TargetDir,
    /// The build id of the running clrbpf: entries of other builds are
    /// rebuilt.
    writer: Box<[u8]>,
    budget_bytes: u64,
    /// Entries in the directory: name, size, last modified.
    entries: Vec<(OsString, u64, SystemTime)>,
    /// Identities looked for and not found this run (then built and
    /// written): not looked for again.
    missed: HashSet<FileIdentity>,
    pub stats: DiskCacheStats,
}

/// Opens (creating it, mode 0700) clrbpf's cache directory at `path`,
/// refused unless it is a real directory owned by the user clrbpf runs as
/// with no access for group or others ([`TargetDir::open_private`]).
pub fn open_cache_dir(path: &Path) -> Result<TargetDir, DiskCacheError> {
    TargetDir::open_private(path, WiderMode::Refuse).map_err(|error| match error {
        PrivateDirError::Open { path, source } => DiskCacheError::Open {
            path: path.display().to_string(),
            source,
        },
        PrivateDirError::Untrusted { path, problem, uid } => DiskCacheError::Untrusted {
            path: path.display().to_string(),
            problem,
            uid,
        },
    })
}

/// Writes the entry `name` of a cache directory whole: under a temporary
/// name (removed by the next [`DiskTableCache`] to open the directory if
/// this process dies first), then renamed, so a reader sees all of it or
/// none.
pub fn write_entry(dir: &TargetDir, name: &OsStr, bytes: &[u8]) -> std::io::Result<()> {
    // Never the name of a dead writer's leftover (a pid is reused).
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let temp = OsString::from(format!(
        "{TEMP_PREFIX}{}-{nanos}-{}",
        std::process::id(),
        name.to_string_lossy()
    ));
    let written = dir
        .create_new(&temp)
        .and_then(|mut file| file.write_all(bytes))
        .and_then(|()| dir.rename(&temp, name));
    if written.is_err() {
        let _ = dir.unlink(&temp);
    }
    written
}

impl DiskTableCache {
    /// Opens (creating it, mode 0700) the cache at `path`, for tables built
    /// by the running clrbpf.
    pub fn open(path: &Path) -> Result<Self, DiskCacheError> {
        let writer = blazesym::helper::read_elf_build_id(Path::new("/proc/self/exe"))
            .ok()
            .flatten()
            .filter(|id| !id.is_empty() && id.len() <= MAX_ID_BYTES)
            .ok_or(DiskCacheError::NoBuildId)?;
        Self::open_for(path, writer.into_owned().into_boxed_slice())
    }

    /// [`Self::open`] for entries written by `writer`.
    pub fn open_for(path: &Path, writer: Box<[u8]>) -> Result<Self, DiskCacheError> {
        let dir = open_cache_dir(path)?;
        let mut cache = Self {
            dir,
            writer,
            budget_bytes: DEFAULT_BUDGET_BYTES,
            entries: Vec::new(),
            missed: HashSet::new(),
            stats: DiskCacheStats::default(),
        };
        cache.scan();
        Ok(cache)
    }

    #[cfg(test)]
    pub fn set_budget_bytes(&mut self, budget_bytes: u64) {
        self.budget_bytes = budget_bytes;
    }

    /// The entries' names and sizes; leftovers of interrupted writes older
    /// than [`STALE_TEMP_SECS`] removed.
    fn scan(&mut self) {
        self.entries.clear();
        for name in self.dir.entries().unwrap_or_default() {
            let text = name.to_string_lossy();
            let Ok(stat) = self.dir.stat(&name) else {
                continue;
            };
            if stat.kind != EntryKind::File {
                continue;
            }
            if text.starts_with(TEMP_PREFIX) {
                let age = SystemTime::now()
                    .duration_since(stat.modified)
                    .unwrap_or_default();
                if age >= Duration::from_secs(STALE_TEMP_SECS) {
                    let _ = self.dir.unlink(&name);
                }
            } else if text.starts_with(ENTRY_PREFIX) {
                self.entries.push((name, stat.size, stat.modified));
            }
        }
    }

    fn entry_name(identity: &FileIdentity) -> OsString {
        let id = identity.to_string().replace(':', "-");
        OsString::from(format!("{ENTRY_PREFIX}{id}"))
    }

    /// The cached table of `identity`, if a good entry holds it.
    pub fn load(&mut self, identity: &FileIdentity) -> Option<UnwindTable> {
        if self.missed.contains(identity) {
            return None;
        }
        let name = Self::entry_name(identity);
        let Ok(file) = self.dir.open_file(&name) else {
            self.stats.misses += 1;
            self.missed.insert(identity.clone());
            return None;
        };
        // Sized from the file: read in one go, not grown by doubling.
        let mut bytes = Vec::with_capacity(
            file.metadata()
                .map_or(0, |meta| meta.len().min(MAX_ENTRY_BYTES) as usize),
        );
        let read = file
            .take(MAX_ENTRY_BYTES + 1)
            .read_to_end(&mut bytes)
            .is_ok();
        match (read && bytes.len() as u64 <= MAX_ENTRY_BYTES)
            .then(|| decode(&bytes, &self.writer, identity))
            .flatten()
        {
            Some(table) => {
                self.stats.hits += 1;
                Some(table)
            }
            None => {
                // Another build's entry, or a damaged one: rebuilt and
                // written again.
                self.stats.rejected += 1;
                self.stats.misses += 1;
                self.missed.insert(identity.clone());
                self.remove(&name);
                None
            }
        }
    }

    /// Writes `table`'s entry, then removes the oldest entries over the
    /// budget.
    pub fn store(&mut self, table: &UnwindTable) {
        let bytes = encode(table, &self.writer);
        if bytes.len() as u64 > MAX_ENTRY_BYTES.min(self.budget_bytes) {
            return;
        }
        let name = Self::entry_name(table.identity());
        if let Err(error) = write_entry(&self.dir, &name, &bytes) {
            tracing::debug!(%error, entry = %name.to_string_lossy(), "could not write an unwind table cache entry");
            self.stats.write_errors += 1;
            return;
        }
        self.stats.written += 1;
        self.missed.remove(table.identity());
        self.entries.retain(|(n, _, _)| *n != name);
        self.entries
            .push((name, bytes.len() as u64, SystemTime::now()));
        self.enforce_budget();
    }

    fn enforce_budget(&mut self) {
        let mut total: u64 = self.entries.iter().map(|(_, size, _)| size).sum();
        if total <= self.budget_bytes {
            return;
        }
        self.entries.sort_by_key(|(_, _, modified)| *modified);
        let mut keep = Vec::with_capacity(self.entries.len());
        for (name, size, modified) in std::mem::take(&mut self.entries) {
            if total > self.budget_bytes {
                let _ = self.dir.unlink(&name);
                total -= size;
                self.stats.evicted += 1;
            } else {
                keep.push((name, size, modified));
            }
        }
        self.entries = keep;
    }

    fn remove(&mut self, name: &OsStr) {
        let _ = self.dir.unlink(name);
        self.entries.retain(|(n, _, _)| n != name);
    }

    /// Bytes of entries in the directory.
    pub fn size_bytes(&self) -> u64 {
        self.entries.iter().map(|(_, size, _)| size).sum()
    }
}

/// The bytes of an entry: magic, writer, identity, row index, counts,
/// rows, index slots, segments; little-endian.
fn encode(table: &UnwindTable, writer: &[u8]) -> Vec<u8> {
    let rows = table.rows();
    let slots = table.index_slots();
    let segments = table.segments();
    let mut out = Vec::with_capacity(
        128 + (rows.len() + slots.len()) * ROW_BYTES + segments.len() * SEGMENT_BYTES,
    );
    out.extend_from_slice(MAGIC);
    put_bytes(&mut out, writer);
    match table.identity() {
        FileIdentity::BuildId(id) => {
            out.push(0);
            put_bytes(&mut out, id);
        }
        FileIdentity::ContentHash(hash) => {
            out.push(1);
            put_bytes(&mut out, &hash.to_le_bytes());
        }
    }
    let index = table.row_index();
    out.extend_from_slice(&index.base.to_le_bytes());
    out.extend_from_slice(&index.len.to_le_bytes());
    out.extend_from_slice(&index.shift.to_le_bytes());
    for count in [rows.len(), slots.len(), segments.len()] {
        out.extend_from_slice(&(count as u32).to_le_bytes());
    }
    for row in rows.iter().chain(slots) {
        out.extend_from_slice(&row.pc.to_le_bytes());
        out.extend_from_slice(&row.cfa_offset.to_le_bytes());
        out.extend_from_slice(&row.fp_offset.to_le_bytes());
        out.extend_from_slice(&row.ra_offset.to_le_bytes());
        out.extend_from_slice(&[row.cfa_rule, row.fp_rule, row.ra_rule, row.cfa_param]);
        out.extend_from_slice(&row._pad);
    }
    for s in segments {
        for v in [s.file_offset, s.file_size, s.vaddr] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Reads an entry front to back; every length is checked against what is
/// left.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.bytes.len() {
            return None;
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = self.u32()? as usize;
        if len > MAX_ID_BYTES {
            return None;
        }
        self.take(len)
    }

    fn rows(&mut self, count: usize) -> Option<Box<[UnwindRow]>> {
        let bytes = self.take(count.checked_mul(ROW_BYTES)?)?;
        Some(
            bytes
                .chunks_exact(ROW_BYTES)
                .map(|b| UnwindRow {
                    pc: u64::from_le_bytes(b[0..8].try_into().unwrap_or_default()),
                    cfa_offset: i32::from_le_bytes(b[8..12].try_into().unwrap_or_default()),
                    fp_offset: i16::from_le_bytes(b[12..14].try_into().unwrap_or_default()),
                    ra_offset: i16::from_le_bytes(b[14..16].try_into().unwrap_or_default()),
                    cfa_rule: b[16],
                    fp_rule: b[17],
                    ra_rule: b[18],
                    cfa_param: b[19],
                    _pad: b[20..24].try_into().unwrap_or_default(),
                })
                .collect(),
        )
    }
}

/// The table in `bytes`, `None` unless it is a whole entry written by
/// `writer` for `identity`.
fn decode(bytes: &[u8], writer: &[u8], identity: &FileIdentity) -> Option<UnwindTable> {
    let mut r = Reader { bytes };
    if r.take(MAGIC.len())? != MAGIC || r.bytes()? != writer {
        return None;
    }
    let stored = match r.array::<1>()? {
        [0] => FileIdentity::BuildId(r.bytes()?.into()),
        [1] => FileIdentity::ContentHash(u64::from_le_bytes(r.bytes()?.try_into().ok()?)),
        _ => return None,
    };
    if stored != *identity {
        return None;
    }
    let index = RowIndex {
        base: r.u64()?,
        len: r.u32()?,
        shift: r.u32()?,
    };
    let (rows, slots, segments) = (r.u32()? as usize, r.u32()? as usize, r.u32()? as usize);
    let rows = r.rows(rows)?;
    let slots = r.rows(slots)?;
    let segments = (0..segments)
        .map(|_| {
            Some(LoadSegment {
                file_offset: r.u64()?,
                file_size: r.u64()?,
                vaddr: r.u64()?,
            })
        })
        .collect::<Option<Box<[LoadSegment]>>>()?;
    if !r.bytes.is_empty() {
        return None;
    }
    UnwindTable::from_parts(stored, rows, index, slots, segments)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(id: &[u8]) -> UnwindTable {
        // Any ELF with .eh_frame.
        let data = std::fs::read("/bin/true").expect("a system binary");
        let mut table = UnwindTable::from_elf_bytes(&data).expect("a table of the test binary");
        table.set_identity(FileIdentity::BuildId(id.into()));
        table
    }

    fn same(a: &UnwindTable, b: &UnwindTable) {
        assert_eq!(a.identity(), b.identity());
        assert_eq!(a.rows(), b.rows());
        assert_eq!(a.row_index(), b.row_index());
        assert_eq!(a.index_slots(), b.index_slots());
        assert_eq!(a.segments(), b.segments());
    }

    #[test]
    fn a_table_comes_back_whole_from_its_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        let built = table(b"\x01\x02\x03");
        let mut cache = DiskTableCache::open_for(&path, (*b"writer").into()).unwrap();
        assert!(cache.load(built.identity()).is_none());
        cache.store(&built);
        let mut again = DiskTableCache::open_for(&path, (*b"writer").into()).unwrap();
        let loaded = again.load(built.identity()).expect("cached");
        same(&built, &loaded);
        assert_eq!(again.stats.hits, 1);
        assert!(!built.rows().is_empty());
        // The directory is the owner's alone.
        let mode = std::fs::metadata(&path).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o700
        );
    }

    #[test]
    fn only_stale_leftovers_of_writes_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        DiskTableCache::open_for(&path, (*b"writer").into()).unwrap();
        // Another clrbpf writing right now, and one that died an hour ago.
        let fresh = path.join(".tmp-77-123-unwind-ELF-aa");
        let stale = path.join(".tmp-78-456-unwind-ELF-bb");
        std::fs::write(&fresh, b"half").unwrap();
        std::fs::write(&stale, b"half").unwrap();
        let old = SystemTime::now() - Duration::from_secs(STALE_TEMP_SECS + 60);
        std::fs::File::options()
            .write(true)
            .open(&stale)
            .unwrap()
            .set_modified(old)
            .unwrap();
        DiskTableCache::open_for(&path, (*b"writer").into()).unwrap();
        assert!(
            fresh.exists(),
            "another writer's file in progress is left alone"
        );
        assert!(!stale.exists(), "a dead writer's leftover is removed");
    }

    #[test]
    fn entries_of_another_build_or_damaged_are_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        let built = table(b"\x01\x02\x03");
        DiskTableCache::open_for(&path, (*b"old build").into())
            .unwrap()
            .store(&built);
        let mut cache = DiskTableCache::open_for(&path, (*b"new build").into()).unwrap();
        assert!(cache.load(built.identity()).is_none());
        assert_eq!(cache.stats.rejected, 1);
        assert_eq!(cache.size_bytes(), 0, "the stale entry is removed");

        // Every truncation of a good entry is refused.
        cache.store(&built);
        let name = path.join(DiskTableCache::entry_name(built.identity()));
        let whole = std::fs::read(&name).unwrap();
        for len in [0, 7, 8, 20, whole.len() / 2, whole.len() - 1] {
            assert!(
                decode(&whole[..len], b"new build", built.identity()).is_none(),
                "{len} bytes"
            );
        }
        // So is an entry filed under another identity.
        assert!(decode(&whole, b"new build", &FileIdentity::ContentHash(7)).is_none());
        assert!(decode(&whole, b"new build", built.identity()).is_some());
    }

    #[test]
    fn untrusted_directories_and_symlinks_are_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let open = std::fs::create_dir(dir.path().join("open"));
        open.unwrap();
        std::fs::set_permissions(
            dir.path().join("open"),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let error = DiskTableCache::open_for(&dir.path().join("open"), (*b"w").into())
            .err()
            .expect("a world-writable cache is refused");
        assert!(error.to_string().contains("mode 0777"), "{error}");

        std::os::unix::fs::symlink(dir.path().join("open"), dir.path().join("link")).unwrap();
        assert!(DiskTableCache::open_for(&dir.path().join("link"), (*b"w").into()).is_err());

        // An entry planted as a symlink is not read.
        let path = dir.path().join("cache");
        let built = table(b"\x09");
        let mut cache = DiskTableCache::open_for(&path, (*b"w").into()).unwrap();
        cache.store(&built);
        let name = path.join(DiskTableCache::entry_name(built.identity()));
        let real = dir.path().join("elsewhere");
        std::fs::rename(&name, &real).unwrap();
        std::os::unix::fs::symlink(&real, &name).unwrap();
        assert!(cache.load(built.identity()).is_none());
    }

    #[test]
    fn the_oldest_entries_go_over_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache");
        let mut cache = DiskTableCache::open_for(&path, (*b"w").into()).unwrap();
        let first = table(b"\x01");
        cache.store(&first);
        let one = cache.size_bytes();
        cache.set_budget_bytes(one * 2);
        cache.store(&table(b"\x02"));
        // Entries written within the same clock tick sort by name order
        // at worst; make the first one clearly older.
        let old = SystemTime::UNIX_EPOCH;
        cache.entries[0].2 = old;
        cache.store(&table(b"\x03"));
        assert_eq!(cache.stats.evicted, 1);
        assert!(cache.size_bytes() <= one * 2);
        assert!(cache.load(first.identity()).is_none(), "the oldest went");
    }
}
