//! The unwind tables of the processes a recording knows at its start, loaded
//! before its first sample: between [`super::Sampler::load`] and
//! [`super::Sampler::start_sampling`], the [`super::UnwindWorker`] indexes
//! them in order ([`StartIndexing`]) while the record loop waits for it, a
//! bounded time ([`crate::pipeline::start_tables`]). Without this, the
//! first waits and CPU samples of a `-p` process were walked by frame
//! pointers and lost the callers of frameless framework code.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicBool, AtomicU32, Ordering},
};

use super::{UnwindMaps, UnwindWorker};

impl UnwindWorker {
    /// Index the processes known at the start of a recording, in order
    /// (queued; `start` tells how far the worker has come).
    pub fn index_at_start(&self, start: Arc<StartIndexing>) {
        self.run(Box::new(move |maps, stop| start.run(maps, stop)));
    }

    /// Load `pid`'s JIT table from the code sent so far without waiting
    /// for its rebuild period (queued; `done` is set once it is).
    pub fn jit_table_now(&self, pid: u32, done: Arc<AtomicBool>) {
        self.run(Box::new(move |maps, _| {
            maps.load_jit_table_now(pid);
            done.store(true, Ordering::Relaxed);
        }));
    }
}

/// The processes to index before sampling starts, in order, and how far the
/// worker has come. Shared by the waiting loop and the worker thread.
#[derive(Debug)]
pub struct StartIndexing {
    pids: Vec<u32>,
    /// The first `kept_after_wait` pids are indexed even after the wait
    /// ended ([`Self::end_wait`]); the others are left to their first
    /// sample then (whole-host mode's processes that are not .NET).
    kept_after_wait: usize,
    wait_over: AtomicBool,
    /// The process being indexed now (0: none).
    current: AtomicU32,
    /// Whether the worker is through the list (or stopped in it).
    finished: AtomicBool,
    done: Mutex<Vec<u32>>,
}

impl StartIndexing {
    /// `pids` in the order to index them; the first `kept_after_wait` are
    /// indexed in any case.
    pub fn new(pids: Vec<u32>, kept_after_wait: usize) -> Self {
        let kept_after_wait = kept_after_wait.min(pids.len());
        Self {
            done: Mutex::new(Vec::with_capacity(pids.len())),
            pids,
            kept_after_wait,
            wait_over: AtomicBool::new(false),
            current: AtomicU32::new(0),
            finished: AtomicBool::new(false),
        }
    }

    /// Every process to index, in order.
    pub fn pids(&self) -> &[u32] {
        &self.pids
    }

    /// How many of [`Self::pids`] must be ready before sampling starts.
    pub fn kept_after_wait(&self) -> usize {
        self.kept_after_wait
    }

    /// The recording stops waiting: the processes past
    /// [`Self::kept_after_wait`] not indexed yet are skipped.
    pub fn end_wait(&self) {
        self.wait_over.store(true, Ordering::Relaxed);
    }

    /// The pids indexed so far (gone processes included: nothing is left
    /// to do for them).
    pub fn done(&self) -> Vec<u32> {
        self.done.lock().map(|d| d.clone()).unwrap_or_default()
    }

    /// How many are done.
    pub fn done_count(&self) -> usize {
        self.done.lock().map_or(0, |d| d.len())
    }

    /// The process being indexed now.
    pub fn current(&self) -> Option<u32> {
        Some(self.current.load(Ordering::Relaxed)).filter(|&pid| pid != 0)
    }

    /// Whether the worker went through the whole list, or every process
    /// that must be ready is.
    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Relaxed)
    }

    /// Indexes the processes in order (on the worker's thread) until the
    /// list ends, `stop` is set, or the wait is over and only processes
    /// past [`Self::kept_after_wait`] are left.
    fn run(&self, maps: &mut UnwindMaps, stop: &AtomicBool) {
        for (i, &pid) in self.pids.iter().enumerate() {
            if stop.load(Ordering::Relaxed)
                || (i >= self.kept_after_wait && self.wait_over.load(Ordering::Relaxed))
            {
                break;
            }
            self.current.store(pid, Ordering::Relaxed);
            maps.track_process(pid);
            if let Ok(mut done) = self.done.lock() {
                done.push(pid);
            }
        }
        self.current.store(0, Ordering::Relaxed);
        self.finished.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_keeps_its_order_and_bound() {
        let start = StartIndexing::new(vec![5, 6, 7], 1);
        assert_eq!(start.pids(), &[5, 6, 7]);
        assert!(!start.is_finished() && start.current().is_none());
        start.done.lock().expect("unpoisoned").push(5);
        assert_eq!((start.done(), start.done_count()), (vec![5], 1));
        assert_eq!(StartIndexing::new(vec![1], 9).kept_after_wait(), 1);
    }
}
