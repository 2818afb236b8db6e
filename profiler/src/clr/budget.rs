//! What CLR exception events may cost a target: a rate budget per process,
//! and the back-off that turns the events off when a storm exceeds it.
//!
//! The runtime walks the managed stack of every event it writes to a
//! session, so an exception storm slows a target down by a third or more
//! while its exception events are on. With a budget, the collector
//! ([`super::collector`]) takes exception events on a session of their own
//! and asks an [`ExceptionGate`] after each one whether that session
//! should go on:
//!
//! 1. Events are counted per second of event time. More than the budget in
//!    one second turns the session off for the back-off period.
//! 2. The back-off starts at [`BACKOFF_MIN`] and doubles, up to
//!    [`BACKOFF_MAX`], each time the events go over the budget again within
//!    one back-off period of being turned back on; a quiet period that long
//!    resets it.
//! 3. While the events are off, the totals come from a session that asks
//!    for no stack walks (.NET 9+) and stays on, by type; before .NET 9
//!    from the runtime's `exception-count` counter, the events taken giving
//!    the shape (their stacks and types), see
//!    [`crate::profile::clr_sampling`].
//!
//! Everything here is pure (times are passed in), so it is unit-tested.

use std::time::Duration;

/// First back-off period.
pub const BACKOFF_MIN: Duration = Duration::from_secs(10);
/// Longest back-off period: the events come back at least this often, so
/// the shape of a long storm is refreshed.
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Default exception events per second and process with stacks.
///
/// Set by what an event's stack walk costs the target, not by what clrbpf
/// can take: the storm bench (docs/performance.md) measured .NET 8 at
/// 131,886 throws a second alone and -35.3% with every event on, about
/// 4 us of the target's core per event. 10,000 a second is then at most
/// some 4% of a core, within the 5% budget, for the second a storm takes to
/// go over it (then the back-off), while a burst below it (the issue's
/// 20,501 in 3 s) keeps every event: exact totals by type, and the type
/// thrown once with its stack, on runtimes that have no session without
/// stacks (before .NET 9).
pub const DEFAULT_EXCEPTIONS_PER_SECOND: u32 = 10_000;

const SECOND_NS: u64 = 1_000_000_000;
/// Most exceptions a runtime's `exception-count` can count in a second: a
/// throw costs microseconds of a core, so this is far above any host.
pub const MAX_EXCEPTIONS_PER_SECOND: f64 = 1e8;

/// Whether the exception events of one process are on; see the module
/// documentation.
#[derive(Clone, Debug)]
pub struct ExceptionGate {
    per_second: u64,
    /// Start of the current one-second bucket (event time).
    bucket_start_ns: Option<u64>,
    bucket_count: u64,
    /// `Some(until)` (monotonic ns) while the events are off.
    off_until_ns: Option<u64>,
    /// When the events were last turned back on.
    resumed_ns: Option<u64>,
    backoff: Duration,
    backoffs: u64,
}

impl ExceptionGate {
    /// At most `per_second` events per second (at least 1).
    pub fn new(per_second: u32) -> Self {
        Self {
            per_second: u64::from(per_second.max(1)),
            bucket_start_ns: None,
            bucket_count: 0,
            off_until_ns: None,
            resumed_ns: None,
            backoff: BACKOFF_MIN,
            backoffs: 0,
        }
    }

    /// Counts one event at `time_ns`; returns `true` when it goes over the
    /// budget, turning the events off from `now_ns` for the back-off
    /// period.
    pub fn observe(&mut self, time_ns: u64, now_ns: u64) -> bool {
        if self.off_until_ns.is_some() {
            return false;
        }
        match self.bucket_start_ns {
            Some(start) if time_ns.saturating_sub(start) < SECOND_NS => self.bucket_count += 1,
            _ => {
                self.bucket_start_ns = Some(time_ns);
                self.bucket_count = 1;
            }
        }
        if self.bucket_count <= self.per_second {
            return false;
        }
        let backoff_ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // Over again soon after the last back-off: a storm that goes on.
        self.backoff = match self.resumed_ns {
            Some(resumed) if now_ns.saturating_sub(resumed) < backoff_ns(self.backoff) => {
                (self.backoff * 2).min(BACKOFF_MAX)
            }
            _ => BACKOFF_MIN,
        };
        self.off_until_ns = Some(now_ns.saturating_add(backoff_ns(self.backoff)));
        self.backoffs += 1;
        self.bucket_start_ns = None;
        self.bucket_count = 0;
        true
    }

    /// Whether the events should be on at `now_ns`; turns them back on when
    /// the back-off period is over.
    pub fn is_on(&mut self, now_ns: u64) -> bool {
        match self.off_until_ns {
            Some(until) if now_ns < until => false,
            Some(_) => {
                self.off_until_ns = None;
                self.resumed_ns = Some(now_ns);
                true
            }
            None => true,
        }
    }

    /// The back-off period in force (or the last one).
    pub fn backoff(&self) -> Duration {
        self.backoff
    }

    /// How many times the events were turned off.
    pub fn backoffs(&self) -> u64 {
        self.backoffs
    }
}

/// Events remembered until the counter's first value (the gate holds them
/// to its budget).
const MAX_EARLY_EVENTS: usize = 1 << 20;

/// The totals of a budgeted session (exceptions, allocated bytes): what its
/// events carried against what the runtime's counter (`exception-count`,
/// `alloc-rate`) saw, so that what the events missed while they were off
/// can be added.
///
/// The counter counts from its baseline, taken some milliseconds after the
/// main session starts; its first value (one counter interval later)
/// covers the time since then. The events are on from before that
/// baseline, so:
///
/// 1. If the events stayed on until the first value, the first value is
///    dropped: what happened up to it is the events' (exact), what came
///    after it the counter's.
/// 2. If the gate turned them off before it (a storm at attach), the first
///    value is kept, and the events from its baseline on are set against
///    it. The baseline is the value's time less the counters' period (the
///    runtime's timer fires one period after it takes the baseline), so
///    what happened between the baseline and the timer's late wake-up (well
///    under a millisecond on a host with a free core) may be counted twice.
///
/// Which case holds is known once no event is on its way
/// ([`Self::unobserved`]), so both tallies are kept until then.
#[derive(Debug)]
pub struct CounterLedger {
    /// Most the counter can count in a second (see [`Self::new`]).
    max_per_second: f64,
    first: Option<FirstValue>,
    /// Event time of the event that first went over the budget.
    first_off_ns: Option<u64>,
    /// Times and amounts of the events taken before the first value.
    early: Vec<(u64, f64)>,
    /// What the events carried after the first value.
    observed: f64,
    /// What they carried between the first value's baseline and the value.
    observed_first_interval: f64,
    /// What the counter saw after its first value.
    counted: f64,
    /// What was added without events so far. Events the runtime dropped
    /// (a full session buffer) are among it: the counter saw them too.
    added: u64,
    /// Time of the latest counter value.
    last_ns: u64,
    /// What the events carried after the first value up to the latest
    /// one: the span the counter covers.
    observed_covered: f64,
    /// Events after the latest value (time, amount): no value covers them
    /// yet, and none will once the process has exited.
    tail: Vec<(u64, f64)>,
    /// What the events carried up to the first value's baseline.
    observed_before_baseline: f64,
    /// What the events handed on carried ([`Self::on_scaled_event`]).
    handed: f64,
    /// What [`Self::correction`] returned so far, summed.
    corrected: f64,
}

/// A counter's first value: its time, its value and its baseline's time.
#[derive(Clone, Copy, Debug)]
struct FirstValue {
    time_ns: u64,
    value: f64,
    baseline_ns: u64,
}

/// Most entries of a ledger's tail (16 KiB), and how close in time two
/// events are to share one.
const MAX_TAIL_ENTRIES: usize = 1024;
const TAIL_MERGE_NS: u64 = 10_000_000;

/// Longest counter interval believed, in seconds: a value's bound is its
/// interval times the counter's rate, and the interval is the target's.
const MAX_COUNTER_INTERVAL_SEC: f32 = 60.0;

impl CounterLedger {
    /// A ledger of a counter that cannot count more than `max_per_second`
    /// in a second of a real runtime: the target writes the values, and one
    /// of 1e30 would otherwise stand for more exceptions than any process
    /// throws in its life.
    pub fn new(max_per_second: f64) -> Self {
        Self {
            max_per_second: max_per_second.max(0.0),
            first: None,
            first_off_ns: None,
            early: Vec::new(),
            observed: 0.0,
            observed_first_interval: 0.0,
            counted: 0.0,
            added: 0,
            last_ns: 0,
            observed_covered: 0.0,
            tail: Vec::new(),
            observed_before_baseline: 0.0,
            handed: 0.0,
            corrected: 0.0,
        }
    }

    /// A counter value (the change over `interval_sec`, the counters'
    /// period) written at `time_ns`.
    pub fn on_counter(&mut self, value: f64, time_ns: u64, interval_sec: f32) {
        if !value.is_finite() {
            return;
        }
        let interval_sec = interval_sec.clamp(0.0, MAX_COUNTER_INTERVAL_SEC);
        // At least one second's worth: the runtime's own interval is 1 s or
        // more.
        let most = self.max_per_second * f64::from(interval_sec.max(1.0));
        let value = value.clamp(0.0, most);
        if self.first.is_some() {
            self.counted += value;
            self.last_ns = self.last_ns.max(time_ns);
            let last_ns = self.last_ns;
            let mut covered = 0.0;
            self.tail.retain(|&(t, amount)| {
                let keep = t > last_ns;
                if !keep {
                    covered += amount;
                }
                keep
            });
            self.observed_covered += covered;
            return;
        }
        self.last_ns = time_ns;
        let interval_ns = (f64::from(interval_sec.max(0.0)) * 1e9) as u64;
        let first = FirstValue {
            time_ns,
            value,
            baseline_ns: time_ns.saturating_sub(interval_ns),
        };
        self.first = Some(first);
        for (time_ns, amount) in std::mem::take(&mut self.early) {
            self.tally(first, time_ns, amount);
        }
    }

    /// An event at `time_ns` carrying `amount`; `over`: it went over the
    /// budget (the events go off).
    pub fn on_event(&mut self, time_ns: u64, amount: f64, over: bool) {
        self.on_scaled_event(time_ns, amount, amount, over);
    }

    /// An event at `time_ns` carrying `amount`, handed on as `handed` (the
    /// amount scaled by [`Self::ratio`]); `over` as in [`Self::on_event`].
    pub fn on_scaled_event(&mut self, time_ns: u64, amount: f64, handed: f64, over: bool) {
        self.handed += handed;
        match self.first {
            None if self.early.len() < MAX_EARLY_EVENTS => self.early.push((time_ns, amount)),
            None => {}
            Some(first) => self.tally(first, time_ns, amount),
        }
        if over && self.first_off_ns.is_none() {
            self.first_off_ns = Some(time_ns);
        }
    }

    fn tally(&mut self, first: FirstValue, time_ns: u64, amount: f64) {
        if time_ns > first.time_ns {
            self.observed += amount;
            if time_ns <= self.last_ns {
                self.observed_covered += amount;
            } else {
                self.push_tail(time_ns, amount);
            }
        } else if time_ns > first.baseline_ns {
            self.observed_first_interval += amount;
        } else {
            self.observed_before_baseline += amount;
        }
    }

    /// Adds an event after the latest value to the tail: into the latest
    /// entry when within [`TAIL_MERGE_NS`] of it or when the tail is full
    /// (the entry's time is its latest event's), so that it stays small.
    fn push_tail(&mut self, time_ns: u64, amount: f64) {
        let full = self.tail.len() >= MAX_TAIL_ENTRIES;
        match self.tail.last_mut() {
            Some((t, a)) if full || time_ns.abs_diff(*t) <= TAIL_MERGE_NS => {
                *t = (*t).max(time_ns);
                *a += amount;
            }
            _ => self.tail.push((time_ns, amount)),
        }
    }

    /// What the counter saw after its first value against what the events
    /// carried over the same span (both with the first interval when the
    /// events were off before the first value), and what the events
    /// carried that no value covers (before it, or after the latest).
    fn spans(&self, first: FirstValue) -> (f64, f64, f64) {
        let tail: f64 = self.tail.iter().map(|&(_, amount)| amount).sum();
        if self.first_off_ns.is_some_and(|off| off <= first.time_ns) {
            (
                self.counted + first.value,
                self.observed_covered + self.observed_first_interval,
                self.observed_before_baseline + tail,
            )
        } else {
            (
                self.counted,
                self.observed_covered,
                self.observed_before_baseline + self.observed_first_interval + tail,
            )
        }
    }

    /// The counter's amount per event amount over the span it covers,
    /// when the events over-count (below 1), from at least `min_observed`
    /// of the events; 1 otherwise, and once the events have been off (the
    /// counter then also counts what they missed). .NET Core 3.1's
    /// allocation ticks count some bytes twice ([`super::alloc_session`]).
    pub fn ratio(&self, min_observed: f64) -> f64 {
        let Some(first) = self.first else {
            return 1.0;
        };
        if self.first_off_ns.is_some() {
            return 1.0;
        }
        let (counted, observed, _) = self.spans(first);
        if observed < min_observed.max(f64::MIN_POSITIVE) {
            return 1.0;
        }
        (counted / observed).clamp(0.0, 1.0)
    }

    /// What to add (or take away, when negative) so that what was handed
    /// on matches the counter: the counter's amount over the span it
    /// covers, and the events' outside it at [`Self::ratio`]. Not returned
    /// twice. Only meaningful while no event is still on its way.
    pub fn correction(&mut self) -> i64 {
        let Some(first) = self.first else {
            return 0;
        };
        let (counted, _, uncovered) = self.spans(first);
        let target = counted + uncovered * self.ratio(0.0);
        let delta = (target - self.handed - self.corrected).round();
        // Both are sums of finite amounts the counter's bound keeps far
        // below i64::MAX.
        let bound = (1u64 << 62) as f64;
        let delta = delta.clamp(-bound, bound) as i64;
        self.corrected += delta as f64;
        delta
    }

    /// What the counter saw that no event stood for, not added yet. Only
    /// meaningful while no event is still on its way.
    pub fn unobserved(&mut self) -> u64 {
        let Some(first) = self.first else {
            return 0;
        };
        let (mut counted, mut observed) = (self.counted, self.observed);
        if self.first_off_ns.is_some_and(|off| off <= first.time_ns) {
            // Off before the first value: it counts what the events missed.
            counted += first.value;
            observed += self.observed_first_interval;
        }
        let missing = ((counted - observed).max(0.0).round() as u64).saturating_sub(self.added);
        self.added += missing;
        missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = SECOND_NS;

    #[test]
    fn events_within_the_budget_stay_on() {
        let mut gate = ExceptionGate::new(100);
        for i in 0..1_000u64 {
            // 100 per second, for 10 s.
            assert!(!gate.observe(i * S / 100, i * S / 100));
        }
        assert!(gate.is_on(10 * S));
        assert_eq!(gate.backoffs(), 0);
    }

    #[test]
    fn a_storm_turns_them_off_for_a_growing_backoff() {
        let mut gate = ExceptionGate::new(100);
        let over = (0..=100u64)
            .map(|i| gate.observe(i * 1000, S))
            .position(|x| x);
        assert_eq!(over, Some(100), "the 101st event of the second");
        assert!(!gate.is_on(S + 9 * S));
        assert!(!gate.observe(S + 9 * S, S + 9 * S), "off: nothing counted");
        // Back on after 10 s; over again at once: 20 s.
        let back = S + 10 * S;
        assert!(gate.is_on(back));
        assert!((0..=100u64).any(|i| gate.observe(back + i, back)));
        assert_eq!(gate.backoff(), Duration::from_secs(20));
        assert!(!gate.is_on(back + 19 * S));
        assert!(gate.is_on(back + 20 * S));
        // And so on up to the cap.
        let mut now = back + 20 * S;
        for _ in 0..10 {
            assert!((0..=100u64).any(|i| gate.observe(now + i, now)));
            now += u64::try_from(gate.backoff().as_nanos()).expect("fits");
            assert!(gate.is_on(now));
        }
        assert_eq!(gate.backoff(), BACKOFF_MAX);
        assert_eq!(gate.backoffs(), 12);
    }

    #[test]
    fn a_quiet_period_resets_the_backoff() {
        let mut gate = ExceptionGate::new(10);
        assert!((0..=10u64).any(|i| gate.observe(i, 0)));
        assert!(gate.is_on(10 * S));
        // Quiet for longer than the back-off, then a new storm: 10 s again.
        let later = 10 * S + 11 * S;
        assert!((0..=10u64).any(|i| gate.observe(later + i, later)));
        assert_eq!(gate.backoff(), BACKOFF_MIN);
    }

    #[test]
    fn events_spread_over_seconds_are_counted_per_second() {
        let mut gate = ExceptionGate::new(10);
        // 10 per second at the end of one second and 10 at the start of
        // the next: within budget in each one-second bucket.
        for i in 0..10u64 {
            assert!(!gate.observe(S - 100 + i, 0));
        }
        for i in 0..10u64 {
            assert!(!gate.observe(2 * S + i, 0));
        }
        assert!(gate.is_on(3 * S));
    }

    #[test]
    fn events_after_the_last_value_take_the_counters_ratio_in_a_bounded_tail() {
        let mut ledger = CounterLedger::new(1e12);
        ledger.on_counter(0.0, S, 1.0);
        // 2 s of events at 2 per ms, 11 each where the counter saw 10.
        for i in 0..4_000u64 {
            ledger.on_event(S + 1 + i * S / 2_000, 11.0, false);
        }
        ledger.on_counter(40_000.0, 3 * S, 2.0);
        assert!((ledger.ratio(0.0) - 10.0 / 11.0).abs() < 1e-12);
        // A million more after the last value: the tail stays small.
        for i in 0..1_000_000u64 {
            ledger.on_event(3 * S + 1 + i * 1_000, 11.0, false);
        }
        assert!(ledger.tail.len() <= MAX_TAIL_ENTRIES);
        let want = 40_000 + 10_000_000 - 44_000 - 11_000_000;
        assert!((ledger.correction() - want).abs() <= 1);
        assert_eq!(ledger.correction(), 0, "taken once");
    }

    #[test]
    fn a_hostile_counter_counts_no_more_than_a_real_runtime_can() {
        // Issue 33, defect 1: two exceptions against a counter claiming
        // 1e30 (and intervals of a century) reached the apportioning loop.
        let mut ledger = CounterLedger::new(MAX_EXCEPTIONS_PER_SECOND);
        ledger.on_event(S / 2, 1.0, false);
        ledger.on_counter(1.0, S, 1.0);
        ledger.on_event(2 * S, 1.0, false);
        ledger.on_counter(1e30, 3 * S, 3e9);
        ledger.on_counter(f64::MAX, 4 * S, f32::MAX);
        let most = 2.0 * MAX_EXCEPTIONS_PER_SECOND * f64::from(MAX_COUNTER_INTERVAL_SEC);
        let missing = ledger.unobserved();
        assert!(missing as f64 <= most, "{missing}");
        assert!(missing > 0);
        assert_eq!(ledger.unobserved(), 0, "added once");
    }
}
