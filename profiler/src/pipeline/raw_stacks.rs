//! CPU samples aggregated by their raw addresses, before symbolization.
//!
//! A CPU-bound process produces the same few stacks thousands of times. So
//! the pipeline first counts each distinct raw stack (process, thread,
//! kernel and user addresses) here, and symbolizes each one once, when its
//! window closes: the cost of naming frames follows the number of distinct
//! stacks, not of samples. A sample whose stack was seen before costs one
//! hash and one comparison; its buffers are dropped.
//!
//! Only on-CPU samples come here; an off-CPU sample carries its own
//! interval, wait kind and waker, and goes straight to symbolization.

use std::{
    collections::{HashMap, HashSet},
    hash::Hasher as _,
};

use twox_hash::XxHash3_64;

use super::{NATIVE_STACKS_NAMED_EVERY, NOT_NAMED_IN_TIME, labels};
use crate::profile::RawSample;

/// One distinct raw stack of a window and what its samples add up to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawStackCount {
    /// The first sample of this stack, with [`RawSample::time_ns`] moved to
    /// the latest one (managed code is named as of then) and
    /// [`RawSample::value`] the sum of the samples' periods.
    pub sample: RawSample,
    /// How many samples.
    pub count: u64,
}

/// The distinct raw stacks of the current window, grouped by process so
/// that an exited process's stacks leave in the time of its own (at 100
/// exits a second, beside a busy process's thousands of stacks).
#[derive(Debug, Default)]
pub struct RawStacks {
    by_pid: HashMap<u32, ProcessStacks>,
    /// The arrival number of the next new stack, so the output keeps the
    /// order of first arrival across processes.
    next_arrival: u64,
    len: usize,
    samples: u64,
}

/// The distinct raw stacks of one process.
#[derive(Debug, Default)]
struct ProcessStacks {
    /// Key hash to indices into `entries` (collisions are compared in full).
    by_hash: HashMap<u64, Vec<usize>>,
    /// With their arrival numbers, in order of first arrival.
    entries: Vec<(u64, RawStackCount)>,
}

impl RawStacks {
    /// Counts `sample` (an on-CPU one) under its raw stack; returns the
    /// sample when its stack is new, so the caller can make sure now, while
    /// the process lives, that its addresses can be named later.
    pub fn add(&mut self, sample: RawSample) -> Option<&RawSample> {
        self.samples += 1;
        let hash = key_hash(&sample);
        let process = self.by_pid.entry(sample.pid).or_default();
        let slots = process.by_hash.entry(hash).or_default();
        if let Some(&at) = slots
            .iter()
            .find(|&&at| same_key(&process.entries[at].1.sample, &sample))
        {
            let entry = &mut process.entries[at].1;
            entry.count += 1;
            entry.sample.value = entry.sample.value.saturating_add(sample.value);
            entry.sample.time_ns = entry.sample.time_ns.max(sample.time_ns);
            return None;
        }
        slots.push(process.entries.len());
        process
            .entries
            .push((self.next_arrival, RawStackCount { sample, count: 1 }));
        self.next_arrival += 1;
        self.len += 1;
        process.entries.last().map(|(_, entry)| &entry.sample)
    }

    /// Distinct stacks held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Samples counted since the last [`Self::take`].
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Processes with stacks held, and the pid holding the most of them
    /// with how many (for the debug line of the pipeline's sizes).
    pub fn processes(&self) -> (usize, Option<(u32, usize)>) {
        let busiest = self
            .by_pid
            .iter()
            .map(|(&pid, p)| (pid, p.entries.len()))
            .max_by_key(|&(pid, n)| (n, std::cmp::Reverse(pid)));
        (self.by_pid.len(), busiest)
    }

    /// The pids with stacks held.
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_pid.keys().copied()
    }

    /// Takes the stacks of process `pid` that `now` says can be named now,
    /// in order of first arrival; the others stay.
    pub fn take_pid_if(
        &mut self,
        pid: u32,
        mut now: impl FnMut(&RawSample) -> bool,
    ) -> Vec<RawStackCount> {
        let Some(process) = self.by_pid.get_mut(&pid) else {
            return Vec::new();
        };
        let (taken, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut process.entries)
            .into_iter()
            .partition(|(_, e)| now(&e.sample));
        if kept.is_empty() {
            self.by_pid.remove(&pid);
        } else {
            process.by_hash.clear();
            for (at, (_, entry)) in kept.iter().enumerate() {
                process
                    .by_hash
                    .entry(key_hash(&entry.sample))
                    .or_default()
                    .push(at);
            }
            process.entries = kept;
        }
        self.len -= taken.len();
        let taken: Vec<RawStackCount> = taken.into_iter().map(|(_, e)| e).collect();
        self.samples -= taken.iter().map(|e| e.count).sum::<u64>();
        taken
    }

    /// The distinct stacks of process `pid` (it exited: they are named
    /// before its symbols go), in order of first arrival; the others stay.
    pub fn take_pid(&mut self, pid: u32) -> Vec<RawStackCount> {
        let Some(process) = self.by_pid.remove(&pid) else {
            return Vec::new();
        };
        self.len -= process.entries.len();
        let mine: Vec<RawStackCount> = process.entries.into_iter().map(|(_, e)| e).collect();
        self.samples -= mine.iter().map(|e| e.count).sum::<u64>();
        mine
    }

    /// Every distinct stack of the window, in order of first arrival; the
    /// next window starts empty.
    pub fn take(&mut self) -> Vec<RawStackCount> {
        let mut all: Vec<(u64, RawStackCount)> = std::mem::take(&mut self.by_pid)
            .into_values()
            .flat_map(|p| p.entries)
            .collect();
        all.sort_unstable_by_key(|&(arrival, _)| arrival);
        self.len = 0;
        self.samples = 0;
        all.into_iter().map(|(_, e)| e).collect()
    }
}

/// `stacks` in the order the end of a recording names them, when its time
/// may not be enough for all ([`super::Pipeline::process_all`]): one stack
/// of each process in turn, each process's heaviest first. A process with
/// thousands of stacks of one sample each (one that rewrites its return
/// addresses) then leaves the other processes their turns, and what goes
/// unnamed when time runs out is the lightest stacks of the processes with
/// the most of them.
pub fn fair_order(stacks: Vec<RawStackCount>) -> Vec<RawStackCount> {
    let total = stacks.len();
    let mut order: Vec<u32> = Vec::new();
    let mut by_pid: HashMap<u32, Vec<RawStackCount>> = HashMap::new();
    for stack in stacks {
        let pid = stack.sample.pid;
        by_pid
            .entry(pid)
            .or_insert_with(|| {
                order.push(pid);
                Vec::new()
            })
            .push(stack);
    }
    let mut queues: Vec<std::vec::IntoIter<RawStackCount>> = order
        .iter()
        .filter_map(|pid| by_pid.remove(pid))
        .map(|mut mine| {
            // Stable: stacks of equal weight keep their order of arrival.
            mine.sort_by_key(|s| std::cmp::Reverse(s.count));
            mine.into_iter()
        })
        .collect();
    let mut fair = Vec::with_capacity(total);
    while fair.len() < total {
        for queue in &mut queues {
            fair.extend(queue.next());
        }
    }
    fair
}

/// What makes two CPU samples the same stack in the profile: everything
/// that becomes a frame or a label.
fn same_key(a: &RawSample, b: &RawSample) -> bool {
    a.pid == b.pid
        && a.tid == b.tid
        && a.kind == b.kind
        && a.kernel_stack_truncated == b.kernel_stack_truncated
        && a.user_stack_truncated == b.user_stack_truncated
        && a.thread_name == b.thread_name
        && a.kernel_stack == b.kernel_stack
        && a.user_stack == b.user_stack
}

fn key_hash(sample: &RawSample) -> u64 {
    let mut hasher = XxHash3_64::default();
    hasher.write_u32(sample.pid);
    hasher.write_u32(sample.tid);
    hasher.write_u8(u8::from(sample.kernel_stack_truncated));
    hasher.write_u8(u8::from(sample.user_stack_truncated));
    hasher.write(sample.thread_name.as_bytes());
    hasher.write_usize(sample.kernel_stack.len());
    for &addr in &sample.kernel_stack {
        hasher.write_u64(addr);
    }
    for &addr in &sample.user_stack {
        hasher.write_u64(addr);
    }
    hasher.finish()
}

/// Naming the window's raw CPU stacks: at its end, or early for the
/// stacks whose names cannot change.
impl super::Pipeline {
    /// Names each distinct raw CPU stack of the window once (after one more
    /// read of the perf maps of their processes) and adds it with its
    /// sample count and summed period. With `until` (the end of a
    /// recording), the stacks are named in [`raw_stacks::fair_order`] up to
    /// that time, or a second stop request; the rest are added under one
    /// [`NOT_NAMED_IN_TIME`] frame and counted: no sample is lost.
    pub(super) fn name_raw_stacks(&mut self, until: Option<std::time::Instant>) {
        // Each process's memory lookups get their window's budget again.
        crate::clr::memory::budget::global().new_window();
        let mut stacks = self.raw_cpu.take();
        self.summary.naming.stacks += stacks.len() as u64;
        if until.is_some() {
            stacks = fair_order(stacks);
        }
        let pids: HashSet<u32> = stacks.iter().map(|s| s.sample.pid).collect();
        for pid in pids {
            if let Some(process) = self.processes.get_mut(&pid) {
                process.refresh_names(true);
            }
        }
        let out_of_time = || {
            until.is_some_and(|until| crate::stop::hurry() || std::time::Instant::now() >= until)
        };
        let mut stacks = stacks.into_iter();
        for stack in stacks.by_ref() {
            self.add_counted(&stack.sample, stack.count, true);
            if out_of_time() {
                break;
            }
        }
        for stack in stacks {
            self.add_not_named(&stack.sample, stack.count);
        }
    }

    /// Adds `count` samples of a raw CPU stack the end had no time to
    /// name, with their labels and values, under [`NOT_NAMED_IN_TIME`].
    fn add_not_named(&mut self, sample: &RawSample, count: u64) {
        let Self {
            processes,
            aggregator,
            summary,
            stack,
            layout,
            ..
        } = self;
        let Some(process) = processes.get_mut(&sample.pid) else {
            return;
        };
        summary.samples += count;
        summary.not_named_in_time.stacks += 1;
        summary.not_named_in_time.samples += count;
        stack.clear();
        stack.push(aggregator.intern(&crate::profile::Frame::synthetic(NOT_NAMED_IN_TIME)));
        let tid = i64::from(sample.tid);
        let labels = labels::sample_labels(process, Some(tid), Some(&sample.thread_name));
        aggregator.add(stack, labels, &layout.on_cpu(count, sample.value));
    }

    /// Every [`NATIVE_STACKS_NAMED_EVERY`], names and adds the raw CPU
    /// stacks whose names cannot change before the window ends: those of
    /// processes without a runtime whose user addresses all lie in files
    /// (no JIT code, which a perf map read later would name). Their counts
    /// merge in the aggregator with the same stack named earlier, so the
    /// profile is the one naming them at the end gives.
    pub(super) fn name_native_stacks(&mut self) {
        if self.native_stacks_named_at.elapsed() < NATIVE_STACKS_NAMED_EVERY {
            return;
        }
        let started = std::time::Instant::now();
        self.native_stacks_named_at = started;
        let pids: Vec<u32> = self
            .raw_cpu
            .pids()
            .filter(|pid| {
                self.processes
                    .get(pid)
                    .is_some_and(|p| p.selected && p.runtime().is_none())
            })
            .collect();
        for pid in pids {
            let Some(process) = self.processes.get(&pid) else {
                continue;
            };
            let in_files = |sample: &RawSample| {
                sample.user_stack.iter().all(|&addr| {
                    process
                        .mapping_for(addr)
                        .is_some_and(|m| m.file_path().is_some())
                })
            };
            for stack in self.raw_cpu.take_pid_if(pid, in_files) {
                self.summary.naming.stacks += 1;
                self.add_counted(&stack.sample, stack.count, true);
            }
        }
        self.summary.naming.before_end += started.elapsed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(time_ns: u64, tid: u32, user_stack: Vec<u64>) -> RawSample {
        RawSample {
            value: 10,
            kernel_stack: vec![0xffff_0001],
            ..RawSample::on_cpu(7, tid, time_ns, user_stack)
        }
    }

    #[test]
    fn equal_stacks_count_once_and_sum_their_periods() {
        let mut raw = RawStacks::default();
        raw.add(sample(5, 1, vec![1, 2]));
        raw.add(sample(9, 1, vec![1, 2]));
        raw.add(sample(7, 1, vec![1, 2]));
        raw.add(sample(6, 2, vec![1, 2]));
        raw.add(sample(8, 1, vec![1, 3]));
        assert_eq!((raw.len(), raw.samples()), (3, 5));
        let taken = raw.take();
        assert_eq!(taken[0].count, 3);
        assert_eq!(taken[0].sample.value, 30);
        assert_eq!(taken[0].sample.time_ns, 9, "named as of the latest sample");
        assert_eq!(taken[1].sample.tid, 2, "another thread is another stack");
        assert_eq!(taken[2].sample.user_stack, vec![1, 3]);
        assert!(raw.is_empty() && raw.samples() == 0);
    }

    #[test]
    fn an_exited_process_takes_its_stacks_and_leaves_the_others() {
        let mut raw = RawStacks::default();
        raw.add(sample(1, 1, vec![1]));
        let mut other = sample(2, 1, vec![1]);
        other.pid = 8;
        raw.add(other.clone());
        raw.add(sample(3, 1, vec![2]));
        let mine = raw.take_pid(7);
        assert_eq!(mine.len(), 2);
        assert_eq!(mine[1].sample.user_stack, vec![2], "in order of arrival");
        assert_eq!((raw.len(), raw.samples()), (1, 1));
        raw.add(other);
        assert_eq!(
            (raw.len(), raw.samples()),
            (1, 2),
            "the index still finds it"
        );
    }

    #[test]
    fn the_window_keeps_the_order_of_arrival_across_processes() {
        let mut raw = RawStacks::default();
        for (pid, leaf) in [(7, 1), (8, 2), (7, 3), (9, 4), (8, 5)] {
            let mut s = sample(1, 1, vec![leaf]);
            s.pid = pid;
            raw.add(s);
        }
        assert_eq!(raw.processes(), (3, Some((7, 2))));
        let leaves: Vec<u64> = raw.take().iter().map(|e| e.sample.user_stack[0]).collect();
        assert_eq!(leaves, [1, 2, 3, 4, 5]);
        assert_eq!(raw.processes(), (0, None));
    }

    #[test]
    fn the_stacks_that_can_be_named_early_leave_and_the_others_stay_found() {
        let mut raw = RawStacks::default();
        raw.add(sample(1, 1, vec![1]));
        raw.add(sample(2, 1, vec![2]));
        raw.add(sample(3, 1, vec![1]));
        let early = raw.take_pid_if(7, |s| s.user_stack == [2]);
        assert_eq!(early.len(), 1);
        assert_eq!((raw.len(), raw.samples()), (1, 2));
        raw.add(sample(4, 1, vec![1]));
        assert_eq!(
            (raw.len(), raw.samples()),
            (1, 3),
            "the index still finds it"
        );
        assert_eq!(raw.take_pid_if(7, |_| true).len(), 1);
        assert_eq!(raw.processes(), (0, None));
    }

    #[test]
    fn the_fair_order_takes_each_process_in_turn_heaviest_first() {
        let mut raw = RawStacks::default();
        for i in 0..4 {
            let mut crafted = sample(i, 1, vec![100 + i]);
            crafted.pid = 9;
            raw.add(crafted);
        }
        raw.add(sample(5, 1, vec![1]));
        for t in 6..9 {
            raw.add(sample(t, 1, vec![2]));
        }
        let fair = fair_order(raw.take());
        let order: Vec<(u32, u64)> = fair
            .iter()
            .map(|s| (s.sample.pid, s.sample.user_stack[0]))
            .collect();
        assert_eq!(
            order,
            [(9, 100), (7, 2), (9, 101), (7, 1), (9, 102), (9, 103)],
            "turns by first arrival; the app's heavier stack first"
        );
    }

    #[test]
    fn a_stack_that_only_ends_the_same_is_another_stack() {
        let mut raw = RawStacks::default();
        raw.add(sample(1, 1, vec![1, 2]));
        raw.add(sample(1, 1, vec![1, 2, 3]));
        let mut truncated = sample(1, 1, vec![1, 2]);
        truncated.user_stack_truncated = true;
        raw.add(truncated);
        assert_eq!(raw.len(), 3);
    }
}
