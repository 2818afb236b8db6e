//! Wait-handle waits (.NET 9+) from their events, before they become
//! samples in the intake ([`super::intake`]). The runtime sends
//! WaitHandleWaitStart when a thread has to block in `WaitOne` on a Mutex,
//! Semaphore, Manual/AutoResetEvent, or in `Monitor.Wait`, and
//! WaitHandleWaitStop when it wakes. Neither carries a duration (unlike
//! ContentionStop) nor an id tying the two: they are paired by thread, as
//! in seed 003 ("Measuring the impact of locks and waits").
//!
//! 1. A Start opens a wait on its thread with its time, its stack (the
//!    waiting stack: the Stop's is the same thread after the wait) and its
//!    source (`Monitor.Wait` or a wait handle).
//! 2. The next Stop on that thread closes it: its duration is the Stop's
//!    time minus the Start's, both the runtime's event ticks, so exact.
//! 3. A Stop with no open wait on its thread (the wait began before the
//!    session, or its Start was dropped) is counted, never given a guessed
//!    duration.
//! 4. A Start on a thread whose wait is still open (its Stop was dropped by
//!    a full session buffer) replaces it; the replaced wait is unfinished.
//! 5. Waits still open when the stream ends (the session stopped while the
//!    thread waited, the stream was cut, the process exited mid-wait) are
//!    unfinished too: counted, not samples. Their end is unknown, and a
//!    sample up to the end of the stream would pass a lower bound off as a
//!    duration. (The off-CPU profile, which sees the wait through the
//!    scheduler, counts a thread still blocked up to the end.)
//!
//! Everything here is pure: the intake feeds it events in stream order.

use std::collections::HashMap;

/// Threads with an open wait tracked at most; a Start beyond is dropped,
/// and its Stop counts as unpaired.
pub const MAX_OPEN_WAITS: usize = 1 << 13;
/// Frames kept of a Start's stack. The runtime walks at most 100
/// (`EP_MAX_STACK_DEPTH`); a hostile stream's longer stacks are cut, so
/// the open waits of a process hold at most 16 MiB of stacks.
pub const MAX_WAIT_STACK_FRAMES: usize = 256;

/// What a thread waited in (the Start event's `WaitSource`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WaitSource {
    /// `WaitOne` (and `WaitAny`/`WaitAll`) on a wait handle: Mutex,
    /// Semaphore, Manual/AutoResetEvent.
    WaitHandle,
    /// `Monitor.Wait`.
    MonitorWait,
}

impl WaitSource {
    /// From the event's `WaitSource` field: 1 is `Monitor.Wait`; 0 (the
    /// runtime's "other") and any value a later runtime may add are wait
    /// handles, so the label keeps two values.
    pub fn from_event(value: u8) -> Self {
        match value {
            1 => Self::MonitorWait,
            _ => Self::WaitHandle,
        }
    }

    /// The `wait.source` label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::WaitHandle => "wait_handle",
            Self::MonitorWait => "monitor_wait",
        }
    }
}

/// A finished wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wait {
    pub thread_id: u64,
    /// CLOCK_MONOTONIC ns of the Start and of the Stop.
    pub start_ns: u64,
    pub end_ns: u64,
    pub duration_ns: u64,
    /// The Start's stack: return addresses, leaf first.
    pub stack: Vec<u64>,
    pub source: WaitSource,
}

#[derive(Debug)]
struct OpenWait {
    start_ns: u64,
    stack: Vec<u64>,
    source: WaitSource,
}

/// Start/Stop pairing per thread; see the module documentation.
#[derive(Debug, Default)]
pub struct WaitPairing {
    open: HashMap<u64, OpenWait>,
    unpaired_stops: u64,
    /// Replaced by a later Start on their thread.
    replaced: u64,
}

impl WaitPairing {
    /// A WaitHandleWaitStart on `thread_id` at `time_ns`.
    pub fn start(&mut self, thread_id: u64, time_ns: u64, mut stack: Vec<u64>, source: WaitSource) {
        if stack.len() > MAX_WAIT_STACK_FRAMES {
            stack.truncate(MAX_WAIT_STACK_FRAMES);
            stack.shrink_to_fit();
        }
        let wait = OpenWait {
            start_ns: time_ns,
            stack,
            source,
        };
        if self.open.len() >= MAX_OPEN_WAITS && !self.open.contains_key(&thread_id) {
            return;
        }
        if self.open.insert(thread_id, wait).is_some() {
            self.replaced += 1;
        }
    }

    /// A WaitHandleWaitStop on `thread_id` at `time_ns`: the wait it ends,
    /// or `None` (counted) when its thread had none open.
    pub fn stop(&mut self, thread_id: u64, time_ns: u64) -> Option<Wait> {
        let Some(OpenWait {
            start_ns,
            stack,
            source,
        }) = self.open.remove(&thread_id)
        else {
            self.unpaired_stops += 1;
            return None;
        };
        Some(Wait {
            thread_id,
            start_ns,
            end_ns: time_ns,
            // Events of one thread come in order; a hostile stream's Stop
            // before its Start is a wait of no length, not a wrap.
            duration_ns: time_ns.saturating_sub(start_ns),
            stack,
            source,
        })
    }

    /// Stops that had no Start on their thread.
    pub fn unpaired_stops(&self) -> u64 {
        self.unpaired_stops
    }

    /// Waits without a Stop so far: replaced by a later Start on their
    /// thread, or still open (at the end of the stream, the unfinished).
    pub fn unfinished(&self) -> u64 {
        self.replaced + self.open.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HANDLE: WaitSource = WaitSource::WaitHandle;

    #[test]
    fn a_stop_closes_the_wait_its_thread_started_with_the_start_stack() {
        let mut pairing = WaitPairing::default();
        pairing.start(7, 1_000, vec![0x10, 0x20], WaitSource::MonitorWait);
        let wait = pairing.stop(7, 251_000_123).expect("paired");
        assert_eq!(
            wait,
            Wait {
                thread_id: 7,
                start_ns: 1_000,
                end_ns: 251_000_123,
                duration_ns: 251_000_123 - 1_000,
                stack: vec![0x10, 0x20],
                source: WaitSource::MonitorWait,
            }
        );
        assert_eq!((pairing.unpaired_stops(), pairing.unfinished()), (0, 0));
    }

    #[test]
    fn interleaved_threads_pair_each_with_its_own_start() {
        let mut pairing = WaitPairing::default();
        pairing.start(1, 100, vec![0x1], HANDLE);
        pairing.start(2, 150, vec![0x2], WaitSource::MonitorWait);
        pairing.start(3, 170, vec![0x3], HANDLE);
        let b = pairing.stop(2, 1_150).expect("thread 2");
        let a = pairing.stop(1, 5_100).expect("thread 1");
        pairing.start(2, 2_000, vec![0x22], HANDLE);
        let c = pairing.stop(3, 2_170).expect("thread 3");
        let b2 = pairing.stop(2, 2_500).expect("thread 2 again");
        let got: Vec<(u64, u64, Vec<u64>)> = [a, b, c, b2]
            .into_iter()
            .map(|w| (w.thread_id, w.duration_ns, w.stack))
            .collect();
        assert_eq!(
            got,
            [
                (1, 5_000, vec![0x1]),
                (2, 1_000, vec![0x2]),
                (3, 2_000, vec![0x3]),
                (2, 500, vec![0x22]),
            ]
        );
        assert_eq!((pairing.unpaired_stops(), pairing.unfinished()), (0, 0));
    }

    #[test]
    fn a_stop_without_a_start_is_counted_not_guessed() {
        let mut pairing = WaitPairing::default();
        assert_eq!(pairing.stop(9, 5_000), None);
        pairing.start(9, 6_000, vec![], HANDLE);
        assert!(pairing.stop(9, 7_000).is_some());
        // A second Stop for the same wait has nothing to close either.
        assert_eq!(pairing.stop(9, 8_000), None);
        assert_eq!(pairing.unpaired_stops(), 2);
        assert_eq!(pairing.unfinished(), 0);
    }

    #[test]
    fn waits_open_when_the_stream_ends_or_restarted_are_unfinished() {
        let mut pairing = WaitPairing::default();
        pairing.start(1, 100, vec![0x1], HANDLE);
        // Thread 1's Stop was dropped: its next Start replaces the wait.
        pairing.start(1, 900, vec![0x2], HANDLE);
        pairing.start(2, 950, vec![0x3], HANDLE);
        assert_eq!(pairing.unfinished(), 3, "one replaced, two open");
        let wait = pairing.stop(1, 1_000).expect("the second wait");
        assert_eq!((wait.duration_ns, wait.stack), (100, vec![0x2]));
        // The stream is cut here: thread 2's wait never ends.
        assert_eq!(pairing.unfinished(), 2);
        assert_eq!(pairing.unpaired_stops(), 0);
    }

    #[test]
    fn a_stop_stamped_before_its_start_is_a_wait_of_no_length() {
        let mut pairing = WaitPairing::default();
        pairing.start(1, 5_000, vec![], HANDLE);
        assert_eq!(pairing.stop(1, 10).map(|w| w.duration_ns), Some(0));
    }

    #[test]
    fn open_waits_are_bounded_and_a_start_beyond_pairs_with_nothing() {
        let mut pairing = WaitPairing::default();
        for tid in 0..MAX_OPEN_WAITS as u64 {
            pairing.start(tid, 1, Vec::new(), HANDLE);
        }
        let beyond = MAX_OPEN_WAITS as u64;
        pairing.start(beyond, 2, Vec::new(), HANDLE);
        assert_eq!(pairing.stop(beyond, 3), None);
        assert_eq!(pairing.unpaired_stops(), 1);
        // A thread already tracked still starts a new wait.
        pairing.start(0, 4, vec![0x1], HANDLE);
        assert_eq!(pairing.stop(0, 5).map(|w| w.stack), Some(vec![0x1]));
    }

    #[test]
    fn a_hostile_stack_is_cut_to_the_frames_kept() {
        let mut pairing = WaitPairing::default();
        pairing.start(1, 0, vec![7; 100_000], HANDLE);
        let wait = pairing.stop(1, 1).expect("paired");
        assert_eq!(wait.stack.len(), MAX_WAIT_STACK_FRAMES);
        assert!(wait.stack.capacity() < 100_000, "the rest is freed");
    }

    #[test]
    fn the_source_has_two_label_values() {
        assert_eq!(WaitSource::from_event(1).name(), "monitor_wait");
        for other in [0, 2, 255] {
            assert_eq!(WaitSource::from_event(other).name(), "wait_handle");
        }
    }
}
