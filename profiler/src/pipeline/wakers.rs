//! Off-CPU samples as the profile holds them: the interval under its
//! blocked stack, labelled with why the thread waited (`wait.kind`), and,
//! when wakeups are recorded, the waker's stack composed on top of the
//! blocked one as bcc's `offwaketime` does, so a flame graph reads
//! "blocked in X (below), released by Y (above)".

use std::sync::Arc;

use super::{Pipeline, labels};
use crate::{
    profile::{Frame, Label, OffCpuDetail, RawSample, label_keys, wait_kind},
    symbolize::stack::user_frame,
};

/// Threads whose off-CPU time the summary reports one by one.
const MAX_OFF_CPU_THREADS: usize = 131_072;

impl Pipeline {
    /// Adds one off-CPU sample, whose stack is in [`Self::stack`] and whose
    /// process's and thread's labels are `labels`.
    pub(super) fn add_off_cpu(
        &mut self,
        sample: &RawSample,
        off_cpu: &OffCpuDetail,
        mut labels: Vec<Label>,
    ) {
        // The latest name: a new thread blocks before it names itself.
        // Both per-thread tables are bounded: past the bound, new threads
        // are counted under tid 0 and go unnamed in the summary.
        let tid = if self.thread_names.len() < MAX_OFF_CPU_THREADS
            || self.thread_names.contains_key(&sample.tid)
        {
            self.thread_names
                .insert(sample.tid, sample.thread_name.clone());
            sample.tid
        } else {
            0
        };
        let waker_kernel: Vec<Arc<Frame>> = off_cpu
            .waker_kernel_stack
            .iter()
            .map(|&addr| self.native.symbolize_kernel(addr))
            .collect();
        let kind = wait_kind::classify(
            off_cpu.syscall,
            wait_kind::woken_by_timer(waker_kernel.iter().map(|f| &*f.name)),
            self.namer.kernel_names(),
        );
        labels.push(Label::str(label_keys::WAIT_KIND, kind.name()));
        if off_cpu.stack_not_taken {
            let frame = Frame::synthetic("[stack not taken: --off-cpu-max-stacks]");
            self.stack.insert(0, self.aggregator.intern(&frame));
        }
        let recorded = self.off_cpu_recorded.entry(tid).or_default();
        recorded.0 += sample.value;
        recorded.1 += 1;
        let values = self.layout.off_cpu(sample.value);
        let Some(waker_values) = self.layout.wakeup(sample.value) else {
            self.aggregator.add(&self.stack, labels, &values);
            return;
        };
        self.aggregator.add(&self.stack, labels.clone(), &values);
        if off_cpu.waker.is_none() && waker_kernel.is_empty() {
            return;
        }
        self.compose_waker_stack(sample, off_cpu, &waker_kernel, &mut labels);
        self.aggregator.add(&self.stack, labels, &waker_values);
    }

    /// Puts the waker's stack, root first, on top of a `--` frame on top of
    /// the blocked stack in [`Self::stack`], and the waker's labels into
    /// `labels`. A wakeup from an interrupt has no waker thread: its
    /// kernel stack stands on an `[interrupt]` frame.
    fn compose_waker_stack(
        &mut self,
        sample: &RawSample,
        off_cpu: &OffCpuDetail,
        waker_kernel: &[Arc<Frame>],
        labels: &mut Vec<Label>,
    ) {
        let Self {
            native,
            processes,
            aggregator,
            stack,
            procfs,
            ..
        } = self;
        let blocked = std::mem::take(stack);
        let in_interrupt = wait_kind::woken_in_interrupt(waker_kernel.iter().map(|f| &*f.name));
        match &off_cpu.waker {
            Some(waker) if !in_interrupt => {
                stack.push(aggregator.intern(&Frame::synthetic(&format!(
                    "{} (pid {})",
                    waker.thread_name, waker.pid
                ))));
                if let Some(process) = processes.get_mut(&waker.pid) {
                    for (i, &addr) in waker.user_stack.iter().enumerate().rev() {
                        let frame =
                            user_frame(native, procfs, process, addr, i > 0, sample.time_ns);
                        stack.push(aggregator.intern_user(waker.pid, &frame));
                    }
                } else {
                    stack.push(aggregator.intern(&Frame::synthetic("[process not profiled]")));
                }
                labels::push_waker_labels(labels, waker);
            }
            _ => stack.push(aggregator.intern(&Frame::synthetic("[interrupt]"))),
        }
        for frame in waker_kernel.iter().rev() {
            stack.push(aggregator.intern(frame));
        }
        stack.push(aggregator.intern(&Frame::synthetic("--")));
        stack.extend_from_slice(&blocked);
    }
}
