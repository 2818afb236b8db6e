//! ReadyToRun images (the precompiled managed code of the framework's and
//! applications' `.dll`s) to sorted [`UnwindRow`]s: managed code's half of
//! the tables the kernel walker reads, next to [`super::eh_frame`]'s native
//! half. An R2R image is a PE file that CoreCLR maps section by section
//! (each section at its RVA from the image base, from its file offset), so
//! its executable mapping is looked up like an ELF segment: the table's
//! addresses are the image's virtual addresses (image base + RVA), and
//! [`super::LoadSegment`]s built from the section headers give the bias.
//!
//! Steps:
//! 1. PE -> CLI header (data directory 14) -> its `ManagedNativeHeader`,
//!    which in an R2R image points at the `READYTORUN_HEADER` ("RTR"): a
//!    list of sections by type. Section 102 (`RuntimeFunctions`) is the
//!    sorted `RUNTIME_FUNCTION` table: `[begin, end)` and an `UNWIND_INFO`
//!    RVA per method body and per funclet (catch/finally/filter bodies).
//! 2. Each `UNWIND_INFO` is the Windows x64 format CoreCLR uses for managed
//!    code on every OS: a prolog described by unwind codes sorted by
//!    decreasing offset. Replayed in increasing order they give the frame's
//!    state after each prolog instruction: bytes between sp and the CFA
//!    (pushes, allocations), whether rbp became the frame register
//!    (`UWOP_SET_FPREG`, then CFA = rbp + the size minus 16 x
//!    `FrameOffset`), and where rbp was saved (`push rbp` or
//!    `UWOP_SAVE_NONVOL`). One row per state change: CFA from sp or rbp,
//!    return address at CFA - 8, rbp at its save slot.
//! 3. A chained entry (`UNW_FLAG_CHAININFO`, cold code split from its
//!    method) starts from its parent's final state.
//! 4. Gaps between functions, and the image before the first one, get a
//!    [`CfaRule::FramePointer`] row: stubs and thunks without unwind info
//!    are walked by frame pointer, as before, instead of ending the walk.
//!
//! 5. Epilogs are not described by version 1 `UNWIND_INFO` (the Windows
//!    unwinder recognises them by their code): the rows carry
//!    [`CFA_PARAM_EPILOG_BY_CODE`], and the walk reads the code of an
//!    interrupted frame (the sampled leaf) for an epilog's `pop`s and `ret`
//!    (`clrbpf_common::unwind::step_interrupted_epilog`). Callers are never
//!    in an epilog.
//!
//! Known limits: a tail-call epilog (`pop`s then `jmp`) is stepped with
//! the body's rule. An image the runtime could not map section by section
//! (it then copies the code to anonymous memory) has no file mapping to
//! attach the table to and is walked by frame pointer. `UWOP_PUSH_MACHFRAME` (interrupt frames, never in managed
//! code) and a frame register other than rbp give an unsupported row.
//!
//! Hostile files: every RVA, count and size is checked against the file;
//! a bad entry is counted and skipped; at most [`MAX_RUNTIME_FUNCTIONS`]
//! entries are read.

use clrbpf_common::unwind::{
    CFA_PARAM_EPILOG_BY_CODE, CfaRule, FpRule, MAX_TABLE_ROWS, RaRule, UnwindRow,
};
use object::LittleEndian as LE;
use object::pe::{
    IMAGE_DIRECTORY_ENTRY_COM_DESCRIPTOR, IMAGE_FILE_MACHINE_AMD64, ImageCor20Header,
};
use object::read::pe::{ImageNtHeaders, PeFile64, SectionTable};

use super::UnwindTableError;
use super::eh_frame::UnwindRowStats;
use super::table::push_merged;

/// `READYTORUN_SIGNATURE`: "RTR" little-endian.
const READY_TO_RUN_SIGNATURE: u32 = 0x0052_5452;
/// Sections an R2R header lists: about 20 in .NET 8; more is corrupt.
const MAX_SECTIONS: u32 = 256;
/// Most `RUNTIME_FUNCTION`s read from one image (System.Private.CoreLib
/// has ~38k).
pub const MAX_RUNTIME_FUNCTIONS: usize = 4 << 20;
/// crossgen2 writes the machine XORed with a per-OS value so Windows never
/// loads a Linux image: `IMAGE_FILE_MACHINE_AMD64 ^ 0x7B79`.
const MACHINE_AMD64_LINUX: u16 = IMAGE_FILE_MACHINE_AMD64 ^ 0x7b79;
/// Chained `UNWIND_INFO`s followed at most this deep.
const MAX_CHAIN_DEPTH: u32 = 8;

/// `UNW_FLAG_CHAININFO`.
const UNW_FLAG_CHAININFO: u8 = 4;
/// rbp's register number in unwind codes.
const REG_RBP: u8 = 5;

/// Unwind operations (`UNWIND_OP_CODES`, with CoreCLR's Unix addition).
mod op {
    pub const PUSH_NONVOL: u8 = 0;
    pub const ALLOC_LARGE: u8 = 1;
    pub const ALLOC_SMALL: u8 = 2;
    pub const SET_FPREG: u8 = 3;
    pub const SAVE_NONVOL: u8 = 4;
    pub const SAVE_NONVOL_FAR: u8 = 5;
    pub const EPILOG: u8 = 6;
    pub const SPARE_CODE: u8 = 7;
    pub const SAVE_XMM128: u8 = 8;
    pub const SAVE_XMM128_FAR: u8 = 9;
    pub const PUSH_MACHFRAME: u8 = 10;
    /// CoreCLR on Unix: rbp = rsp + 16 x (a 32-bit offset in the next two
    /// slots), for frames larger than `FrameOffset`'s 240 bytes.
    pub const SET_FPREG_LARGE: u8 = 11;
}

/// One method body or funclet of the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeFunction {
    pub begin: u32,
    pub end: u32,
    pub unwind_info: u32,
}

/// The frame after some of a prolog ran: what a row says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FrameState {
    /// Bytes from sp to the CFA (8: only the return address).
    sp_to_cfa: i64,
    /// Set once rbp is the frame register: CFA = rbp + this.
    rbp_to_cfa: Option<i64>,
    /// rbp saved at CFA + this.
    rbp_saved_at: Option<i64>,
    /// Something the rows cannot express (`PUSH_MACHFRAME`, a frame
    /// register other than rbp).
    unsupported: bool,
}

impl FrameState {
    const ENTRY: Self = Self {
        sp_to_cfa: 8,
        rbp_to_cfa: None,
        rbp_saved_at: None,
        unsupported: false,
    };

    fn row(&self, pc: u64) -> UnwindRow {
        let (rule, offset) = match self.rbp_to_cfa {
            Some(offset) => (CfaRule::FpOffset, offset),
            None => (CfaRule::SpOffset, self.sp_to_cfa),
        };
        let (Ok(offset), false) = (i32::try_from(offset), self.unsupported) else {
            return UnwindRow::new(pc, CfaRule::Unsupported, 0);
        };
        let row = UnwindRow::new(pc, rule, offset).with_cfa_param(CFA_PARAM_EPILOG_BY_CODE);
        match self.rbp_saved_at.map(i16::try_from) {
            None => row,
            Some(Ok(at)) => row.with_fp_at(at),
            Some(Err(_)) => row.with_fp_rule(FpRule::Unsupported),
        }
    }
}

/// One decoded unwind code: its prolog offset and effect.
#[derive(Clone, Copy, Debug)]
struct UnwindCode {
    /// Offset from the function's start of the instruction after it.
    code_offset: u8,
    op: u8,
    info: u8,
    /// The operand in the following slots (size, offset), if any.
    operand: u32,
}

/// An `UNWIND_INFO`, its codes decoded.
struct UnwindInfo {
    frame_register: u8,
    /// `FrameOffset` x 16.
    frame_offset: i64,
    codes: Vec<UnwindCode>,
    /// The parent entry of a chained info.
    chained: Option<RuntimeFunction>,
}

/// Why one `UNWIND_INFO` was skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BadUnwindInfo {
    OutOfFile,
    Version,
    Code,
    ChainTooDeep,
}

fn u16_at(data: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(data.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(data.get(at..at + 4)?.try_into().ok()?))
}

/// Parses the `UNWIND_INFO` at `rva`.
fn parse_unwind_info(
    data: &[u8],
    sections: &SectionTable<'_>,
    rva: u32,
) -> Result<UnwindInfo, BadUnwindInfo> {
    let bytes = sections
        .pe_data_at(data, rva)
        .ok_or(BadUnwindInfo::OutOfFile)?;
    decode_unwind_info(bytes)
}

/// Decodes an `UNWIND_INFO` from the bytes that start with it (and run to
/// its section's end).
fn decode_unwind_info(bytes: &[u8]) -> Result<UnwindInfo, BadUnwindInfo> {
    let header = bytes.get(..4).ok_or(BadUnwindInfo::OutOfFile)?;
    let version = header[0] & 7;
    let flags = header[0] >> 3;
    if !(1..=2).contains(&version) {
        return Err(BadUnwindInfo::Version);
    }
    let count = usize::from(header[2]);
    let frame_register = header[3] & 0x0f;
    let frame_offset = i64::from(header[3] >> 4) * 16;
    let slot = |i: usize| u16_at(bytes, 4 + 2 * i).ok_or(BadUnwindInfo::OutOfFile);
    let mut codes = Vec::with_capacity(count);
    let mut i = 0;
    while i < count {
        let s = slot(i)?;
        let (code_offset, op, info) = (s as u8, ((s >> 8) & 0x0f) as u8, (s >> 12) as u8);
        let (slots, operand) = match op {
            op::PUSH_NONVOL | op::ALLOC_SMALL | op::SET_FPREG | op::PUSH_MACHFRAME => (1, 0),
            op::ALLOC_LARGE if info == 0 => (2, u32::from(slot(i + 1)?) * 8),
            op::ALLOC_LARGE if info == 1 => {
                (3, u32::from(slot(i + 1)?) | (u32::from(slot(i + 2)?) << 16))
            }
            op::SAVE_NONVOL => (2, u32::from(slot(i + 1)?) * 8),
            op::SAVE_NONVOL_FAR => (3, u32::from(slot(i + 1)?) | (u32::from(slot(i + 2)?) << 16)),
            op::EPILOG | op::SAVE_XMM128 => (2, 0),
            op::SPARE_CODE | op::SAVE_XMM128_FAR => (3, 0),
            op::SET_FPREG_LARGE => (3, u32::from(slot(i + 1)?) | (u32::from(slot(i + 2)?) << 16)),
            _ => return Err(BadUnwindInfo::Code),
        };
        if i + slots > count {
            return Err(BadUnwindInfo::Code);
        }
        codes.push(UnwindCode {
            code_offset,
            op,
            info,
            operand,
        });
        i += slots;
    }
    let chained = if flags & UNW_FLAG_CHAININFO != 0 {
        let at = 4 + 2 * (count + (count & 1));
        Some(RuntimeFunction {
            begin: u32_at(bytes, at).ok_or(BadUnwindInfo::OutOfFile)?,
            end: u32_at(bytes, at + 4).ok_or(BadUnwindInfo::OutOfFile)?,
            unwind_info: u32_at(bytes, at + 8).ok_or(BadUnwindInfo::OutOfFile)?,
        })
    } else {
        None
    };
    Ok(UnwindInfo {
        frame_register,
        frame_offset,
        codes,
        chained,
    })
}

impl UnwindInfo {
    /// `sp_to_cfa` once the whole prolog ran from `entry`, and the same at
    /// the moment rbp became the frame register: the base of
    /// `SAVE_NONVOL` offsets ("from the fixed allocation's low end, or from
    /// where the frame register points minus its offset").
    fn frame_base(&self, entry: &FrameState) -> i64 {
        let mut size = entry.sp_to_cfa;
        for code in self.codes.iter().rev() {
            match code.op {
                op::PUSH_NONVOL => size += 8,
                op::ALLOC_SMALL => size += i64::from(code.info) * 8 + 8,
                op::ALLOC_LARGE => size += i64::from(code.operand),
                op::SET_FPREG | op::SET_FPREG_LARGE => return size,
                _ => {}
            }
        }
        size
    }

    /// Applies one code to `state`.
    fn apply(&self, code: &UnwindCode, base: i64, state: &mut FrameState) {
        match code.op {
            op::PUSH_NONVOL => {
                state.sp_to_cfa += 8;
                if code.info == REG_RBP {
                    state.rbp_saved_at = Some(-state.sp_to_cfa);
                }
            }
            op::ALLOC_SMALL => state.sp_to_cfa += i64::from(code.info) * 8 + 8,
            op::ALLOC_LARGE => state.sp_to_cfa += i64::from(code.operand),
            op::SET_FPREG | op::SET_FPREG_LARGE => {
                let offset = if code.op == op::SET_FPREG {
                    self.frame_offset
                } else {
                    i64::from(code.operand) * 16
                };
                if self.frame_register == REG_RBP {
                    state.rbp_to_cfa = Some(state.sp_to_cfa - offset);
                } else {
                    state.unsupported = true;
                }
            }
            op::SAVE_NONVOL | op::SAVE_NONVOL_FAR if code.info == REG_RBP => {
                state.rbp_saved_at = Some(i64::from(code.operand) - base);
            }
            op::PUSH_MACHFRAME => state.unsupported = true,
            _ => {}
        }
    }

    /// The state after the whole prolog, from `entry`.
    fn final_state(&self, entry: FrameState) -> FrameState {
        let base = self.frame_base(&entry);
        let mut state = entry;
        for code in self.codes.iter().rev() {
            self.apply(code, base, &mut state);
        }
        state
    }
}

/// The state a function starts in: the entry state, or for a chained
/// entry its parent's (recursively) final state.
fn entry_state(
    data: &[u8],
    sections: &SectionTable<'_>,
    info: &UnwindInfo,
    depth: u32,
) -> Result<FrameState, BadUnwindInfo> {
    let Some(parent) = info.chained else {
        return Ok(FrameState::ENTRY);
    };
    if depth >= MAX_CHAIN_DEPTH {
        return Err(BadUnwindInfo::ChainTooDeep);
    }
    let parent = parse_unwind_info(data, sections, parent.unwind_info)?;
    let entry = entry_state(data, sections, &parent, depth + 1)?;
    Ok(parent.final_state(entry))
}

/// The rows of one function at image virtual address `begin`, `len` bytes
/// long: one per prolog state, the first at `begin`.
fn function_rows(
    data: &[u8],
    sections: &SectionTable<'_>,
    begin: u64,
    len: u64,
    info: &UnwindInfo,
) -> Result<Vec<UnwindRow>, BadUnwindInfo> {
    let entry = entry_state(data, sections, info, 0)?;
    let base = info.frame_base(&entry);
    let mut state = entry;
    let mut rows = vec![state.row(begin)];
    for code in info.codes.iter().rev() {
        info.apply(code, base, &mut state);
        let offset = u64::from(code.code_offset);
        if offset >= len {
            continue;
        }
        let row = state.row(begin + offset);
        match rows.last_mut() {
            Some(last) if last.pc == row.pc => *last = row,
            // Codes come by decreasing offset; anything else is corrupt.
            Some(last) if last.pc > row.pc => return Err(BadUnwindInfo::Code),
            _ => rows.push(row),
        }
    }
    Ok(rows)
}

/// The rows of one function of `len` bytes at `begin` from its
/// `UNWIND_INFO` bytes (without following a chain: a chained entry starts
/// from the entry state), `None` for an info that does not decode. For the
/// fuzz target: every pc in `begin..begin + len`, sorted, never a panic.
pub fn rows_of_unwind_info(bytes: &[u8], begin: u64, len: u64) -> Option<Vec<UnwindRow>> {
    let mut info = decode_unwind_info(bytes).ok()?;
    info.chained = None;
    function_rows(&[], &SectionTable::default(), begin, len, &info).ok()
}

/// Where the sections of a PE image land, for [`super::LoadSegment`]s:
/// (file offset, size in the file, image virtual address).
pub fn section_segments(pe: &PeFile64<'_>) -> Vec<(u64, u64, u64)> {
    let image_base = pe.nt_headers().optional_header().image_base.get(LE);
    pe.section_table()
        .iter()
        .map(|s| {
            (
                u64::from(s.pointer_to_raw_data.get(LE)),
                u64::from(s.size_of_raw_data.get(LE)),
                image_base.wrapping_add(u64::from(s.virtual_address.get(LE))),
            )
        })
        .collect()
}

/// `ReadyToRunSectionType`s read here and by
/// [`crate::symbolize::ready_to_run`].
pub mod section_type {
    pub const RUNTIME_FUNCTIONS: u32 = 102;
    pub const METHOD_DEF_ENTRY_POINTS: u32 = 103;
    pub const INSTANCE_METHOD_ENTRY_POINTS: u32 = 109;
    pub const HOT_COLD_MAP: u32 = 120;
    /// Listed by a composite image (the code of several assemblies in one
    /// file, each with its own component header).
    pub const COMPONENT_ASSEMBLIES: u32 = 116;
}

/// `READYTORUN_FLAG_COMPONENT`: an assembly whose code is in a composite
/// image.
pub const READY_TO_RUN_FLAG_COMPONENT: u32 = 0x20;

/// An R2R image's `READYTORUN_HEADER`: its flags and its sections.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadyToRunHeader {
    pub major_version: u16,
    pub flags: u32,
    /// (type, RVA, size) of each section.
    pub sections: Vec<(u32, u32, u32)>,
}

impl ReadyToRunHeader {
    /// The (RVA, size) of the section of type `kind`, if listed.
    pub fn section(&self, kind: u32) -> Option<(u32, u32)> {
        self.sections
            .iter()
            .find(|s| s.0 == kind)
            .map(|&(_, rva, size)| (rva, size))
    }
}

/// The `READYTORUN_HEADER` of an image (through its CLI header's
/// `ManagedNativeHeader`).
pub fn ready_to_run_header(
    pe: &PeFile64<'_>,
    data: &[u8],
) -> Result<ReadyToRunHeader, UnwindTableError> {
    let sections = pe.section_table();
    let not_r2r = |reason: &'static str| UnwindTableError::NotReadyToRun { reason };
    let cli = pe
        .data_directory(IMAGE_DIRECTORY_ENTRY_COM_DESCRIPTOR)
        .ok_or(not_r2r("no CLI header: not a .NET assembly"))?
        .data(data, &sections)
        .map_err(|_| not_r2r("CLI header outside the file"))?;
    let cli: &ImageCor20Header = object::pod::from_bytes(cli)
        .map_err(|()| not_r2r("CLI header truncated"))?
        .0;
    let native = cli.managed_native_header;
    let native_rva = native.virtual_address.get(LE);
    if native_rva == 0 {
        return Err(not_r2r("no ReadyToRun header: an IL-only assembly"));
    }
    let header = sections
        .pe_data_at(data, native_rva)
        .ok_or(not_r2r("ReadyToRun header outside the file"))?;
    if u32_at(header, 0) != Some(READY_TO_RUN_SIGNATURE) {
        return Err(not_r2r("no ReadyToRun signature"));
    }
    // Signature, major and minor version, flags, then the section count and
    // the sections: (type, rva, size).
    let truncated = || not_r2r("ReadyToRun header truncated");
    let major_version = u16_at(header, 4).ok_or_else(truncated)?;
    let flags = u32_at(header, 8).ok_or_else(truncated)?;
    let count = u32_at(header, 12).ok_or_else(truncated)?;
    if count > MAX_SECTIONS {
        return Err(not_r2r("ReadyToRun header lists too many sections"));
    }
    let sections = (0..count as usize)
        .map(|i| {
            let at = 16 + 12 * i;
            Some((
                u32_at(header, at)?,
                u32_at(header, at + 4)?,
                u32_at(header, at + 8)?,
            ))
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(truncated)?;
    Ok(ReadyToRunHeader {
        major_version,
        flags,
        sections,
    })
}

/// The bytes of an image's R2R section at `rva`, `size` long; `None` when
/// the file does not hold them all.
pub fn section_bytes<'data>(
    pe: &PeFile64<'data>,
    data: &'data [u8],
    (rva, size): (u32, u32),
) -> Option<&'data [u8]> {
    pe.section_table()
        .pe_data_at(data, rva)
        .and_then(|b| b.get(..size as usize))
}

/// The `RUNTIME_FUNCTION` table of an R2R image (the bytes of its
/// `RuntimeFunctions` section), entries in the file's order (the order
/// method entry points index).
pub fn runtime_functions<'data>(
    pe: &PeFile64<'data>,
    data: &'data [u8],
) -> Result<&'data [u8], UnwindTableError> {
    let not_r2r = |reason: &'static str| UnwindTableError::NotReadyToRun { reason };
    let header = ready_to_run_header(pe, data)?;
    let section = header
        .section(section_type::RUNTIME_FUNCTIONS)
        .ok_or(not_r2r("no RuntimeFunctions section"))?;
    section_bytes(pe, data, section).ok_or(not_r2r("RuntimeFunctions section outside the file"))
}

/// The image's `RUNTIME_FUNCTION`s with `begin < end`, sorted by `begin`
/// (RVAs), at most [`MAX_RUNTIME_FUNCTIONS`]; true when more were left out.
pub fn runtime_function_list(
    pe: &PeFile64<'_>,
    data: &[u8],
) -> Result<(Vec<RuntimeFunction>, bool), UnwindTableError> {
    let table = runtime_functions(pe, data)?;
    let mut functions: Vec<RuntimeFunction> = table
        .chunks_exact(12)
        .take(MAX_RUNTIME_FUNCTIONS)
        .filter_map(|e| {
            Some(RuntimeFunction {
                begin: u32_at(e, 0)?,
                end: u32_at(e, 4)?,
                unwind_info: u32_at(e, 8)?,
            })
        })
        .filter(|f| f.begin < f.end)
        .collect();
    functions.sort_by_key(|f| f.begin);
    Ok((functions, table.len() / 12 > MAX_RUNTIME_FUNCTIONS))
}

/// Whether a PE file is for x86_64 (plain, or crossgen2's Linux value).
pub fn is_x86_64(pe: &PeFile64<'_>) -> bool {
    let machine = pe.nt_headers().file_header().machine.get(LE);
    machine == IMAGE_FILE_MACHINE_AMD64 || machine == MACHINE_AMD64_LINUX
}

/// Builds the sorted, merged rows of an R2R image (addresses are image
/// virtual addresses: image base + RVA).
pub fn build_rows(
    pe: &PeFile64<'_>,
    data: &[u8],
) -> Result<(Vec<UnwindRow>, UnwindRowStats), UnwindTableError> {
    if !is_x86_64(pe) {
        return Err(UnwindTableError::UnsupportedArchitecture {
            architecture: format!(
                "PE machine {:#x}",
                pe.nt_headers().file_header().machine.get(LE)
            ),
        });
    }
    let image_base = pe.nt_headers().optional_header().image_base.get(LE);
    let sections = pe.section_table();
    let mut stats = UnwindRowStats::default();
    let (functions, truncated) = runtime_function_list(pe, data)?;
    stats.truncated = truncated;

    let mut rows: Vec<UnwindRow> = vec![UnwindRow::new(image_base, CfaRule::FramePointer, 0)];
    let mut last_end = 0u32;
    for f in functions {
        if f.begin < last_end {
            stats.overlapping_fdes += 1;
            continue;
        }
        if rows.len() >= MAX_TABLE_ROWS - 16 {
            stats.truncated = true;
            break;
        }
        let begin = image_base.wrapping_add(u64::from(f.begin));
        let len = u64::from(f.end - f.begin);
        let built = parse_unwind_info(data, &sections, f.unwind_info).and_then(|info| {
            if info.chained.is_some() {
                stats.chained_functions += 1;
            }
            if info.frame_register == 0 {
                stats.functions_without_frame_register += 1;
            }
            function_rows(data, &sections, begin, len, &info)
        });
        let Ok(function) = built else {
            stats.parse_errors += 1;
            continue;
        };
        if last_end != f.begin {
            push_merged(
                &mut rows,
                UnwindRow::new(
                    image_base.wrapping_add(u64::from(last_end)),
                    CfaRule::FramePointer,
                    0,
                ),
            );
        }
        for row in function {
            push_merged(&mut rows, row);
        }
        stats.runtime_functions += 1;
        last_end = f.end;
    }
    push_merged(
        &mut rows,
        UnwindRow::new(
            image_base.wrapping_add(u64::from(last_end)),
            CfaRule::FramePointer,
            0,
        ),
    );
    stats.rows = rows.len();
    stats.unsupported_cfa_rows = rows
        .iter()
        .filter(|r| r.cfa_rule == CfaRule::Unsupported as u8)
        .count();
    stats.unsupported_fp_rows = rows
        .iter()
        .filter(|r| r.fp_rule == FpRule::Unsupported as u8)
        .count();
    debug_assert!(rows.iter().all(|r| r.ra_rule == RaRule::AtCfaOffset as u8));
    Ok((rows, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row as the builder makes it: epilogs are read from the code.
    fn r(pc: u64, rule: CfaRule, offset: i32) -> UnwindRow {
        UnwindRow::new(pc, rule, offset).with_cfa_param(CFA_PARAM_EPILOG_BY_CODE)
    }

    fn info(frame_register: u8, frame_offset: i64, codes: &[(u8, u8, u8, u32)]) -> UnwindInfo {
        UnwindInfo {
            frame_register,
            frame_offset,
            codes: codes
                .iter()
                .map(|&(code_offset, op, info, operand)| UnwindCode {
                    code_offset,
                    op,
                    info,
                    operand,
                })
                .collect(),
            chained: None,
        }
    }

    fn rows_of(info: &UnwindInfo, len: u64) -> Vec<UnwindRow> {
        let sections = SectionTable::default();
        function_rows(&[], &sections, 0x1000, len, info).expect("no chain")
    }

    /// `ManualResetEventSlim.Wait(int)` in .NET 8's CoreLib: `push rax;
    /// xor edx, edx; call; nop; add rsp, 8; ret`, one code (`ALLOC_SMALL` 8
    /// at offset 1).
    #[test]
    fn frameless_wrapper() {
        let rows = rows_of(&info(0, 0, &[(1, op::ALLOC_SMALL, 0, 0)]), 14);
        assert_eq!(
            rows,
            vec![
                r(0x1000, CfaRule::SpOffset, 8),
                r(0x1001, CfaRule::SpOffset, 16),
            ]
        );
    }

    /// The JIT's frame: `push rbp; push r15; push rbx; sub rsp, 0x28; lea
    /// rbp, [rsp+0x30]`.
    #[test]
    fn rbp_frame_with_saved_registers() {
        let codes = [
            (13, op::SET_FPREG, 0, 0),
            (8, op::ALLOC_SMALL, 4, 0),
            (4, op::PUSH_NONVOL, 3, 0),
            (3, op::PUSH_NONVOL, 15, 0),
            (1, op::PUSH_NONVOL, REG_RBP, 0),
        ];
        let rows = rows_of(&info(REG_RBP, 0x30, &codes), 100);
        assert_eq!(
            rows,
            vec![
                r(0x1000, CfaRule::SpOffset, 8),
                r(0x1001, CfaRule::SpOffset, 16).with_fp_at(-16),
                r(0x1003, CfaRule::SpOffset, 24).with_fp_at(-16),
                r(0x1004, CfaRule::SpOffset, 32).with_fp_at(-16),
                r(0x1008, CfaRule::SpOffset, 72).with_fp_at(-16),
                // rbp = rsp + 0x30 = CFA - 72 + 48.
                r(0x100d, CfaRule::FpOffset, 24).with_fp_at(-16),
            ]
        );
    }

    #[test]
    fn save_nonvol_and_large_alloc() {
        // sub rsp, 0x1000 (ALLOC_LARGE, 16-bit); mov [rsp+0x20], rbp.
        let codes = [
            (12, op::SAVE_NONVOL, REG_RBP, 0x20),
            (7, op::ALLOC_LARGE, 0, 0x1000),
        ];
        let rows = rows_of(&info(0, 0, &codes), 50);
        assert_eq!(
            rows,
            vec![
                r(0x1000, CfaRule::SpOffset, 8),
                r(0x1007, CfaRule::SpOffset, 0x1008),
                r(0x100c, CfaRule::SpOffset, 0x1008).with_fp_at(0x20 - 0x1008),
            ]
        );
    }

    #[test]
    fn odd_frames_are_unsupported_rows() {
        let rows = rows_of(&info(0, 0, &[(1, op::PUSH_MACHFRAME, 0, 0)]), 10);
        assert_eq!(rows[1].cfa_rule, CfaRule::Unsupported as u8);
        // A frame register other than rbp.
        let rows = rows_of(&info(3, 0, &[(3, op::SET_FPREG, 0, 0)]), 10);
        assert_eq!(rows[1].cfa_rule, CfaRule::Unsupported as u8);
        // Codes past the function's end add no row.
        let rows = rows_of(&info(0, 0, &[(20, op::ALLOC_SMALL, 0, 0)]), 10);
        assert_eq!(rows.len(), 1);
    }

    /// What the fuzz target checks, over random bytes: rows inside the
    /// function, sorted, never a panic.
    #[test]
    fn random_unwind_infos_give_sorted_rows_inside_the_function() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut decoded = 0;
        for _ in 0..20_000 {
            let mut bytes = [0u8; 24];
            for b in &mut bytes {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *b = seed as u8;
            }
            // Mostly valid versions and short code lists.
            bytes[0] = (bytes[0] & 0xf8) | 1;
            bytes[2] %= 10;
            let len = u64::from(bytes[23]) + 1;
            if let Some(rows) = rows_of_unwind_info(&bytes, 0x1000, len) {
                decoded += 1;
                assert_eq!(rows[0].pc, 0x1000);
                assert!(rows.windows(2).all(|p| p[0].pc < p[1].pc), "{bytes:?}");
                assert!(rows.iter().all(|r| r.pc < 0x1000 + len), "{bytes:?}");
            }
        }
        assert!(decoded > 1000, "{decoded}");
    }

    #[test]
    fn unwind_info_bytes() {
        // Version 1, no flags, prolog 13 bytes, 5 slots, rbp + 3 x 16.
        let bytes = [
            0x01, 13, 5, 0x35, // header
            13, 0x03, // SET_FPREG
            8, 0x01, 0x00, 0x02, // ALLOC_LARGE 0x200 x 8
            3, 0xf0, // PUSH_NONVOL r15
            1, 0x50, // PUSH_NONVOL rbp
            0xaa, 0xbb, // the odd slot's padding is not read as a code
        ];
        let info = decode_unwind_info(&bytes).expect("valid");
        assert_eq!((info.frame_register, info.frame_offset), (REG_RBP, 48));
        assert_eq!(info.codes.len(), 4);
        assert_eq!(info.codes[1].operand, 0x1000);
        assert!(info.chained.is_none());
        let rows = rows_of(&info, 64);
        assert_eq!(
            rows.last(),
            Some(&r(0x100d, CfaRule::FpOffset, 8 + 16 + 0x1000 - 48).with_fp_at(-16))
        );

        // Chained: the parent entry follows the (even) codes.
        let mut chained = vec![0x21, 0, 1, 0, 4, 0x02, 0, 0];
        chained.extend_from_slice(&[0x10, 0, 0, 0, 0x20, 0, 0, 0, 0x30, 0, 0, 0]);
        let info = decode_unwind_info(&chained).expect("valid");
        assert_eq!(
            info.chained,
            Some(RuntimeFunction {
                begin: 0x10,
                end: 0x20,
                unwind_info: 0x30
            })
        );

        // Truncations and bad values are errors, never panics.
        for cut in 0..14 {
            assert!(decode_unwind_info(&bytes[..cut]).is_err(), "cut {cut}");
        }
        assert_eq!(
            decode_unwind_info(&[0x03, 0, 0, 0]).err(),
            Some(BadUnwindInfo::Version)
        );
        assert_eq!(
            decode_unwind_info(&[0x01, 0, 1, 0, 0, 0x0c]).err(),
            Some(BadUnwindInfo::Code)
        );
        // A two-slot code in the last slot.
        assert_eq!(
            decode_unwind_info(&[0x01, 0, 1, 0, 0, 0x04, 0, 0]).err(),
            Some(BadUnwindInfo::Code)
        );
    }
}
