//! Aggregation of symbolized samples into a [`Profile`]: the shape every
//! writer in [`crate::export`] reads.

mod aggregate;
pub mod alloc_sampling;
pub mod clr_sampling;
pub mod gc;
pub mod layout;
mod model;
pub mod wait_kind;

pub use aggregate::Aggregator;
pub use model::*;

/// Now on CLOCK_MONOTONIC, in nanoseconds: the clock of BPF's
/// `bpf_ktime_get_ns`, of jitdump records and of nettrace timestamps, so
/// every event of a recording is placed on one time line.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}
