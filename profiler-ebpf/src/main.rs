//! clrbpf's kernel side. `on_cpu_sample` runs on every `cpu-clock` tick of
//! every online CPU and writes one [`RawSampleEvent`] (thread, time, kernel
//! and user stacks) into the `SAMPLES` ring buffer; userspace does the rest.
//! `off_cpu_switch` and `off_cpu_waking` ([`offcpu`]) measure where profiled
//! threads block and who wakes them.
//! `follow_fork` and `forget_exit` keep the set of profiled processes in step
//! with the process tree when clrbpf profiles a command and its children;
//! `forget_exit` and `process_exec` also tell userspace, through the same
//! ring buffer and so in order with the samples, when a profiled process
//! ends or execs ([`ProcessEventRecord`]), so it can let go of what the
//! process held.
//!
//! With `USER_UNWIND` set, user stacks of indexed processes are walked with
//! the unwind tables ([`unwind`]); otherwise `bpf_get_stack` follows frame
//! pointers. Kept bounded: every loop has a constant bound, no string work.
#![no_std]
#![no_main]

use aya_ebpf::{
    Global,
    bindings::BPF_F_NO_PREALLOC,
    helpers::bpf_get_current_pid_tgid,
    macros::{map, perf_event, tracepoint},
    maps::{HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{PerfEventContext, TracePointContext},
};
use clrbpf_common::{
    CODE_MAPPED_EVERY_NS, COUNTER_SLOTS, Counter, ProcessEventKind, ProcessEventRecord,
    RawSampleEvent, SampleKind,
};

mod offcpu;
mod stack_copy;
mod stacks;
mod unwind;

/// 0: profile every process; 1: only the tgids in `TARGET_PIDS`.
#[unsafe(no_mangle)]
static FILTER_PIDS: Global<u32> = Global::new(0);
/// clrbpf's own tgid: its samples would only describe the profiler.
#[unsafe(no_mangle)]
static SELF_TGID: Global<u32> = Global::new(0);
/// Nanoseconds one on-CPU sample stands for (1e9 / frequency).
#[unsafe(no_mangle)]
static ON_CPU_PERIOD_NS: Global<u64> = Global::new(10_101_010);
/// 1: walk user stacks with the unwind tables for processes userspace has
/// indexed; 0: frame pointers only (`bpf_get_stack`).
#[unsafe(no_mangle)]
static USER_UNWIND: Global<u32> = Global::new(0);
/// Bytes of user-stack copies each CPU may write per second for processes
/// without unwind tables ([`stack_copy`]); 0: none.
#[unsafe(no_mangle)]
static STACK_COPY_BYTES_PER_CPU: Global<u64> = Global::new(0);
/// 1: copy the user stack of every sample, indexed process or not, and
/// leave the walk to userspace: `cargo xtask bench` measures what a copy
/// costs against the walk. Set at load time, so the verifier drops the
/// branch from the program when it is 0.
#[unsafe(no_mangle)]
static STACK_COPY_ALWAYS: Global<u32> = Global::new(0);
/// Offset of `group_dead` in `sched_process_exit`'s record (read by
/// userspace from the tracepoint's format file); 0: the kernel has none.
#[unsafe(no_mangle)]
static EXIT_GROUP_DEAD_OFFSET: Global<u32> = Global::new(0);

/// Raw samples for userspace. The size is set at load time.
#[map]
static SAMPLES: RingBuf = RingBuf::with_byte_size(8 * 1024 * 1024, 0);

/// The profiled processes (tgid -> 1) when `FILTER_PIDS` is 1. Not
/// preallocated: a whole-host recording never uses it, and preallocating
/// 65,536 elements was a few ms of every run's start.
#[map]
static TARGET_PIDS: HashMap<u32, u8> = HashMap::with_max_entries(65_536, BPF_F_NO_PREALLOC);

/// Event counters, indexed by [`Counter`].
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

const CLONE_THREAD: u64 = 0x0001_0000;
/// `BPF_RB_NO_WAKEUP`, `BPF_RB_FORCE_WAKEUP`, `BPF_RB_AVAIL_DATA` and
/// `BPF_RB_RING_SIZE` from include/uapi/linux/bpf.h.
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
const BPF_RB_RING_SIZE: u64 = 1;

/// The flags for a record written to `SAMPLES`: no wakeup while the ring is
/// under a quarter full (userspace drains it on its timer, and a wakeup is
/// an irq_work per record, the most expensive part of a sample in a VM);
/// past that, wake userspace, so a burst is drained before the ring fills.
#[inline(always)]
fn ring_flags() -> u64 {
    let queued = SAMPLES.query(BPF_RB_AVAIL_DATA);
    let size = SAMPLES.query(BPF_RB_RING_SIZE);
    if queued > size / 4 {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

#[inline(always)]
fn count(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: a per-CPU slot, only this CPU writes it and we are not preempted.
        unsafe { *slot += 1 };
    }
}

#[inline(always)]
fn is_profiled(tgid: u32) -> bool {
    // SAFETY: the value is a plain u8 we only test for presence.
    FILTER_PIDS.load() == 0 || unsafe { TARGET_PIDS.get(&tgid) }.is_some()
}

#[perf_event]
pub fn on_cpu_sample(ctx: PerfEventContext) -> u32 {
    match try_on_cpu_sample(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_on_cpu_sample(ctx: &PerfEventContext) -> Result<(), i64> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    if tid == 0 {
        count(Counter::IdleTicks);
        return Ok(());
    }
    if tgid == SELF_TGID.load() || !is_profiled(tgid) {
        count(Counter::Filtered);
        return Ok(());
    }
    let Some(event) = unwind::EVENT_SCRATCH.get_ptr_mut(0) else {
        return Ok(());
    };
    let user = if STACK_COPY_ALWAYS.load() != 0 {
        stacks::UserStack::FramePointers
    } else {
        stacks::user_stack_for(tgid, Counter::UnwindProcessUnknown, || {
            unwind::user_regs(ctx)
        })
    };
    // Frame pointers with the tables on: the process is not indexed yet.
    let unindexed = USER_UNWIND.load() != 0 && matches!(user, stacks::UserStack::FramePointers);
    // SAFETY: a per-CPU scratch record, only this program on this CPU uses
    // it (see `stacks::take_stacks`); every field read by userspace is
    // written before output.
    unsafe {
        stacks::take_stacks(ctx, event, SampleKind::OnCpu, tgid, tid, user);
        (*event).value = ON_CPU_PERIOD_NS.load();
        if unindexed && stack_copy::output_with_copy(ctx, event) {
            return Ok(());
        }
        if SAMPLES
            .output::<RawSampleEvent>(&*event, ring_flags())
            .is_err()
        {
            count(Counter::SamplesLost);
            return Ok(());
        }
    }
    count(Counter::SamplesSubmitted);
    Ok(())
}

// Field offsets from /sys/kernel/tracing/events/task/task_newtask/format.
const NEWTASK_PID: usize = 8;
const NEWTASK_CLONE_FLAGS: usize = 32;

/// `task:task_newtask` fires in the parent: a profiled process that creates a
/// process (not a thread) makes the child profiled too, as `perf record -- cmd`
/// follows children.
#[tracepoint]
pub fn follow_fork(ctx: TracePointContext) -> u32 {
    match try_follow_fork(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_follow_fork(ctx: &TracePointContext) -> Result<(), i64> {
    if FILTER_PIDS.load() == 0 {
        return Ok(());
    }
    let parent = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: presence test only.
    if unsafe { TARGET_PIDS.get(&parent) }.is_none() {
        return Ok(());
    }
    // SAFETY: offsets from the tracepoint's format file.
    let clone_flags: u64 = unsafe { ctx.read_at(NEWTASK_CLONE_FLAGS) }.map_err(i64::from)?;
    if clone_flags & CLONE_THREAD != 0 {
        return Ok(());
    }
    // SAFETY: as above.
    let child: i32 = unsafe { ctx.read_at(NEWTASK_PID) }.map_err(i64::from)?;
    TARGET_PIDS
        .insert(&(child as u32), &1, 0)
        .map_err(i64::from)?;
    count(Counter::ForksFollowed);
    Ok(())
}

/// `sched:sched_process_exit` (once per exiting thread): when the whole
/// process ends, tell userspace and drop it from the set and from
/// [`CODE_MAPPED_AT`] so the maps do not fill with dead pids; always drop
/// the thread's parked off-CPU record.
#[tracepoint]
pub fn forget_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    offcpu::forget_thread(pid_tgid as u32);
    if !process_ends(&ctx, pid_tgid) {
        return 0;
    }
    let _ = CODE_MAPPED_AT.remove(&tgid);
    if tgid == SELF_TGID.load() || !is_profiled(tgid) {
        return 0;
    }
    send_process_event(ProcessEventKind::Exit, tgid);
    if FILTER_PIDS.load() != 0 {
        let _ = TARGET_PIDS.remove(&tgid);
    }
    0
}

/// Whether the exiting thread is the process's last: the tracepoint's
/// `group_dead` where the kernel has it (6.16+), else the thread-group
/// leader's exit (a leader that exits before its threads is then taken
/// for the process's end).
#[inline(always)]
fn process_ends(ctx: &TracePointContext, pid_tgid: u64) -> bool {
    let offset = EXIT_GROUP_DEAD_OFFSET.load();
    if offset == 0 {
        return (pid_tgid >> 32) as u32 == pid_tgid as u32;
    }
    // SAFETY: the offset comes from the tracepoint's format file.
    unsafe { ctx.read_at::<u8>(offset as usize) }.is_ok_and(|dead| dead != 0)
}

/// `sched:sched_process_exec`: a profiled process replaced its image.
#[tracepoint]
pub fn process_exec(_ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if tgid != SELF_TGID.load() && is_profiled(tgid) {
        send_process_event(ProcessEventKind::Exec, tgid);
    }
    0
}

/// When each process last sent [`ProcessEventKind::CodeMapped`].
#[map]
static CODE_MAPPED_AT: LruHashMap<u32, u64> = LruHashMap::with_max_entries(8192, 0);

/// `PROT_EXEC` from include/uapi/asm-generic/mman-common.h.
const PROT_EXEC: u64 = 4;
/// Offset of `prot` in `syscalls:sys_enter_mmap` and `sys_enter_mprotect`
/// (the third argument of both: arguments start at 16, 8 bytes each).
const SYSCALL_PROT: usize = 32;

/// `syscalls:sys_enter_mmap` and `sys_enter_mprotect` (attached only when
/// user stacks are walked with unwind tables): a profiled process asks
/// for executable memory, so userspace rescans its mappings right after
/// instead of on a timer, and its tables are in before its new code runs
/// long. Rate-limited per process ([`CODE_MAPPED_EVERY_NS`]).
#[tracepoint]
pub fn code_mapped(ctx: TracePointContext) -> u32 {
    // SAFETY: the offset of an argument every syscall record has.
    let prot: u64 = unsafe { ctx.read_at(SYSCALL_PROT) }.unwrap_or(0);
    if prot & PROT_EXEC == 0 {
        return 0;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if tgid == SELF_TGID.load() || !is_profiled(tgid) {
        return 0;
    }
    // SAFETY: a helper without arguments or memory access.
    let now = unsafe { aya_ebpf::helpers::generated::bpf_ktime_get_ns() };
    // SAFETY: a plain u64 copied out at once.
    if let Some(&last) = unsafe { CODE_MAPPED_AT.get(&tgid) }
        && now.wrapping_sub(last) < CODE_MAPPED_EVERY_NS
    {
        return 0;
    }
    let _ = CODE_MAPPED_AT.insert(&tgid, &now, 0);
    send_process_event(ProcessEventKind::CodeMapped, tgid);
    0
}

#[inline(always)]
fn send_process_event(kind: ProcessEventKind, pid: u32) {
    let record = ProcessEventRecord {
        // SAFETY: a helper without arguments or memory access.
        time_ns: unsafe { aya_ebpf::helpers::generated::bpf_ktime_get_ns() },
        pid,
        kind: kind as u32,
    };
    if SAMPLES
        .output::<ProcessEventRecord>(&record, ring_flags())
        .is_err()
    {
        count(Counter::ProcessEventsLost);
        return;
    }
    count(match kind {
        ProcessEventKind::Exit => Counter::ProcessExits,
        ProcessEventKind::Exec => Counter::ProcessExecs,
        ProcessEventKind::CodeMapped => return,
    });
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
