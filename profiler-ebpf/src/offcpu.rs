//! Off-CPU time in the kernel (issue 4): where profiled threads block, for
//! how long, and who wakes them.
//!
//! 1. `sched:sched_switch`, switch-out half: the tracepoint runs in the
//!    context of `prev`. When `prev` is a thread of a profiled process going
//!    to sleep (state S or D; preemption is not off-CPU time), its kernel
//!    and user stacks are taken as for an on-CPU sample (the unwind tables
//!    when userspace indexed the process, else frame pointers), stamped with
//!    the time and the system call it blocked in, and parked in
//!    `OFF_CPU_PENDING` under its tid.
//! 2. `sched:sched_waking` for a parked thread: the first wakeup draws the
//!    keep decision's random number; if the interval would be kept already
//!    (it can only grow until switch-in), it records the current thread's
//!    ids and its kernel and user stacks, walked like the blocked one's,
//!    into a [`SampleKind::Waker`] record parked in `WAKER_PENDING`. As only
//!    kept waits pay for it, the waker's stack costs at most one walk per
//!    `--off-cpu-min` of waiting. Userspace tells
//!    from the kernel stack whether it was a thread's wakeup or an
//!    interrupt's (a timer running out): the tracepoint's common flags
//!    cannot say, as a BPF program sees the regs pointer written over them.
//! 3. `sched:sched_switch`, switch-in half (`next`): the interval is
//!    measured, added to the thread's exact totals in `OFF_CPU_TOTALS`, and
//!    kept or not by [`keep_interval`]; a kept one goes to the ring buffer
//!    straight from the parked record. The entry is removed either way.
//!
//! Cost: every switch on the host does one hash lookup (the `next` side)
//! and, for `prev`, the profiled-set test; stacks are taken only for
//! blocking switches of profiled threads. The parked records live in a map
//! allocated on demand, so memory follows the number of threads blocked
//! now; a thread that exits while parked is removed by the exit tracepoint,
//! which also sends the thread's totals to userspace and removes them.

use core::ffi::c_void;

use aya_ebpf::{
    Global,
    bindings::{BPF_F_NO_PREALLOC, pt_regs},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_probe_read_kernel,
        generated::{
            bpf_get_current_task_btf, bpf_get_prandom_u32, bpf_ktime_get_ns,
            bpf_probe_read_kernel as bpf_probe_read_kernel_raw, bpf_task_pt_regs,
        },
    },
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray},
    programs::TracePointContext,
};
use clrbpf_common::{
    Counter, RawSampleEvent, SampleKind, TASK_COMM_LEN,
    offcpu::{
        ExitedThreadTotals, OffCpuThreadTotals, STACK_P_ALWAYS, STACK_RATE_WINDOW_NS, StackRate,
        keep_interval, stack_probability, take_stack, wake_flags,
    },
    sample_flags,
    unwind::UnwindRegs,
};

use crate::{SAMPLES, SELF_TGID, count, is_profiled, ring_flags, stacks, unwind};

/// 1: the off-CPU programs record; 0: they return at once.
#[unsafe(no_mangle)]
static OFF_CPU: Global<u32> = Global::new(0);
/// Intervals at least this long are always kept (`--off-cpu-min`).
#[unsafe(no_mangle)]
static OFF_CPU_MIN_NS: Global<u64> = Global::new(1_000_000);
/// Most stacks taken per CPU per [`STACK_RATE_WINDOW_NS`]
/// (`--off-cpu-max-stacks`).
#[unsafe(no_mangle)]
static OFF_CPU_STACKS_PER_WINDOW: Global<u64> = Global::new(200);

/// The stack rate limit's state on each CPU.
#[map]
static STACK_RATE: PerCpuArray<StackRate> = PerCpuArray::with_max_entries(1, 0);

/// Profiled threads that blocked since recording started (tid -> the
/// sample being built for it; `time_ns` 0 while the thread runs). Entries
/// stay until the thread exits, so a switch costs no allocation.
#[map]
pub static OFF_CPU_PENDING: HashMap<u32, RawSampleEvent> =
    HashMap::with_max_entries(65_536, BPF_F_NO_PREALLOC);

/// Exact totals per thread (tid).
#[map]
static OFF_CPU_TOTALS: HashMap<u32, OffCpuThreadTotals> =
    HashMap::with_max_entries(65_536, BPF_F_NO_PREALLOC);

/// The wakers of blocked threads whose wait will be kept (woken tid -> a
/// [`SampleKind::Waker`] record: the waking thread's stacks).
#[map]
static WAKER_PENDING: HashMap<u32, RawSampleEvent> =
    HashMap::with_max_entries(65_536, BPF_F_NO_PREALLOC);

// Field offsets from /sys/kernel/tracing/events/sched/sched_switch/format
// (stable since 4.x) and sched_waking's.
const SWITCH_PREV_PID: usize = 24;
const SWITCH_PREV_STATE: usize = 32;
const SWITCH_NEXT_PID: usize = 56;
const WAKING_PID: usize = 24;

/// `TASK_INTERRUPTIBLE | TASK_UNINTERRUPTIBLE` in the reported state.
const BLOCKED_STATES: i64 = 0x1 | 0x2;

#[tracepoint]
pub fn off_cpu_switch(ctx: TracePointContext) -> u32 {
    if OFF_CPU.load() == 0 {
        return 0;
    }
    // The switch-in half first: it only needs the next thread's parked record.
    let _ = switch_in(&ctx);
    let _ = switch_out(&ctx);
    0
}

/// Where the user registers were saved at kernel entry, and the system
/// call number; `None` for a kernel thread.
#[inline(always)]
fn saved_user_frame() -> Option<(*const pt_regs, i64)> {
    // SAFETY: helpers available to tracing programs since 5.15; the result
    // is only read through bpf_probe_read_kernel.
    let saved = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as *const pt_regs;
    if saved.is_null() {
        return None;
    }
    // SAFETY: probe reads of kernel memory; a fault gives an error.
    unsafe {
        let cs: u64 = bpf_probe_read_kernel(&raw const (*saved).cs).ok()?;
        if cs & 3 != 3 {
            return None;
        }
        let syscall: u64 = bpf_probe_read_kernel(&raw const (*saved).orig_rax).ok()?;
        Some((saved, syscall as i64))
    }
}

/// The user registers the unwinder starts from, read from `saved`.
#[inline(always)]
fn read_user_regs(saved: *const pt_regs) -> Option<UnwindRegs> {
    // SAFETY: probe reads of kernel memory; a fault gives an error.
    unsafe {
        Some(UnwindRegs {
            pc: bpf_probe_read_kernel(&raw const (*saved).rip).ok()?,
            sp: bpf_probe_read_kernel(&raw const (*saved).rsp).ok()?,
            fp: bpf_probe_read_kernel(&raw const (*saved).rbp).ok()?,
            lr: 0,
        })
    }
}

fn switch_out(ctx: &TracePointContext) -> Result<(), i64> {
    // SAFETY: offsets from the tracepoint's format file.
    let state: i64 = unsafe { ctx.read_at(SWITCH_PREV_STATE) }.map_err(i64::from)?;
    if state & BLOCKED_STATES == 0 {
        return Ok(());
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    if tid == 0 || tgid == SELF_TGID.load() || !is_profiled(tgid) {
        return Ok(());
    }
    // SAFETY: as above.
    let prev: i32 = unsafe { ctx.read_at(SWITCH_PREV_PID) }.map_err(i64::from)?;
    if prev as u32 != tid {
        return Ok(());
    }
    let Some((saved, syscall)) = saved_user_frame() else {
        // A kernel thread: its waits are the kernel's, not the program's.
        return Ok(());
    };
    let Some(event) = unwind::EVENT_SCRATCH.get_ptr_mut(0) else {
        return Ok(());
    };
    let parked = OFF_CPU_PENDING.get_ptr_mut(&tid);
    // A thread's first wait, and the wait after a long one, always get
    // their stacks: long waits are what an off-CPU profile is for, and
    // they are few. The rate limit thins out the short ones.
    // SAFETY: this thread's own map value, see below.
    let predictably_long =
        parked.is_none_or(|p| unsafe { (*p).flags } & sample_flags::OFF_CPU_LAST_WAIT_LONG != 0);
    let p = stack_p_now();
    let p = if predictably_long { STACK_P_ALWAYS } else { p };
    // SAFETY: helper without arguments.
    let random = unsafe { bpf_get_prandom_u32() };
    // SAFETY: the per-CPU scratch record, see `stacks::take_stacks`; `parked` is
    // this thread's own map value, written only by its own switches (and
    // by wakeups, which cannot come before it has blocked).
    unsafe {
        if !take_stack(p, random) {
            count(Counter::OffCpuStacksSkipped);
            // Only the stamp: the interval still counts in the totals.
            let target = match parked {
                Some(parked) => parked,
                None => {
                    (*event).kernel_stack_len = 0;
                    (*event).user_stack_len = 0;
                    if OFF_CPU_PENDING.insert(&tid, &*event, 0).is_err() {
                        count(Counter::OffCpuPendingFull);
                        return Ok(());
                    }
                    let Some(parked) = OFF_CPU_PENDING.get_ptr_mut(&tid) else {
                        return Ok(());
                    };
                    parked
                }
            };
            (*target).pid = tgid;
            (*target).tid = tid;
            (*target).kind = SampleKind::OffCpu as u32;
            (*target).kernel_stack_len = 0;
            (*target).user_stack_len = 0;
            (*target).syscall = syscall;
            (*target).flags = sample_flags::OFF_CPU_NO_STACK;
            (*target).user_unwind_error = 0;
            (*target).wake_flags = 0;
            (*target).waker_tid = 0;
            (*target).waker_pid = 0;
            (*target).stack_p = p;
            (*target).comm = bpf_get_current_comm().unwrap_or([0; TASK_COMM_LEN]);
            (*target).time_ns = bpf_ktime_get_ns();
            return Ok(());
        }
        let Some(regs) = read_user_regs(saved) else {
            return Ok(());
        };
        let user = stacks::user_stack_for(tgid, Counter::UnwindProcessUnknown, || Some(regs));
        stacks::take_stacks(ctx, event, SampleKind::OffCpu, tgid, tid, user);
        (*event).syscall = syscall;
        (*event).stack_p = p;
        match parked {
            // One helper copy of the 2 KiB record: an assignment compiles
            // to a byte-by-byte `memcpy` loop, slow to run and the larger
            // part of this program's verification.
            Some(parked) => {
                bpf_probe_read_kernel_raw(
                    parked.cast::<c_void>(),
                    size_of::<RawSampleEvent>() as u32,
                    event.cast_const().cast::<c_void>(),
                );
            }
            None => {
                if OFF_CPU_PENDING.insert(&tid, &*event, 0).is_err() {
                    count(Counter::OffCpuPendingFull);
                    return Ok(());
                }
            }
        }
    }
    count(Counter::OffCpuBlocked);
    Ok(())
}

/// The stack-taking probability in force on this CPU, counting this
/// blocking switch toward the next window's.
#[inline(always)]
fn stack_p_now() -> u32 {
    let Some(rate) = STACK_RATE.get_ptr_mut(0) else {
        return STACK_P_ALWAYS;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: a per-CPU value, only sched_switch on this CPU (interrupts
    // off) uses it.
    unsafe {
        if now.saturating_sub((*rate).window_start_ns) >= STACK_RATE_WINDOW_NS {
            // A first window (p still 0) takes every stack.
            (*rate).p = stack_probability((*rate).seen, OFF_CPU_STACKS_PER_WINDOW.load());
            (*rate).window_start_ns = now;
            (*rate).seen = 0;
        }
        (*rate).seen += 1;
        if (*rate).p == 0 {
            STACK_P_ALWAYS
        } else {
            (*rate).p
        }
    }
}

fn switch_in(ctx: &TracePointContext) -> Result<(), i64> {
    // SAFETY: offsets from the tracepoint's format file.
    let next: i32 = unsafe { ctx.read_at(SWITCH_NEXT_PID) }.map_err(i64::from)?;
    let tid = next as u32;
    let Some(parked) = OFF_CPU_PENDING.get_ptr_mut(&tid) else {
        return Ok(());
    };
    // SAFETY: a map value, see below.
    let (started, no_stack, waker_recorded) = unsafe {
        (
            (*parked).time_ns,
            (*parked).flags & sample_flags::OFF_CPU_NO_STACK != 0,
            (*parked).wake_flags & wake_flags::RECORDED != 0,
        )
    };
    if started == 0 {
        // Not parked: the thread was preempted, or it is our own entry.
        return Ok(());
    }
    count(Counter::OffCpuIntervals);
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: a map value only this CPU's sched_switch touches for `tid`
    // (the thread is switching in here); waking writes other fields first.
    let (pid, interval, drawn, draw) = unsafe {
        (
            (*parked).pid,
            now.saturating_sub((*parked).time_ns),
            (*parked).wake_flags & wake_flags::DRAWN != 0,
            (*parked).keep_draw,
        )
    };
    let random = if drawn {
        draw
    } else {
        // SAFETY: helper without arguments.
        unsafe { bpf_get_prandom_u32() }
    };
    // Waits of at least min are all kept, with their length, with or
    // without stacks; shorter ones only with stacks, by the keep rule, and
    // userspace upscales those by 1/p of the stack rate limit. So every
    // wait's expected contribution is its length.
    let min = OFF_CPU_MIN_NS.load();
    let long = interval >= min;
    let kept = if no_stack && !long {
        None
    } else {
        keep_interval(interval, min, random)
    };
    let mut lost = false;
    if let Some(weight) = kept {
        if let Some(waker) = waker_recorded
            .then(|| WAKER_PENDING.get_ptr(&tid))
            .flatten()
        {
            // Just before the off-CPU record it belongs to; userspace joins
            // them by the woken thread's id.
            // SAFETY: a map value, complete since the wakeup.
            if SAMPLES
                .output::<RawSampleEvent>(unsafe { &*waker }, ring_flags())
                .is_err()
            {
                count(Counter::SamplesLost);
            }
        }
        // SAFETY: as above; the record is complete since switch-out.
        unsafe {
            (*parked).value = weight;
            (*parked).interval_ns = interval;
            if long {
                (*parked).stack_p = STACK_P_ALWAYS;
            }
            if SAMPLES
                .output::<RawSampleEvent>(&*parked, ring_flags())
                .is_err()
            {
                count(Counter::SamplesLost);
                lost = true;
            } else {
                count(Counter::OffCpuKept);
            }
        }
    }
    // SAFETY: as above.
    unsafe {
        (*parked).time_ns = 0;
        (*parked).flags = if long {
            sample_flags::OFF_CPU_LAST_WAIT_LONG
        } else {
            0
        };
    }
    if waker_recorded {
        let _ = WAKER_PENDING.remove(&tid);
    }
    add_to_totals(tid, pid, interval, lost);
    Ok(())
}

#[inline(always)]
fn add_to_totals(tid: u32, pid: u32, interval: u64, lost: bool) {
    let mut totals = OFF_CPU_TOTALS.get_ptr_mut(&tid);
    if totals.is_none() {
        let fresh = OffCpuThreadTotals {
            pid,
            ..OffCpuThreadTotals::default()
        };
        if OFF_CPU_TOTALS.insert(&tid, &fresh, 0).is_err() {
            return;
        }
        totals = OFF_CPU_TOTALS.get_ptr_mut(&tid);
    }
    let Some(totals) = totals else {
        return;
    };
    // SAFETY: a map value; concurrent updates for one tid cannot happen
    // (only its own switch-in writes it), and a torn total is only a
    // statistic.
    unsafe {
        (*totals).pid = pid;
        (*totals).blocked_ns += interval;
        (*totals).intervals += 1;
        if lost {
            (*totals).lost += 1;
        }
    }
}

/// `sched:sched_waking` runs in the waker's context (or in the interrupt
/// that does the wakeup).
#[tracepoint]
pub fn off_cpu_waking(ctx: TracePointContext) -> u32 {
    if OFF_CPU.load() == 0 {
        return 0;
    }
    let _ = try_off_cpu_waking(&ctx);
    0
}

fn try_off_cpu_waking(ctx: &TracePointContext) -> Result<(), i64> {
    // SAFETY: offsets from the tracepoint's format file.
    let target: i32 = unsafe { ctx.read_at(WAKING_PID) }.map_err(i64::from)?;
    let Some(parked) = OFF_CPU_PENDING.get_ptr_mut(&(target as u32)) else {
        return Ok(());
    };
    // SAFETY: a map value; a second waking of the same thread before it
    // runs finds DRAWN and leaves it.
    unsafe {
        if (*parked).time_ns == 0
            || (*parked).flags & sample_flags::OFF_CPU_NO_STACK != 0
            || (*parked).wake_flags & wake_flags::DRAWN != 0
        {
            return Ok(());
        }
        let draw = bpf_get_prandom_u32();
        (*parked).keep_draw = draw;
        (*parked).wake_flags = wake_flags::DRAWN;
        let blocked_so_far = bpf_ktime_get_ns().saturating_sub((*parked).time_ns);
        if keep_interval(blocked_so_far, OFF_CPU_MIN_NS.load(), draw).is_none() {
            // Most likely dropped at switch-in: no waker stacks for it.
            return Ok(());
        }
        let pid_tgid = bpf_get_current_pid_tgid();
        let (waker_pid, waker_tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
        (*parked).waker_pid = waker_pid;
        (*parked).waker_tid = waker_tid;
        let Some(event) = unwind::EVENT_SCRATCH.get_ptr_mut(0) else {
            return Ok(());
        };
        // A kernel thread (or an interrupt over one) has no user stack.
        let user = match saved_user_frame() {
            Some((saved, _)) => {
                stacks::user_stack_for(waker_pid, Counter::WakerProcessUnknown, || {
                    read_user_regs(saved)
                })
            }
            None => stacks::UserStack::Skip,
        };
        // SAFETY: the per-CPU scratch record, see `stacks::take_stacks`.
        stacks::take_stacks(ctx, event, SampleKind::Waker, waker_pid, waker_tid, user);
        // For a waker record, `waker_tid` names the thread it woke.
        (*event).waker_tid = target as u32;
        if WAKER_PENDING.insert(&(target as u32), &*event, 0).is_err() {
            return Ok(());
        }
        (*parked).wake_flags = wake_flags::DRAWN | wake_flags::RECORDED;
    }
    count(Counter::OffCpuWakers);
    Ok(())
}

/// A thread that exits while parked never switches in again. Its exact
/// totals go to userspace in the ring, in order with its samples, and
/// leave the map; if the ring is full they stay in the map, where
/// userspace reads them at the end.
#[inline(always)]
pub fn forget_thread(tid: u32) {
    if OFF_CPU.load() == 0 {
        return;
    }
    let _ = OFF_CPU_PENDING.remove(&tid);
    let _ = WAKER_PENDING.remove(&tid);
    // SAFETY: a map value, copied at once.
    let Some(totals) = (unsafe { OFF_CPU_TOTALS.get(&tid) }).copied() else {
        return;
    };
    let record = ExitedThreadTotals {
        totals,
        tid,
        _pad: 0,
    };
    if SAMPLES
        .output::<ExitedThreadTotals>(&record, ring_flags())
        .is_ok()
    {
        let _ = OFF_CPU_TOTALS.remove(&tid);
    }
}
