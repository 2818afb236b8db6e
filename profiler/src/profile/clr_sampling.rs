//! Sampling and upscaling of CLR events before aggregation, after Datadog's
//! .NET profiler: the expensive part of an event (its stack, symbolized later,
//! and its strings) is kept for a bounded number of events per window, and
//! the kept ones are weighted so that the totals are exact.
//!
//! - Contention: events fall into duration buckets (0-9, 10-49, 50-99,
//!   100-499, 500+ ms); each bucket keeps a uniform reservoir of at most
//!   `limit / 5` events per window and counts every event and its delay.
//!   At the end of the window each bucket's exact count and delay are
//!   apportioned over its kept events (count evenly, delay in proportion to
//!   each one's duration).
//! - Wait-handle waits (.NET 9+, [`crate::clr::waits`]): exactly as
//!   contention, on a [`ContentionSampler`] of their own with the same
//!   limit, so waits never crowd contentions out of the budget (nor the
//!   reverse), and each kind's totals stay exact.
//! - Exceptions: the first exception of each type in a window is always
//!   kept; the others with a probability a PID controller adjusts every tick
//!   so that about `limit` are kept per window (a hard cap stops at the
//!   limit). Each type's exact count is apportioned over its kept events.
//!   Exceptions the runtime counted but sent no event for (the events were
//!   off during a storm, [`crate::clr::budget`]) are added to the types in
//!   proportion to the window's events, or to the kept events of the last
//!   window that had some: the counter gives the total, the events the
//!   shape.
//!
//! Apportioning uses the largest-remainder method, so the integer weights
//! of a group add up exactly to its total. Windows are measured in event
//! time (CLOCK_MONOTONIC ns). Everything here is pure and deterministic
//! (seeded generator), so the arithmetic is unit-tested.

use std::collections::HashMap;

/// Splits `total` into integers proportional to `weights` that add up to
/// exactly `total` (largest remainder). Non-finite or negative weights count
/// as 0; if all are 0 the split is even. Empty `weights` gives an empty list.
///
/// `total` and the weights come from the target (a contention's
/// `DurationNs`, the runtime's exception counter), so nothing here may wrap
/// or loop per unit: the floors are summed in `u128`, and what floating
/// error leaves over or under is settled in whole passes over the entries.
pub fn apportion(total: u64, weights: &[f64]) -> Vec<u64> {
    if weights.is_empty() {
        return Vec::new();
    }
    let clean: Vec<f64> = weights
        .iter()
        .map(|&w| if w.is_finite() && w > 0.0 { w } else { 0.0 })
        .collect();
    let sum: f64 = clean.iter().sum();
    let shares: Vec<f64> = if sum > 0.0 && sum.is_finite() {
        clean.iter().map(|w| total as f64 * (w / sum)).collect()
    } else {
        vec![total as f64 / clean.len() as f64; clean.len()]
    };
    // `as` saturates, and no share is above the total.
    let mut out: Vec<u64> = shares
        .iter()
        .map(|s| (s.floor() as u64).min(total))
        .collect();
    let assigned: u128 = out.iter().map(|&v| u128::from(v)).sum();
    let total_wide = u128::from(total);
    if assigned < total_wide {
        let mut order: Vec<usize> = (0..shares.len()).collect();
        order.sort_by(|&a, &b| {
            let ra = shares[a] - shares[a].floor();
            let rb = shares[b] - shares[b].floor();
            rb.total_cmp(&ra).then(a.cmp(&b))
        });
        give(&mut out, &order, total_wide - assigned);
    } else if assigned > total_wide {
        // Rounding up of large shares: take the excess back from the
        // largest entries first.
        let mut order: Vec<usize> = (0..out.len()).collect();
        order.sort_by(|&a, &b| out[b].cmp(&out[a]).then(a.cmp(&b)));
        take(&mut out, &order, assigned - total_wide);
    }
    out
}

/// Adds `left` to `out`, an even part to every entry and one more to the
/// first `left % n` in `order`: one pass, whatever `left` is. The result
/// fits: the entries then add up to a `u64` total.
fn give(out: &mut [u64], order: &[usize], left: u128) {
    let n = order.len() as u128;
    let (each, extra) = (left / n, left % n);
    for (rank, &i) in order.iter().enumerate() {
        let add = each + u128::from((rank as u128) < extra);
        out[i] = u64::try_from(u128::from(out[i]) + add).unwrap_or(u64::MAX);
    }
}

/// Takes `excess` from `out` in `order`, each entry down to at most 0: one
/// pass, whatever `excess` is.
fn take(out: &mut [u64], order: &[usize], mut excess: u128) {
    for &i in order {
        if excess == 0 {
            break;
        }
        let cut = excess.min(u128::from(out[i]));
        out[i] -= u64::try_from(cut).expect("no more than the entry");
        excess -= cut;
    }
}

/// A small deterministic generator (SplitMix64): sampling decisions need
/// no cryptographic quality, only independence from the workload.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[0, n)`; `n` must be > 0.
    pub fn below(&mut self, n: u64) -> u64 {
        // Modulo bias is at most n / 2^64: irrelevant here.
        self.next_u64() % n.max(1)
    }
}

/// Lower bounds of the contention duration buckets, in milliseconds.
pub const CONTENTION_BUCKETS_MS: [u64; 5] = [0, 10, 50, 100, 500];
/// Default per-window limits.
pub const DEFAULT_CONTENTION_LIMIT: usize = 3000;
pub const DEFAULT_EXCEPTION_LIMIT: usize = 500;

/// The bucket of a contention of `duration_ns`.
pub fn contention_bucket(duration_ns: u64) -> usize {
    let ms = duration_ns / 1_000_000;
    CONTENTION_BUCKETS_MS
        .iter()
        .rposition(|&low| ms >= low)
        .unwrap_or(0)
}

/// The event-time window a sampler fills: it opens at its first event and
/// closes at the first event (or [`EventWindow::due`] check) at least its
/// length later, so a quiet process opens no empty windows. Shared by the
/// contention, exception and allocation samplers.
#[derive(Clone, Copy, Debug)]
pub struct EventWindow {
    length_ns: u64,
    start_ns: Option<u64>,
}

impl EventWindow {
    pub fn new(length_ns: u64) -> Self {
        Self {
            length_ns: length_ns.max(1),
            start_ns: None,
        }
    }

    pub fn is_open(&self) -> bool {
        self.start_ns.is_some()
    }

    /// Moves to an event at `time_ns`; `true` when the open window ended
    /// before it: the caller closes it, and `time_ns` opens the next.
    pub fn advance(&mut self, time_ns: u64) -> bool {
        match self.start_ns {
            Some(start) if time_ns < start.saturating_add(self.length_ns) => false,
            Some(_) => {
                self.start_ns = Some(time_ns);
                true
            }
            None => {
                self.start_ns = Some(time_ns);
                false
            }
        }
    }

    /// `true` when the open window ended before `now_ns`: the caller
    /// closes it, and the next event opens one.
    pub fn due(&mut self, now_ns: u64) -> bool {
        let due = self
            .start_ns
            .is_some_and(|start| now_ns >= start.saturating_add(self.length_ns));
        if due {
            self.start_ns = None;
        }
        due
    }

    /// Ends the open window; `true` when one was open.
    pub fn finish(&mut self) -> bool {
        self.start_ns.take().is_some()
    }
}

/// A kept event with its share of the exact totals.
#[derive(Clone, Debug, PartialEq)]
pub struct Weighted<T> {
    pub item: T,
    /// Events this one stands for.
    pub count: u64,
    /// Contention or wait delay it stands for (0 for exceptions); for
    /// allocations ([`super::alloc_sampling`]), the bytes it stands for.
    pub delay_ns: u64,
}

#[derive(Clone, Debug)]
struct ContentionBucket<T> {
    seen: u64,
    delay_ns: u64,
    kept: Vec<(u64, T)>,
}

impl<T> Default for ContentionBucket<T> {
    fn default() -> Self {
        Self {
            seen: 0,
            delay_ns: 0,
            kept: Vec::new(),
        }
    }
}

/// Contention sampler; see the module documentation.
#[derive(Clone, Debug)]
pub struct ContentionSampler<T> {
    per_bucket: usize,
    window: EventWindow,
    buckets: [ContentionBucket<T>; 5],
    completed: Vec<Weighted<T>>,
    rng: SplitMix64,
}

impl<T> ContentionSampler<T> {
    /// At most `limit_per_window` kept per `window_ns` (spread evenly over
    /// the five buckets, at least one each).
    pub fn new(limit_per_window: usize, window_ns: u64, seed: u64) -> Self {
        Self {
            per_bucket: (limit_per_window / CONTENTION_BUCKETS_MS.len()).max(1),
            window: EventWindow::new(window_ns),
            buckets: Default::default(),
            completed: Vec::new(),
            rng: SplitMix64::new(seed),
        }
    }

    /// Counts a contention of `duration_ns` that ended at `time_ns`; keeps
    /// it (building it with `make`) if the reservoir picks it.
    pub fn offer(&mut self, time_ns: u64, duration_ns: u64, make: impl FnOnce() -> T) {
        if self.window.advance(time_ns) {
            self.close_window();
        }
        let per_bucket = self.per_bucket;
        let bucket = &mut self.buckets[contention_bucket(duration_ns)];
        bucket.seen += 1;
        bucket.delay_ns = bucket.delay_ns.saturating_add(duration_ns);
        if bucket.kept.len() < per_bucket {
            bucket.kept.push((duration_ns, make()));
        } else {
            // Algorithm R: the n-th event replaces a kept one with
            // probability k / n, which keeps the reservoir uniform.
            let j = self.rng.below(bucket.seen);
            if let Some(slot) = usize::try_from(j).ok().and_then(|j| bucket.kept.get_mut(j)) {
                *slot = (duration_ns, make());
            }
        }
    }

    fn close_window(&mut self) {
        for bucket in &mut self.buckets {
            let ContentionBucket {
                seen,
                delay_ns,
                kept,
            } = std::mem::take(bucket);
            let counts = apportion(seen, &vec![1.0; kept.len()]);
            let weights: Vec<f64> = kept.iter().map(|&(d, _)| d as f64).collect();
            let delays = apportion(delay_ns, &weights);
            for (((_, item), count), delay_ns) in kept.into_iter().zip(counts).zip(delays) {
                self.completed.push(Weighted {
                    item,
                    count,
                    delay_ns,
                });
            }
        }
    }

    /// The weighted events of the windows closed so far.
    pub fn take_completed(&mut self) -> Vec<Weighted<T>> {
        std::mem::take(&mut self.completed)
    }

    /// Closes the current window and returns everything not taken yet.
    pub fn finish(&mut self) -> Vec<Weighted<T>> {
        self.window.finish();
        self.close_window();
        self.take_completed()
    }
}

/// Gains of the exception sampler's controller. The controller sets the
/// next tick's budget of kept events from the error (target - kept) of the
/// ticks so far.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PidGains {
    pub kp: f64,
    pub ki: f64,
    pub kd: f64,
}

impl Default for PidGains {
    fn default() -> Self {
        Self {
            kp: 0.5,
            ki: 0.1,
            kd: 0.1,
        }
    }
}

/// A PID controller over the kept-per-tick error that outputs the sampling
/// probability of the next tick.
#[derive(Clone, Debug)]
pub struct SamplingController {
    gains: PidGains,
    target_per_tick: f64,
    integral: f64,
    previous_error: f64,
    probability: f64,
}

impl SamplingController {
    /// Smallest probability: a storm never hides a type forever.
    pub const MIN_PROBABILITY: f64 = 1e-6;

    pub fn new(target_per_tick: f64, gains: PidGains) -> Self {
        Self {
            gains,
            target_per_tick: target_per_tick.max(0.0),
            integral: 0.0,
            previous_error: 0.0,
            probability: 1.0,
        }
    }

    pub fn probability(&self) -> f64 {
        self.probability
    }

    /// One tick saw `seen` candidates and kept `kept`: set the probability
    /// for the next one.
    pub fn update(&mut self, seen: u64, kept: u64) -> f64 {
        let PidGains { kp, ki, kd } = self.gains;
        let error = self.target_per_tick - kept as f64;
        // Anti-windup: the integral never asks for more than a few ticks'
        // worth of events.
        let bound = 4.0 * self.target_per_tick.max(1.0);
        self.integral = (self.integral + error).clamp(-bound, bound);
        let derivative = error - self.previous_error;
        self.previous_error = error;
        let budget =
            (self.target_per_tick + kp * error + ki * self.integral + kd * derivative).max(0.0);
        self.probability = if seen == 0 {
            1.0
        } else {
            (budget / seen as f64).clamp(Self::MIN_PROBABILITY, 1.0)
        };
        self.probability
    }
}

/// Ticks of the controller per window.
pub const CONTROLLER_TICKS_PER_WINDOW: u64 = 20;
/// Exception types tracked per window; the types beyond (a hostile or
/// generated set) share one tally, so memory stays bounded and the total
/// stays exact, but they are not each guaranteed a kept sample.
pub const MAX_EXCEPTION_TYPES_PER_WINDOW: usize = 1024;
/// The tally of the types beyond [`MAX_EXCEPTION_TYPES_PER_WINDOW`].
pub const OTHER_EXCEPTION_TYPES: &str = "[other exception types]";

#[derive(Clone, Debug)]
struct ExceptionType<T> {
    thrown: u64,
    kept: Vec<T>,
    /// Stands for the type's exceptions when no event with a stack showed
    /// it in the window ([`ExceptionSampler::count`]).
    placeholder: Option<T>,
}

/// Exceptions the runtime counted but sent no event for (their events were
/// off, see [`crate::clr::budget`]), in the current window.
#[derive(Clone, Debug)]
struct Unobserved<T> {
    count: u64,
    /// Stands for them when no event gives them a shape.
    placeholder: T,
}

/// Exception sampler; see the module documentation.
#[derive(Clone, Debug)]
pub struct ExceptionSampler<T> {
    limit: u64,
    window: EventWindow,
    tick_ns: u64,
    tick_start_ns: u64,
    tick_seen: u64,
    tick_kept: u64,
    window_kept: u64,
    controller: SamplingController,
    types: HashMap<Box<str>, ExceptionType<T>>,
    unobserved: Option<Unobserved<T>>,
    /// The kept events of the last window that had any, with their shares:
    /// the shape given to a later window's unobserved exceptions.
    last_shape: Vec<Weighted<T>>,
    completed: Vec<Weighted<T>>,
    rng: SplitMix64,
}

impl<T: Clone> ExceptionSampler<T> {
    pub fn new(limit_per_window: usize, window_ns: u64, seed: u64) -> Self {
        let window_ns = window_ns.max(CONTROLLER_TICKS_PER_WINDOW);
        let limit = limit_per_window as u64;
        Self {
            limit,
            window: EventWindow::new(window_ns),
            tick_ns: window_ns / CONTROLLER_TICKS_PER_WINDOW,
            tick_start_ns: 0,
            tick_seen: 0,
            tick_kept: 0,
            window_kept: 0,
            controller: SamplingController::new(
                limit as f64 / CONTROLLER_TICKS_PER_WINDOW as f64,
                PidGains::default(),
            ),
            types: HashMap::new(),
            unobserved: None,
            last_shape: Vec::new(),
            completed: Vec::new(),
            rng: SplitMix64::new(seed),
        }
    }

    /// The probability the controller currently applies.
    pub fn probability(&self) -> f64 {
        self.controller.probability()
    }

    /// Counts an exception of `type_name` thrown at `time_ns`; returns
    /// whether it was kept (built with `make`).
    pub fn offer(&mut self, time_ns: u64, type_name: &str, make: impl FnOnce() -> T) -> bool {
        self.advance(time_ns);
        self.type_entry(type_name).thrown += 1;
        self.keep(type_name, make)
    }

    /// Counts an exception of `type_name` thrown at `time_ns` whose event
    /// carries no stack (a session without stack walks, which stays on
    /// over the budget): the exact count, while [`Self::offer_shape`] takes
    /// the events with stacks. `placeholder` stands for the type in a
    /// window where no event with a stack showed it.
    pub fn count(&mut self, time_ns: u64, type_name: &str, placeholder: impl FnOnce() -> T) {
        self.advance(time_ns);
        let entry = self.type_entry(type_name);
        entry.thrown += 1;
        if entry.placeholder.is_none() {
            entry.placeholder = Some(placeholder());
        }
    }

    /// Offers an exception event with its stack whose exception
    /// [`Self::count`] counts; returns whether it was kept (built with
    /// `make`). The first of its type in the window is always kept.
    pub fn offer_shape(&mut self, time_ns: u64, type_name: &str, make: impl FnOnce() -> T) -> bool {
        self.advance(time_ns);
        self.type_entry(type_name);
        self.keep(type_name, make)
    }

    /// The tally of `type_name` in the window (of
    /// [`OTHER_EXCEPTION_TYPES`] beyond the types tracked).
    fn type_entry(&mut self, type_name: &str) -> &mut ExceptionType<T> {
        let type_name = self.tracked_name(type_name);
        self.types
            .entry(type_name.into())
            .or_insert_with(|| ExceptionType {
                thrown: 0,
                kept: Vec::new(),
                placeholder: None,
            })
    }

    fn tracked_name<'a>(&self, type_name: &'a str) -> &'a str {
        if self.types.len() >= MAX_EXCEPTION_TYPES_PER_WINDOW && !self.types.contains_key(type_name)
        {
            OTHER_EXCEPTION_TYPES
        } else {
            type_name
        }
    }

    /// Keeps an event of `type_name` (tallied already) if it is the first
    /// kept of its type in the window, or if the controller picks it.
    fn keep(&mut self, type_name: &str, make: impl FnOnce() -> T) -> bool {
        self.tick_seen += 1;
        let type_name = self.tracked_name(type_name);
        let under_limit = self.window_kept < self.limit;
        let probability = self.probability();
        let Some(entry) = self.types.get_mut(type_name) else {
            return false;
        };
        let keep = entry.kept.is_empty() || (under_limit && self.rng.next_f64() < probability);
        if keep {
            entry.kept.push(make());
            self.tick_kept += 1;
            self.window_kept += 1;
        }
        keep
    }

    /// Adds `count` exceptions thrown by `time_ns` that came without events
    /// (the runtime's counter saw them). They take the shape of the
    /// window's events: each type's share of its thrown ones, or, in a
    /// window without events, the kept events of the last window that had
    /// some; without either, `placeholder` stands for them.
    pub fn add_unobserved(&mut self, time_ns: u64, count: u64, placeholder: impl FnOnce() -> T) {
        if count == 0 {
            return;
        }
        self.advance(time_ns);
        match &mut self.unobserved {
            Some(unobserved) => unobserved.count = unobserved.count.saturating_add(count),
            None => {
                self.unobserved = Some(Unobserved {
                    count,
                    placeholder: placeholder(),
                });
            }
        }
    }

    /// Closes the current window if it ended before `now_ns`, so that its
    /// samples come out even when no later event does.
    pub fn close_due(&mut self, now_ns: u64) {
        if self.window.due(now_ns) {
            self.close_window();
        }
    }

    fn advance(&mut self, time_ns: u64) {
        if !self.window.is_open() {
            self.window.advance(time_ns);
            self.tick_start_ns = time_ns;
            return;
        }
        if self.window.advance(time_ns) {
            self.close_window();
        }
        if time_ns >= self.tick_start_ns.saturating_add(self.tick_ns) {
            self.controller.update(self.tick_seen, self.tick_kept);
            self.tick_seen = 0;
            self.tick_kept = 0;
            self.tick_start_ns = time_ns;
        }
    }

    fn close_window(&mut self) {
        let mut types: Vec<(Box<str>, ExceptionType<T>)> = self.types.drain().collect();
        // Deterministic output order.
        types.sort_by(|a, b| a.0.cmp(&b.0));
        let unobserved = self.unobserved.take();
        if let Some(Unobserved { count, .. }) = &unobserved
            && !types.is_empty()
        {
            let weights: Vec<f64> = types.iter().map(|(_, t)| t.thrown as f64).collect();
            for ((_, ty), extra) in types.iter_mut().zip(apportion(*count, &weights)) {
                ty.thrown = ty.thrown.saturating_add(extra);
            }
        }
        let first = self.completed.len();
        for (
            _,
            ExceptionType {
                thrown,
                mut kept,
                placeholder,
            },
        ) in types
        {
            if kept.is_empty() {
                kept.extend(placeholder);
            }
            let counts = apportion(thrown, &vec![1.0; kept.len()]);
            // Events with stacks of a type counted in another window
            // stand for none here.
            for (item, count) in kept.into_iter().zip(counts).filter(|(_, c)| *c > 0) {
                self.completed.push(Weighted {
                    item,
                    count,
                    delay_ns: 0,
                });
            }
        }
        if self.completed.len() > first {
            self.last_shape = self.completed[first..].to_vec();
        } else if let Some(Unobserved { count, placeholder }) = unobserved {
            if self.last_shape.is_empty() {
                self.completed.push(Weighted {
                    item: placeholder,
                    count,
                    delay_ns: 0,
                });
            } else {
                let weights: Vec<f64> = self.last_shape.iter().map(|w| w.count as f64).collect();
                for (shape, count) in self.last_shape.iter().zip(apportion(count, &weights)) {
                    if count > 0 {
                        self.completed.push(Weighted {
                            item: shape.item.clone(),
                            count,
                            delay_ns: 0,
                        });
                    }
                }
            }
        }
        self.window_kept = 0;
    }

    pub fn take_completed(&mut self) -> Vec<Weighted<T>> {
        std::mem::take(&mut self.completed)
    }

    /// Closes the current window and returns everything not taken yet.
    pub fn finish(&mut self) -> Vec<Weighted<T>> {
        self.window.finish();
        self.close_window();
        self.take_completed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    #[test]
    fn event_windows_open_at_an_event_and_close_by_time() {
        let mut w = EventWindow::new(10 * SECOND);
        assert!(!w.due(100 * SECOND), "no window open: nothing due");
        assert!(!w.advance(5 * SECOND));
        assert!(!w.advance(14 * SECOND));
        assert!(!w.due(14 * SECOND));
        // The event at 15 s ends the window opened at 5 s and opens the next.
        assert!(w.advance(15 * SECOND));
        assert!(!w.advance(24 * SECOND));
        assert!(w.due(25 * SECOND));
        assert!(!w.is_open() && !w.finish());
        assert!(!w.advance(40 * SECOND) && w.finish());
    }

    #[test]
    fn apportion_adds_up_exactly() {
        assert_eq!(apportion(10, &[1.0, 1.0, 1.0]), vec![4, 3, 3]);
        assert_eq!(apportion(7, &[0.0, 3.0, 1.0]), vec![0, 5, 2]);
        assert_eq!(apportion(5, &[0.0, 0.0]), vec![3, 2]);
        assert_eq!(apportion(0, &[1.0, 2.0]), vec![0, 0]);
        assert!(apportion(9, &[]).is_empty());
        let weird = apportion(1000, &[f64::NAN, -1.0, f64::INFINITY, 2.0]);
        assert_eq!(weird, vec![0, 0, 0, 1000]);
        let many: Vec<f64> = (1..=997).map(|i| (i % 13) as f64 + 0.5).collect();
        assert_eq!(
            apportion(123_456_789, &many).iter().sum::<u64>(),
            123_456_789
        );
    }

    #[test]
    fn apportion_of_hostile_totals_is_exact_and_quick() {
        // Issue 33, defect 1: the floors' u64 sum wrapped to 0 and the
        // remainder loop counted down from u64::MAX.
        let half = (1u64 << 63) as f64;
        let out = apportion(u64::MAX, &[half, half]);
        assert_eq!(
            out.iter().map(|&v| u128::from(v)).sum::<u128>(),
            u128::from(u64::MAX)
        );
        assert_eq!(apportion(u64::MAX, &[1.0, 1.0]).len(), 2);
        assert_eq!(
            apportion(u64::MAX, &[f64::MAX, f64::MAX])
                .iter()
                .map(|&v| u128::from(v))
                .sum::<u128>(),
            u128::from(u64::MAX)
        );
        assert_eq!(
            apportion(u64::MAX, &[0.0; 3])
                .iter()
                .map(|&v| u128::from(v))
                .sum::<u128>(),
            u128::from(u64::MAX)
        );
    }

    #[test]
    fn apportion_adds_up_exactly_for_extreme_values() {
        // A seeded search over the values a target can choose: totals near
        // the ends of u64, weights from subnormal to f64::MAX, up to 64
        // entries.
        let mut rng = SplitMix64::new(0x33);
        let totals = [
            0,
            1,
            2,
            1 << 53,
            (1 << 53) + 1,
            1 << 63,
            u64::MAX - 1,
            u64::MAX,
        ];
        let weights = [
            0.0,
            f64::MIN_POSITIVE,
            1e-300,
            0.5,
            1.0,
            3.0,
            1e15,
            (1u64 << 63) as f64,
            1.8e19,
            1e300,
            f64::MAX,
            f64::NAN,
            f64::INFINITY,
            -1.0,
        ];
        for _ in 0..20_000 {
            let total = if rng.below(2) == 0 {
                totals[rng.below(totals.len() as u64) as usize]
            } else {
                rng.next_u64() >> rng.below(64)
            };
            let n = 1 + rng.below(64) as usize;
            let w: Vec<f64> = (0..n)
                .map(|_| weights[rng.below(weights.len() as u64) as usize])
                .collect();
            let out = apportion(total, &w);
            assert_eq!(out.len(), n);
            assert_eq!(
                out.iter().map(|&v| u128::from(v)).sum::<u128>(),
                u128::from(total),
                "{total} over {w:?}"
            );
        }
    }

    #[test]
    fn buckets_follow_the_design_bounds() {
        let ms = 1_000_000;
        assert_eq!(contention_bucket(0), 0);
        assert_eq!(contention_bucket(9 * ms + ms / 2), 0);
        assert_eq!(contention_bucket(10 * ms), 1);
        assert_eq!(contention_bucket(49 * ms), 1);
        assert_eq!(contention_bucket(50 * ms), 2);
        assert_eq!(contention_bucket(100 * ms), 3);
        assert_eq!(contention_bucket(499 * ms), 3);
        assert_eq!(contention_bucket(500 * ms), 4);
        assert_eq!(contention_bucket(u64::MAX), 4);
    }

    #[test]
    fn contention_keeps_the_limit_and_exact_totals() {
        let ms = 1_000_000;
        let mut sampler = ContentionSampler::new(50, 60 * SECOND, 7);
        let mut expected_delay = 0u64;
        for i in 0..10_000u64 {
            // Mostly short contentions, a few long ones.
            let d = if i % 1000 == 0 {
                700 * ms
            } else {
                (i % 9) * ms + 1
            };
            expected_delay += d;
            sampler.offer(i * 1000, d, || i);
        }
        let out = sampler.finish();
        assert!(out.len() <= 50, "{} kept", out.len());
        assert_eq!(out.iter().map(|w| w.count).sum::<u64>(), 10_000);
        assert_eq!(out.iter().map(|w| w.delay_ns).sum::<u64>(), expected_delay);
        // The 10 long ones are all kept (their bucket has room): exact.
        let long: Vec<_> = out.iter().filter(|w| w.item % 1000 == 0).collect();
        assert_eq!(long.len(), 10);
        assert!(long.iter().all(|w| w.count == 1 && w.delay_ns == 700 * ms));
    }

    #[test]
    fn contention_windows_close_by_event_time() {
        let mut sampler = ContentionSampler::new(5, SECOND, 1);
        sampler.offer(0, 5, || 'a');
        sampler.offer(SECOND / 2, 5, || 'b');
        assert!(sampler.take_completed().is_empty());
        sampler.offer(SECOND, 5, || 'c');
        let first = sampler.take_completed();
        assert_eq!(first.iter().map(|w| w.count).sum::<u64>(), 2);
        let rest = sampler.finish();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].item, 'c');
    }

    #[test]
    fn controller_converges_toward_the_target() {
        let mut controller = SamplingController::new(25.0, PidGains::default());
        let mut rng = SplitMix64::new(3);
        let mut kept_late = 0u64;
        for tick in 0..200 {
            let seen = 1000u64;
            let p = controller.probability();
            let kept = (0..seen).filter(|_| rng.next_f64() < p).count() as u64;
            if tick >= 100 {
                kept_late += kept;
            }
            controller.update(seen, kept);
        }
        let mean = kept_late as f64 / 100.0;
        assert!((20.0..=30.0).contains(&mean), "mean kept per tick {mean}");
        // A quiet tick lets everything through.
        controller.update(0, 0);
        assert_eq!(controller.probability(), 1.0);
    }

    #[test]
    fn exceptions_are_upscaled_per_type_and_rare_types_survive() {
        let mut sampler = ExceptionSampler::new(500, 10 * SECOND, 11);
        let rates = [("Frequent", 20_000u64), ("Sometimes", 300), ("Once", 1)];
        let total: u64 = rates.iter().map(|r| r.1).sum();
        // Interleave the types evenly over one window.
        let mut events = Vec::new();
        for (name, n) in rates {
            for i in 0..n {
                events.push(((i as u128 * 9 * SECOND as u128 / n as u128) as u64, name));
            }
        }
        events.sort();
        let mut kept = 0;
        for (t, name) in &events {
            if sampler.offer(*t, name, || *name) {
                kept += 1;
            }
        }
        let out = sampler.finish();
        assert_eq!(out.len(), kept);
        assert!(kept <= 500 + rates.len(), "kept {kept}");
        assert!(kept >= 200, "kept only {kept}");
        for (name, n) in rates {
            let count: u64 = out.iter().filter(|w| w.item == name).map(|w| w.count).sum();
            assert_eq!(count, n, "{name}");
        }
        assert_eq!(out.iter().map(|w| w.count).sum::<u64>(), total);
        assert!(out.iter().any(|w| w.item == "Once"));
    }

    /// A storm counted by a session without stacks, while the events with
    /// stacks came only for its first 200: every type's total is exact, the
    /// types seen with a stack keep it, and the one thrown only while the
    /// stacks were off stands as its placeholder.
    #[test]
    fn counted_exceptions_are_exact_per_type_and_shaped_by_the_stacked_events() {
        let mut sampler = ExceptionSampler::new(500, 10 * SECOND, 11);
        let rates = [("Frequent", 20_000u64), ("Sometimes", 500), ("Once", 1)];
        let mut events = Vec::new();
        for (name, n) in rates {
            for i in 0..n {
                // The one `Once` in the middle, the others spread evenly.
                let at = if n == 1 { 4 } else { i * 9 / n };
                events.push(((at * SECOND as u128 as u64) + i, name));
            }
        }
        events.sort();
        for (i, (t, name)) in events.iter().enumerate() {
            sampler.count(*t, name, || ("placeholder", *name));
            if i < 200 {
                sampler.offer_shape(*t, name, || ("stack", *name));
            }
        }
        let out = sampler.finish();
        for (name, n) in rates {
            let count: u64 = out
                .iter()
                .filter(|w| w.item.1 == name)
                .map(|w| w.count)
                .sum();
            assert_eq!(count, n, "{name}");
        }
        assert!(
            out.iter()
                .filter(|w| w.item.1 != "Once")
                .all(|w| w.item.0 == "stack"),
            "the types with a stacked event keep only those"
        );
        let once: Vec<_> = out.iter().filter(|w| w.item.1 == "Once").collect();
        assert_eq!(once.len(), 1);
        assert_eq!(once[0].item.0, "placeholder");
        assert!(out.iter().all(|w| w.count > 0));
    }

    #[test]
    fn a_stacked_event_counted_in_another_window_stands_for_nothing() {
        let mut sampler = ExceptionSampler::new(500, SECOND, 1);
        sampler.count(10, "A", || "counted");
        // Its stacked event arrives after the window closed.
        sampler.offer_shape(2 * SECOND, "A", || "late");
        let out = sampler.finish();
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].item, out[0].count), ("counted", 1));
    }

    #[test]
    fn generated_exception_types_stay_bounded_and_counted() {
        let mut sampler = ExceptionSampler::new(500, SECOND, 9);
        let n = 50_000u64;
        for i in 0..n {
            sampler.offer(i, &format!("Generated{i}"), || ());
        }
        assert!(sampler.types.len() <= MAX_EXCEPTION_TYPES_PER_WINDOW + 1);
        let out = sampler.finish();
        assert_eq!(out.iter().map(|w| w.count).sum::<u64>(), n);
    }

    #[test]
    fn exception_limit_holds_in_a_storm_of_one_type() {
        let mut sampler = ExceptionSampler::new(100, SECOND, 5);
        let mut kept = 0;
        for i in 0..1_000_000u64 {
            if sampler.offer(i * 1000, "Storm", || ()) {
                kept += 1;
            }
        }
        assert!(kept <= 100, "kept {kept}");
        assert!(kept >= 50, "kept {kept}");
        assert_eq!(
            sampler.finish().iter().map(|w| w.count).sum::<u64>(),
            1_000_000
        );
    }

    #[test]
    fn unobserved_exceptions_take_the_shape_of_the_events() {
        let mut sampler = ExceptionSampler::new(100, SECOND, 3);
        // Window 1: events of two types (3:1), then 400 more counted
        // without events: split 300/100.
        for i in 0..300u64 {
            sampler.offer(i, "A", || "A");
        }
        for i in 0..100u64 {
            sampler.offer(300 + i, "B", || "B");
        }
        sampler.add_unobserved(500, 400, || "?");
        // Window 2: no events at all, 1000 counted: the last shape.
        sampler.add_unobserved(SECOND + 10, 1000, || "?");
        sampler.close_due(2 * SECOND + 10);
        let out = sampler.take_completed();
        let sum = |from: &[Weighted<&str>], name: &str| -> u64 {
            from.iter()
                .filter(|w| w.item == name)
                .map(|w| w.count)
                .sum()
        };
        assert_eq!(sum(&out, "A"), 600 + 750);
        assert_eq!(sum(&out, "B"), 200 + 250);
        assert_eq!(sum(&out, "?"), 0);
        assert_eq!(out.iter().map(|w| w.count).sum::<u64>(), 1800);

        // Nothing ever seen: the placeholder stands for them.
        let mut blind = ExceptionSampler::new(100, SECOND, 3);
        blind.add_unobserved(5, 42, || "?");
        assert_eq!(
            blind.finish(),
            vec![Weighted {
                item: "?",
                count: 42,
                delay_ns: 0
            }]
        );
    }

    #[test]
    fn a_window_closes_without_a_later_event() {
        let mut sampler = ExceptionSampler::new(100, SECOND, 3);
        sampler.offer(0, "A", || "A");
        sampler.close_due(SECOND - 1);
        assert!(sampler.take_completed().is_empty());
        sampler.close_due(SECOND);
        assert_eq!(sampler.take_completed().len(), 1);
        assert!(sampler.finish().is_empty());
    }
}
