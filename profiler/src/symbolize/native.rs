//! Native and kernel frames, through blazesym.
//!
//! A user address is turned into (file, file offset) with the process's
//! mappings, and the file is opened once, through `/proc/PID/map_files`
//! (which works for deleted files and files in other mount namespaces), and
//! kept open: blazesym reads it as `/proc/self/fd/N`. So frames of a process
//! that exited before its samples were symbolized still get names, as long
//! as its mappings were seen while it ran. Results are cached per
//! (file, offset) and per kernel address.

use std::{collections::HashMap, fs::File, os::fd::AsRawFd, path::PathBuf, sync::Arc};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Kernel, Source},
};

use crate::profile::{Frame, FrameKind, InlinedFunction, Module};

/// Most files kept open for symbolization; past this, new files are
/// symbolized as unknown (and counted) rather than exhausting descriptors.
const MAX_OPEN_FILES: usize = 4096;

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

/// Most mappings given their own module; past it frames keep the file's
/// module (no range), so a host with endless `dlopen`s stays bounded.
const MAX_MAPPING_MODULES: usize = 65_536;

struct OpenedElf {
    /// Held open so `fd_path` stays valid after the process exits.
    file: File,
    module: Arc<Module>,
}

impl OpenedElf {
    fn fd_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }
}

/// Counts of what could not be named, for the end summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NativeStats {
    pub files_opened: u64,
    pub files_unopenable: u64,
    pub unresolved_user: u64,
    pub unresolved_kernel: u64,
}

pub struct NativeSymbolizer {
    symbolizer: Symbolizer,
    files: HashMap<FileKey, Option<Arc<OpenedElf>>>,
    user_cache: HashMap<(FileKey, u64), Arc<Frame>>,
    /// The pprof mapping of each file mapping seen: the file's module with
    /// the mapping's real range and offset, shared by its frames.
    mapping_modules: HashMap<MappingKey, Arc<Module>>,
    kernel_cache: HashMap<u64, Arc<Frame>>,
    kernel_module: Arc<Module>,
    pub stats: NativeStats,
}

impl Default for NativeSymbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl NativeSymbolizer {
    pub fn new() -> Self {
        let symbolizer = Symbolizer::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            .build();
        Self {
            symbolizer,
            files: HashMap::new(),
            user_cache: HashMap::new(),
            mapping_modules: HashMap::new(),
            kernel_cache: HashMap::new(),
            kernel_module: Arc::new(Module {
                path: "[kernel.kallsyms]".into(),
                build_id: None,
                memory_start: 0,
                memory_limit: 0,
                file_offset: 0,
                has_functions: true,
            }),
            stats: NativeStats::default(),
        }
    }

    /// Opens (once) the file behind a mapping while its process is alive.
    /// Call it when a mapping is first seen, so later symbolization does
    /// not depend on the process still running.
    pub fn prepare(&mut self, mapping: &MappedFile<'_>) {
        if self.files.contains_key(&mapping.key) {
            return;
        }
        if self.files.len() >= MAX_OPEN_FILES {
            self.stats.files_unopenable += 1;
            return;
        }
        let opened = open_mapped_file(mapping).map(|file| {
            let build_id = blazesym::helper::read_elf_build_id(&PathBuf::from(format!(
                "/proc/self/fd/{}",
                file.as_raw_fd()
            )))
            .ok()
            .flatten()
            .map(|id| hex(&id).into());
            Arc::new(OpenedElf {
                file,
                module: Arc::new(Module {
                    path: mapping.path.into(),
                    build_id,
                    memory_start: 0,
                    memory_limit: 0,
                    file_offset: 0,
                    has_functions: true,
                }),
            })
        });
        match &opened {
            Some(_) => self.stats.files_opened += 1,
            None => self.stats.files_unopenable += 1,
        }
        self.files.insert(mapping.key, opened);
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
        let lookup = if is_return_address {
            addr.saturating_sub(1)
        } else {
            addr
        };
        let file_offset = lookup
            .saturating_sub(mapping.start)
            .saturating_add(mapping.offset);
        if let Some(frame) = self.user_cache.get(&(mapping.key, file_offset)).cloned() {
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
        let opened = self.files.get(&mapping.key).cloned().flatten();
        let frame = match opened {
            Some(elf) => {
                let source = Source::Elf(Elf::new(elf.fd_path()));
                let result = self
                    .symbolizer
                    .symbolize_single(&source, Input::FileOffset(file_offset))
                    .ok();
                match result {
                    Some(Symbolized::Sym(sym)) => {
                        frame_from_sym(&sym, FrameKind::Native, Some(&elf.module), addr)
                    }
                    _ => {
                        self.stats.unresolved_user += 1;
                        unnamed_frame(Some(&elf.module), addr, file_offset)
                    }
                }
            }
            None => {
                self.stats.unresolved_user += 1;
                unnamed_frame(None, addr, file_offset)
            }
        };
        let frame = Arc::new(frame);
        self.user_cache
            .insert((mapping.key, file_offset), frame.clone());
        match &frame.module {
            Some(module) => Arc::new(Frame {
                module: Some(self.mapping_module(mapping, module)),
                ..(*frame).clone()
            }),
            None => frame,
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
        if let Some(module) = self.mapping_modules.get(&key) {
            return module.clone();
        }
        if self.mapping_modules.len() >= MAX_MAPPING_MODULES {
            return file_module.clone();
        }
        let module = Arc::new(Module {
            memory_start: mapping.start,
            memory_limit: mapping.end,
            file_offset: mapping.offset,
            ..(**file_module).clone()
        });
        self.mapping_modules.insert(key, module.clone());
        module
    }

    /// Names a kernel address from kallsyms.
    pub fn symbolize_kernel(&mut self, addr: u64) -> Arc<Frame> {
        if let Some(frame) = self.kernel_cache.get(&addr) {
            return frame.clone();
        }
        let source = Source::Kernel(Kernel {
            debug_syms: false,
            ..Kernel::default()
        });
        let frame = match self
            .symbolizer
            .symbolize_single(&source, Input::AbsAddr(addr))
        {
            Ok(Symbolized::Sym(sym)) => {
                frame_from_sym(&sym, FrameKind::Kernel, Some(&self.kernel_module), addr)
            }
            _ => {
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
        self.kernel_cache.insert(addr, frame.clone());
        frame
    }
}

fn open_mapped_file(mapping: &MappedFile<'_>) -> Option<File> {
    let map_files = format!(
        "/proc/{}/map_files/{:x}-{:x}",
        mapping.pid, mapping.start, mapping.end
    );
    if let Ok(file) = File::open(&map_files) {
        return Some(file);
    }
    // map_files needs CAP_SYS_ADMIN; the target's root view is the fallback,
    // opened without following symlinks out of that root.
    let procfs = crate::process::ProcFs::default();
    let root = crate::process::root::TargetRoot::open(&procfs, mapping.pid).ok()?;
    root.open_file(mapping.path).ok()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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

/// A frame nothing could name: `libfoo.so+0x1234` when the file is known
/// (the form pprof and perf use), else `[unknown]`.
pub fn unnamed_frame(module: Option<&Arc<Module>>, addr: u64, file_offset: u64) -> Frame {
    let name = match module {
        Some(m) => {
            let base = m.path.rsplit('/').next().unwrap_or(&m.path);
            format!("{base}+0x{file_offset:x}")
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
        let f = unnamed_frame(Some(&module), 0x7f00_0000_1234, 0x1234);
        assert_eq!(&*f.name, "libc.so.6+0x1234");
        assert_eq!(f.kind, FrameKind::Unknown);
        assert_eq!(&*unnamed_frame(None, 1, 1).name, "[unknown]");
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
