//! ReadyToRun frames named from the image file alone: no perf map, no
//! diagnostic socket, no read of the target's memory. Part of the
//! `symbolize/` stage for managed code: the runtime seam
//! ([`crate::clr::instance`]) asks [`ReadyToRunNames`] for a frame that
//! falls in a mapped `.dll` before the native symbolizer sees it.
//!
//! Steps (formats in `docs/design/coreclr/botr/readytorun-format.md` of
//! dotnet/runtime; the runtime's own reader is `readytoruninfo.cpp`):
//! 1. PC -> file offset through the mapping (`pc - start + offset`) -> RVA
//!    through the PE section that holds that offset.
//! 2. RVA -> `RUNTIME_FUNCTION` index: binary search of the sorted table
//!    ([`crate::unwind::ready_to_run`] reads the same header for
//!    unwinding).
//! 3. Index -> MethodDef token: `MethodDefEntryPoints` (a NativeFormat
//!    sparse array by MethodDef row) and `InstanceMethodEntryPoints` (a
//!    NativeFormat hashtable of generic instantiations, each a method
//!    signature whose MethodDef row is read and whose type arguments are
//!    skipped) each give a method's entry function index
//!    (`clrbpf_parse::native_format`).
//! 4. Funclets (catch, finally, filter bodies) follow their method in the
//!    table: an index that is no entry takes the nearest entry before it.
//!    Cold code (`HotColdMap`, .NET 8+) maps to its hot part first.
//! 5. Token -> `Namespace.Type.Method` from the image's own metadata
//!    (`clrbpf_parse::clr_metadata`).
//!
//! Known limits: composite images (the framework built as one file, as in
//! some container images) are not read (their component assemblies carry
//! no code); instantiations of methods from another module of the version
//! bubble are named after nothing and left to other sources; an image the
//! runtime copied into anonymous memory (single-file bundles) has no file
//! mapping and is left to the memory reader. Only x86_64 images.

pub mod process;

use std::fs::File;
use std::os::unix::fs::FileExt;

use object::read::pe::PeFile64;

use crate::unwind::ready_to_run::{
    READY_TO_RUN_FLAG_COMPONENT, is_x86_64, ready_to_run_header, runtime_functions, section_bytes,
    section_type,
};
use clrbpf_parse::{
    clr_metadata::{ClrMetadata, MetadataError},
    native_format::{NativeArray, NativeReader, hashtable_entries},
};

pub use process::{AssemblyCache, AssemblyKey, HeldMetadata, ReadyToRunNames};

/// Largest image read whole (System.Private.CoreLib 8.0 has 12 MiB).
pub const MAX_IMAGE_BYTES: u64 = 256 << 20;
/// Most generic instantiations read from one image (CoreLib 8.0 has a few
/// thousand).
const MAX_INSTANCE_ENTRIES: usize = 1 << 20;
/// The token of a method entry this reader does not name (another
/// module's method): the functions after it are not given the method
/// before it.
const UNNAMED_ENTRY: u32 = u32::MAX;

/// `READYTORUN_METHOD_SIG_*` flags of an instantiation's signature.
mod method_sig {
    pub const METHOD_INSTANTIATION: u32 = 0x04;
    pub const SLOT_INSTEAD_OF_TOKEN: u32 = 0x08;
    pub const MEMBER_REF_TOKEN: u32 = 0x10;
    pub const CONSTRAINED: u32 = 0x20;
    pub const OWNER_TYPE: u32 = 0x40;
    pub const UPDATE_CONTEXT: u32 = 0x80;
}

/// Why an assembly image gave no names.
#[derive(Debug, thiserror::Error)]
pub enum ReadyToRunError {
    #[error("reading the assembly image")]
    Read {
        #[source]
        source: std::io::Error,
    },
    #[error("assembly image is larger than the {limit}-byte limit")]
    TooLarge { limit: u64 },
    #[error("not a 64-bit PE image")]
    NotPe,
    #[error("not a ReadyToRun image: {reason}")]
    NotReadyToRun { reason: String },
    #[error("ReadyToRun image has no usable metadata")]
    Metadata(#[source] MetadataError),
}

/// What reading an image's method tables found (for the summary's
/// problems and for tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadyToRunStats {
    pub runtime_functions: u32,
    /// Methods whose entry point `MethodDefEntryPoints` gives.
    pub methods: u32,
    /// Generic instantiations read from `InstanceMethodEntryPoints`.
    pub instantiations: u32,
    /// Instantiations left unnamed (another module's method, a signature
    /// not read).
    pub instantiations_skipped: u32,
    /// Entries whose function index is past the table.
    pub bad_entries: u32,
}

/// The methods of an R2R image's code, by RVA.
#[derive(Debug, Default)]
pub struct ReadyToRunMethods {
    /// `[begin, end)` RVAs of each `RUNTIME_FUNCTION`, in the table's
    /// order (the order entry points index).
    functions: Box<[(u32, u32)]>,
    /// When `functions` is not sorted by begin (crossgen2 sorts it, a
    /// hostile image need not): its indices sorted by begin, made once at
    /// load, so every lookup is a binary search.
    order: Option<Box<[u32]>>,
    /// The MethodDef token owning each function (funclets and cold parts
    /// resolved to their method); 0 for none, [`UNNAMED_ENTRY`] for a
    /// method's entry that is not named here.
    tokens: Box<[u32]>,
    pub stats: ReadyToRunStats,
}

impl ReadyToRunMethods {
    /// Reads the method tables of an R2R image whose bytes are `data`.
    pub fn parse(pe: &PeFile64<'_>, data: &[u8]) -> Result<Self, ReadyToRunError> {
        let not_r2r = |e: crate::unwind::UnwindTableError| ReadyToRunError::NotReadyToRun {
            reason: e.to_string(),
        };
        if !is_x86_64(pe) {
            return Err(ReadyToRunError::NotReadyToRun {
                reason: "not an x86_64 image".into(),
            });
        }
        let header = ready_to_run_header(pe, data).map_err(not_r2r)?;
        if header.flags & READY_TO_RUN_FLAG_COMPONENT != 0
            || header.section(section_type::COMPONENT_ASSEMBLIES).is_some()
        {
            return Err(ReadyToRunError::NotReadyToRun {
                reason: "a composite image (not read)".into(),
            });
        }
        let table = runtime_functions(pe, data).map_err(not_r2r)?;
        let functions: Box<[(u32, u32)]> = table
            .chunks_exact(12)
            .take(crate::unwind::ready_to_run::MAX_RUNTIME_FUNCTIONS)
            .map(|e| {
                let word = |i: usize| u32::from_le_bytes([e[i], e[i + 1], e[i + 2], e[i + 3]]);
                (word(0), word(4))
            })
            .collect();
        let mut methods = Self {
            order: sorted_order(&functions),
            tokens: vec![0; functions.len()].into_boxed_slice(),
            functions,
            stats: ReadyToRunStats::default(),
        };
        methods.stats.runtime_functions = methods.functions.len() as u32;
        let section = |kind| {
            header
                .section(kind)
                .and_then(|s| section_bytes(pe, data, s))
        };
        if let Some(bytes) = section(section_type::METHOD_DEF_ENTRY_POINTS) {
            methods.read_method_entry_points(NativeReader::new(bytes));
        }
        if let Some(bytes) = section(section_type::INSTANCE_METHOD_ENTRY_POINTS) {
            methods.read_instance_entry_points(NativeReader::new(bytes));
        }
        let cold = section(section_type::HOT_COLD_MAP).unwrap_or_default();
        methods.resolve_funclets_and_cold_code(cold);
        Ok(methods)
    }

    /// Marks function `index` as the entry of `token`.
    fn set_entry(&mut self, index: u32, token: u32) {
        match self.tokens.get_mut(index as usize) {
            Some(slot) if *slot == 0 => *slot = token,
            Some(_) => {}
            None => self.stats.bad_entries += 1,
        }
    }

    fn read_method_entry_points(&mut self, reader: NativeReader<'_>) {
        let Some(array) = NativeArray::new(reader, 0) else {
            return;
        };
        // At most one element per function: a larger claimed count is
        // hostile and bounded by the table.
        let rows = array.len().min(0x00ff_ffff);
        for rid in 1..=rows {
            let Some(at) = array.get(rid - 1) else {
                continue;
            };
            if let Some(index) = reader.entry_point(at) {
                self.set_entry(index, 0x0600_0000 | rid);
                self.stats.methods += 1;
            }
        }
    }

    fn read_instance_entry_points(&mut self, reader: NativeReader<'_>) {
        let Some(entries) = hashtable_entries(reader, 0, MAX_INSTANCE_ENTRIES) else {
            return;
        };
        for at in entries {
            match instance_entry(reader, at) {
                Some((Some(rid), index)) => {
                    self.set_entry(index, 0x0600_0000 | rid);
                    self.stats.instantiations += 1;
                }
                Some((None, index)) => {
                    self.set_entry(index, UNNAMED_ENTRY);
                    self.stats.instantiations_skipped += 1;
                }
                None => self.stats.instantiations_skipped += 1,
            }
        }
    }

    /// Gives every function that is no method's entry the method of the
    /// nearest entry before it (funclets follow their method), after
    /// mapping cold parts to their hot parts.
    fn resolve_funclets_and_cold_code(&mut self, hot_cold_map: &[u8]) {
        let entries = self.tokens.clone();
        for pair in hot_cold_map.chunks_exact(8) {
            let cold = u32::from_le_bytes([pair[0], pair[1], pair[2], pair[3]]) as usize;
            let hot = u32::from_le_bytes([pair[4], pair[5], pair[6], pair[7]]) as usize;
            let token = owner_before(&entries, hot);
            if let (Some(slot), Some(token)) = (self.tokens.get_mut(cold), token)
                && *slot == 0
            {
                *slot = token;
            }
        }
        let mut last = 0;
        for slot in self.tokens.iter_mut() {
            if *slot == 0 {
                *slot = last;
            } else {
                last = *slot;
            }
        }
    }

    /// The function holding `rva`: its index.
    fn function_at(&self, rva: u32) -> Option<usize> {
        let index = match &self.order {
            None => self
                .functions
                .partition_point(|f| f.0 <= rva)
                .checked_sub(1)?,
            Some(order) => {
                let at = order
                    .partition_point(|&i| self.functions[i as usize].0 <= rva)
                    .checked_sub(1)?;
                order[at] as usize
            }
        };
        let (begin, end) = self.functions[index];
        (begin <= rva && rva < end).then_some(index)
    }

    /// The MethodDef token of the method whose code holds `rva`.
    pub fn token_at(&self, rva: u32) -> Option<u32> {
        let token = *self.tokens.get(self.function_at(rva)?)?;
        (token != 0 && token != UNNAMED_ENTRY).then_some(token)
    }

    /// Bytes held.
    pub fn memory_bytes(&self) -> usize {
        self.functions.len() * 8
            + self.tokens.len() * 4
            + self.order.as_ref().map_or(0, |o| o.len() * 4)
    }
}

/// The indices of `functions` sorted by begin, or `None` when the table is
/// sorted already (the table is at most `MAX_RUNTIME_FUNCTIONS` long, so
/// the indices fit a `u32`).
fn sorted_order(functions: &[(u32, u32)]) -> Option<Box<[u32]>> {
    if functions.is_sorted_by_key(|f| f.0) {
        return None;
    }
    let mut order: Vec<u32> = (0..functions.len())
        .map(|i| u32::try_from(i).unwrap_or(u32::MAX))
        .collect();
    order.sort_unstable_by_key(|&i| functions[i as usize].0);
    Some(order.into_boxed_slice())
}

/// The token owning function `index` or the nearest entry before it.
fn owner_before(entries: &[u32], index: usize) -> Option<u32> {
    let upto = entries.get(..=index)?;
    upto.iter().rev().copied().find(|&t| t != 0)
}

/// The MethodDef row (`None` for a method of another module, or named by
/// slot or MemberRef) and the entry function index of the instantiation
/// whose signature starts at `at`; `None` when it does not read.
fn instance_entry(reader: NativeReader<'_>, at: usize) -> Option<(Option<u32>, u32)> {
    let (flags, mut at) = reader.compressed(at)?;
    if flags & method_sig::UPDATE_CONTEXT != 0 {
        // The module the rest of the signature is read in.
        at = reader.compressed(at)?.1;
    }
    if flags & method_sig::OWNER_TYPE != 0 {
        at = reader.skip_type(at)?;
    }
    // A MethodDef or MemberRef row, or a slot number.
    let (rid, after) = reader.compressed(at)?;
    at = after;
    if flags & method_sig::METHOD_INSTANTIATION != 0 {
        let (count, after) = reader.compressed(at)?;
        at = after;
        for _ in 0..count.min(64) {
            at = reader.skip_type(at)?;
        }
    }
    if flags & method_sig::CONSTRAINED != 0 {
        at = reader.skip_type(at)?;
    }
    let elsewhere = method_sig::UPDATE_CONTEXT
        | method_sig::SLOT_INSTEAD_OF_TOKEN
        | method_sig::MEMBER_REF_TOKEN;
    let rid = (flags & elsewhere == 0 && rid != 0).then_some(rid);
    Some((rid, reader.entry_point(at)?))
}

/// A managed assembly file: its metadata, and the methods of its code
/// when it is a ReadyToRun image.
#[derive(Debug)]
pub struct AssemblyImage {
    pub metadata: ClrMetadata,
    pub methods: Option<ReadyToRunMethods>,
    /// (file offset, size in the file, RVA) of each section.
    sections: Box<[(u64, u64, u32)]>,
}

impl AssemblyImage {
    /// Parses an assembly's whole image.
    pub fn from_image(data: &[u8]) -> Result<Self, ReadyToRunError> {
        use object::LittleEndian as LE;
        let metadata = ClrMetadata::from_image(data).map_err(ReadyToRunError::Metadata)?;
        let Ok(pe) = PeFile64::parse(data) else {
            // A PE32 IL-only assembly (no native code): names for the
            // memory reader only.
            return Ok(Self {
                metadata,
                methods: None,
                sections: Box::default(),
            });
        };
        let sections = pe
            .section_table()
            .iter()
            .map(|s| {
                (
                    u64::from(s.pointer_to_raw_data.get(LE)),
                    u64::from(s.size_of_raw_data.get(LE)),
                    s.virtual_address.get(LE),
                )
            })
            .collect();
        let methods = ReadyToRunMethods::parse(&pe, data).ok();
        Ok(Self {
            metadata,
            methods,
            sections,
        })
    }

    /// Reads and parses the assembly opened as `file` (at most
    /// [`MAX_IMAGE_BYTES`], and the memory budget's share for reading one
    /// file).
    pub fn read(file: &File) -> Result<Self, ReadyToRunError> {
        let size = file
            .metadata()
            .map_err(|source| ReadyToRunError::Read { source })?
            .len();
        let limit = MAX_IMAGE_BYTES.min(crate::memory_budget::current().file_read_bytes());
        if size > limit {
            return Err(ReadyToRunError::TooLarge { limit });
        }
        let mut data = vec![0u8; size as usize];
        file.read_exact_at(&mut data, 0)
            .map_err(|source| ReadyToRunError::Read { source })?;
        Self::from_image(&data)
    }

    /// The RVA of the byte at file offset `offset`.
    pub fn rva_of_file_offset(&self, offset: u64) -> Option<u32> {
        self.sections.iter().find_map(|&(start, size, rva)| {
            let within = offset.checked_sub(start)?;
            (within < size).then(|| rva.checked_add(u32::try_from(within).ok()?))?
        })
    }

    /// The MethodDef token of the R2R code at file offset `offset`.
    pub fn token_at_file_offset(&self, offset: u64) -> Option<u32> {
        self.methods
            .as_ref()?
            .token_at(self.rva_of_file_offset(offset)?)
    }

    /// Bytes held (for the cache's budget).
    pub fn memory_bytes(&self) -> usize {
        self.metadata.memory_bytes()
            + self
                .methods
                .as_ref()
                .map_or(0, ReadyToRunMethods::memory_bytes)
            + self.sections.len() * 24
    }
}

#[cfg(test)]
mod tests;
