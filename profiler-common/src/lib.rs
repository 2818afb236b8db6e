//! The contract between clrbpf's eBPF programs and its userspace: the raw
//! sample record the kernel side writes into the ring buffer, the counters it
//! keeps, and the load-time settings. Everything here is `#[repr(C)]`, laid out
//! largest field first with explicit padding, and its size is checked at
//! compile time so both sides agree byte for byte.
#![no_std]

pub mod offcpu;
pub mod unwind;

/// Most frames one stack (kernel or user) holds in a [`RawSampleEvent`].
/// 127 is the kernel's default `perf_event_max_stack`, so `bpf_get_stack`
/// never returns more.
pub const MAX_STACK_DEPTH: usize = 127;

/// Most frames a user stack holds in a [`RawSampleEvent`]. The kernel-side
/// unwinder walks up to this many; `bpf_get_stack` (the frame-pointer
/// fallback) never returns more than [`MAX_STACK_DEPTH`].
pub const MAX_USER_STACK_DEPTH: usize = 128;

/// Length of a task's `comm`, as the kernel's `TASK_COMM_LEN`.
pub const TASK_COMM_LEN: usize = 16;

/// What one raw sample measures. The numbers cross the kernel/user boundary:
/// never renumber, only add.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleKind {
    /// A `cpu-clock` (or `cycles`) tick while the thread ran; the value is
    /// the sampling period in nanoseconds.
    OnCpu = 1,
    /// A thread left the CPU in a blocking state; the value is how long it
    /// stayed off (nanoseconds).
    OffCpu = 2,
    /// The thread that woke a blocked one, with its stacks, written just
    /// before the [`Self::OffCpu`] record of the wait it ended; its
    /// `waker_tid` is the thread it woke. The value is unused.
    Waker = 3,
}

impl SampleKind {
    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::OnCpu),
            2 => Some(Self::OffCpu),
            3 => Some(Self::Waker),
            _ => None,
        }
    }
}

/// Bits of [`RawSampleEvent::flags`].
pub mod sample_flags {
    /// The kernel stack did not fit in [`super::MAX_STACK_DEPTH`] frames.
    pub const KERNEL_STACK_TRUNCATED: u32 = 1 << 0;
    /// The user stack did not fit in [`super::MAX_STACK_DEPTH`] frames.
    pub const USER_STACK_TRUNCATED: u32 = 1 << 1;
    /// `bpf_get_stack` failed for the kernel stack.
    pub const KERNEL_STACK_ERROR: u32 = 1 << 2;
    /// `bpf_get_stack` failed for the user stack.
    pub const USER_STACK_ERROR: u32 = 1 << 3;
    /// The user stack was walked with the unwind tables (`.eh_frame` rows
    /// and the frame-pointer rule), not by `bpf_get_stack`.
    pub const USER_STACK_UNWOUND: u32 = 1 << 4;
    /// The walk met a pc in none of the process's indexed mappings (code
    /// mapped after userspace last read its maps: a new JIT code heap, a
    /// `dlopen`) and stepped it by the frame-pointer rule; userspace should
    /// read the process's maps again.
    pub const USER_PC_UNINDEXED: u32 = 1 << 5;
    /// An off-CPU record whose stacks were not taken (the stack rate
    /// limit): a wait at least `--off-cpu-min` long, kept without stacks.
    pub const OFF_CPU_NO_STACK: u32 = 1 << 6;
    /// Kernel side only: the thread's last wait was at least
    /// `--off-cpu-min` long, so its next one takes its stack whatever the
    /// rate limit (idle threads wait long and rarely).
    pub const OFF_CPU_LAST_WAIT_LONG: u32 = 1 << 7;
    /// The process had no unwind index yet: the record is a
    /// [`super::StackCopyEvent`], whose copy of the user stack userspace
    /// unwinds once the process's tables exist. The sample's own user
    /// stack is the frame-pointer walk, kept for when they never do.
    pub const USER_STACK_COPIED: u32 = 1 << 8;
}

/// One sample, as the eBPF side writes it into the `SAMPLES` ring buffer.
/// Stacks are leaf first; only the first `*_stack_len` entries are valid.
/// The fixed header comes first and the stacks last.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawSampleEvent {
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC, the clock of jitdump records.
    /// For an off-CPU sample, the time the thread blocked.
    pub time_ns: u64,
    /// Depends on `kind`: the period for on-CPU; for off-CPU the interval
    /// weighted by the sampling rule ([`offcpu::keep_interval`]).
    pub value: u64,
    /// Off-CPU: the interval as measured, before weighting. 0 for on-CPU.
    pub interval_ns: u64,
    /// Off-CPU: the system call the thread blocked in (`orig_ax` of its
    /// saved user registers), -1 when it blocked outside one (a page fault).
    pub syscall: i64,
    /// Process id (tgid) in the initial PID namespace.
    pub pid: u32,
    /// Thread id in the initial PID namespace.
    pub tid: u32,
    pub cpu: u32,
    /// A [`SampleKind`] number.
    pub kind: u32,
    pub kernel_stack_len: u32,
    pub user_stack_len: u32,
    /// [`sample_flags`] bits.
    pub flags: u32,
    /// Why the user-stack walk ended early: an
    /// [`unwind::UnwindError`] number, 0 for a clean end.
    pub user_unwind_error: u32,
    /// Off-CPU: [`offcpu::wake_flags`] bits.
    pub wake_flags: u32,
    /// Off-CPU: the thread running when this one was woken (0 when no
    /// wakeup was recorded), and its process. In a [`SampleKind::Waker`]
    /// record, `waker_tid` is the thread that was woken.
    pub waker_tid: u32,
    pub waker_pid: u32,
    /// Off-CPU: the random draw of [`offcpu::keep_interval`], made at the
    /// first wakeup (see [`offcpu::wake_flags::DRAWN`]).
    pub keep_draw: u32,
    /// Off-CPU: the probability (of `u32::MAX`) with which this wait's
    /// stack was taken under the stack rate limit; userspace divides the
    /// value by it. `u32::MAX`: always.
    pub stack_p: u32,
    pub _pad: u32,
    /// The thread's name (`comm`), NUL-padded.
    pub comm: [u8; TASK_COMM_LEN],
    pub kernel_stack: [u64; MAX_STACK_DEPTH],
    pub user_stack: [u64; MAX_USER_STACK_DEPTH],
}

const _: () = assert!(
    size_of::<RawSampleEvent>()
        == 32 + 4 * 14 + TASK_COMM_LEN + 8 * MAX_STACK_DEPTH + 8 * MAX_USER_STACK_DEPTH
);

#[cfg(feature = "user")]
// SAFETY: `#[repr(C)]`, only integers and arrays of integers, no implicit padding.
unsafe impl aya::Pod for RawSampleEvent {}

/// Most bytes of user stack a [`StackCopyEvent`] holds: from the sampled
/// sp up, as perf's `--call-graph dwarf` copies (8 KiB there by default).
/// 16 KiB hold a .NET thread's frames from a native leaf up to its managed
/// entry point in the cases measured; a deeper stack ends where the copy
/// does.
pub const STACK_COPY_BYTES: usize = 16 * 1024;

/// What the kernel adds to a [`RawSampleEvent`] when it copies the user
/// stack of a process without unwind tables ([`StackCopyEvent`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackCopyHeader {
    /// The user registers of the sample: the walk starts from them.
    pub regs: unwind::UnwindRegs,
    /// The 8 code bytes at `regs.pc` (the leaf's peek at `push rbp`, `ret`
    /// or an epilog needs them), valid when `code_len` is 8.
    pub code: u64,
    /// Bytes of stack copied from `regs.sp` (at most [`STACK_COPY_BYTES`]):
    /// the copy stops at the first page that cannot be read.
    pub stack_len: u32,
    pub code_len: u32,
}

const _: () = assert!(size_of::<StackCopyHeader>() == 48);

/// A sample with a copy of its user stack, as the on-CPU program writes it
/// into the `SAMPLES` ring buffer for a process userspace has not indexed
/// yet (within a byte budget per second). Only the first
/// [`STACK_COPY_RECORD_HEADER`] + `header.stack_len` bytes are written:
/// userspace tells the record by a length above a [`RawSampleEvent`]'s.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct StackCopyEvent {
    pub sample: RawSampleEvent,
    pub header: StackCopyHeader,
    /// [`STACK_COPY_BYTES`] and one page of slack: the copy goes a page at
    /// a time, and the verifier must see every page's write in bounds.
    pub stack: [u8; STACK_COPY_BYTES + 4096],
}

/// Bytes of a [`StackCopyEvent`] before its stack.
pub const STACK_COPY_RECORD_HEADER: usize =
    size_of::<RawSampleEvent>() + size_of::<StackCopyHeader>();

const _: () =
    assert!(size_of::<StackCopyEvent>() == STACK_COPY_RECORD_HEADER + STACK_COPY_BYTES + 4096);
// A per-CPU map value is at most 32 KiB.
const _: () = assert!(size_of::<StackCopyEvent>() <= 32 * 1024);

/// The byte budget of stack copies on one CPU, in the kernel's
/// `STACK_COPY_BUDGET` map: `used` bytes written since `window_start_ns`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct StackCopyBudget {
    pub window_start_ns: u64,
    pub used: u64,
}

/// What a [`ProcessEventRecord`] reports. Numbered apart from
/// [`SampleKind`] so one number names any ring-buffer record: never
/// renumber, only add.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessEventKind {
    /// The whole process ended: its last thread exited (or, on kernels
    /// whose `sched_process_exit` has no `group_dead` field, its
    /// thread-group leader did).
    Exit = 16,
    /// The process replaced its image (`execve`): every mapping changed.
    Exec = 17,
    /// The process asked for executable memory (`mmap` or `mprotect` with
    /// `PROT_EXEC`): a library, an image or a code heap is being mapped,
    /// and its unwind index is due for a rescan. At most one per process
    /// per [`CODE_MAPPED_EVERY_NS`].
    CodeMapped = 18,
}

/// The kernel side reports a process's [`ProcessEventKind::CodeMapped`] at
/// most this often; userspace rescans it at least this long after an
/// event, so that the mappings of the whole interval are seen.
pub const CODE_MAPPED_EVERY_NS: u64 = 10_000_000;

impl ProcessEventKind {
    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            16 => Some(Self::Exit),
            17 => Some(Self::Exec),
            18 => Some(Self::CodeMapped),
            _ => None,
        }
    }
}

/// A process lifecycle event, as the eBPF side writes it into the
/// `SAMPLES` ring buffer among the samples. Userspace tells it from a
/// [`RawSampleEvent`] by its length. Kept small: whole-host mode writes
/// one per process exit on the host.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessEventRecord {
    /// `bpf_ktime_get_ns()`, the clock of [`RawSampleEvent::time_ns`].
    pub time_ns: u64,
    /// Process id (tgid) in the initial PID namespace.
    pub pid: u32,
    /// A [`ProcessEventKind`] number.
    pub kind: u32,
}

const _: () = assert!(size_of::<ProcessEventRecord>() == 16);
const _: () = assert!(size_of::<ProcessEventRecord>() != size_of::<RawSampleEvent>());

#[cfg(feature = "user")]
// SAFETY: `#[repr(C)]`, only integers, no implicit padding.
unsafe impl aya::Pod for ProcessEventRecord {}

/// Indices of the per-CPU `COUNTERS` array. Stable numbers: never renumber.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Samples written to the ring buffer.
    SamplesSubmitted = 0,
    /// Samples dropped because the ring buffer was full.
    SamplesLost = 1,
    /// Ticks that landed in the idle task.
    IdleTicks = 2,
    /// Ticks of threads outside the profiled set.
    Filtered = 3,
    /// `bpf_get_stack` failed for the kernel stack.
    KernelStackErrors = 4,
    /// `bpf_get_stack` failed for the user stack.
    UserStackErrors = 5,
    /// Processes added to the profiled set because a profiled process forked.
    ForksFollowed = 6,
    /// User stacks walked with the unwind tables.
    UserStacksUnwound = 7,
    /// Samples of a process with no mapping index yet (userspace has not
    /// seen it): their user stack came from `bpf_get_stack`.
    UnwindProcessUnknown = 8,
    /// The user registers could not be read (a kernel thread, a failed read).
    UserRegsUnavailable = 9,
    /// Blocking switches of profiled threads whose stack was taken.
    OffCpuBlocked = 10,
    /// Off-CPU intervals measured at switch-in.
    OffCpuIntervals = 11,
    /// Off-CPU intervals kept (written to the ring buffer).
    OffCpuKept = 12,
    /// Blocking switches not tracked because the pending-stack map was full.
    OffCpuPendingFull = 13,
    /// Wakeups of a blocked profiled thread whose waker was recorded.
    OffCpuWakers = 14,
    /// Blocking switches whose stacks were not taken (stack rate limit).
    OffCpuStacksSkipped = 15,
    /// Process exits written to the ring buffer ([`ProcessEventKind::Exit`]).
    ProcessExits = 16,
    /// Process execs written to the ring buffer ([`ProcessEventKind::Exec`]).
    ProcessExecs = 17,
    /// Process events dropped because the ring buffer was full.
    ProcessEventsLost = 18,
    /// Waker stacks of a process with no mapping index (outside the
    /// profiled set, or not indexed yet): walked by frame pointers.
    WakerProcessUnknown = 19,
    /// On-CPU samples of a process without unwind tables whose user stack
    /// was copied ([`StackCopyEvent`]).
    StackCopies = 20,
    /// Bytes of those records written to the ring buffer.
    StackCopyBytes = 21,
    /// Samples of a process without unwind tables whose stack was not
    /// copied: the byte budget of the second was spent (frame pointers).
    StackCopiesOverBudget = 22,
}

/// Slots of the `UNWIND_ERRORS` map: one per `UnwindError` number.
pub const UNWIND_ERROR_SLOTS: u32 = 32;

/// Number of slots in the `COUNTERS` map.
pub const COUNTER_SLOTS: u32 = 23;

/// Names of the eBPF programs, maps and globals, shared so a rename breaks the
/// build instead of the load.
pub mod names {
    pub const PROG_ON_CPU_SAMPLE: &str = "on_cpu_sample";
    pub const PROG_FOLLOW_FORK: &str = "follow_fork";
    pub const PROG_FORGET_EXIT: &str = "forget_exit";
    /// `sched:sched_process_exec`: a [`super::ProcessEventKind::Exec`] record.
    pub const PROG_PROCESS_EXEC: &str = "process_exec";
    pub const PROG_CODE_MAPPED: &str = "code_mapped";
    /// `u32`: offset of `group_dead` in `sched_process_exit`'s record, 0
    /// when the kernel's tracepoint has none (the leader's exit then
    /// stands for the process's).
    pub const GLOBAL_EXIT_GROUP_DEAD_OFFSET: &str = "EXIT_GROUP_DEAD_OFFSET";
    /// `sched:sched_switch`: off-CPU stacks and intervals.
    pub const PROG_OFF_CPU_SWITCH: &str = "off_cpu_switch";
    /// `sched:sched_waking`: the waker of a blocked profiled thread.
    pub const PROG_OFF_CPU_WAKING: &str = "off_cpu_waking";
    /// `HashMap<u32 tid, RawSampleEvent>`: threads blocked now, with the
    /// stack they blocked in.
    pub const MAP_OFF_CPU_PENDING: &str = "OFF_CPU_PENDING";
    /// `HashMap<u32 tid, OffCpuThreadTotals>`: exact per-thread totals.
    pub const MAP_OFF_CPU_TOTALS: &str = "OFF_CPU_TOTALS";
    /// `HashMap<u32 woken tid, RawSampleEvent>`: wakers of kept waits.
    pub const MAP_WAKER_PENDING: &str = "WAKER_PENDING";
    /// `u32`: 1 = off-CPU programs record, 0 = they return at once.
    pub const GLOBAL_OFF_CPU: &str = "OFF_CPU";
    /// `u64`: intervals at least this long are always kept.
    pub const GLOBAL_OFF_CPU_MIN_NS: &str = "OFF_CPU_MIN_NS";
    /// `u64`: most off-CPU stacks taken per CPU per rate window.
    pub const GLOBAL_OFF_CPU_STACKS_PER_WINDOW: &str = "OFF_CPU_STACKS_PER_WINDOW";
    pub const MAP_SAMPLES: &str = "SAMPLES";
    pub const MAP_TARGET_PIDS: &str = "TARGET_PIDS";
    pub const MAP_COUNTERS: &str = "COUNTERS";
    /// `Array<UnwindRow>`, mmap-able: every loaded table's rows.
    pub const MAP_UNWIND_ROW_CHUNKS: &str = "UNWIND_ROW_CHUNKS";
    /// `HashMap<u32 tgid, ProcessMappings>`.
    pub const MAP_PROCESS_MAPPINGS: &str = "PROCESS_MAPPINGS";
    /// `PerCpuArray<u64>` indexed by `UnwindError` number.
    pub const MAP_UNWIND_ERRORS: &str = "UNWIND_ERRORS";
    /// `u32`: 1 = walk user stacks with the unwind tables, 0 = only
    /// `bpf_get_stack` (frame pointers).
    pub const GLOBAL_USER_UNWIND: &str = "USER_UNWIND";
    /// `u32`: 0 = every process, 1 = only the tgids in `TARGET_PIDS`.
    pub const GLOBAL_FILTER_PIDS: &str = "FILTER_PIDS";
    /// `u32`: clrbpf's own tgid, never sampled.
    pub const GLOBAL_SELF_TGID: &str = "SELF_TGID";
    /// `u64`: the on-CPU sampling period in nanoseconds, stored as the value.
    pub const GLOBAL_ON_CPU_PERIOD_NS: &str = "ON_CPU_PERIOD_NS";
    /// `u64`: bytes of stack copies each CPU may write per second; 0: no
    /// copies (frame pointers until a process is indexed).
    pub const GLOBAL_STACK_COPY_BYTES_PER_CPU: &str = "STACK_COPY_BYTES_PER_CPU";
    /// `u32`: 1 = copy every on-CPU sample's user stack instead of walking
    /// it (the bench's measure of a copy against the walk).
    pub const GLOBAL_STACK_COPY_ALWAYS: &str = "STACK_COPY_ALWAYS";
}
