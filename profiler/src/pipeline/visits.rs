//! Which tracked processes a tick visits for their runtime's work (its
//! EventPipe sessions, its newly compiled code): those that have
//! something to do, not every one. A node's idle .NET processes then cost
//! the loop next to nothing per tick.
//!
//! 1. Whatever says a process has work marks it ([`Visits::mark`]): its
//!    sessions delivered ([`crate::clr::session_reader::take_delivered`]),
//!    its runtime is busy ([`crate::runtime::RuntimeInstance::busy`]), its
//!    samples are being named, it was just tracked.
//! 2. Each tick takes the marked processes ([`Visits::take`]), or every
//!    one when the backstop is due: work that comes by time rather than by
//!    a signal (a perf map polled for new code, a CLR sampling window
//!    closing) is at most that late.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

/// The processes one tick visits.
#[derive(Debug, PartialEq, Eq)]
pub enum Visit {
    /// Every tracked process (the backstop).
    All,
    /// Only these pids (sorted).
    Only(Vec<u32>),
}

/// The processes marked for the next tick, and the backstop.
#[derive(Debug)]
pub struct Visits {
    /// Every process is visited at least this often.
    every: Duration,
    /// When every process was last visited.
    all_at: Instant,
    marked: HashSet<u32>,
}

impl Visits {
    /// The first [`Self::take`] at `now` or later visits every process.
    pub fn new(every: Duration, now: Instant) -> Self {
        Self {
            every,
            all_at: now.checked_sub(every).unwrap_or(now),
            marked: HashSet::new(),
        }
    }

    /// Visit `pid` at the next tick.
    pub fn mark(&mut self, pid: u32) {
        self.marked.insert(pid);
    }

    /// Whether a process is marked for the next tick.
    pub fn any_marked(&self) -> bool {
        !self.marked.is_empty()
    }

    /// The processes to visit at `now`; the marks are taken.
    pub fn take(&mut self, now: Instant) -> Visit {
        if now.saturating_duration_since(self.all_at) >= self.every {
            self.all_at = now;
            self.marked.clear();
            return Visit::All;
        }
        let mut pids: Vec<u32> = self.marked.drain().collect();
        pids.sort_unstable();
        Visit::Only(pids)
    }
}

/// The pids `visit` names: every key of `processes` for [`Visit::All`].
pub fn pids<V>(visit: Visit, processes: &std::collections::HashMap<u32, V>) -> Vec<u32> {
    match visit {
        Visit::All => processes.keys().copied().collect(),
        Visit::Only(pids) => pids,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: Duration = Duration::from_millis(500);

    #[test]
    fn the_first_tick_visits_every_process() {
        let now = Instant::now();
        let mut visits = Visits::new(EVERY, now);
        assert_eq!(visits.take(now), Visit::All);
        assert_eq!(visits.take(now), Visit::Only(Vec::new()));
    }

    #[test]
    fn between_backstops_only_the_marked_processes_once() {
        let start = Instant::now();
        let mut visits = Visits::new(EVERY, start);
        visits.take(start);
        assert!(!visits.any_marked());
        visits.mark(7);
        visits.mark(3);
        visits.mark(7);
        assert!(visits.any_marked());
        let soon = start + Duration::from_millis(50);
        assert_eq!(visits.take(soon), Visit::Only(vec![3, 7]));
        assert!(!visits.any_marked());
        assert_eq!(visits.take(soon), Visit::Only(Vec::new()));
    }

    #[test]
    fn the_backstop_comes_every_period_and_takes_the_marks() {
        let start = Instant::now();
        let mut visits = Visits::new(EVERY, start);
        visits.take(start);
        visits.mark(3);
        assert_eq!(visits.take(start + EVERY), Visit::All);
        assert_eq!(
            visits.take(start + EVERY + Duration::from_millis(1)),
            Visit::Only(Vec::new())
        );
        assert_eq!(visits.take(start + 2 * EVERY), Visit::All);
    }
}
