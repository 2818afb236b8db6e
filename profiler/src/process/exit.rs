//! The end of clrbpf's own run: its threads must be able to exit. The
//! process is gone (and `record` gives the shell back) only once every
//! thread has run its own exit, and on a saturated host a background
//! thread waits for the CPU to do so like for any other work: at nice -10
//! among 400 busy loops, 45 EventPipe and attach threads held a `record`
//! 4.9 s after its profile was written; one unwind thread at `--nice 19`,
//! about a minute.
//!
//! [`hurry_threads_to_exit`], called once the output is written, gives
//! every other thread the calling thread's real-time class (the recording
//! loop's, [`super::priority::boost_sampling_thread`]), so that each runs
//! its exit as soon as the process ends. The work a thread may still be
//! doing runs that way only for the moments until then.

/// Gives every other thread of clrbpf the calling thread's real-time
/// scheduling, if it has one (without the priority boost, the threads
/// already run as the caller does). Best effort.
pub fn hurry_threads_to_exit() {
    // SAFETY: no preconditions; pid 0 is the calling thread.
    let policy = unsafe { libc::sched_getscheduler(0) } & !libc::SCHED_RESET_ON_FORK;
    if policy != libc::SCHED_RR && policy != libc::SCHED_FIFO {
        return;
    }
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid, writable sched_param.
    if unsafe { libc::sched_getparam(0, &mut param) } != 0 {
        return;
    }
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    let tids = tasks.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok());
    for tid in tids.filter(|&tid: &libc::pid_t| tid != me) {
        // A thread that ended since the listing may have left its id free,
        // but the kernel gives ids out in order: one comes back only after
        // the whole pid space, not within this loop.
        // SAFETY: `param` is a valid sched_param; a tid that is gone only
        // fails the call.
        unsafe {
            libc::sched_setscheduler(tid, policy | libc::SCHED_RESET_ON_FORK, &param);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs CAP_SYS_NICE: `cargo xtask test` runs it as root. It hurries
    /// the test harness's threads too; they keep `SCHED_RESET_ON_FORK`,
    /// so the tests after it start as before.
    #[test]
    #[ignore = "needs root"]
    fn the_other_threads_take_the_callers_real_time_class() {
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let (go_tx, go) = std::sync::mpsc::channel::<()>();
        let helper = std::thread::spawn(move || {
            // SAFETY: setpriority has no memory preconditions.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
            ready_tx.send(()).expect("send");
            go.recv().expect("recv");
            // SAFETY: no preconditions; pid 0 is the calling thread.
            unsafe { libc::sched_getscheduler(0) & !libc::SCHED_RESET_ON_FORK }
        });
        ready.recv().expect("helper ready");
        let caller = std::thread::spawn(|| {
            let param = libc::sched_param { sched_priority: 1 };
            // SAFETY: `param` is a valid sched_param; pid 0 is this thread.
            let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_RR, &param) };
            assert_eq!(rc, 0, "root may take SCHED_RR");
            hurry_threads_to_exit();
        });
        caller.join().expect("caller");
        go_tx.send(()).expect("go");
        assert_eq!(helper.join().expect("helper"), libc::SCHED_RR);
    }
}
