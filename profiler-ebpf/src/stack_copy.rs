//! Copies of user stacks for processes without unwind tables yet (issue
//! 25): while userspace builds a new process's tables, the on-CPU program
//! writes, with the sample, the user registers and up to
//! [`STACK_COPY_BYTES`] of stack from sp, as perf's `--call-graph dwarf`
//! does. Userspace unwinds the copy once the tables exist, with the same
//! step (`clrbpf_common::unwind`). A byte budget per CPU and second bounds
//! what the copies cost; past it, samples keep the frame-pointer walk.
//! Processes with tables never come here: the steady state costs nothing
//! more.

use core::ffi::c_void;

use aya_ebpf::{
    helpers::{
        bpf_probe_read_user,
        generated::{
            bpf_ktime_get_ns, bpf_probe_read_kernel as bpf_probe_read_kernel_raw,
            bpf_probe_read_user as bpf_probe_read_user_raw,
        },
    },
    macros::map,
    maps::PerCpuArray,
    programs::PerfEventContext,
};
use clrbpf_common::{
    Counter, RawSampleEvent, STACK_COPY_BYTES, STACK_COPY_RECORD_HEADER, StackCopyBudget,
    StackCopyEvent, sample_flags,
};

use crate::{SAMPLES, STACK_COPY_BYTES_PER_CPU, count, ring_flags, unwind};

/// The record being built: too large for the stack.
#[map]
static STACK_COPY_SCRATCH: PerCpuArray<StackCopyEvent> = PerCpuArray::with_max_entries(1, 0);

/// Bytes written this second, per CPU.
#[map]
static STACK_COPY_BUDGET: PerCpuArray<StackCopyBudget> = PerCpuArray::with_max_entries(1, 0);

const PAGE: u64 = 4096;
/// Pages one copy reads at most: a first partial one, then whole ones.
const COPY_READS: usize = STACK_COPY_BYTES / PAGE as usize + 1;
const WINDOW_NS: u64 = 1_000_000_000;

/// Writes `event` (filled by `take_stacks`) with a copy of the user stack
/// into `SAMPLES` when the budget allows. Returns false when nothing was
/// written: the caller then writes `event` alone.
///
/// # Safety
/// `event` is the per-CPU scratch record of this program, filled.
#[inline(always)]
pub unsafe fn output_with_copy(ctx: &PerfEventContext, event: *const RawSampleEvent) -> bool {
    let per_cpu = STACK_COPY_BYTES_PER_CPU.load();
    if per_cpu == 0 {
        return false;
    }
    let (Some(copy), Some(budget)) = (
        STACK_COPY_SCRATCH.get_ptr_mut(0),
        STACK_COPY_BUDGET.get_ptr_mut(0),
    ) else {
        return false;
    };
    // SAFETY: per-CPU values, only this program on this CPU uses them
    // (the on-CPU program runs in hard-interrupt context).
    let (copy, budget) = unsafe { (&mut *copy, &mut *budget) };
    // SAFETY: a helper without arguments or memory access.
    let now = unsafe { bpf_ktime_get_ns() };
    if now.wrapping_sub(budget.window_start_ns) >= WINDOW_NS {
        budget.window_start_ns = now;
        budget.used = 0;
    }
    // The budget is checked against the largest record, so a second never
    // goes over it.
    let largest = (STACK_COPY_RECORD_HEADER + STACK_COPY_BYTES) as u64;
    if budget.used.saturating_add(largest) > per_cpu {
        count(Counter::StackCopiesOverBudget);
        return false;
    }
    let Some(regs) = unwind::user_regs(ctx) else {
        return false;
    };
    let mut len: u64 = 0;
    let mut addr = regs.sp;
    for _ in 0..COPY_READS {
        let left = STACK_COPY_BYTES as u64 - len;
        let mut chunk = PAGE - (addr & (PAGE - 1));
        if chunk > left {
            chunk = left;
        }
        if chunk == 0 || chunk > PAGE || len >= STACK_COPY_BYTES as u64 {
            break;
        }
        let at = (len as usize) & (STACK_COPY_BYTES - 1);
        // SAFETY: `at < STACK_COPY_BYTES` and `chunk <= PAGE`, inside the
        // buffer's `STACK_COPY_BYTES + PAGE` bytes; the helper checks the
        // user address and fails on an unmapped page (the stack's top).
        let rc = unsafe {
            bpf_probe_read_user_raw(
                copy.stack.as_mut_ptr().add(at).cast::<c_void>(),
                chunk as u32,
                addr as *const c_void,
            )
        };
        if rc != 0 {
            break;
        }
        len += chunk;
        addr = addr.wrapping_add(chunk);
    }
    // SAFETY: the helper checks the address; a fault gives an error.
    let code = unsafe { bpf_probe_read_user(regs.pc as *const u64) };
    copy.header.regs = regs;
    copy.header.code = code.unwrap_or(0);
    copy.header.code_len = if code.is_ok() { 8 } else { 0 };
    copy.header.stack_len = len as u32;
    // SAFETY: two per-CPU map values of this program; one helper call
    // instead of a 2 KiB copy in BPF instructions.
    let rc = unsafe {
        bpf_probe_read_kernel_raw(
            (&raw mut copy.sample).cast::<c_void>(),
            size_of::<RawSampleEvent>() as u32,
            event.cast::<c_void>(),
        )
    };
    if rc != 0 {
        return false;
    }
    copy.sample.flags |= sample_flags::USER_STACK_COPIED;
    let size = STACK_COPY_RECORD_HEADER + (len as usize & (2 * STACK_COPY_BYTES - 1));
    if size > size_of::<StackCopyEvent>() {
        return false;
    }
    // SAFETY: the first `size` bytes of the scratch record, all written.
    let bytes =
        unsafe { core::slice::from_raw_parts((copy as *const StackCopyEvent).cast::<u8>(), size) };
    if SAMPLES.output::<[u8]>(bytes, ring_flags()).is_err() {
        count(Counter::SamplesLost);
        return true;
    }
    budget.used += size as u64;
    count(Counter::StackCopies);
    count(Counter::SamplesSubmitted);
    if let Some(slot) = crate::COUNTERS.get_ptr_mut(Counter::StackCopyBytes as u32) {
        // SAFETY: a per-CPU slot, only this CPU writes it.
        unsafe { *slot += size as u64 };
    }
    true
}
