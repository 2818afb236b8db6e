//! The copied user stacks of processes that had no unwind tables when
//! they were sampled (`profiler-ebpf/src/stack_copy.rs`), held on the
//! unwind worker's thread until the process is indexed, then walked with
//! the index and rows the kernel holds
//! ([`crate::unwind::stack_copy::replay`]) and handed back to the
//! pipeline as ordinary samples. A copy whose walk still meets code
//! outside the index waits for a rescan, a bounded time; one whose tables
//! never come (the process exited first, the worker is saturated) keeps
//! the kernel's frame-pointer walk, counted. Held copies are bounded in
//! bytes.
//!
//! The record loop keeps the frame-pointer walk of every copy it sent
//! ([`CopiesOut`]): the end of a recording takes back what the worker
//! answered by then and keeps those walks for the rest. On a saturated
//! host the worker can be seconds behind (hundreds of processes to index
//! at a few percent of a CPU), and the end neither waits for it nor loses
//! the samples it still holds.

use std::{
    collections::HashMap,
    sync::mpsc::Sender,
    time::{Duration, Instant},
};

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use clrbpf_common::{
    RawSampleEvent, STACK_COPY_BYTES, STACK_COPY_RECORD_HEADER, SampleKind, StackCopyHeader,
    unwind::UnwindError,
};

use super::unwind_maps::UnwindMaps;
use crate::{
    profile::RawSample,
    unwind::stack_copy::{CopiedSample, replay},
};

/// Bytes of copies held at most (16 KiB of stack each, so about 2,000
/// samples): past it, new copies keep their frame-pointer walk.
const MAX_HELD_BYTES: usize = 32 << 20;
/// How long a copy waits for its process's tables, or for a rescan that
/// indexes the code its walk met outside the index.
const WAIT_FOR_TABLES: Duration = Duration::from_secs(5);
/// How often held copies are tried again.
const RETRY_EVERY: Duration = Duration::from_millis(100);

/// What became of the copied stacks, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackCopyStats {
    /// Walked with the tables.
    pub unwound: u64,
    /// Of those, walks that still met code outside the index (after
    /// [`WAIT_FOR_TABLES`]) and stepped it by frame pointer.
    pub unwound_unindexed: u64,
    /// Kept with the frame-pointer walk: the process was not indexed in
    /// time (or the worker had not come to it when the recording ended).
    pub without_tables: u64,
    /// Kept with the frame-pointer walk: too many bytes held.
    pub over_memory: u64,
}

/// A copy on its way to the worker, with the number [`CopiesOut`] gave it.
pub(super) struct SentCopy {
    pub id: u64,
    pub copy: CopiedSample,
}

/// What the worker did with a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CopyOutcome {
    /// Walked with the tables; `unindexed`: the walk still met code
    /// outside the index and stepped it by frame pointer.
    Unwound { unindexed: bool },
    /// Given back with its frame-pointer walk: no tables in time.
    WithoutTables,
}

/// A copy the worker is done with: its sample, unwound or not.
pub(super) struct ReplayedCopy {
    pub id: u64,
    pub sample: RawSample,
    pub outcome: CopyOutcome,
}

/// A copy and when it came.
struct HeldCopy {
    id: u64,
    copy: CopiedSample,
    since: Instant,
}

/// The copies waiting for their processes' tables (the worker's side).
pub(super) struct CopyReplayer {
    waiting: HashMap<u32, Vec<HeldCopy>>,
    done: Sender<Vec<ReplayedCopy>>,
}

impl CopyReplayer {
    pub(super) fn new(done: Sender<Vec<ReplayedCopy>>) -> Self {
        Self {
            waiting: HashMap::new(),
            done,
        }
    }

    /// When the held copies should be tried again.
    pub(super) fn next_wake(&self) -> Duration {
        if self.waiting.is_empty() {
            Duration::MAX
        } else {
            RETRY_EVERY
        }
    }

    /// Holds `copies` and indexes their processes now (the record loop
    /// asked for it too, but its request may be queued behind others).
    /// [`CopiesOut`] bounds the bytes sent, so none is refused here. Once
    /// `ending` is set (the end of a recording, which takes back the copies
    /// it does not wait for), no more processes are indexed.
    pub(super) fn add(
        &mut self,
        maps: &mut UnwindMaps,
        copies: Vec<SentCopy>,
        ending: &AtomicBool,
    ) {
        let now = Instant::now();
        for SentCopy { id, copy } in copies {
            let pid = copy.sample.pid;
            let held = self.waiting.entry(pid).or_default();
            if held.is_empty() && !ending.load(Ordering::Relaxed) {
                maps.track_process(pid);
            }
            held.push(HeldCopy {
                id,
                copy,
                since: now,
            });
        }
        self.replay(maps, false);
    }

    /// The process `pid` ended (or its pid went to another process, its
    /// exit lost): its held copies go back with their frame-pointer walks
    /// now, never to be replayed against the tables of whichever process
    /// holds the pid next.
    pub(super) fn forget(&mut self, pid: u32) {
        let Some(held) = self.waiting.remove(&pid) else {
            return;
        };
        let out = held
            .into_iter()
            .map(|h| ReplayedCopy {
                id: h.id,
                sample: h.copy.sample,
                outcome: CopyOutcome::WithoutTables,
            })
            .collect();
        self.give_back(out);
    }

    /// Walks the held copies of the processes indexed now; with `all`
    /// (the end of a recording), gives back every other one with its
    /// frame-pointer walk.
    pub(super) fn replay(&mut self, maps: &mut UnwindMaps, all: bool) {
        if self.waiting.is_empty() {
            return;
        }
        let mut out = Vec::new();
        let mut rescan = Vec::new();
        let reader = maps.row_reader();
        for (&pid, held) in &mut self.waiting {
            let index = maps.kernel_index(pid);
            // A process that exited before it was indexed never will be:
            // its samples go back now, while the pipeline still knows the
            // process and can name their frame-pointer walks.
            let gone = index.is_none() && std::fs::metadata(format!("/proc/{pid}")).is_err();
            let mut kept = Vec::new();
            for h in held.drain(..) {
                let waited = h.since.elapsed() >= WAIT_FOR_TABLES || all || gone;
                let Some((mappings, scanned_at)) = index.as_ref() else {
                    if waited {
                        out.push(ReplayedCopy {
                            id: h.id,
                            sample: h.copy.sample,
                            outcome: CopyOutcome::WithoutTables,
                        });
                    } else {
                        kept.push(h);
                    }
                    continue;
                };
                let walk = replay(&h.copy, mappings, |i| reader.row(i));
                if walk.unindexed && !waited && *scanned_at < h.since {
                    // Code mapped after the last scan (a runtime maps its
                    // libraries and images in its first second): wait
                    // for a scan after the copy came.
                    rescan.push(pid);
                    kept.push(h);
                    continue;
                }
                let mut sample = h.copy.sample;
                sample.user_stack_truncated = walk.error == Some(UnwindError::TooDeep);
                sample.user_stack = walk.frames;
                out.push(ReplayedCopy {
                    id: h.id,
                    sample,
                    outcome: CopyOutcome::Unwound {
                        unindexed: walk.unindexed,
                    },
                });
            }
            *held = kept;
        }
        drop(reader);
        self.waiting.retain(|_, held| !held.is_empty());
        rescan.dedup();
        for pid in rescan {
            maps.refresh_process(pid);
        }
        self.give_back(out);
    }

    fn give_back(&self, copies: Vec<ReplayedCopy>) {
        if !copies.is_empty() {
            // The receiver is gone only when the recording is over.
            let _ = self.done.send(copies);
        }
    }
}

/// The record loop's side of the copies: the frame-pointer walk of each
/// one sent to the worker and not answered yet, the bytes they hold on
/// their way and in the worker, and what became of them.
#[derive(Default)]
pub(super) struct CopiesOut {
    next_id: u64,
    /// By id: the sample as the kernel walked it, and the bytes its copy
    /// holds.
    fallbacks: HashMap<u64, (RawSample, usize)>,
    bytes: usize,
    stats: StackCopyStats,
}

impl CopiesOut {
    /// Numbers `copies` for the worker, keeping each one's frame-pointer
    /// walk; past [`MAX_HELD_BYTES`] on their way or held (a worker that
    /// falls behind), a copy keeps its walk at once, into `kept`.
    pub(super) fn send(
        &mut self,
        copies: Vec<CopiedSample>,
        kept: &mut Vec<RawSample>,
    ) -> Vec<SentCopy> {
        let mut sent = Vec::with_capacity(copies.len());
        for copy in copies {
            let bytes = copy.held_bytes();
            if self.bytes + bytes > MAX_HELD_BYTES {
                self.stats.over_memory += 1;
                kept.push(copy.sample);
                continue;
            }
            self.bytes += bytes;
            let id = self.next_id;
            self.next_id += 1;
            self.fallbacks.insert(id, (copy.sample.clone(), bytes));
            sent.push(SentCopy { id, copy });
        }
        sent
    }

    /// Takes in what the worker answered, into `out`; an answer for a
    /// copy already given back by [`Self::abandon`] is dropped.
    pub(super) fn answered(&mut self, answers: Vec<ReplayedCopy>, out: &mut Vec<RawSample>) {
        for ReplayedCopy {
            id,
            sample,
            outcome,
        } in answers
        {
            let Some((_, bytes)) = self.fallbacks.remove(&id) else {
                continue;
            };
            self.bytes -= bytes;
            match outcome {
                CopyOutcome::Unwound { unindexed } => {
                    self.stats.unwound += 1;
                    self.stats.unwound_unindexed += u64::from(unindexed);
                }
                CopyOutcome::WithoutTables => self.stats.without_tables += 1,
            }
            out.push(sample);
        }
    }

    /// The end of a recording: every copy not answered keeps its
    /// frame-pointer walk, in time order.
    pub(super) fn abandon(&mut self) -> Vec<RawSample> {
        let mut kept: Vec<RawSample> = self
            .fallbacks
            .drain()
            .map(|(_, (sample, _))| sample)
            .collect();
        kept.sort_by_key(|s| s.time_ns);
        self.stats.without_tables += kept.len() as u64;
        self.bytes = 0;
        kept
    }

    /// Copies sent and not answered yet.
    pub(super) fn outstanding(&self) -> usize {
        self.fallbacks.len()
    }

    pub(super) fn stats(&self) -> StackCopyStats {
        self.stats
    }
}

/// Decodes a [`clrbpf_common::StackCopyEvent`] (its first
/// [`STACK_COPY_RECORD_HEADER`] bytes and the stack bytes it says it
/// holds); `None` when it is shorter than that or not an on-CPU sample.
pub(super) fn decode(
    bytes: &[u8],
    names: &mut HashMap<[u8; 16], Arc<str>>,
) -> Option<CopiedSample> {
    let header_bytes = bytes.get(size_of::<RawSampleEvent>()..STACK_COPY_RECORD_HEADER)?;
    // SAFETY: the length is checked by `get` and the header is plain old
    // data, read unaligned.
    let header: StackCopyHeader = unsafe { std::ptr::read_unaligned(header_bytes.as_ptr().cast()) };
    let stack_len = (header.stack_len as usize).min(STACK_COPY_BYTES);
    let stack = bytes.get(STACK_COPY_RECORD_HEADER..STACK_COPY_RECORD_HEADER + stack_len)?;
    let (sample, _, _) = super::decode_event(bytes, names)?;
    if sample.kind != SampleKind::OnCpu {
        return None;
    }
    Some(CopiedSample {
        sample,
        regs: header.regs,
        code: (header.code_len == 8).then_some(header.code),
        stack: stack.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use clrbpf_common::unwind::UnwindRegs;

    use super::*;

    /// A copy of pid 7's stack taken at `time_ns`, `stack_bytes` long,
    /// whose frame-pointer walk is `[0xf00, time_ns]`.
    fn copy(time_ns: u64, stack_bytes: usize) -> CopiedSample {
        CopiedSample {
            sample: RawSample::on_cpu(7, 7, time_ns, vec![0xf00, time_ns]),
            regs: UnwindRegs {
                pc: 0xf00,
                sp: 0x7ff0_0000,
                fp: 0,
                lr: 0,
            },
            code: None,
            stack: vec![0; stack_bytes],
        }
    }

    fn answer(sent: SentCopy, outcome: CopyOutcome) -> ReplayedCopy {
        let mut sample = sent.copy.sample;
        if let CopyOutcome::Unwound { .. } = outcome {
            sample.user_stack = vec![0xf00, 0xa, 0xb, 0xc];
        }
        ReplayedCopy {
            id: sent.id,
            sample,
            outcome,
        }
    }

    #[test]
    fn copies_the_worker_has_not_answered_keep_their_frame_pointer_walks_at_the_end() {
        let mut out = CopiesOut::default();
        let mut done = Vec::new();
        let mut sent = out.send((1..=4).map(|t| copy(t, 512)).collect(), &mut done);
        assert!(done.is_empty());
        assert_eq!(out.outstanding(), 4);
        // The worker answers two of them (one unwound, one without tables)
        // and is still busy with the others when the recording ends.
        let second = sent.remove(1);
        let first = sent.remove(0);
        out.answered(
            vec![
                answer(first, CopyOutcome::Unwound { unindexed: false }),
                answer(second, CopyOutcome::WithoutTables),
            ],
            &mut done,
        );
        assert_eq!(done.len(), 2);
        assert_eq!(done[0].user_stack, [0xf00, 0xa, 0xb, 0xc]);
        assert_eq!(out.outstanding(), 2);
        let kept = out.abandon();
        let walks: Vec<&[u64]> = kept.iter().map(|s| s.user_stack.as_slice()).collect();
        assert_eq!(walks, [&[0xf00, 3][..], &[0xf00, 4][..]]);
        assert_eq!(out.outstanding(), 0);
        // The worker's late answers are dropped: each sample is kept once.
        let late: Vec<ReplayedCopy> = sent
            .into_iter()
            .map(|s| answer(s, CopyOutcome::Unwound { unindexed: true }))
            .collect();
        out.answered(late, &mut done);
        assert_eq!(done.len(), 2);
        assert_eq!(
            out.stats(),
            StackCopyStats {
                unwound: 1,
                unwound_unindexed: 0,
                without_tables: 3,
                over_memory: 0,
            }
        );
    }

    #[test]
    fn copies_past_the_byte_bound_keep_their_walks_at_once_until_answers_free_it() {
        let mut out = CopiesOut::default();
        let mut done = Vec::new();
        let big = MAX_HELD_BYTES / 2;
        let sent = out.send(vec![copy(1, big), copy(2, big), copy(3, big)], &mut done);
        // A worker that falls behind holds at most the bound, on its way
        // or held: the third keeps its frame-pointer walk.
        assert_eq!(sent.len(), 1);
        assert_eq!(done.len(), 2);
        assert_eq!(out.stats().over_memory, 2);
        let answers = sent
            .into_iter()
            .map(|s| answer(s, CopyOutcome::WithoutTables))
            .collect();
        out.answered(answers, &mut done);
        assert_eq!(out.send(vec![copy(4, big)], &mut done).len(), 1);
    }
}
