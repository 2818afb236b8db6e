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
    /// The process being indexed now (0: none).
    current: AtomicU32,
    /// Whether the worker is through the list (or stopped in it).
    finished: AtomicBool,
    done: Mutex<Vec<u32>>,
}

impl StartIndexing {
    /// `pids` in the order to index them.
    pub fn new(pids: Vec<u32>) -> Self {
        Self {
            done: Mutex::new(Vec::with_capacity(pids.len())),
            pids,
            current: AtomicU32::new(0),
            finished: AtomicBool::new(false),
        }
    }

    /// Every process to index, in order.
    pub fn pids(&self) -> &[u32] {
        &self.pids
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

    /// Whether the worker went through the whole list (or was stopped).
    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Relaxed)
    }

    /// Indexes the processes in order (on the worker's thread) until the
    /// list ends or `stop` is set.
    fn run(&self, maps: &mut UnwindMaps, stop: &AtomicBool) {
        for &pid in &self.pids {
            if stop.load(Ordering::Relaxed) {
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
        let start = StartIndexing::new(vec![5, 6, 7]);
        assert_eq!(start.pids(), &[5, 6, 7]);
        assert!(!start.is_finished() && start.current().is_none());
        start.done.lock().expect("unpoisoned").push(5);
        assert_eq!((start.done(), start.done_count()), (vec![5], 1));
    }
}
