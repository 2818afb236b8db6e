//! Taking a thread's stacks into a [`RawSampleEvent`]: the one piece every
//! program that records a stack shares (the on-CPU sampler, the off-CPU
//! switch-out, the waker). The kernel stack comes from `bpf_get_stack`; the
//! user stack from the unwind tables ([`unwind::walk_user_stack`]) when
//! userspace indexed the process, else from frame pointers.

use core::{ffi::c_void, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext,
    bindings::BPF_F_USER_STACK,
    helpers::{
        bpf_get_current_comm,
        generated::{bpf_get_smp_processor_id, bpf_get_stack, bpf_ktime_get_ns},
    },
};
use clrbpf_common::{
    Counter, MAX_STACK_DEPTH, RawSampleEvent, SampleKind, TASK_COMM_LEN,
    offcpu::STACK_P_ALWAYS,
    sample_flags,
    unwind::{ProcessMappings, UnwindError, UnwindRegs},
};

use crate::{USER_UNWIND, count, unwind};

const KERNEL_STACK_BYTES: u32 = (MAX_STACK_DEPTH * size_of::<u64>()) as u32;
/// `bpf_get_stack` returns at most `perf_event_max_stack` (127) frames.
const FP_USER_STACK_BYTES: u32 = (MAX_STACK_DEPTH * size_of::<u64>()) as u32;

/// How to take the user stack.
pub enum UserStack {
    /// Walk it with the unwind tables from these registers, in the
    /// process's mapping index ([`unwind::process_mappings`]).
    Walk {
        regs: UnwindRegs,
        mappings: *const ProcessMappings,
    },
    /// Follow frame pointers (`bpf_get_stack`).
    FramePointers,
    /// None: a kernel thread, or registers that could not be read.
    Skip,
}

/// How to take the user stack of process `tgid`: the unwind tables when
/// they are on and userspace indexed it, from the registers `regs` gives
/// (`None`: unreadable, counted); else frame pointers, counted in
/// `unknown` (a profiled process not indexed yet, or a waker's process).
#[inline(always)]
pub fn user_stack_for(
    tgid: u32,
    unknown: Counter,
    regs: impl FnOnce() -> Option<UnwindRegs>,
) -> UserStack {
    if USER_UNWIND.load() == 0 {
        return UserStack::FramePointers;
    }
    let Some(mappings) = unwind::process_mappings(tgid) else {
        count(unknown);
        return UserStack::FramePointers;
    };
    match regs() {
        Some(regs) => UserStack::Walk { regs, mappings },
        None => {
            count(Counter::UserRegsUnavailable);
            UserStack::Skip
        }
    }
}

/// Fills `event` for the current thread (`tgid`, `tid`): both stacks, the
/// time, CPU and name, `kind`; every other field is reset (value 0, no
/// off-CPU details).
///
/// # Safety
/// `event` is the per-CPU scratch record, not in use by another program on
/// this CPU: the on-CPU sampler runs in hard-interrupt context and the
/// off-CPU programs with interrupts off (sched_switch, and sched_waking
/// inside try_to_wake_up), so none of them interleave on one CPU.
#[inline(always)]
pub unsafe fn take_stacks<C: EbpfContext>(
    ctx: &C,
    event: *mut RawSampleEvent,
    kind: SampleKind,
    tgid: u32,
    tid: u32,
    user: UserStack,
) {
    // SAFETY: as the function's contract says.
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
        match user {
            UserStack::Walk { regs, mappings } => {
                match unwind::walk_user_stack(tgid, mappings, regs) {
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
            }
            UserStack::FramePointers => {
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
            UserStack::Skip => {}
        }
        (*event).time_ns = bpf_ktime_get_ns();
        (*event).value = 0;
        (*event).interval_ns = 0;
        (*event).syscall = -1;
        (*event).pid = tgid;
        (*event).tid = tid;
        (*event).cpu = bpf_get_smp_processor_id();
        (*event).kind = kind as u32;
        (*event).kernel_stack_len = kernel_frames;
        (*event).user_stack_len = user_frames;
        (*event).flags = flags;
        (*event).user_unwind_error = unwind_error;
        (*event).wake_flags = 0;
        (*event).waker_tid = 0;
        (*event).waker_pid = 0;
        (*event).keep_draw = 0;
        (*event).stack_p = STACK_P_ALWAYS;
        (*event)._pad = 0;
        (*event).comm = bpf_get_current_comm().unwrap_or([0; TASK_COMM_LEN]);
    }
}
