//! Naming JIT-compiled .NET frames from the target's memory, with no
//! diagnostic socket and nothing written into the target: the name source
//! for processes started with `DOTNET_EnableDiagnostics=0` or without a
//! writable `/tmp`. It sits beside the perf map in the .NET instance
//! ([`super::instance`]) and hands back a [`ManagedCode`]: a method by image
//! file and MethodDef token (named from the image's metadata), a dynamic
//! method, a stub kind, or a ReadyToRun image (named from the file alone).
//!
//! 1. [`ClrMemoryReader::attach`]: the runtime's `libcoreclr.so`, the file
//!    mapped ([`crate::process::mapped_file`]), is read within caps
//!    ([`runtime_image`]) for `g_dacTable`, the contract descriptor (.NET
//!    9+) and the version; the version picks the layout ([`layout`]), the
//!    descriptor's JSON overrides it.
//! 2. The code range map's address is DAC table slot 0, 0 until the
//!    runtime's execution manager is up (then asked again at each lookup).
//! 3. [`ClrMemoryReader::code_at`]: PC -> code range ([`code_map`], cached
//!    per range) -> nibble map -> code block start -> code header ->
//!    `MethodDesc` ([`method`]) -> token and `Module*` -> the image file
//!    mapping holding the module's `m_pSimpleName`.
//! 4. Blocks are cached by start address, together with their code header
//!    (a [`charged_cache::ChargedCache`] of the memory budget, dynamic
//!    methods' names cut at 512 bytes):
//!    each hit reads the header again, so code freed and reused (dynamic
//!    methods, collectible assemblies) is read afresh. A method that tiers
//!    up gets a new block, hence a new entry.
//!
//! Reads go through [`target::TargetMemory`] (`process_vm_readv` on a live
//! process); each is bounded, pointers are checked before they are
//! followed, and failures are counted ([`MemoryNameStats`]).
//!
//! Known limits: x86-64 layouts only; .NET 6-10 (3.1 and 5 export no
//! `g_dacTable`); methods longer than 2 MiB; modules loaded from bytes have
//! no file to name them from. Pinned reference:
//! open-telemetry/opentelemetry-ebpf-profiler@b442421 `interpreter/dotnet`
//! and dotnet/runtime `docs/design/datacontracts/ExecutionManager.md`.

pub mod budget;
pub mod charged_cache;
pub mod code_heap_scan;
pub mod code_map;
pub mod layout;
pub mod method;
pub mod names;
pub mod runtime_image;
pub mod target;

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering},
};

use budget::{Metered, Outcome, ProcessNamingBudget, Refusal};
use charged_cache::{ChargedCache, capped_name};
use code_map::{CodeMapError, CodeRange, CodeRangeKind, find_code_range, find_code_start};
use layout::ClrLayout;
use method::{CodeBlock, MethodError, read_code_block, read_code_header};
use runtime_image::{RuntimeImage, RuntimeImageError};
use target::{ProcessMemory, ReadError, ReadExt, TargetMemory};

use crate::process::{
    MappingTable, ProcFs,
    dotnet::DotnetRuntime,
    mapped_file::{MappedFileError, MappedFileRef, open_mapped},
};

/// Code blocks remembered per process before the cache starts over.
const MAX_CACHED_BLOCKS: usize = 65_536;
/// Code ranges remembered per process.
const MAX_CACHED_RANGES: usize = 4096;
/// The contract descriptor's JSON is read up to this size.
const MAX_DESCRIPTOR_JSON: u32 = 256 * 1024;
/// `"DNCCDAC\0"`.
const DESCRIPTOR_MAGIC: u64 = 0x0043_4144_4343_4e44;

/// What a code address is, as far as the runtime's memory tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagedCode {
    /// A method with metadata: `token` in the image at `image` (path in the
    /// target's mount namespace), `None` when the module has no file.
    Method {
        image: Option<Arc<str>>,
        token: u32,
        /// The start of its code block (one per tier).
        code_start: u64,
    },
    /// An LCG method or IL stub, with its name when the runtime keeps one.
    Dynamic { name: Option<Arc<str>> },
    /// A runtime stub (precode, jump stub, virtual call stub...).
    Stub { kind: &'static str },
    /// Code of the ReadyToRun image mapped at `begin`: named from the file.
    ReadyToRun { begin: u64 },
}

/// Why a code address could not be read.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum MemoryNameError {
    #[error("the runtime's code range map is not set up yet")]
    NotInitialized,
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    CodeMap(#[from] CodeMapError),
    #[error(transparent)]
    Method(#[from] MethodError),
    #[error("lookup not made: {0}")]
    Refused(#[from] Refusal),
}

/// Why the memory path cannot be used for a process.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("no libcoreclr.so is mapped")]
    NoRuntime,
    #[error("cannot read {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: MappedFileError,
    },
    #[error(transparent)]
    Image(#[from] RuntimeImageError),
    #[error("the runtime's version is unknown")]
    UnknownVersion,
    #[error(".NET {0} has no known memory layout (6 to 10 do)")]
    UnsupportedVersion(u32),
    #[error("libcoreclr.so's mappings do not match its program headers")]
    NoLoadBias,
    #[error("contract descriptor: {0}")]
    Descriptor(String),
}

/// Counts of what the memory path did, for the summary and metrics.
#[derive(Debug, Default)]
pub struct MemoryNameStats {
    pub lookups: AtomicU64,
    pub named: AtomicU64,
    pub not_managed: AtomicU64,
    pub failed: AtomicU64,
    pub cache_hits: AtomicU64,
}

/// A file-backed mapping, for finding the image a module pointer is in.
#[derive(Debug, Clone)]
struct FileMapping {
    start: u64,
    end: u64,
    path: Arc<str>,
}

/// The memory name source of one .NET process; see the module doc.
pub struct ClrMemoryReader<M: TargetMemory = ProcessMemory> {
    mem: M,
    layout: ClrLayout,
    /// Runtime address of `g_dacTable`.
    dac_table: u64,
    /// Load bias of libcoreclr.so (.NET 6's DAC entries are RVAs).
    bias: u64,
    files: Vec<FileMapping>,
    code_ranges: AtomicU64,
    ranges: Mutex<Vec<CodeRange>>,
    blocks: Mutex<ChargedCache<u64, (u64, ManagedCode)>>,
    /// The process's pid, for warnings (0 for memory that is not a
    /// process's).
    pid: u32,
    pub stats: MemoryNameStats,
    /// What its lookups may cost ([`budget`]).
    pub budget: ProcessNamingBudget,
}

impl ClrMemoryReader<ProcessMemory> {
    /// Prepares the memory path for process `pid` whose mappings are
    /// `mappings`: reads its `libcoreclr.so`, the file mapped
    /// ([`crate::process::mapped_file`]), with bounded reads
    /// ([`RuntimeImage::read`]).
    pub fn attach(procfs: &ProcFs, pid: u32, mappings: &MappingTable) -> Result<Self, AttachError> {
        let runtime = DotnetRuntime::detect(mappings).ok_or(AttachError::NoRuntime)?;
        let path = runtime
            .libcoreclr_path
            .clone()
            .ok_or(AttachError::NoRuntime)?;
        let mapping = mappings
            .iter()
            .find(|m| m.file_path() == Some(path.as_str()))
            .ok_or(AttachError::NoRuntime)?;
        let file = open_mapped(procfs, pid, &MappedFileRef::from(mapping)).map_err(|source| {
            AttachError::Open {
                path: path.clone(),
                source,
            }
        })?;
        let image = RuntimeImage::read(&file)?;
        let major = runtime
            .major()
            .or_else(|| image.major())
            .ok_or(AttachError::UnknownVersion)?;
        let bias = mappings
            .iter()
            .filter(|m| m.file_path() == Some(path.as_str()))
            .find_map(|m| image.load_bias(m.start, m.offset))
            .ok_or(AttachError::NoLoadBias)?;
        let mut reader = Self::new(ProcessMemory::new(pid), &image, bias, major, mappings)?;
        reader.pid = pid;
        Ok(reader)
    }
}

impl<M: TargetMemory> ClrMemoryReader<M> {
    /// A reader over `mem` for the runtime `image` loaded at `bias`.
    pub fn new(
        mem: M,
        image: &RuntimeImage,
        bias: u64,
        major: u32,
        mappings: &MappingTable,
    ) -> Result<Self, AttachError> {
        let mut layout =
            ClrLayout::for_major(major).ok_or(AttachError::UnsupportedVersion(major))?;
        if let Some(descriptor) = image.contract_descriptor {
            let json = read_descriptor_json(&mem, bias.wrapping_add(descriptor))
                .map_err(|e| AttachError::Descriptor(e.to_string()))?;
            layout
                .apply_descriptor(&json)
                .map_err(|e| AttachError::Descriptor(e.to_string()))?;
        }
        let mut reader = Self {
            mem,
            layout,
            dac_table: bias.wrapping_add(image.dac_table),
            bias,
            files: Vec::new(),
            code_ranges: AtomicU64::new(0),
            ranges: Mutex::new(Vec::new()),
            blocks: Mutex::new(ChargedCache::new(MAX_CACHED_BLOCKS)),
            pid: 0,
            stats: MemoryNameStats::default(),
            budget: ProcessNamingBudget::new(budget::global()),
        };
        reader.sync_mappings(mappings);
        Ok(reader)
    }

    pub fn layout(&self) -> &ClrLayout {
        &self.layout
    }

    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// Takes the process's mappings again (images loaded since).
    pub fn sync_mappings(&mut self, mappings: &MappingTable) {
        self.files = mappings
            .iter()
            .filter_map(|m| {
                Some(FileMapping {
                    start: m.start,
                    end: m.end,
                    path: m.path.clone().filter(|_| m.file_path().is_some())?,
                })
            })
            .collect();
        self.files.sort_by_key(|m| m.start);
    }

    /// What the code at `pc` is; `Ok(None)` when the runtime has no code
    /// range there (native code, or code it does not manage).
    /// Each lookup is metered by the process's [`budget`]: refused (no
    /// read) when it is spent, put aside or the place failed a moment ago.
    pub fn code_at(&self, pc: u64) -> Result<Option<ManagedCode>, MemoryNameError> {
        self.stats.lookups.fetch_add(1, Ordering::Relaxed);
        let cached = self.cached_range(pc);
        let permit = self
            .budget
            .permit(pc, cached.map(|r| r.begin), std::time::Instant::now())?;
        let mem = Metered::for_lookup(&self.mem, &permit);
        let result = self.lookup(&mem, cached, pc);
        let outcome = match &result {
            Ok(Some(_)) => Outcome::Named,
            // A runtime still starting: one read, nothing crafted.
            Ok(None) | Err(MemoryNameError::NotInitialized) => Outcome::NotManaged,
            Err(_) => Outcome::Failed,
        };
        self.budget
            .charge(&permit, mem.reads(), outcome, std::time::Instant::now());
        let counter = match &result {
            Ok(Some(_)) => &self.stats.named,
            Ok(None) => &self.stats.not_managed,
            Err(_) => &self.stats.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        result
    }

    /// A failure in a cached range keeps the range (the budget's negative
    /// cache remembers the failure): only a PC past the heap's used end, the
    /// heap having grown since, reads the range again.
    fn lookup(
        &self,
        mem: &dyn TargetMemory,
        cached: Option<CodeRange>,
        pc: u64,
    ) -> Result<Option<ManagedCode>, MemoryNameError> {
        if let Some(range) = cached {
            match self.code_in_range(mem, &range, pc) {
                Ok(code) => return Ok(Some(code)),
                Err(MemoryNameError::CodeMap(CodeMapError::BadHeap { end, .. })) if pc > end => {}
                Err(e) => return Err(e),
            }
        }
        let code_ranges = self.code_ranges(mem)?;
        let Some(range) = find_code_range(mem, &self.layout, code_ranges, pc)? else {
            return Ok(None);
        };
        self.remember_range(range);
        Ok(Some(self.code_in_range(mem, &range, pc)?))
    }

    /// The JIT methods `scan` found since its last call (at most every
    /// [`code_heap_scan::SCAN_EVERY`]); none until the runtime's code range
    /// map is set up.
    pub fn take_new_methods(
        &self,
        scan: &mut code_heap_scan::CodeHeapScan,
    ) -> Vec<crate::unwind::jit_code::JitMethod> {
        match self.code_ranges(&self.mem) {
            Ok(code_ranges) => scan.take_new_methods(&self.mem, &self.layout, code_ranges),
            Err(_) => Vec::new(),
        }
    }

    /// DAC slot 0, read until the runtime has set it.
    fn code_ranges(&self, mem: &dyn TargetMemory) -> Result<u64, MemoryNameError> {
        let known = self.code_ranges.load(Ordering::Relaxed);
        if known != 0 {
            return Ok(known);
        }
        let slot = self.layout.dac_code_range_slot;
        let address = if self.layout.dac_entries_are_rvas {
            // .NET 6: RVAs relative to libcoreclr's load address.
            match mem.read_u32(self.dac_table + slot * 4)? {
                0 => 0,
                rva => self.bias.wrapping_add(u64::from(rva)),
            }
        } else {
            mem.read_u64(self.dac_table + slot * 8)?
        };
        if address == 0 {
            return Err(MemoryNameError::NotInitialized);
        }
        let address = target::checked_ptr(address)?;
        self.code_ranges.store(address, Ordering::Relaxed);
        Ok(address)
    }

    fn cached_range(&self, pc: u64) -> Option<CodeRange> {
        let ranges = self.ranges.lock().ok()?;
        ranges
            .iter()
            .find(|r| (r.begin..r.end).contains(&pc))
            .copied()
    }

    fn remember_range(&self, range: CodeRange) {
        if let Ok(mut ranges) = self.ranges.lock() {
            if ranges.len() >= MAX_CACHED_RANGES {
                ranges.clear();
            }
            ranges.retain(|r| r.begin != range.begin);
            ranges.push(range);
        }
    }

    fn code_in_range(
        &self,
        mem: &dyn TargetMemory,
        range: &CodeRange,
        pc: u64,
    ) -> Result<ManagedCode, MemoryNameError> {
        let heap = match range.kind {
            CodeRangeKind::JitHeap(heap) => heap,
            CodeRangeKind::Stubs { kind } => {
                return Ok(ManagedCode::Stub {
                    kind: method::stub_kind_name(kind),
                });
            }
            CodeRangeKind::ReadyToRun { .. } => {
                return Ok(ManagedCode::ReadyToRun { begin: range.begin });
            }
        };
        let start = find_code_start(mem, self.layout.nibble_map, &heap, pc)?.ok_or(
            CodeMapError::BadHeap {
                start: heap.start,
                end: heap.end,
                pc,
            },
        )?;
        let header = read_code_header(mem, start)?;
        if let Some(code) = self.cached_block(start, header) {
            return Ok(code);
        }
        let code = match read_code_block(mem, &self.layout, header)? {
            CodeBlock::Stub { kind } => ManagedCode::Stub {
                kind: method::stub_kind_name(kind),
            },
            CodeBlock::Method(m) if m.is_dynamic() => ManagedCode::Dynamic {
                name: m.dynamic_name.map(|n| Arc::from(capped_name(n))),
            },
            CodeBlock::Method(m) => ManagedCode::Method {
                image: self.module_image(mem, m.module),
                token: m.token,
                code_start: start,
            },
        };
        if let Ok(mut blocks) = self.blocks.lock() {
            let heap_bytes = match &code {
                ManagedCode::Dynamic { name: Some(name) } => name.len() as u64,
                // The image path is shared with the mapping table.
                _ => 0,
            };
            blocks.insert(self.pid, start, (header, code.clone()), heap_bytes);
        }
        Ok(code)
    }

    /// The cached block at `start` if its code header is still `header`.
    fn cached_block(&self, start: u64, header: u64) -> Option<ManagedCode> {
        let blocks = self.blocks.lock().ok()?;
        let (cached_header, code) = blocks.get(&start)?;
        if *cached_header != header {
            return None;
        }
        self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
        Some(code.clone())
    }

    /// The file of the image `module` was loaded from: the mapping that
    /// holds its simple name (a pointer into the image's metadata).
    fn module_image(&self, mem: &dyn TargetMemory, module: u64) -> Option<Arc<str>> {
        let module = target::checked_ptr(module).ok()?;
        let name = mem.read_ptr(module + self.layout.module_simple_name).ok()?;
        let at = self.files.partition_point(|m| m.start <= name);
        let mapping = self.files.get(at.checked_sub(1)?)?;
        (name < mapping.end).then(|| mapping.path.clone())
    }
}

/// Reads the JSON of the contract descriptor at `addr`: `{u64 magic, u32
/// flags, u32 size, char* json, ...}`.
fn read_descriptor_json(mem: &dyn TargetMemory, addr: u64) -> Result<Vec<u8>, ReadError> {
    let header: [u8; 24] = mem.read_array(addr)?;
    let field = |at: usize, len: usize| {
        let mut b = [0u8; 8];
        b[..len].copy_from_slice(&header[at..at + len]);
        u64::from_le_bytes(b)
    };
    let (magic, size, json) = (field(0, 8), field(12, 4), field(16, 8));
    if magic != DESCRIPTOR_MAGIC || size == 0 || size > u64::from(MAX_DESCRIPTOR_JSON) {
        return Err(ReadError::BadPointer { addr });
    }
    let json = target::checked_ptr(json)?;
    let mut out = vec![0u8; size as usize];
    for (i, chunk) in out.chunks_mut(target::MAX_READ).enumerate() {
        mem.read(json + (i * target::MAX_READ) as u64, chunk)?;
    }
    // The size may count the terminating NUL.
    while out.last() == Some(&0) {
        out.pop();
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::clr::memory::{
        code_map::tests::{HEADER_MAP, MAP_BASE, nibble_map},
        method::tests::{CODE_HEADER, MODULE, put_method},
        target::FakeMemory,
    };

    const BIAS: u64 = 0x7fa0_0000_0000;
    const DAC_TABLE: u64 = 0x6aecc8;
    pub const RANGE_MAP: u64 = 0x5600_0000_0000;
    const FRAGMENT: u64 = 0x5600_0001_0000;
    const SECTION: u64 = 0x5600_0002_0000;
    const HEAP_LIST: u64 = 0x5600_0003_0000;
    const STUB_SECTION: u64 = 0x5600_0004_0000;
    const RANGE_LIST: u64 = 0x5600_0005_0000;
    const IMAGE: u64 = 0x7fb0_0000_0000;
    pub const METHOD_START: u64 = MAP_BASE + 0x1920;
    const STUBS: u64 = MAP_BASE + 0x10_0000;

    fn image() -> RuntimeImage {
        RuntimeImage {
            dac_table: DAC_TABLE,
            contract_descriptor: None,
            segments: vec![(0, 0, 0x80_0000)],
            file_version: Some("8.0.424.16909".into()),
        }
    }

    fn mappings() -> MappingTable {
        let text = format!(
            "{:x}-{:x} r--p 00000000 fe:00 42 /app/Ratio.dll\n",
            IMAGE,
            IMAGE + 0x2000
        );
        MappingTable::parse(text.as_bytes()).unwrap()
    }

    /// A .NET 8 process image: one code heap holding one method and one
    /// stub range, reachable through a five-level RangeSectionMap.
    pub fn net8_memory() -> FakeMemory {
        let mut mem = FakeMemory::new();
        mem.put_u64(BIAS + DAC_TABLE, RANGE_MAP);
        // Levels: RANGE_MAP -> L4 -> L3 -> L2 -> L1 -> fragment list.
        let mut level = RANGE_MAP;
        let mut levels = Vec::new();
        for (i, shift) in [49u32, 41, 33, 25, 17].into_iter().enumerate() {
            let next = if i == 4 {
                0
            } else {
                RANGE_MAP + 0x1000 * (i as u64 + 1)
            };
            levels.push((level, shift, next));
            level = next;
        }
        for (addr, _, _) in &levels {
            mem.put(*addr, &[0u8; 2048]);
        }
        for (addr, shift, next) in levels {
            for (pc, target) in [(MAP_BASE, FRAGMENT), (STUBS, FRAGMENT + 0x100)] {
                let index = (pc >> shift) & 0xff;
                let value = if next == 0 { target | 1 } else { next | 1 };
                mem.poke(addr + index * 8, &value.to_le_bytes());
            }
        }
        let fragment = |next: u64, begin: u64, end: u64, section: u64| {
            [next, begin, end, section]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect::<Vec<u8>>()
        };
        mem.put(
            FRAGMENT,
            &fragment(0, MAP_BASE, MAP_BASE + 0x8_0000, SECTION),
        );
        mem.put(
            FRAGMENT + 0x100,
            &fragment(0, STUBS, STUBS + 0x1_0000, STUB_SECTION),
        );
        let mut section = vec![0u8; 0x40];
        section[0..8].copy_from_slice(&MAP_BASE.to_le_bytes());
        section[8..16].copy_from_slice(&(MAP_BASE + 0x8_0000).to_le_bytes());
        section[0x10..0x14].copy_from_slice(&2u32.to_le_bytes());
        section[0x28..0x30].copy_from_slice(&HEAP_LIST.to_le_bytes());
        mem.put(SECTION, &section);
        let mut stubs = vec![0u8; 0x40];
        stubs[0..8].copy_from_slice(&STUBS.to_le_bytes());
        stubs[8..16].copy_from_slice(&(STUBS + 0x1_0000).to_le_bytes());
        stubs[0x10..0x14].copy_from_slice(&4u32.to_le_bytes());
        stubs[0x30..0x38].copy_from_slice(&RANGE_LIST.to_le_bytes());
        mem.put(STUB_SECTION, &stubs);
        let mut range_list = vec![0u8; 0x128];
        range_list[0x120..0x124].copy_from_slice(&5u32.to_le_bytes());
        mem.put(RANGE_LIST, &range_list);
        let heap = [
            0u64,
            0,
            MAP_BASE + 0x10,
            MAP_BASE + 0x3000,
            MAP_BASE,
            HEADER_MAP,
        ];
        mem.put(
            HEAP_LIST,
            &heap
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        mem.put(
            HEADER_MAP,
            &nibble_map(&[MAP_BASE + 0x20, METHOD_START], 64),
        );
        let mut code = vec![0u8; 0x3000];
        let header_at = (METHOD_START - 8 - MAP_BASE) as usize;
        code[header_at..header_at + 8].copy_from_slice(&CODE_HEADER.to_le_bytes());
        // The block at 0x20 is a dynamic helper stub (kind 3).
        code[0x18..0x20].copy_from_slice(&3u64.to_le_bytes());
        mem.put(MAP_BASE, &code);
        put_method(&mut mem, 0x0600_0002, 0);
        let mut module = vec![0u8; 0x110];
        module[0x108..0x110].copy_from_slice(&(IMAGE + 0x1234).to_le_bytes());
        mem.put(MODULE, &module);
        mem
    }

    fn reader(mem: FakeMemory) -> ClrMemoryReader<FakeMemory> {
        ClrMemoryReader::new(mem, &image(), BIAS, 8, &mappings()).unwrap()
    }

    #[test]
    fn net8_walk_names_method_stub_and_helper() {
        let reader = reader(net8_memory());
        let method = ManagedCode::Method {
            image: Some("/app/Ratio.dll".into()),
            token: 0x0600_0002,
            code_start: METHOD_START,
        };
        assert_eq!(
            reader.code_at(METHOD_START + 0x40).unwrap(),
            Some(method.clone())
        );
        // The second lookup hits the range and block caches.
        assert_eq!(reader.code_at(METHOD_START).unwrap(), Some(method));
        assert_eq!(reader.stats.cache_hits.load(Ordering::Relaxed), 1);
        assert_eq!(
            reader.code_at(MAP_BASE + 0x30).unwrap(),
            Some(ManagedCode::Stub {
                kind: "dynamic helper"
            })
        );
        assert_eq!(
            reader.code_at(STUBS + 0x44).unwrap(),
            Some(ManagedCode::Stub {
                kind: "fixup precode"
            })
        );
        // Native code: no range.
        assert_eq!(reader.code_at(0x5555_0000_1000).unwrap(), None);
    }

    #[test]
    fn reused_code_is_read_again() {
        let mut mem = net8_memory();
        let first = reader(mem.clone()).code_at(METHOD_START).unwrap();
        assert!(matches!(first, Some(ManagedCode::Method { .. })));
        // The block is freed and its space reused for a stub: same start,
        // another header.
        let warm = reader(mem.clone());
        warm.code_at(METHOD_START).unwrap();
        mem.poke(METHOD_START - 8, &9u64.to_le_bytes());
        let reused = ClrMemoryReader { mem, ..warm };
        assert_eq!(
            reused.code_at(METHOD_START).unwrap(),
            Some(ManagedCode::Stub {
                kind: "virtual call vtable stub"
            })
        );
    }

    /// [`FakeMemory`] that counts its reads.
    struct CountingMemory(FakeMemory, AtomicU64);

    impl TargetMemory for CountingMemory {
        fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.read(addr, buf)
        }
    }

    #[test]
    fn a_failed_lookup_is_remembered_and_keeps_its_range() {
        let mem = CountingMemory(net8_memory(), AtomicU64::new(0));
        let reader = ClrMemoryReader::new(mem, &image(), BIAS, 8, &mappings()).unwrap();
        let reads = || reader.memory().1.swap(0, Ordering::Relaxed);
        assert!(matches!(
            reader.code_at(METHOD_START),
            Ok(Some(ManagedCode::Method { .. }))
        ));
        let walk = reads();
        // Before the heap's first block: the walk fails in a cached range.
        assert!(reader.code_at(MAP_BASE + 0x18).is_err());
        reads();
        assert_eq!(
            reader.code_at(MAP_BASE + 0x1c),
            Err(MemoryNameError::Refused(Refusal::KnownBad))
        );
        assert_eq!(reads(), 0, "a known failure costs no read");
        // The range was kept: the method is named without the map walk.
        assert!(reader.code_at(METHOD_START + 4).unwrap().is_some());
        assert!(reads() < walk, "the cached range was forgotten");
    }

    /// The attack of issue 33: every sample a new stack of return addresses
    /// into a crafted code heap, each a lookup that fails. Each page costs
    /// one walk; the lookups after make no read.
    #[test]
    fn failing_lookups_cost_one_walk_a_page() {
        let mut fake = net8_memory();
        // The heap's range section points at no heap.
        fake.poke(SECTION + 0x28, &0xdead_beefu64.to_le_bytes());
        let mem = CountingMemory(fake, AtomicU64::new(0));
        let reader = ClrMemoryReader::new(mem, &image(), BIAS, 8, &mappings()).unwrap();
        // The map leaf covers 128 KiB: 32 pages.
        let pages = 0x2_0000 / 4096;
        let mut refused = 0u64;
        for i in 0..20_000u64 {
            let pc = MAP_BASE + (((i * 7) % pages) << 12) + (i % 4096);
            if let Err(MemoryNameError::Refused(_)) = reader.code_at(pc) {
                refused += 1;
            }
        }
        let reads = reader.memory().1.load(Ordering::Relaxed);
        assert!(reads <= pages * 16, "{reads} reads for failing lookups");
        assert_eq!(refused, 20_000 - pages);
    }

    #[test]
    fn uninitialized_runtime_and_garbage_are_errors_not_panics() {
        let mut mem = net8_memory();
        mem.poke(BIAS + DAC_TABLE, &0u64.to_le_bytes());
        let uninitialized = reader(mem);
        assert_eq!(
            uninitialized.code_at(METHOD_START),
            Err(MemoryNameError::NotInitialized)
        );
        assert_eq!(uninitialized.stats.failed.load(Ordering::Relaxed), 1);
        // A heap list pointer into nowhere.
        let mut mem = net8_memory();
        mem.poke(SECTION + 0x28, &0xdead_beefu64.to_le_bytes());
        assert!(reader(mem).code_at(METHOD_START).is_err());
    }

    /// The fuzz target's check (fuzz/fuzz_targets/clr_memory.rs) on a few
    /// thousand pseudo-random images, in every layout: walks end, in a name
    /// or an error.
    #[test]
    fn random_memory_never_panics() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..2000u64 {
            let mut mem = net8_memory();
            // Scribble pointers to the image's own structures and junk over it.
            let targets = [
                RANGE_MAP,
                FRAGMENT,
                SECTION,
                HEAP_LIST,
                HEADER_MAP,
                CODE_HEADER,
                MODULE,
            ];
            for _ in 0..8 {
                let at = targets[(next() % 7) as usize] + (next() % 0x40) * 8;
                let value = match next() % 3 {
                    0 => targets[(next() % 7) as usize] + (next() % 0x100),
                    1 => next(),
                    _ => 0,
                };
                if mem.read_u64(at).is_ok() {
                    mem.poke(at, &value.to_le_bytes());
                }
            }
            let major = 6 + (round % 5) as u32;
            let reader = ClrMemoryReader::new(mem, &image(), BIAS, major, &mappings()).unwrap();
            for pc in [
                METHOD_START + next() % 0x100,
                STUBS + next() % 0x100,
                next(),
            ] {
                let _ = reader.code_at(pc);
            }
        }
    }

    #[test]
    fn descriptor_json_is_bounded() {
        let mut mem = FakeMemory::new();
        let json = br#"{"types":{}}"#;
        let mut header = Vec::new();
        header.extend_from_slice(&DESCRIPTOR_MAGIC.to_le_bytes());
        header.extend_from_slice(&1u32.to_le_bytes());
        header.extend_from_slice(&(json.len() as u32 + 1).to_le_bytes());
        header.extend_from_slice(&0x5700_0000_0000u64.to_le_bytes());
        mem.put(0x5600_0000_0000, &header);
        let mut with_nul = json.to_vec();
        with_nul.push(0);
        mem.put(0x5700_0000_0000, &with_nul);
        assert_eq!(read_descriptor_json(&mem, 0x5600_0000_0000).unwrap(), json);
        header[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        mem.put(0x5600_0000_0000, &header);
        assert!(read_descriptor_json(&mem, 0x5600_0000_0000).is_err());
    }
}
