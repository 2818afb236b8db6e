//! From the start of a JIT code block to the method it is, the last steps
//! of the memory walk ([`super`]):
//!
//! 1. The pointer-sized code header just before the code: a value up to
//!    `StubCodeBlockLast` (0xF) is a stub's kind, anything else a
//!    `RealCodeHeader*`, whose `phdrMDesc` is the `MethodDesc`.
//! 2. `MethodDesc`: classification (`Flags & 7`), the low bits of the
//!    MethodDef token, and its index in its `MethodDescChunk`, which sits
//!    `ChunkIndex * MethodDescAlignment + sizeof(MethodDescChunk)` before it.
//! 3. The chunk gives the high bits of the token and the `MethodTable`,
//!    whose `Module` names the image by `m_pSimpleName`, a pointer into the
//!    image's metadata as the runtime mapped it.
//!
//! Dynamic methods (LCG, IL stubs) have no metadata; .NET 9+ keeps their
//! name in `DynamicMethodDesc`.

use super::{
    layout::ClrLayout,
    target::{ReadError, ReadExt, TargetMemory, checked_ptr},
};

/// `StubCodeBlockLast`: code header values up to this are stub kinds.
const STUB_CODE_BLOCK_LAST: u64 = 0xf;
/// `mcDynamic`: a `DynamicMethodDesc` (LCG or IL stub).
const CLASSIFICATION_DYNAMIC: u16 = 7;
/// `mcArray`: methods of array types, made up by the runtime.
const CLASSIFICATION_ARRAY: u16 = 4;
/// Longest dynamic method name read.
const MAX_DYNAMIC_NAME: usize = 512;

/// What the code header says a code block is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CodeBlock {
    /// A stub allocated in a code heap, by `StubCodeBlockKind`.
    Stub { kind: u32 },
    /// A compiled method.
    Method(MethodRecord),
}

/// A compiled method as the runtime describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodRecord {
    pub code_header: u64,
    pub method_desc: u64,
    /// `MethodClassification` (`Flags & 7`).
    pub classification: u16,
    /// The MethodDef token (0x06xxxxxx); meaningless for dynamic methods.
    pub token: u32,
    /// `Module*`, 0 for dynamic methods whose chunk has none.
    pub module: u64,
    /// The dynamic method's own name, when the runtime keeps it (9+).
    pub dynamic_name: Option<String>,
}

impl MethodRecord {
    pub fn is_dynamic(&self) -> bool {
        self.classification == CLASSIFICATION_DYNAMIC
    }
    pub fn is_array(&self) -> bool {
        self.classification == CLASSIFICATION_ARRAY
    }
}

/// Why a code block could not be read as a method.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum MethodError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("MethodDesc at {method_desc:#x} is not aligned")]
    Misaligned { method_desc: u64 },
}

/// Reads the code header of the block starting at `code_start`.
pub fn read_code_header(mem: &dyn TargetMemory, code_start: u64) -> Result<u64, ReadError> {
    mem.read_u64(
        code_start
            .checked_sub(8)
            .ok_or(ReadError::BadPointer { addr: code_start })?,
    )
}

/// Decodes the block whose code header value is `header`.
pub fn read_code_block(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    header: u64,
) -> Result<CodeBlock, MethodError> {
    if header <= STUB_CODE_BLOCK_LAST {
        return Ok(CodeBlock::Stub {
            kind: header as u32,
        });
    }
    let code_header = checked_ptr(header)?;
    let method_desc = mem.read_ptr(code_header + layout.code_header_method_desc)?;
    if method_desc % layout.method_desc_alignment != 0 {
        return Err(MethodError::Misaligned { method_desc });
    }
    read_method_desc(mem, layout, code_header, method_desc).map(CodeBlock::Method)
}

fn read_method_desc(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    code_header: u64,
    method_desc: u64,
) -> Result<MethodRecord, MethodError> {
    let remainder_bits = layout.token_remainder_bits;
    let remainder = u32::from(mem.read_u16(method_desc + layout.method_desc_token_remainder)?)
        & ((1 << remainder_bits) - 1);
    let chunk_index = u64::from(mem.read_u8(method_desc + layout.method_desc_chunk_index)?);
    let classification = mem.read_u16(method_desc + layout.method_desc_flags)? & 7;
    let chunk = method_desc
        .checked_sub(chunk_index * layout.method_desc_alignment + layout.chunk_size)
        .ok_or(ReadError::BadPointer { addr: method_desc })?;
    let range = u32::from(mem.read_u16(chunk + layout.chunk_token_range)?)
        & ((1 << (24 - remainder_bits)) - 1);
    let token = 0x0600_0000 | (range << remainder_bits) | remainder;
    let dynamic = classification == CLASSIFICATION_DYNAMIC;
    let dynamic_name = match layout.dynamic_method_name {
        Some(offset) if dynamic => mem
            .read_ptr(method_desc + offset)
            .and_then(|name| mem.read_c_string(name, MAX_DYNAMIC_NAME))
            .ok()
            .filter(|name| !name.is_empty()),
        _ => None,
    };
    let module = match mem.read_ptr(chunk + layout.chunk_method_table) {
        Ok(method_table) => mem.read_u64(method_table + layout.method_table_module),
        Err(e) => Err(e),
    };
    let module = match module {
        Ok(module) => module,
        // A dynamic method needs no module to be named.
        Err(_) if dynamic => 0,
        Err(e) => return Err(e.into()),
    };
    Ok(MethodRecord {
        code_header,
        method_desc,
        classification,
        token,
        module,
        dynamic_name,
    })
}

/// The human name of a `StubCodeBlockKind`.
pub fn stub_kind_name(kind: u32) -> &'static str {
    match kind {
        1 => "jump stub",
        2 => "precode",
        3 => "dynamic helper",
        4 => "stub precode",
        5 => "fixup precode",
        6 => "virtual call dispatch stub",
        7 => "virtual call resolve stub",
        8 => "virtual call lookup stub",
        9 => "virtual call vtable stub",
        _ => "runtime stub",
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::clr::memory::target::FakeMemory;

    pub const CODE_HEADER: u64 = 0x5500_0000_1000;
    pub const CHUNK: u64 = 0x5500_0000_2000;
    pub const METHOD_TABLE: u64 = 0x5500_0000_3000;
    pub const MODULE: u64 = 0x5500_0000_4000;

    /// A .NET 8 MethodDesc (index 2 in its chunk) for `token`, with
    /// classification `classification`; returns the MethodDesc address.
    pub fn put_method(mem: &mut FakeMemory, token: u32, classification: u16) -> u64 {
        let md = CHUNK + 0x18 + 2 * 8;
        let mut header = vec![0u8; 0x20];
        header[0x18..0x20].copy_from_slice(&md.to_le_bytes());
        mem.put(CODE_HEADER, &header);
        let mut chunk = vec![0u8; 0x60];
        chunk[0..8].copy_from_slice(&METHOD_TABLE.to_le_bytes());
        chunk[0x12..0x14].copy_from_slice(&(((token & 0xff_ffff) >> 12) as u16).to_le_bytes());
        chunk[0x28..0x2a].copy_from_slice(&((token & 0xfff) as u16 | 0x8000).to_le_bytes());
        chunk[0x2a] = 2;
        chunk[0x2e..0x30].copy_from_slice(&classification.to_le_bytes());
        mem.put(CHUNK, &chunk);
        let mut method_table = vec![0u8; 0x20];
        method_table[0x18..0x20].copy_from_slice(&MODULE.to_le_bytes());
        mem.put(METHOD_TABLE, &method_table);
        md
    }

    #[test]
    fn decodes_net8_method_desc() {
        let layout = ClrLayout::for_major(8).unwrap();
        let mut mem = FakeMemory::new();
        let md = put_method(&mut mem, 0x0600_1234, 0);
        let block = read_code_block(&mem, &layout, CODE_HEADER).unwrap();
        let CodeBlock::Method(method) = block else {
            panic!("not a method: {block:?}")
        };
        assert_eq!(method.method_desc, md);
        assert_eq!(method.token, 0x0600_1234);
        assert_eq!(method.module, MODULE);
        assert!(!method.is_dynamic());
    }

    #[test]
    fn small_headers_are_stubs() {
        let layout = ClrLayout::for_major(8).unwrap();
        let mem = FakeMemory::new();
        assert_eq!(
            read_code_block(&mem, &layout, 5).unwrap(),
            CodeBlock::Stub { kind: 5 }
        );
        assert_eq!(stub_kind_name(5), "fixup precode");
        assert!(read_code_block(&mem, &layout, 0x10).is_err());
    }

    #[test]
    fn dynamic_methods_need_no_module() {
        let mut layout = ClrLayout::for_major(9).unwrap();
        layout.dynamic_method_name = Some(0x20);
        let mut mem = FakeMemory::new();
        let md = put_method(&mut mem, 0x0600_0001, 7);
        mem.poke(CHUNK, &0u64.to_le_bytes());
        mem.poke(md + 0x20, &0x5500_0000_5000u64.to_le_bytes());
        let mut name = vec![0u8; 4096];
        name[..15].copy_from_slice(b"lambda_method12");
        mem.put(0x5500_0000_5000, &name);
        let CodeBlock::Method(method) = read_code_block(&mem, &layout, CODE_HEADER).unwrap() else {
            panic!("not a method")
        };
        assert!(method.is_dynamic());
        assert_eq!(method.module, 0);
        assert_eq!(method.dynamic_name.as_deref(), Some("lambda_method12"));
    }
}
