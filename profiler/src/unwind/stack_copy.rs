//! Unwinding a copied user stack in userspace: the second half of the
//! kernel's stack copies (`profiler-ebpf/src/stack_copy.rs`). A sample of a
//! process whose unwind tables were not in the kernel yet carries its
//! registers and up to 16 KiB of stack from sp; once the tables are
//! loaded, [`replay`] walks the copy with the process's index as the
//! kernel holds it and the rows of the kernel's row array, with
//! [`clrbpf_common::unwind::next_frame`], the step the kernel runs. The
//! lookup is the kernel's: the mapping by binary search, the row through
//! the table's row index; a pc in no indexed mapping takes the
//! frame-pointer rule and is reported, so the caller can wait for a
//! rescan.
//!
//! Known limits: the copy is the stack at the sample, but the tables are
//! those of the moment of the replay (a library unloaded in between is
//! walked without its rows); only the leaf's code bytes are copied, so a
//! signal frame's interrupted code is not peeked at; a stack deeper than
//! the copy ends with [`UnwindError::BadRead`] where the copy ends.

use clrbpf_common::{
    MAX_USER_STACK_DEPTH,
    unwind::{
        CfaRule, MemoryReader, ProcessMappings, ROW_INDEX_WORDS_PER_ROW, UnwindError, UnwindRegs,
        UnwindRow, find_mapping, find_row_index_indexed, next_frame, row_index_word,
    },
};

use crate::profile::RawSample;

/// A sample whose user stack the kernel copied instead of walking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopiedSample {
    /// The sample, with the kernel's frame-pointer walk as its user stack:
    /// what is kept when the copy cannot be unwound.
    pub sample: RawSample,
    pub regs: UnwindRegs,
    /// The 8 code bytes at `regs.pc`, when they could be read.
    pub code: Option<u64>,
    /// The stack from `regs.sp` up.
    pub stack: Vec<u8>,
}

impl CopiedSample {
    /// Bytes held, for the memory bound of the copies waiting for tables.
    pub fn held_bytes(&self) -> usize {
        self.stack.len()
            + 8 * (self.sample.user_stack.len() + self.sample.kernel_stack.len())
            + size_of::<Self>()
    }
}

impl MemoryReader for CopiedSample {
    fn read_u64(&self, addr: u64) -> Option<u64> {
        let at = usize::try_from(addr.checked_sub(self.regs.sp)?).ok()?;
        let word = self.stack.get(at..at.checked_add(8)?)?;
        Some(u64::from_le_bytes(word.try_into().ok()?))
    }

    fn read_code_u64(&self, addr: u64) -> Option<u64> {
        if addr == self.regs.pc {
            return self.code;
        }
        None
    }
}

/// What [`replay`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replay {
    /// Leaf first.
    pub frames: Vec<u64>,
    /// Why the walk ended early, `None` for a clean end.
    pub error: Option<UnwindError>,
    /// A pc was in none of the index's mappings (stepped by frame
    /// pointer): the process mapped code after its last scan.
    pub unindexed: bool,
}

/// Walks `copy` with the process index `mappings` and the kernel's row
/// array, read with `row_at` (row `i` of the array, `None` past it).
pub fn replay(
    copy: &CopiedSample,
    mappings: &ProcessMappings,
    row_at: impl Fn(u32) -> Option<UnwindRow>,
) -> Replay {
    let mut out = Replay::default();
    let mut regs = copy.regs;
    let mut interrupted = true;
    let mut unindexed = false;
    let mut lookup = |pc: u64| match lookup(mappings, &row_at, pc) {
        Err(UnwindError::NoMapping) => {
            unindexed = true;
            Ok(None)
        }
        other => other,
    };
    loop {
        if out.frames.len() >= MAX_USER_STACK_DEPTH {
            out.error = Some(UnwindError::TooDeep);
            break;
        }
        if regs.pc == 0 {
            out.error = Some(UnwindError::PcZero);
            break;
        }
        out.frames.push(regs.pc);
        match next_frame(&mut regs, &mut interrupted, &mut lookup, copy) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                out.error = Some(e);
                break;
            }
        }
    }
    out.unindexed = unindexed;
    out
}

/// The row for `pc`, as the kernel's lookup finds it
/// (`profiler-ebpf/src/unwind.rs`): `Ok(None)` for a mapping without a
/// table (the frame-pointer rule).
fn lookup(
    mappings: &ProcessMappings,
    row_at: &impl Fn(u32) -> Option<UnwindRow>,
    pc: u64,
) -> Result<Option<UnwindRow>, UnwindError> {
    let entries = &mappings.entries;
    let index = find_mapping(
        mappings.len,
        |i| entries.get(i as usize).map(|e| (e.start, e.end)),
        pc,
    )
    .ok_or(UnwindError::NoMapping)?;
    let entry = entries.get(index as usize).ok_or(UnwindError::NoMapping)?;
    if entry.row_count == 0 {
        return Ok(None);
    }
    let vaddr = pc.wrapping_sub(entry.bias);
    let first = entry.row_offset;
    let words = first.wrapping_add(entry.row_count);
    let at = find_row_index_indexed(
        &entry.row_index(),
        entry.row_count,
        |w| {
            row_at(words.wrapping_add(w / ROW_INDEX_WORDS_PER_ROW))
                .map(|slot| row_index_word(&slot, w))
        },
        |i| row_at(first.wrapping_add(i)).map(|r| r.pc),
        vaddr,
    )
    .ok_or(UnwindError::NoTableRow)?;
    let row = row_at(first.wrapping_add(at)).ok_or(UnwindError::NoTableRow)?;
    if row.cfa_rule == CfaRule::NoInfo as u8 {
        return Err(UnwindError::NoTableRow);
    }
    Ok(Some(row))
}

#[cfg(test)]
mod tests {
    use clrbpf_common::unwind::{MappingEntry, RowIndex};

    use super::*;

    const SP: u64 = 0x7ff0_0000;
    /// A "glibc" mapping with rows (no frame pointer) and a "JIT" one
    /// without (the frame-pointer rule).
    const LIB: (u64, u64) = (0x1000, 0x2000);
    const JIT: (u64, u64) = (0x5000, 0x6000);

    fn copy(stack: &[(u64, u64)], pc: u64, fp: u64) -> CopiedSample {
        let mut bytes = vec![0u8; 512];
        for &(addr, value) in stack {
            let at = (addr - SP) as usize;
            bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        }
        CopiedSample {
            sample: RawSample::on_cpu(7, 7, 1, vec![pc]),
            regs: UnwindRegs {
                pc,
                sp: SP,
                fp,
                lr: 0,
            },
            // `nop`s: no `push rbp` or `ret` to peek at.
            code: Some(0x9090_9090_9090_9090),
            stack: bytes,
        }
    }

    /// The library's table: one function at 0x1100..0x1200 whose CFA is
    /// sp + 32 (no frame pointer), then no info.
    fn rows() -> Vec<UnwindRow> {
        vec![
            UnwindRow::new(0x100, CfaRule::SpOffset, 32),
            UnwindRow::no_info(0x200),
        ]
    }

    fn mappings(with_lib: bool) -> ProcessMappings {
        let mut m = ProcessMappings::EMPTY;
        let mut entries = Vec::new();
        if with_lib {
            entries.push(
                MappingEntry {
                    start: LIB.0,
                    end: LIB.1,
                    bias: 0x1000,
                    ..MappingEntry::default()
                }
                .with_table(0, 2, RowIndex::default(), 1),
            );
        }
        entries.push(MappingEntry {
            start: JIT.0,
            end: JIT.1,
            ..MappingEntry::default()
        });
        for (slot, e) in m.entries.iter_mut().zip(&entries) {
            *slot = *e;
        }
        m.len = entries.len() as u32;
        m
    }

    /// JIT leaf (frame pointers) -> glibc without them -> JIT caller ->
    /// its caller, ending at a zero return address.
    fn managed_through_glibc() -> CopiedSample {
        // Leaf frame record at SP+0x10: saved fp (garbage for glibc: it
        // does not keep rbp) and the return address into the library.
        // The library frame's CFA is its sp (SP+0x20) + 32 = SP+0x40; its
        // return address at CFA-8 goes to JIT code, whose frame record is
        // at the fp the library left alone: SP+0x80.
        copy(
            &[
                (SP + 0x10, SP + 0x80),
                (SP + 0x18, 0x1150),
                (SP + 0x38, 0x5400),
                (SP + 0x80, SP + 0x100),
                (SP + 0x88, 0x5600),
                (SP + 0x100, 0),
                (SP + 0x108, 0),
            ],
            0x5100,
            SP + 0x10,
        )
    }

    #[test]
    fn a_copy_walks_through_code_without_frame_pointers_once_its_rows_exist() {
        let rows = rows();
        let row_at = |i: u32| rows.get(i as usize).copied();
        let walked = replay(&managed_through_glibc(), &mappings(true), row_at);
        assert_eq!(walked.frames, vec![0x5100, 0x1150, 0x5400, 0x5600]);
        assert!(!walked.unindexed);
    }

    #[test]
    fn a_pc_outside_the_index_is_stepped_by_frame_pointer_and_reported() {
        let rows = rows();
        let row_at = |i: u32| rows.get(i as usize).copied();
        let walked = replay(&managed_through_glibc(), &mappings(false), row_at);
        assert!(walked.unindexed, "{walked:?}");
        // By frame pointer, the library frame's caller is lost: the
        // frame record at SP+0x80 is read as the library's.
        assert_ne!(walked.frames, vec![0x5100, 0x1150, 0x5400, 0x5600]);
    }

    #[test]
    fn reads_outside_the_copy_end_the_walk() {
        let mut c = managed_through_glibc();
        c.stack.truncate(0x40);
        let rows = rows();
        let walked = replay(&c, &mappings(true), |i| rows.get(i as usize).copied());
        assert_eq!(walked.frames, vec![0x5100, 0x1150, 0x5400]);
        assert_eq!(walked.error, Some(UnwindError::BadRead));
        assert_eq!(c.read_u64(SP - 8), None);
        assert_eq!(c.read_code_u64(0x5101), None);
    }
}
