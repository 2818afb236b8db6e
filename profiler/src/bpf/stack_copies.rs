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

use std::{
    collections::HashMap,
    sync::mpsc::Sender,
    time::{Duration, Instant},
};

use std::sync::Arc;

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
    /// Kept with the frame-pointer walk: the process was never indexed.
    pub without_tables: u64,
    /// Kept with the frame-pointer walk: too many bytes held.
    pub over_memory: u64,
}

/// A copy and when it came.
struct HeldCopy {
    copy: CopiedSample,
    since: Instant,
}

/// The copies waiting for their processes' tables.
pub(super) struct CopyReplayer {
    waiting: HashMap<u32, Vec<HeldCopy>>,
    held_bytes: usize,
    done: Sender<Vec<RawSample>>,
    stats: StackCopyStats,
}

impl CopyReplayer {
    pub(super) fn new(done: Sender<Vec<RawSample>>) -> Self {
        Self {
            waiting: HashMap::new(),
            held_bytes: 0,
            done,
            stats: StackCopyStats::default(),
        }
    }

    pub(super) fn stats(&self) -> StackCopyStats {
        self.stats
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
    pub(super) fn add(&mut self, maps: &mut UnwindMaps, copies: Vec<CopiedSample>) {
        let now = Instant::now();
        let mut given_back = Vec::new();
        for copy in copies {
            let bytes = copy.held_bytes();
            if self.held_bytes + bytes > MAX_HELD_BYTES {
                self.stats.over_memory += 1;
                given_back.push(copy.sample);
                continue;
            }
            self.held_bytes += bytes;
            let pid = copy.sample.pid;
            let held = self.waiting.entry(pid).or_default();
            if held.is_empty() {
                maps.track_process(pid);
            }
            held.push(HeldCopy { copy, since: now });
        }
        self.give_back(given_back);
        self.replay(maps, false);
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
                        self.stats.without_tables += 1;
                        self.held_bytes -= h.copy.held_bytes();
                        out.push(h.copy.sample);
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
                self.stats.unwound += 1;
                self.stats.unwound_unindexed += u64::from(walk.unindexed);
                self.held_bytes -= h.copy.held_bytes();
                let mut sample = h.copy.sample;
                sample.user_stack_truncated = walk.error == Some(UnwindError::TooDeep);
                sample.user_stack = walk.frames;
                out.push(sample);
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

    fn give_back(&self, samples: Vec<RawSample>) {
        if !samples.is_empty() {
            // The receiver is gone only when the recording is over.
            let _ = self.done.send(samples);
        }
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
