//! A pid another process holds now: the exit event of the process first
//! learnt under it was lost (a full ring), and it ends where the new one
//! starts (issue 33, defect 8).

use super::{EXIT_GRACE_NS, Pipeline};

/// When a process event happened, on the samples' clock.
fn event_time(event: &crate::bpf::ProcessEvent) -> u64 {
    match *event {
        crate::bpf::ProcessEvent::Exited { time_ns, .. }
        | crate::bpf::ProcessEvent::Exec { time_ns, .. } => time_ns,
    }
}

impl Pipeline {
    /// Ends the tracked processes whose pid another process holds now (a
    /// different start time): their exit event was lost. An exit is queued
    /// at the new process's start, in its place among the kernel's events,
    /// so the samples taken before it stay the old process's and the first
    /// one after it learns the new process afresh (its labels, selection
    /// and memory reader its own). The exit ends the old one as a real
    /// one would (what it collected added, its tables and readers dropped,
    /// the unwinder's copies of its stacks given back unreplayed).
    pub(super) fn end_reused(&mut self) {
        let mut exits = Vec::new();
        for process in self.processes.values_mut() {
            if process.successor_seen {
                continue;
            }
            let Some(started_ns) = process.successor_start_ns(&self.procfs) else {
                continue;
            };
            tracing::debug!(pid = process.pid, "a process whose pid was reused ends");
            process.successor_seen = true;
            exits.push(crate::bpf::ProcessEvent::Exited {
                pid: process.pid,
                // Applied EXIT_GRACE_NS after its time: at the start.
                time_ns: started_ns.saturating_sub(EXIT_GRACE_NS),
            });
        }
        for exit in exits {
            self.summary.processes_vanished += 1;
            let at = self
                .lifecycle
                .partition_point(|e| event_time(e) <= event_time(&exit));
            self.lifecycle.insert(at, exit);
        }
    }

    /// Checks for reused pids as soon as the kernel says it dropped a
    /// record (a full ring): the exit event of a process may be among
    /// them, and the next process under its pid must not be taken for it.
    pub(super) fn end_reused_after_losses(&mut self, sampler: &crate::bpf::Sampler) {
        let losses = sampler.losses();
        if losses != self.losses_seen {
            self.losses_seen = losses;
            self.end_reused();
        }
    }
}
