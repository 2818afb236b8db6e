//! Where CoreCLR keeps what the memory walk reads, per major version: the
//! offsets of `RangeSection`, `HeapList`, `RealCodeHeader`, `MethodDesc`,
//! `MethodDescChunk`, `MethodTable` and `Module` fields on 64-bit targets.
//!
//! .NET 6, 7 and 8 have no self-description: their numbers are written
//! here from the runtime's headers (`codeman.h`, `method.hpp`,
//! `methodtable.h`, `ceeload.h` at v6.0/v7.0/v8.0 release tags, as the
//! OpenTelemetry eBPF profiler encodes them in `interpreter/dotnet/data.go`
//! @ b442421). .NET 9 starts from the .NET 8 numbers; .NET 9 and later
//! carry a contract descriptor (`DotNetRuntimeContractDescriptor`, cDAC)
//! whose JSON names types, fields and globals, and whatever it names
//! overrides the table ([`ClrLayout::apply_descriptor`]).
//!
//! Tested against a live runtime: .NET 8.0.4 (tests/tests/end_to_end/jit_names_from_memory.rs).
//! Not tested here (no runtime on this machine): 6, 7, 9, 10; their
//! numbers are from sources only. .NET Core 3.1 and .NET 5 are refused:
//! their `libcoreclr.so` exports no `g_dacTable` (the table's address is
//! compiled into `libmscordaccore.so`).

use serde_json::Value;

/// The largest structure size a descriptor may declare that we read.
const MAX_STRUCT_SIZE: u64 = 64 * 1024;
/// The largest field offset a descriptor may declare.
const MAX_FIELD_OFFSET: u64 = 64 * 1024;
/// The oldest and one past the newest major version with a layout.
pub const OLDEST_MAJOR: u32 = 6;
pub const NEWEST_MAJOR: u32 = 10;

/// How the code range map is organised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeRangeMapKind {
    /// .NET 6/7: `ExecutionManager::m_CodeRangeList`, a linked list of
    /// `RangeSection`s; the DAC slot holds the address of the head pointer.
    List,
    /// .NET 8+: `ExecutionManager::g_codeRangeMap`, a 5-level radix map of
    /// `RangeSectionFragment` lists; the DAC slot holds its address.
    Map,
}

/// How the nibble map of a code heap finds the start of a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NibbleMapKind {
    /// 6-9 (`NibbleMapLinearLookup`): walk back over zero DWORDs.
    Linear,
    /// 10+ (`NibbleMapConstantLookup`): DWORDs inside a method hold a
    /// relative pointer to its start.
    Constant,
}

/// Offsets for one runtime; see the module doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClrLayout {
    pub major: u32,
    /// .NET 6 stores 32-bit RVAs in `g_dacTable`, later versions pointers.
    pub dac_entries_are_rvas: bool,
    /// Slot of the code range list/map in `g_dacTable`.
    pub dac_code_range_slot: u64,
    pub code_range_map: CodeRangeMapKind,
    pub nibble_map: NibbleMapKind,

    pub range_begin: u64,
    pub range_end_open: u64,
    /// .NET 6/7 list link.
    pub range_next: u64,
    pub range_flags: u64,
    pub range_heap_list: u64,
    pub range_r2r_module: u64,
    /// .NET 8+ stub range list (`CodeRangeMapRangeList*`).
    pub range_range_list: u64,
    /// `CodeRangeMapRangeList::_rangeListType` (a `StubCodeBlockKind`).
    pub range_list_type: u64,

    pub heap_start: u64,
    pub heap_end: u64,
    pub heap_map_base: u64,
    pub heap_header_map: u64,

    pub code_header_method_desc: u64,

    pub method_desc_token_remainder: u64,
    pub method_desc_chunk_index: u64,
    pub method_desc_flags: u64,
    pub method_desc_alignment: u64,
    pub token_remainder_bits: u32,
    /// `DynamicMethodDesc::m_pszMethodName` (8 written down, 9+ from the
    /// descriptor).
    pub dynamic_method_name: Option<u64>,

    pub chunk_method_table: u64,
    pub chunk_token_range: u64,
    pub chunk_size: u64,

    pub method_table_module: u64,
    /// `Module::m_pSimpleName`: a pointer into the `#Strings` heap of the
    /// mapped image, which tells the image's file.
    pub module_simple_name: u64,
}

impl ClrLayout {
    /// The layout written down for `major` on x86-64; `None` outside 6-10.
    pub fn for_major(major: u32) -> Option<Self> {
        if !(OLDEST_MAJOR..=NEWEST_MAJOR).contains(&major) {
            return None;
        }
        let old_list = major <= 7;
        Some(Self {
            major,
            dac_entries_are_rvas: major == 6,
            dac_code_range_slot: 0,
            code_range_map: if old_list {
                CodeRangeMapKind::List
            } else {
                CodeRangeMapKind::Map
            },
            nibble_map: if major >= 10 {
                NibbleMapKind::Constant
            } else {
                NibbleMapKind::Linear
            },
            range_begin: 0,
            range_end_open: 8,
            range_next: 0x18,
            range_flags: if old_list { 0x28 } else { 0x10 },
            range_heap_list: if old_list { 0x30 } else { 0x28 },
            range_r2r_module: if old_list { 0x30 } else { 0x20 },
            range_range_list: 0x30,
            range_list_type: 0x120,
            heap_start: 0x10,
            heap_end: 0x18,
            heap_map_base: 0x20,
            heap_header_map: 0x28,
            // 0x20 with FEATURE_GDBJIT, which release builds do not define.
            code_header_method_desc: 0x18,
            method_desc_token_remainder: 0,
            method_desc_chunk_index: 2,
            method_desc_flags: 6,
            method_desc_alignment: 8,
            token_remainder_bits: match major {
                6 => 14,
                7 => 13,
                _ => 12,
            },
            // `DynamicMethodDesc::m_pszMethodName` follows `MethodDesc` (8
            // bytes) and `StoredSigMethodDesc`'s `m_pSig`, `m_cSig` and
            // `m_dwExtendedFlags` (method.hpp at v8.0.0); checked against a
            // live 8.0.4 by tests/tests/end_to_end/jit_names_from_memory.rs. Left out
            // for .NET 6/7, whose headers (relative pointers in 6) are not
            // checked against a runtime here: `[dynamic method]` there.
            dynamic_method_name: (major == 8).then_some(0x18),
            chunk_method_table: 0,
            chunk_token_range: 0x12,
            chunk_size: 0x18,
            // .NET 6/7: the loader module, which for non-generic code is the
            // defining one; 8+: the defining module.
            method_table_module: 0x18,
            module_simple_name: match major {
                6 => 0x8,
                7 => 0x100,
                _ => 0x108,
            },
        })
    }

    /// Applies what a contract descriptor's JSON names (types, fields,
    /// globals, contract versions) over the written-down numbers. Unknown
    /// names are ignored; a value out of bounds is an error, and the
    /// layout is left as it was.
    pub fn apply_descriptor(&mut self, json: &[u8]) -> Result<(), LayoutError> {
        let root: Value = serde_json::from_slice(json).map_err(|_| LayoutError::Json)?;
        let mut next = self.clone();
        let types = root.get("types").and_then(Value::as_object);
        let field = |ty: &str, name: &str| -> Result<Option<u64>, LayoutError> {
            let Some(v) = types.and_then(|t| t.get(ty)).and_then(|t| t.get(name)) else {
                return Ok(None);
            };
            let value = match v {
                Value::Array(items) => items.first().and_then(number),
                other => number(other),
            }
            .ok_or(LayoutError::BadField {
                ty: ty.into(),
                name: name.into(),
            })?;
            let limit = if name == "!" {
                MAX_STRUCT_SIZE
            } else {
                MAX_FIELD_OFFSET
            };
            if value > limit {
                return Err(LayoutError::BadField {
                    ty: ty.into(),
                    name: name.into(),
                });
            }
            Ok(Some(value))
        };
        let set = |slot: &mut u64, ty: &str, name: &str| -> Result<(), LayoutError> {
            if let Some(v) = field(ty, name)? {
                *slot = v;
            }
            Ok(())
        };
        set(&mut next.range_begin, "RangeSection", "RangeBegin")?;
        set(&mut next.range_end_open, "RangeSection", "RangeEndOpen")?;
        set(&mut next.range_flags, "RangeSection", "Flags")?;
        set(&mut next.range_heap_list, "RangeSection", "HeapList")?;
        set(&mut next.range_r2r_module, "RangeSection", "R2RModule")?;
        match field("RangeSection", "RangeList")? {
            Some(v) => next.range_range_list = v,
            // The 10 descriptor leaves it out; it follows the heap list.
            None if field("RangeSection", "HeapList")?.is_some() => {
                next.range_range_list = next.range_heap_list + 8;
            }
            None => {}
        }
        set(
            &mut next.range_list_type,
            "CodeRangeMapRangeList",
            "RangeListType",
        )?;
        set(&mut next.heap_start, "CodeHeapListNode", "StartAddress")?;
        set(&mut next.heap_end, "CodeHeapListNode", "EndAddress")?;
        set(&mut next.heap_map_base, "CodeHeapListNode", "MapBase")?;
        set(&mut next.heap_header_map, "CodeHeapListNode", "HeaderMap")?;
        set(
            &mut next.code_header_method_desc,
            "RealCodeHeader",
            "MethodDesc",
        )?;
        set(
            &mut next.method_desc_token_remainder,
            "MethodDesc",
            "Flags3AndTokenRemainder",
        )?;
        set(
            &mut next.method_desc_chunk_index,
            "MethodDesc",
            "ChunkIndex",
        )?;
        set(&mut next.method_desc_flags, "MethodDesc", "Flags")?;
        if let Some(v) = field("DynamicMethodDesc", "MethodName")? {
            next.dynamic_method_name = Some(v);
        }
        set(
            &mut next.chunk_method_table,
            "MethodDescChunk",
            "MethodTable",
        )?;
        set(
            &mut next.chunk_token_range,
            "MethodDescChunk",
            "FlagsAndTokenRange",
        )?;
        set(&mut next.chunk_size, "MethodDescChunk", "!")?;
        set(&mut next.method_table_module, "MethodTable", "Module")?;
        // `m_pSimpleName` sits just before `m_path` (OTel's synthesis).
        if let Some(path) = field("Module", "Path")? {
            next.module_simple_name = path.checked_sub(8).ok_or(LayoutError::BadField {
                ty: "Module".into(),
                name: "Path".into(),
            })?;
        }
        next.apply_globals(&root)?;
        *self = next;
        Ok(())
    }

    /// The globals and contract versions of a descriptor (see
    /// [`Self::apply_descriptor`]).
    fn apply_globals(&mut self, root: &Value) -> Result<(), LayoutError> {
        let next = self;
        let globals = root.get("globals").and_then(Value::as_object);
        let global = |name: &str| -> Option<u64> {
            match globals?.get(name)? {
                Value::Array(items) => items.first().and_then(number),
                other => number(other),
            }
        };
        if let Some(v) = global("MethodDescAlignment") {
            if !matches!(v, 4 | 8 | 16) {
                return Err(LayoutError::BadGlobal("MethodDescAlignment"));
            }
            next.method_desc_alignment = v;
        }
        if let Some(v) = global("MethodDescTokenRemainderBitCount") {
            if !(1..24).contains(&v) {
                return Err(LayoutError::BadGlobal("MethodDescTokenRemainderBitCount"));
            }
            next.token_remainder_bits = v as u32;
        }
        let contract = root
            .get("contracts")
            .and_then(|c| c.get("ExecutionManager"))
            .and_then(number);
        if let Some(version) = contract {
            next.nibble_map = if version >= 2 {
                NibbleMapKind::Constant
            } else {
                NibbleMapKind::Linear
            };
        }
        Ok(())
    }
}

/// A number as descriptors write them: JSON number, or a decimal or `0x`
/// hex string.
fn number(value: &Value) -> Option<u64> {
    match value {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => s.parse().ok(),
        },
        _ => None,
    }
}

/// Why a contract descriptor could not be applied.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LayoutError {
    #[error("contract descriptor is not JSON")]
    Json,
    #[error("contract descriptor field {ty}.{name} is missing its value or out of bounds")]
    BadField { ty: String, name: String },
    #[error("contract descriptor global {0} is out of bounds")]
    BadGlobal(&'static str),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_outside_six_to_ten_have_no_layout() {
        assert!(ClrLayout::for_major(3).is_none());
        assert!(ClrLayout::for_major(5).is_none());
        assert!(ClrLayout::for_major(11).is_none());
        let net6 = ClrLayout::for_major(6).unwrap();
        assert!(net6.dac_entries_are_rvas);
        assert_eq!(net6.code_range_map, CodeRangeMapKind::List);
        assert_eq!(net6.token_remainder_bits, 14);
        let net8 = ClrLayout::for_major(8).unwrap();
        assert_eq!(net8.code_range_map, CodeRangeMapKind::Map);
        assert_eq!((net8.range_flags, net8.range_heap_list), (0x10, 0x28));
        assert_eq!(net8.module_simple_name, 0x108);
        assert_eq!(
            ClrLayout::for_major(10).unwrap().nibble_map,
            NibbleMapKind::Constant
        );
    }

    /// The compact descriptor form of docs/design/datacontracts/data_descriptor.md:
    /// plain and `[offset, "type"]` fields, `"!"` sizes, typed globals.
    #[test]
    fn descriptor_overrides_table() {
        let json = br#"{"version":0,"baseline":"empty",
            "types":{"MethodDesc":{"!":8,"ChunkIndex":[3,"uint8"],"Flags":4,"Flags3AndTokenRemainder":0},
                     "MethodDescChunk":{"!":32,"MethodTable":0,"FlagsAndTokenRange":[26,"uint16"]},
                     "RangeSection":{"RangeBegin":0,"RangeEndOpen":8,"Flags":16,"HeapList":48,"R2RModule":40},
                     "Module":{"Path":"0x90"},
                     "DynamicMethodDesc":{"MethodName":40}},
            "globals":{"MethodDescAlignment":[8,"uint64"],"MethodDescTokenRemainderBitCount":["0xc","uint8"]},
            "contracts":{"ExecutionManager":2}}"#;
        let mut layout = ClrLayout::for_major(9).unwrap();
        layout.apply_descriptor(json).unwrap();
        assert_eq!(layout.method_desc_chunk_index, 3);
        assert_eq!(layout.method_desc_flags, 4);
        assert_eq!(layout.chunk_size, 32);
        assert_eq!(layout.chunk_token_range, 26);
        assert_eq!(layout.range_heap_list, 48);
        assert_eq!(layout.range_range_list, 56);
        assert_eq!(layout.module_simple_name, 0x88);
        assert_eq!(layout.dynamic_method_name, Some(40));
        assert_eq!(layout.token_remainder_bits, 12);
        assert_eq!(layout.nibble_map, NibbleMapKind::Constant);
    }

    #[test]
    fn hostile_descriptor_leaves_layout_alone() {
        let before = ClrLayout::for_major(9).unwrap();
        for json in [
            &br#"{"types":{"MethodDescChunk":{"!":100000000}}}"#[..],
            br#"{"types":{"Module":{"Path":4}}}"#,
            br#"{"globals":{"MethodDescAlignment":[3,"uint8"]}}"#,
            br#"{"types":{"MethodDesc":{"Flags":"zz"}}}"#,
            b"not json",
        ] {
            let mut layout = before.clone();
            assert!(
                layout.apply_descriptor(json).is_err(),
                "{}",
                String::from_utf8_lossy(json)
            );
            assert_eq!(layout, before);
        }
    }
}
