//! The ReadyToRun images of one process ([`ReadyToRunNames`]), and the
//! parsed assemblies every process of a run shares ([`AssemblyCache`]):
//! the framework's images are the same files in every .NET process on a
//! host, parsed once.
//!
//! A process's executable `.dll` mappings come from its mappings table at
//! each read; a frame in one is named through its image, opened the first
//! time it is needed through `/proc/PID/map_files` (the exact file mapped)
//! or, without `CAP_SYS_ADMIN`, inside the process's root without following
//! a symlink out of it. Images are keyed by the device and inode the
//! mappings report, as native files are.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use super::AssemblyImage;
use crate::process::{
    MappingTable, ProcFs,
    mapped_file::{MappedFileRef, open_mapped},
};
use crate::profile::{Frame, FrameKind, Module};
use crate::symbolize::clr_metadata::{ClrMetadata, MetadataError};
use crate::symbolize::native::FileKey;

/// The tier a ReadyToRun frame shows, as the runtime's jitdump names
/// precompiled code.
pub const READY_TO_RUN_TIER: &str = "PreJIT";

/// Parsed assemblies shared by every process of a run, within a byte
/// budget: past it the least recently used are dropped (and parsed again if
/// asked for). A file that is no assembly is remembered as such.
#[derive(Clone, Debug)]
pub struct AssemblyCache {
    inner: Arc<Mutex<CacheInner>>,
}

#[derive(Debug, Default)]
struct CacheInner {
    entries: HashMap<FileKey, CacheEntry>,
    bytes: usize,
    limit: usize,
    tick: u64,
    stats: AssemblyCacheStats,
    /// Metadata (of any assembly, IL-only too) that processes' memory
    /// readers hold, by file identity: read once while any holds it.
    metadata: HashMap<(u64, u64, u64, i64), Weak<ClrMetadata>>,
}

#[derive(Debug)]
struct CacheEntry {
    image: Option<Arc<AssemblyImage>>,
    bytes: usize,
    used_at: u64,
}

/// What the cache did, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AssemblyCacheStats {
    pub parsed: u64,
    /// Files that could not be opened or are no assembly.
    pub failed: u64,
    pub evicted: u64,
}

/// Files remembered as no assembly at most (a bound on a hostile process
/// mapping endless `.dll`s).
const MAX_NEGATIVE_ENTRIES: usize = 4096;

impl AssemblyCache {
    /// A cache holding at most `limit` bytes of parsed assemblies.
    pub fn new(limit: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(CacheInner {
                limit,
                ..CacheInner::default()
            })),
        }
    }

    /// The assembly with identity `key`, parsed from the file `open` gives
    /// the first time; `None` when it cannot be read or is no assembly.
    pub fn get_or_read(
        &self,
        key: FileKey,
        open: impl FnOnce() -> Option<File>,
    ) -> Option<Arc<AssemblyImage>> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(entry) = inner.entries.get_mut(&key) {
            entry.used_at = tick;
            return entry.image.clone();
        }
        let image = open().and_then(|file| match AssemblyImage::read(&file) {
            Ok(image) => Some(Arc::new(image)),
            Err(error) => {
                tracing::debug!(?key, %error, "no names from this assembly");
                None
            }
        });
        if image.is_some() {
            inner.stats.parsed += 1;
        } else {
            inner.stats.failed += 1;
        }
        let bytes = image.as_ref().map_or(64, |i| i.memory_bytes());
        inner.bytes += bytes;
        inner.entries.insert(
            key,
            CacheEntry {
                image: image.clone(),
                bytes,
                used_at: tick,
            },
        );
        inner.evict(key);
        image
    }

    /// The metadata of the assembly opened as `file`, shared with every
    /// other holder of the same file (device, inode, size, mtime): read
    /// only when no one holds it, freed with its last holder.
    pub fn shared_metadata(&self, file: &File) -> Result<Arc<ClrMetadata>, MetadataError> {
        let meta = file
            .metadata()
            .map_err(|source| MetadataError::Read { source })?;
        let mtime_ns = meta
            .mtime()
            .saturating_mul(1_000_000_000)
            .saturating_add(meta.mtime_nsec());
        let key = (meta.dev(), meta.ino(), meta.size(), mtime_ns);
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = inner.metadata.get(&key).and_then(Weak::upgrade) {
            return Ok(known);
        }
        let read = Arc::new(ClrMetadata::read(file)?);
        inner.metadata.retain(|_, held| held.strong_count() > 0);
        inner.metadata.insert(key, Arc::downgrade(&read));
        Ok(read)
    }

    pub fn stats(&self) -> AssemblyCacheStats {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stats
    }

    /// Bytes of parsed assemblies held.
    pub fn memory_bytes(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes
    }
}

impl CacheInner {
    /// Drops the least recently used entries (never `keep`, the one just
    /// added) while over the limit or the negative bound.
    fn evict(&mut self, keep: FileKey) {
        loop {
            let negatives = self.entries.values().filter(|e| e.image.is_none()).count();
            if self.bytes <= self.limit && negatives <= MAX_NEGATIVE_ENTRIES {
                return;
            }
            let victim = self
                .entries
                .iter()
                .filter(|(k, _)| **k != keep)
                .min_by_key(|(_, e)| e.used_at)
                .map(|(k, _)| *k);
            let Some(entry) = victim.and_then(|k| self.entries.remove(&k)) else {
                return;
            };
            self.bytes -= entry.bytes;
            self.stats.evicted += 1;
        }
    }
}

/// An executable mapping of an assembly file.
#[derive(Clone, Debug)]
struct ImageMapping {
    start: u64,
    end: u64,
    offset: u64,
    key: FileKey,
    path: Arc<str>,
    module: Arc<Module>,
}

/// Names the frames of one process's ReadyToRun code; see the module doc.
#[derive(Debug)]
pub struct ReadyToRunNames {
    pid: u32,
    cache: AssemblyCache,
    /// Sorted by start.
    mappings: Vec<ImageMapping>,
    tier: Arc<str>,
    /// Assembly names, interned.
    assemblies: Mutex<HashMap<FileKey, Option<Arc<str>>>>,
    named: AtomicU64,
}

impl ReadyToRunNames {
    pub fn new(pid: u32, cache: AssemblyCache) -> Self {
        Self {
            pid,
            cache,
            mappings: Vec::new(),
            tier: READY_TO_RUN_TIER.into(),
            assemblies: Mutex::default(),
            named: AtomicU64::new(0),
        }
    }

    /// Takes the process's executable assembly mappings from a new read of
    /// its mappings (modules of unchanged mappings are kept, so their
    /// frames stay the same).
    pub fn sync_mappings(&mut self, mappings: &MappingTable) {
        let old = std::mem::take(&mut self.mappings);
        for m in mappings.iter() {
            let Some(path) = m.path.as_ref() else {
                continue;
            };
            if !m.is_executable() || m.is_anonymous() || m.inode == 0 || !is_assembly_path(path) {
                continue;
            }
            let key = FileKey {
                dev_major: m.dev_major,
                dev_minor: m.dev_minor,
                inode: m.inode,
            };
            let same = old
                .iter()
                .find(|o| (o.start, o.end, o.offset, o.key) == (m.start, m.end, m.offset, key));
            let module = same.map_or_else(
                || {
                    Arc::new(Module {
                        path: path.clone(),
                        build_id: None,
                        memory_start: m.start,
                        memory_limit: m.end,
                        file_offset: m.offset,
                        has_functions: true,
                    })
                },
                |o| o.module.clone(),
            );
            self.mappings.push(ImageMapping {
                start: m.start,
                end: m.end,
                offset: m.offset,
                key,
                path: path.clone(),
                module,
            });
        }
        self.mappings.sort_by_key(|m| m.start);
    }

    /// Whether the process maps any assembly as code.
    pub fn has_images(&self) -> bool {
        !self.mappings.is_empty()
    }

    /// Frames named so far.
    pub fn named(&self) -> u64 {
        self.named.load(Ordering::Relaxed)
    }

    /// The frame of the ReadyToRun method whose code holds `lookup`,
    /// reported at `addr`.
    pub fn frame(&self, lookup: u64, addr: u64) -> Option<Arc<Frame>> {
        let index = self.mappings.partition_point(|m| m.start <= lookup);
        let mapping = self.mappings.get(index.checked_sub(1)?)?;
        if lookup >= mapping.end {
            return None;
        }
        let image = self
            .cache
            .get_or_read(mapping.key, || open_mapping(self.pid, mapping))?;
        let offset = (lookup - mapping.start).checked_add(mapping.offset)?;
        let token = image.token_at_file_offset(offset)?;
        let name = image.metadata.method_name(token)?;
        self.named.fetch_add(1, Ordering::Relaxed);
        Some(Arc::new(Frame {
            kind: FrameKind::Managed,
            name: name.into(),
            system_name: None,
            jit_tier: Some(self.tier.clone()),
            module: Some(mapping.module.clone()),
            address: addr,
            file: self.assembly(mapping.key, &image),
            line: 0,
            inlined: Vec::new(),
        }))
    }

    fn assembly(&self, key: FileKey, image: &AssemblyImage) -> Option<Arc<str>> {
        let mut names = self
            .assemblies
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        names
            .entry(key)
            .or_insert_with(|| image.metadata.assembly_name().map(Arc::from))
            .clone()
    }
}

/// Whether a mapped file's name is an assembly's.
fn is_assembly_path(path: &str) -> bool {
    let lower = |suffix: &str| {
        path.len() >= suffix.len()
            && path.as_bytes()[path.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
    };
    lower(".dll") || lower(".exe")
}

/// Opens the file of a mapping: the exact file mapped
/// ([`crate::process::mapped_file`]).
fn open_mapping(pid: u32, mapping: &ImageMapping) -> Option<File> {
    let mapped = MappedFileRef {
        start: mapping.start,
        end: mapping.end,
        dev_major: mapping.key.dev_major,
        dev_minor: mapping.key.dev_minor,
        inode: mapping.key.inode,
        path: &mapping.path,
    };
    open_mapped(&ProcFs::default(), pid, &mapped)
        .inspect_err(|e| tracing::debug!(pid, "ReadyToRun image: {e}"))
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assembly_paths() {
        assert!(is_assembly_path(
            "/usr/share/dotnet/System.Private.CoreLib.dll"
        ));
        assert!(is_assembly_path("/app/App.DLL"));
        assert!(is_assembly_path("/app/tool.exe"));
        assert!(!is_assembly_path("/usr/lib/libcoreclr.so"));
        assert!(!is_assembly_path("dll"));
    }

    /// Two readers of the same file hold one copy of its metadata, freed
    /// with the last of them.
    #[test]
    fn metadata_is_shared_while_held() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("Names.dll");
        std::fs::write(&path, include_bytes!("../clr_metadata/testdata/Names.dll")).expect("write");
        let cache = AssemblyCache::new(0);
        let open = || File::open(&path).expect("open");
        let first = cache.shared_metadata(&open()).expect("metadata");
        let second = cache.shared_metadata(&open()).expect("metadata");
        assert!(Arc::ptr_eq(&first, &second), "read once");
        let weak = Arc::downgrade(&first);
        drop((first, second));
        assert!(weak.upgrade().is_none(), "freed with its last holder");
        let again = cache.shared_metadata(&open()).expect("read again");
        assert_eq!(again.assembly_name(), Some("Names"));
    }

    #[test]
    fn the_cache_stays_within_its_budget() {
        let cache = AssemblyCache::new(1 << 30);
        let key = |inode| FileKey {
            dev_major: 8,
            dev_minor: 1,
            inode,
        };
        // Files that are no assembly are remembered, bounded.
        for inode in 0..(MAX_NEGATIVE_ENTRIES as u64 + 10) {
            assert!(cache.get_or_read(key(inode), || None).is_none());
        }
        let stats = cache.stats();
        assert_eq!(stats.failed, MAX_NEGATIVE_ENTRIES as u64 + 10);
        assert!(stats.evicted >= 10);
        // Asked again: no new open.
        let last = key(MAX_NEGATIVE_ENTRIES as u64 + 9);
        assert!(
            cache
                .get_or_read(last, || panic!("cached, not opened again"))
                .is_none()
        );
    }
}
