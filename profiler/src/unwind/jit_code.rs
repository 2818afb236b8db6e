//! Unwind rows for JIT-compiled methods, from their prologues: the third
//! source of rows next to [`super::eh_frame`] (native code) and
//! [`super::ready_to_run`] (precompiled managed code).
//!
//! Most JIT-compiled methods keep an rbp frame, which the kernel walker
//! steps by frame pointer. Optimized code may omit it: a thin wrapper such
//! as `ManualResetEventSlim.Wait()` at tier 1 is `push rax; xor edx, edx;
//! mov esi, -1; call [..]; nop; add rsp, 8; ret`, and a frame-pointer walk
//! through it skips its caller (rbp still holds the caller's caller's
//! frame). Such a method needs a row saying where its return address is.
//! So does an rbp frame while its prologue runs: tier-1
//! `Dictionary<int,long>.FindValue` is `push rbp; push r15; push r14;
//! push r13; push r12; push rbx; sub rsp, 0x18; lea rbp, [rsp+0x40]`, and
//! until the `lea` rbp still holds the caller's frame. A leaf sampled
//! there (a tenth of a dictionary-bound method's samples, most of them
//! right after the `push rbp`) lost its caller.
//!
//! Place in the data flow: the pipeline learns each method's code range
//! from the perf map, the jitdump or MethodLoad events
//! (`crate::symbolize::managed`), and hands the new ranges to the unwind
//! worker (`crate::bpf::unwind_maps`), which reads each method's first
//! [`PROLOGUE_BYTES`] through `/proc/PID/mem`, decodes them here
//! ([`method_frame`]), keeps the rows of the process's methods in a
//! [`JitCodeRows`] and loads its [`JitCodeRows::rows`] as one table for the
//! process's anonymous (and memfd) executable mappings.
//!
//! The decoder runs the method's straight-line start (until the first
//! branch, call, return or stack release) and follows the stack pointer
//! and rbp through the forms the JIT emits: `push r64`, `sub rsp, imm`,
//! `lea rbp, [rsp+imm]`, `mov rbp, rsp`, with any other instruction that
//! leaves rsp and rbp alone in between (`vzeroupper`, zeroing of locals).
//! A method whose rbp ends up at its saved-rbp slot gets rows for its
//! prologue only, then the frame-pointer rule from the instruction after
//! the one that set rbp ([`MethodFrame::Prologue`]); any other frame gets
//! one row per stack change, CFA from rsp (or from rbp when it was set
//! elsewhere), the return address at CFA - 8, rbp at its save slot. Epilogs are left to the
//! kernel's code check ([`CFA_PARAM_EPILOG_BY_CODE`]), as for ReadyToRun
//! code. A stack change the decoder does not model (`mov rsp, rax` after a
//! stack probe, `and rsp`) gives [`MethodFrame::Unrecognised`]: the method
//! is walked by frame pointer, and counted.
//!
//! An OSR method ([`osr_method_frame`]) runs on the frame of the tier-0
//! code it was entered from: its decode starts from the end of that code's
//! prologue (the symbol index names the tier-0 code, [`JitMethod`]).
//!
//! A call the JIT turned into a tail call (`jmp`) leaves no frame, and no
//! row invents one: the row describes the stack as it is.

use std::collections::BTreeMap;

use clrbpf_common::unwind::{CFA_PARAM_EPILOG_BY_CODE, CfaRule, UnwindRow};

use super::table::push_merged;
use iced_x86::{
    Code, Decoder, DecoderError, DecoderOptions, FlowControl, InstructionInfoFactory, OpAccess,
    OpKind, Register,
};

/// Code bytes read at a method's start: the JIT's longest prologue (six
/// callee-saved pushes, an allocation, `lea rbp` and a `vzeroupper`) fits
/// in about 30.
pub const PROLOGUE_BYTES: usize = 64;

/// Largest frame a row is made for; beyond it the decoder gives up (the
/// JIT probes such frames with a loop it does not model).
const MAX_FRAME_BYTES: i64 = 1 << 20;

/// How a JIT-compiled method's frame is unwound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MethodFrame {
    /// The frame-pointer rule throughout: the code could not be read, or
    /// its prologue sets rbp past the bytes read.
    FramePointer,
    /// `push rbp` and rbp set to its save slot: rows from the method's
    /// start, one per stack change of the prologue, and a
    /// [`CfaRule::FramePointer`] row from the end of it (the walker's own
    /// code check knows only a `push rbp` that `mov rbp, rsp` follows, and
    /// the JIT pushes the callee-saved registers in between).
    Prologue(Vec<UnwindRow>),
    /// No rbp frame (or an unusual one): rows from the method's start, one
    /// per stack change, the last one for the body.
    Rows(Vec<UnwindRow>),
    /// A stack change the decoder does not model: frame pointers, counted.
    Unrecognised,
}

/// The frame state after some instructions of a prologue ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Frame {
    /// Bytes from rsp to the CFA (8: only the return address).
    sp_to_cfa: i64,
    /// Once rbp is set from rsp: CFA = rbp + this.
    rbp_to_cfa: Option<i64>,
    /// rbp saved at CFA + this.
    rbp_saved_at: Option<i64>,
}

impl Frame {
    const ENTRY: Self = Self {
        sp_to_cfa: 8,
        rbp_to_cfa: None,
        rbp_saved_at: None,
    };

    /// Whether the frame-pointer rule unwinds this frame: rbp points at
    /// the saved rbp, with the return address above it.
    fn is_frame_pointer(&self) -> bool {
        self.rbp_to_cfa == Some(16) && self.rbp_saved_at == Some(-16)
    }

    fn row(&self, pc: u64) -> Option<UnwindRow> {
        let (rule, offset) = match self.rbp_to_cfa {
            Some(offset) => (CfaRule::FpOffset, offset),
            None => (CfaRule::SpOffset, self.sp_to_cfa),
        };
        let row = UnwindRow::new(pc, rule, i32::try_from(offset).ok()?)
            .with_cfa_param(CFA_PARAM_EPILOG_BY_CODE);
        Some(match self.rbp_saved_at {
            Some(at) => row.with_fp_at(i16::try_from(at).ok()?),
            None => row,
        })
    }
}

/// A JIT-compiled method whose rows are to be made: its code and, for an
/// OSR method, where the code whose frame it runs on starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JitMethod {
    pub start: u64,
    pub end: u64,
    /// An OSR method (tier `OptimizedTier1OSR`) is entered by a jump from
    /// a patchpoint of the method's tier-0 code, on that code's frame:
    /// the start of that tier-0 code.
    pub osr_base: Option<u64>,
}

/// Decodes the prologue of the method whose first bytes are `code` (at
/// most [`PROLOGUE_BYTES`] matter), loaded at `start`.
pub fn method_frame(code: &[u8], start: u64) -> MethodFrame {
    let Some((rows, frame)) = decode(code, start, Frame::ENTRY) else {
        return MethodFrame::Unrecognised;
    };
    if frame.is_frame_pointer() {
        return prologue_rows(&rows);
    }
    to_rows(&rows)
}

impl MethodFrame {
    /// The method's rows, if it has any.
    pub fn rows(&self) -> Option<&[UnwindRow]> {
        match self {
            Self::Prologue(rows) | Self::Rows(rows) => Some(rows),
            Self::FramePointer | Self::Unrecognised => None,
        }
    }
}

/// The rows of an rbp frame's prologue (`rows` as [`decode`] gives them):
/// up to the pc from which rbp is at its save slot, where the
/// frame-pointer rule takes over for the body.
fn prologue_rows(rows: &[(u64, Frame)]) -> MethodFrame {
    let Some(set) = rows.iter().position(|(_, f)| f.is_frame_pointer()) else {
        // rbp is set by the window's last instruction: no row for the
        // body's pc, and the frame-pointer rule as before.
        return MethodFrame::FramePointer;
    };
    let prologue: Option<Vec<UnwindRow>> = rows[..set].iter().map(|(pc, f)| f.row(*pc)).collect();
    match prologue {
        Some(mut prologue) => {
            prologue.push(UnwindRow::new(rows[set].0, CfaRule::FramePointer, 0));
            MethodFrame::Prologue(prologue)
        }
        None => MethodFrame::FramePointer,
    }
}

/// Decodes the prologue of an OSR method (`code` at `start`) entered on the
/// frame of the tier-0 code whose prologue is `base_code` at `base_start`.
///
/// On x64 the runtime enters an OSR method with the tier-0 frame still on
/// the stack and rsp one slot below it, as if the tier-0 code had called
/// it; the JIT's unwind info for it starts with a "phantom prolog" of the
/// tier-0 frame (docs/design/features/OnStackReplacement.md, 5.1). The OSR
/// prologue then copies the saved rbp (`mov rax, [rbp]; push rax`), saves
/// more callee-saved registers into space the tier-0 frame reserved, and
/// sets rbp to the copy: the frame-pointer rule would take a tier-0 local
/// for the return address. The rows put the CFA above the tier-0 frame's
/// return address and rbp at the tier-0 frame's save slot.
pub fn osr_method_frame(code: &[u8], start: u64, base_code: &[u8], base_start: u64) -> MethodFrame {
    let Some((_, base)) = decode(base_code, base_start, Frame::ENTRY) else {
        return MethodFrame::Unrecognised;
    };
    if base.rbp_saved_at.is_none() {
        return MethodFrame::Unrecognised;
    }
    let entry = Frame {
        sp_to_cfa: base.sp_to_cfa + 8,
        rbp_to_cfa: None,
        rbp_saved_at: base.rbp_saved_at,
    };
    match decode(code, start, entry) {
        Some((rows, _)) => to_rows(&rows),
        None => MethodFrame::Unrecognised,
    }
}

fn to_rows(rows: &[(u64, Frame)]) -> MethodFrame {
    let rows: Option<Vec<UnwindRow>> = rows.iter().map(|(pc, f)| f.row(*pc)).collect();
    rows.map_or(MethodFrame::Unrecognised, MethodFrame::Rows)
}

/// Runs a prologue from `entry`: the frame at each pc where it changed,
/// and the frame at the end of the prologue; `None` for a stack change the
/// decoder does not model.
fn decode(code: &[u8], start: u64, entry: Frame) -> Option<(Vec<(u64, Frame)>, Frame)> {
    let code = &code[..code.len().min(PROLOGUE_BYTES)];
    let end = start.saturating_add(code.len() as u64);
    let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut frame = entry;
    let mut rows: Vec<(u64, Frame)> = vec![(start, frame)];
    while decoder.can_decode() {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            if decoder.last_error() == DecoderError::NoMoreBytes {
                // The window ended inside an instruction: the prologue is
                // over by then.
                break;
            }
            return None;
        }
        let op0 = instruction.op0_register();
        let rsp_base = |i: &iced_x86::Instruction| {
            i.memory_base() == Register::RSP && i.memory_index() == Register::None
        };
        let before = frame;
        match instruction.code() {
            Code::Push_r64 => {
                frame.sp_to_cfa += 8;
                if op0 == Register::RBP {
                    frame.rbp_saved_at = Some(-frame.sp_to_cfa);
                }
            }
            Code::Sub_rm64_imm8 | Code::Sub_rm64_imm32
                if op0 == Register::RSP && instruction.op0_kind() == OpKind::Register =>
            {
                let size = instruction.immediate(1) as i64;
                if !(0..=MAX_FRAME_BYTES).contains(&size) {
                    return None;
                }
                frame.sp_to_cfa += size;
            }
            Code::Lea_r64_m if op0 == Register::RBP && rsp_base(&instruction) => {
                let displacement = instruction.memory_displacement64() as i64;
                frame.rbp_to_cfa = Some(frame.sp_to_cfa - displacement);
            }
            Code::Mov_r64_rm64 | Code::Mov_rm64_r64
                if op0 == Register::RBP
                    && instruction.op1_kind() == OpKind::Register
                    && instruction.op1_register() == Register::RSP =>
            {
                frame.rbp_to_cfa = Some(frame.sp_to_cfa);
            }
            _ => {
                if instruction.flow_control() != FlowControl::Next {
                    break;
                }
                let used = info.info(&instruction).used_registers();
                let writes = |register: Register| {
                    used.iter().any(|r| {
                        r.register() == register
                            && matches!(
                                r.access(),
                                OpAccess::Write
                                    | OpAccess::CondWrite
                                    | OpAccess::ReadWrite
                                    | OpAccess::ReadCondWrite
                            )
                    })
                };
                if writes(Register::RSP) {
                    // An epilog's `add rsp` or `pop` (the body state stands
                    // until the code check sees them), or a stack change
                    // not modelled.
                    let releases = matches!(
                        instruction.code(),
                        Code::Add_rm64_imm8 | Code::Add_rm64_imm32 | Code::Pop_r64
                    ) || instruction.code() == Code::Lea_r64_m;
                    if releases && rows.len() > 1 {
                        break;
                    }
                    return None;
                }
                if writes(Register::RBP) && frame.rbp_to_cfa.is_some() {
                    // rbp reused after the frame was set: nothing to base
                    // the CFA on that the decoder can follow.
                    return None;
                }
            }
        }
        if frame.sp_to_cfa > MAX_FRAME_BYTES {
            return None;
        }
        let pc = instruction.next_ip();
        if pc >= end {
            // The code read ends here: nothing after it is this method's.
            break;
        }
        if frame != before {
            match rows.last_mut() {
                Some(last) if last.0 == pc => last.1 = frame,
                _ => rows.push((pc, frame)),
            }
        }
    }
    Some((rows, frame))
}

/// Most methods with rows one process keeps: past it, new ones are walked
/// by frame pointer (and counted by the caller).
pub const MAX_METHODS_PER_PROCESS: usize = 1 << 16;

/// The JIT-compiled methods of one process that have rows, by start address:
/// what its JIT table is built from. A method compiled over an older one's
/// range (rejit, code freed and reused) replaces it.
#[derive(Debug, Default)]
pub struct JitCodeRows {
    /// start -> (end, rows).
    methods: BTreeMap<u64, (u64, Box<[UnwindRow]>)>,
    rows: usize,
    /// Whether [`Self::rows`] changed since [`Self::take_changed`].
    changed: bool,
}

impl JitCodeRows {
    /// Records the frame of the method at `[start, end)`, dropping the
    /// methods it overlaps. Returns false when the process already holds
    /// [`MAX_METHODS_PER_PROCESS`] methods with rows (this one is then
    /// walked by frame pointer).
    pub fn insert(&mut self, start: u64, end: u64, frame: &MethodFrame) -> bool {
        if start >= end {
            return true;
        }
        let overlapping: Vec<u64> = self
            .methods
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(s, _)| *s)
            .collect();
        for s in overlapping {
            if let Some((_, rows)) = self.methods.remove(&s) {
                self.rows -= rows.len();
                self.changed = true;
            }
        }
        let Some(rows) = frame.rows() else {
            return true;
        };
        if self.methods.len() >= MAX_METHODS_PER_PROCESS {
            return false;
        }
        let rows: Box<[UnwindRow]> = rows
            .iter()
            .filter(|r| r.pc >= start && r.pc < end)
            .copied()
            .collect();
        self.rows += rows.len();
        self.methods.insert(start, (end, rows));
        self.changed = true;
        true
    }

    /// Whether the table changed since [`Self::take_changed`], which
    /// would say so.
    pub fn is_changed(&self) -> bool {
        self.changed
    }

    /// Whether the table changed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// Methods with rows.
    pub fn len(&self) -> usize {
        self.methods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.methods.is_empty()
    }

    /// The process's sorted table: each method's rows, a
    /// [`CfaRule::FramePointer`] row in every gap between methods and after
    /// the last one (so the table answers for any pc from the first
    /// method's start on). Empty when there are no methods.
    pub fn rows(&self) -> Vec<UnwindRow> {
        let mut out = Vec::with_capacity(self.rows + self.methods.len() + 1);
        let mut last_end: Option<u64> = None;
        for (&start, (end, rows)) in &self.methods {
            if let Some(gap) = last_end.filter(|&e| e < start) {
                push_merged(&mut out, UnwindRow::new(gap, CfaRule::FramePointer, 0));
            }
            for row in rows.iter() {
                push_merged(&mut out, *row);
            }
            last_end = Some(*end);
        }
        if let Some(end) = last_end {
            push_merged(&mut out, UnwindRow::new(end, CfaRule::FramePointer, 0));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clrbpf_common::unwind::{MemoryReader, UnwindRegs, find_row, next_frame};

    const AT: u64 = 0x7f00_1000;

    fn sp(pc: u64, offset: i32) -> UnwindRow {
        UnwindRow::new(pc, CfaRule::SpOffset, offset).with_cfa_param(CFA_PARAM_EPILOG_BY_CODE)
    }

    /// .NET 8's `ManualResetEventSlim::Wait()` at tier 1, as read from a
    /// live process: `push rax; xor edx, edx; mov esi, -1; call [rip+..];
    /// nop; add rsp, 8; ret`.
    const WAIT_TIER1: &[u8] = &[
        0x50, 0x33, 0xd2, 0xbe, 0xff, 0xff, 0xff, 0xff, 0xff, 0x15, 0x11, 0x22, 0x33, 0x44, 0x90,
        0x48, 0x83, 0xc4, 0x08, 0xc3,
    ];

    #[test]
    fn frameless_wrapper_gets_rows() {
        assert_eq!(
            method_frame(WAIT_TIER1, AT),
            MethodFrame::Rows(vec![sp(AT, 8), sp(AT + 1, 16)])
        );
    }

    /// .NET 8's `Dictionary<int,long>.FindValue` at tier 1, as read from a
    /// live process: `push rbp; push r15; push r14; push r13; push r12;
    /// push rbx; sub rsp, 0x18; lea rbp, [rsp+0x40]; mov rbx, rdi`.
    const FIND_VALUE_TIER1: &[u8] = &[
        0x55, 0x41, 0x57, 0x41, 0x56, 0x41, 0x55, 0x41, 0x54, 0x53, 0x48, 0x83, 0xec, 0x18, 0x48,
        0x8d, 0x6c, 0x24, 0x40, 0x48, 0x8b, 0xdf,
    ];

    fn fp(pc: u64) -> UnwindRow {
        UnwindRow::new(pc, CfaRule::FramePointer, 0)
    }

    #[test]
    fn rbp_frames_get_rows_for_their_prologue() {
        let saved = |pc, offset| sp(pc, offset).with_fp_at(-16);
        // .NET 8: push rbp; push r15; push rbx; sub rsp, 0x20;
        // lea rbp, [rsp+0x30]; then the body.
        let net8 = [
            0x55, 0x41, 0x57, 0x53, 0x48, 0x83, 0xec, 0x20, 0x48, 0x8d, 0x6c, 0x24, 0x30, 0x48,
            0x8b, 0xdf, 0xe8, 0, 0, 0, 0,
        ];
        assert_eq!(
            method_frame(&net8, AT),
            MethodFrame::Prologue(vec![
                sp(AT, 8),
                saved(AT + 1, 16),
                saved(AT + 3, 24),
                saved(AT + 4, 32),
                saved(AT + 8, 64),
                fp(AT + 13),
            ])
        );
        // .NET Core 3.1: push rbp; push rbx; push rax; lea rbp, [rsp+0x10].
        let net31 = [0x55, 0x53, 0x50, 0x48, 0x8d, 0x6c, 0x24, 0x10, 0xc3];
        assert_eq!(
            method_frame(&net31, AT),
            MethodFrame::Prologue(vec![
                sp(AT, 8),
                saved(AT + 1, 16),
                saved(AT + 2, 24),
                saved(AT + 3, 32),
                fp(AT + 8),
            ])
        );
        // Tier 0: vzeroupper; push rbp; mov rbp, rsp.
        let tier0 = [0xc5, 0xf8, 0x77, 0x55, 0x48, 0x8b, 0xec, 0x90, 0xc3];
        assert_eq!(
            method_frame(&tier0, AT),
            MethodFrame::Prologue(vec![sp(AT, 8), saved(AT + 4, 16), fp(AT + 7)])
        );
        // rbp set by the last instruction read: no pc of the body to give
        // the frame-pointer row, and none needed.
        assert_eq!(
            method_frame(&[0x55, 0x48, 0x8b, 0xec], AT),
            MethodFrame::FramePointer
        );
    }

    /// A leaf sampled inside an rbp frame's prologue, right after its
    /// `push rbp` (where most such samples of a dictionary-bound loop
    /// land): the rows reach the method that called it; frame pointers
    /// alone go from the leaf to that method's caller.
    #[test]
    fn walk_from_inside_an_rbp_prologue_finds_its_caller() {
        let find_value = 0x1000;
        let mut jit = JitCodeRows::default();
        let frame = method_frame(FIND_VALUE_TIER1, find_value);
        assert!(matches!(frame, MethodFrame::Prologue(_)), "{frame:?}");
        jit.insert(find_value, find_value + 0x175, &frame);
        let rows = jit.rows();
        let (churn_ra, main_ra) = (0x5000_0040, 0x6000_0080);
        let sp0 = 0x7ffd_0000u64;
        let churn_fp = 0x7ffd_0100u64;
        let memory = Words(vec![
            (sp0, churn_fp),     // the rbp FindValue just pushed
            (sp0 + 8, churn_ra), // its return address, into the caller
            (churn_fp, 0),       // the caller's saved rbp (outermost)
            (churn_fp + 8, main_ra),
        ]);
        let leaf = UnwindRegs {
            pc: find_value + 1,
            sp: sp0,
            fp: churn_fp,
            lr: 0,
        };
        let mut regs = leaf;
        let mut interrupted = true;
        let mut lookup = |pc: u64| Ok(find_row(&rows, pc).copied());
        assert_eq!(
            next_frame(&mut regs, &mut interrupted, &mut lookup, &memory),
            Ok(true)
        );
        assert_eq!((regs.pc, regs.fp), (churn_ra, churn_fp), "the caller");
        // Past the prologue the frame-pointer rule applies.
        let body = find_value + FIND_VALUE_TIER1.len() as u64 - 3;
        let row = find_row(&rows, body).expect("a row for the body");
        assert_eq!(row.cfa_rule, CfaRule::FramePointer as u8);
        // Without rows, the caller is skipped.
        let mut regs = leaf;
        let mut interrupted = true;
        let mut none = |_: u64| Ok(None);
        assert_eq!(
            next_frame(&mut regs, &mut interrupted, &mut none, &memory),
            Ok(true)
        );
        assert_eq!(regs.pc, main_ra);
    }

    #[test]
    fn callee_saved_pushes_and_an_allocation() {
        // push r14; push rbx; sub rsp, 0x28; mov rbx, rdi; call ...
        let code = [
            0x41, 0x56, 0x53, 0x48, 0x83, 0xec, 0x28, 0x48, 0x8b, 0xdf, 0xe8, 0, 0, 0, 0,
        ];
        assert_eq!(
            method_frame(&code, AT),
            MethodFrame::Rows(vec![
                sp(AT, 8),
                sp(AT + 2, 16),
                sp(AT + 3, 24),
                sp(AT + 7, 64)
            ])
        );
    }

    #[test]
    fn rbp_pushed_as_a_general_register_is_restored_from_its_slot() {
        // push rbp; push rbx; sub rsp, 0x1000 (imm32); ret.
        let code = [0x55, 0x53, 0x48, 0x81, 0xec, 0x00, 0x10, 0x00, 0x00, 0xc3];
        assert_eq!(
            method_frame(&code, AT),
            MethodFrame::Rows(vec![
                sp(AT, 8),
                sp(AT + 1, 16).with_fp_at(-16),
                sp(AT + 2, 24).with_fp_at(-16),
                sp(AT + 9, 24 + 0x1000).with_fp_at(-16),
            ])
        );
    }

    #[test]
    fn leaves_and_jumps_keep_the_entry_row() {
        // mov eax, [rdi+8]; ret
        assert_eq!(
            method_frame(&[0x8b, 0x47, 0x08, 0xc3], AT),
            MethodFrame::Rows(vec![sp(AT, 8)])
        );
        // jmp [rip+..] (a precode)
        assert_eq!(
            method_frame(&[0xff, 0x25, 1, 2, 3, 4], AT),
            MethodFrame::Rows(vec![sp(AT, 8)])
        );
    }

    #[test]
    fn unmodelled_stack_changes_fall_back() {
        // lea rax, [rsp-0x2000]; mov rsp, rax (a probed frame).
        let probe = [
            0x48, 0x8d, 0x84, 0x24, 0x00, 0xe0, 0xff, 0xff, 0x48, 0x8b, 0xe0,
        ];
        assert_eq!(method_frame(&probe, AT), MethodFrame::Unrecognised);
        // and rsp, -16
        assert_eq!(
            method_frame(&[0x48, 0x83, 0xe4, 0xf0, 0xc3], AT),
            MethodFrame::Unrecognised
        );
        // Garbage.
        assert_eq!(
            method_frame(&[0x0f, 0x0b, 0xff, 0xff], AT),
            MethodFrame::Rows(vec![sp(AT, 8)])
        );
        assert_eq!(
            method_frame(&[0x06, 0x90, 0x90, 0x90], AT),
            MethodFrame::Unrecognised
        );
    }

    #[test]
    fn any_bytes_decode_without_panic_to_sorted_rows_in_the_window() {
        let mut state = 0x1234_5678_9abc_def0u64;
        for _ in 0..20_000 {
            let mut code = [0u8; PROLOGUE_BYTES];
            for b in &mut code {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            // Bias towards prologue bytes.
            code[0] = [0x50, 0x55, 0x41, 0x48, 0xc5][(state % 5) as usize];
            if let Some(rows) = method_frame(&code, AT).rows() {
                assert_eq!(rows[0].pc, AT);
                assert!(rows.windows(2).all(|w| w[0].pc < w[1].pc));
                assert!(rows.iter().all(|r| r.pc < AT + PROLOGUE_BYTES as u64));
            }
        }
    }

    #[test]
    fn table_has_frame_pointer_gaps_and_replaces_overlaps() {
        let mut jit = JitCodeRows::default();
        let frameless = method_frame(WAIT_TIER1, 0x1000);
        assert!(jit.insert(0x1000, 0x1014, &frameless));
        assert!(jit.insert(0x1100, 0x1114, &method_frame(WAIT_TIER1, 0x1100)));
        assert!(jit.take_changed());
        assert!(jit.insert(0x2000, 0x2100, &MethodFrame::FramePointer));
        assert!(
            !jit.take_changed(),
            "a framed method over no other changes nothing"
        );
        assert_eq!(
            jit.rows(),
            vec![
                sp(0x1000, 8),
                sp(0x1001, 16),
                fp(0x1014),
                sp(0x1100, 8),
                sp(0x1101, 16),
                fp(0x1114)
            ]
        );
        // Code reused by a framed method.
        assert!(jit.insert(0x1100, 0x1200, &MethodFrame::FramePointer));
        assert_eq!(jit.len(), 1);
        assert_eq!(jit.rows(), vec![sp(0x1000, 8), sp(0x1001, 16), fp(0x1014)]);
        // A method over the start of another.
        assert!(jit.insert(0x0ff0, 0x1004, &MethodFrame::Unrecognised));
        assert!(jit.is_empty());
        assert!(jit.rows().is_empty());
    }

    /// Memory of a captured stack, as a map of words.
    struct Words(Vec<(u64, u64)>);

    impl MemoryReader for Words {
        fn read_u64(&self, addr: u64) -> Option<u64> {
            self.0.iter().find(|(a, _)| *a == addr).map(|(_, v)| *v)
        }
    }

    /// A thread parked under the frameless wrapper: the walk with its rows
    /// reaches the user's method that called it, where frame pointers
    /// alone go from the wrapper straight to that method's caller.
    #[test]
    fn walk_through_a_frameless_wrapper_finds_its_caller() {
        let wrapper = 0x1000;
        let mut jit = JitCodeRows::default();
        jit.insert(wrapper, wrapper + 0x14, &method_frame(WAIT_TIER1, wrapper));
        let rows = jit.rows();
        let (callee_ra, user_ra, user_caller_ra) = (0x1000 + 14, 0x5000_0040, 0x6000_0080);
        // The wrapper's callee returned to `callee_ra` (its frame is the
        // sp we start from); the wrapper pushed rax below its own return
        // address; the user's method keeps an rbp frame.
        let sp0 = 0x7ffd_0000u64;
        let user_fp = 0x7ffd_0100u64;
        let memory = Words(vec![
            (sp0, 0xdead),      // the pushed rax
            (sp0 + 8, user_ra), // the wrapper's return address
            (user_fp, 0),       // the user method's saved rbp (outermost)
            (user_fp + 8, user_caller_ra),
        ]);
        let mut regs = UnwindRegs {
            pc: callee_ra,
            sp: sp0,
            fp: user_fp,
            lr: 0,
        };
        let mut interrupted = false;
        let mut lookup = |pc: u64| Ok(find_row(&rows, pc).copied());
        assert_eq!(
            next_frame(&mut regs, &mut interrupted, &mut lookup, &memory),
            Ok(true)
        );
        assert_eq!(regs.pc, user_ra, "the wrapper's caller, from its row");
        assert_eq!(regs.fp, user_fp);
        // Without rows, the frame-pointer rule skips the user's method.
        let mut regs = UnwindRegs {
            pc: callee_ra,
            sp: sp0,
            fp: user_fp,
            lr: 0,
        };
        let mut none = |_: u64| Ok(None);
        let mut interrupted = false;
        assert_eq!(
            next_frame(&mut regs, &mut interrupted, &mut none, &memory),
            Ok(true)
        );
        assert_eq!(regs.pc, user_caller_ra);
    }

    /// .NET 8's `Exceptions::Main` at tier 0, as read from a live process:
    /// `push rbp; sub rsp, 0x110; vzeroupper; lea rbp, [rsp+0x110]; xor
    /// eax, eax; mov [rbp-0x108], rax`.
    const MAIN_TIER0: &[u8] = &[
        0x55, 0x48, 0x81, 0xec, 0x10, 0x01, 0x00, 0x00, 0xc5, 0xf8, 0x77, 0x48, 0x8d, 0xac, 0x24,
        0x10, 0x01, 0x00, 0x00, 0x33, 0xc0, 0x48, 0x89, 0x85, 0xf8, 0xfe, 0xff, 0xff,
    ];

    /// Its OSR version (`[OptimizedTier1OSR]`), entered from a patchpoint of
    /// the tier-0 code: `mov rax, [rbp]; push rax; sub rsp, 0x20; mov
    /// [rsp+0x138], rbx; vzeroupper; lea rbp, [rsp+0x20]; mov [rbp-0x20],
    /// rsp; mov edi, [rbp+0xb4]`.
    const MAIN_OSR: &[u8] = &[
        0x48, 0x8b, 0x45, 0x00, 0x50, 0x48, 0x83, 0xec, 0x20, 0x48, 0x89, 0x9c, 0x24, 0x38, 0x01,
        0x00, 0x00, 0xc5, 0xf8, 0x77, 0x48, 0x8d, 0x6c, 0x24, 0x20, 0x48, 0x89, 0x65, 0xe0, 0x8b,
        0xbd, 0xb4, 0x00, 0x00, 0x00,
    ];

    #[test]
    fn osr_methods_unwind_through_the_tier0_frame() {
        let base = 0x2000;
        // push rbp; sub rsp, 0x110; vzeroupper; lea rbp, [rsp+0x110].
        assert_eq!(
            method_frame(MAIN_TIER0, base),
            MethodFrame::Prologue(vec![
                sp(base, 8),
                sp(base + 1, 16).with_fp_at(-16),
                sp(base + 8, 0x120).with_fp_at(-16),
                UnwindRow::new(base + 19, CfaRule::FramePointer, 0),
            ])
        );
        // Entered with rsp one slot below the tier-0 frame (return address,
        // saved rbp, 0x110 bytes): CFA = rsp + 0x128, rbp saved at CFA-16.
        let fp = |row: UnwindRow| row.with_fp_at(-16);
        let rbp_based = UnwindRow::new(AT + 0x19, CfaRule::FpOffset, 0x130)
            .with_cfa_param(CFA_PARAM_EPILOG_BY_CODE)
            .with_fp_at(-16);
        assert_eq!(
            osr_method_frame(MAIN_OSR, AT, MAIN_TIER0, base),
            MethodFrame::Rows(vec![
                fp(sp(AT, 0x128)),
                fp(sp(AT + 5, 0x130)),
                fp(sp(AT + 9, 0x150)),
                rbp_based,
            ])
        );
        // Without its tier-0 frame the OSR prologue is an rbp frame whose
        // return address would be a tier-0 local.
        assert_ne!(method_frame(MAIN_OSR, AT), MethodFrame::FramePointer);
        // A base the decoder cannot follow gives no rows.
        assert_eq!(
            osr_method_frame(MAIN_OSR, AT, &[0x48, 0x8b, 0xe0, 0xc3], base),
            MethodFrame::Unrecognised
        );
    }

    #[test]
    fn walk_through_an_osr_frame_finds_the_methods_caller() {
        let osr = 0x3000u64;
        let mut jit = JitCodeRows::default();
        jit.insert(
            osr,
            osr + 0x300,
            &osr_method_frame(MAIN_OSR, osr, MAIN_TIER0, 0x2000),
        );
        let rows = jit.rows();
        // The tier-0 frame's return address at `ra_slot`, the caller's rbp
        // below it; the OSR prologue ran: rsp = ra_slot - 0x148, rbp at the
        // copy of the caller's rbp it pushed.
        let ra_slot = 0x7ffd_1000u64;
        let (caller_ra, caller_fp) = (0x5000_0040u64, 0x7ffd_2000u64);
        let memory = Words(vec![
            (ra_slot - 0x128, caller_fp), // the pushed copy
            (ra_slot - 0x120, 0xbad),     // a tier-0 local
            (ra_slot - 8, caller_fp),     // the tier-0 frame's saved rbp
            (ra_slot, caller_ra),
        ]);
        let mut regs = UnwindRegs {
            pc: osr + 0x40,
            sp: ra_slot - 0x148,
            fp: ra_slot - 0x128,
            lr: 0,
        };
        let mut interrupted = true;
        let mut lookup = |pc: u64| Ok(find_row(&rows, pc).copied());
        assert_eq!(
            next_frame(&mut regs, &mut interrupted, &mut lookup, &memory),
            Ok(true)
        );
        assert_eq!(
            regs.pc, caller_ra,
            "the method's caller, past its tier-0 frame"
        );
        assert_eq!(regs.fp, caller_fp);
        assert_eq!(regs.sp, ra_slot + 8);
    }
}
