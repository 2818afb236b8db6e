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

use std::{collections::HashMap, hash::Hasher as _};

use twox_hash::XxHash3_64;

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

/// The distinct raw stacks of the current window.
#[derive(Debug, Default)]
pub struct RawStacks {
    /// Key hash to indices into `entries` (collisions are compared in full).
    by_hash: HashMap<u64, Vec<usize>>,
    /// In order of first arrival, so the output is deterministic.
    entries: Vec<RawStackCount>,
    samples: u64,
}

impl RawStacks {
    /// Counts `sample` (an on-CPU one) under its raw stack; returns the
    /// sample when its stack is new, so the caller can make sure now, while
    /// the process lives, that its addresses can be named later.
    pub fn add(&mut self, sample: RawSample) -> Option<&RawSample> {
        self.samples += 1;
        let hash = key_hash(&sample);
        let slots = self.by_hash.entry(hash).or_default();
        if let Some(&at) = slots
            .iter()
            .find(|&&at| same_key(&self.entries[at].sample, &sample))
        {
            let entry = &mut self.entries[at];
            entry.count += 1;
            entry.sample.value = entry.sample.value.saturating_add(sample.value);
            entry.sample.time_ns = entry.sample.time_ns.max(sample.time_ns);
            return None;
        }
        slots.push(self.entries.len());
        self.entries.push(RawStackCount { sample, count: 1 });
        self.entries.last().map(|entry| &entry.sample)
    }

    /// Distinct stacks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Samples counted since the last [`Self::take`].
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The distinct stacks of process `pid` (it exited: they are named
    /// before its symbols go); the others stay.
    pub fn take_pid(&mut self, pid: u32) -> Vec<RawStackCount> {
        if !self.entries.iter().any(|e| e.sample.pid == pid) {
            return Vec::new();
        }
        let (mine, others): (Vec<RawStackCount>, Vec<RawStackCount>) =
            std::mem::take(&mut self.entries)
                .into_iter()
                .partition(|e| e.sample.pid == pid);
        self.samples -= mine.iter().map(|e| e.count).sum::<u64>();
        self.by_hash.clear();
        for (at, entry) in others.iter().enumerate() {
            self.by_hash
                .entry(key_hash(&entry.sample))
                .or_default()
                .push(at);
        }
        self.entries = others;
        mine
    }

    /// Every distinct stack of the window, in order of first arrival; the
    /// next window starts empty.
    pub fn take(&mut self) -> Vec<RawStackCount> {
        self.by_hash.clear();
        self.samples = 0;
        std::mem::take(&mut self.entries)
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
        assert_eq!((raw.len(), raw.samples()), (1, 1));
        raw.add(other);
        assert_eq!(
            (raw.len(), raw.samples()),
            (1, 2),
            "the index still finds it"
        );
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
