//! ECMA-335 metadata of a .NET assembly file: a method's name from its
//! MethodDef token, with no help from the runtime. Part of the `symbolize/`
//! stage for managed code that no perf map names: ReadyToRun code (the
//! token comes from the image's own entry point tables) and JIT-compiled
//! code (the token comes from the runtime's MethodDesc in target memory).
//! Either way the assembly file is read through the target's root
//! (`/proc/PID/root`, never following a symlink out of it: the profiler
//! opens it with `TargetRoot::open_file` and reads it with
//! [`ClrMetadata::from_parts`]) and only its headers and metadata are read,
//! at most [`MAX_METADATA_BYTES`].
//!
//! Steps (ECMA-335 6th ed., Partition II §24 and §22):
//! 1. PE (32- or 64-bit) -> CLI header (data directory 14) -> the metadata
//!    root (`BSJB`): a version string, then stream headers. `#Strings` is
//!    the heap of names; `#~` (or the uncompressed `#-`) holds the tables.
//! 2. The `#~` header gives the heap index sizes and a row count per
//!    present table. Every table up to the last one read (NestedClass,
//!    0x29) is sized exactly: simple indexes are 4 bytes when the table has
//!    2^16 rows or more, coded indexes when the largest table they can
//!    point at has 2^(16 - tag bits) rows or more.
//! 3. A MethodDef's owner is the last TypeDef whose `MethodList` is at most
//!    the method's row (the runs are contiguous); NestedClass gives each
//!    nested type its enclosing one.
//! 4. The name has the short form perf maps give (the profiler's
//!    `symbolize::method_name`):
//!    `Namespace.Outer+Inner.Method`, the namespace of the outermost type,
//!    generic types with their arity as metadata spells them
//!    (``List`1``). Type arguments and signatures are not in a MethodDef:
//!    `List`1.Add`, where a perf map says `List`1[System.__Canon].Add`.
//!
//! Hostile files: every offset and count is checked against the bytes
//! read; a bad table gives an error, a bad row `None`; nesting is followed
//! at most [`MAX_NESTING`] deep (a cycle ends there); names are cut at
//! [`MAX_NAME_BYTES`] and invalid UTF-8 is replaced.
//!
//! Limits: `#-` metadata with a `MethodPtr` or `TypeDefPtr`-style
//! indirection (edit-and-continue images, never shipped assemblies) is
//! refused; method type parameters are not shown (perf maps show none).

use std::collections::HashMap;

/// Most bytes of metadata read from one assembly (System.Private.CoreLib
/// 8.0 has about 5 MiB).
pub const MAX_METADATA_BYTES: u32 = 64 << 20;
/// Most bytes of one name read from `#Strings`.
pub const MAX_NAME_BYTES: usize = 1024;
/// Most enclosing types followed for a nested type.
pub const MAX_NESTING: usize = 32;
/// Bytes of PE headers read to find the CLI header (headers and section
/// table; images have 512 or 4096).
pub const PE_HEADER_BYTES: usize = 4096;
/// Sections a PE image may list (the format allows 96).
const MAX_PE_SECTIONS: usize = 96;
/// The metadata root's signature, `BSJB`.
const METADATA_SIGNATURE: u32 = 0x424a_5342;
/// The CLI header's data directory.
const DIRECTORY_CLI: usize = 14;

/// A MethodDef token's table (the top byte).
pub const METHOD_DEF_TABLE: u32 = 0x06;

/// Why an assembly's metadata could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error("reading the assembly for its metadata")]
    Read {
        #[source]
        source: std::io::Error,
    },
    #[error("not a PE image: {reason}")]
    NotPe { reason: &'static str },
    #[error("PE image has no CLI header: not a .NET assembly")]
    NotManaged,
    #[error("assembly metadata is larger than the {limit}-byte limit")]
    TooLarge { limit: u32 },
    #[error("malformed assembly metadata: {reason}")]
    Malformed { reason: &'static str },
    #[error("unsupported assembly metadata: {reason}")]
    Unsupported { reason: &'static str },
}

fn malformed(reason: &'static str) -> MetadataError {
    MetadataError::Malformed { reason }
}

fn u16_at(data: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        data.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        data.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(data: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        data.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// A PE section: where its bytes are in the file and in the image.
#[derive(Clone, Copy, Debug)]
struct PeSection {
    virtual_address: u32,
    raw_offset: u32,
    raw_size: u32,
}

/// What the metadata reader needs of a PE image's headers: its sections
/// and the CLI header's place.
#[derive(Debug)]
struct PeHeaders {
    sections: Vec<PeSection>,
    cli: (u32, u32),
}

impl PeHeaders {
    /// Parses the headers at the start of `data` (PE32 or PE32+).
    fn parse(data: &[u8]) -> Result<Self, MetadataError> {
        let not_pe = |reason| MetadataError::NotPe { reason };
        if data.get(..2) != Some(b"MZ") {
            return Err(not_pe("no MZ signature"));
        }
        let pe = u32_at(data, 0x3c).ok_or(not_pe("truncated DOS header"))? as usize;
        if u32_at(data, pe) != Some(0x0000_4550) {
            return Err(not_pe("no PE signature"));
        }
        let file_header = pe + 4;
        let section_count = usize::from(u16_at(data, file_header + 2).ok_or(not_pe("truncated"))?);
        let optional_size = usize::from(u16_at(data, file_header + 16).ok_or(not_pe("truncated"))?);
        let optional = file_header + 20;
        // The data directories follow the optional header's fixed part.
        let (directories, count_at) = match u16_at(data, optional) {
            Some(0x10b) => (optional + 96, optional + 92),
            Some(0x20b) => (optional + 112, optional + 108),
            _ => return Err(not_pe("unknown optional header magic")),
        };
        let directory_count = u32_at(data, count_at).ok_or(not_pe("truncated"))? as usize;
        if directory_count <= DIRECTORY_CLI {
            return Err(MetadataError::NotManaged);
        }
        let cli_at = directories + 8 * DIRECTORY_CLI;
        let cli = (
            u32_at(data, cli_at).ok_or(not_pe("truncated"))?,
            u32_at(data, cli_at + 4).ok_or(not_pe("truncated"))?,
        );
        if cli.0 == 0 {
            return Err(MetadataError::NotManaged);
        }
        if section_count > MAX_PE_SECTIONS {
            return Err(not_pe("too many sections"));
        }
        let table = optional + optional_size;
        let sections = (0..section_count)
            .map(|i| {
                let at = table + 40 * i;
                Some(PeSection {
                    virtual_address: u32_at(data, at + 12)?,
                    raw_size: u32_at(data, at + 16)?,
                    raw_offset: u32_at(data, at + 20)?,
                })
            })
            .collect::<Option<Vec<_>>>()
            .ok_or(not_pe("truncated section table"))?;
        Ok(Self { sections, cli })
    }

    /// The file range of `size` bytes at `rva`, when one section holds
    /// them all.
    fn file_range(&self, rva: u32, size: u32) -> Option<(u64, u32)> {
        self.sections.iter().find_map(|s| {
            let offset = rva.checked_sub(s.virtual_address)?;
            let end = offset.checked_add(size)?;
            (end <= s.raw_size).then(|| (u64::from(s.raw_offset) + u64::from(offset), size))
        })
    }
}

/// The file range of an image's metadata root, from its headers and its
/// CLI header (read through `read`: offset, length).
fn metadata_range(
    headers: &PeHeaders,
    limit: u32,
    mut read: impl FnMut(u64, u32) -> Result<Vec<u8>, MetadataError>,
) -> Result<(u64, u32), MetadataError> {
    // The CLI header: cb, runtime version, then the metadata directory.
    let (cli_offset, _) = headers
        .file_range(headers.cli.0, 16)
        .ok_or(malformed("CLI header outside the file"))?;
    let cli = read(cli_offset, 16)?;
    let (rva, size) = (
        u32_at(&cli, 8).ok_or(malformed("CLI header truncated"))?,
        u32_at(&cli, 12).ok_or(malformed("CLI header truncated"))?,
    );
    if size > limit.min(MAX_METADATA_BYTES) {
        return Err(MetadataError::TooLarge {
            limit: limit.min(MAX_METADATA_BYTES),
        });
    }
    headers
        .file_range(rva, size)
        .ok_or(malformed("metadata outside the file"))
}

/// The metadata tables, by number (ECMA-335 II.22).
mod table {
    pub const MODULE: usize = 0x00;
    pub const TYPE_REF: usize = 0x01;
    pub const TYPE_DEF: usize = 0x02;
    pub const FIELD_PTR: usize = 0x03;
    pub const FIELD: usize = 0x04;
    pub const METHOD_PTR: usize = 0x05;
    pub const METHOD_DEF: usize = 0x06;
    pub const PARAM: usize = 0x08;
    pub const INTERFACE_IMPL: usize = 0x09;
    pub const MEMBER_REF: usize = 0x0a;
    pub const DECL_SECURITY: usize = 0x0e;
    pub const STAND_ALONE_SIG: usize = 0x11;
    pub const EVENT: usize = 0x14;
    pub const PROPERTY: usize = 0x17;
    pub const MODULE_REF: usize = 0x1a;
    pub const TYPE_SPEC: usize = 0x1b;
    pub const ASSEMBLY: usize = 0x20;
    pub const ASSEMBLY_REF: usize = 0x23;
    pub const FILE: usize = 0x26;
    pub const EXPORTED_TYPE: usize = 0x27;
    pub const MANIFEST_RESOURCE: usize = 0x28;
    pub const NESTED_CLASS: usize = 0x29;
    pub const GENERIC_PARAM: usize = 0x2a;
    pub const METHOD_SPEC: usize = 0x2b;
    pub const GENERIC_PARAM_CONSTRAINT: usize = 0x2c;
}

/// Coded indexes: the tables one can point at, in tag order (II.24.2.6).
mod coded {
    use super::table::*;
    pub const TYPE_DEF_OR_REF: &[usize] = &[TYPE_DEF, TYPE_REF, TYPE_SPEC];
    pub const HAS_CONSTANT: &[usize] = &[FIELD, PARAM, PROPERTY];
    pub const HAS_CUSTOM_ATTRIBUTE: &[usize] = &[
        METHOD_DEF,
        FIELD,
        TYPE_REF,
        TYPE_DEF,
        PARAM,
        INTERFACE_IMPL,
        MEMBER_REF,
        MODULE,
        DECL_SECURITY,
        PROPERTY,
        EVENT,
        STAND_ALONE_SIG,
        MODULE_REF,
        TYPE_SPEC,
        ASSEMBLY,
        ASSEMBLY_REF,
        FILE,
        EXPORTED_TYPE,
        MANIFEST_RESOURCE,
        GENERIC_PARAM,
        GENERIC_PARAM_CONSTRAINT,
        METHOD_SPEC,
    ];
    pub const HAS_FIELD_MARSHAL: &[usize] = &[FIELD, PARAM];
    pub const HAS_DECL_SECURITY: &[usize] = &[TYPE_DEF, METHOD_DEF, ASSEMBLY];
    pub const MEMBER_REF_PARENT: &[usize] =
        &[TYPE_DEF, TYPE_REF, MODULE_REF, METHOD_DEF, TYPE_SPEC];
    pub const HAS_SEMANTICS: &[usize] = &[EVENT, PROPERTY];
    pub const METHOD_DEF_OR_REF: &[usize] = &[METHOD_DEF, MEMBER_REF];
    pub const MEMBER_FORWARDED: &[usize] = &[FIELD, METHOD_DEF];
    pub const IMPLEMENTATION: &[usize] = &[FILE, ASSEMBLY_REF, EXPORTED_TYPE];
    /// Five tags, of which only MethodDef and MemberRef are used.
    pub const CUSTOM_ATTRIBUTE_TYPE: &[usize] =
        &[METHOD_DEF, MEMBER_REF, MEMBER_REF, MEMBER_REF, MEMBER_REF];
    pub const RESOLUTION_SCOPE: &[usize] = &[MODULE, MODULE_REF, ASSEMBLY_REF, TYPE_REF];
    pub const TYPE_OR_METHOD_DEF: &[usize] = &[TYPE_DEF, METHOD_DEF];
}

/// A column of a metadata table.
#[derive(Clone, Copy, Debug)]
enum Column {
    Fixed(u8),
    Strings,
    Guid,
    Blob,
    Index(usize),
    Coded(&'static [usize]),
}

/// The columns of the tables up to the last one read (II.22).
fn columns(number: usize) -> &'static [Column] {
    use Column::{Blob, Coded, Fixed, Guid, Index, Strings};
    use table as t;
    match number {
        0x00 => &[Fixed(2), Strings, Guid, Guid, Guid],
        0x01 => &[Coded(coded::RESOLUTION_SCOPE), Strings, Strings],
        0x02 => &[
            Fixed(4),
            Strings,
            Strings,
            Coded(coded::TYPE_DEF_OR_REF),
            Index(t::FIELD),
            Index(t::METHOD_DEF),
        ],
        0x03 => &[Index(t::FIELD)],
        0x04 => &[Fixed(2), Strings, Blob],
        0x05 => &[Index(t::METHOD_DEF)],
        0x06 => &[Fixed(4), Fixed(2), Fixed(2), Strings, Blob, Index(t::PARAM)],
        0x07 => &[Index(t::PARAM)],
        0x08 => &[Fixed(2), Fixed(2), Strings],
        0x09 => &[Index(t::TYPE_DEF), Coded(coded::TYPE_DEF_OR_REF)],
        0x0a => &[Coded(coded::MEMBER_REF_PARENT), Strings, Blob],
        0x0b => &[Fixed(2), Coded(coded::HAS_CONSTANT), Blob],
        0x0c => &[
            Coded(coded::HAS_CUSTOM_ATTRIBUTE),
            Coded(coded::CUSTOM_ATTRIBUTE_TYPE),
            Blob,
        ],
        0x0d => &[Coded(coded::HAS_FIELD_MARSHAL), Blob],
        0x0e => &[Fixed(2), Coded(coded::HAS_DECL_SECURITY), Blob],
        0x0f => &[Fixed(2), Fixed(4), Index(t::TYPE_DEF)],
        0x10 => &[Fixed(4), Index(t::FIELD)],
        0x11 => &[Blob],
        0x12 => &[Index(t::TYPE_DEF), Index(t::EVENT)],
        0x13 => &[Index(t::EVENT)],
        0x14 => &[Fixed(2), Strings, Coded(coded::TYPE_DEF_OR_REF)],
        0x15 => &[Index(t::TYPE_DEF), Index(t::PROPERTY)],
        0x16 => &[Index(t::PROPERTY)],
        0x17 => &[Fixed(2), Strings, Blob],
        0x18 => &[Fixed(2), Index(t::METHOD_DEF), Coded(coded::HAS_SEMANTICS)],
        0x19 => &[
            Index(t::TYPE_DEF),
            Coded(coded::METHOD_DEF_OR_REF),
            Coded(coded::METHOD_DEF_OR_REF),
        ],
        0x1a => &[Strings],
        0x1b => &[Blob],
        0x1c => &[
            Fixed(2),
            Coded(coded::MEMBER_FORWARDED),
            Strings,
            Index(t::MODULE_REF),
        ],
        0x1d => &[Fixed(4), Index(t::FIELD)],
        0x1e => &[Fixed(4), Fixed(4)],
        0x1f => &[Fixed(4)],
        0x20 => &[
            Fixed(4),
            Fixed(2),
            Fixed(2),
            Fixed(2),
            Fixed(2),
            Fixed(4),
            Blob,
            Strings,
            Strings,
        ],
        0x21 => &[Fixed(4)],
        0x22 => &[Fixed(4), Fixed(4), Fixed(4)],
        0x23 => &[
            Fixed(2),
            Fixed(2),
            Fixed(2),
            Fixed(2),
            Fixed(4),
            Blob,
            Strings,
            Strings,
            Blob,
        ],
        0x24 => &[Fixed(4), Index(t::ASSEMBLY_REF)],
        0x25 => &[Fixed(4), Fixed(4), Fixed(4), Index(t::ASSEMBLY_REF)],
        0x26 => &[Fixed(4), Strings, Blob],
        0x27 => &[
            Fixed(4),
            Fixed(4),
            Strings,
            Strings,
            Coded(coded::IMPLEMENTATION),
        ],
        0x28 => &[Fixed(4), Fixed(4), Strings, Coded(coded::IMPLEMENTATION)],
        0x29 => &[Index(t::TYPE_DEF), Index(t::TYPE_DEF)],
        0x2a => &[
            Fixed(2),
            Fixed(2),
            Coded(coded::TYPE_OR_METHOD_DEF),
            Strings,
        ],
        _ => &[],
    }
}

/// Tables sized and placed: everything up to NestedClass.
const SIZED_TABLES: usize = table::NESTED_CLASS + 1;

/// Where one table is in the metadata, and its columns' places in a row.
#[derive(Clone, Debug, Default)]
struct TableLayout {
    /// Offset of row 1 in the metadata.
    offset: usize,
    rows: u32,
    row_size: usize,
    /// (offset in the row, width) per column.
    columns: Vec<(usize, usize)>,
}

impl TableLayout {
    /// Column `column` of row `rid` (1-based), zero-extended.
    fn get(&self, data: &[u8], rid: u32, column: usize) -> Option<u32> {
        if rid == 0 || rid > self.rows {
            return None;
        }
        let &(at, width) = self.columns.get(column)?;
        let at = self.offset + (rid as usize - 1) * self.row_size + at;
        match width {
            1 => data.get(at).copied().map(u32::from),
            2 => u16_at(data, at).map(u32::from),
            4 => u32_at(data, at),
            _ => None,
        }
    }
}

/// Column numbers of the rows read.
mod col {
    pub const TYPE_DEF_NAME: usize = 1;
    pub const TYPE_DEF_NAMESPACE: usize = 2;
    pub const TYPE_DEF_METHOD_LIST: usize = 5;
    pub const METHOD_DEF_NAME: usize = 3;
    pub const NESTED_CLASS_NESTED: usize = 0;
    pub const NESTED_CLASS_ENCLOSING: usize = 1;
    pub const MODULE_NAME: usize = 1;
    pub const ASSEMBLY_NAME: usize = 7;
}

/// The metadata of one assembly, kept to name its methods; see the module
/// doc.
#[derive(Debug)]
pub struct ClrMetadata {
    /// The metadata, from its root.
    data: Box<[u8]>,
    /// The `#Strings` heap in `data`.
    strings: std::ops::Range<usize>,
    tables: Vec<TableLayout>,
    /// Each TypeDef's first MethodDef row, by TypeDef row - 1.
    method_lists: Vec<u32>,
    /// Nested TypeDef row -> enclosing TypeDef row.
    enclosing: HashMap<u32, u32>,
    /// The assembly's simple name (Assembly table, else the module's name
    /// without `.dll`).
    assembly: Option<String>,
}

impl ClrMetadata {
    /// The metadata of an assembly file read in parts: `header` is its
    /// first bytes (up to [`PE_HEADER_BYTES`], fewer for a short file),
    /// `read(offset, len)` the caller's read of `len` bytes at `offset`.
    /// Metadata over `limit` bytes is refused before it is read (a sparse
    /// file's header can claim 64 MiB that cost its owner nothing).
    pub fn from_parts(
        header: &[u8],
        limit: u32,
        read: impl Fn(u64, u32) -> Result<Vec<u8>, MetadataError>,
    ) -> Result<Self, MetadataError> {
        let headers = PeHeaders::parse(header)?;
        let (offset, size) = metadata_range(&headers, limit, &read)?;
        Self::parse_metadata(read(offset, size)?.into_boxed_slice())
    }

    /// The metadata of a whole PE image already in memory.
    pub fn from_image(image: &[u8]) -> Result<Self, MetadataError> {
        let headers = PeHeaders::parse(image)?;
        let read = |offset: u64, len: u32| {
            usize::try_from(offset)
                .ok()
                .and_then(|at| image.get(at..at.checked_add(len as usize)?))
                .map(<[u8]>::to_vec)
                .ok_or(malformed("metadata outside the file"))
        };
        let (offset, size) = metadata_range(&headers, MAX_METADATA_BYTES, read)?;
        Self::parse_metadata(read(offset, size)?.into_boxed_slice())
    }

    /// Parses metadata that starts at its root (`BSJB`).
    pub fn parse_metadata(data: Box<[u8]>) -> Result<Self, MetadataError> {
        if data.len() > MAX_METADATA_BYTES as usize {
            return Err(MetadataError::TooLarge {
                limit: MAX_METADATA_BYTES,
            });
        }
        let streams = Streams::parse(&data)?;
        let strings = streams.strings.ok_or(malformed("no #Strings heap"))?;
        let (tables_range, uncompressed) = streams.tables.ok_or(malformed("no #~ tables"))?;
        let tables = parse_tables(&data, tables_range, uncompressed)?;
        let type_defs = &tables[table::TYPE_DEF];
        let method_lists = (1..=type_defs.rows)
            .map(|rid| type_defs.get(&data, rid, col::TYPE_DEF_METHOD_LIST))
            .collect::<Option<Vec<u32>>>()
            .ok_or(malformed("TypeDef table truncated"))?;
        let nested = &tables[table::NESTED_CLASS];
        let enclosing = (1..=nested.rows)
            .filter_map(|rid| {
                Some((
                    nested.get(&data, rid, col::NESTED_CLASS_NESTED)?,
                    nested.get(&data, rid, col::NESTED_CLASS_ENCLOSING)?,
                ))
            })
            .collect();
        let mut metadata = Self {
            data,
            strings,
            tables,
            method_lists,
            enclosing,
            assembly: None,
        };
        metadata.assembly = metadata.read_assembly_name();
        Ok(metadata)
    }

    fn read_assembly_name(&self) -> Option<String> {
        let from_assembly = self.tables[table::ASSEMBLY]
            .get(&self.data, 1, col::ASSEMBLY_NAME)
            .and_then(|at| self.string(at));
        let from_assembly = from_assembly.filter(|n| !n.is_empty()).map(str::to_owned);
        from_assembly.or_else(|| {
            let module = self.tables[table::MODULE].get(&self.data, 1, col::MODULE_NAME)?;
            let name = self.string(module)?;
            let name = name
                .strip_suffix(".dll")
                .or_else(|| name.strip_suffix(".exe"))
                .unwrap_or(name);
            (!name.is_empty()).then(|| name.to_owned())
        })
    }

    /// The assembly's simple name: `System.Private.CoreLib`.
    pub fn assembly_name(&self) -> Option<&str> {
        self.assembly.as_deref()
    }

    /// How many MethodDef rows there are (tokens `0x06000001..=0x06000000 +
    /// this`).
    pub fn method_count(&self) -> u32 {
        self.tables[table::METHOD_DEF].rows
    }

    /// Bytes this metadata holds in memory (for a budget).
    pub fn memory_bytes(&self) -> usize {
        self.data.len()
            + self.method_lists.len() * 4
            + self.enclosing.len() * 16
            + self.tables.len() * size_of::<TableLayout>()
    }

    /// The short name of the method with MethodDef token `token`
    /// (`0x06nnnnnn`): `Namespace.Outer+Inner.Method`; `None` for another
    /// token or a row the metadata does not hold.
    pub fn method_name(&self, token: u32) -> Option<String> {
        let (type_name, method) = self.method_parts(token)?;
        let mut name = type_name;
        if !name.is_empty() {
            name.push('.');
        }
        name.push_str(&method);
        Some(name)
    }

    /// The type (`Namespace.Outer+Inner`, empty for a method without an
    /// owner) and the method name of MethodDef token `token`.
    pub fn method_parts(&self, token: u32) -> Option<(String, String)> {
        if token >> 24 != METHOD_DEF_TABLE {
            return None;
        }
        let rid = token & 0x00ff_ffff;
        let methods = &self.tables[table::METHOD_DEF];
        let method = self.string(methods.get(&self.data, rid, col::METHOD_DEF_NAME)?)?;
        let method = method.to_owned();
        // The owner: the last type whose method list starts at or before
        // the method (a hostile, unsorted list gives some type, not a
        // panic).
        let owner = self.method_lists.partition_point(|&first| first <= rid);
        let type_name = if owner == 0 {
            String::new()
        } else {
            self.type_name(owner as u32).unwrap_or_default()
        };
        Some((type_name, method))
    }

    /// The name of TypeDef row `rid`: `Namespace.Outer+Inner`.
    pub fn type_name(&self, rid: u32) -> Option<String> {
        let types = &self.tables[table::TYPE_DEF];
        let mut chain = Vec::new();
        let mut current = rid;
        loop {
            chain.push(self.string(types.get(&self.data, current, col::TYPE_DEF_NAME)?)?);
            match self.enclosing.get(&current) {
                Some(&outer) if chain.len() < MAX_NESTING => current = outer,
                _ => break,
            }
        }
        let namespace = types
            .get(&self.data, current, col::TYPE_DEF_NAMESPACE)
            .and_then(|at| self.string(at))
            .unwrap_or_default();
        let mut name = String::new();
        if !namespace.is_empty() {
            name.push_str(namespace);
            name.push('.');
        }
        for (i, part) in chain.iter().rev().enumerate() {
            if i > 0 {
                name.push('+');
            }
            name.push_str(part);
        }
        Some(name)
    }

    /// The `#Strings` entry at `index`: UTF-8 up to its NUL, at most
    /// [`MAX_NAME_BYTES`]; `None` outside the heap or not UTF-8.
    fn string(&self, index: u32) -> Option<&str> {
        let heap = self.data.get(self.strings.clone())?;
        let rest = heap.get(index as usize..)?;
        let rest = &rest[..rest.len().min(MAX_NAME_BYTES)];
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).ok()
    }
}

/// The streams of a metadata root that are read.
struct Streams {
    strings: Option<std::ops::Range<usize>>,
    /// The tables stream, and whether it is the uncompressed `#-` form.
    tables: Option<(std::ops::Range<usize>, bool)>,
}

impl Streams {
    fn parse(data: &[u8]) -> Result<Self, MetadataError> {
        if u32_at(data, 0) != Some(METADATA_SIGNATURE) {
            return Err(malformed("no BSJB signature"));
        }
        let version_len = u32_at(data, 12).ok_or(malformed("root truncated"))? as usize;
        if version_len > 255 {
            return Err(malformed("version string too long"));
        }
        // Version, then flags (u16) and the stream count (u16).
        let at = 16 + version_len;
        let count = u16_at(data, at + 2).ok_or(malformed("root truncated"))?;
        let mut at = at + 4;
        let mut streams = Self {
            strings: None,
            tables: None,
        };
        for _ in 0..count {
            let offset = u32_at(data, at).ok_or(malformed("stream header truncated"))? as usize;
            let size = u32_at(data, at + 4).ok_or(malformed("stream header truncated"))? as usize;
            let name_at = at + 8;
            let name_len = data
                .get(name_at..)
                .and_then(|rest| rest.iter().take(32).position(|&b| b == 0))
                .ok_or(malformed("stream name unterminated"))?;
            let name = &data[name_at..name_at + name_len];
            let range = offset..offset.checked_add(size).ok_or(malformed("stream size"))?;
            if range.end > data.len() {
                return Err(malformed("stream outside the metadata"));
            }
            match name {
                b"#Strings" => streams.strings = Some(range),
                b"#~" => streams.tables = Some((range, false)),
                b"#-" => streams.tables = Some((range, true)),
                _ => {}
            }
            // The name with its NUL, padded to 4 bytes.
            at = name_at + (name_len + 4) / 4 * 4;
        }
        Ok(streams)
    }
}

/// Places the tables of the tables stream at `range` of `data`.
fn parse_tables(
    data: &[u8],
    range: std::ops::Range<usize>,
    uncompressed: bool,
) -> Result<Vec<TableLayout>, MetadataError> {
    let stream = &data[range.clone()];
    let truncated = || malformed("tables header truncated");
    let heap_sizes = *stream.get(6).ok_or_else(truncated)?;
    let valid = u64_at(stream, 8).ok_or_else(truncated)?;
    let mut rows = [0u32; 64];
    let mut at = 24;
    for (table, count) in rows.iter_mut().enumerate() {
        if valid & (1 << table) != 0 {
            *count = u32_at(stream, at).ok_or_else(truncated)?;
            at += 4;
        }
    }
    // CoreCLR's "extra data" flag: four more bytes before the tables.
    if heap_sizes & 0x40 != 0 {
        at += 4;
    }
    if uncompressed && (rows[table::METHOD_PTR] != 0 || rows[table::FIELD_PTR] != 0) {
        return Err(MetadataError::Unsupported {
            reason: "#- metadata with pointer tables",
        });
    }
    let width = |column: Column| -> usize {
        match column {
            Column::Fixed(n) => usize::from(n),
            Column::Strings => 2 + 2 * usize::from(heap_sizes & 0x1 != 0),
            Column::Guid => 2 + 2 * usize::from(heap_sizes & 0x2 != 0),
            Column::Blob => 2 + 2 * usize::from(heap_sizes & 0x4 != 0),
            Column::Index(t) => 2 + 2 * usize::from(rows[t] >= 1 << 16),
            Column::Coded(targets) => {
                let tag_bits = usize::BITS - (targets.len() - 1).leading_zeros();
                let largest = targets.iter().map(|&t| rows[t]).max().unwrap_or(0);
                2 + 2 * usize::from(u64::from(largest) >= 1 << (16 - tag_bits))
            }
        }
    };
    let mut offset = range.start + at;
    let mut tables = Vec::with_capacity(SIZED_TABLES);
    for (table, &count) in rows.iter().enumerate().take(SIZED_TABLES) {
        let mut row_size = 0;
        let columns = columns(table)
            .iter()
            .map(|&c| {
                let w = width(c);
                row_size += w;
                (row_size - w, w)
            })
            .collect();
        if count != 0 && row_size == 0 {
            return Err(malformed("rows in an unknown table"));
        }
        let bytes = (count as usize)
            .checked_mul(row_size)
            .ok_or(malformed("table size"))?;
        let end = offset.checked_add(bytes).ok_or(malformed("table size"))?;
        if end > range.end {
            return Err(malformed("tables outside their stream"));
        }
        tables.push(TableLayout {
            offset,
            rows: count,
            row_size,
            columns,
        });
        offset = end;
    }
    Ok(tables)
}

#[cfg(test)]
mod tests;
