//! Native and kernel frames, through blazesym.
//!
//! A user address is turned into (file, file offset) with the process's
//! mappings, and the file is opened once, through `/proc/PID/map_files`
//! (which works for deleted files and files in other mount namespaces), and
//! kept open: blazesym reads it as `/proc/self/fd/N`. So frames of a process
//! that exited before its samples were symbolized still get names, as long
//! as its mappings were seen while it ran. Results are cached per
//! (file, offset) and per kernel address.
//!
//! Bounded for a long run over a churning host: each file counts the
//! processes that map it ([`NativeSymbolizer::prepare`]) and is closed, with
//! blazesym's data for it, when the last of them is forgotten
//! ([`NativeSymbolizer::forget_process`], on the kernel's exit event, after
//! the process's samples were named). Open files and cached frames are also
//! capped ([`NativeLimits`]), least recently used first, and every eviction
//! is counted in [`NativeStats`].

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    num::NonZeroUsize,
    os::fd::AsRawFd,
    path::PathBuf,
    sync::Arc,
};

use blazesym::MaybeDefault;
use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    evict::{self, Evict},
    source::{Elf, Kernel, Source},
};
use lru::LruCache;

use super::debug_file::{self, LoadSegment};
use super::debug_lookup::{self, DebugLookupStats};
use super::kallsyms::KernelSymbolFiles;
use super::symbol_server::{DebugDownloads, DownloadLimits, DownloadStats, SymbolServer};
use crate::memory_budget::{Charge, OverBudget, Pool};
use crate::profile::{Frame, FrameKind, InlinedFunction, Module};

/// Bounds of a [`NativeSymbolizer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativeLimits {
    /// Files kept open at once (each is one descriptor of ours and one of
    /// blazesym's); past it the least recently used is closed, and opened
    /// again if a live process needs it.
    pub max_open_files: usize,
    /// Named user frames cached, per (file, offset).
    pub max_user_frames: usize,
    /// Named kernel frames cached, per address.
    pub max_kernel_frames: usize,
}

impl Default for NativeLimits {
    fn default() -> Self {
        Self {
            // Well under the usual soft RLIMIT_NOFILE of 1024, two
            // descriptors per file.
            max_open_files: 384,
            max_user_frames: 1 << 17,
            max_kernel_frames: 1 << 16,
        }
    }
}

/// Identity of a mapped file: device and inode as /proc/PID/maps reports
/// them, so the same library in many processes is opened once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileKey {
    pub dev_major: u32,
    pub dev_minor: u32,
    pub inode: u64,
}

/// The part of a file-backed executable mapping symbolization needs.
#[derive(Clone, Copy, Debug)]
pub struct MappedFile<'a> {
    pub pid: u32,
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    pub key: FileKey,
    /// Path as the process sees it.
    pub path: &'a str,
}

/// A file mapping's identity: the file and where it is mapped.
type MappingKey = (FileKey, u64, u64, u64);

/// Files without a debug file listed in the summary.
pub const MAX_MISSING_LISTED: usize = 32;

/// Most mappings given their own module; past it frames keep the file's
/// module (no range), so a host with endless `dlopen`s stays bounded.
const MAX_MAPPING_MODULES: usize = 65_536;

/// A mapping's pprof module and how many known processes use it (forked
/// processes share their parent's layout).
struct MappingModule {
    module: Arc<Module>,
    users: u32,
}

struct OpenedElf {
    /// Held open so `fd_path` stays valid after the process exits.
    file: File,
    module: Arc<Module>,
    /// Its debug file, when one with its build id was found (set once,
    /// when found later, from a symbol server).
    debug: std::sync::OnceLock<DebugElf>,
}

/// A debug file (symbols and DWARF of a stripped file), with the
/// original file's `PT_LOAD` segments: a file offset of the original is
/// looked up at its virtual offset in the debug file.
struct DebugElf {
    file: File,
    segments: Vec<LoadSegment>,
    /// An estimate of what blazesym holds for it, in the debug-file pool.
    _charge: Charge,
}

fn fd_path(file: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

impl OpenedElf {
    fn fd_path(&self) -> PathBuf {
        fd_path(&self.file)
    }
}

/// The share of a debug file's size charged to [`Pool::DebugFiles`] as
/// what blazesym parses of it (symbol table, line programs of the units
/// asked for), a rough eighth.
const DEBUG_FILE_CHARGE_DIVISOR: u64 = 8;

/// One file as symbolization knows it: open (or found unopenable) once.
struct KnownFile {
    opened: Option<Arc<OpenedElf>>,
    /// Names this opening in the frame cache, so a file closed and opened
    /// again (or an inode reused) never meets the old one's frames.
    generation: u64,
}

/// Counts of what could not be named and what was let go, for the end
/// summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NativeStats {
    pub files_opened: u64,
    pub files_unopenable: u64,
    pub unresolved_user: u64,
    pub unresolved_kernel: u64,
    /// Files closed because no live process maps them any more.
    pub files_closed: u64,
    /// Files closed by the open-file bound while a process still mapped them.
    pub files_evicted: u64,
    /// Cached frames dropped by the frame-cache bounds.
    pub frames_evicted: u64,
    /// Files opened again unchanged after they were closed, their cached
    /// frames found again.
    pub files_reopened: u64,
    /// Processes let go of through [`NativeSymbolizer::forget_process`].
    pub processes_forgotten: u64,
    /// Files given a debug file (`--debug-dir`, the target's root, the
    /// host), and files with a build id for which none was found.
    pub debug_files_found: u64,
    pub debug_files_missing: u64,
    /// Debug files found but over the memory budget's share.
    pub debug_files_over_budget: u64,
    /// User frames named by a debug file.
    pub named_by_debug_file: u64,
    /// What the lookups came across (wrong build ids, sizes, bad links).
    pub debug_lookup: DebugLookupStats,
}

pub struct NativeSymbolizer {
    symbolizer: Symbolizer,
    limits: NativeLimits,
    files: LruCache<FileKey, KnownFile>,
    /// How many known processes map each file (whether open or not).
    file_users: HashMap<FileKey, u32>,
    /// The files each known process maps.
    process_files: HashMap<u32, HashSet<FileKey>>,
    next_generation: u64,
    /// Files closed, with their build id and the generation their frames
    /// are cached under: opened again unchanged (the next run of a
    /// short-lived program maps the same libraries), a file gets its old
    /// generation back and its frames are found instead of named again,
    /// and never left unreachable in the frame cache to age out.
    closed: LruCache<FileKey, (Arc<str>, u64)>,
    user_cache: LruCache<(u64, u64), Arc<Frame>>,
    kernel_cache: LruCache<u64, Arc<Frame>>,
    /// The pprof mapping of each file mapping seen: the file's module with
    /// the mapping's real range and offset, shared by its frames.
    mapping_modules: HashMap<MappingKey, MappingModule>,
    /// The mappings each known process's frames were given, so they go
    /// when the last process using them is forgotten (each process maps
    /// its files elsewhere: a host starting processes all day would
    /// otherwise keep one module per mapping of every process it saw).
    process_mappings: HashMap<u32, HashSet<MappingKey>>,
    kernel_module: Arc<Module>,
    /// Which kallsyms names a kernel address (this boot's kept table or
    /// the live file).
    kernel_files: KernelSymbolFiles,
    /// `--debug-dir`s, searched first for debug files (then the download
    /// cache, when symbol servers are set).
    debug_dirs: Vec<PathBuf>,
    /// Debug files asked of symbol servers.
    downloads: Option<DebugDownloads>,
    /// Open files whose debug file is being downloaded, with their build id.
    awaiting_debug: HashMap<FileKey, String>,
    /// Files (path, build id) no place had a debug file for, the first
    /// [`MAX_MISSING_LISTED`], for the summary.
    pub missing_debug: Vec<(Arc<str>, String)>,
    pub stats: NativeStats,
}

impl Default for NativeSymbolizer {
    fn default() -> Self {
        Self::new()
    }
}

fn at_least_one(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN)
}

impl NativeSymbolizer {
    pub fn new() -> Self {
        Self::with_limits(NativeLimits::default())
    }

    pub fn with_limits(limits: NativeLimits) -> Self {
        let symbolizer = Symbolizer::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            // Debug files are found (and their build ids checked) by
            // debug_lookup, never by name alone.
            .set_debug_dirs(Some(Vec::<PathBuf>::new()))
            .build();
        Self {
            symbolizer,
            limits,
            files: LruCache::new(at_least_one(limits.max_open_files)),
            file_users: HashMap::new(),
            process_files: HashMap::new(),
            next_generation: 0,
            closed: LruCache::new(at_least_one(limits.max_open_files.saturating_mul(4))),
            user_cache: LruCache::new(at_least_one(limits.max_user_frames)),
            kernel_cache: LruCache::new(at_least_one(limits.max_kernel_frames)),
            mapping_modules: HashMap::new(),
            process_mappings: HashMap::new(),
            kernel_module: Arc::new(Module {
                path: "[kernel.kallsyms]".into(),
                build_id: None,
                memory_start: 0,
                memory_limit: 0,
                file_offset: 0,
                has_functions: true,
            }),
            kernel_files: KernelSymbolFiles::new(None),
            debug_dirs: Vec::new(),
            downloads: None,
            awaiting_debug: HashMap::new(),
            missing_debug: Vec::new(),
            stats: NativeStats::default(),
        }
    }

    /// Names kernel frames from this boot's table of kallsyms kept in
    /// `cache_dir` (written there the first time), for addresses in the
    /// core kernel's text.
    pub fn keep_kernel_symbols_in(&mut self, cache_dir: Option<PathBuf>) {
        self.kernel_files = KernelSymbolFiles::new(cache_dir);
    }

    /// Looks for debug files in `dirs` (`--debug-dir`, at most
    /// [`debug_lookup::MAX_DEBUG_DIRS`]) before the usual places.
    pub fn set_debug_dirs(&mut self, dirs: Vec<PathBuf>) {
        self.debug_dirs = dirs;
        self.debug_dirs.truncate(debug_lookup::MAX_DEBUG_DIRS);
    }

    /// Asks `servers` for debug files no local place has, into
    /// `cache_dir/debug` (off the sampling path, see [`DebugDownloads`]).
    pub fn set_symbol_servers(
        &mut self,
        servers: Vec<SymbolServer>,
        cache_dir: &std::path::Path,
        limits: DownloadLimits,
    ) {
        self.downloads = DebugDownloads::start(servers, cache_dir, limits);
        if let Some(downloads) = &self.downloads {
            self.debug_dirs.push(downloads.dir.clone());
        }
    }

    /// Waits until the debug files asked for arrived, or `deadline`.
    pub fn wait_for_downloads(&self, deadline: std::time::Instant) {
        if let Some(downloads) = &self.downloads {
            downloads.wait_until(deadline);
        }
    }

    /// What the downloads came to.
    pub fn download_stats(&self) -> Option<DownloadStats> {
        self.downloads.as_ref().map(DebugDownloads::stats)
    }

    fn note_missing(&mut self, path: &str, build_id: &str) {
        self.stats.debug_files_missing += 1;
        if self.missing_debug.len() < MAX_MISSING_LISTED
            && !self.missing_debug.iter().any(|(_, id)| id == build_id)
        {
            self.missing_debug.push((path.into(), build_id.to_owned()));
        }
    }

    /// Gives the file of `mapping` the debug file that was downloaded for
    /// it, once its download finished; its frames are named afresh.
    fn attach_downloaded(&mut self, mapping: &MappedFile<'_>) {
        let Some(id) = self.awaiting_debug.get(&mapping.key) else {
            return;
        };
        let Some(downloads) = &self.downloads else {
            return;
        };
        if downloads.is_pending(id) {
            return;
        }
        let Some(id) = self.awaiting_debug.remove(&mapping.key) else {
            return;
        };
        let Some(opened) = self.files.peek(&mapping.key).and_then(|k| k.opened.clone()) else {
            return;
        };
        match self.debug_elf(mapping, &opened.file, &id, false) {
            Some(found) => {
                let _ = opened.debug.set(found);
                self.next_generation += 1;
                let generation = self.next_generation;
                if let Some(known) = self.files.get_mut(&mapping.key) {
                    known.generation = generation;
                }
            }
            None => self.note_missing(mapping.path, &id),
        }
    }

    /// Opens (once) the file behind a mapping while its process is alive,
    /// and counts the process among the file's users. Call it when a
    /// mapping is first seen, so later symbolization does not depend on the
    /// process still running.
    pub fn prepare(&mut self, mapping: &MappedFile<'_>) {
        if self
            .process_files
            .entry(mapping.pid)
            .or_default()
            .insert(mapping.key)
        {
            *self.file_users.entry(mapping.key).or_insert(0) += 1;
        }
        if self.files.get(&mapping.key).is_some() {
            return;
        }
        let opened = open_mapped_file(mapping).map(|file| {
            let build_id = debug_lookup::build_id_of(&file);
            let debug = std::sync::OnceLock::new();
            if let Some(found) = build_id
                .as_deref()
                .and_then(|id| self.debug_elf(mapping, &file, id, true))
            {
                let _ = debug.set(found);
            }
            Arc::new(OpenedElf {
                file,
                module: Arc::new(Module {
                    path: mapping.path.into(),
                    build_id: build_id.map(Into::into),
                    memory_start: 0,
                    memory_limit: 0,
                    file_offset: 0,
                    has_functions: true,
                }),
                debug,
            })
        });
        match &opened {
            Some(_) => self.stats.files_opened += 1,
            None => self.stats.files_unopenable += 1,
        }
        let build_id = opened.as_ref().and_then(|elf| elf.module.build_id.clone());
        let generation = match (self.closed.pop(&mapping.key), build_id) {
            (Some((closed_id, generation)), Some(id)) if closed_id == id => {
                self.stats.files_reopened += 1;
                generation
            }
            _ => {
                self.next_generation += 1;
                self.next_generation
            }
        };
        let known = KnownFile { opened, generation };
        if let Some((old_key, old)) = self.files.push(mapping.key, known)
            && old_key != mapping.key
        {
            self.stats.files_evicted += 1;
            self.close(old_key, old);
        }
    }

    /// The debug file of `file` (build id `build_id`), found and charged.
    fn debug_elf(
        &mut self,
        mapping: &MappedFile<'_>,
        file: &File,
        build_id: &str,
        may_download: bool,
    ) -> Option<DebugElf> {
        let found = debug_lookup::find_debug_file(
            mapping.pid,
            mapping.path,
            file,
            build_id,
            &self.debug_dirs,
            &mut self.stats.debug_lookup,
        );
        let Some(found) = found else {
            match &self.downloads {
                Some(downloads) if may_download => {
                    let name = std::path::Path::new(mapping.path)
                        .file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or("");
                    downloads.request(build_id, name);
                    self.awaiting_debug.insert(mapping.key, build_id.to_owned());
                }
                _ => self.note_missing(mapping.path, build_id),
            }
            return None;
        };
        let size = found.file.metadata().map_or(0, |m| m.len());
        let mut charge = Charge::new(Pool::DebugFiles);
        if !charge.try_add(size / DEBUG_FILE_CHARGE_DIVISOR) {
            self.stats.debug_files_over_budget += 1;
            crate::memory_budget::warn_once(mapping.pid, OverBudget::DebugFiles, || {
                format!(
                    "the debug file of {} is over the memory budget's share for debug files: its frames stay unnamed",
                    mapping.path
                )
            });
            return None;
        }
        let segments = debug_file::load_segments(&mut debug_lookup::FileAt(file)).ok()?;
        self.stats.debug_files_found += 1;
        tracing::debug!(path = mapping.path, build_id, source = ?found.source, "debug file found");
        Some(DebugElf {
            file: found.file,
            segments,
            _charge: charge,
        })
    }

    /// Lets go of what `pid` held: the files only it mapped are closed and
    /// their blazesym data dropped (their cached frames age out of the
    /// frame cache, unreachable). Call it once the process has exited and
    /// its samples are named; frames of files other processes still map
    /// stay. A pid never prepared is fine.
    pub fn forget_process(&mut self, pid: u32) {
        for key in self.process_mappings.remove(&pid).into_iter().flatten() {
            if let Some(mapping) = self.mapping_modules.get_mut(&key) {
                mapping.users = mapping.users.saturating_sub(1);
                if mapping.users == 0 {
                    self.mapping_modules.remove(&key);
                }
            }
        }
        let Some(keys) = self.process_files.remove(&pid) else {
            return;
        };
        self.stats.processes_forgotten += 1;
        for key in keys {
            let Some(users) = self.file_users.get_mut(&key) else {
                continue;
            };
            *users = users.saturating_sub(1);
            if *users > 0 {
                continue;
            }
            self.file_users.remove(&key);
            if let Some(known) = self.files.pop(&key) {
                self.stats.files_closed += 1;
                self.close(key, known);
            }
        }
    }

    /// Files open now (each holds a descriptor of ours, and one of
    /// blazesym's once it was read).
    pub fn open_files(&self) -> usize {
        self.files
            .iter()
            .filter(|(_, f)| f.opened.is_some())
            .count()
    }

    /// Processes whose files are counted ([`Self::prepare`]d, not yet
    /// forgotten).
    pub fn processes(&self) -> usize {
        self.process_files.len()
    }

    pub fn limits(&self) -> NativeLimits {
        self.limits
    }

    fn close(&mut self, key: FileKey, known: KnownFile) {
        self.awaiting_debug.remove(&key);
        if let Some(elf) = known.opened {
            if let Some(build_id) = &elf.module.build_id {
                self.closed.put(key, (build_id.clone(), known.generation));
            }
            // blazesym keeps its own descriptor and parsed data per path.
            let _ = self
                .symbolizer
                .evict(&Evict::Elf(evict::Elf::new(elf.fd_path())));
            if let Some(debug) = elf.debug.get() {
                let _ = self
                    .symbolizer
                    .evict(&Evict::Elf(evict::Elf::new(fd_path(&debug.file))));
            }
        }
    }

    /// Names a user address inside `mapping`. `is_return_address` is true
    /// for every frame but the leaf: a return address points after the
    /// call, so the call instruction is one byte earlier.
    pub fn symbolize_user(
        &mut self,
        mapping: &MappedFile<'_>,
        addr: u64,
        is_return_address: bool,
    ) -> Arc<Frame> {
        self.prepare(mapping);
        if !self.awaiting_debug.is_empty() {
            self.attach_downloaded(mapping);
        }
        let lookup = if is_return_address {
            addr.saturating_sub(1)
        } else {
            addr
        };
        let file_offset = lookup
            .saturating_sub(mapping.start)
            .saturating_add(mapping.offset);
        let (generation, opened) = match self.files.get(&mapping.key) {
            Some(known) => (known.generation, known.opened.clone()),
            None => (0, None),
        };
        if let Some(frame) = self.user_cache.get(&(generation, file_offset)).cloned() {
            let module = frame
                .module
                .as_ref()
                .map(|module| self.mapping_module(mapping, module));
            return Arc::new(Frame {
                address: addr,
                module,
                ..(*frame).clone()
            });
        }
        let frame = match opened {
            Some(elf) => match self.name_from_debug_file(&elf, file_offset, addr) {
                Some(frame) => {
                    self.stats.named_by_debug_file += 1;
                    frame
                }
                None => {
                    let source = Source::Elf(Elf::new(elf.fd_path()));
                    match self
                        .symbolizer
                        .symbolize_single(&source, Input::FileOffset(file_offset))
                    {
                        Ok(Symbolized::Sym(sym)) => {
                            frame_from_sym(&sym, FrameKind::Native, Some(&elf.module), addr)
                        }
                        _ => {
                            self.stats.unresolved_user += 1;
                            unnamed_frame(Some(&elf.module), addr)
                        }
                    }
                }
            },
            None => {
                self.stats.unresolved_user += 1;
                unnamed_frame(None, addr)
            }
        };
        let frame = Arc::new(frame);
        if generation != 0
            && self
                .user_cache
                .push((generation, file_offset), frame.clone())
                .is_some()
        {
            self.stats.frames_evicted += 1;
        }
        match &frame.module {
            Some(module) => Arc::new(Frame {
                module: Some(self.mapping_module(mapping, module)),
                ..(*frame).clone()
            }),
            None => frame,
        }
    }
    /// The frame `elf`'s debug file names at `file_offset`, if it has one
    /// and it names it.
    fn name_from_debug_file(&self, elf: &OpenedElf, file_offset: u64, addr: u64) -> Option<Frame> {
        let debug = elf.debug.get()?;
        let virt = debug_file::virtual_offset(&debug.segments, file_offset)?;
        let source = Source::Elf(Elf::new(fd_path(&debug.file)));
        match self
            .symbolizer
            .symbolize_single(&source, Input::VirtOffset(virt))
        {
            Ok(Symbolized::Sym(sym)) => Some(frame_from_sym(
                &sym,
                FrameKind::Native,
                Some(&elf.module),
                addr,
            )),
            _ => None,
        }
    }

    /// `file_module` (the file's path and build id) placed where `mapping`
    /// maps it: the pprof mapping a server-side symbolizer needs.
    fn mapping_module(
        &mut self,
        mapping: &MappedFile<'_>,
        file_module: &Arc<Module>,
    ) -> Arc<Module> {
        let key = (mapping.key, mapping.start, mapping.end, mapping.offset);
        let known = self.mapping_modules.contains_key(&key);
        if !known && self.mapping_modules.len() >= MAX_MAPPING_MODULES {
            return file_module.clone();
        }
        let new_user = self
            .process_mappings
            .entry(mapping.pid)
            .or_default()
            .insert(key);
        let entry = self
            .mapping_modules
            .entry(key)
            .or_insert_with(|| MappingModule {
                module: Arc::new(Module {
                    memory_start: mapping.start,
                    memory_limit: mapping.end,
                    file_offset: mapping.offset,
                    ..(**file_module).clone()
                }),
                users: 0,
            });
        entry.users += u32::from(new_user);
        entry.module.clone()
    }

    /// Mappings given a module of their own now (see
    /// [`Self::forget_process`]).
    pub fn mapping_modules(&self) -> usize {
        self.mapping_modules.len()
    }

    /// Names a kernel address from kallsyms.
    pub fn symbolize_kernel(&mut self, addr: u64) -> Arc<Frame> {
        if let Some(frame) = self.kernel_cache.get(&addr) {
            return frame.clone();
        }
        let kept = self
            .kernel_files
            .table_for(addr)
            .map(|table| table.name_of(addr));
        let named = match kept {
            // This boot's table covers the address: its answer stands.
            Some(name) => name.map(|name| Frame {
                kind: FrameKind::Kernel,
                name: name.into(),
                module: Some(self.kernel_module.clone()),
                address: addr,
                ..Frame::synthetic("")
            }),
            None => {
                let source = Source::Kernel(Kernel {
                    kallsyms: MaybeDefault::Default,
                    debug_syms: false,
                    ..Kernel::default()
                });
                match self
                    .symbolizer
                    .symbolize_single(&source, Input::AbsAddr(addr))
                {
                    Ok(Symbolized::Sym(sym)) => Some(frame_from_sym(
                        &sym,
                        FrameKind::Kernel,
                        Some(&self.kernel_module),
                        addr,
                    )),
                    _ => None,
                }
            }
        };
        let frame = match named {
            Some(frame) => frame,
            None => {
                self.stats.unresolved_kernel += 1;
                Frame {
                    kind: FrameKind::Kernel,
                    name: format!("0x{addr:x}").into(),
                    module: Some(self.kernel_module.clone()),
                    address: addr,
                    ..Frame::synthetic("")
                }
            }
        };
        let frame = Arc::new(frame);
        if self.kernel_cache.push(addr, frame.clone()).is_some() {
            self.stats.frames_evicted += 1;
        }
        frame
    }
}

/// The exact file mapped ([`crate::process::mapped_file`]: never a path
/// the target swapped since, never a device or FIFO).
fn open_mapped_file(mapping: &MappedFile<'_>) -> Option<File> {
    let mapped = crate::process::mapped_file::MappedFileRef {
        start: mapping.start,
        end: mapping.end,
        dev_major: mapping.key.dev_major,
        dev_minor: mapping.key.dev_minor,
        inode: mapping.key.inode,
        path: mapping.path,
    };
    crate::process::mapped_file::open_mapped(
        &crate::process::ProcFs::default(),
        mapping.pid,
        &mapped,
    )
    .inspect_err(|e| tracing::debug!(pid = mapping.pid, "native file: {e}"))
    .ok()
}

fn frame_from_sym(
    sym: &blazesym::symbolize::Sym<'_>,
    kind: FrameKind,
    module: Option<&Arc<Module>>,
    addr: u64,
) -> Frame {
    let (file, line) = match &sym.code_info {
        Some(info) => (
            Some(code_path(info.dir.as_deref(), &info.file)),
            info.line.unwrap_or(0),
        ),
        None => (None, 0),
    };
    // blazesym lists inlined functions outermost first; pprof wants the
    // innermost first. Each inlined function's code_info is the location of
    // the call *to the next one*, and the innermost one's is the sample's.
    let mut inlined: Vec<InlinedFunction> = Vec::with_capacity(sym.inlined.len());
    for inl in sym.inlined.iter().rev() {
        let (ifile, iline) = match &inl.code_info {
            Some(info) => (
                Some(code_path(info.dir.as_deref(), &info.file)),
                info.line.unwrap_or(0),
            ),
            None => (None, 0),
        };
        inlined.push(InlinedFunction {
            name: inl.name.as_ref().into(),
            file: ifile,
            line: iline,
        });
    }
    Frame {
        kind,
        name: sym.name.as_ref().into(),
        system_name: None,
        jit_tier: None,
        module: module.cloned(),
        address: addr,
        file,
        line,
        inlined,
    }
}

fn code_path(dir: Option<&std::path::Path>, file: &std::ffi::OsStr) -> Arc<str> {
    match dir {
        Some(dir) => dir.join(file).to_string_lossy().into(),
        None => file.to_string_lossy().into(),
    }
}

/// A frame nothing could name: `[libfoo.so]` when the file is known (the
/// form perf uses), else `[unknown]`. All unnamed addresses of a file are
/// one function; each keeps its address (and the file's mapping, with its
/// build id and offset) in its pprof location, for a backend that has the
/// debug file to name later.
pub fn unnamed_frame(module: Option<&Arc<Module>>, addr: u64) -> Frame {
    let name = match module {
        Some(m) => {
            let base = m.path.rsplit('/').next().unwrap_or(&m.path);
            format!("[{base}]")
        }
        None => "[unknown]".to_owned(),
    };
    Frame {
        kind: FrameKind::Unknown,
        name: name.into(),
        module: module.cloned(),
        address: addr,
        ..Frame::synthetic("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unnamed_frames_name_the_file() {
        let module = Arc::new(Module {
            path: "/usr/lib/x86_64-linux-gnu/libc.so.6".into(),
            build_id: None,
            memory_start: 0,
            memory_limit: 0,
            file_offset: 0,
            has_functions: true,
        });
        let f = unnamed_frame(Some(&module), 0x7f00_0000_1234);
        assert_eq!(&*f.name, "[libc.so.6]");
        assert_eq!(f.kind, FrameKind::Unknown);
        assert_eq!(f.address, 0x7f00_0000_1234);
        assert_eq!(&*unnamed_frame(None, 1).name, "[unknown]");
    }

    #[test]
    fn kernel_addresses_get_names() {
        // kallsyms is readable by anyone; addresses are zero without
        // privileges, in which case there is nothing to check.
        let Ok(kallsyms) = std::fs::read_to_string("/proc/kallsyms") else {
            return;
        };
        let Some((addr, name)) = kallsyms.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            let addr = u64::from_str_radix(it.next()?, 16).ok()?;
            let kind = it.next()?;
            let name = it.next()?;
            (addr != 0 && (kind == "T" || kind == "t") && name == "schedule")
                .then(|| (addr, name.to_owned()))
        }) else {
            return;
        };
        let mut s = NativeSymbolizer::new();
        let frame = s.symbolize_kernel(addr + 1);
        assert_eq!(&*frame.name, name);
        assert_eq!(frame.kind, FrameKind::Kernel);
    }

    /// An executable file mapping as `/proc/PID/maps` gives it: start, end,
    /// offset, file, path.
    type MapsLine = (u64, u64, u64, FileKey, String);

    /// `line` as a mapping of process `pid`.
    fn as_mapping(pid: u32, line: &MapsLine) -> MappedFile<'_> {
        let (start, end, offset, key, path) = line;
        MappedFile {
            pid,
            start: *start,
            end: *end,
            offset: *offset,
            key: *key,
            path,
        }
    }

    /// The executable mappings of `pid` whose path ends with `suffix`.
    fn mapped_files(pid: u32, suffix: &str) -> Vec<MapsLine> {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        maps.lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let path = *fields.get(5)?;
                if !fields.get(1)?.contains('x') || !path.ends_with(suffix) {
                    return None;
                }
                let (start, end) = fields[0].split_once('-')?;
                let (major, minor) = fields[3].split_once(':')?;
                Some((
                    u64::from_str_radix(start, 16).ok()?,
                    u64::from_str_radix(end, 16).ok()?,
                    u64::from_str_radix(fields[2], 16).ok()?,
                    FileKey {
                        dev_major: u32::from_str_radix(major, 16).ok()?,
                        dev_minor: u32::from_str_radix(minor, 16).ok()?,
                        inode: fields[4].parse().ok()?,
                    },
                    path.to_owned(),
                ))
            })
            .collect()
    }

    /// Descriptors of this process open on `path`.
    fn fds_open_on(path: &std::path::Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .expect("list own fds")
            .filter_map(Result::ok)
            .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target == path))
            .count()
    }

    #[test]
    fn forgetting_the_last_process_of_a_file_closes_it() {
        // A copy of `sleep` under a name of its own, so descriptors other
        // tests open in parallel are not counted.
        let dir = tempfile::tempdir().expect("temp dir");
        let exe = dir.path().join("clrbpf-native-forget-sleep");
        std::fs::copy("/bin/sleep", &exe).expect("copy sleep");
        let (mut child, mappings) = start_and_map(&exe, &["30"]);
        let pid = child.id();
        let baseline = fds_open_on(&exe);
        let mut s = NativeSymbolizer::new();
        for line in &mappings {
            let mapping = as_mapping(pid, line);
            s.prepare(&mapping);
            let _ = s.symbolize_user(&mapping, mapping.start + 0x40, false);
        }
        assert_eq!(s.stats.files_opened, 1, "{:?}", s.stats);
        assert_eq!(s.open_files(), 1);
        assert!(fds_open_on(&exe) > baseline, "the file is held open");
        let _ = child.kill();
        let _ = child.wait();
        s.forget_process(pid);
        assert_eq!(
            fds_open_on(&exe),
            baseline,
            "every descriptor on the file is closed"
        );
        assert_eq!(s.open_files(), 0);
        assert_eq!(s.processes(), 0);
        assert_eq!(s.stats.files_closed, 1);
        assert_eq!(s.stats.processes_forgotten, 1);
        // Forgetting twice, or a pid never seen, is harmless.
        s.forget_process(pid);
        s.forget_process(u32::MAX);
        assert_eq!(s.stats.processes_forgotten, 1);
    }

    /// Starts `exe` with `args` and waits for its mappings of `exe`.
    #[expect(
        clippy::zombie_processes,
        reason = "the child goes to the caller, which waits for it"
    )]
    fn start_and_map(exe: &std::path::Path, args: &[&str]) -> (std::process::Child, Vec<MapsLine>) {
        let mut child = std::process::Command::new(exe)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("start the program");
        let name = exe
            .file_name()
            .and_then(|n| n.to_str())
            .expect("utf-8 name");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let found = mapped_files(child.id(), name);
            if !found.is_empty() {
                return (child, found);
            }
            if std::time::Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child never mapped its exe");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Symbolizes one address in each mapping of `pid`, then lets the
    /// process go as the pipeline does after its exit.
    fn symbolize_then_forget(
        s: &mut NativeSymbolizer,
        mut child: std::process::Child,
        mappings: &[MapsLine],
    ) {
        let pid = child.id();
        for line in mappings {
            let mapping = as_mapping(pid, line);
            let _ = s.symbolize_user(&mapping, mapping.start + 0x40, false);
        }
        let _ = child.kill();
        let _ = child.wait();
        s.forget_process(pid);
    }

    #[test]
    fn a_file_opened_again_unchanged_finds_its_frames() {
        let dir = tempfile::tempdir().expect("temp dir");
        let exe = dir.path().join("clrbpf-native-reopen");
        std::fs::copy("/bin/sleep", &exe).expect("copy sleep");
        let mut s = NativeSymbolizer::new();
        let (child, mappings) = start_and_map(&exe, &["30"]);
        symbolize_then_forget(&mut s, child, &mappings);
        let cached = s.user_cache.len();
        assert!(cached > 0);
        assert_eq!(s.stats.files_closed, 1, "{:?}", s.stats);

        // The next run of the same file: its frames are the cached ones,
        // none added, none left behind unreachable.
        let (child, mappings) = start_and_map(&exe, &["30"]);
        symbolize_then_forget(&mut s, child, &mappings);
        assert_eq!(s.stats.files_reopened, 1, "{:?}", s.stats);
        assert_eq!(s.user_cache.len(), cached);

        // Rewritten in place (same inode, another build id): named afresh.
        std::fs::write(&exe, std::fs::read("/bin/cat").expect("read cat")).expect("rewrite");
        let (child, mappings) = start_and_map(&exe, &[]);
        symbolize_then_forget(&mut s, child, &mappings);
        assert_eq!(s.stats.files_reopened, 1, "{:?}", s.stats);
        assert!(s.user_cache.len() > cached);
    }

    #[test]
    fn a_file_still_mapped_by_a_live_process_stays_open() {
        let own = std::process::id();
        let mappings = mapped_files(own, "");
        let (start, end, offset, key, path) = mappings.first().expect("an executable mapping");
        let mut s = NativeSymbolizer::new();
        // A third process maps the file elsewhere (its own layout).
        for (pid, shift) in [
            (own, 0),
            (own + 1_000_000, 0),
            (own + 2_000_000, 0x1000_0000),
        ] {
            let mapping = MappedFile {
                pid,
                start: *start + shift,
                end: *end + shift,
                offset: *offset,
                key: *key,
                path,
            };
            s.prepare(&mapping);
            let frame = s.symbolize_user(&mapping, mapping.start + 0x40, false);
            let module = frame.module.as_ref().expect("a file frame has a module");
            assert_eq!(
                module.memory_start, mapping.start,
                "the process's own range"
            );
        }
        assert_eq!(s.mapping_modules(), 2, "one per distinct mapping");
        s.forget_process(own + 2_000_000);
        assert_eq!(s.mapping_modules(), 1, "its own mapping goes with it");
        s.forget_process(own + 1_000_000);
        assert_eq!(s.open_files(), 1, "another process still maps it");
        assert_eq!(s.mapping_modules(), 1, "shared with a live process");
        s.forget_process(own);
        assert_eq!(s.open_files(), 0);
        assert_eq!(s.mapping_modules(), 0);
    }

    #[test]
    fn open_files_and_frames_are_bounded() {
        let own = std::process::id();
        let mut mappings = mapped_files(own, "");
        let mut keys = HashSet::new();
        mappings.retain(|m| keys.insert(m.3));
        assert!(mappings.len() >= 2, "this test binary maps itself and libc");
        let mut s = NativeSymbolizer::with_limits(NativeLimits {
            max_open_files: 1,
            max_user_frames: 2,
            max_kernel_frames: 1,
        });
        for line in &mappings {
            let mapping = as_mapping(own, line);
            for i in 0..3 {
                let _ = s.symbolize_user(&mapping, mapping.start + 0x100 * i, false);
            }
        }
        assert_eq!(s.open_files(), 1);
        assert_eq!(s.stats.files_evicted as usize, mappings.len() - 1);
        assert!(s.user_cache.len() <= 2);
        assert!(s.stats.frames_evicted > 0);
        let _ = s.symbolize_kernel(1);
        let _ = s.symbolize_kernel(2);
        assert_eq!(s.kernel_cache.len(), 1);
    }

    /// A shared library built with `-g`, its debug info split off and the
    /// library stripped (as Microsoft ships libcoreclr), loaded into this
    /// process: (library, debug file, the address of its static `inner`).
    fn load_stripped_library(dir: &std::path::Path) -> (PathBuf, PathBuf, u64) {
        let source = dir.join("split.c");
        std::fs::write(
            &source,
            "static int inner(int x) { return x * 3 + 1; }\n\
             void *split_inner(void) { return (void *)inner; }\n",
        )
        .expect("write the source");
        let lib = dir.join("libsplit.so");
        let dbg = dir.join("libsplit.so.dbg");
        let run = |program: &str, args: &[&std::ffi::OsStr]| {
            let status = std::process::Command::new(program)
                .args(args)
                .status()
                .unwrap_or_else(|e| panic!("run {program}: {e}"));
            assert!(status.success(), "{program} {args:?}");
        };
        run(
            "gcc",
            &[
                "-g".as_ref(),
                "-O1".as_ref(),
                "-shared".as_ref(),
                "-fPIC".as_ref(),
                "-Wl,--build-id".as_ref(),
                "-o".as_ref(),
                lib.as_os_str(),
                source.as_os_str(),
            ],
        );
        run(
            "objcopy",
            &[
                "--only-keep-debug".as_ref(),
                lib.as_os_str(),
                dbg.as_os_str(),
            ],
        );
        run("strip", &["--strip-unneeded".as_ref(), lib.as_os_str()]);
        let c_path = std::ffi::CString::new(lib.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: a library of ours with no constructors; kept loaded.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null(), "dlopen {}", lib.display());
        // SAFETY: the symbol is a `void *(void)` function of that library.
        let inner = unsafe {
            let sym = libc::dlsym(handle, c"split_inner".as_ptr());
            assert!(!sym.is_null(), "dlsym split_inner");
            let f: extern "C" fn() -> *const std::ffi::c_void = std::mem::transmute(sym);
            f() as u64
        };
        (lib, dbg, inner)
    }

    #[test]
    fn a_stripped_library_is_named_from_its_debug_file_in_a_debug_dir() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (lib, dbg, inner) = load_stripped_library(dir.path());
        let own = std::process::id();
        let lib_path = lib.to_str().expect("utf-8 path");
        let mappings = mapped_files(own, lib_path);
        let line = mappings
            .iter()
            .find(|(start, end, ..)| (*start..*end).contains(&inner))
            .expect("inner is in an executable mapping of the library");

        let mut plain = NativeSymbolizer::new();
        let frame = plain.symbolize_user(&as_mapping(own, line), inner, false);
        assert_eq!(&*frame.name, "[libsplit.so]", "stripped: nothing names it");
        assert_eq!(plain.stats.debug_files_missing, 1);

        let id = File::open(&lib)
            .ok()
            .and_then(|f| debug_lookup::build_id_of(&f))
            .expect("the library has a build id");
        // The build-id layout, then the symbol-store layout.
        let build_id_dir = dir.path().join("by-build-id");
        let at = build_id_dir.join(debug_file::build_id_path(&id).expect("path"));
        std::fs::create_dir_all(at.parent().expect("parent")).expect("mkdir");
        std::fs::copy(&dbg, &at).expect("copy the debug file");
        let store = dir.path().join("store");
        let [key, _] = debug_file::symbol_store_keys("libsplit.so", &id).expect("keys");
        let at = store.join(key);
        std::fs::create_dir_all(at.parent().expect("parent")).expect("mkdir");
        std::fs::copy(&dbg, &at).expect("copy the debug file");
        // A debug file of another build id is never believed.
        let wrong = dir.path().join("wrong");
        let at = wrong.join(debug_file::build_id_path(&id).expect("path"));
        std::fs::create_dir_all(at.parent().expect("parent")).expect("mkdir");
        std::fs::copy("/proc/self/exe", &at).expect("copy another file");
        for debug_dir in [&build_id_dir, &store] {
            let mut s = NativeSymbolizer::new();
            s.set_debug_dirs(vec![wrong.clone(), debug_dir.clone()]);
            let frame = s.symbolize_user(&as_mapping(own, line), inner, false);
            assert_eq!(&*frame.name, "inner", "from {}", debug_dir.display());
            assert!(
                frame
                    .file
                    .as_deref()
                    .is_some_and(|f| f.ends_with("split.c"))
            );
            assert_eq!(s.stats.debug_files_found, 1);
            assert_eq!(s.stats.debug_lookup.wrong_build_id, 1);
            assert_eq!(s.stats.named_by_debug_file, 1);
        }
    }

    #[test]
    fn this_test_binary_symbolizes_itself() {
        // Resolve the address of a function in this very test binary
        // through the same path as a profiled process.
        #[inline(never)]
        fn marker_function_for_symbolization() -> u64 {
            marker_function_for_symbolization as *const () as u64
        }
        let addr = std::hint::black_box(marker_function_for_symbolization());
        let maps = std::fs::read_to_string("/proc/self/maps").expect("read own maps");
        let line = maps
            .lines()
            .find(|l| {
                let range = l.split_whitespace().next().unwrap_or("");
                let mut bounds = range
                    .split('-')
                    .map(|h| u64::from_str_radix(h, 16).unwrap_or(0));
                let (s, e) = (bounds.next().unwrap_or(0), bounds.next().unwrap_or(0));
                s <= addr && addr < e
            })
            .expect("the function is mapped");
        let fields: Vec<&str> = line.split_whitespace().collect();
        let mut bounds = fields[0]
            .split('-')
            .map(|h| u64::from_str_radix(h, 16).expect("hex"));
        let (start, end) = (bounds.next().expect("start"), bounds.next().expect("end"));
        let mut dev = fields[3]
            .split(':')
            .map(|h| u32::from_str_radix(h, 16).expect("hex"));
        let mapping = MappedFile {
            pid: std::process::id(),
            start,
            end,
            offset: u64::from_str_radix(fields[2], 16).expect("hex"),
            key: FileKey {
                dev_major: dev.next().expect("major"),
                dev_minor: dev.next().expect("minor"),
                inode: fields[4].parse().expect("inode"),
            },
            path: fields[5],
        };
        let mut s = NativeSymbolizer::new();
        let frame = s.symbolize_user(&mapping, addr, false);
        assert!(
            frame.name.contains("marker_function_for_symbolization"),
            "got {}",
            frame.name
        );
        assert_eq!(frame.kind, FrameKind::Native);
        // The pprof mapping is where the file is mapped, with its build id.
        let module = frame.module.as_deref().expect("a module");
        assert_eq!(
            (module.memory_start, module.memory_limit, module.file_offset),
            (mapping.start, mapping.end, mapping.offset)
        );
        assert_eq!(&*module.path, mapping.path);
        assert!(module.build_id.as_deref().is_some_and(|id| id.len() >= 16));
        // Cached: the second lookup gives the same name and module, and the
        // same file mapped elsewhere gets its own range.
        let again = s.symbolize_user(&mapping, addr, false);
        assert_eq!(again.name, frame.name);
        assert!(Arc::ptr_eq(
            again.module.as_ref().expect("a module"),
            frame.module.as_ref().expect("a module")
        ));
        let moved = MappedFile {
            start: mapping.start + 0x1000_0000,
            end: mapping.end + 0x1000_0000,
            ..mapping
        };
        let elsewhere = s.symbolize_user(&moved, addr + 0x1000_0000, false);
        assert_eq!(elsewhere.name, frame.name);
        let module = elsewhere.module.as_deref().expect("a module");
        assert_eq!(module.memory_start, moved.start);
        assert_eq!(s.stats.files_opened, 1);
    }
}
