//! Off-CPU rules shared by the kernel side (the `sched_switch` program) and
//! userspace: which intervals are kept and with what weight, and the exact
//! per-thread totals the kernel keeps for every interval, kept or not.
//!
//! The keep rule makes the profile's total an unbiased estimate of the
//! true off-CPU time while bounding the records written: an interval at
//! least `min_ns` long is kept with its own length; a shorter one is kept
//! with probability `interval / min_ns` and then weighs `min_ns` (1/p
//! upscaling), so its expected contribution is its own length. A thread can
//! then produce at most about one record per `min_ns` of off-CPU time,
//! whatever its switch rate: the rate limit that keeps a host doing
//! hundreds of thousands of short sleeps per second cheap.

/// Bits of [`crate::RawSampleEvent::wake_flags`].
pub mod wake_flags {
    /// A `sched_waking` for the blocked thread was seen and the current
    /// thread and stacks recorded (in an interrupt, the interrupted thread:
    /// userspace tells from the kernel stack).
    pub const RECORDED: u32 = 1 << 0;
    /// `keep_draw` holds the keep decision's random draw, made at the first
    /// wakeup: an interval already kept at that point is kept at switch-in
    /// too (the rule only keeps more as the interval grows), so the waker's
    /// stacks are taken only for the wakeups of intervals that will be kept.
    pub const DRAWN: u32 = 1 << 1;
}

/// Longest `min_ns` [`keep_interval`] takes (about 4.29 s): shorter
/// intervals are shifted left 32 bits in a `u64`.
pub const MAX_MIN_NS: u64 = u32::MAX as u64;

/// Whether to keep an off-CPU interval of `interval_ns`, and the weight
/// (nanoseconds) it is recorded with. `random` is a uniform 32-bit value
/// (`bpf_get_prandom_u32`). `min_ns` of 0 keeps everything; values above
/// [`MAX_MIN_NS`] are treated as [`MAX_MIN_NS`].
#[inline(always)]
pub fn keep_interval(interval_ns: u64, min_ns: u64, random: u32) -> Option<u64> {
    let min_ns = if min_ns > MAX_MIN_NS {
        MAX_MIN_NS
    } else {
        min_ns
    };
    if interval_ns >= min_ns {
        return Some(interval_ns);
    }
    // interval_ns < min_ns <= 2^32 - 1, so the shift cannot overflow.
    let threshold = (interval_ns << 32) / min_ns;
    if u64::from(random) < threshold {
        Some(min_ns)
    } else {
        None
    }
}

/// Length of the stack rate limit's window: the probability of taking a
/// stack in one window follows from the blocking switches of the last.
pub const STACK_RATE_WINDOW_NS: u64 = 100_000_000;

/// `stack_p` of "always".
pub const STACK_P_ALWAYS: u32 = u32::MAX;

/// The stack-taking probability (of [`STACK_P_ALWAYS`]) for a window
/// after one with `seen` blocking switches on this CPU, to take about
/// `limit` stacks per window.
#[inline(always)]
pub fn stack_probability(seen: u64, limit: u64) -> u32 {
    if seen <= limit {
        return STACK_P_ALWAYS;
    }
    // limit < seen, so the quotient is below 2^32; at least 1 so a stack is
    // still possible.
    let p = (limit << 32) / seen;
    if p == 0 { 1 } else { p as u32 }
}

/// Whether to take the stack with probability `p` given a uniform draw.
#[inline(always)]
pub fn take_stack(p: u32, random: u32) -> bool {
    p == STACK_P_ALWAYS || random < p
}

/// An off-CPU value upscaled by 1/p for a stack taken with probability `p`.
pub fn upscale_by_stack_p(value: u64, p: u32) -> u64 {
    if p == STACK_P_ALWAYS || p == 0 {
        return value;
    }
    // `+ 0.5` and truncation: rounding without `std`.
    (value as f64 * (f64::from(STACK_P_ALWAYS) / f64::from(p)) + 0.5) as u64
}

/// Per-CPU state of the stack rate limit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct StackRate {
    pub window_start_ns: u64,
    /// Blocking switches seen in this window.
    pub seen: u64,
    /// The probability in force this window.
    pub p: u32,
    pub _pad: u32,
}

/// Exact off-CPU totals of one thread, kept by the kernel side for every
/// interval it measured, in the `OFF_CPU_TOTALS` map. What the profile
/// holds (upscaled) is userspace's to count.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuThreadTotals {
    /// Sum of every measured interval.
    pub blocked_ns: u64,
    /// Intervals measured.
    pub intervals: u64,
    /// Kept intervals lost because the ring buffer was full.
    pub lost: u64,
    /// The thread's process.
    pub pid: u32,
    pub _pad: u32,
}

const _: () = assert!(size_of::<OffCpuThreadTotals>() == 32);

impl OffCpuThreadTotals {
    /// Adds `other`'s counts (the same tid at another time: an exited
    /// thread's handed-over totals and what the map holds now, or a reused
    /// tid); the process is `other`'s.
    pub fn add(&mut self, other: &Self) {
        self.pid = other.pid;
        self.blocked_ns += other.blocked_ns;
        self.intervals += other.intervals;
        self.lost += other.lost;
    }
}

#[cfg(feature = "user")]
// SAFETY: `#[repr(C)]`, only integers, explicit padding.
unsafe impl aya::Pod for OffCpuThreadTotals {}

/// A thread's [`OffCpuThreadTotals`] handed to userspace through the
/// `SAMPLES` ring buffer when the thread exits, after which its entry
/// leaves `OFF_CPU_TOTALS`: a host that starts threads for weeks would fill
/// the map otherwise. Told apart from the other ring records by its size.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExitedThreadTotals {
    pub totals: OffCpuThreadTotals,
    pub tid: u32,
    pub _pad: u32,
}

const _: () = assert!(size_of::<ExitedThreadTotals>() == 40);
const _: () = assert!(size_of::<ExitedThreadTotals>() != size_of::<crate::ProcessEventRecord>());
const _: () = assert!(size_of::<ExitedThreadTotals>() != size_of::<crate::RawSampleEvent>());

#[cfg(feature = "user")]
// SAFETY: `#[repr(C)]`, only integers, explicit padding.
unsafe impl aya::Pod for ExitedThreadTotals {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stand-in for `bpf_get_prandom_u32`: every 32-bit
    /// value visited evenly.
    fn uniform(n: u64) -> impl Iterator<Item = u32> {
        (0..n).map(move |i| ((i << 32) / n) as u32)
    }

    #[test]
    fn long_intervals_are_kept_with_their_length() {
        assert_eq!(keep_interval(5_000_000, 1_000_000, 0), Some(5_000_000));
        assert_eq!(
            keep_interval(1_000_000, 1_000_000, u32::MAX),
            Some(1_000_000)
        );
        assert_eq!(keep_interval(7, 0, u32::MAX), Some(7));
    }

    #[test]
    fn short_intervals_are_upscaled_without_bias() {
        let min = 1_000_000;
        for interval in [1, 999, 250_000, 333_333, 999_999] {
            let draws = 100_000u64;
            let total: u64 = uniform(draws)
                .filter_map(|r| keep_interval(interval, min, r))
                .sum();
            let kept = uniform(draws)
                .filter(|&r| keep_interval(interval, min, r).is_some())
                .count() as u64;
            // Every kept draw weighs `min`; on average they add up to the
            // true total within one draw's weight.
            assert!(
                total.abs_diff(interval * draws) <= min,
                "interval {interval}: {total} vs {}",
                interval * draws
            );
            assert!(kept <= draws * interval / min + 1);
        }
    }

    #[test]
    fn the_stack_rate_limit_is_unbiased() {
        assert_eq!(stack_probability(10, 500), STACK_P_ALWAYS);
        assert_eq!(stack_probability(500, 500), STACK_P_ALWAYS);
        let p = stack_probability(10_000, 500);
        assert!((f64::from(p) / f64::from(u32::MAX) - 0.05).abs() < 1e-6);
        assert!(stack_probability(u64::MAX >> 33, 0) >= 1);
        let draws = 100_000u64;
        let taken = uniform(draws).filter(|&r| take_stack(p, r)).count() as u64;
        // Each taken interval of 1 ms, upscaled, adds up to all of them.
        let total: u64 = (0..taken).map(|_| upscale_by_stack_p(1_000_000, p)).sum();
        assert!(total.abs_diff(draws * 1_000_000) <= 2 * 1_000_000 * 20);
        assert!(take_stack(STACK_P_ALWAYS, u32::MAX));
        assert_eq!(upscale_by_stack_p(7, STACK_P_ALWAYS), 7);
    }

    #[test]
    fn zero_length_intervals_are_never_kept_below_the_threshold() {
        assert_eq!(keep_interval(0, 1_000_000, 0), None);
    }

    #[test]
    fn a_huge_threshold_is_clamped_not_overflowed() {
        let interval = MAX_MIN_NS - 1;
        assert_eq!(keep_interval(interval, u64::MAX, 0), Some(MAX_MIN_NS));
        assert_eq!(keep_interval(MAX_MIN_NS, u64::MAX, 0), Some(MAX_MIN_NS));
        assert_eq!(keep_interval(interval, u64::MAX, u32::MAX), None);
    }
}
