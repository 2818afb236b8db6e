//! clrbpf's own scheduling priority: a profiler is most needed on a
//! saturated host, where at the default priority it gets too little CPU to
//! load its programs, drain its ring buffers and keep its samples; and an
//! always-on agent must not take the host's CPU for work that can wait.
//!
//! 1. [`boost_sampling_thread`], called once on the thread that drains the
//!    rings (the recording loop), gives it `SCHED_RR` priority 1: it runs
//!    whenever it is runnable, and it is runnable only a few percent of the
//!    time (it sleeps between ticks), so it cannot starve the host; the
//!    kernel's real-time throttling (`sched_rt_runtime_us`) bounds it anyway.
//!    `SCHED_RESET_ON_FORK` keeps the threads it starts out of the
//!    real-time class.
//! 2. Those background threads call [`enter_background_thread`] first,
//!    saying what they do ([`BackgroundWork`]):
//!    - a thread that keeps pace with a stream (the EventPipe reader, whose
//!      runtime drops events when it falls behind) runs at the chosen nice
//!      value, ahead of ordinary work but behind the loop;
//!    - catch-up work (unwind tables, runtime attaches, method rundowns:
//!      seconds of CPU at a start, then a little per new process) runs at
//!      the same nice value in `record`, which wants it done at once, and
//!      `SCHED_IDLE` in the agent ([`BackgroundPriority::catch_up_idle`]):
//!      it takes the CPU the host's own work leaves, so an agent's start
//!      costs a busy service nothing. Until a process's tables are built,
//!      its stacks are walked by frame pointers (or copied and unwound
//!      later); in a cgroup of its own (a Kubernetes pod) the agent still
//!      gets its cgroup's share, which `SCHED_IDLE` only orders within.
//! 3. At the end, [`hurry_catch_up`] lifts the catch-up threads to the
//!    chosen nice value: the detaches that restore the .NET processes and
//!    the last tables must not wait for an idle CPU.
//!
//! All of it needs `CAP_SYS_NICE`; without it clrbpf warns and runs as
//! started.

use std::sync::{
    Mutex,
    atomic::{AtomicBool, AtomicI32, Ordering},
};

/// The nice value background threads take; 0 leaves them as started.
static BACKGROUND_NICE: AtomicI32 = AtomicI32::new(0);
/// Whether catch-up threads run `SCHED_IDLE` (until [`hurry_catch_up`]).
static CATCH_UP_IDLE: AtomicBool = AtomicBool::new(false);
/// Set by [`hurry_catch_up`]: catch-up threads started later take the nice
/// value at once.
static HURRIED: AtomicBool = AtomicBool::new(false);
/// The catch-up threads running `SCHED_IDLE` now (kernel thread ids). A
/// thread leaves the list before it exits ([`BackgroundThread`]'s drop),
/// so [`hurry_catch_up`], which holds the lock, never touches a thread id
/// the kernel may have given to someone else.
static IDLE_THREADS: Mutex<Vec<libc::pid_t>> = Mutex::new(Vec::new());

/// `sched_priority` of the sampling loop: the lowest real-time priority,
/// below every real-time thread of the host.
const SAMPLING_RT_PRIORITY: i32 = 1;

/// How clrbpf's threads other than the loop run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackgroundPriority {
    /// Nice value of the background threads (catch-up work too, unless
    /// `catch_up_idle`).
    pub nice: i32,
    /// Catch-up work runs `SCHED_IDLE` (the agent).
    pub catch_up_idle: bool,
}

/// What a background thread does, which decides how it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackgroundWork {
    /// Keeps pace with a stream that loses data when it falls behind.
    Stream,
    /// Work that may wait for an idle CPU: unwind tables, attaches,
    /// rundowns.
    CatchUp,
}

/// The scheduling a background thread takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ThreadPolicy {
    /// As started.
    Unchanged,
    /// `SCHED_OTHER` at this nice value.
    Nice(i32),
    /// `SCHED_IDLE`.
    Idle,
}

/// How a thread doing `work` runs, given the chosen nice value, whether
/// catch-up work idles, and whether the end has hurried it.
fn policy_for(work: BackgroundWork, nice: i32, catch_up_idle: bool, hurried: bool) -> ThreadPolicy {
    match work {
        BackgroundWork::CatchUp if catch_up_idle && !hurried => ThreadPolicy::Idle,
        _ if nice == 0 => ThreadPolicy::Unchanged,
        _ => ThreadPolicy::Nice(nice),
    }
}

/// Raises the calling thread (the recording loop) to `SCHED_RR` and sets
/// how the background threads run. Returns a warning when the host does
/// not allow it.
pub fn boost_sampling_thread(background: BackgroundPriority) -> Result<(), String> {
    let BackgroundPriority {
        nice,
        catch_up_idle,
    } = background;
    BACKGROUND_NICE.store(nice, Ordering::Relaxed);
    CATCH_UP_IDLE.store(catch_up_idle, Ordering::Relaxed);
    let mut problems = Vec::new();
    // The nice value first: it is what SCHED_OTHER falls back to if the
    // real-time class is refused.
    if let Err(e) = set_nice(0, nice) {
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

/// Held by a background thread for its life: a `SCHED_IDLE` catch-up
/// thread leaves [`IDLE_THREADS`] when it is dropped.
#[must_use = "a catch-up thread stays listed only while this lives"]
pub struct BackgroundThread {
    idle_tid: Option<libc::pid_t>,
}

impl Drop for BackgroundThread {
    fn drop(&mut self) {
        if let Some(tid) = self.idle_tid {
            lock_idle_threads().retain(|&t| t != tid);
        }
    }
}

/// Called first on every background thread: takes the scheduling chosen
/// by [`boost_sampling_thread`] for `work` (a thread started by a
/// real-time thread with `SCHED_RESET_ON_FORK` starts at nice 0). Best
/// effort: a failure was reported by [`boost_sampling_thread`] already.
pub fn enter_background_thread(work: BackgroundWork) -> BackgroundThread {
    let nice = BACKGROUND_NICE.load(Ordering::Relaxed);
    let catch_up_idle = CATCH_UP_IDLE.load(Ordering::Relaxed);
    // The list's lock orders this against hurry_catch_up: a thread either
    // is listed before the hurry, or sees HURRIED set.
    let mut idle_threads = lock_idle_threads();
    match policy_for(work, nice, catch_up_idle, HURRIED.load(Ordering::Relaxed)) {
        ThreadPolicy::Idle => {
            if set_idle(0).is_ok() {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() };
                idle_threads.push(tid);
                return BackgroundThread {
                    idle_tid: Some(tid),
                };
            }
        }
        ThreadPolicy::Nice(nice) => {
            let _ = set_nice(0, nice);
        }
        ThreadPolicy::Unchanged => {}
    }
    BackgroundThread { idle_tid: None }
}

/// Lifts every `SCHED_IDLE` catch-up thread, and those started from now
/// on, to the background nice value: the end of a run must not wait for
/// an idle CPU. Best effort.
pub fn hurry_catch_up() {
    let mut idle_threads = lock_idle_threads();
    HURRIED.store(true, Ordering::Relaxed);
    let nice = BACKGROUND_NICE.load(Ordering::Relaxed);
    for tid in idle_threads.drain(..) {
        if let Err(error) = set_other(tid) {
            tracing::debug!(tid, %error, "could not lift a catch-up thread out of SCHED_IDLE");
            continue;
        }
        let _ = set_nice(tid, nice);
    }
}

fn lock_idle_threads() -> std::sync::MutexGuard<'static, Vec<libc::pid_t>> {
    // A thread that panicked while holding it left a valid list.
    IDLE_THREADS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Puts thread `tid` (0: the calling thread) in `SCHED_IDLE`.
#[doc(alias = "SCHED_IDLE")]
fn set_idle(tid: libc::pid_t) -> std::io::Result<()> {
    set_scheduler(tid, libc::SCHED_IDLE)
}

/// Puts thread `tid` back in `SCHED_OTHER`.
fn set_other(tid: libc::pid_t) -> std::io::Result<()> {
    set_scheduler(tid, libc::SCHED_OTHER)
}

fn set_scheduler(tid: libc::pid_t, policy: libc::c_int) -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param; `tid` is 0 or a thread of
    // this process that is still listed (so still alive).
    let rc = unsafe { libc::sched_setscheduler(tid, policy, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Sets the nice value of thread `tid` (0: the calling thread; Linux
/// keeps one per thread).
fn set_nice(tid: libc::pid_t, nice: i32) -> std::io::Result<()> {
    let who = libc::id_t::try_from(tid).unwrap_or(0);
    // SAFETY: setpriority has no memory preconditions; with PRIO_PROCESS,
    // `who` is a thread id on Linux (0: the calling thread).
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, who, nice) };
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

/// The nice value of thread `tid` (0: the calling thread).
#[cfg(test)]
fn nice_of(tid: libc::pid_t) -> i32 {
    let who = libc::id_t::try_from(tid).unwrap_or(0);
    // SAFETY: getpriority has no preconditions.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, who) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catch_up_work_idles_only_in_the_agent_and_until_the_end() {
        use BackgroundWork::{CatchUp, Stream};
        // record: everything at the chosen nice value.
        assert_eq!(
            policy_for(CatchUp, -10, false, false),
            ThreadPolicy::Nice(-10)
        );
        assert_eq!(
            policy_for(Stream, -10, false, false),
            ThreadPolicy::Nice(-10)
        );
        // The agent: catch-up work idles, streams keep pace.
        assert_eq!(policy_for(CatchUp, -5, true, false), ThreadPolicy::Idle);
        assert_eq!(policy_for(Stream, -5, true, false), ThreadPolicy::Nice(-5));
        // After the end's hurry, catch-up work takes the nice value too.
        assert_eq!(policy_for(CatchUp, -5, true, true), ThreadPolicy::Nice(-5));
        // --no-priority-boost (nice 0, no idling) leaves threads alone.
        assert_eq!(
            policy_for(CatchUp, 0, false, false),
            ThreadPolicy::Unchanged
        );
        assert_eq!(policy_for(Stream, 0, true, false), ThreadPolicy::Unchanged);
    }

    /// Needs CAP_SYS_NICE: `cargo xtask test` runs it as root. One test
    /// for the whole sequence: the settings are the process's.
    #[test]
    #[ignore = "needs root"]
    fn the_loop_is_real_time_its_catch_up_threads_idle_until_hurried() {
        let handle = std::thread::spawn(|| {
            boost_sampling_thread(BackgroundPriority {
                nice: -7,
                catch_up_idle: true,
            })
            .expect("root may raise its priority");
            assert_eq!(current_policy(), libc::SCHED_RR);
            let stream = std::thread::spawn(|| {
                let before = current_policy();
                let _thread = enter_background_thread(BackgroundWork::Stream);
                (before, current_policy(), nice_of(0))
            })
            .join()
            .expect("stream thread");
            assert_eq!(stream, (libc::SCHED_OTHER, libc::SCHED_OTHER, -7));
            // A catch-up thread that ends leaves the idle list.
            let short = std::thread::spawn(|| {
                let _thread = enter_background_thread(BackgroundWork::CatchUp);
                current_policy()
            })
            .join()
            .expect("short catch-up thread");
            assert_eq!(short, libc::SCHED_IDLE);
            assert!(lock_idle_threads().is_empty());
            // A catch-up thread idles until the hurry, then runs at the
            // nice value; one started after the hurry starts there.
            let (entered, go) = std::sync::mpsc::channel();
            let (hurried, done) = std::sync::mpsc::channel::<()>();
            let catch_up = std::thread::spawn(move || {
                let _thread = enter_background_thread(BackgroundWork::CatchUp);
                entered.send(current_policy()).expect("main side");
                done.recv().expect("main side");
                (current_policy(), nice_of(0))
            });
            assert_eq!(go.recv().expect("catch-up thread"), libc::SCHED_IDLE);
            assert_eq!(lock_idle_threads().len(), 1);
            hurry_catch_up();
            hurried.send(()).expect("catch-up thread");
            assert_eq!(
                catch_up.join().expect("catch-up thread"),
                (libc::SCHED_OTHER, -7)
            );
            let late = std::thread::spawn(|| {
                let _thread = enter_background_thread(BackgroundWork::CatchUp);
                (current_policy(), nice_of(0))
            })
            .join()
            .expect("late catch-up thread");
            assert_eq!(late, (libc::SCHED_OTHER, -7));
            assert!(lock_idle_threads().is_empty());
        });
        handle.join().expect("boosted thread");
        BACKGROUND_NICE.store(0, Ordering::Relaxed);
        CATCH_UP_IDLE.store(false, Ordering::Relaxed);
        HURRIED.store(false, Ordering::Relaxed);
    }
}
