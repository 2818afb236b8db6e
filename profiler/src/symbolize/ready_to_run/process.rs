//! The ReadyToRun images of one process ([`ReadyToRunNames`]), and the
//! parsed assemblies every process of a run shares ([`AssemblyCache`]):
//! the framework's images are the same files in every .NET process on a
//! host, parsed once.
//!
//! A process's executable `.dll` mappings come from its mappings table at
//! each read; a frame in one is named through its image, opened the first
//! time it is needed through `/proc/PID/map_files` (the exact file mapped)
//! or, without `CAP_SYS_ADMIN`, inside the process's root without following
//! a symlink out of it; the mapping remembers the file's identity
//! ([`AssemblyKey`]: device, inode, size, mtime of the file opened) and the
//! shared cache is keyed by it.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use super::AssemblyImage;
use crate::memory_budget::{self, Charge, Drops, Pool};
use crate::process::{
    MappingTable, ProcFs,
    mapped_file::{MappedFileRef, open_mapped},
};
use crate::profile::{Frame, FrameKind, Module};
use crate::symbolize::assembly_file::read_metadata_at_most;
use crate::symbolize::native::FileKey;
use clrbpf_parse::clr_metadata::{ClrMetadata, MetadataError};

/// The tier a ReadyToRun frame shows, as the runtime's jitdump names
/// precompiled code.
pub const READY_TO_RUN_TIER: &str = "PreJIT";

/// Parsed assemblies shared by every process of a run, within a byte
/// budget: past it the least recently used are dropped (and parsed again if
/// asked for). A file that is no assembly is remembered as such, and so is
/// one whose parse holds more than half the budget ([`Self::image_share`]):
/// it is refused once, counted, and never read again while remembered, so
/// it cannot evict every other tenant's images (CoreLib) and then be read
/// again at each frame. Files are read without the cache's lock held.
#[derive(Clone, Debug)]
pub struct AssemblyCache {
    inner: Arc<Mutex<CacheInner>>,
}

/// Identity of an assembly file, from `fstat` of the file opened: device,
/// inode, size and mtime, so a file deleted and its inode reused for
/// another is another entry (never named with the old file's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AssemblyKey {
    pub dev: u64,
    pub inode: u64,
    pub size: u64,
    pub mtime_ns: i64,
}

impl AssemblyKey {
    /// The identity of the file opened as `file`.
    pub fn of(file: &File) -> Option<Self> {
        let meta = file.metadata().ok()?;
        Some(Self {
            dev: meta.dev(),
            inode: meta.ino(),
            size: meta.size(),
            mtime_ns: meta
                .mtime()
                .saturating_mul(1_000_000_000)
                .saturating_add(meta.mtime_nsec()),
        })
    }
}

#[derive(Debug, Default)]
struct CacheInner {
    entries: HashMap<AssemblyKey, CacheEntry>,
    bytes: usize,
    limit: usize,
    tick: u64,
    /// Entries without an image (no assembly, or refused).
    negatives: usize,
    stats: AssemblyCacheStats,
    /// Metadata (of any assembly, IL-only too) that processes' memory
    /// readers hold, by file identity: read once while any holds it, and
    /// charged once to [`Pool::Metadata`]. `None`: refused (over its share).
    metadata: HashMap<AssemblyKey, Option<Weak<HeldMetadata>>>,
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
    /// Images refused: their parse holds more than [`AssemblyCache::image_share`].
    pub refused: u64,
}

/// Files remembered as no assembly at most (a bound on a hostile process
/// mapping endless `.dll`s).
const MAX_NEGATIVE_ENTRIES: usize = 4096;

/// What a negative entry is charged.
const NEGATIVE_ENTRY_BYTES: usize = 64;

/// Image metadata a memory reader holds, charged to [`Pool::Metadata`]
/// until its last holder drops it.
#[derive(Debug)]
pub struct HeldMetadata {
    metadata: ClrMetadata,
    _charge: Charge,
}

impl std::ops::Deref for HeldMetadata {
    type Target = ClrMetadata;

    fn deref(&self) -> &ClrMetadata {
        &self.metadata
    }
}

impl HeldMetadata {
    /// Reads the metadata of `file`, refused (as too large) when it is over
    /// the budget's image share or the metadata pool has no room for it.
    pub fn read(file: &File) -> Result<Self, MetadataError> {
        let share = memory_budget::current().image_share_bytes();
        let too_large = || MetadataError::TooLarge {
            limit: u32::try_from(share).unwrap_or(u32::MAX),
        };
        let metadata = read_metadata_at_most(file, u32::try_from(share).unwrap_or(u32::MAX))?;
        let bytes = metadata.memory_bytes() as u64;
        if bytes > share {
            return Err(too_large());
        }
        let mut charge = Charge::new(Pool::Metadata);
        if !charge.try_add(bytes) {
            return Err(MetadataError::TooLarge {
                limit: u32::try_from(Pool::Metadata.usage().2).unwrap_or(u32::MAX),
            });
        }
        Ok(Self {
            metadata,
            _charge: charge,
        })
    }
}

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

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most bytes one parsed image may hold: half the cache.
    pub fn image_share(&self) -> usize {
        self.lock().limit / 2
    }

    /// The assembly with identity `key`, parsed from the file `open` gives
    /// the first time (if it still is that file); `None` when it cannot be
    /// read, is no assembly, or is refused.
    pub fn get_or_read(
        &self,
        key: AssemblyKey,
        open: impl FnOnce() -> Option<File>,
    ) -> Option<Arc<AssemblyImage>> {
        if let Some(known) = self.lookup(key) {
            return known;
        }
        // Read without the lock: other processes' frames are named
        // meanwhile (a big image takes tens of milliseconds).
        let share = self.image_share();
        let read = open()
            .filter(|file| AssemblyKey::of(file) == Some(key))
            .map(|file| AssemblyImage::read(&file));
        let mut refused = false;
        let image = match read {
            Some(Ok(image)) if image.memory_bytes() > share => {
                refused = true;
                None
            }
            Some(Ok(image)) => Some(Arc::new(image)),
            Some(Err(error)) => {
                if let super::ReadyToRunError::TooLarge { .. } = error {
                    // Over the budget's share for reading one file: counted
                    // with the unwinder's files over it (once: remembered).
                    let drops = memory_budget::drops();
                    Drops::count(&drops.files, 1);
                    Drops::count(&drops.file_bytes, key.size);
                }
                tracing::debug!(?key, %error, "no names from this assembly");
                None
            }
            None => None,
        };
        let mut inner = self.lock();
        if let Some(entry) = inner.entries.get(&key) {
            // Another thread read it meanwhile.
            return entry.image.clone();
        }
        if refused {
            inner.stats.refused += 1;
            Drops::count(&memory_budget::drops().images, 1);
            tracing::debug!(?key, share, "assembly refused: over its share of the cache");
        } else if image.is_some() {
            inner.stats.parsed += 1;
        } else {
            inner.stats.failed += 1;
        }
        inner.tick += 1;
        let used_at = inner.tick;
        let bytes = image
            .as_ref()
            .map_or(NEGATIVE_ENTRY_BYTES, |i| i.memory_bytes());
        inner.bytes += bytes;
        inner.negatives += usize::from(image.is_none());
        inner.entries.insert(
            key,
            CacheEntry {
                image: image.clone(),
                bytes,
                used_at,
            },
        );
        inner.evict(key);
        image
    }

    /// The cached entry of `key` (`Some(None)`: known to have no image).
    fn lookup(&self, key: AssemblyKey) -> Option<Option<Arc<AssemblyImage>>> {
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        let entry = inner.entries.get_mut(&key)?;
        entry.used_at = tick;
        Some(entry.image.clone())
    }

    /// The metadata of the assembly opened as `file`, shared with every
    /// other holder of the same file (device, inode, size, mtime): read
    /// only when no one holds it, charged once, freed with its last holder.
    /// One over its share is refused, and the refusal remembered (counted
    /// once).
    pub fn shared_metadata(&self, file: &File) -> Result<Arc<HeldMetadata>, MetadataError> {
        let key = AssemblyKey::of(file).ok_or(MetadataError::Read {
            source: std::io::Error::other("fstat failed"),
        })?;
        let refusal = || MetadataError::TooLarge {
            limit: u32::try_from(memory_budget::current().image_share_bytes()).unwrap_or(u32::MAX),
        };
        let mut inner = self.lock();
        match inner.metadata.get(&key) {
            Some(None) => return Err(refusal()),
            Some(Some(held)) => {
                if let Some(known) = held.upgrade() {
                    return Ok(known);
                }
            }
            None => {}
        }
        inner
            .metadata
            .retain(|_, held| held.as_ref().is_none_or(|h| h.strong_count() > 0));
        if inner.metadata.len() >= MAX_NEGATIVE_ENTRIES {
            // Refusals of files no longer asked about are forgotten first.
            inner.metadata.retain(|_, held| held.is_some());
        }
        match HeldMetadata::read(file) {
            Ok(read) => {
                let read = Arc::new(read);
                inner.metadata.insert(key, Some(Arc::downgrade(&read)));
                Ok(read)
            }
            Err(error @ MetadataError::TooLarge { .. }) => {
                inner.metadata.insert(key, None);
                Drops::count(&memory_budget::drops().images, 1);
                Err(error)
            }
            Err(error) => Err(error),
        }
    }

    pub fn stats(&self) -> AssemblyCacheStats {
        self.lock().stats
    }

    /// Bytes of parsed assemblies held.
    pub fn memory_bytes(&self) -> usize {
        self.lock().bytes
    }
}

impl CacheInner {
    /// Drops the least recently used entries (never `keep`, the one just
    /// added) while over the limit or the negative bound. No entry holds
    /// more than half the limit, so one insert never empties the cache.
    fn evict(&mut self, keep: AssemblyKey) {
        while self.bytes > self.limit || self.negatives > MAX_NEGATIVE_ENTRIES {
            let only_negatives = self.bytes <= self.limit;
            let victim = self
                .entries
                .iter()
                .filter(|(k, e)| **k != keep && (!only_negatives || e.image.is_none()))
                .min_by_key(|(_, e)| e.used_at)
                .map(|(k, _)| *k);
            let Some(entry) = victim.and_then(|k| self.entries.remove(&k)) else {
                return;
            };
            self.bytes -= entry.bytes;
            self.negatives -= usize::from(entry.image.is_none());
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
    /// The identity of the file mapped, from its first open (`None`: it
    /// could not be opened): each mapping is opened once, not per frame.
    identity: Arc<OnceLock<Option<AssemblyKey>>>,
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
    assemblies: Mutex<HashMap<AssemblyKey, Option<Arc<str>>>>,
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
                identity: Arc::default(),
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
        let (key, image) = self.image(mapping)?;
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
            file: self.assembly(key, &image),
            line: 0,
            inlined: Vec::new(),
        }))
    }

    /// The parsed image of `mapping` and its identity.
    fn image(&self, mapping: &ImageMapping) -> Option<(AssemblyKey, Arc<AssemblyImage>)> {
        if let Some(known) = mapping.identity.get() {
            let key = (*known)?;
            let image = self
                .cache
                .get_or_read(key, || open_mapping(self.pid, mapping))?;
            return Some((key, image));
        }
        let mut file = open_mapping(self.pid, mapping);
        let key = file.as_ref().and_then(AssemblyKey::of);
        let key = (*mapping.identity.get_or_init(|| key))?;
        let image = self.cache.get_or_read(key, || file.take())?;
        Some((key, image))
    }

    fn assembly(&self, key: AssemblyKey, image: &AssemblyImage) -> Option<Arc<str>> {
        let mut names = self
            .assemblies
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if names.len() >= MAX_NEGATIVE_ENTRIES {
            // Files replaced under the same mappings over a long run.
            names.clear();
        }
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
        std::fs::write(
            &path,
            include_bytes!("../../../../profiler-parse/src/clr_metadata/testdata/Names.dll"),
        )
        .expect("write");
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
        let key = |inode| AssemblyKey {
            dev: 8,
            inode,
            size: 4096,
            mtime_ns: 1,
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

    fn names_dll(dir: &tempfile::TempDir, name: &str) -> std::path::PathBuf {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            include_bytes!("../../../../profiler-parse/src/clr_metadata/testdata/Names.dll"),
        )
        .expect("write");
        path
    }

    /// An image whose parse is over half the cache is refused once and
    /// remembered: asked again, it is not opened (nor read) again, and the
    /// images already held stay.
    #[test]
    fn an_image_over_its_share_is_refused_once_and_remembered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = names_dll(&dir, "Big.dll");
        let open = || File::open(&path).ok();
        let key = AssemblyKey::of(&File::open(&path).expect("open")).expect("fstat");
        let bytes = AssemblyImage::read(&File::open(&path).expect("open"))
            .expect("parse")
            .memory_bytes();
        // Fits: held.
        let roomy = AssemblyCache::new(bytes * 2);
        assert!(roomy.get_or_read(key, open).is_some());
        assert_eq!(roomy.stats().parsed, 1);
        // Over half the cache: refused, counted, remembered.
        let before = memory_budget::drops().snapshot().images;
        let small = AssemblyCache::new(bytes * 2 - 2);
        assert!(small.get_or_read(key, open).is_none());
        assert!(
            small
                .get_or_read(key, || panic!("remembered, not opened again"))
                .is_none()
        );
        assert_eq!(small.stats().refused, 1);
        assert_eq!(small.stats().parsed, 0);
        assert!(memory_budget::drops().snapshot().images > before);
        assert!(small.memory_bytes() <= NEGATIVE_ENTRY_BYTES);
    }

    /// Issue 33, defect 6: two images over their share alternating in one
    /// stack are read once each, not at every frame: 1,000 frames that
    /// alternate between them open each file once, and the cache holds
    /// only their two remembered refusals.
    #[test]
    fn two_images_over_their_share_alternating_are_read_once_each() {
        let dir = tempfile::tempdir().expect("tempdir");
        let paths = [names_dll(&dir, "BigA.dll"), names_dll(&dir, "BigB.dll")];
        let keys = paths
            .each_ref()
            .map(|p| AssemblyKey::of(&File::open(p).expect("open")).expect("fstat"));
        assert_ne!(keys[0], keys[1], "two files");
        let bytes = AssemblyImage::read(&File::open(&paths[0]).expect("open"))
            .expect("parse")
            .memory_bytes();
        let cache = AssemblyCache::new(bytes * 2 - 2);
        let opens = std::cell::Cell::new(0u32);
        for frame in 0..1_000 {
            let which = frame % 2;
            let image = cache.get_or_read(keys[which], || {
                opens.set(opens.get() + 1);
                File::open(&paths[which]).ok()
            });
            assert!(image.is_none(), "over its share: refused");
        }
        assert_eq!(opens.get(), 2, "each image opened and read once");
        let stats = cache.stats();
        assert_eq!((stats.refused, stats.parsed), (2, 0));
        assert!(cache.memory_bytes() <= 2 * NEGATIVE_ENTRY_BYTES);
    }

    /// A file over the budget's share for reading one file is not read,
    /// and is counted once with the files over the budget.
    #[test]
    fn a_file_over_the_read_share_is_counted_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = names_dll(&dir, "Huge.dll");
        let share = memory_budget::current().file_read_bytes();
        File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_len(share + 1))
            .expect("grow the file (sparse)");
        let key = AssemblyKey::of(&File::open(&path).expect("open")).expect("fstat");
        let before = memory_budget::drops().snapshot();
        let cache = AssemblyCache::new(64 << 20);
        assert!(cache.get_or_read(key, || File::open(&path).ok()).is_none());
        assert!(cache.get_or_read(key, || panic!("remembered")).is_none());
        let after = memory_budget::drops().snapshot();
        assert!(after.files > before.files);
        assert!(after.file_bytes >= before.file_bytes + share);
    }

    /// The cache is keyed by the file's size and mtime too: a file whose
    /// inode was reused (or rewritten in place) is another entry, and a
    /// file opened that is not the one keyed is not read under its key.
    #[test]
    fn a_reused_inode_is_another_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = names_dll(&dir, "Reused.dll");
        let cache = AssemblyCache::new(64 << 20);
        let first = AssemblyKey::of(&File::open(&path).expect("open")).expect("fstat");
        assert!(
            cache
                .get_or_read(first, || File::open(&path).ok())
                .is_some()
        );
        let other = AssemblyKey {
            mtime_ns: first.mtime_ns + 1,
            ..first
        };
        assert!(
            cache
                .get_or_read(other, || File::open(&path).ok())
                .is_none(),
            "the file opened is not the one keyed: nothing read under that key"
        );
        assert!(cache.get_or_read(first, || panic!("cached")).is_some());
    }

    /// The metadata memory readers share is charged to its pool once per
    /// file, given back with its last holder; one over the image share is
    /// refused and the refusal remembered.
    #[test]
    fn shared_metadata_is_charged_once_per_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = names_dll(&dir, "Charged.dll");
        let cache = AssemblyCache::new(0);
        let open = || File::open(&path).expect("open");
        let first = cache.shared_metadata(&open()).expect("metadata");
        let bytes = first.memory_bytes() as u64;
        let (used, _, _) = Pool::Metadata.usage();
        assert!(used >= bytes, "charged");
        let second = cache.shared_metadata(&open()).expect("metadata");
        assert!(Arc::ptr_eq(&first, &second));
        // Once: only one file's bytes were charged for both (other tests
        // charge the pool at the same time, so this one is checked by the
        // charge its holder carries).
        assert_eq!(first._charge.bytes(), bytes);
        drop((first, second));
        // Remembered refusals answer without a read.
        let key = AssemblyKey::of(&open()).expect("fstat");
        cache.lock().metadata.insert(key, None);
        assert!(matches!(
            cache.shared_metadata(&open()),
            Err(MetadataError::TooLarge { .. })
        ));
    }
}
