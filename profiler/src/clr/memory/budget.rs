//! What naming frames from a target's memory may cost ([`super`]): every
//! lookup and code heap scan of the memory path goes through here, so that a
//! process that crafts its runtime's structures (a fake `g_dacTable`, a
//! "code heap" of random return addresses) costs clrbpf a bounded share of
//! its time, and never another tenant its samples or names.
//!
//! 1. A lookup is metered ([`Metered`]): at most [`LOOKUP_READS`] reads, and
//!    no read past the process's deadline for the window.
//! 2. Failed lookups are remembered ([`NegativeCache`]): the page for
//!    [`FAILED_FOR`], and a code range in which [`RANGE_FAILURES`] lookups
//!    in a row failed, for as long. A lookup there makes no read.
//! 3. Each process has a budget per window ([`WINDOW_READS`] reads and
//!    [`WINDOW_TIME`]); past it, its other frames stay unnamed for the
//!    window. All processes share [`CUT_TIME`] a window; past it, each
//!    still gets [`FAIR_SHARE`], so one tenant cannot spend another's.
//! 4. A process whose last [`PUT_ASIDE_AFTER`] lookups all failed (or
//!    whose last [`PUT_ASIDE_AFTER_READS`] reads were all in failed
//!    lookups) is put
//!    aside for [`ASIDE_FIRST`], twice as long each time again (up to
//!    [`ASIDE_LONGEST`]): it is either not .NET or crafted.
//! 5. Code heap scans of all processes share [`SCAN_TIME_PER_SECOND`]; a
//!    scan reads nothing past its deadline (checked at every read, inside
//!    the listing and the nibble map reads).
//!
//! What went over is counted ([`NamingBudgetCounts`]) for the summary and
//! the agent's `/metrics`. The window is the pipeline's: it calls
//! [`SharedNamingBudget::new_window`] before it names a window's stacks.

use std::{
    cell::Cell,
    collections::HashMap,
    sync::{
        Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use super::target::{ReadError, TargetMemory};

/// Reads one lookup may make (a walk is about 200 at most on .NET 8+; a
/// .NET 6/7 range list walk is cut here).
pub const LOOKUP_READS: u64 = 1024;
/// Reads one process's lookups may make in a window.
pub const WINDOW_READS: u64 = 50_000;
/// Time one process's lookups may take in a window.
pub const WINDOW_TIME: Duration = Duration::from_millis(150);
/// Time all processes' lookups may take in a window.
pub const CUT_TIME: Duration = Duration::from_millis(400);
/// What a process may still spend in a window once [`CUT_TIME`] is spent.
pub const FAIR_SHARE: Duration = Duration::from_millis(20);
/// How long a failed page or code range is not looked at again.
pub const FAILED_FOR: Duration = Duration::from_secs(10);
/// Failed pages and ranges remembered per process (then the oldest half
/// goes).
pub const MAX_FAILED: usize = 4096;
/// Lookups in a row in one code range that fail before the range is.
pub const RANGE_FAILURES: u32 = 16;
/// Lookups in a row that fail, none named, before a process is put aside.
pub const PUT_ASIDE_AFTER: u64 = 256;
/// Reads in a row, all in lookups that failed, before a process is put
/// aside: a crafted process whose every lookup runs to [`LOOKUP_READS`]
/// spends its window's reads in about 50 lookups, so it would never reach
/// [`PUT_ASIDE_AFTER`] failures and cost its whole budget every window.
pub const PUT_ASIDE_AFTER_READS: u64 = WINDOW_READS;
pub const ASIDE_FIRST: Duration = Duration::from_secs(30);
pub const ASIDE_LONGEST: Duration = Duration::from_secs(600);
/// Time all processes' code heap scans may take in one second.
pub const SCAN_TIME_PER_SECOND: Duration = Duration::from_millis(100);

/// Why a lookup was not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the process's naming budget for this window is spent")]
    OverBudget,
    #[error("a lookup there failed a moment ago")]
    KnownBad,
    #[error("the process's lookups all failed: put aside")]
    PutAside,
}

/// What the budgets refused, over the run: for the summary and `/metrics`.
#[derive(Debug, Default)]
pub struct NamingBudgetCounts {
    pub over_budget: AtomicU64,
    pub known_bad: AtomicU64,
    pub put_aside: AtomicU64,
    pub processes_put_aside: AtomicU64,
    pub scans_deferred: AtomicU64,
    pub scans_cut_short: AtomicU64,
}

/// A copy of [`NamingBudgetCounts`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NamingBudgetSnapshot {
    /// Lookups not made: their process's budget for the window was spent.
    pub over_budget: u64,
    /// Lookups answered by the failed-lookup cache, with no read.
    pub known_bad: u64,
    /// Lookups of processes put aside.
    pub put_aside: u64,
    /// Times a process was put aside.
    pub processes_put_aside: u64,
    /// Code heap scans put off to a later tick (the shared time was spent).
    pub scans_deferred: u64,
    /// Code heap scans stopped at their deadline.
    pub scans_cut_short: u64,
}

impl NamingBudgetSnapshot {
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

impl NamingBudgetCounts {
    pub fn snapshot(&self) -> NamingBudgetSnapshot {
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        NamingBudgetSnapshot {
            over_budget: load(&self.over_budget),
            known_bad: load(&self.known_bad),
            put_aside: load(&self.put_aside),
            processes_put_aside: load(&self.processes_put_aside),
            scans_deferred: load(&self.scans_deferred),
            scans_cut_short: load(&self.scans_cut_short),
        }
    }
}

fn bump(n: &AtomicU64) {
    n.fetch_add(1, Ordering::Relaxed);
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// What every process's memory path shares: the window, the time all
/// lookups spent in it, the code heap scans' second, the counts.
#[derive(Debug, Default)]
pub struct SharedNamingBudget {
    window: AtomicU64,
    window_spent_ns: AtomicU64,
    /// The start of the scans' second and their time spent in it.
    scan: Mutex<Option<(Instant, Duration)>>,
    pub counts: NamingBudgetCounts,
}

static GLOBAL: OnceLock<SharedNamingBudget> = OnceLock::new();

/// The budget of this clrbpf's readers.
pub fn global() -> &'static SharedNamingBudget {
    GLOBAL.get_or_init(SharedNamingBudget::default)
}

impl SharedNamingBudget {
    /// A window's stacks are about to be named: every budget starts again.
    pub fn new_window(&self) {
        self.window.fetch_add(1, Ordering::Relaxed);
        self.window_spent_ns.store(0, Ordering::Relaxed);
    }

    fn cut_spent(&self) -> bool {
        self.window_spent_ns.load(Ordering::Relaxed) >= nanos(CUT_TIME)
    }

    /// The deadline of a code heap scan that may take `own` at most, or
    /// `None` when the scans' second is spent (the scan waits).
    pub fn scan_deadline(&self, own: Duration, now: Instant) -> Option<Instant> {
        let mut scan = self.scan.lock().ok()?;
        let (start, spent) = scan.get_or_insert((now, Duration::ZERO));
        if now.duration_since(*start) >= Duration::from_secs(1) {
            (*start, *spent) = (now, Duration::ZERO);
        }
        let left = SCAN_TIME_PER_SECOND.saturating_sub(*spent);
        if left.is_zero() {
            bump(&self.counts.scans_deferred);
            return None;
        }
        Some(now + own.min(left))
    }

    /// A scan took `took`.
    pub fn charge_scan(&self, took: Duration, cut_short: bool) {
        if let Ok(mut scan) = self.scan.lock()
            && let Some((_, spent)) = scan.as_mut()
        {
            *spent += took;
        }
        if cut_short {
            bump(&self.counts.scans_cut_short);
        }
    }
}

/// Where a lookup failed, remembered for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum FailedAt {
    Page(u64),
    Range(u64),
}

/// Failed pages and code ranges of one process; bounded by count.
#[derive(Debug, Default)]
struct NegativeCache {
    /// Until when it is not looked at (`None`: a range with failures so
    /// far, and how many in a row).
    failed: HashMap<FailedAt, (Option<Instant>, u32)>,
}

impl NegativeCache {
    fn is_bad(&self, at: FailedAt, now: Instant) -> bool {
        matches!(self.failed.get(&at), Some((Some(until), _)) if now < *until)
    }

    fn fail(&mut self, at: FailedAt, now: Instant) {
        if self.failed.len() >= MAX_FAILED && !self.failed.contains_key(&at) {
            // Forget the ones that expire first (and ranges still counting).
            let mut until: Vec<Instant> = self.failed.values().filter_map(|(u, _)| *u).collect();
            until.sort_unstable();
            let keep_from = until.get(until.len() / 2).copied();
            self.failed
                .retain(|_, (u, _)| u.zip(keep_from).is_some_and(|(u, k)| u >= k));
        }
        let entry = self.failed.entry(at).or_insert((None, 0));
        entry.1 = entry.1.saturating_add(1);
        let threshold = match at {
            FailedAt::Page(_) => 1,
            FailedAt::Range(_) => RANGE_FAILURES,
        };
        if entry.1 >= threshold {
            *entry = (Some(now + FAILED_FOR), 0);
        }
    }

    fn named(&mut self, range: Option<u64>) {
        if let Some(range) = range {
            self.failed.remove(&FailedAt::Range(range));
        }
    }
}

/// One process's share: its window's reads and time, its failed places,
/// its failures in a row and whether it is put aside.
#[derive(Debug, Default)]
struct ProcessState {
    window: u64,
    reads: u64,
    spent: Duration,
    negative: NegativeCache,
    failed_in_a_row: u64,
    failed_reads_in_a_row: u64,
    named_ever: bool,
    aside_until: Option<Instant>,
    aside_for: Duration,
    times_aside: u64,
}

/// The naming budget of one process; see the module doc.
#[derive(Debug)]
pub struct ProcessNamingBudget {
    shared: &'static SharedNamingBudget,
    state: Mutex<ProcessState>,
    /// Lookups refused, for the process's warning.
    pub refused: AtomicU64,
}

/// How a metered lookup ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Named,
    NotManaged,
    Failed,
}

/// A lookup allowed to run: its deadline and the range it started in.
#[derive(Debug, Clone, Copy)]
pub struct Permit {
    started: Instant,
    deadline: Instant,
    reads_left: u64,
    page: u64,
    range: Option<u64>,
}

impl ProcessNamingBudget {
    pub fn new(shared: &'static SharedNamingBudget) -> Self {
        Self {
            shared,
            state: Mutex::new(ProcessState::default()),
            refused: AtomicU64::new(0),
        }
    }

    /// Whether a lookup of `pc` (in the cached code range starting at
    /// `range`, if any) may run now, and with what.
    pub fn permit(&self, pc: u64, range: Option<u64>, now: Instant) -> Result<Permit, Refusal> {
        let result = self.try_permit(pc, range, now);
        if let Err(refusal) = result {
            self.refused.fetch_add(1, Ordering::Relaxed);
            let counts = &self.shared.counts;
            bump(match refusal {
                Refusal::OverBudget => &counts.over_budget,
                Refusal::KnownBad => &counts.known_bad,
                Refusal::PutAside => &counts.put_aside,
            });
        }
        result
    }

    fn try_permit(&self, pc: u64, range: Option<u64>, now: Instant) -> Result<Permit, Refusal> {
        let mut state = self.state.lock().map_err(|_| Refusal::OverBudget)?;
        let window = self.shared.window.load(Ordering::Relaxed);
        if state.window != window {
            (state.window, state.reads, state.spent) = (window, 0, Duration::ZERO);
        }
        if state.aside_until.is_some_and(|until| now < until) {
            return Err(Refusal::PutAside);
        }
        let page = pc >> 12;
        if state.negative.is_bad(FailedAt::Page(page), now)
            || range.is_some_and(|r| state.negative.is_bad(FailedAt::Range(r), now))
        {
            return Err(Refusal::KnownBad);
        }
        let time = if self.shared.cut_spent() {
            FAIR_SHARE
        } else {
            WINDOW_TIME
        };
        let left = time.saturating_sub(state.spent);
        if state.reads >= WINDOW_READS || left.is_zero() {
            return Err(Refusal::OverBudget);
        }
        Ok(Permit {
            started: now,
            deadline: now + left,
            reads_left: (WINDOW_READS - state.reads).min(LOOKUP_READS),
            page,
            range,
        })
    }

    /// A lookup made under `permit` made `reads` reads and ended so.
    pub fn charge(&self, permit: &Permit, reads: u64, outcome: Outcome, now: Instant) {
        let took = now.saturating_duration_since(permit.started);
        self.shared
            .window_spent_ns
            .fetch_add(nanos(took), Ordering::Relaxed);
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        state.reads = state.reads.saturating_add(reads);
        state.spent += took;
        match outcome {
            Outcome::Named | Outcome::NotManaged => {
                state.failed_in_a_row = 0;
                state.failed_reads_in_a_row = 0;
                state.named_ever |= outcome == Outcome::Named;
                state.negative.named(permit.range);
                if outcome == Outcome::Named {
                    state.aside_for = Duration::ZERO;
                }
            }
            Outcome::Failed => {
                state.negative.fail(FailedAt::Page(permit.page), now);
                if let Some(range) = permit.range {
                    state.negative.fail(FailedAt::Range(range), now);
                }
                state.failed_in_a_row += 1;
                state.failed_reads_in_a_row = state.failed_reads_in_a_row.saturating_add(reads);
                if state.failed_in_a_row >= PUT_ASIDE_AFTER
                    || state.failed_reads_in_a_row >= PUT_ASIDE_AFTER_READS
                {
                    (state.failed_in_a_row, state.failed_reads_in_a_row) = (0, 0);
                    state.aside_for = (state.aside_for * 2).clamp(ASIDE_FIRST, ASIDE_LONGEST);
                    state.aside_until = Some(now + state.aside_for);
                    state.times_aside += 1;
                    bump(&self.shared.counts.processes_put_aside);
                }
            }
        }
    }

    /// How often the process was put aside, and whether it was ever named.
    pub fn put_aside(&self) -> (u64, bool) {
        self.state
            .lock()
            .map_or((0, false), |s| (s.times_aside, s.named_ever))
    }
}

/// A [`TargetMemory`] that refuses reads past a count or a deadline: what
/// a metered lookup or scan reads through. The clock is looked at on every
/// read (a vDSO call, next to a `process_vm_readv` syscall).
pub struct Metered<'a> {
    mem: &'a dyn TargetMemory,
    deadline: Instant,
    reads_left: Cell<u64>,
    reads: Cell<u64>,
    stopped: Cell<bool>,
}

impl<'a> Metered<'a> {
    pub fn new(mem: &'a dyn TargetMemory, deadline: Instant, reads: u64) -> Self {
        Self {
            mem,
            deadline,
            reads_left: Cell::new(reads),
            reads: Cell::new(0),
            stopped: Cell::new(false),
        }
    }

    pub fn for_lookup(mem: &'a dyn TargetMemory, permit: &Permit) -> Self {
        Self::new(mem, permit.deadline, permit.reads_left)
    }

    /// Reads made.
    pub fn reads(&self) -> u64 {
        self.reads.get()
    }

    /// Whether a read was refused by the bound.
    pub fn stopped(&self) -> bool {
        self.stopped.get()
    }
}

impl TargetMemory for Metered<'_> {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        if self.reads_left.get() == 0 || Instant::now() >= self.deadline {
            self.stopped.set(true);
            return Err(ReadError::OverBudget { addr });
        }
        self.reads_left.set(self.reads_left.get() - 1);
        self.reads.set(self.reads.get() + 1);
        self.mem.read(addr, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clr::memory::target::{FakeMemory, ReadExt};

    fn leaked() -> &'static SharedNamingBudget {
        Box::leak(Box::default())
    }

    #[test]
    fn a_failed_page_is_not_read_again_for_a_while() {
        let budget = ProcessNamingBudget::new(leaked());
        let t0 = Instant::now();
        let permit = budget.permit(0x7000_1234, None, t0).unwrap();
        budget.charge(&permit, 10, Outcome::Failed, t0);
        assert_eq!(
            budget.permit(0x7000_1ff0, None, t0).unwrap_err(),
            Refusal::KnownBad
        );
        // Another page is looked at; the first again once it expired.
        assert!(budget.permit(0x7000_2000, None, t0).is_ok());
        assert!(budget.permit(0x7000_1234, None, t0 + FAILED_FOR).is_ok());
        assert_eq!(budget.shared.counts.snapshot().known_bad, 1);
    }

    #[test]
    fn a_range_fails_after_failures_in_a_row_and_a_name_clears_it() {
        let budget = ProcessNamingBudget::new(leaked());
        let t0 = Instant::now();
        let range = Some(0x7000_0000);
        for i in 0..RANGE_FAILURES as u64 - 1 {
            let permit = budget.permit(0x7000_0000 + i * 4096, range, t0).unwrap();
            budget.charge(&permit, 1, Outcome::Failed, t0);
        }
        let permit = budget.permit(0x7100_0000, range, t0).unwrap();
        budget.charge(&permit, 1, Outcome::Named, t0);
        for i in 0..RANGE_FAILURES as u64 {
            let permit = budget.permit(0x7200_0000 + i * 4096, range, t0).unwrap();
            budget.charge(&permit, 1, Outcome::Failed, t0);
        }
        assert_eq!(
            budget.permit(0x7300_0000, range, t0).unwrap_err(),
            Refusal::KnownBad
        );
        assert!(budget.permit(0x7300_0000, None, t0).is_ok());
    }

    #[test]
    fn the_window_budget_stops_a_process_until_the_next_window() {
        let shared = leaked();
        let budget = ProcessNamingBudget::new(shared);
        let other = ProcessNamingBudget::new(shared);
        let t0 = Instant::now();
        let permit = budget.permit(0x1000, None, t0).unwrap();
        assert_eq!(permit.reads_left, LOOKUP_READS);
        budget.charge(&permit, WINDOW_READS, Outcome::NotManaged, t0);
        assert_eq!(
            budget.permit(0x2000, None, t0).unwrap_err(),
            Refusal::OverBudget
        );
        // Another tenant is not charged for it.
        assert!(other.permit(0x2000, None, t0).is_ok());
        shared.new_window();
        assert!(budget.permit(0x2000, None, t0).is_ok());
        // Time counts too: a lookup that took the window's time.
        let permit = budget.permit(0x3000, None, t0).unwrap();
        assert!(permit.deadline <= t0 + WINDOW_TIME);
        budget.charge(&permit, 1, Outcome::NotManaged, t0 + WINDOW_TIME);
        assert_eq!(
            budget.permit(0x4000, None, t0).unwrap_err(),
            Refusal::OverBudget
        );
        assert_eq!(shared.counts.snapshot().over_budget, 2);
    }

    #[test]
    fn once_the_cut_is_spent_each_process_keeps_a_fair_share() {
        let shared = leaked();
        let hog = ProcessNamingBudget::new(shared);
        let t0 = Instant::now();
        let permit = hog.permit(0x1000, None, t0).unwrap();
        shared
            .window_spent_ns
            .store(nanos(CUT_TIME), Ordering::Relaxed);
        hog.charge(&permit, 1, Outcome::Named, t0 + FAIR_SHARE);
        assert_eq!(
            hog.permit(0x2000, None, t0).unwrap_err(),
            Refusal::OverBudget
        );
        let tenant = ProcessNamingBudget::new(shared);
        let permit = tenant.permit(0x1000, None, t0).unwrap();
        assert!(permit.deadline <= t0 + FAIR_SHARE);
    }

    #[test]
    fn a_process_whose_lookups_all_fail_is_put_aside_longer_each_time() {
        let budget = ProcessNamingBudget::new(leaked());
        let mut now = Instant::now();
        for round in 0..2u32 {
            for i in 0..PUT_ASIDE_AFTER {
                let permit = budget.permit(i << 12, None, now).unwrap();
                budget.charge(&permit, 1, Outcome::Failed, now);
            }
            assert_eq!(
                budget.permit(0x9999_0000, None, now).unwrap_err(),
                Refusal::PutAside
            );
            let aside = ASIDE_FIRST * 2u32.pow(round);
            assert_eq!(
                budget
                    .permit(0x9999_0000, None, now + aside - Duration::from_secs(1))
                    .unwrap_err(),
                Refusal::PutAside
            );
            now += aside + FAILED_FOR;
            assert!(budget.permit(0x9999_0000, None, now).is_ok());
        }
        assert_eq!(budget.put_aside(), (2, false));
        assert_eq!(budget.shared.counts.snapshot().processes_put_aside, 2);
    }

    #[test]
    fn a_process_whose_costly_lookups_all_fail_is_put_aside_after_a_windows_reads() {
        let budget = ProcessNamingBudget::new(leaked());
        let now = Instant::now();
        let lookups = PUT_ASIDE_AFTER_READS.div_ceil(LOOKUP_READS);
        assert!(lookups < PUT_ASIDE_AFTER);
        for i in 0..lookups {
            assert_eq!(budget.put_aside().0, 0, "put aside after {i} lookups");
            let permit = budget.permit(i << 12, None, now).unwrap();
            budget.charge(&permit, LOOKUP_READS, Outcome::Failed, now);
            budget.shared.new_window();
        }
        assert_eq!(
            budget.permit(0x9999_0000, None, now).unwrap_err(),
            Refusal::PutAside
        );
        assert_eq!(budget.put_aside(), (1, false));
    }

    #[test]
    fn the_negative_cache_is_bounded() {
        let mut cache = NegativeCache::default();
        let t0 = Instant::now();
        for page in 0..(MAX_FAILED as u64 * 3) {
            cache.fail(FailedAt::Page(page), t0 + Duration::from_micros(page));
        }
        assert!(cache.failed.len() <= MAX_FAILED);
        // The newest are kept.
        let last = MAX_FAILED as u64 * 3 - 1;
        assert!(cache.is_bad(FailedAt::Page(last), t0));
    }

    #[test]
    fn metered_reads_stop_at_the_count_and_the_deadline() {
        let mut mem = FakeMemory::new();
        mem.put(0x10_0000, &[7u8; 64]);
        let far = Instant::now() + Duration::from_secs(60);
        let metered = Metered::new(&mem, far, 2);
        assert_eq!(metered.read_u8(0x10_0000).unwrap(), 7);
        assert_eq!(metered.read_u8(0x10_0001).unwrap(), 7);
        assert!(matches!(
            metered.read_u8(0x10_0002),
            Err(ReadError::OverBudget { .. })
        ));
        assert_eq!(metered.reads(), 2);
        assert!(metered.stopped());
        let past = Metered::new(&mem, Instant::now(), 100);
        assert!(past.read_u8(0x10_0000).is_err());
    }

    #[test]
    fn scans_share_their_second() {
        let shared = leaked();
        let t0 = Instant::now();
        let own = Duration::from_millis(200);
        let deadline = shared.scan_deadline(own, t0).unwrap();
        assert_eq!(deadline, t0 + SCAN_TIME_PER_SECOND);
        shared.charge_scan(SCAN_TIME_PER_SECOND, true);
        assert!(shared.scan_deadline(own, t0).is_none());
        assert!(
            shared
                .scan_deadline(own, t0 + Duration::from_secs(1))
                .is_some()
        );
        let counts = shared.counts.snapshot();
        assert_eq!((counts.scans_deferred, counts.scans_cut_short), (1, 1));
    }
}
