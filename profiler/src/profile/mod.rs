//! Aggregation of symbolized samples into a [`Profile`]: the shape every
//! writer in [`crate::export`] reads.

mod aggregate;
pub mod alloc_sampling;
pub mod clr_sampling;
pub mod gc;
pub mod kinds;
pub mod layout;
mod model;
pub mod wait_kind;

pub use aggregate::{Aggregator, UNKNOWN_FRAMES_PER_PROCESS};
pub use model::*;

/// Now on CLOCK_MONOTONIC, in nanoseconds: the clock of BPF's
/// `bpf_ktime_get_ns`, of jitdump records and of nettrace timestamps, so
/// every event of a recording is placed on one time line.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// A process start time from `/proc/PID/stat` (clock ticks after boot, on
/// CLOCK_BOOTTIME) on [`monotonic_ns`]'s clock, to the tick (10 ms); 0
/// for a start before CLOCK_MONOTONIC's origin.
pub fn boot_ticks_to_monotonic_ns(ticks: u64) -> u64 {
    // SAFETY: sysconf has no memory preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&hz| hz > 0)
        .unwrap_or(100);
    let boot_ns =
        u64::try_from(u128::from(ticks) * 1_000_000_000 / u128::from(hz)).unwrap_or(u64::MAX);
    let since_boot = clock_ns(libc::CLOCK_BOOTTIME).saturating_sub(monotonic_ns());
    boot_ns.saturating_sub(since_boot)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer; CLOCK_MONOTONIC and CLOCK_BOOTTIME always
    // exist on Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}
