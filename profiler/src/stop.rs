//! The user's stop requests beyond the first. The first Ctrl-C or SIGTERM
//! ends the sampling loop; the end of the recording then waits, briefly
//! and boundedly, for the targets (the last CLR events after StopTracing,
//! a method rundown, the unwind-table thread). A second one means "now":
//! every such wait ends at once and clrbpf writes what it has.
//!
//! The signal handler only sets an atomic flag (async-signal-safe); the
//! waits poll [`hurry`].

use std::sync::atomic::{AtomicBool, Ordering};

static HURRY: AtomicBool = AtomicBool::new(false);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Whether a second stop request came: waits on targets end now.
pub fn hurry() -> bool {
    HURRY.load(Ordering::Relaxed)
}

/// From now on, SIGINT and SIGTERM set [`hurry`] (call when the first one
/// has been taken). Other handlers of those signals (tokio's) still run.
pub fn arm_second_request() -> std::io::Result<()> {
    if INSTALLED.swap(true, Ordering::Relaxed) {
        return Ok(());
    }
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the action only stores to an atomic, which is
        // async-signal-safe, and allocates nothing.
        unsafe { signal_hook_registry::register(signal, || HURRY.store(true, Ordering::Relaxed)) }?;
    }
    Ok(())
}

/// Sleeps in short steps until `until` or until [`hurry`]; returns whether
/// it was cut short.
pub fn wait_until(until: std::time::Instant, mut done: impl FnMut() -> bool) -> bool {
    const STEP: std::time::Duration = std::time::Duration::from_millis(10);
    while !done() {
        if hurry() {
            return true;
        }
        let now = std::time::Instant::now();
        if now >= until {
            return false;
        }
        std::thread::sleep(STEP.min(until - now));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn waits_end_when_done_or_at_the_deadline() {
        let start = Instant::now();
        assert!(!wait_until(start + Duration::from_secs(5), || true));
        assert!(start.elapsed() < Duration::from_secs(1));
        let mut calls = 0;
        assert!(!wait_until(
            Instant::now() + Duration::from_millis(30),
            || {
                calls += 1;
                false
            }
        ));
        assert!(calls >= 2);
    }
}
