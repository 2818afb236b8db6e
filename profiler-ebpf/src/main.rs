//! clrbpf's kernel side. `on_cpu_sample` runs on every `cpu-clock` tick of
//! every online CPU and writes one [`RawSampleEvent`] (thread, time, kernel
//! and user stacks) into the `SAMPLES` ring buffer; userspace does the rest.
//! `off_cpu_switch` and `off_cpu_waking` ([`offcpu`]) measure where profiled
//! threads block and who wakes them.
//! `follow_fork` and `forget_exit` keep the set of profiled processes in step
//! with the process tree when clrbpf profiles a command and its children.
//!
//! With `USER_UNWIND` set, user stacks of indexed processes are walked with
//! the unwind tables ([`unwind`]); otherwise `bpf_get_stack` follows frame
//! pointers. Kept bounded: every loop has a constant bound, no string work.
#![no_std]
#![no_main]

use core::{ffi::c_void, mem::size_of, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext, Global,
    bindings::BPF_F_USER_STACK,
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid,
        generated::{bpf_get_smp_processor_id, bpf_get_stack, bpf_ktime_get_ns},
    },
    macros::{map, perf_event, tracepoint},
    maps::{HashMap, PerCpuArray, RingBuf},
    programs::{PerfEventContext, TracePointContext},
};
use clrbpf_common::{
    COUNTER_SLOTS, Counter, MAX_STACK_DEPTH, RawSampleEvent, SampleKind, TASK_COMM_LEN,
    sample_flags, unwind::UnwindError,
};

mod offcpu;
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

/// Raw samples for userspace. The size is set at load time.
#[map]
static SAMPLES: RingBuf = RingBuf::with_byte_size(8 * 1024 * 1024, 0);

/// The profiled processes (tgid -> 1) when `FILTER_PIDS` is 1.
#[map]
static TARGET_PIDS: HashMap<u32, u8> = HashMap::with_max_entries(65_536, 0);

/// Event counters, indexed by [`Counter`].
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

const CLONE_THREAD: u64 = 0x0001_0000;
/// `BPF_RB_NO_WAKEUP` from include/uapi/linux/bpf.h.
const BPF_RB_NO_WAKEUP: u64 = 1;
const KERNEL_STACK_BYTES: u32 = (MAX_STACK_DEPTH * size_of::<u64>()) as u32;
/// `bpf_get_stack` returns at most `perf_event_max_stack` (127) frames.
const FP_USER_STACK_BYTES: u32 = (MAX_STACK_DEPTH * size_of::<u64>()) as u32;

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
    // SAFETY: a per-CPU scratch record, only this program on this CPU uses
    // it; every field read by userspace is written before output.
    unsafe {
        let kernel_len = bpf_get_stack(
            ctx.as_ptr(),
            addr_of_mut!((*event).kernel_stack).cast::<c_void>(),
            KERNEL_STACK_BYTES,
            0,
        );
        let mut flags = 0;
        let kernel_frames = if kernel_len < 0 {
            count(Counter::KernelStackErrors);
            flags |= sample_flags::KERNEL_STACK_ERROR;
            0
        } else {
            (kernel_len as u32) / 8
        };
        if kernel_frames as usize == MAX_STACK_DEPTH {
            flags |= sample_flags::KERNEL_STACK_TRUNCATED;
        }
        let mut user_frames = 0;
        let mut unwind_error = 0;
        if USER_UNWIND.load() != 0 && unwind::has_mappings(tgid) {
            match unwind::user_regs(ctx).and_then(|regs| unwind::walk_user_stack(tgid, regs)) {
                Some(walk) => {
                    count(Counter::UserStacksUnwound);
                    flags |= sample_flags::USER_STACK_UNWOUND;
                    user_frames = walk.frames;
                    unwind_error = walk.error;
                    if walk.unindexed {
                        flags |= sample_flags::USER_PC_UNINDEXED;
                    }
                    if walk.error == UnwindError::TooDeep as u32 {
                        flags |= sample_flags::USER_STACK_TRUNCATED;
                    }
                }
                None => count(Counter::UserRegsUnavailable),
            }
        } else {
            if USER_UNWIND.load() != 0 {
                count(Counter::UnwindProcessUnknown);
            }
            let user_len = bpf_get_stack(
                ctx.as_ptr(),
                addr_of_mut!((*event).user_stack).cast::<c_void>(),
                FP_USER_STACK_BYTES,
                u64::from(BPF_F_USER_STACK),
            );
            if user_len < 0 {
                count(Counter::UserStackErrors);
                flags |= sample_flags::USER_STACK_ERROR;
            } else {
                user_frames = (user_len as u32) / 8;
            }
            if user_frames as usize == MAX_STACK_DEPTH {
                flags |= sample_flags::USER_STACK_TRUNCATED;
            }
        }
        (*event).time_ns = bpf_ktime_get_ns();
        (*event).value = ON_CPU_PERIOD_NS.load();
        (*event).pid = tgid;
        (*event).tid = tid;
        (*event).cpu = bpf_get_smp_processor_id();
        (*event).kind = SampleKind::OnCpu as u32;
        (*event).kernel_stack_len = kernel_frames;
        (*event).user_stack_len = user_frames;
        (*event).flags = flags;
        (*event).user_unwind_error = unwind_error;
        (*event).interval_ns = 0;
        (*event).syscall = -1;
        (*event).wake_flags = 0;
        (*event).waker_tid = 0;
        (*event).waker_pid = 0;
        (*event).keep_draw = 0;
        (*event).stack_p = clrbpf_common::offcpu::STACK_P_ALWAYS;
        (*event)._pad = 0;
        (*event).comm = bpf_get_current_comm().unwrap_or([0; TASK_COMM_LEN]);
        // Userspace drains the ring on a timer, so no wakeup per record: the
        // wakeup is an irq_work per sample, the most expensive part in a VM.
        if SAMPLES
            .output::<RawSampleEvent>(&*event, BPF_RB_NO_WAKEUP)
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

/// `sched:sched_process_exit` (once per exiting thread): drop an exiting
/// process from the set so the map does not fill with dead pids, and the
/// thread's parked off-CPU record.
#[tracepoint]
pub fn forget_exit(_ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    offcpu::forget_thread(pid_tgid as u32);
    if FILTER_PIDS.load() != 0 && (pid_tgid >> 32) as u32 == pid_tgid as u32 {
        let _ = TARGET_PIDS.remove(&((pid_tgid >> 32) as u32));
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
