//! Allocation samples before aggregation: what each allocation event
//! stands for (the estimator), and a bounded number kept per window whose
//! shares add up to the window's totals (the sampler). Fed by the intake
//! ([`crate::clr::intake`]) with the events of the allocation session
//! ([`crate::clr::alloc_session`]); its output becomes `alloc_samples/count`
//! and `alloc_size/bytes` values in [`crate::pipeline`].
//!
//! The estimator ([`estimate`]), per event (D = 100 KiB):
//!
//! - `GCAllocationTick` charges its `AllocationAmount64` bytes (what was
//!   handed out on its object heap since the previous tick) to the stack
//!   and type of the object that crossed the threshold. Summed, the bytes
//!   are the process's allocated bytes; per site they are unbiased while
//!   objects are much smaller than D.
//! - Objects: with the object's size s (V4, .NET 6+), the tick stands for
//!   `amount / s` objects of that site, at least one: count times size is
//!   then the bytes charged, so the two sample types agree. For s much
//!   smaller than D this is the Poisson weight 1/(1 - e^(-s/D)) ≈ D/s + ½ of
//!   the reference; near and above D it tends to 1 where the Poisson
//!   weight, which assumes a random rather than the runtime's
//!   reset-to-zero threshold, over-counts big objects by up to 1.58x at
//!   s = D (unit test `big_objects_are_not_over_counted`). Without a size
//!   (V3 on .NET Core 3.1 and .NET 5) a tick counts as one sample: the
//!   count is of ticks, not objects.
//! - `AllocationSampled` (.NET 10+, untested here: no such runtime on this
//!   machine) draws bytes uniformly: weight 1/(1 - (1 - 1/D)^s) objects and
//!   s times that in bytes (the runtime design's approach 1).
//!
//! The sampler keeps a uniform reservoir of at most `limit` events per
//! window, adds up every event's estimate (and the bytes the runtime's
//! counter saw while the events were off, with the window's objects per
//! byte), and at the window's end apportions the totals over the kept
//! events in proportion to their own estimates: the totals are exact, the
//! shape is the kept events'. Pure and seeded, so unit-tested.

use super::clr_sampling::{EventWindow, SplitMix64, Weighted, apportion};
use clrbpf_parse::allocations::{Allocation, AllocationSource, TICK_BYTES};

/// Allocation events kept with their stacks per window by default.
pub const DEFAULT_ALLOCATION_LIMIT: usize = 3000;

/// What one allocation event stands for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AllocationEstimate {
    pub bytes: f64,
    pub objects: f64,
}

/// Most bytes one event can stand for, and the largest object: a user
/// address space (2^47 bytes). The amount and the size are the target's to
/// choose; a tick of 2^64 bytes is not a real one.
pub const MAX_EVENT_BYTES: u64 = 1 << 47;

/// The estimate of one event; see the module documentation.
pub fn estimate(allocation: &Allocation) -> AllocationEstimate {
    let size = allocation
        .object_size
        .filter(|&s| s > 0)
        .map(|s| s.min(MAX_EVENT_BYTES));
    match allocation.source {
        AllocationSource::Tick { amount } => {
            let bytes = amount.min(MAX_EVENT_BYTES) as f64;
            let objects = size.map_or(1.0, |s| (bytes / s as f64).max(1.0));
            AllocationEstimate { bytes, objects }
        }
        AllocationSource::Sampled { .. } => {
            let s = size.unwrap_or(1) as f64;
            let q = 1.0 - 1.0 / TICK_BYTES as f64;
            // 1 - q^s without cancellation for small s.
            let p = -(s * q.ln()).exp_m1();
            let objects = if p > 0.0 { 1.0 / p } else { 1.0 };
            AllocationEstimate {
                bytes: objects * s,
                objects,
            }
        }
    }
}

#[derive(Clone, Debug)]
struct Kept<T> {
    item: T,
    estimate: AllocationEstimate,
}

/// Allocation sampler; see the module documentation.
#[derive(Clone, Debug)]
pub struct AllocationSampler<T> {
    limit: usize,
    window: EventWindow,
    seen: u64,
    bytes: f64,
    objects: f64,
    /// Bytes the counter saw without events, in this window (negative:
    /// the events counted more than it saw).
    unobserved_bytes: i64,
    kept: Vec<Kept<T>>,
    /// The kept events of the last window that had some: the shape of a
    /// later window's bytes that came without events.
    last_shape: Vec<Kept<T>>,
    completed: Vec<Weighted<T>>,
    rng: SplitMix64,
}

impl<T: Clone> AllocationSampler<T> {
    pub fn new(limit_per_window: usize, window_ns: u64, seed: u64) -> Self {
        Self {
            limit: limit_per_window.max(1),
            window: EventWindow::new(window_ns),
            seen: 0,
            bytes: 0.0,
            objects: 0.0,
            unobserved_bytes: 0,
            kept: Vec::new(),
            last_shape: Vec::new(),
            completed: Vec::new(),
            rng: SplitMix64::new(seed),
        }
    }

    /// Counts an allocation event at `time_ns`; keeps it (built with
    /// `make`) in the window's reservoir or not. Returns the estimate.
    pub fn offer(
        &mut self,
        time_ns: u64,
        allocation: &Allocation,
        make: impl FnOnce() -> T,
    ) -> AllocationEstimate {
        self.advance(time_ns);
        let estimate = estimate(allocation);
        self.seen += 1;
        self.bytes += estimate.bytes;
        self.objects += estimate.objects;
        if self.kept.len() < self.limit {
            self.kept.push(Kept {
                item: make(),
                estimate,
            });
        } else {
            // Reservoir sampling: the n-th event replaces a kept one with
            // probability limit / n.
            let slot = self.rng.below(self.seen);
            if let Some(kept) = self.kept.get_mut(slot as usize) {
                *kept = Kept {
                    item: make(),
                    estimate,
                };
            }
        }
        estimate
    }

    /// Adds `bytes` the runtime's counter saw allocated by `time_ns` while
    /// no event stood for them.
    /// Negative `bytes` take away from the window's (down to none).
    pub fn add_unobserved(&mut self, time_ns: u64, bytes: i64) {
        if bytes == 0 {
            return;
        }
        self.advance(time_ns);
        self.unobserved_bytes = self.unobserved_bytes.saturating_add(bytes);
    }

    /// Closes the current window if it ended before `now_ns`.
    pub fn close_due(&mut self, now_ns: u64) {
        if self.window.due(now_ns) {
            self.close_window();
        }
    }

    fn advance(&mut self, time_ns: u64) {
        if self.window.advance(time_ns) {
            self.close_window();
        }
    }

    fn close_window(&mut self) {
        let kept = std::mem::take(&mut self.kept);
        let (bytes, objects) = (self.bytes, self.objects);
        let unobserved = std::mem::take(&mut self.unobserved_bytes);
        (self.seen, self.bytes, self.objects) = (0, 0.0, 0.0);
        let shape = if kept.is_empty() {
            self.last_shape.clone()
        } else {
            kept
        };
        if shape.is_empty() {
            // Bytes without a single event ever: nothing to give them a
            // stack; the caller's counters still hold them.
            return;
        }
        let (bytes, objects) = if bytes > 0.0 {
            let total = (bytes + unobserved as f64).max(0.0);
            (total, objects * total / bytes)
        } else {
            // A window of unobserved bytes only: the last shape's objects
            // per byte.
            let (b, o) = shape.iter().fold((0.0, 0.0), |(b, o), k| {
                (b + k.estimate.bytes, o + k.estimate.objects)
            });
            let total = unobserved.max(0) as f64;
            (total, if b > 0.0 { o * total / b } else { 0.0 })
        };
        let byte_weights: Vec<f64> = shape.iter().map(|k| k.estimate.bytes).collect();
        let object_weights: Vec<f64> = shape.iter().map(|k| k.estimate.objects).collect();
        let byte_shares = apportion(bytes.round() as u64, &byte_weights);
        let object_shares = apportion(objects.round() as u64, &object_weights);
        for ((kept, bytes), objects) in shape.iter().zip(byte_shares).zip(object_shares) {
            if bytes == 0 && objects == 0 {
                continue;
            }
            self.completed.push(Weighted {
                item: kept.item.clone(),
                count: objects,
                // The bytes it stands for (see [`Weighted::delay_ns`]).
                delay_ns: bytes,
            });
        }
        self.last_shape = shape;
    }

    /// Weighted samples of the windows closed so far.
    pub fn take_completed(&mut self) -> Vec<Weighted<T>> {
        std::mem::take(&mut self.completed)
    }

    /// Closes the current window: every kept sample not taken yet.
    pub fn finish(&mut self) -> Vec<Weighted<T>> {
        if self.window.finish() {
            self.close_window();
        }
        self.take_completed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clrbpf_parse::allocations::AllocationHeap;

    const SECOND: u64 = 1_000_000_000;

    fn tick(amount: u64, size: Option<u64>, name: &str) -> Allocation {
        Allocation {
            source: AllocationSource::Tick { amount },
            heap: AllocationHeap::Small,
            type_name: name.to_owned(),
            type_id: 0,
            object_size: size,
        }
    }

    /// The runtime's tick, simulated: a per-heap counter of bytes that
    /// fires when it passes D with the object that crossed it, then resets
    /// to 0 (§1.4 of the reference). Objects go to the counter whole (as
    /// LOH objects do, and SOH ones through contexts of about their size).
    fn simulate(objects: &[(u64, &'static str, u64)]) -> Vec<Allocation> {
        let mut counter = 0u64;
        let mut out = Vec::new();
        let mut rng = SplitMix64::new(1);
        let mut left: Vec<u64> = objects.iter().map(|o| o.2).collect();
        while left.iter().any(|&n| n > 0) {
            let i = rng.below(objects.len() as u64) as usize;
            if left[i] == 0 {
                continue;
            }
            left[i] -= 1;
            let (size, name, _) = objects[i];
            counter += size;
            if counter > TICK_BYTES {
                out.push(tick(counter, Some(size), name));
                counter = 0;
            }
        }
        out
    }

    fn totals_by_type(out: &[Weighted<String>]) -> std::collections::HashMap<String, (u64, u64)> {
        let mut by = std::collections::HashMap::new();
        for w in out {
            let e = by.entry(w.item.clone()).or_insert((0, 0));
            e.0 += w.count;
            e.1 += w.delay_ns;
        }
        by
    }

    #[test]
    fn counts_and_bytes_per_type_match_a_simulated_runtime() {
        // 2000-byte arrays and 32-byte objects, equal bytes.
        let events = simulate(&[(2_000, "byte[]", 100_000), (32, "Small", 6_250_000)]);
        let mut sampler = AllocationSampler::new(1_000_000, 60 * SECOND, 3);
        for (i, e) in events.iter().enumerate() {
            sampler.offer(i as u64, e, || e.type_name.clone());
        }
        let by = totals_by_type(&sampler.finish());
        let (arrays, small) = (by["byte[]"], by["Small"]);
        let total = 2.0 * 200_000_000.0;
        let share = arrays.1 as f64 / (arrays.1 + small.1) as f64;
        assert!((share - 0.5).abs() < 0.03, "byte share {share}");
        assert!(((arrays.1 + small.1) as f64 - total).abs() / total < 0.01);
        let rel = |got: u64, want: f64| (got as f64 - want).abs() / want;
        assert!(rel(arrays.0, 100_000.0) < 0.05, "arrays {}", arrays.0);
        assert!(rel(small.0, 6_250_000.0) < 0.05, "small {}", small.0);
    }

    #[test]
    fn hostile_amounts_are_bounded_and_the_totals_stay_exact() {
        let huge = tick(u64::MAX, Some(u64::MAX), "Huge");
        let e = estimate(&huge);
        assert_eq!(e.bytes, MAX_EVENT_BYTES as f64);
        assert!(e.objects >= 1.0 && e.objects.is_finite());
        let mut sampler = AllocationSampler::new(2, SECOND, 1);
        for i in 0..1000u64 {
            sampler.offer(i, &huge, || i);
        }
        sampler.add_unobserved(2000, i64::MAX);
        sampler.add_unobserved(2001, i64::MAX);
        let out = sampler.finish();
        let bytes: u128 = out.iter().map(|w| u128::from(w.delay_ns)).sum();
        let want = (1000.0 * MAX_EVENT_BYTES as f64 + i64::MAX as f64) as u64;
        assert_eq!(
            bytes,
            u128::from(want),
            "saturated at the end, exact over the kept"
        );
    }

    #[test]
    fn big_objects_are_not_over_counted() {
        // Objects of D and of 3 D: each one its own tick.
        for size in [TICK_BYTES + 1, 3 * TICK_BYTES] {
            let events = simulate(&[(size, "big", 1_000)]);
            let mut sampler = AllocationSampler::new(10_000, 60 * SECOND, 3);
            for e in &events {
                sampler.offer(0, e, || e.type_name.clone());
            }
            let by = totals_by_type(&sampler.finish());
            assert_eq!(by["big"], (1_000, 1_000 * size), "size {size}");
            // The Poisson weight would say 1.58 objects per tick at s = D.
            let poisson = 1.0 / (1.0 - (-(size as f64) / TICK_BYTES as f64).exp());
            assert!(size > 2 * TICK_BYTES || poisson > 1.5);
        }
    }

    #[test]
    fn net_core_3_ticks_count_as_one_sample_each_with_their_bytes() {
        let e = estimate(&tick(150_000, None, "X"));
        assert_eq!((e.bytes, e.objects), (150_000.0, 1.0));
        let e = estimate(&tick(102_500, Some(0), "X"));
        assert_eq!(e.objects, 1.0, "a zero size is no size");
    }

    #[test]
    fn net_10_samples_are_weighted_by_their_inclusion_probability() {
        let sampled = |size| Allocation {
            source: AllocationSource::Sampled { offset: 0 },
            heap: AllocationHeap::Small,
            type_name: String::new(),
            type_id: 0,
            object_size: Some(size),
        };
        let small = estimate(&sampled(24));
        // ≈ D/s + ½ (minus 1/(2s) from q = 1 - 1/D being discrete).
        assert!((small.objects - (TICK_BYTES as f64 / 24.0 + 0.5)).abs() < 0.05);
        let big = estimate(&sampled(10 * TICK_BYTES));
        assert!((big.objects - 1.0).abs() < 1e-4);
        assert!((big.bytes - 10.0 * TICK_BYTES as f64).abs() < 100.0);
    }

    #[test]
    fn the_reservoir_is_bounded_and_the_totals_stay_exact() {
        let mut sampler = AllocationSampler::new(100, SECOND, 9);
        let mut bytes = 0;
        for i in 0..10_000u64 {
            let amount = 100_000 + i;
            bytes += amount;
            let e = tick(amount, Some(1_000), if i % 4 == 0 { "a" } else { "b" });
            sampler.offer(i * 1_000, &e, || e.type_name.clone());
        }
        let out = sampler.finish();
        assert!(out.len() <= 100);
        assert_eq!(out.iter().map(|w| w.delay_ns).sum::<u64>(), bytes);
        let by = totals_by_type(&out);
        let share = by["a"].1 as f64 / bytes as f64;
        assert!((share - 0.25).abs() < 0.1, "share of a {share}");
    }

    #[test]
    fn counter_bytes_without_events_take_the_shape_of_the_events() {
        let mut sampler = AllocationSampler::new(100, SECOND, 9);
        for i in 0..10u64 {
            let e = tick(100_000, Some(1_000), if i < 5 { "a" } else { "b" });
            sampler.offer(i, &e, || e.type_name.clone());
        }
        sampler.add_unobserved(20, 1_000_000);
        let by = totals_by_type(&sampler.take_completed());
        assert!(by.is_empty(), "window still open");
        // The next window has only counter bytes: the last shape.
        sampler.add_unobserved(2 * SECOND, 4_000_000);
        let out = sampler.finish();
        let first: u64 = out.iter().take(10).map(|w| w.delay_ns).sum();
        assert_eq!(first, 2_000_000, "events + counter bytes");
        let by = totals_by_type(&out);
        assert_eq!(by["a"].1 + by["b"].1, 6_000_000);
        assert_eq!(by["a"].1, 3_000_000);
        assert_eq!(by["a"].0 + by["b"].0, 6_000, "1000 bytes per object");
        // Nothing ever seen: nothing to give bytes a stack.
        let mut empty = AllocationSampler::<String>::new(10, SECOND, 1);
        empty.add_unobserved(0, 5);
        assert!(empty.finish().is_empty());
    }
}
