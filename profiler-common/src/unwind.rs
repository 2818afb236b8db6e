//! Native stack unwinding without frame pointers, one frame at a time.
//!
//! Place in the data flow: userspace (`clrbpf::unwind`) turns each ELF file's
//! `.eh_frame` into sorted [`UnwindRow`]s; the eBPF program looks up the row
//! for a frame's pc and calls [`step`] to get the caller's registers, starting
//! from the sampled user registers. The same functions run on the host in
//! tests over captured stack memory (the "coredump suite" idea of the
//! OpenTelemetry eBPF profiler), so everything here is verifier-friendly: no
//! allocation, no recursion, no floats, every loop bounded by a constant or by
//! the caller's output slice.
//!
//! Strategy, per frame:
//! 1. The caller's lookup maps the pc to a row of the file's table (an ELF
//!    file's `.eh_frame`, or a ReadyToRun image's Windows x64 unwind info),
//!    to "no row" (anonymous executable memory such as JIT code, or a file
//!    without a table: use the frame-pointer rule; a
//!    [`CfaRule::FramePointer`] row means the same), or to an
//!    [`UnwindError`]. Return
//!    addresses are looked up at `pc - 1`, so a call that ends a function
//!    finds its own row, not the next function's; interrupted pcs (the
//!    sampled leaf, and the frame a signal interrupted) are looked up as is.
//! 2. With a row: CFA = sp or fp + offset (or the x86_64 PLT rule); the return
//!    address is read at CFA + `ra_offset` (CFA - 8 on x86_64); fp is restored
//!    from CFA + `fp_offset` when the function saved it; the caller's sp is
//!    the CFA. A signal-trampoline row (`__restore_rt`) instead reloads pc, sp
//!    and fp from the `ucontext` the kernel left on the stack.
//! 3. Without a row: the frame-pointer rule (return address at fp + 8,
//!    caller's fp at fp, caller's sp = fp + 16), the frame layout CoreCLR's
//!    JIT keeps on every method. For the leaf frame only, [`walk`] first
//!    peeks at the code to handle a pc at `push rbp`, right after it (`mov
//!    rbp, rsp`) or at `ret`, where the frame record is not (or no longer)
//!    set up.
//!
//! Known limits: a leaf JIT frame without rows (code userspace has not
//! decoded yet) interrupted between `push rbp` and the instruction that
//! sets rbp after further pushes (CoreCLR's `push rbp; push r15...; lea
//! rbp, [rsp+N]`: decoded methods get rows for it), or in a stub without a
//! frame (precode jumps), skips its direct caller, exactly as a
//! frame-pointer walk would. CFA rules
//! that are DWARF expressions other than the PLT and signal-frame patterns
//! end the walk with [`UnwindError::UnsupportedCfa`]. Only x86_64 rules are
//! implemented; the row format keeps the frame register and the return
//! address rule generic so aarch64 (frame record in x29/x30, return address
//! in the link register in leaf frames) is an addition, not a change.

/// Most rows one table may hold: [`find_row`] finishes in
/// `MAX_TABLE_ROWS_LOG2 + 1` steps, the bound the verifier sees.
pub const MAX_TABLE_ROWS_LOG2: u32 = 24;
/// See [`MAX_TABLE_ROWS_LOG2`].
pub const MAX_TABLE_ROWS: usize = 1 << MAX_TABLE_ROWS_LOG2;

/// The kernel's row array grows by chunks of this many rows (1.5 MiB of
/// [`UnwindRow`]s), created as tables need them.
pub const UNWIND_ROWS_PER_CHUNK_LOG2: u32 = 16;
/// See [`UNWIND_ROWS_PER_CHUNK_LOG2`].
pub const UNWIND_ROWS_PER_CHUNK: usize = 1 << UNWIND_ROWS_PER_CHUNK_LOG2;

/// x86_64 facts the rules depend on.
pub mod x86_64 {
    /// `call` pushes the return address just below the caller's sp (the CFA).
    pub const RA_CFA_OFFSET: i16 = -8;
    /// Size of a PLT entry (`.plt`, `.plt.sec`): the PLT CFA rule tests the pc
    /// modulo this.
    pub const PLT_ENTRY_SIZE: u64 = 16;
    /// Offsets in the `ucontext_t` the kernel stores for a signal handler:
    /// `uc_flags`, `uc_link` and `uc_stack` (40 bytes) come before
    /// `uc_mcontext.gregs[]`, where `REG_RBP` = 10, `REG_RSP` = 15 and
    /// `REG_RIP` = 16. When the handler returns into `__restore_rt`, rsp points
    /// at the `ucontext_t` (glibc's own CFI for it reads rsp + 160).
    pub const UCONTEXT_RBP: u64 = 40 + 10 * 8;
    /// See [`UCONTEXT_RBP`].
    pub const UCONTEXT_RSP: u64 = 40 + 15 * 8;
    /// See [`UCONTEXT_RBP`].
    pub const UCONTEXT_RIP: u64 = 40 + 16 * 8;
    /// `push rbp`.
    pub const OP_PUSH_RBP: u8 = 0x55;
    /// `ret`.
    pub const OP_RET: u8 = 0xc3;
    /// `pop rbp`.
    pub const OP_POP_RBP: u8 = 0x5d;
    /// The REX prefix with only B set: `41 58+r` is `pop r8`..`pop r15`.
    pub const REX_B: u8 = 0x41;
    /// `mov rbp, rsp` (`48 89 e5`) as the low three bytes of a little-endian
    /// read at the pc.
    pub const OP_MOV_RBP_RSP: u64 = 0x00e5_8948;
}

/// [`UnwindRow::cfa_param`] flag of an sp- or fp-based row whose function's
/// epilogs are not described by the rows (Windows x64 unwind info, which
/// ReadyToRun code carries): an interrupted frame first checks whether its
/// pc is in an epilog's `pop`s or at its `ret` ([`step_interrupted_epilog`]).
pub const CFA_PARAM_EPILOG_BY_CODE: u8 = 1;

/// How to compute the CFA (the caller's sp before its call) of a frame.
/// Stored as a `u8` in [`UnwindRow::cfa_rule`]: never renumber, only add.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CfaRule {
    /// No unwind information covers this pc: a gap between functions or the
    /// end of the table. [`find_row`] reports such a pc as having no row.
    NoInfo = 0,
    /// CFA = sp + `cfa_offset`.
    SpOffset = 1,
    /// CFA = fp + `cfa_offset` (rbp on x86_64, x29 on aarch64).
    FpOffset = 2,
    /// An x86_64 lazy-binding PLT entry: CFA = sp + `cfa_offset`, plus 8 when
    /// `pc % 16 >= cfa_param` (the entry already pushed its relocation index).
    /// The translation of binutils' `DW_CFA_def_cfa_expression` for `.plt`.
    PltSp = 3,
    /// A signal trampoline (`__restore_rt`): sp points at the `ucontext_t`
    /// holding the interrupted registers.
    SignalFrame = 4,
    /// A rule the table cannot express (a DWARF expression, a register other
    /// than sp and fp).
    Unsupported = 5,
    /// No unwind information, but code that keeps the frame-pointer chain:
    /// the gaps of a ReadyToRun image's table (stubs, thunks). The walk
    /// steps as for a mapping without a table instead of ending.
    FramePointer = 6,
}

impl CfaRule {
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::NoInfo),
            1 => Some(Self::SpOffset),
            2 => Some(Self::FpOffset),
            3 => Some(Self::PltSp),
            4 => Some(Self::SignalFrame),
            5 => Some(Self::Unsupported),
            6 => Some(Self::FramePointer),
            _ => None,
        }
    }
}

/// How to find the caller's frame register (rbp / x29). Stored as a `u8` in
/// [`UnwindRow::fp_rule`]: never renumber, only add.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FpRule {
    /// The function has not touched it (DWARF `Undefined` or `SameValue`:
    /// for a callee-saved register both mean "the caller's value is in it").
    Unchanged = 0,
    /// Saved at CFA + `fp_offset`.
    AtCfaOffset = 1,
    /// Saved in a way the table cannot express.
    Unsupported = 2,
}

impl FpRule {
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Unchanged),
            1 => Some(Self::AtCfaOffset),
            2 => Some(Self::Unsupported),
            _ => None,
        }
    }
}

/// How to find the return address. Stored as a `u8` in
/// [`UnwindRow::ra_rule`]: never renumber, only add.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RaRule {
    /// Saved at CFA + `ra_offset` (always CFA - 8 on x86_64).
    AtCfaOffset = 0,
    /// DWARF `Undefined`: the outermost frame (`_start`, a thread's start
    /// routine). The walk ends cleanly here.
    Undefined = 1,
    /// Still in the link register (aarch64 leaf code before it saves x30).
    LinkRegister = 2,
    /// Saved in a way the table cannot express.
    Unsupported = 3,
}

impl RaRule {
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::AtCfaOffset),
            1 => Some(Self::Undefined),
            2 => Some(Self::LinkRegister),
            3 => Some(Self::Unsupported),
            _ => None,
        }
    }
}

/// One row of a file's unwind table: how to unwind any pc from `pc` up to the
/// next row's `pc`. Tables are sorted by `pc` and end with a
/// [`CfaRule::NoInfo`] row; consecutive rows differ.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UnwindRow {
    /// First pc the row covers, as an ELF virtual address of the file (the
    /// address space of its symbols and `.eh_frame`). A process's mapping
    /// translates with `pc - load_bias`.
    pub pc: u64,
    /// Added to the base register of [`Self::cfa_rule`].
    pub cfa_offset: i32,
    /// Where the caller's fp is saved, from the CFA ([`FpRule::AtCfaOffset`]).
    pub fp_offset: i16,
    /// Where the return address is saved, from the CFA
    /// ([`RaRule::AtCfaOffset`]).
    pub ra_offset: i16,
    /// A [`CfaRule`] number.
    pub cfa_rule: u8,
    /// A [`FpRule`] number.
    pub fp_rule: u8,
    /// A [`RaRule`] number.
    pub ra_rule: u8,
    /// Parameter of some CFA rules: for [`CfaRule::PltSp`], the offset in the
    /// PLT entry from which the extra 8 bytes are on the stack; for
    /// [`CfaRule::SpOffset`] and [`CfaRule::FpOffset`], flags
    /// ([`CFA_PARAM_EPILOG_BY_CODE`]).
    pub cfa_param: u8,
    pub _pad: [u8; 4],
}

const _: () = assert!(size_of::<UnwindRow>() == 24);

#[cfg(feature = "user")]
// SAFETY: `#[repr(C)]`, only integers, no implicit padding (checked above).
unsafe impl aya::Pod for UnwindRow {}

impl UnwindRow {
    /// A row with the usual x86_64 return-address rule (CFA - 8) and fp
    /// unchanged.
    pub const fn new(pc: u64, cfa_rule: CfaRule, cfa_offset: i32) -> Self {
        Self {
            pc,
            cfa_offset,
            fp_offset: 0,
            ra_offset: x86_64::RA_CFA_OFFSET,
            cfa_rule: cfa_rule as u8,
            fp_rule: FpRule::Unchanged as u8,
            ra_rule: RaRule::AtCfaOffset as u8,
            cfa_param: 0,
            _pad: [0; 4],
        }
    }

    /// The [`CfaRule::NoInfo`] row that closes a function or the table.
    pub const fn no_info(pc: u64) -> Self {
        Self::new(pc, CfaRule::NoInfo, 0)
    }

    /// The same row with fp saved at CFA + `fp_offset`.
    pub const fn with_fp_at(mut self, fp_offset: i16) -> Self {
        self.fp_rule = FpRule::AtCfaOffset as u8;
        self.fp_offset = fp_offset;
        self
    }

    /// The same row with another fp rule (and no offset).
    pub const fn with_fp_rule(mut self, fp_rule: FpRule) -> Self {
        self.fp_rule = fp_rule as u8;
        self.fp_offset = 0;
        self
    }

    /// The same row with another return-address rule.
    pub const fn with_ra(mut self, ra_rule: RaRule, ra_offset: i16) -> Self {
        self.ra_rule = ra_rule as u8;
        self.ra_offset = ra_offset;
        self
    }

    /// The same row with a [`Self::cfa_param`].
    pub const fn with_cfa_param(mut self, cfa_param: u8) -> Self {
        self.cfa_param = cfa_param;
        self
    }

    /// Whether both rows unwind the same way (everything but `pc` equal), so
    /// the second one can be merged into the first.
    pub const fn same_rule(&self, other: &Self) -> bool {
        self.cfa_offset == other.cfa_offset
            && self.fp_offset == other.fp_offset
            && self.ra_offset == other.ra_offset
            && self.cfa_rule == other.cfa_rule
            && self.fp_rule == other.fp_rule
            && self.ra_rule == other.ra_rule
            && self.cfa_param == other.cfa_param
    }
}

/// The registers an unwinding step needs, for one frame.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindRegs {
    /// Instruction pointer (rip).
    pub pc: u64,
    /// Stack pointer (rsp).
    pub sp: u64,
    /// Frame register: rbp on x86_64, x29 on aarch64.
    pub fp: u64,
    /// Link register (x30 on aarch64); unused on x86_64, where it stays 0.
    pub lr: u64,
}

const _: () = assert!(size_of::<UnwindRegs>() == 32);

#[cfg(feature = "user")]
// SAFETY: `#[repr(C)]`, only u64 fields, no padding.
unsafe impl aya::Pod for UnwindRegs {}

/// Why a walk stopped early. Counted per kind by the kernel side and shown in
/// the summary: stable numbers, never renumber, only add. 0 means "no error"
/// where a number is stored.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnwindError {
    /// The pc is in no executable mapping known for the process.
    NoMapping = 1,
    /// The file's table has no row for the pc (code without CFI).
    NoTableRow = 2,
    /// The row's CFA rule is one the table cannot express.
    UnsupportedCfa = 3,
    /// The row's rule for the frame register is one the table cannot express.
    UnsupportedFpRule = 4,
    /// The row's return-address rule is one the table cannot express.
    UnsupportedRaRule = 5,
    /// Reading the target's stack failed (unmapped, paged out).
    BadRead = 6,
    /// The return address read is 0.
    PcZero = 7,
    /// The stack has more frames than the output holds.
    TooDeep = 8,
    /// The caller's sp is not above the frame's sp: garbage or a loop.
    StackNotAdvancing = 9,
    /// The frame-pointer rule met an fp below sp or not 8-byte aligned.
    InvalidFramePointer = 10,
    /// A rule number this code does not know (corrupt or newer table).
    InvalidRow = 11,
    /// Address arithmetic overflowed.
    AddressOverflow = 12,
}

impl UnwindError {
    /// Every error, in number order: for summaries and metric names.
    pub const ALL: [Self; 12] = [
        Self::NoMapping,
        Self::NoTableRow,
        Self::UnsupportedCfa,
        Self::UnsupportedFpRule,
        Self::UnsupportedRaRule,
        Self::BadRead,
        Self::PcZero,
        Self::TooDeep,
        Self::StackNotAdvancing,
        Self::InvalidFramePointer,
        Self::InvalidRow,
        Self::AddressOverflow,
    ];

    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::NoMapping),
            2 => Some(Self::NoTableRow),
            3 => Some(Self::UnsupportedCfa),
            4 => Some(Self::UnsupportedFpRule),
            5 => Some(Self::UnsupportedRaRule),
            6 => Some(Self::BadRead),
            7 => Some(Self::PcZero),
            8 => Some(Self::TooDeep),
            9 => Some(Self::StackNotAdvancing),
            10 => Some(Self::InvalidFramePointer),
            11 => Some(Self::InvalidRow),
            12 => Some(Self::AddressOverflow),
            _ => None,
        }
    }

    /// A short snake_case name, for summaries and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            Self::NoMapping => "no_mapping",
            Self::NoTableRow => "no_table_row",
            Self::UnsupportedCfa => "unsupported_cfa",
            Self::UnsupportedFpRule => "unsupported_fp_rule",
            Self::UnsupportedRaRule => "unsupported_ra_rule",
            Self::BadRead => "bad_read",
            Self::PcZero => "pc_zero",
            Self::TooDeep => "too_deep",
            Self::StackNotAdvancing => "stack_not_advancing",
            Self::InvalidFramePointer => "invalid_frame_pointer",
            Self::InvalidRow => "invalid_row",
            Self::AddressOverflow => "address_overflow",
        }
    }
}

/// What one [`step`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// The registers now hold the caller's frame; its pc is a return address
    /// (look it up at `pc - 1`).
    Caller,
    /// The registers now hold a context a signal interrupted; its pc is the
    /// interrupted instruction (look it up as is; it is a leaf again).
    Interrupted,
    /// The frame has no caller; the registers are unchanged.
    EndOfStack,
}

/// Reads the target's memory: `bpf_probe_read_user` in the kernel, a captured
/// snapshot on the host.
pub trait MemoryReader {
    /// The little-endian u64 at `addr`, or `None` when it cannot be read.
    fn read_u64(&self, addr: u64) -> Option<u64>;

    /// The u64s at `addr` and `addr + 8`, `None` unless both can be read:
    /// a frame record, or a saved fp next to the return address. The kernel
    /// does it in one `bpf_probe_read_user`, which costs as much as one
    /// word (the call, not the bytes, is the price).
    fn read_u64_pair(&self, addr: u64) -> Option<(u64, u64)> {
        Some((self.read_u64(addr)?, self.read_u64(addr.checked_add(8)?)?))
    }

    /// The 8 code bytes at `addr`, little-endian. A separate method because
    /// the kernel reads stack words through a window of the stack page
    /// that code reads must not displace.
    fn read_code_u64(&self, addr: u64) -> Option<u64> {
        self.read_u64(addr)
    }

    /// The epilog whose next instruction is at `pc` ([`decode_epilog`] of
    /// the code there), `None` when the code is no epilog or cannot be
    /// read. The kernel runs the same [`EpilogScan`] steps one `bpf_loop`
    /// iteration at a time, which its verifier checks far faster than the
    /// loop.
    fn epilog_at(&self, pc: u64) -> Option<Epilog> {
        decode_epilog(self.read_code_u64(pc)?)
    }
}

/// An x64 epilog an interrupted frame is in: where its `pop`s leave the
/// return address and rbp, from sp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Epilog {
    pub ra_slot: u64,
    /// Where `pop rbp` takes rbp from, `None` when the epilog has none.
    pub rbp_slot: Option<u64>,
}

/// [`EpilogScan::state`]: decoding.
pub const EPILOG_SCANNING: u32 = 0;
/// [`EpilogScan::state`]: `ret` reached after `pop`s.
pub const EPILOG_FOUND: u32 = 1;
/// [`EpilogScan::state`]: the code is not `pop`s then `ret`.
pub const EPILOG_NONE: u32 = 2;

/// The decoding of an epilog (zero or more `pop`s, `58+r` or `41 58+r`,
/// then `ret`) in 8 code bytes, one instruction per [`Self::step`]: at
/// most [`Self::STEPS`] of them (7 one-byte pops and `ret`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpilogScan {
    /// Code bytes decoded.
    pub at: u32,
    /// [`EPILOG_SCANNING`], [`EPILOG_FOUND`] or [`EPILOG_NONE`].
    pub state: u32,
    /// Stack bytes the decoded pops take: where the return address is.
    pub ra_slot: u32,
    /// 1 + where `pop rbp` takes rbp from, 0 for no `pop rbp`.
    pub rbp_slot_plus_one: u32,
}

impl EpilogScan {
    pub const STEPS: u32 = 8;

    /// Decodes the next instruction of `code`; false once the scan is over.
    #[inline(always)]
    pub fn step(&mut self, code: u64) -> bool {
        if self.state != EPILOG_SCANNING {
            return false;
        }
        if self.at >= 8 {
            self.state = EPILOG_NONE;
            return false;
        }
        let byte = (code >> (8 * self.at)) as u8;
        if byte == x86_64::OP_RET {
            self.state = EPILOG_FOUND;
            return false;
        }
        if (0x58..=0x5f).contains(&byte) {
            if byte == x86_64::OP_POP_RBP {
                self.rbp_slot_plus_one = self.ra_slot + 1;
            }
            self.ra_slot += 8;
            self.at += 1;
        } else if byte == x86_64::REX_B
            && self.at < 7
            && (0x58..=0x5f).contains(&((code >> (8 * (self.at + 1))) as u8))
        {
            self.ra_slot += 8;
            self.at += 2;
        } else {
            self.state = EPILOG_NONE;
            return false;
        }
        true
    }

    /// The epilog decoded, `None` unless `ret` was reached.
    #[inline(always)]
    pub fn result(&self) -> Option<Epilog> {
        if self.state != EPILOG_FOUND || self.ra_slot > 8 * Self::STEPS {
            return None;
        }
        Some(Epilog {
            ra_slot: u64::from(self.ra_slot),
            rbp_slot: self.rbp_slot_plus_one.checked_sub(1).map(u64::from),
        })
    }
}

/// The epilog the 8 code bytes `code` start, if they are one.
pub fn decode_epilog(code: u64) -> Option<Epilog> {
    let mut scan = EpilogScan::default();
    for _ in 0..EpilogScan::STEPS {
        if !scan.step(code) {
            break;
        }
    }
    scan.result()
}

/// The row covering `pc` in a table sorted by `pc`: the last row starting at
/// or before `pc`, unless that is a [`CfaRule::NoInfo`] row. `None` also for
/// a table longer than [`MAX_TABLE_ROWS`], which the bounded search cannot
/// finish.
pub fn find_row(rows: &[UnwindRow], pc: u64) -> Option<&UnwindRow> {
    if rows.len() > MAX_TABLE_ROWS {
        return None;
    }
    let index = find_row_index(
        rows.len() as u32,
        |i| rows.get(i as usize).map(|r| r.pc),
        pc,
    )?;
    let row = rows.get(index as usize)?;
    if row.cfa_rule == CfaRule::NoInfo as u8 {
        None
    } else {
        Some(row)
    }
}

/// The index of the last of `len` sorted rows starting at or before `pc`,
/// reading each row's start with `pc_at` (a slice on the host, a BPF array
/// map in the kernel, where rows cannot form a slice). At most
/// `MAX_TABLE_ROWS_LOG2 + 1` probes, whatever `len` is: a longer table, or a
/// `pc_at` that fails, gives `None`. The caller still checks the row for
/// [`CfaRule::NoInfo`].
#[inline(always)]
pub fn find_row_index(len: u32, pc_at: impl Fn(u32) -> Option<u64>, pc: u64) -> Option<u32> {
    let mut search = SortedSearch::new(len);
    for _ in 0..=MAX_TABLE_ROWS_LOG2 {
        let Some(mid) = search.probe() else {
            break;
        };
        search.narrow(mid, pc_at(mid)? <= pc);
    }
    search.found()
}

/// The state of a binary search for the last of `len` sorted entries that
/// starts at or before a key, one probe at a time. [`find_row_index`] and
/// [`find_mapping`] drive it in a loop; the eBPF side drives the same steps
/// but keeps the state in map memory between probes, so the verifier sees
/// unknown bounds instead of exploring every (lo, hi) pair.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SortedSearch {
    /// Entries before `lo` start at or before the key.
    pub lo: u32,
    /// Entries from `hi` on start after the key.
    pub hi: u32,
}

impl SortedSearch {
    pub const fn new(len: u32) -> Self {
        Self { lo: 0, hi: len }
    }

    /// The index to probe next, `None` once the search is over.
    #[inline(always)]
    pub fn probe(&self) -> Option<u32> {
        if self.lo >= self.hi {
            None
        } else {
            Some(self.lo + (self.hi - self.lo) / 2)
        }
    }

    /// Narrows after probing `mid`: `at_or_before` tells whether the entry
    /// at `mid` starts at or before the key.
    #[inline(always)]
    pub fn narrow(&mut self, mid: u32, at_or_before: bool) {
        if at_or_before {
            self.lo = mid.saturating_add(1);
        } else {
            self.hi = mid;
        }
    }

    /// The index found: `None` when no entry starts at or before the key,
    /// or when the search was cut short before it finished.
    #[inline(always)]
    pub fn found(&self) -> Option<u32> {
        if self.lo < self.hi {
            return None;
        }
        self.lo.checked_sub(1)
    }
}

fn read<M: MemoryReader + ?Sized>(mem: &M, addr: u64) -> Result<u64, UnwindError> {
    mem.read_u64(addr).ok_or(UnwindError::BadRead)
}

fn read_pair<M: MemoryReader + ?Sized>(mem: &M, addr: u64) -> Result<(u64, u64), UnwindError> {
    mem.read_u64_pair(addr).ok_or(UnwindError::BadRead)
}

fn offset(base: u64, offset: i64) -> Result<u64, UnwindError> {
    base.checked_add_signed(offset)
        .ok_or(UnwindError::AddressOverflow)
}

/// Unwinds one frame: replaces `regs` (the frame's registers) with its
/// caller's, using `row` when the pc has one and the frame-pointer rule when
/// it has none. On error `regs` are left as they were.
pub fn step<M: MemoryReader + ?Sized>(
    regs: &mut UnwindRegs,
    row: Option<&UnwindRow>,
    mem: &M,
) -> Result<StepOutcome, UnwindError> {
    let Some(row) = row else {
        return step_frame_pointer(regs, mem);
    };
    let cfa_rule = CfaRule::from_u8(row.cfa_rule).ok_or(UnwindError::InvalidRow)?;
    let ra_rule = RaRule::from_u8(row.ra_rule).ok_or(UnwindError::InvalidRow)?;
    let fp_rule = FpRule::from_u8(row.fp_rule).ok_or(UnwindError::InvalidRow)?;
    let base = match cfa_rule {
        CfaRule::NoInfo => return Err(UnwindError::NoTableRow),
        CfaRule::Unsupported => return Err(UnwindError::UnsupportedCfa),
        CfaRule::SignalFrame => return step_signal_frame(regs, mem),
        CfaRule::FramePointer => return step_frame_pointer(regs, mem),
        CfaRule::SpOffset => regs.sp,
        CfaRule::FpOffset => regs.fp,
        CfaRule::PltSp => {
            if regs.pc % x86_64::PLT_ENTRY_SIZE >= row.cfa_param as u64 {
                offset(regs.sp, 8)?
            } else {
                regs.sp
            }
        }
    };
    if ra_rule == RaRule::Undefined {
        return Ok(StepOutcome::EndOfStack);
    }
    let cfa = offset(base, row.cfa_offset as i64)?;
    // `call` pushed the return address below the CFA, so the frame's sp is
    // always strictly below it.
    if cfa <= regs.sp {
        return Err(UnwindError::StackNotAdvancing);
    }
    let (pc, fp) = match (ra_rule, fp_rule) {
        // The usual x86_64 frame (`push rbp` right after the call): the
        // saved fp just below the return address, one read for both.
        (RaRule::AtCfaOffset, FpRule::AtCfaOffset)
            if row.fp_offset as i32 + 8 == row.ra_offset as i32 =>
        {
            let (fp, pc) = read_pair(mem, offset(cfa, row.fp_offset as i64)?)?;
            (pc, fp)
        }
        _ => {
            let pc = match ra_rule {
                RaRule::AtCfaOffset => read(mem, offset(cfa, row.ra_offset as i64)?)?,
                RaRule::LinkRegister => regs.lr,
                RaRule::Undefined | RaRule::Unsupported => {
                    return Err(UnwindError::UnsupportedRaRule);
                }
            };
            let fp = match fp_rule {
                FpRule::Unchanged => regs.fp,
                FpRule::AtCfaOffset => read(mem, offset(cfa, row.fp_offset as i64)?)?,
                FpRule::Unsupported => return Err(UnwindError::UnsupportedFpRule),
            };
            (pc, fp)
        }
    };
    if pc == 0 {
        return Err(UnwindError::PcZero);
    }
    *regs = UnwindRegs {
        pc,
        sp: cfa,
        fp,
        lr: 0,
    };
    Ok(StepOutcome::Caller)
}

/// The frame-pointer rule: the frame record `[caller fp, return address]` is
/// at fp. An fp of 0 ends the chain (`_start` and thread entry points clear
/// it).
fn step_frame_pointer<M: MemoryReader + ?Sized>(
    regs: &mut UnwindRegs,
    mem: &M,
) -> Result<StepOutcome, UnwindError> {
    let fp = regs.fp;
    if fp == 0 {
        return Ok(StepOutcome::EndOfStack);
    }
    if fp < regs.sp || !fp.is_multiple_of(8) {
        return Err(UnwindError::InvalidFramePointer);
    }
    let sp = offset(fp, 16)?;
    let (caller_fp, pc) = read_pair(mem, fp)?;
    if pc == 0 {
        return Err(UnwindError::PcZero);
    }
    *regs = UnwindRegs {
        pc,
        sp,
        fp: caller_fp,
        lr: 0,
    };
    Ok(StepOutcome::Caller)
}

/// `__restore_rt`: reload the interrupted registers from the `ucontext_t` at
/// sp. The interrupted sp may be anywhere (an alternate signal stack), so no
/// "stack advances" check here; the walk's bound still holds.
fn step_signal_frame<M: MemoryReader + ?Sized>(
    regs: &mut UnwindRegs,
    mem: &M,
) -> Result<StepOutcome, UnwindError> {
    let uc = regs.sp;
    let pc = read(mem, offset(uc, x86_64::UCONTEXT_RIP as i64)?)?;
    let sp = read(mem, offset(uc, x86_64::UCONTEXT_RSP as i64)?)?;
    let fp = read(mem, offset(uc, x86_64::UCONTEXT_RBP as i64)?)?;
    if pc == 0 {
        return Err(UnwindError::PcZero);
    }
    *regs = UnwindRegs { pc, sp, fp, lr: 0 };
    Ok(StepOutcome::Interrupted)
}

/// The frame-pointer rule for an interrupted frame (the sampled leaf, or the
/// frame a signal interrupted) without a row: at `push rbp` or `ret` the
/// return address is at sp; right after `push rbp` (at `mov rbp, rsp`) it is
/// at sp + 8 and fp still holds the caller's. Anywhere else (or when the code
/// cannot be read) the plain frame-pointer rule.
///
/// The code at pc is read for every such leaf: first asking whether a
/// stack word could be a return address (a mapping lookup for each of
/// two words) made the kernel's walk about 8% slower than the code read it
/// saved.
pub fn step_interrupted_without_row<M: MemoryReader + ?Sized>(
    regs: &mut UnwindRegs,
    mem: &M,
) -> Result<StepOutcome, UnwindError> {
    // One call of the frame-pointer rule for every way of not finding the
    // return address: the kernel's verifier checks a call once per state
    // reaching it.
    let Some(ra_slot) = interrupted_return_slot(regs, mem) else {
        return step_frame_pointer(regs, mem);
    };
    let ra_addr = offset(regs.sp, ra_slot)?;
    let pc = read(mem, ra_addr)?;
    if pc == 0 {
        return Err(UnwindError::PcZero);
    }
    *regs = UnwindRegs {
        pc,
        sp: offset(ra_addr, 8)?,
        fp: regs.fp,
        lr: 0,
    };
    Ok(StepOutcome::Caller)
}

/// Where the return address is from sp when an interrupted frame without a
/// row is at `push rbp`, `ret` or right after `push rbp`; `None` anywhere
/// else, or when the code cannot be read.
fn interrupted_return_slot<M: MemoryReader + ?Sized>(regs: &UnwindRegs, mem: &M) -> Option<i64> {
    let code = mem.read_code_u64(regs.pc)?;
    let first = code as u8;
    if first == x86_64::OP_PUSH_RBP || first == x86_64::OP_RET {
        Some(0)
    } else if code & 0x00ff_ffff == x86_64::OP_MOV_RBP_RSP
        && regs
            .pc
            .checked_sub(1)
            .and_then(|pc| mem.read_code_u64(pc))
            .map(|c| c as u8)
            == Some(x86_64::OP_PUSH_RBP)
    {
        Some(8)
    } else {
        None
    }
}

/// An interrupted frame in an x64 epilog the rows do not describe: when
/// the code at pc is zero or more `pop`s (`58+r`, `41 58+r`) then `ret`,
/// the stack pointer already went past the frame's allocation, and the
/// return address is above the words those pops will take (rbp among them
/// when one is `pop rbp`). `Ok(None)` when the code is not such an epilog
/// (or cannot be read): the row applies. Before the epilog's `add rsp` or
/// `lea rsp` the row's rule is still right. The pc of an interrupted frame
/// is an instruction's start, so the bytes decode as they run.
pub fn step_interrupted_epilog<M: MemoryReader + ?Sized>(
    regs: &mut UnwindRegs,
    mem: &M,
) -> Result<Option<StepOutcome>, UnwindError> {
    let Some(Epilog { ra_slot, rbp_slot }) = mem.epilog_at(regs.pc) else {
        return Ok(None);
    };
    let ra_addr = offset(regs.sp, ra_slot as i64)?;
    let pc = read(mem, ra_addr)?;
    if pc == 0 {
        return Err(UnwindError::PcZero);
    }
    let fp = match rbp_slot {
        Some(slot) => read(mem, offset(regs.sp, slot as i64)?)?,
        None => regs.fp,
    };
    *regs = UnwindRegs {
        pc,
        sp: offset(ra_addr, 8)?,
        fp,
        lr: 0,
    };
    Ok(Some(StepOutcome::Caller))
}

/// Walks a stack from `regs` (the sampled registers), writing each frame's pc
/// into `out`, leaf first, at most `out.len()` frames (the only loop bound).
///
/// `lookup(pc)` returns the row for a pc (already adjusted to `pc - 1` for
/// return addresses), `Ok(None)` to use the frame-pointer rule (JIT code, a
/// file without a table), or the error that ends the walk (no mapping, no row
/// in a file that has a table). Returns the number of frames written and why
/// the walk stopped early: `None` for a clean end (outermost frame or fp 0),
/// [`UnwindError::TooDeep`] when frames remained. Frames found before an
/// error are kept.
pub fn walk<M, L>(
    regs: UnwindRegs,
    mut lookup: L,
    mem: &M,
    out: &mut [u64],
) -> (usize, Option<UnwindError>)
where
    M: MemoryReader + ?Sized,
    L: FnMut(u64) -> Result<Option<UnwindRow>, UnwindError>,
{
    let mut regs = regs;
    let mut interrupted = true;
    let mut frames = 0;
    for slot in out.iter_mut() {
        if regs.pc == 0 {
            return (frames, Some(UnwindError::PcZero));
        }
        *slot = regs.pc;
        frames += 1;
        match next_frame(&mut regs, &mut interrupted, &mut lookup, mem) {
            Ok(true) => {}
            Ok(false) => return (frames, None),
            Err(e) => return (frames, Some(e)),
        }
    }
    (frames, Some(UnwindError::TooDeep))
}

/// One iteration of [`walk`], for callers that cannot hold the whole walk in
/// one loop (the eBPF side runs it under `bpf_loop`): the frame in `regs`
/// (whose pc the caller has recorded) is replaced by its caller's. Returns
/// `Ok(true)` when `regs` hold another frame, `Ok(false)` at the outermost
/// frame. `interrupted` is true for the sampled leaf and for a frame a signal
/// interrupted; it is updated for the next frame.
#[inline(always)]
pub fn next_frame<M, L>(
    regs: &mut UnwindRegs,
    interrupted: &mut bool,
    lookup: &mut L,
    mem: &M,
) -> Result<bool, UnwindError>
where
    M: MemoryReader + ?Sized,
    L: FnMut(u64) -> Result<Option<UnwindRow>, UnwindError>,
{
    let lookup_pc = if *interrupted {
        regs.pc
    } else {
        regs.pc.wrapping_sub(1)
    };
    let row = lookup(lookup_pc)?.filter(|r| r.cfa_rule != CfaRule::FramePointer as u8);
    let outcome = match (row, *interrupted) {
        (None, true) => step_interrupted_without_row(regs, mem)?,
        (row, interrupted) => {
            let in_epilog = match row {
                Some(row)
                    if interrupted
                        && row.cfa_param & CFA_PARAM_EPILOG_BY_CODE != 0
                        && (row.cfa_rule == CfaRule::SpOffset as u8
                            || row.cfa_rule == CfaRule::FpOffset as u8) =>
                {
                    step_interrupted_epilog(regs, mem)?
                }
                _ => None,
            };
            // One call of `step` for both ways here: the kernel's verifier
            // checks a call once per state reaching it.
            match in_epilog {
                Some(outcome) => outcome,
                None => step(regs, row.as_ref(), mem)?,
            }
        }
    };
    match outcome {
        StepOutcome::Caller => *interrupted = false,
        StepOutcome::Interrupted => *interrupted = true,
        StepOutcome::EndOfStack => return Ok(false),
    }
    Ok(true)
}

/// Most executable mappings one process's [`ProcessMappings`] holds. .NET
/// processes map each ReadyToRun assembly executable, so a few hundred are
/// normal; contiguous mappings unwound the same way are merged first.
pub const MAX_PROCESS_MAPPINGS: usize = 512;
/// [`find_mapping`] finishes in `MAX_PROCESS_MAPPINGS_LOG2 + 1` probes.
pub const MAX_PROCESS_MAPPINGS_LOG2: u32 = 9;
const _: () = assert!(1 << MAX_PROCESS_MAPPINGS_LOG2 == MAX_PROCESS_MAPPINGS);

/// One executable mapping of a process, as the kernel side looks it up:
/// `[start, end)`, the load bias that turns a pc into the ELF virtual
/// address of its file's table, where that table's rows are in the shared
/// row array, and the shape of the table's [`RowIndex`]. `row_count` 0 means
/// "no table": anonymous executable memory (JIT code), a file that is not
/// ELF or has no `.eh_frame`, or a table evicted under the memory cap. The
/// frame-pointer rule applies there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappingEntry {
    pub start: u64,
    pub end: u64,
    pub bias: u64,
    /// [`RowIndex::base`] of the table.
    pub index_base: u64,
    /// Index of the table's first row in the shared row array.
    pub row_offset: u32,
    pub row_count: u32,
    /// [`RowIndex::len`] of the table: 0 for none (the whole table is
    /// binary-searched). The index's words follow the rows in the array.
    pub index_len: u32,
    /// [`RowIndex::shift`] of the table.
    pub index_shift: u8,
    pub _pad: u8,
    /// Which load of a table the rows at `row_offset` are (userspace counts
    /// loads, wrapping): the kernel's per-CPU cache of looked-up rows tags
    /// its entries with it, so rows of an evicted table never answer for
    /// the table loaded at the same place after it.
    pub table_serial: u16,
}

const _: () = assert!(size_of::<MappingEntry>() == 48);

impl MappingEntry {
    /// The shape of the table's row index.
    #[inline(always)]
    pub const fn row_index(&self) -> RowIndex {
        RowIndex {
            base: self.index_base,
            len: self.index_len,
            shift: self.index_shift as u32,
        }
    }

    /// Sets the table's rows, row index and load serial.
    pub const fn with_table(
        mut self,
        row_offset: u32,
        row_count: u32,
        index: RowIndex,
        table_serial: u16,
    ) -> Self {
        self.row_offset = row_offset;
        self.row_count = row_count;
        self.index_base = index.base;
        self.index_len = index.len;
        // The builder's shifts are at most ROW_INDEX_MAX_SHIFT.
        self.index_shift = index.shift as u8;
        self.table_serial = table_serial;
        self
    }
}

/// The shape of a table's coarse row index, which turns the search for a
/// pc's row from a binary search over the whole table (~20 probes, each a
/// likely cache and TLB miss in a multi-MiB array) into one read of two
/// adjacent index words and a search over the few neighbouring rows they
/// name.
///
/// The index has `len` u32 words; word `b` is the number of the row that
/// covers ELF address `base + (b << shift)` (the last row starting at or
/// before it). The row for an address in bucket `b` is therefore among rows
/// `word(b) ..= word(b + 1)`. `base` is the table's first row's pc. In the
/// kernel's row array the words follow the table's rows,
/// [`ROW_INDEX_WORDS_PER_ROW`] to a row slot ([`row_index_word`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowIndex {
    pub base: u64,
    /// Words in the index; 0 for no index.
    pub len: u32,
    /// log2 of the bytes of code one bucket covers.
    pub shift: u32,
}

/// Smallest bucket: 16 bytes of code, about one row.
pub const ROW_INDEX_MIN_SHIFT: u32 = 4;
/// Largest bucket the index builder picks: 16 MiB of code.
pub const ROW_INDEX_MAX_SHIFT: u32 = 24;
/// Row-index words stored in one [`UnwindRow`] slot of the row array.
pub const ROW_INDEX_WORDS_PER_ROW: u32 = 6;

/// Word `i % 6` of the 24 bytes of a row slot that holds row-index words,
/// little-endian as userspace packs them ([`UnwindRow::from_index_words`]).
#[inline(always)]
pub fn row_index_word(slot: &UnwindRow, i: u32) -> u32 {
    match i % ROW_INDEX_WORDS_PER_ROW {
        0 => slot.pc as u32,
        1 => (slot.pc >> 32) as u32,
        2 => slot.cfa_offset as u32,
        3 => u32::from(slot.fp_offset as u16) | (u32::from(slot.ra_offset as u16) << 16),
        4 => u32::from_le_bytes([slot.cfa_rule, slot.fp_rule, slot.ra_rule, slot.cfa_param]),
        _ => u32::from_le_bytes(slot._pad),
    }
}

impl UnwindRow {
    /// A row slot holding six row-index words (see [`row_index_word`]).
    pub const fn from_index_words(w: [u32; 6]) -> Self {
        let b4 = w[4].to_le_bytes();
        Self {
            pc: w[0] as u64 | ((w[1] as u64) << 32),
            cfa_offset: w[2] as i32,
            fp_offset: w[3] as u16 as i16,
            ra_offset: (w[3] >> 16) as u16 as i16,
            cfa_rule: b4[0],
            fp_rule: b4[1],
            ra_rule: b4[2],
            cfa_param: b4[3],
            _pad: w[5].to_le_bytes(),
        }
    }
}

impl RowIndex {
    /// The search over the rows that can hold the row for `vaddr` in a
    /// table of `row_count` rows, reading index words with `word_at`: the
    /// whole table without an index, an empty search for an address before
    /// the first row, `None` when a word cannot be read. Words are clamped
    /// to the table, so a bad index gives a wrong row at worst, never an
    /// access outside the table.
    #[inline(always)]
    pub fn rows_for(
        &self,
        row_count: u32,
        word_at: impl Fn(u32) -> Option<u32>,
        vaddr: u64,
    ) -> Option<SortedSearch> {
        if self.len == 0 {
            return Some(SortedSearch::new(row_count));
        }
        if vaddr < self.base {
            return Some(SortedSearch::new(0));
        }
        let bucket = (vaddr - self.base) >> (self.shift & 63);
        let last = u64::from(self.len - 1);
        let (lo, hi) = if bucket < last {
            let b = bucket as u32;
            (word_at(b)?, word_at(b + 1)?.saturating_add(1))
        } else {
            (word_at(last as u32)?, row_count)
        };
        // Row `word(b)` starts at or before `vaddr`, so the search starts
        // past it and may end on it without probing it.
        let hi = if hi > row_count { row_count } else { hi };
        let lo = lo.saturating_add(1);
        let lo = if lo > hi { hi } else { lo };
        Some(SortedSearch { lo, hi })
    }
}

/// The index of `rows_count` sorted rows' row for `vaddr` (see
/// [`find_row_index`]), narrowed first by the table's [`RowIndex`] whose
/// words `word_at` reads. The caller still checks the row for
/// [`CfaRule::NoInfo`].
#[inline(always)]
pub fn find_row_index_indexed(
    index: &RowIndex,
    row_count: u32,
    word_at: impl Fn(u32) -> Option<u32>,
    pc_at: impl Fn(u32) -> Option<u64>,
    vaddr: u64,
) -> Option<u32> {
    let mut search = index.rows_for(row_count, word_at, vaddr)?;
    for _ in 0..=MAX_TABLE_ROWS_LOG2 {
        let Some(mid) = search.probe() else {
            break;
        };
        search.narrow(mid, pc_at(mid)? <= vaddr);
    }
    search.found()
}

#[cfg(feature = "user")]
// SAFETY: `#[repr(C)]`, only integers, no implicit padding (checked above).
unsafe impl aya::Pod for MappingEntry {}

/// The value of the per-process mapping map (keyed by tgid): the first
/// `len` entries, sorted by `start`, not overlapping. Userspace replaces the
/// whole value at once, so the kernel never sees a half-written index.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessMappings {
    pub len: u32,
    /// Which write of the index this is (userspace counts writes, never 0):
    /// the kernel keeps the mappings a walk found for the next walk of the
    /// same process while this stays the same.
    pub generation: u32,
    pub entries: [MappingEntry; MAX_PROCESS_MAPPINGS],
}

const _: () = assert!(size_of::<ProcessMappings>() == 8 + 48 * MAX_PROCESS_MAPPINGS);

#[cfg(feature = "user")]
// SAFETY: `#[repr(C)]`, integers and an array of Pod structs, explicit padding.
unsafe impl aya::Pod for ProcessMappings {}

impl ProcessMappings {
    pub const EMPTY: Self = Self {
        len: 0,
        generation: 0,
        entries: [MappingEntry {
            start: 0,
            end: 0,
            bias: 0,
            index_base: 0,
            row_offset: 0,
            row_count: 0,
            index_len: 0,
            index_shift: 0,
            _pad: 0,
            table_serial: 0,
        }; MAX_PROCESS_MAPPINGS],
    };
}

/// The index of the entry holding `pc` among `len` sorted entries read with
/// `entry_at`; `None` when no entry holds it. Bounded like
/// [`find_row_index`].
#[inline(always)]
pub fn find_mapping(
    len: u32,
    entry_at: impl Fn(u32) -> Option<(u64, u64)>,
    pc: u64,
) -> Option<u32> {
    let len = if len as usize > MAX_PROCESS_MAPPINGS {
        MAX_PROCESS_MAPPINGS as u32
    } else {
        len
    };
    let mut search = SortedSearch::new(len);
    for _ in 0..=MAX_PROCESS_MAPPINGS_LOG2 {
        let Some(mid) = search.probe() else {
            break;
        };
        search.narrow(mid, entry_at(mid)?.0 <= pc);
    }
    let index = search.found()?;
    let (start, end) = entry_at(index)?;
    (start <= pc && pc < end).then_some(index)
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::collections::BTreeMap;
    use std::vec::Vec;

    use super::*;

    /// Sparse memory: u64 words at 8-aligned addresses, plus code bytes.
    #[derive(Default)]
    struct FakeMemory {
        words: BTreeMap<u64, u64>,
        code: BTreeMap<u64, u8>,
    }

    impl FakeMemory {
        fn word(mut self, addr: u64, value: u64) -> Self {
            self.words.insert(addr, value);
            self
        }
        fn code_at(mut self, addr: u64, bytes: &[u8]) -> Self {
            for (i, b) in bytes.iter().enumerate() {
                self.code.insert(addr + i as u64, *b);
            }
            self
        }
    }

    impl MemoryReader for FakeMemory {
        fn read_u64(&self, addr: u64) -> Option<u64> {
            if let Some(v) = self.words.get(&addr) {
                return Some(*v);
            }
            // Code: all 8 bytes must be known.
            let mut v = 0u64;
            for i in 0..8 {
                v |= (*self.code.get(&(addr + i))? as u64) << (8 * i);
            }
            Some(v)
        }
    }

    fn regs(pc: u64, sp: u64, fp: u64) -> UnwindRegs {
        UnwindRegs { pc, sp, fp, lr: 0 }
    }

    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<UnwindRow>(), 24);
        assert_eq!(core::mem::offset_of!(UnwindRow, cfa_offset), 8);
        assert_eq!(core::mem::offset_of!(UnwindRow, cfa_rule), 16);
        assert_eq!(UnwindError::ALL.len(), 12);
        for (i, e) in UnwindError::ALL.iter().enumerate() {
            assert_eq!(*e as u32, i as u32 + 1);
            assert_eq!(UnwindError::from_u32(*e as u32), Some(*e));
        }
        assert_eq!(UnwindError::from_u32(0), None);
        for v in 0..=255u8 {
            if let Some(r) = CfaRule::from_u8(v) {
                assert_eq!(r as u8, v);
            }
            if let Some(r) = FpRule::from_u8(v) {
                assert_eq!(r as u8, v);
            }
            if let Some(r) = RaRule::from_u8(v) {
                assert_eq!(r as u8, v);
            }
        }
    }

    fn table() -> Vec<UnwindRow> {
        std::vec![
            UnwindRow::new(0x1000, CfaRule::SpOffset, 8),
            UnwindRow::new(0x1004, CfaRule::SpOffset, 16),
            UnwindRow::no_info(0x1010),
            UnwindRow::new(0x1020, CfaRule::FpOffset, 16).with_fp_at(-16),
            UnwindRow::no_info(0x1040),
        ]
    }

    /// A leaf in a ReadyToRun epilog: at its `pop`s and `ret` the row (the
    /// body's rule) no longer holds; the code says where the return address
    /// is. Elsewhere the row applies.
    #[test]
    fn interrupted_epilogs_are_read_from_the_code() {
        // Body: CFA = sp + 24 (push rbp; push rbx; call...). Epilog at
        // 0x5010: add rsp, 0 (nothing here); pop rbx; pop rbp; ret.
        let row = UnwindRow::new(0x5000, CfaRule::SpOffset, 24)
            .with_fp_at(-16)
            .with_cfa_param(CFA_PARAM_EPILOG_BY_CODE);
        let mem = FakeMemory::default()
            .code_at(
                0x5010,
                &[0x5b, 0x5d, 0xc3, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc],
            )
            .code_at(0x5020, &[0x41, 0x5f, 0xc3, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc])
            .code_at(0x5030, &[0x48, 0x8b, 0xc3, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc])
            .word(0x7000, 0x1111) // rbx
            .word(0x7008, 0x7200) // rbp
            .word(0x7010, 0x6000); // return address
        let lookup = |pc: u64| Ok(Some(UnwindRow { pc, ..row }));
        let at = |pc: u64, sp: u64| {
            let mut r = regs(pc, sp, 0x7100);
            let mut interrupted = true;
            next_frame(&mut r, &mut interrupted, &mut { lookup }, &mem).map(|_| r)
        };
        // At `pop rbx`: two words, then the return address.
        assert_eq!(at(0x5010, 0x7000), Ok(regs(0x6000, 0x7018, 0x7200)));
        // At `pop rbp`.
        assert_eq!(at(0x5011, 0x7008), Ok(regs(0x6000, 0x7018, 0x7200)));
        // At `ret`: rbp already restored.
        assert_eq!(at(0x5012, 0x7010), Ok(regs(0x6000, 0x7018, 0x7100)));
        // `pop r15; ret` from 0x7008.
        assert_eq!(at(0x5020, 0x7008), Ok(regs(0x6000, 0x7018, 0x7100)));
        // Not an epilog (`mov rax, rbx`): the row, CFA = sp + 24.
        assert_eq!(at(0x5030, 0x7000), Ok(regs(0x6000, 0x7018, 0x7200)));
        // A return address (not interrupted) never reads code.
        let mut r = regs(0x5013, 0x7000, 0x7100);
        let mut interrupted = false;
        assert_eq!(
            next_frame(&mut r, &mut interrupted, &mut { lookup }, &mem),
            Ok(true)
        );
        assert_eq!(r, regs(0x6000, 0x7018, 0x7200));
    }

    /// The epilog scan the kernel runs one step per `bpf_loop` iteration:
    /// its longest epilog, pops with and without REX, and 8 bytes that run
    /// out before a `ret`.
    #[test]
    fn epilogs_decode_within_eight_steps() {
        let code = |bytes: [u8; 8]| u64::from_le_bytes(bytes);
        // Seven pops, rbp fourth, then ret: every step used.
        assert_eq!(
            decode_epilog(code([0x5b, 0x5e, 0x5f, 0x5d, 0x58, 0x59, 0x5a, 0xc3])),
            Some(Epilog {
                ra_slot: 56,
                rbp_slot: Some(24),
            })
        );
        // `pop r12; pop r13; pop rbp; ret` (41 5d is r13, not rbp).
        assert_eq!(
            decode_epilog(code([0x41, 0x5c, 0x41, 0x5d, 0x5d, 0xc3, 0xcc, 0xcc])),
            Some(Epilog {
                ra_slot: 24,
                rbp_slot: Some(16),
            })
        );
        assert_eq!(
            decode_epilog(code([0xc3, 0, 0, 0, 0, 0, 0, 0])),
            Some(Epilog {
                ra_slot: 0,
                rbp_slot: None,
            })
        );
        // Eight pops: no room left for the ret.
        assert_eq!(decode_epilog(code([0x5b; 8])), None);
        // A REX prefix in the last byte has no pop after it.
        assert_eq!(
            decode_epilog(code([0x5b, 0x5b, 0x5b, 0x5b, 0x5b, 0x5b, 0x5b, 0x41])),
            None
        );
        // `add rsp, 8; ret` is the row's to describe.
        assert_eq!(
            decode_epilog(code([0x48, 0x83, 0xc4, 0x08, 0xc3, 0, 0, 0])),
            None
        );
        // A scan stepped past its end stays where it stopped.
        let mut scan = EpilogScan::default();
        let c = code([0x5d, 0xc3, 0, 0, 0, 0, 0, 0]);
        while scan.step(c) {}
        let done = scan;
        assert!(!scan.step(c));
        assert_eq!(scan, done);
        assert_eq!(scan.state, EPILOG_FOUND);
    }

    /// A `FramePointer` row (a gap of a ReadyToRun table) walks exactly as
    /// no row does: frame records, and the leaf's `push rbp` check.
    #[test]
    fn frame_pointer_rows_walk_like_no_row() {
        // Leaf at `push rbp` (return address at sp), then a frame record.
        let mem = FakeMemory::default()
            .code_at(
                0x5000,
                &[
                    x86_64::OP_PUSH_RBP,
                    0x90,
                    0x90,
                    0x90,
                    0x90,
                    0x90,
                    0x90,
                    0x90,
                ],
            )
            .word(0x7000, 0x6010)
            .word(0x7100, 0)
            .word(0x7108, 0x6020);
        let start = regs(0x5000, 0x7000, 0x7100);
        let mut with_rows = [0u64; 8];
        let mut without = [0u64; 8];
        let a = walk(
            start,
            |pc| Ok(Some(UnwindRow::new(pc, CfaRule::FramePointer, 0))),
            &mem,
            &mut with_rows,
        );
        let b = walk(start, |_| Ok(None), &mem, &mut without);
        assert_eq!(a, b);
        assert_eq!(&with_rows[..a.0], &[0x5000, 0x6010, 0x6020]);
        assert_eq!(a.1, None);
        let mut r = start;
        let row = UnwindRow::new(0, CfaRule::FramePointer, 0);
        assert_eq!(step(&mut r, Some(&row), &mem), Ok(StepOutcome::Caller));
        assert_eq!(r, regs(0x6020, 0x7110, 0));
    }

    #[test]
    fn find_row_picks_the_last_row_at_or_before_pc() {
        let t = table();
        assert_eq!(find_row(&t, 0xfff), None);
        assert_eq!(find_row(&t, 0x1000).map(|r| r.cfa_offset), Some(8));
        assert_eq!(find_row(&t, 0x1003).map(|r| r.cfa_offset), Some(8));
        assert_eq!(find_row(&t, 0x1004).map(|r| r.cfa_offset), Some(16));
        assert_eq!(find_row(&t, 0x100f).map(|r| r.cfa_offset), Some(16));
        assert_eq!(find_row(&t, 0x1010), None, "gap between functions");
        assert_eq!(find_row(&t, 0x101f), None);
        assert_eq!(find_row(&t, 0x1030).map(|r| r.pc), Some(0x1020));
        assert_eq!(find_row(&t, 0x1040), None, "end of table");
        assert_eq!(find_row(&t, u64::MAX), None);
        assert_eq!(find_row(&[], 0x1000), None);
    }

    #[test]
    fn find_row_agrees_with_a_linear_scan() {
        let rows: Vec<UnwindRow> = (0..1000u64)
            .map(|i| {
                if i % 7 == 3 {
                    UnwindRow::no_info(i * 16)
                } else {
                    UnwindRow::new(i * 16, CfaRule::SpOffset, i as i32)
                }
            })
            .collect();
        for pc in (0..16 * 1000 + 40).step_by(5) {
            let linear = rows
                .iter()
                .rev()
                .find(|r| r.pc <= pc)
                .filter(|r| r.cfa_rule != CfaRule::NoInfo as u8);
            assert_eq!(find_row(&rows, pc), linear, "pc {pc:#x}");
        }
    }

    #[test]
    fn sp_rule_reads_the_return_address_below_the_cfa() {
        let mem = FakeMemory::default().word(0x7000 + 24 - 8, 0x4242);
        let row = UnwindRow::new(0x1000, CfaRule::SpOffset, 24);
        let mut r = regs(0x1008, 0x7000, 0xdead);
        assert_eq!(step(&mut r, Some(&row), &mem), Ok(StepOutcome::Caller));
        assert_eq!(r, regs(0x4242, 0x7018, 0xdead));
    }

    #[test]
    fn fp_rule_row_restores_fp_from_the_cfa() {
        // push rbp; mov rbp, rsp: CFA = rbp + 16, saved rbp at CFA - 16.
        let mem = FakeMemory::default()
            .word(0x7100, 0x7200) // saved rbp
            .word(0x7108, 0x5555); // return address
        let row = UnwindRow::new(0x1000, CfaRule::FpOffset, 16).with_fp_at(-16);
        let mut r = regs(0x1010, 0x70f0, 0x7100);
        assert_eq!(step(&mut r, Some(&row), &mem), Ok(StepOutcome::Caller));
        assert_eq!(r, regs(0x5555, 0x7110, 0x7200));
    }

    #[test]
    fn plt_rule_depends_on_the_offset_in_the_entry() {
        let mem = FakeMemory::default()
            .word(0x7000, 0x1111) // return address before the push
            .word(0x7008, 0x2222); // return address after the push
        let row = UnwindRow::new(0x3030, CfaRule::PltSp, 8).with_cfa_param(11);
        let mut before = regs(0x3036, 0x7000, 1);
        assert_eq!(step(&mut before, Some(&row), &mem), Ok(StepOutcome::Caller));
        assert_eq!(before, regs(0x1111, 0x7008, 1));
        let mut after = regs(0x303b, 0x7000, 1);
        assert_eq!(step(&mut after, Some(&row), &mem), Ok(StepOutcome::Caller));
        assert_eq!(after, regs(0x2222, 0x7010, 1));
    }

    #[test]
    fn signal_frame_reloads_the_interrupted_registers() {
        let uc = 0x7000;
        let mem = FakeMemory::default()
            .word(uc + x86_64::UCONTEXT_RIP, 0x9999)
            .word(uc + x86_64::UCONTEXT_RSP, 0x6000) // alternate stack: lower
            .word(uc + x86_64::UCONTEXT_RBP, 0x6100);
        let row = UnwindRow::new(0x3c04f, CfaRule::SignalFrame, 0);
        let mut r = regs(0x3c050, uc, 0);
        assert_eq!(step(&mut r, Some(&row), &mem), Ok(StepOutcome::Interrupted));
        assert_eq!(r, regs(0x9999, 0x6000, 0x6100));
    }

    #[test]
    fn frame_pointer_rule_without_row() {
        let mem = FakeMemory::default()
            .word(0x7100, 0x7300)
            .word(0x7108, 0x4444);
        let mut r = regs(0x1, 0x7000, 0x7100);
        assert_eq!(step(&mut r, None, &mem), Ok(StepOutcome::Caller));
        assert_eq!(r, regs(0x4444, 0x7110, 0x7300));
        let mut end = regs(0x1, 0x7000, 0);
        assert_eq!(step(&mut end, None, &mem), Ok(StepOutcome::EndOfStack));
        assert_eq!(end, regs(0x1, 0x7000, 0));
    }

    #[test]
    fn errors_leave_registers_alone() {
        let mem = FakeMemory::default().word(0x7100, 0).word(0x7108, 0);
        let cases: &[(UnwindRegs, Option<UnwindRow>, UnwindError)] = &[
            (
                regs(1, 0x7000, 0x6ff0),
                None,
                UnwindError::InvalidFramePointer,
            ),
            (
                regs(1, 0x7000, 0x7104),
                None,
                UnwindError::InvalidFramePointer,
            ),
            (regs(1, 0x7000, 0x7100), None, UnwindError::PcZero),
            (regs(1, 0x7000, 0x8000), None, UnwindError::BadRead),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow::new(0, CfaRule::SpOffset, 64)),
                UnwindError::BadRead,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow::new(0, CfaRule::SpOffset, 0)),
                UnwindError::StackNotAdvancing,
            ),
            (
                regs(1, 0x7000, 0x6000),
                Some(UnwindRow::new(0, CfaRule::FpOffset, 16)),
                UnwindError::StackNotAdvancing,
            ),
            (
                regs(1, u64::MAX - 4, 0),
                Some(UnwindRow::new(0, CfaRule::SpOffset, 16)),
                UnwindError::AddressOverflow,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow::new(0, CfaRule::Unsupported, 16)),
                UnwindError::UnsupportedCfa,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow::no_info(0)),
                UnwindError::NoTableRow,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow::new(0, CfaRule::SpOffset, 0x110).with_fp_rule(FpRule::Unsupported)),
                UnwindError::UnsupportedFpRule,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow::new(0, CfaRule::SpOffset, 0x110).with_ra(RaRule::Unsupported, 0)),
                UnwindError::UnsupportedRaRule,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow::new(0, CfaRule::SpOffset, 0x110)),
                UnwindError::PcZero,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow {
                    cfa_rule: 99,
                    ..UnwindRow::new(0, CfaRule::SpOffset, 8)
                }),
                UnwindError::InvalidRow,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow {
                    fp_rule: 99,
                    ..UnwindRow::new(0, CfaRule::SpOffset, 8)
                }),
                UnwindError::InvalidRow,
            ),
            (
                regs(1, 0x7000, 0),
                Some(UnwindRow::new(0, CfaRule::SignalFrame, 0)),
                UnwindError::BadRead,
            ),
        ];
        for (start, row, want) in cases {
            let mut r = *start;
            assert_eq!(step(&mut r, row.as_ref(), &mem), Err(*want), "{row:?}");
            assert_eq!(r, *start, "{row:?}");
        }
    }

    #[test]
    fn undefined_return_address_ends_the_stack() {
        let row = UnwindRow::new(0, CfaRule::SpOffset, 8).with_ra(RaRule::Undefined, 0);
        let mut r = regs(5, 0x7000, 0);
        assert_eq!(
            step(&mut r, Some(&row), &FakeMemory::default()),
            Ok(StepOutcome::EndOfStack)
        );
    }

    #[test]
    fn link_register_rule() {
        let row = UnwindRow::new(0, CfaRule::SpOffset, 0x10).with_ra(RaRule::LinkRegister, 0);
        let mut r = UnwindRegs {
            pc: 5,
            sp: 0x7000,
            fp: 0x7100,
            lr: 0x8888,
        };
        assert_eq!(
            step(&mut r, Some(&row), &FakeMemory::default()),
            Ok(StepOutcome::Caller)
        );
        assert_eq!(r, regs(0x8888, 0x7010, 0x7100));
    }

    #[test]
    fn leaf_prologue_and_epilogue_without_row() {
        let mem = FakeMemory::default()
            .code_at(
                0x2000,
                &[0x55, 0x48, 0x89, 0xe5, 0x90, 0x90, 0x90, 0x90, 0x90, 0xc3],
            )
            .code_at(0x200a, &[0x90; 8])
            .word(0x7000, 0xaaaa)
            .word(0x7008, 0xbbbb);
        // At `push rbp`: return address at sp.
        let mut r = regs(0x2000, 0x7000, 0x7500);
        assert_eq!(
            step_interrupted_without_row(&mut r, &mem),
            Ok(StepOutcome::Caller)
        );
        assert_eq!(r, regs(0xaaaa, 0x7008, 0x7500));
        // At `mov rbp, rsp`: saved rbp at sp, return address at sp + 8.
        let mut r = regs(0x2001, 0x7000, 0x7500);
        assert_eq!(
            step_interrupted_without_row(&mut r, &mem),
            Ok(StepOutcome::Caller)
        );
        assert_eq!(r, regs(0xbbbb, 0x7010, 0x7500));
        // At `ret`.
        let mut r = regs(0x2009, 0x7000, 0x7500);
        assert_eq!(
            step_interrupted_without_row(&mut r, &mem),
            Ok(StepOutcome::Caller)
        );
        assert_eq!(r, regs(0xaaaa, 0x7008, 0x7500));
        // In the body: the frame-pointer rule (fp 0 ends it here).
        let mut r = regs(0x2004, 0x7000, 0);
        assert_eq!(
            step_interrupted_without_row(&mut r, &mem),
            Ok(StepOutcome::EndOfStack)
        );
        // Code that cannot be read: the frame-pointer rule.
        let mut r = regs(0x9000, 0x7000, 0);
        assert_eq!(
            step_interrupted_without_row(&mut r, &mem),
            Ok(StepOutcome::EndOfStack)
        );
    }

    /// A native frame with a table (sp rule), a JIT frame (no row: fp rule),
    /// a signal frame, and an outermost frame.
    #[test]
    fn walk_mixes_rules_and_adjusts_lookups() {
        const LIBC: u64 = 0x10_0000;
        const TRAMPOLINE: u64 = 0x10_8000;
        const JIT: u64 = 0x50_0000;
        const START: u64 = 0x20_0000;
        let mem = FakeMemory::default()
            // Leaf in libc: CFA = sp + 16 -> return address at 0x7008 into JIT code.
            .word(0x7008, JIT + 0x40)
            // JIT frame record at fp 0x7100 -> returns to the trampoline.
            .word(0x7100, 0x7400)
            .word(0x7108, TRAMPOLINE)
            // ucontext at 0x7110 (the caller's sp after the JIT frame).
            .word(0x7110 + x86_64::UCONTEXT_RIP, START + 0x10)
            .word(0x7110 + x86_64::UCONTEXT_RSP, 0x7800)
            .word(0x7110 + x86_64::UCONTEXT_RBP, 0);
        let mut lookups = Vec::new();
        let lookup = |pc: u64| {
            lookups.push(pc);
            match pc {
                pc if (LIBC..LIBC + 0x100).contains(&pc) => {
                    Ok(Some(UnwindRow::new(LIBC, CfaRule::SpOffset, 16)))
                }
                pc if (TRAMPOLINE - 1..TRAMPOLINE + 0x10).contains(&pc) => Ok(Some(
                    UnwindRow::new(TRAMPOLINE - 1, CfaRule::SignalFrame, 0),
                )),
                pc if (JIT..JIT + 0x1000).contains(&pc) => Ok(None),
                pc if (START..START + 0x100).contains(&pc) => Ok(Some(
                    UnwindRow::new(START, CfaRule::SpOffset, 8).with_ra(RaRule::Undefined, 0),
                )),
                _ => Err(UnwindError::NoMapping),
            }
        };
        let mut out = [0u64; 16];
        let (n, err) = walk(regs(LIBC + 0x20, 0x7000, 0x7100), lookup, &mem, &mut out);
        assert_eq!(err, None);
        assert_eq!(
            &out[..n],
            &[LIBC + 0x20, JIT + 0x40, TRAMPOLINE, START + 0x10]
        );
        // Leaf and interrupted pcs as is, return addresses minus one.
        assert_eq!(
            lookups,
            [LIBC + 0x20, JIT + 0x3f, TRAMPOLINE - 1, START + 0x10]
        );
    }

    #[test]
    fn find_mapping_finds_the_holding_entry_only() {
        let entries = [(0x1000u64, 0x2000u64), (0x2000, 0x3000), (0x5000, 0x6000)];
        let at = |i: u32| entries.get(i as usize).copied();
        assert_eq!(find_mapping(3, at, 0xfff), None);
        assert_eq!(find_mapping(3, at, 0x1000), Some(0));
        assert_eq!(find_mapping(3, at, 0x1fff), Some(0));
        assert_eq!(find_mapping(3, at, 0x2000), Some(1));
        assert_eq!(find_mapping(3, at, 0x3000), None, "gap");
        assert_eq!(find_mapping(3, at, 0x5fff), Some(2));
        assert_eq!(find_mapping(3, at, 0x6000), None);
        assert_eq!(find_mapping(0, at, 0x1000), None);
        // A length beyond what the reader holds: the failed read gives None.
        assert_eq!(find_mapping(9, at, 0x5800), None);
        // A hostile length is clamped to the bound.
        let many: Vec<(u64, u64)> = (0..MAX_PROCESS_MAPPINGS as u64)
            .map(|i| (i * 0x1000, i * 0x1000 + 0x800))
            .collect();
        let at = |i: u32| many.get(i as usize).copied();
        assert_eq!(find_mapping(u32::MAX, at, 0x1f_f400), Some(0x1ff));
        assert_eq!(find_mapping(u32::MAX, at, 0x1f_f900), None);
    }

    #[test]
    fn index_words_round_trip_through_a_row_slot() {
        let words = [0, 1, 0xdead_beef, 0xffff_fffe, 0x8000_0001, u32::MAX];
        let slot = UnwindRow::from_index_words(words);
        for (i, w) in words.iter().enumerate() {
            assert_eq!(row_index_word(&slot, i as u32), *w);
            assert_eq!(
                row_index_word(&slot, i as u32 + 6),
                *w,
                "word {i} of the next slot"
            );
        }
    }

    /// Rows every 16 bytes from 0x1000, a gap, then a NoInfo terminator;
    /// an index over 64-byte buckets as the builder makes it.
    fn indexed_table() -> (Vec<UnwindRow>, RowIndex, Vec<u32>) {
        let mut rows: Vec<UnwindRow> = (0..40u64)
            .map(|i| UnwindRow::new(0x1000 + i * 16, CfaRule::SpOffset, i as i32 + 8))
            .collect();
        rows.push(UnwindRow::new(0x1400, CfaRule::SpOffset, 99));
        rows.push(UnwindRow::no_info(0x1500));
        let index = RowIndex {
            base: 0x1000,
            len: ((0x1500 - 0x1000) >> 6) + 1,
            shift: 6,
        };
        let words = (0..index.len)
            .map(|b| {
                let start = 0x1000 + (u64::from(b) << 6);
                rows.iter()
                    .rposition(|r| r.pc <= start)
                    .expect("base is row 0") as u32
            })
            .collect();
        (rows, index, words)
    }

    #[test]
    fn indexed_search_agrees_with_a_linear_scan() {
        let (rows, index, words) = indexed_table();
        let word_at = |w: u32| words.get(w as usize).copied();
        let pc_at = |i: u32| rows.get(i as usize).map(|r| r.pc);
        for vaddr in (0xf00..0x1600).chain([0, u64::MAX]) {
            let linear = rows.iter().rposition(|r| r.pc <= vaddr).map(|i| i as u32);
            let found = find_row_index_indexed(&index, rows.len() as u32, word_at, pc_at, vaddr);
            assert_eq!(found, linear, "vaddr {vaddr:#x}");
        }
        // No index: the whole table.
        let none = RowIndex::default();
        assert_eq!(
            find_row_index_indexed(&none, rows.len() as u32, word_at, pc_at, 0x1405),
            Some(40)
        );
    }

    #[test]
    fn indexed_search_narrows_to_the_bucket() {
        let (rows, index, words) = indexed_table();
        let word_at = |w: u32| words.get(w as usize).copied();
        let n = rows.len() as u32;
        // 0x1050 is in bucket 1 (0x1040..0x1080): rows 4..=8.
        assert_eq!(
            index.rows_for(n, word_at, 0x1050),
            Some(SortedSearch { lo: 5, hi: 9 })
        );
        // Before the first row: nothing to search.
        assert_eq!(
            index.rows_for(n, word_at, 0xfff).and_then(|s| s.found()),
            None
        );
        // The last bucket reaches the end of the table.
        assert_eq!(
            index.rows_for(n, word_at, 0x9999),
            Some(SortedSearch { lo: n, hi: n })
        );
        // A word that cannot be read.
        assert_eq!(index.rows_for(n, |_| None, 0x1050), None);
    }

    #[test]
    fn hostile_index_words_stay_inside_the_table() {
        let index = RowIndex {
            base: 0x1000,
            len: 4,
            shift: 99,
        };
        for words in [[u32::MAX; 4], [7, 2, 0, 1], [0; 4]] {
            let word_at = |w: u32| words.get(w as usize).copied();
            for vaddr in [0x1000, 0x1001, u64::MAX] {
                let s = index.rows_for(5, word_at, vaddr).expect("words readable");
                assert!(s.lo <= s.hi && s.hi <= 5, "{s:?}");
                assert!(s.found().is_none_or(|i| i < 5));
            }
        }
    }

    #[test]
    fn frame_records_are_read_as_pairs() {
        /// Counts reads: a pair must cost one.
        #[derive(Default)]
        struct Counting(FakeMemory, core::cell::Cell<u32>);
        impl MemoryReader for Counting {
            fn read_u64(&self, addr: u64) -> Option<u64> {
                self.1.set(self.1.get() + 1);
                self.0.read_u64(addr)
            }
            fn read_u64_pair(&self, addr: u64) -> Option<(u64, u64)> {
                self.1.set(self.1.get() + 1);
                Some((self.0.read_u64(addr)?, self.0.read_u64(addr + 8)?))
            }
        }
        let mem = Counting(
            FakeMemory::default()
                .word(0x7100, 0x7200)
                .word(0x7108, 0x5555),
            Default::default(),
        );
        let row = UnwindRow::new(0x1000, CfaRule::FpOffset, 16).with_fp_at(-16);
        let mut r = regs(0x1010, 0x70f0, 0x7100);
        assert_eq!(step(&mut r, Some(&row), &mem), Ok(StepOutcome::Caller));
        assert_eq!(r, regs(0x5555, 0x7110, 0x7200));
        assert_eq!(mem.1.get(), 1);
        let mut r = regs(0x1, 0x70f0, 0x7100);
        assert_eq!(step(&mut r, None, &mem), Ok(StepOutcome::Caller));
        assert_eq!(r, regs(0x5555, 0x7110, 0x7200));
        assert_eq!(mem.1.get(), 2);
        // fp saved elsewhere than next to the return address: two reads.
        let row = UnwindRow::new(0x1000, CfaRule::FpOffset, 16).with_fp_at(-24);
        let mem = Counting(
            FakeMemory::default()
                .word(0x70f8, 0x7300)
                .word(0x7108, 0x6666),
            Default::default(),
        );
        let mut r = regs(0x1010, 0x70f0, 0x7100);
        assert_eq!(step(&mut r, Some(&row), &mem), Ok(StepOutcome::Caller));
        assert_eq!(r, regs(0x6666, 0x7110, 0x7300));
        assert_eq!(mem.1.get(), 2);
    }

    #[test]
    fn find_row_index_is_bounded() {
        // A reader that claims 2^32-1 rows: the search gives up instead of
        // returning an index it did not bound.
        assert_eq!(find_row_index(u32::MAX, |i| Some(u64::from(i)), 5), None);
        assert_eq!(find_row_index(3, |i| Some(u64::from(i) * 10), 25), Some(2));
        assert_eq!(find_row_index(3, |_| None, 25), None);
        assert_eq!(find_row_index(3, |i| Some(u64::from(i) * 10 + 1), 0), None);
    }

    #[test]
    fn walk_is_bounded_by_the_output() {
        // A frame-pointer chain that loops upwards forever (each frame record
        // points 16 bytes higher): only the output length stops it.
        struct Ramp;
        impl MemoryReader for Ramp {
            fn read_u64(&self, addr: u64) -> Option<u64> {
                if addr.is_multiple_of(16) {
                    Some(addr + 16)
                } else {
                    Some(0x1234)
                }
            }
        }
        let mut out = [0u64; 128];
        let (n, err) = walk(regs(0x1234, 0x7000, 0x7000), |_| Ok(None), &Ramp, &mut out);
        assert_eq!((n, err), (128, Some(UnwindError::TooDeep)));
        let (n, err) = walk(regs(0x1234, 0x7000, 0x7000), |_| Ok(None), &Ramp, &mut []);
        assert_eq!((n, err), (0, Some(UnwindError::TooDeep)));
    }

    #[test]
    fn walk_keeps_frames_found_before_an_error() {
        let mem = FakeMemory::default().word(0x7008, 0x9999);
        let mut out = [0u64; 8];
        let lookup = |pc: u64| {
            if pc < 0x2000 {
                Ok(Some(UnwindRow::new(0, CfaRule::SpOffset, 16)))
            } else {
                Err(UnwindError::NoMapping)
            }
        };
        let (n, err) = walk(regs(0x1000, 0x7000, 0), lookup, &mem, &mut out);
        assert_eq!((n, err), (2, Some(UnwindError::NoMapping)));
        assert_eq!(&out[..2], &[0x1000, 0x9999]);
        // A zero pc to start with is an error, with no frame.
        let (n, err) = walk(regs(0, 0x7000, 0), lookup, &mem, &mut out);
        assert_eq!((n, err), (0, Some(UnwindError::PcZero)));
    }
}
