//! [`UnwindMaps`] on a thread of its own ([`UnwindWorker`]): the record
//! loop sends it processes to index, JIT code and stack copies, and it
//! does its periodic work (held processes, exits, young processes'
//! rescans, JIT table rebuilds) between requests.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clrbpf_common::unwind::UnwindError;

use super::{
    UnwindMaps, UnwindMapsStats, UnwindMemory,
    stack_copies::{CopiesOut, CopyReplayer, ReplayedCopy, SentCopy, StackCopyStats},
    table_times::ProcessTableTimes,
};
use crate::{
    profile::RawSample,
    unwind::{disk_cache::DiskCacheStats, jit_code::JitMethod, stack_copy::CopiedSample},
};

/// What the record loop asks of the [`UnwindWorker`].
enum UnwindRequest {
    Track(u32),
    Refresh(u32),
    Forget(u32),
    /// New JIT-compiled code: `(start, end)` ranges, and how many more
    /// ranges were dropped before they were sent.
    JitCode(u32, Vec<JitMethod>, u64),
    /// Work of the start of a recording ([`super::start_tables`]).
    Run(WorkerJob),
    /// Samples with a copied user stack, to unwind once their process is
    /// indexed ([`super::stack_copies`]).
    StackCopies(Vec<SentCopy>),
    /// Wakes the thread to see [`EndSignal`].
    End,
    /// Index processes seen from now on only this long after.
    HoldNew(Duration),
}

/// Work run on the [`UnwindWorker`]'s thread, with the flag set when the
/// recording ends (the work stops early then).
pub(super) type WorkerJob = Box<dyn FnOnce(&mut UnwindMaps, &AtomicBool) + Send>;

/// What the worker knows when it stops: for the end summary.
#[derive(Clone, Debug, Default)]
pub struct UnwindReport {
    /// Kernel-side walks ended by each error kind.
    pub errors: Vec<(UnwindError, u64)>,
    pub memory: UnwindMemory,
    pub stats: UnwindMapsStats,
    /// What the tables kept between runs did (`None`: no cache).
    pub disk_cache: Option<DiskCacheStats>,
    /// How long the processes exec'd meanwhile waited for their tables.
    pub new_processes: Vec<ProcessTableTimes>,
}

/// The end of a recording, as the thread sees it before each request.
#[derive(Default)]
struct EndSignal {
    /// Set first thing at the end: the thread gives back the copies it
    /// holds, answers, and leaves whatever is still queued (a saturated
    /// host queues hundreds of processes to index and thousands of copies,
    /// which the end does not wait for); work under way stops early.
    ending: AtomicBool,
    /// Where to answer once the copies are given back.
    answer: std::sync::Mutex<Option<std::sync::mpsc::Sender<()>>>,
}

impl EndSignal {
    /// Asks for the end, to be answered on `answer`.
    fn begin(&self, answer: std::sync::mpsc::Sender<()>) {
        if let Ok(mut slot) = self.answer.lock() {
            *slot = Some(answer);
        }
        // After the slot: the thread that sees the flag finds the answer.
        self.ending.store(true, Ordering::Release);
    }

    fn is_ending(&self) -> bool {
        self.ending.load(Ordering::Acquire)
    }

    fn answer(&self) {
        if let Some(answer) = self.answer.lock().ok().and_then(|mut slot| slot.take()) {
            let _ = answer.send(());
        }
    }
}

/// How long [`UnwindWorker::finish`] waits for the table being built.
const FINISH_WAIT: Duration = Duration::from_secs(1);

/// [`UnwindMaps`] on a thread of its own. Indexing a .NET process builds
/// tables for libcoreclr, libclrjit, ICU and the rest: seconds of CPU on a
/// busy machine, which must not stall the loop that drains the ring buffer
/// and reads a short-lived process's maps while it is alive. Until a
/// process's index is written, the kernel side walks it by frame pointers.
pub struct UnwindWorker {
    requests: Option<std::sync::mpsc::Sender<UnwindRequest>>,
    /// Set by [`Self::finish`]: the requests still queued are dropped (a
    /// saturated host can queue hundreds of processes to index, which the
    /// end of a recording must not wait for).
    stop: Arc<AtomicBool>,
    /// Set by [`Self::flush_stack_copies`] (or [`Self::finish`]).
    end: Arc<EndSignal>,
    /// The flush was not answered in time: [`Self::finish`] does not wait.
    busy_at_end: bool,
    thread: Option<std::thread::JoinHandle<UnwindReport>>,
    /// Kernel memory of the row chunks and indexes, as the thread last saw.
    kernel_bytes: Arc<AtomicU64>,
    /// Samples of copied stacks, unwound (or given back) by the thread.
    replayed: std::sync::mpsc::Receiver<Vec<ReplayedCopy>>,
    /// The copies sent and not answered yet, with their frame-pointer
    /// walks.
    copies: CopiesOut,
    /// Samples of copies done with, for [`Self::take_replayed`].
    copies_done: Vec<RawSample>,
}

impl UnwindWorker {
    /// Moves `maps` to a new thread.
    pub fn spawn(maps: UnwindMaps) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<UnwindRequest>();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let end = Arc::new(EndSignal::default());
        let end_seen = Arc::clone(&end);
        let kernel_bytes = Arc::new(AtomicU64::new(0));
        let kernel_bytes_seen = Arc::clone(&kernel_bytes);
        let (replayed_tx, replayed) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("clrbpf-unwind".into())
            .spawn(move || {
                crate::process::priority::enter_background_thread();
                let mut maps = maps;
                let mut copies = CopyReplayer::new(replayed_tx);
                loop {
                    if stop_flag.load(Ordering::Relaxed) {
                        break;
                    }
                    if end_seen.is_ending() {
                        // Ahead of what is still queued: the record loop
                        // keeps the walks of the copies sent since.
                        copies.replay(&mut maps, true);
                        end_seen.answer();
                        break;
                    }
                    match rx.recv_timeout(maps.next_wake().min(copies.next_wake())) {
                        Ok(UnwindRequest::End) => {}
                        Ok(UnwindRequest::Track(pid)) => {
                            maps.track_process(pid);
                        }
                        Ok(UnwindRequest::Refresh(pid)) => {
                            maps.refresh_process(pid);
                        }
                        Ok(UnwindRequest::Forget(pid)) => {
                            copies.forget(pid);
                            maps.forget_process(pid);
                        }
                        Ok(UnwindRequest::JitCode(pid, ranges, dropped)) => {
                            maps.add_jit_code(pid, &ranges);
                            maps.stats.jit_not_decoded += dropped;
                        }
                        Ok(UnwindRequest::Run(work)) => work(&mut maps, &end_seen.ending),
                        Ok(UnwindRequest::StackCopies(batch)) => {
                            copies.add(&mut maps, batch, &end_seen.ending);
                        }
                        Ok(UnwindRequest::HoldNew(delay)) => maps.hold_new = delay,
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                    maps.index_held();
                    maps.rescan_code_mapped();
                    copies.replay(&mut maps, false);
                    maps.forget_exited();
                    maps.rescan_young();
                    maps.rebuild_jit_tables();
                    maps.trim_heap_after_loads();
                    let memory = maps.memory();
                    kernel_bytes_seen.store(
                        memory.allocated_bytes + memory.index_bytes,
                        Ordering::Relaxed,
                    );
                }
                // The agent has no summary: its log gets the processes
                // still running too.
                maps.times.finish_all();
                UnwindReport {
                    errors: maps.error_counts(),
                    memory: maps.memory(),
                    stats: maps.stats(),
                    disk_cache: maps.builder.disk_stats(),
                    new_processes: maps.times.report(),
                }
            })?;
        Ok(Self {
            requests: Some(tx),
            stop,
            end,
            busy_at_end: false,
            thread: Some(thread),
            kernel_bytes,
            replayed,
            copies: CopiesOut::default(),
            copies_done: Vec::new(),
        })
    }

    /// Kernel memory held for unwinding now: the row chunks created and
    /// the process indexes.
    pub fn kernel_memory_bytes(&self) -> u64 {
        self.kernel_bytes.load(Ordering::Relaxed)
    }

    fn send(&self, request: UnwindRequest) {
        if let Some(tx) = &self.requests {
            // A send fails only when the thread is gone (it panicked): the
            // kernel side then keeps walking by frame pointers.
            let _ = tx.send(request);
        }
    }

    /// Runs `work` on the thread after the requests queued before it (the
    /// maps, and the flag the end of the recording sets).
    pub(super) fn run(&self, work: WorkerJob) {
        self.send(UnwindRequest::Run(work));
    }

    /// Index a process seen for the first time (queued; returns at once).
    pub fn track_process(&self, pid: u32) {
        self.send(UnwindRequest::Track(pid));
    }

    /// Re-read a process's mappings (a walk met a pc in none of them).
    pub fn refresh_process(&self, pid: u32) {
        self.send(UnwindRequest::Refresh(pid));
    }

    pub fn forget_process(&self, pid: u32) {
        self.send(UnwindRequest::Forget(pid));
    }

    /// Give rows to the JIT-compiled code at the `(start, end)` ranges of
    /// `pid` (methods just seen in its perf map, jitdump or events);
    /// `dropped` more were not kept to be sent.
    pub fn add_jit_code(&self, pid: u32, ranges: Vec<JitMethod>, dropped: u64) {
        if !ranges.is_empty() || dropped > 0 {
            self.send(UnwindRequest::JitCode(pid, ranges, dropped));
        }
    }

    /// Unwind the copied user stacks of `copies` once their processes are
    /// indexed ([`Self::take_replayed`] gives them back).
    pub fn replay_stack_copies(&mut self, copies: Vec<CopiedSample>) {
        if copies.is_empty() {
            return;
        }
        let sent = self.copies.send(copies, &mut self.copies_done);
        if !sent.is_empty() {
            self.send(UnwindRequest::StackCopies(sent));
        }
    }

    /// The samples of copied stacks done with: unwound, or with their
    /// frame-pointer walk when their tables never came (or too many bytes
    /// were held).
    pub fn take_replayed(&mut self) -> Vec<RawSample> {
        let answers: Vec<ReplayedCopy> = self.replayed.try_iter().flatten().collect();
        self.copies.answered(answers, &mut self.copies_done);
        std::mem::take(&mut self.copies_done)
    }

    /// The end of a recording: has every copy sent unwound or given back
    /// now, waiting at most `wait` for the thread; the ones it has not
    /// answered by then keep their frame-pointer walks
    /// ([`Self::take_replayed`] gives them all).
    pub fn flush_stack_copies(&mut self, wait: Duration) {
        let (done, answered) = std::sync::mpsc::channel();
        self.end.begin(done);
        self.send(UnwindRequest::End);
        let started = Instant::now();
        self.busy_at_end = answered.recv_timeout(wait).is_err();
        let answers: Vec<ReplayedCopy> = self.replayed.try_iter().flatten().collect();
        self.copies.answered(answers, &mut self.copies_done);
        let unanswered = self.copies.outstanding();
        self.copies_done.extend(self.copies.abandon());
        tracing::debug!(
            waited = ?started.elapsed(),
            busy = self.busy_at_end,
            unanswered,
            "stack copies flushed"
        );
    }

    /// What became of the copied stacks so far.
    pub fn stack_copy_stats(&self) -> StackCopyStats {
        self.copies.stats()
    }

    /// Index the processes first seen from now on only `delay` after
    /// (`--hold-new-processes-ms`, for tests): the wait a saturated worker
    /// or a cold cache gives a new process, made certain.
    pub fn hold_new_processes(&self, delay: Duration) {
        if !delay.is_zero() {
            self.send(UnwindRequest::HoldNew(delay));
        }
    }

    /// Stops the thread once the request under way is done (the queued
    /// ones are dropped) and returns what it counted; `None` if it
    /// panicked. Call before the sampler (the owner of the programs) is
    /// dropped, so the error counters are read while the maps are still
    /// loaded.
    pub fn finish(mut self) -> Option<UnwindReport> {
        self.end.ending.store(true, Ordering::Release);
        self.stop.store(true, Ordering::Relaxed);
        self.requests = None;
        let thread = self.thread.take()?;
        // One table can take seconds to build on a saturated host: the
        // recording does not wait for it (the thread ends by itself after),
        // nor at all when the thread did not answer the flush.
        if !self.busy_at_end {
            crate::stop::wait_until(Instant::now() + FINISH_WAIT, || thread.is_finished());
        }
        if !thread.is_finished() {
            tracing::debug!("the unwind table thread is still busy: no unwind report");
            return None;
        }
        thread.join().ok()
    }
}

impl Drop for UnwindWorker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.requests = None;
        if let Some(thread) = self.thread.take()
            && thread.is_finished()
        {
            let _ = thread.join();
        }
    }
}
