//! Every JIT-compiled method of a process and its code range, from the
//! runtime's memory: what the unwinder's JIT rows ([`crate::unwind::jit_code`])
//! are made of when no perf map lists the methods (`--managed-names memory`,
//! a process without its diagnostic socket or with a read-only `/tmp`).
//! [`super::names::JitMemoryNames`] holds a [`CodeHeapScan`] and hands its
//! new methods to the .NET instance, which sends them to the unwind worker
//! as it does the perf map's.
//!
//! 1. The code heaps: every `RangeSection` of the code range map (.NET 8+:
//!    all five levels of `RangeSectionMap` walked, then each leaf's fragment
//!    list; .NET 6/7: the `RangeSection` list) whose flags say JIT code heap,
//!    read as in [`super::code_map`]. Done again every [`HEAPS_EVERY`]: heaps are
//!    added rarely, and the map's leaves are many small reads.
//! 2. Each heap's nibble map, read whole up to its used end
//!    (`HeapList.endAddress`, read again at every scan) and walked forward:
//!    every non-zero nibble is a block start (the .NET 10 map's pointer
//!    DWORDs, inside a method, are skipped).
//! 3. Each new start's code header: a stub kind (`<= 0xF`) is skipped; a
//!    `RealCodeHeader` gives the method's size from its `unwindInfos[]`
//!    (x64 `RUNTIME_FUNCTION {Begin, End, UnwindData}` right after
//!    `phdrMDesc` and `nUnwindInfos`: last `End` - first `Begin`, the same
//!    base cancelling out), checked against the next block's start; when it
//!    does not check out, the next block's code header bounds the method.
//!
//! Starts seen are remembered with their end: a scan reads only the headers
//! of new starts. A start gone from a heap's nibble map (code freed with its
//! collectible assembly or dynamic method) is forgotten, so code put there
//! later is read afresh; its rows stay until new code overlaps them (no pc
//! runs in freed code). Everything is bounded: map nodes, heaps, nibble map
//! bytes and methods per scan, and the scan's time, which all processes
//! share ([`super::budget::SCAN_TIME_PER_SECOND`], checked at every
//! read). Known limits: an OSR method is not told from others (its rows
//! come from its own prologue, as if it were entered by a call); a start
//! freed and reused between two scans keeps the first method's end. Pinned reference: dotnet/runtime
//! `src/coreclr/vm/codeman.h` (`RealCodeHeader`, `HeapList`,
//! `RangeSectionMap`).

use std::{
    collections::{BTreeMap, HashSet},
    time::{Duration, Instant},
};

use super::{
    budget::Metered,
    code_map::{CodeHeap, CodeMapError, CodeRangeKind, RangeFragment, read_range_section},
    layout::{ClrLayout, CodeRangeMapKind, NibbleMapKind},
    target::{MAX_READ, ReadError, ReadExt, TargetMemory, checked_ptr},
};
use crate::unwind::jit_code::{JitMethod, MAX_METHODS_PER_PROCESS};

/// Code heaps are listed again at most this often.
pub const HEAPS_EVERY: Duration = Duration::from_secs(10);
/// A process's methods are scanned at most this often.
pub const SCAN_EVERY: Duration = Duration::from_secs(1);
/// `RangeSectionMap` nodes (2 KiB each) read at most in one listing.
const MAX_MAP_NODES: usize = 1024;
/// Fragments read at most in one listing.
const MAX_FRAGMENTS_READ: usize = 65_536;
/// Code heaps kept at most.
const MAX_HEAPS: usize = 4096;
/// Nibble map bytes read at most in one scan (64 MiB of code at 1/64).
const MAX_MAP_BYTES: u64 = 1 << 20;
/// Methods with more unwind infos (funclets) than this are bounded by the
/// next block instead.
const MAX_UNWIND_INFOS: u32 = 4096;
/// Time one scan may take; the rest waits for the next.
const MAX_SCAN_TIME: Duration = Duration::from_millis(200);
/// Bytes of a `RangeSectionMap` level: 256 pointers.
const MAP_NODE_BYTES: usize = 256 * 8;
/// Levels of a `RangeSectionMap` above the fragment lists.
const MAP_LEVELS: u32 = 5;
/// `StubCodeBlockLast`: code header values up to this are stub kinds.
const STUB_CODE_BLOCK_LAST: u64 = 0xf;
/// `sizeof(CodeHeader)`, just before a block's code.
const CODE_HEADER_BYTES: u64 = 8;
/// `sizeof(T_RUNTIME_FUNCTION)` on x64.
const RUNTIME_FUNCTION_BYTES: u64 = 12;

/// What the scans found and where they stopped, for the debug log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodeScanStats {
    pub scans: u64,
    pub heaps: u64,
    /// Methods handed out, by extent source.
    pub from_unwind_info: u64,
    pub from_next_block: u64,
    /// Stub blocks in code heaps (no rows: frame pointers).
    pub stubs: u64,
    /// Starts gone from their heap's nibble map since the last scan.
    pub freed: u64,
    /// Listings or heaps that failed (unreadable or inconsistent memory).
    pub failed: u64,
    /// Code headers that could not be read.
    pub bad_headers: u64,
    /// Scans stopped by a bound (methods, map bytes, time).
    pub bounded: u64,
}

/// A code heap as the scan keeps it: the `HeapList*`, read again at each
/// scan for its used end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KnownHeap {
    heap_list: u64,
    heap: CodeHeap,
}

/// The JIT methods of one process found so far; see the module doc.
#[derive(Debug, Default)]
pub struct CodeHeapScan {
    heaps: Vec<KnownHeap>,
    heaps_listed_at: Option<Instant>,
    scanned_at: Option<Instant>,
    /// Block start -> end of every method handed out, and of stubs (end 0).
    known: BTreeMap<u64, u64>,
    pub stats: CodeScanStats,
}

impl CodeHeapScan {
    /// The methods found since the last call, at most every [`SCAN_EVERY`];
    /// `code_ranges` is DAC slot 0 (see [`code_map::find_code_range`]).
    ///
    /// [`code_map::find_code_range`]: super::code_map::find_code_range
    pub fn take_new_methods(
        &mut self,
        mem: &dyn TargetMemory,
        layout: &ClrLayout,
        code_ranges: u64,
    ) -> Vec<JitMethod> {
        if self.scanned_at.is_some_and(|t| t.elapsed() < SCAN_EVERY) {
            return Vec::new();
        }
        let began = Instant::now();
        // All processes' scans share their time: a scan whose turn has no
        // time left waits for a later tick.
        let shared = super::budget::global();
        let Some(deadline) = shared.scan_deadline(MAX_SCAN_TIME, began) else {
            return Vec::new();
        };
        let metered = Metered::new(mem, deadline, u64::MAX);
        let new = self.scan(&metered, layout, code_ranges, began, deadline);
        shared.charge_scan(began.elapsed(), metered.stopped());
        new
    }

    /// [`Self::take_new_methods`] once it is due: reads through `mem`,
    /// which refuses reads after `deadline`.
    fn scan(
        &mut self,
        mem: &dyn TargetMemory,
        layout: &ClrLayout,
        code_ranges: u64,
        began: Instant,
        deadline: Instant,
    ) -> Vec<JitMethod> {
        self.scanned_at = Some(began);
        self.stats.scans += 1;
        if self
            .heaps_listed_at
            .is_none_or(|t| t.elapsed() >= HEAPS_EVERY)
        {
            self.heaps_listed_at = Some(began);
            match list_code_heaps(mem, layout, code_ranges) {
                Ok(heaps) => self.heaps = heaps,
                Err(e) => {
                    self.stats.failed += 1;
                    tracing::debug!("code heap scan: listing heaps: {e}");
                }
            }
            self.stats.heaps = self.heaps.len() as u64;
        }
        let mut new = Vec::new();
        let mut map_bytes = 0u64;
        for i in 0..self.heaps.len() {
            if Instant::now() >= deadline || map_bytes >= MAX_MAP_BYTES {
                self.stats.bounded += 1;
                break;
            }
            let known = self.heaps[i];
            let heap = match reread_heap(mem, layout, &known) {
                Ok(heap) => heap,
                Err(e) => {
                    self.stats.failed += 1;
                    tracing::debug!("code heap scan: heap {:#x}: {e}", known.heap_list);
                    continue;
                }
            };
            self.heaps[i].heap = heap;
            let starts = match block_starts(mem, layout.nibble_map, &heap, &mut map_bytes) {
                Ok(starts) => starts,
                Err(e) => {
                    self.stats.failed += 1;
                    tracing::debug!("code heap scan: nibble map of {:#x}: {e}", heap.start);
                    continue;
                }
            };
            self.forget_freed(&heap, &starts);
            if !self.add_methods(mem, layout, &heap, &starts, &mut new, deadline) {
                self.stats.bounded += 1;
                break;
            }
        }
        new
    }

    /// Forgets the starts of `heap` that are no longer in its nibble map.
    fn forget_freed(&mut self, heap: &CodeHeap, starts: &[u64]) {
        let found: HashSet<u64> = starts.iter().copied().collect();
        let gone: Vec<u64> = self
            .known
            .range(heap.start..heap.end)
            .map(|(&start, _)| start)
            .filter(|start| !found.contains(start))
            .collect();
        self.stats.freed += gone.len() as u64;
        for start in gone {
            self.known.remove(&start);
        }
    }

    /// Reads the code header of each new start in `starts` (sorted) and
    /// pushes its method onto `new`. False when a bound stopped it.
    fn add_methods(
        &mut self,
        mem: &dyn TargetMemory,
        layout: &ClrLayout,
        heap: &CodeHeap,
        starts: &[u64],
        new: &mut Vec<JitMethod>,
        deadline: Instant,
    ) -> bool {
        for (i, &start) in starts.iter().enumerate() {
            if self.known.contains_key(&start) {
                continue;
            }
            if self.known.len() >= MAX_METHODS_PER_PROCESS || Instant::now() >= deadline {
                return false;
            }
            let bound = starts
                .get(i + 1)
                .map_or(heap.end, |next| next.saturating_sub(CODE_HEADER_BYTES));
            if bound <= start {
                continue;
            }
            match method_extent(mem, layout, start, bound) {
                Ok(Extent::Stub) => {
                    self.stats.stubs += 1;
                    self.known.insert(start, 0);
                }
                Ok(Extent::Method { end, from_unwind }) => {
                    if from_unwind {
                        self.stats.from_unwind_info += 1;
                    } else {
                        self.stats.from_next_block += 1;
                    }
                    self.known.insert(start, end);
                    new.push(JitMethod {
                        start,
                        end,
                        osr_base: None,
                    });
                }
                // Read again at the next scan (the JIT may be writing it).
                Err(_) => self.stats.bad_headers += 1,
            }
        }
        true
    }
}

/// What a block's code header says of its extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Extent {
    Stub,
    Method { end: u64, from_unwind: bool },
}

/// The extent of the block at `start`, no further than `bound`.
fn method_extent(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    start: u64,
    bound: u64,
) -> Result<Extent, ReadError> {
    let header = mem.read_u64(start - CODE_HEADER_BYTES)?;
    if header <= STUB_CODE_BLOCK_LAST {
        return Ok(Extent::Stub);
    }
    let real = checked_ptr(header)?;
    let count_at = real + layout.code_header_method_desc + 8;
    let raw: [u8; 12] = mem.read_array(count_at)?;
    let word = |i: usize| u32::from_le_bytes([raw[i], raw[i + 1], raw[i + 2], raw[i + 3]]);
    let (count, first_begin, first_end) = (word(0), word(4), word(8));
    let last_end = match count {
        0 => None,
        1 => Some(first_end),
        n if n <= MAX_UNWIND_INFOS => {
            let last = count_at + 4 + u64::from(n - 1) * RUNTIME_FUNCTION_BYTES;
            mem.read_u32(last + 4).ok()
        }
        _ => None,
    };
    let from_unwind = last_end
        .filter(|&end| first_begin < first_end && first_end <= end)
        .map(|end| start + u64::from(end - first_begin))
        .filter(|&end| end <= bound);
    Ok(match from_unwind {
        Some(end) => Extent::Method {
            end,
            from_unwind: true,
        },
        None => Extent::Method {
            end: bound,
            from_unwind: false,
        },
    })
}

/// Every block start of `heap`'s nibble map below its used end, sorted;
/// `map_bytes` counts the bytes read against [`MAX_MAP_BYTES`].
fn block_starts(
    mem: &dyn TargetMemory,
    kind: NibbleMapKind,
    heap: &CodeHeap,
    map_bytes: &mut u64,
) -> Result<Vec<u64>, CodeMapError> {
    if heap.map_base > heap.start || heap.start > heap.end {
        return Err(CodeMapError::BadHeap {
            start: heap.start,
            end: heap.end,
            pc: heap.start,
        });
    }
    // One DWORD per 256 bytes of code.
    let dwords = (heap.end - heap.map_base).div_ceil(256);
    let bytes = dwords.saturating_mul(4).min(MAX_MAP_BYTES - *map_bytes);
    let mut starts = Vec::new();
    let mut block = [0u8; MAX_READ];
    let mut offset = 0u64;
    while offset < bytes {
        let len = (bytes - offset).min(MAX_READ as u64) as usize & !3;
        if len == 0 {
            break;
        }
        mem.read(heap.header_map + offset, &mut block[..len])?;
        for (i, chunk) in block[..len].chunks_exact(4).enumerate() {
            let dword = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            let index = offset / 4 + i as u64;
            push_dword_starts(kind, heap, index, dword, &mut starts);
        }
        offset += len as u64;
    }
    *map_bytes += bytes;
    Ok(starts)
}

/// The block starts DWORD `index` of the nibble map (`dword`) holds.
fn push_dword_starts(
    kind: NibbleMapKind,
    heap: &CodeHeap,
    index: u64,
    dword: u32,
    out: &mut Vec<u64>,
) {
    // .NET 10: a DWORD whose low nibble is above 8 points into a method
    // that started earlier; no block starts in its 256 bytes.
    if dword == 0 || (kind == NibbleMapKind::Constant && dword & 0xf > 8) {
        return;
    }
    // Nibble 0 of a DWORD is its top nibble.
    for j in 0..8u64 {
        let nibble = u64::from((dword >> (28 - 4 * j)) & 0xf);
        if nibble == 0 {
            continue;
        }
        let start = heap.map_base + (index * 8 + j) * 32 + (nibble - 1) * 4;
        if (heap.start..heap.end).contains(&start) {
            out.push(start);
        }
    }
}

/// The heap at `known.heap_list` as it is now (its used end grows).
fn reread_heap(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    known: &KnownHeap,
) -> Result<CodeHeap, ReadError> {
    let heap = read_heap_list(mem, layout, known.heap_list)?;
    // Another heap now (the HeapList was freed and reused): same fields
    // expected but the start.
    if heap.start != known.heap.start || heap.header_map != known.heap.header_map {
        return Err(ReadError::BadPointer {
            addr: known.heap_list,
        });
    }
    Ok(heap)
}

fn read_heap_list(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    heap_list: u64,
) -> Result<CodeHeap, ReadError> {
    Ok(CodeHeap {
        start: mem.read_u64(heap_list + layout.heap_start)?,
        end: mem.read_u64(heap_list + layout.heap_end)?,
        map_base: mem.read_u64(heap_list + layout.heap_map_base)?,
        header_map: mem.read_ptr(heap_list + layout.heap_header_map)?,
    })
}

/// Every JIT code heap of the code range map at `code_ranges`.
fn list_code_heaps(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    code_ranges: u64,
) -> Result<Vec<KnownHeap>, CodeMapError> {
    let sections = match layout.code_range_map {
        CodeRangeMapKind::Map => map_sections(mem, code_ranges)?,
        CodeRangeMapKind::List => list_sections(mem, layout, code_ranges)?,
    };
    let mut heaps = Vec::new();
    for section in sections {
        let Ok(begin) = mem.read_u64(section + layout.range_begin) else {
            continue;
        };
        let range = match read_range_section(mem, layout, section, begin) {
            Ok(Some(range)) => range,
            _ => continue,
        };
        if let CodeRangeKind::JitHeap(heap) = range.kind
            && let Ok(heap_list) = mem.read_ptr(section + layout.range_heap_list)
        {
            heaps.push(KnownHeap { heap_list, heap });
            if heaps.len() >= MAX_HEAPS {
                break;
            }
        }
    }
    heaps.sort_by_key(|h| h.heap.start);
    heaps.dedup_by_key(|h| h.heap.start);
    Ok(heaps)
}

/// The distinct `RangeSection*` of a .NET 8+ `RangeSectionMap`.
fn map_sections(mem: &dyn TargetMemory, map: u64) -> Result<Vec<u64>, CodeMapError> {
    let mut nodes = vec![(checked_ptr(map)?, 1u32)];
    let mut read_nodes = 0usize;
    let mut fragments_read = 0usize;
    let mut seen_fragments = HashSet::new();
    let mut sections = HashSet::new();
    let mut raw = [0u8; MAP_NODE_BYTES];
    while let Some((node, level)) = nodes.pop() {
        read_nodes += 1;
        if read_nodes > MAX_MAP_NODES {
            return Err(CodeMapError::ListTooLong);
        }
        mem.read(node, &mut raw)?;
        for entry in raw.chunks_exact(8) {
            let mut b = [0u8; 8];
            b.copy_from_slice(entry);
            // Bit 0 tags collectible memory.
            let entry = u64::from_le_bytes(b) & !1;
            if entry == 0 {
                continue;
            }
            let entry = checked_ptr(entry)?;
            if level < MAP_LEVELS {
                nodes.push((entry, level + 1));
                continue;
            }
            // A leaf: its fragment list.
            let mut fragment = entry;
            while seen_fragments.insert(fragment) {
                fragments_read += 1;
                if fragments_read > MAX_FRAGMENTS_READ {
                    return Err(CodeMapError::ListTooLong);
                }
                let RangeFragment { next, section, .. } = RangeFragment::read(mem, fragment)?;
                if section != 0 {
                    sections.insert(checked_ptr(section)?);
                }
                match next {
                    0 => break,
                    next => fragment = checked_ptr(next)?,
                }
            }
        }
    }
    let mut sections: Vec<u64> = sections.into_iter().collect();
    sections.sort_unstable();
    Ok(sections)
}

/// The `RangeSection*` of the .NET 6/7 list whose head is at `head_addr`.
fn list_sections(
    mem: &dyn TargetMemory,
    layout: &ClrLayout,
    head_addr: u64,
) -> Result<Vec<u64>, CodeMapError> {
    let mut sections = Vec::new();
    let mut section = mem.read_u64(head_addr)?;
    for _ in 0..super::code_map::MAX_RANGE_SECTIONS {
        if section == 0 {
            return Ok(sections);
        }
        let section_ptr = checked_ptr(section)?;
        sections.push(section_ptr);
        section = mem.read_u64(section_ptr + layout.range_next)?;
    }
    Err(CodeMapError::ListTooLong)
}

/// The methods `reader`'s process compiled since `scan` last looked (at
/// most every [`SCAN_EVERY`]), logged with the scan's counts.
pub fn take_new_code<M: TargetMemory>(
    reader: &super::ClrMemoryReader<M>,
    scan: &mut CodeHeapScan,
) -> Vec<JitMethod> {
    let new = reader.take_new_methods(scan);
    if !new.is_empty() {
        tracing::debug!(methods = new.len(), stats = ?scan.stats, "JIT methods from memory");
    }
    new
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clr::memory::{
        code_map::tests::{HEADER_MAP, MAP_BASE, nibble_map},
        method::tests::CODE_HEADER,
        target::FakeMemory,
        tests::{METHOD_START, RANGE_MAP, net8_memory},
    };

    /// A second `RealCodeHeader`, with no unwind info.
    const OTHER_HEADER: u64 = 0x5e00_0000_0000;
    const HEAP_END: u64 = MAP_BASE + 0x3000;

    /// `nUnwindInfos` and the `RUNTIME_FUNCTION`s after a .NET 8
    /// `RealCodeHeader`'s `phdrMDesc` (at 0x18).
    fn unwind_infos(functions: &[(u32, u32)]) -> Vec<u8> {
        let mut out = (functions.len() as u32).to_le_bytes().to_vec();
        for &(begin, end) in functions {
            for word in [begin, end, 0x77] {
                out.extend(word.to_le_bytes());
            }
        }
        out
    }

    fn scan_now(scan: &mut CodeHeapScan, mem: &FakeMemory) -> Vec<JitMethod> {
        scan.scanned_at = None;
        let layout = ClrLayout::for_major(8).unwrap();
        scan.take_new_methods(mem, &layout, RANGE_MAP)
    }

    #[test]
    fn finds_methods_with_their_unwind_extent_and_skips_stubs() {
        let mut mem = net8_memory();
        // Main body 0x40 bytes, one funclet of 0x10 after it; Begin is
        // relative to a base the scan never needs.
        mem.put(
            CODE_HEADER + 0x20,
            &unwind_infos(&[(0x1000, 0x1040), (0x1040, 0x1050)]),
        );
        let mut scan = CodeHeapScan::default();
        assert_eq!(
            scan_now(&mut scan, &mem),
            vec![JitMethod {
                start: METHOD_START,
                end: METHOD_START + 0x50,
                osr_base: None
            }]
        );
        assert_eq!(scan.stats.heaps, 1);
        assert_eq!(scan.stats.stubs, 1);
        assert_eq!(scan.stats.from_unwind_info, 1);
        // Within SCAN_EVERY: not scanned; after it, nothing new.
        let layout = ClrLayout::for_major(8).unwrap();
        assert!(scan.take_new_methods(&mem, &layout, RANGE_MAP).is_empty());
        assert!(scan_now(&mut scan, &mem).is_empty());
        assert_eq!(scan.stats.scans, 2);
    }

    #[test]
    fn freed_starts_are_forgotten_and_bad_unwind_info_is_bounded() {
        let mut mem = net8_memory();
        mem.put(CODE_HEADER + 0x20, &unwind_infos(&[(0x1000, 0x1040)]));
        let mut scan = CodeHeapScan::default();
        assert_eq!(scan_now(&mut scan, &mem).len(), 1);
        // The method is freed; another is put at 0x2000 whose unwind info
        // claims more than the heap holds.
        let other = MAP_BASE + 0x2000;
        mem.poke(HEADER_MAP, &nibble_map(&[MAP_BASE + 0x20, other], 64));
        mem.poke(other - 8, &OTHER_HEADER.to_le_bytes());
        let mut header = vec![0u8; 0x20];
        header.extend(unwind_infos(&[(0x10, 0x9000)]));
        mem.put(OTHER_HEADER, &header);
        assert_eq!(
            scan_now(&mut scan, &mem),
            vec![JitMethod {
                start: other,
                end: HEAP_END,
                osr_base: None
            }]
        );
        assert_eq!(scan.stats.freed, 1);
        assert_eq!(scan.stats.from_next_block, 1);
        // Put back at the freed start, it is read again.
        mem.poke(
            HEADER_MAP,
            &nibble_map(&[MAP_BASE + 0x20, METHOD_START, other], 64),
        );
        assert_eq!(
            scan_now(&mut scan, &mem),
            vec![JitMethod {
                start: METHOD_START,
                end: METHOD_START + 0x40,
                osr_base: None
            }]
        );
    }

    #[test]
    fn hostile_maps_end_in_errors_not_loops() {
        let layout = ClrLayout::for_major(8).unwrap();
        // Every level's entries point back at the map itself: the walk
        // stops at the node bound.
        let mut mem = FakeMemory::new();
        let node: Vec<u8> = (0..256)
            .flat_map(|_| (RANGE_MAP | 1).to_le_bytes())
            .collect();
        mem.put(RANGE_MAP, &node);
        assert!(matches!(
            list_code_heaps(&mem, &layout, RANGE_MAP),
            Err(CodeMapError::ListTooLong)
        ));
        // An unreadable map: an error, counted by the scan.
        let mut scan = CodeHeapScan::default();
        assert!(scan_now(&mut scan, &FakeMemory::new()).is_empty());
        assert_eq!(scan.stats.failed, 1);
        // A heap whose used end is far past its map: the read fails.
        let heap = CodeHeap {
            start: MAP_BASE + 0x10,
            end: MAP_BASE + (1 << 40),
            map_base: MAP_BASE,
            header_map: HEADER_MAP,
        };
        let mut bytes = 0;
        assert!(block_starts(&net8_memory(), NibbleMapKind::Linear, &heap, &mut bytes).is_err());
    }
}
