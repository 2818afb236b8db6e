//! From a program counter to the start of the code block holding it, the
//! first steps of the memory walk ([`super`]):
//!
//! 1. The code range: .NET 8+ looks the PC up in `RangeSectionMap` (five
//!    levels of 256 pointers indexed by address bits 56-49 ... 24-17, then a
//!    list of `RangeSectionFragment {next, begin, end_open, RangeSection*}`;
//!    bit 0 of every level and `next` pointer tags collectible memory and is
//!    masked). .NET 6/7 walk the `RangeSection` list.
//! 2. The range's kind from `RangeSection.Flags`: a JIT code heap (0x2,
//!    `HeapList*`), a stub range (0x4, .NET 8+, kind in its
//!    `CodeRangeMapRangeList`), else a ReadyToRun image (`R2RModule`).
//! 3. In a code heap, the nibble map (`HeapList.pHdrMap`, one 4-bit entry
//!    per 32-byte bucket, eight per big-endian-ordered DWORD) gives the start
//!    of the block ([`find_code_start`]): the runtime's `FindMethodCode`,
//!    linear (6-9) or with relative pointers (10+).
//!
//! Every walk is bounded: lists by [`MAX_FRAGMENTS`] and
//! [`MAX_RANGE_SECTIONS`], the backward nibble scan by
//! [`MAX_NIBBLE_DWORDS`] (a method longer than 2 MiB is not named).

use super::{
    layout::{ClrLayout, CodeRangeMapKind, NibbleMapKind},
    target::{ReadError, ReadExt, TargetMemory, checked_ptr},
};

/// `RangeSectionFlags`: the range is a JIT code heap.
const RANGE_CODE_HEAP: u32 = 0x2;
/// `RangeSectionFlags`: the range holds stubs (.NET 8+).
const RANGE_RANGE_LIST: u32 = 0x4;
/// Longest fragment list followed in one map leaf.
pub const MAX_FRAGMENTS: usize = 64;
/// Longest `RangeSection` list followed (.NET 6/7).
pub const MAX_RANGE_SECTIONS: usize = 4096;
/// DWORDs of nibble map scanned backwards at most (256 bytes of code each).
pub const MAX_NIBBLE_DWORDS: u64 = 8192;
/// Nibble map DWORDs read per backward step.
const NIBBLE_BLOCK: usize = 64;

/// The code range a PC falls in, as the runtime registered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeRange {
    pub begin: u64,
    pub end: u64,
    pub kind: CodeRangeKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeRangeKind {
    /// A JIT code heap and its nibble map.
    JitHeap(CodeHeap),
    /// Runtime stubs of one `StubCodeBlockKind`.
    Stubs { kind: u32 },
    /// A ReadyToRun image; `module` is its `Module*`.
    ReadyToRun { module: u64 },
}

/// What of a `HeapList` the nibble lookup needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeHeap {
    pub start: u64,
    pub end: u64,
    pub map_base: u64,
    pub header_map: u64,
}

/// Why a PC could not be placed in a code block.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CodeMapError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("code range list is longer than {MAX_RANGE_SECTIONS} or loops")]
    ListTooLong,
    #[error("range section {begin:#x}..{end:#x} is empty or upside down")]
    BadRange { begin: u64, end: u64 },
    #[error("code heap {start:#x}..{end:#x} is not a valid heap for {pc:#x}")]
    BadHeap { start: u64, end: u64, pc: u64 },
    #[error("method at {pc:#x} is longer than the nibble scan bound")]
    MethodTooLong { pc: u64 },
}

/// The code range holding `pc`, or `None` if the runtime registered none.
/// `code_ranges` is what the DAC slot points at (the map, or the list head's
/// address).
pub fn find_code_range(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    code_ranges: u64,
    pc: u64,
) -> Result<Option<CodeRange>, CodeMapError> {
    let section = match layout.code_range_map {
        CodeRangeMapKind::Map => find_in_map(mem, code_ranges, pc)?,
        CodeRangeMapKind::List => find_in_list(mem, layout, code_ranges, pc)?,
    };
    match section {
        Some(section) => read_range_section(mem, layout, section, pc),
        None => Ok(None),
    }
}

/// `RangeSectionMap::LookupRangeSection` for 64-bit targets.
fn find_in_map(mem: &dyn TargetMemory, map: u64, pc: u64) -> Result<Option<u64>, CodeMapError> {
    let mut level = checked_ptr(map)?;
    for shift in [49u32, 41, 33, 25, 17] {
        let index = (pc >> shift) & 0xff;
        let entry = mem.read_u64(level + index * 8)? & !1;
        if entry == 0 {
            return Ok(None);
        }
        level = checked_ptr(entry)?;
    }
    let mut fragment = level;
    for _ in 0..MAX_FRAGMENTS {
        let RangeFragment {
            next,
            begin,
            end_open,
            section,
        } = RangeFragment::read(mem, fragment)?;
        if (begin..end_open).contains(&pc) {
            return Ok(Some(checked_ptr(section)?));
        }
        if next == 0 {
            return Ok(None);
        }
        fragment = checked_ptr(next)?;
    }
    Err(CodeMapError::ListTooLong)
}

/// A `RangeSectionFragment` of a map leaf's list (.NET 8+).
pub(super) struct RangeFragment {
    /// The next fragment, its collectible tag (bit 0) masked; 0 ends.
    pub next: u64,
    pub begin: u64,
    pub end_open: u64,
    /// Its `RangeSection*`.
    pub section: u64,
}

impl RangeFragment {
    pub(super) fn read(mem: &dyn TargetMemory, at: u64) -> Result<Self, CodeMapError> {
        let raw: [u8; 32] = mem.read_array(at)?;
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[i * 8..i * 8 + 8]);
            u64::from_le_bytes(b)
        };
        Ok(Self {
            next: word(0) & !1,
            begin: word(1),
            end_open: word(2),
            section: word(3),
        })
    }
}

/// `ExecutionManager::m_CodeRangeList` walk (.NET 6/7).
fn find_in_list(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    head_addr: u64,
    pc: u64,
) -> Result<Option<u64>, CodeMapError> {
    let mut section = mem.read_u64(head_addr)?;
    for _ in 0..MAX_RANGE_SECTIONS {
        if section == 0 {
            return Ok(None);
        }
        let section_ptr = checked_ptr(section)?;
        let begin = mem.read_u64(section_ptr + layout.range_begin)?;
        let end = mem.read_u64(section_ptr + layout.range_end_open)?;
        if (begin..end).contains(&pc) {
            return Ok(Some(section_ptr));
        }
        section = mem.read_u64(section_ptr + layout.range_next)?;
    }
    Err(CodeMapError::ListTooLong)
}

/// The range `section` registers, `None` when `pc` is not in it.
pub(super) fn read_range_section(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    section: u64,
    pc: u64,
) -> Result<Option<CodeRange>, CodeMapError> {
    let begin = mem.read_u64(section + layout.range_begin)?;
    let end = mem.read_u64(section + layout.range_end_open)?;
    if begin >= end {
        return Err(CodeMapError::BadRange { begin, end });
    }
    if !(begin..end).contains(&pc) {
        // A fragment left over from a deleted (collectible) section.
        return Ok(None);
    }
    let flags = mem.read_u32(section + layout.range_flags)?;
    let kind = if flags & RANGE_CODE_HEAP != 0 {
        let heap = mem.read_ptr(section + layout.range_heap_list)?;
        let code_heap = CodeHeap {
            start: mem.read_u64(heap + layout.heap_start)?,
            end: mem.read_u64(heap + layout.heap_end)?,
            map_base: mem.read_u64(heap + layout.heap_map_base)?,
            header_map: mem.read_ptr(heap + layout.heap_header_map)?,
        };
        CodeRangeKind::JitHeap(code_heap)
    } else if layout.code_range_map == CodeRangeMapKind::Map && flags & RANGE_RANGE_LIST != 0 {
        let list = mem.read_ptr(section + layout.range_range_list)?;
        CodeRangeKind::Stubs {
            kind: mem.read_u32(list + layout.range_list_type)?,
        }
    } else {
        CodeRangeKind::ReadyToRun {
            module: mem.read_u64(section + layout.range_r2r_module)?,
        }
    };
    Ok(Some(CodeRange { begin, end, kind }))
}

const NIBBLES_PER_DWORD: u64 = 8;
const BYTES_PER_BUCKET: u64 = 32;
const NIBBLE_MASK: u32 = 0xf;

/// The start of the code block holding `pc` in `heap`, or `None` if no
/// block starts before it: `EEJitManager::FindMethodCode`.
pub fn find_code_start(
    mem: &dyn TargetMemory,
    kind: NibbleMapKind,
    heap: &CodeHeap,
    pc: u64,
) -> Result<Option<u64>, CodeMapError> {
    let bad_heap = CodeMapError::BadHeap {
        start: heap.start,
        end: heap.end,
        pc,
    };
    if pc < heap.start || pc > heap.end || heap.map_base > heap.start {
        return Err(bad_heap);
    }
    let delta = pc - heap.map_base;
    let pos = delta / BYTES_PER_BUCKET;
    // Nibble values are 1 + the 4-byte slot of the start in its bucket.
    let offset = ((delta % BYTES_PER_BUCKET) >> 2) as u32 + 1;
    let dword_index = pos / NIBBLES_PER_DWORD;
    let dword = mem.read_u32(heap.header_map + dword_index * 4)?;
    let at =
        |pos: u64, nibble: u32| heap.map_base + pos * BYTES_PER_BUCKET + u64::from(nibble - 1) * 4;
    if kind == NibbleMapKind::Constant && dword & NIBBLE_MASK > 8 {
        return Ok(Some(decode_pointer(heap.map_base, dword)));
    }
    // Our nibble in the low bits (nibble 0 of a DWORD is its top nibble).
    let mut tmp = dword >> (28 - ((pos % NIBBLES_PER_DWORD) << 2));
    if tmp & NIBBLE_MASK != 0 && tmp & NIBBLE_MASK <= offset {
        return Ok(Some(at(pos, tmp & NIBBLE_MASK)));
    }
    tmp >>= 4;
    let mut pos = pos;
    if tmp != 0 {
        pos -= 1;
        while tmp & NIBBLE_MASK == 0 {
            tmp >>= 4;
            pos -= 1;
        }
        return Ok(Some(at(pos, tmp & NIBBLE_MASK)));
    }
    if dword_index == 0 {
        return Ok(None);
    }
    // The previous DWORDs: for the constant map only the one before.
    let (prev, prev_index) = match kind {
        NibbleMapKind::Constant => {
            let prev = mem.read_u32(heap.header_map + (dword_index - 1) * 4)?;
            if prev & NIBBLE_MASK > 8 {
                return Ok(Some(decode_pointer(heap.map_base, prev)));
            }
            (prev, dword_index - 1)
        }
        NibbleMapKind::Linear => match last_nonzero_dword(mem, heap.header_map, dword_index, pc)? {
            Some(found) => found,
            None => return Ok(None),
        },
    };
    if prev == 0 {
        return Ok(None);
    }
    let mut tmp = prev;
    let mut pos = prev_index * NIBBLES_PER_DWORD + NIBBLES_PER_DWORD - 1;
    while tmp & NIBBLE_MASK == 0 {
        tmp >>= 4;
        pos -= 1;
    }
    Ok(Some(at(pos, tmp & NIBBLE_MASK)))
}

/// `base + relative pointer` of a constant-lookup pointer DWORD: the top 28
/// bits, with the low nibble's 9..=12 standing for bits 2-3.
fn decode_pointer(map_base: u64, dword: u32) -> u64 {
    let nibble = dword & NIBBLE_MASK;
    map_base + u64::from((dword & !NIBBLE_MASK) + ((nibble - 9) << 2))
}

/// The last non-zero DWORD before `index`, read backwards in blocks.
fn last_nonzero_dword(
    mem: &dyn TargetMemory,
    map: u64,
    index: u64,
    pc: u64,
) -> Result<Option<(u32, u64)>, CodeMapError> {
    let lowest = index.saturating_sub(MAX_NIBBLE_DWORDS);
    let mut end = index;
    let mut block = [0u8; NIBBLE_BLOCK * 4];
    while end > lowest {
        let start = end.saturating_sub(NIBBLE_BLOCK as u64).max(lowest);
        let count = (end - start) as usize;
        mem.read(map + start * 4, &mut block[..count * 4])?;
        for i in (0..count).rev() {
            let mut b = [0u8; 4];
            b.copy_from_slice(&block[i * 4..i * 4 + 4]);
            let dword = u32::from_le_bytes(b);
            if dword != 0 {
                return Ok(Some((dword, start + i as u64)));
            }
        }
        end = start;
    }
    if lowest == 0 {
        Ok(None)
    } else {
        Err(CodeMapError::MethodTooLong { pc })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::clr::memory::target::FakeMemory;

    pub const MAP_BASE: u64 = 0x7f00_0000_0000;
    pub const HEADER_MAP: u64 = 0x7e00_0000_0000;

    /// A nibble map (linear form) with blocks starting at `starts`.
    pub fn nibble_map(starts: &[u64], dwords: usize) -> Vec<u8> {
        let mut map = vec![0u32; dwords];
        for &start in starts {
            let delta = start - MAP_BASE;
            let pos = delta / 32;
            let nibble = ((delta % 32) >> 2) as u32 + 1;
            map[(pos / 8) as usize] |= nibble << (28 - ((pos % 8) << 2));
        }
        map.iter().flat_map(|d| d.to_le_bytes()).collect()
    }

    fn heap(end: u64) -> CodeHeap {
        CodeHeap {
            start: MAP_BASE + 0x10,
            end,
            map_base: MAP_BASE,
            header_map: HEADER_MAP,
        }
    }

    #[test]
    fn linear_lookup_finds_starts() {
        let starts = [
            MAP_BASE + 0x20,
            MAP_BASE + 0x90,
            MAP_BASE + 0xb8,
            MAP_BASE + 0x1920,
        ];
        let mut mem = FakeMemory::new();
        mem.put(HEADER_MAP, &nibble_map(&starts, 64));
        let heap = heap(MAP_BASE + 0x3000);
        let find = |pc| find_code_start(&mem, NibbleMapKind::Linear, &heap, pc).unwrap();
        assert_eq!(find(MAP_BASE + 0x20), Some(MAP_BASE + 0x20));
        assert_eq!(find(MAP_BASE + 0x8f), Some(MAP_BASE + 0x20));
        assert_eq!(find(MAP_BASE + 0x94), Some(MAP_BASE + 0x90));
        // Same bucket as the start at 0xb8, but before it.
        assert_eq!(find(MAP_BASE + 0xa4), Some(MAP_BASE + 0x90));
        assert_eq!(find(MAP_BASE + 0xbc), Some(MAP_BASE + 0xb8));
        // Several zero DWORDs back.
        assert_eq!(find(MAP_BASE + 0x1900), Some(MAP_BASE + 0xb8));
        assert_eq!(find(MAP_BASE + 0x2fff), Some(MAP_BASE + 0x1920));
        assert_eq!(find(MAP_BASE + 0x18), None);
    }

    #[test]
    fn constant_lookup_decodes_pointers() {
        let mut map = nibble_map(&[MAP_BASE + 0x24], 4);
        // DWORD 1 (code 0x100..0x200) is fully inside the block at 0x24.
        let rel = 0x24u32;
        let pointer = (rel & !0xf) + ((rel & 0xf) >> 2) + 9;
        map[4..8].copy_from_slice(&pointer.to_le_bytes());
        let mut mem = FakeMemory::new();
        mem.put(HEADER_MAP, &map);
        let heap = heap(MAP_BASE + 0x400);
        let find = |pc| find_code_start(&mem, NibbleMapKind::Constant, &heap, pc).unwrap();
        assert_eq!(find(MAP_BASE + 0x150), Some(MAP_BASE + 0x24));
        assert_eq!(find(MAP_BASE + 0x30), Some(MAP_BASE + 0x24));
        // DWORD 2 is empty: the previous one is a pointer.
        assert_eq!(find(MAP_BASE + 0x210), Some(MAP_BASE + 0x24));
        // DWORD 3 empty and DWORD 2 empty: not in a method.
        assert_eq!(find(MAP_BASE + 0x310), None);
    }

    #[test]
    fn hostile_heaps_are_errors() {
        let mem = FakeMemory::new();
        let small = heap(MAP_BASE + 0x400);
        assert!(matches!(
            find_code_start(&mem, NibbleMapKind::Linear, &small, MAP_BASE + 0x500),
            Err(CodeMapError::BadHeap { .. })
        ));
        assert!(matches!(
            find_code_start(&mem, NibbleMapKind::Linear, &small, MAP_BASE + 0x100),
            Err(CodeMapError::Read(_))
        ));
        // An all-zero map far longer than the scan bound.
        let mut mem = FakeMemory::new();
        let dwords = (MAX_NIBBLE_DWORDS + 100) as usize;
        mem.put(HEADER_MAP, &vec![0u8; dwords * 4]);
        let pc = MAP_BASE + (dwords as u64 - 1) * 256;
        let long_heap = heap(pc + 1);
        assert!(matches!(
            find_code_start(&mem, NibbleMapKind::Linear, &long_heap, pc),
            Err(CodeMapError::MethodTooLong { .. })
        ));
    }
}
