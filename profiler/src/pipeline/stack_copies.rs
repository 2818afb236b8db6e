//! Samples whose user stack the kernel copied because their process had
//! no unwind tables yet (`profiler-ebpf/src/stack_copy.rs`): the pipeline
//! hands them to the unwind worker (`crate::bpf::unwind_maps`), which walks
//! them once the tables exist, and takes them back among the pending
//! samples, in time order.

use super::Pipeline;
use crate::unwind::stack_copy::CopiedSample;

/// How long the end of a recording waits for the unwind worker to walk
/// the copied stacks it holds. It answers ahead of its queued work, so
/// this is the wait for the request under way: milliseconds, unless the
/// host is saturated (one table can then take seconds). The copies not
/// answered by then keep their frame-pointer walks.
const STACK_COPY_FLUSH_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

impl Pipeline {
    /// Hands the copied stacks of `copies` to the unwind worker (without
    /// it, they keep their frame-pointer walk) and takes in the samples
    /// it is done with, in time order among the pending ones (they come
    /// late: their process had to be indexed first).
    pub(super) fn take_stack_copies(&mut self, copies: Vec<CopiedSample>) {
        // Tracked now: a .NET process's perf map attach starts with its
        // first sample, held or not.
        for copy in &copies {
            self.track(copy.sample.pid);
        }
        let mut done = match self.unwind.as_mut() {
            Some(unwind) => {
                unwind.replay_stack_copies(copies);
                unwind.take_replayed()
            }
            None => copies.into_iter().map(|c| c.sample).collect(),
        };
        for sample in done.drain(..) {
            self.track(sample.pid);
            let at = self
                .pending
                .partition_point(|s| s.time_ns <= sample.time_ns);
            self.pending.insert(at, sample);
        }
    }

    /// The end of a recording: every copied stack the unwind worker holds
    /// comes back now, unwound or with its frame-pointer walk.
    pub fn flush_stack_copies(&mut self) {
        if let Some(unwind) = self.unwind.as_mut() {
            unwind.flush_stack_copies(STACK_COPY_FLUSH_WAIT);
        }
        self.take_stack_copies(Vec::new());
    }
}
