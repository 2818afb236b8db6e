//! `.eh_frame` / `.debug_frame` to sorted [`UnwindRow`]s: the first half of
//! native unwinding, done once per ELF file in userspace so the kernel side
//! only binary-searches and applies a row.
//!
//! Steps:
//! 1. Evaluate every FDE's CFI program with gimli's `UnwindTable`, from
//!    `.eh_frame` and then `.debug_frame` (only for address ranges
//!    `.eh_frame` does not cover: both usually describe the same functions).
//! 2. Translate each gimli row: CFA = rsp/rbp + offset, rbp's rule
//!    (`Undefined`/`SameValue` -> unchanged, `Offset(n)` -> at CFA + n), the
//!    return address rule (`Offset(n)`, or `Undefined` for the outermost
//!    frame). Two CFA expressions have dedicated rules: binutils' `.plt`
//!    expression (`rsp + 8 + ((rip & 15) >= K) << 3`, [`CfaRule::PltSp`]) and
//!    glibc's `__restore_rt` (FDE augmented with `S`, CFA `*(rsp + 160)`,
//!    [`CfaRule::SignalFrame`]: the step reloads registers from the
//!    `ucontext_t`). Anything else is kept as an `Unsupported` row so a walk
//!    reaching it stops with a precise error instead of a wrong frame.
//! 3. PLT sections without FDEs (lld, and `.plt.got`/`.plt.sec` everywhere)
//!    get synthesized rows read off their code: PLT0 pushes 16 then 24
//!    bytes, lazy entries switch to "+8" after their `push` (the same rule),
//!    and non-lazy entries are a bare `jmp` (CFA = rsp + 8).
//! 4. Sort, close each function with a [`CfaRule::NoInfo`] row unless the
//!    next one starts where it ends, and merge consecutive rows that unwind
//!    the same way.
//!
//! Hostile files: every parse error is counted and the rows built so far are
//! kept; an FDE whose program fails, or that overlaps one already kept, is
//! skipped; the table stops growing at [`MAX_TABLE_ROWS`]. Only x86_64 files
//! are translated for now.

use clrbpf_common::unwind::{CfaRule, FpRule, MAX_TABLE_ROWS, RaRule, UnwindRow, x86_64 as arch};
use gimli::{
    BaseAddresses, CieOrFde, DebugFrame, EhFrame, EndianSlice, LittleEndian, Register,
    RegisterRule, UnwindContext, UnwindSection, X86_64,
};
use object::{Object, ObjectSection};

use super::UnwindTableError;

/// What building one file's rows met, for reports and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnwindRowStats {
    /// FDEs whose rows are in the table (`.eh_frame` and `.debug_frame`).
    pub fdes: usize,
    /// FDEs taken from `.debug_frame`.
    pub debug_frame_fdes: usize,
    /// Rows in the table (after merging), including `NoInfo` rows.
    pub rows: usize,
    /// Rows with [`CfaRule::Unsupported`].
    pub unsupported_cfa_rows: usize,
    /// Rows whose rbp rule is [`FpRule::Unsupported`].
    pub unsupported_fp_rows: usize,
    /// Rows whose return-address rule is [`RaRule::Unsupported`].
    pub unsupported_ra_rows: usize,
    /// Rows with [`CfaRule::PltSp`].
    pub plt_rows: usize,
    /// Rows with [`CfaRule::SignalFrame`].
    pub signal_frame_rows: usize,
    /// PLT sections without FDEs that got synthesized rows.
    pub synthesized_plt_sections: usize,
    /// Entries or CFI programs gimli could not parse or evaluate.
    pub parse_errors: usize,
    /// FDEs dropped because they overlap one already kept.
    pub overlapping_fdes: usize,
    /// The table hit [`MAX_TABLE_ROWS`] and the rest was dropped.
    pub truncated: bool,
    /// ReadyToRun images: `RUNTIME_FUNCTION`s (method bodies, funclets)
    /// whose rows are in the table.
    pub runtime_functions: usize,
    /// ReadyToRun images: functions whose unwind info names no frame
    /// register, so their CFA is rsp-based throughout. Most of them still
    /// push rbp and point it at their frame (CoreCLR does not declare it
    /// unless the frame needs it, as for `localloc`); the others are the
    /// ones a frame-pointer walk loses the caller of.
    pub functions_without_frame_register: usize,
    /// ReadyToRun images: functions continuing another's unwind info.
    pub chained_functions: usize,
}

impl UnwindRowStats {
    /// Rows a walk cannot go through, as a fraction of the rows that
    /// describe code (not `NoInfo`).
    pub fn unsupported_fraction(&self, rows: &[UnwindRow]) -> f64 {
        let code_rows = rows
            .iter()
            .filter(|r| r.cfa_rule != CfaRule::NoInfo as u8)
            .count();
        if code_rows == 0 {
            return 0.0;
        }
        let unsupported = rows
            .iter()
            .filter(|r| {
                r.cfa_rule == CfaRule::Unsupported as u8
                    || r.fp_rule == FpRule::Unsupported as u8
                    || r.ra_rule == RaRule::Unsupported as u8
            })
            .count();
        unsupported as f64 / code_rows as f64
    }
}

/// One FDE's (or one synthesized PLT section's) rows: covers
/// `start..end`, rows sorted, the first at `start`.
struct FunctionRows {
    start: u64,
    end: u64,
    rows: Vec<UnwindRow>,
}

/// Builds the sorted, merged rows of an ELF file.
pub fn build_rows(
    elf: &object::File<'_>,
) -> Result<(Vec<UnwindRow>, UnwindRowStats), UnwindTableError> {
    if elf.architecture() != object::Architecture::X86_64 {
        return Err(UnwindTableError::UnsupportedArchitecture {
            architecture: format!("{:?}", elf.architecture()),
        });
    }
    let mut stats = UnwindRowStats::default();
    let mut functions = Vec::new();
    let mut ctx = UnwindContext::new();
    let mut row_budget = MAX_TABLE_ROWS;

    if let Some(section) = elf.section_by_name(".eh_frame")
        && let Ok(data) = section.data()
    {
        let mut eh_frame = EhFrame::new(data, LittleEndian);
        eh_frame.set_address_size(8);
        let mut bases = BaseAddresses::default().set_eh_frame(section.address());
        if let Some(text) = elf.section_by_name(".text") {
            bases = bases.set_text(text.address());
        }
        if let Some(got) = elf.section_by_name(".got") {
            bases = bases.set_got(got.address());
        }
        collect_fdes(
            &eh_frame,
            &bases,
            &mut ctx,
            &mut functions,
            &mut stats,
            &mut row_budget,
        );
    }
    functions.sort_by_key(|f| f.start);
    drop_overlaps(&mut functions, &mut stats);

    if let Some(section) = elf.section_by_name(".debug_frame") {
        // Compressed sections need the `compression` feature of `object`;
        // stripped distribution binaries have no `.debug_frame` anyway.
        if let Ok(data) = section.data() {
            let mut debug_frame = DebugFrame::new(data, LittleEndian);
            debug_frame.set_address_size(8);
            let bases = BaseAddresses::default();
            let mut extra = Vec::new();
            collect_fdes(
                &debug_frame,
                &bases,
                &mut ctx,
                &mut extra,
                &mut stats,
                &mut row_budget,
            );
            // Keep only what `.eh_frame` does not describe.
            extra.retain(|f| !overlaps_any(&functions, f.start, f.end));
            stats.debug_frame_fdes = extra.len();
            functions.extend(extra);
            functions.sort_by_key(|f| f.start);
            drop_overlaps(&mut functions, &mut stats);
        }
    }

    for name in [".plt", ".plt.sec", ".plt.got"] {
        let Some(section) = elf.section_by_name(name) else {
            continue;
        };
        let (start, size) = (section.address(), section.size());
        let Some(end) = start.checked_add(size) else {
            continue;
        };
        if size == 0 || overlaps_any(&functions, start, end) {
            continue;
        }
        let Ok(code) = section.data() else {
            continue;
        };
        let rows = if name == ".plt" {
            lazy_plt_rows(start, code)
        } else {
            vec![UnwindRow::new(start, CfaRule::SpOffset, 8)]
        };
        stats.synthesized_plt_sections += 1;
        let at = functions.partition_point(|f| f.start < start);
        functions.insert(at, FunctionRows { start, end, rows });
    }

    stats.fdes = functions.len() - stats.synthesized_plt_sections;
    let rows = merge(functions);
    for row in &rows {
        match CfaRule::from_u8(row.cfa_rule) {
            Some(CfaRule::Unsupported) => stats.unsupported_cfa_rows += 1,
            Some(CfaRule::PltSp) => stats.plt_rows += 1,
            Some(CfaRule::SignalFrame) => stats.signal_frame_rows += 1,
            _ => {}
        }
        if row.fp_rule == FpRule::Unsupported as u8 {
            stats.unsupported_fp_rows += 1;
        }
        if row.ra_rule == RaRule::Unsupported as u8 {
            stats.unsupported_ra_rows += 1;
        }
    }
    stats.rows = rows.len();
    stats.truncated = row_budget == 0;
    Ok((rows, stats))
}

type Slice<'a> = EndianSlice<'a, LittleEndian>;

fn collect_fdes<'a, S: UnwindSection<Slice<'a>>>(
    section: &S,
    bases: &BaseAddresses,
    ctx: &mut UnwindContext<usize>,
    functions: &mut Vec<FunctionRows>,
    stats: &mut UnwindRowStats,
    row_budget: &mut usize,
) {
    let mut entries = section.entries(bases);
    loop {
        let partial = match entries.next() {
            Ok(Some(CieOrFde::Fde(partial))) => partial,
            Ok(Some(CieOrFde::Cie(_))) => continue,
            Ok(None) => break,
            // The entry's length cannot be trusted: nothing after it can be
            // found again.
            Err(_) => {
                stats.parse_errors += 1;
                break;
            }
        };
        let fde = match partial.parse(|s, b, o| s.cie_from_offset(b, o)) {
            Ok(fde) => fde,
            Err(_) => {
                stats.parse_errors += 1;
                continue;
            }
        };
        let start = fde.initial_address();
        // FDEs of discarded sections (COMDAT folding) are left at 0 with
        // their length: no code of a loaded file lives at 0.
        if fde.len() == 0 || start == 0 {
            continue;
        }
        let Some(end) = start.checked_add(fde.len()) else {
            stats.parse_errors += 1;
            continue;
        };
        let signal_frame = fde.is_signal_trampoline();
        let ra_register = fde.cie().return_address_register();
        let mut rows = Vec::new();
        let evaluated = (|| -> gimli::Result<()> {
            let mut table = fde.rows(section, bases, ctx)?;
            while let Some(row) = table.next_row()? {
                if row.start_address() >= row.end_address() {
                    continue;
                }
                if *row_budget == 0 {
                    return Ok(());
                }
                *row_budget -= 1;
                rows.push(translate_row(section, row, ra_register, signal_frame));
            }
            Ok(())
        })();
        if evaluated.is_err() {
            stats.parse_errors += 1;
            continue;
        }
        if rows.is_empty() {
            continue;
        }
        functions.push(FunctionRows { start, end, rows });
        if *row_budget == 0 {
            break;
        }
    }
}

fn translate_row<'a, S: UnwindSection<Slice<'a>>>(
    section: &S,
    row: &gimli::UnwindTableRow<usize>,
    ra_register: Register,
    signal_frame: bool,
) -> UnwindRow {
    let pc = row.start_address();
    let cfa = match row.cfa() {
        gimli::CfaRule::RegisterAndOffset { register, offset } => {
            let rule = match *register {
                X86_64::RSP => CfaRule::SpOffset,
                X86_64::RBP => CfaRule::FpOffset,
                _ => CfaRule::Unsupported,
            };
            match i32::try_from(*offset) {
                Ok(offset) if !signal_frame => UnwindRow::new(pc, rule, offset),
                _ => UnwindRow::new(pc, CfaRule::Unsupported, 0),
            }
        }
        gimli::CfaRule::Expression(expression) => {
            let bytes = expression.get(section).map(|e| e.0.slice()).unwrap_or(&[]);
            translate_cfa_expression(pc, bytes, signal_frame)
        }
    };
    if cfa.cfa_rule == CfaRule::SignalFrame as u8 {
        // The ucontext holds every register: the other rules do not apply.
        return cfa;
    }
    let cfa = match row.register(X86_64::RBP) {
        None | Some(RegisterRule::Undefined | RegisterRule::SameValue) => cfa,
        Some(RegisterRule::Offset(n)) => match i16::try_from(n) {
            Ok(n) => cfa.with_fp_at(n),
            Err(_) => cfa.with_fp_rule(FpRule::Unsupported),
        },
        Some(_) => cfa.with_fp_rule(FpRule::Unsupported),
    };
    match row.register(ra_register) {
        // x86_64's `call` always leaves it at CFA - 8: the CIE just did not
        // say so.
        None => cfa,
        Some(RegisterRule::Undefined) => cfa.with_ra(RaRule::Undefined, 0),
        Some(RegisterRule::Offset(n)) => match i16::try_from(n) {
            Ok(n) => cfa.with_ra(RaRule::AtCfaOffset, n),
            Err(_) => cfa.with_ra(RaRule::Unsupported, 0),
        },
        Some(_) => cfa.with_ra(RaRule::Unsupported, 0),
    }
}

// DWARF expression opcodes of the two patterns we translate.
const DW_OP_DEREF: u8 = 0x06;
const DW_OP_AND: u8 = 0x1a;
const DW_OP_PLUS: u8 = 0x22;
const DW_OP_SHL: u8 = 0x24;
const DW_OP_GE: u8 = 0x2a;
const DW_OP_LIT0: u8 = 0x30;
const DW_OP_BREG7_RSP: u8 = 0x77;
const DW_OP_BREG16_RIP: u8 = 0x80;

/// The CFA expressions with a dedicated rule; everything else is
/// `Unsupported`.
fn translate_cfa_expression(pc: u64, bytes: &[u8], signal_frame: bool) -> UnwindRow {
    let unsupported = UnwindRow::new(pc, CfaRule::Unsupported, 0);
    let [DW_OP_BREG7_RSP, rest @ ..] = bytes else {
        return unsupported;
    };
    let Some((offset, rest)) = read_sleb128(rest) else {
        return unsupported;
    };
    // glibc's __restore_rt: DW_OP_breg7 (rsp): 160; DW_OP_deref.
    if signal_frame {
        return if offset == arch::UCONTEXT_RSP as i64 && rest == [DW_OP_DEREF] {
            UnwindRow::new(pc, CfaRule::SignalFrame, 0)
        } else {
            unsupported
        };
    }
    // binutils' .plt: DW_OP_breg7 (rsp): N; DW_OP_breg16 (rip): 0;
    // DW_OP_lit15; DW_OP_and; DW_OP_litK; DW_OP_ge; DW_OP_lit3; DW_OP_shl;
    // DW_OP_plus.
    if let [
        DW_OP_BREG16_RIP,
        0,
        lit15,
        DW_OP_AND,
        lit_k,
        DW_OP_GE,
        lit3,
        DW_OP_SHL,
        DW_OP_PLUS,
    ] = *rest
        && lit15 == DW_OP_LIT0 + 15
        && lit3 == DW_OP_LIT0 + 3
        && (DW_OP_LIT0..DW_OP_LIT0 + 16).contains(&lit_k)
        && let Ok(offset) = i32::try_from(offset)
    {
        return UnwindRow::new(pc, CfaRule::PltSp, offset).with_cfa_param(lit_k - DW_OP_LIT0);
    }
    unsupported
}

/// A signed LEB128 number of at most 9 bytes, and what follows it.
fn read_sleb128(bytes: &[u8]) -> Option<(i64, &[u8])> {
    let mut value: i64 = 0;
    for (i, &byte) in bytes.iter().enumerate().take(9) {
        value |= i64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            let shift = 7 * (i + 1);
            if shift < 64 && byte & 0x40 != 0 {
                value |= -1i64 << shift;
            }
            return Some((value, &bytes[i + 1..]));
        }
    }
    None
}

const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
const OP_PUSH_IMM32: u8 = 0x68;

/// Rows for a lazy-binding `.plt` without FDEs, read off its code. PLT0
/// (`[endbr64;] push GOT+8(%rip); jmp *GOT+16(%rip)`) has the return address
/// and one pushed word (the entry's `push`) on the stack, then the pushed
/// link map. Each entry (`[endbr64;] jmp *GOT(%rip); push $i; jmp PLT0`, or
/// the IBT variant) has CFA = rsp + 8 until its `push` ran.
fn lazy_plt_rows(start: u64, code: &[u8]) -> Vec<UnwindRow> {
    let entry = arch::PLT_ENTRY_SIZE as usize;
    let plt0_push_end: u64 = if code.starts_with(&ENDBR64) { 4 + 6 } else { 6 };
    let mut rows = vec![
        UnwindRow::new(start, CfaRule::SpOffset, 16),
        UnwindRow::new(start + plt0_push_end, CfaRule::SpOffset, 24),
    ];
    if code.len() >= 2 * entry {
        let first = &code[entry..2 * entry];
        // The `push $i` sits after `jmp *GOT(%rip)` (6 bytes) or after
        // `endbr64` (4 bytes) in IBT PLTs.
        let push_at = [6usize, 4]
            .into_iter()
            .find(|&at| first[at] == OP_PUSH_IMM32);
        let entries = start + arch::PLT_ENTRY_SIZE;
        rows.push(match push_at {
            Some(at) => UnwindRow::new(entries, CfaRule::PltSp, 8).with_cfa_param(at as u8 + 5),
            // Non-lazy entries only jump.
            None => UnwindRow::new(entries, CfaRule::SpOffset, 8),
        });
    }
    rows
}

fn overlaps_any(sorted: &[FunctionRows], start: u64, end: u64) -> bool {
    let at = sorted.partition_point(|f| f.end <= start);
    sorted.get(at).is_some_and(|f| f.start < end)
}

/// Drops functions that overlap an earlier one (sorted by start).
fn drop_overlaps(functions: &mut Vec<FunctionRows>, stats: &mut UnwindRowStats) {
    let mut last_end = 0u64;
    let before = functions.len();
    functions.retain(|f| {
        if f.start < last_end {
            return false;
        }
        last_end = f.end;
        true
    });
    stats.overlapping_fdes += before - functions.len();
}

/// Concatenates sorted, non-overlapping functions into one table: a `NoInfo`
/// row after each function the next does not directly follow, rows clipped
/// to their function, consecutive equal rules merged.
fn merge(functions: Vec<FunctionRows>) -> Vec<UnwindRow> {
    let mut rows: Vec<UnwindRow> = Vec::new();
    let mut iter = functions.into_iter().peekable();
    while let Some(function) = iter.next() {
        for row in function.rows {
            if row.pc < function.start || row.pc >= function.end {
                continue;
            }
            push_merged(&mut rows, row);
        }
        let next_start = iter.peek().map(|f| f.start);
        if next_start != Some(function.end) {
            push_merged(&mut rows, UnwindRow::no_info(function.end));
        }
    }
    rows
}

fn push_merged(rows: &mut Vec<UnwindRow>, row: UnwindRow) {
    match rows.last_mut() {
        Some(last) if last.same_rule(&row) => {}
        // Two rows at one pc: the later one wins.
        Some(last) if last.pc == row.pc => *last = row,
        _ => rows.push(row),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleb128() {
        assert_eq!(read_sleb128(&[0x08, 1]), Some((8, &[1u8][..])));
        assert_eq!(read_sleb128(&[0xa0, 0x01]), Some((160, &[][..])));
        assert_eq!(read_sleb128(&[0x7f]), Some((-1, &[][..])));
        assert_eq!(read_sleb128(&[0x80, 0x7f]), Some((-128, &[][..])));
        assert_eq!(read_sleb128(&[0x80; 12]), None);
        assert_eq!(read_sleb128(&[]), None);
    }

    #[test]
    fn plt_expression() {
        let bytes = [0x77, 8, 0x80, 0, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22];
        let row = translate_cfa_expression(0x3030, &bytes, false);
        assert_eq!(
            row,
            UnwindRow::new(0x3030, CfaRule::PltSp, 8).with_cfa_param(11)
        );
        // Any other byte: unsupported.
        // (Bytes 1 and 6 are the offset and K, free to change.)
        for i in (0..bytes.len()).filter(|&i| i != 1 && i != 6) {
            let mut changed = bytes;
            changed[i] ^= 0x01;
            let row = translate_cfa_expression(0x3030, &changed, false);
            assert_eq!(row.cfa_rule, CfaRule::Unsupported as u8, "byte {i}");
        }
        assert_eq!(
            translate_cfa_expression(0, &bytes[..5], false).cfa_rule,
            CfaRule::Unsupported as u8
        );
    }

    #[test]
    fn signal_expression() {
        let bytes = [0x77, 0xa0, 0x01, 0x06];
        assert_eq!(
            translate_cfa_expression(0x10, &bytes, true),
            UnwindRow::new(0x10, CfaRule::SignalFrame, 0)
        );
        // Only in an FDE augmented as a signal frame.
        assert_eq!(
            translate_cfa_expression(0x10, &bytes, false).cfa_rule,
            CfaRule::Unsupported as u8
        );
        assert_eq!(
            translate_cfa_expression(0x10, &[0x77, 0x98, 0x01, 0x06], true).cfa_rule,
            CfaRule::Unsupported as u8
        );
    }

    #[test]
    fn lazy_plt_from_code() {
        // lld / binutils non-IBT: jmp *GOT(%rip); push $i; jmp PLT0.
        let mut code = vec![
            0xff, 0x35, 0, 0, 0, 0, 0xff, 0x25, 0, 0, 0, 0, 0x0f, 0x1f, 0x40, 0,
        ];
        code.extend([0xff, 0x25, 0, 0, 0, 0, 0x68, 0, 0, 0, 0, 0xe9, 0, 0, 0, 0]);
        let rows = lazy_plt_rows(0x1000, &code);
        assert_eq!(
            rows,
            vec![
                UnwindRow::new(0x1000, CfaRule::SpOffset, 16),
                UnwindRow::new(0x1006, CfaRule::SpOffset, 24),
                UnwindRow::new(0x1010, CfaRule::PltSp, 8).with_cfa_param(11),
            ]
        );
        // Truncated section: only PLT0.
        assert_eq!(lazy_plt_rows(0x1000, &code[..20]).len(), 2);
        assert_eq!(lazy_plt_rows(0x1000, &[]).len(), 2);
    }

    #[test]
    fn merge_closes_gaps_and_merges_equal_rules() {
        let f = |start, end, rows: Vec<UnwindRow>| FunctionRows { start, end, rows };
        let sp = |pc, off| UnwindRow::new(pc, CfaRule::SpOffset, off);
        let rows = merge(vec![
            f(
                0x10,
                0x20,
                vec![sp(0x10, 8), sp(0x14, 8), sp(0x18, 16), sp(0x30, 99)],
            ),
            f(0x20, 0x28, vec![sp(0x20, 16)]),
            f(0x40, 0x50, vec![sp(0x40, 8)]),
        ]);
        assert_eq!(
            rows,
            vec![
                sp(0x10, 8),
                sp(0x18, 16),
                UnwindRow::no_info(0x28),
                sp(0x40, 8),
                UnwindRow::no_info(0x50),
            ]
        );
    }

    #[test]
    fn overlapping_functions_are_dropped() {
        let f = |start, end| FunctionRows {
            start,
            end,
            rows: vec![UnwindRow::new(start, CfaRule::SpOffset, 8)],
        };
        let mut functions = vec![f(0x10, 0x20), f(0x18, 0x30), f(0x20, 0x30)];
        let mut stats = UnwindRowStats::default();
        drop_overlaps(&mut functions, &mut stats);
        assert_eq!(
            functions.iter().map(|f| f.start).collect::<Vec<_>>(),
            [0x10, 0x20]
        );
        assert_eq!(stats.overlapping_fdes, 1);
        assert!(overlaps_any(&functions, 0x1f, 0x21));
        assert!(!overlaps_any(&functions, 0x30, 0x40));
        assert!(!overlaps_any(&functions, 0, 0x10));
    }
}
