//! clrbpf's own scheduling priority: a profiler is most needed on a
//! saturated host, where at the default priority it gets too little CPU to
//! load its programs, drain its ring buffers and keep its samples.
//!
//! 1. [`boost_sampling_thread`], called once on the thread that drains the
//!    rings (the recording loop), gives it `SCHED_RR` priority 1: it runs
//!    whenever it is runnable, and it is runnable only a few percent of the
//!    time (it sleeps between ticks), so it cannot starve the host; the
//!    kernel's real-time throttling (`sched_rt_runtime_us`) bounds it anyway.
//!    `SCHED_RESET_ON_FORK` keeps the threads it starts out of the
//!    real-time class.
//! 2. Those background threads (unwind tables, method rundown, EventPipe
//!    readers) do seconds of CPU work at start-up; they call
//!    [`enter_background_thread`] to run at the chosen nice value, ahead of
//!    ordinary work but behind the loop, so their work never delays a
//!    sample (until a process's unwind tables are built, its stacks are
//!    walked by frame pointers).
//!
//! Both need `CAP_SYS_NICE`; without it clrbpf warns and runs as started.

use std::sync::atomic::{AtomicI32, Ordering};

/// The nice value background threads take; 0 leaves them as started.
static BACKGROUND_NICE: AtomicI32 = AtomicI32::new(0);

/// `sched_priority` of the sampling loop: the lowest real-time priority,
/// below every real-time thread of the host.
const SAMPLING_RT_PRIORITY: i32 = 1;

/// Raises the calling thread (the recording loop) to `SCHED_RR` and sets
/// `nice` for the background threads. Returns a warning when the host does
/// not allow it.
pub fn boost_sampling_thread(nice: i32) -> Result<(), String> {
    BACKGROUND_NICE.store(nice, Ordering::Relaxed);
    let mut problems = Vec::new();
    // The nice value first: it is what SCHED_OTHER falls back to if the
    // real-time class is refused.
    if let Err(e) = set_nice(nice) {
        problems.push(format!("nice {nice}: {e}"));
    }
    let param = libc::sched_param {
        sched_priority: SAMPLING_RT_PRIORITY,
    };
    // SAFETY: `param` is a valid sched_param; pid 0 is the calling thread.
    let rc =
        unsafe { libc::sched_setscheduler(0, libc::SCHED_RR | libc::SCHED_RESET_ON_FORK, &param) };
    if rc != 0 {
        problems.push(format!("SCHED_RR: {}", std::io::Error::last_os_error()));
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(format!(
        "could not raise clrbpf's scheduling priority ({}): it may lose samples on a saturated host; it needs CAP_SYS_NICE (or run with --no-priority-boost)",
        problems.join(", ")
    ))
}

/// Called first on every background thread: takes the nice value chosen by
/// [`boost_sampling_thread`] (a thread started by a real-time thread with
/// `SCHED_RESET_ON_FORK` starts at nice 0). Best effort.
pub fn enter_background_thread() {
    let nice = BACKGROUND_NICE.load(Ordering::Relaxed);
    if nice != 0 {
        // Failure was reported by boost_sampling_thread already.
        let _ = set_nice(nice);
    }
}

/// Sets the calling thread's nice value (Linux keeps one per thread).
fn set_nice(nice: i32) -> std::io::Result<()> {
    // SAFETY: setpriority has no memory preconditions; who = 0 with
    // PRIO_PROCESS is the calling thread on Linux.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The calling thread's scheduling policy (without the reset-on-fork flag).
#[cfg(test)]
pub fn current_policy() -> i32 {
    // SAFETY: no preconditions; pid 0 is the calling thread.
    unsafe { libc::sched_getscheduler(0) & !libc::SCHED_RESET_ON_FORK }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs CAP_SYS_NICE: `cargo xtask test` runs it as root.
    #[test]
    #[ignore = "needs root"]
    fn the_loop_is_real_time_and_its_helpers_are_not() {
        let handle = std::thread::spawn(|| {
            boost_sampling_thread(-7).expect("root may raise its priority");
            assert_eq!(current_policy(), libc::SCHED_RR);
            let helper = std::thread::spawn(|| {
                let before = current_policy();
                enter_background_thread();
                // SAFETY: getpriority has no preconditions.
                let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
                (before, nice)
            })
            .join()
            .expect("helper");
            assert_eq!(helper, (libc::SCHED_OTHER, -7));
        });
        handle.join().expect("boosted thread");
        BACKGROUND_NICE.store(0, Ordering::Relaxed);
    }
}
