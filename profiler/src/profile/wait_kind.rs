//! `wait.kind` of an off-CPU sample: why the thread was off the CPU, derived
//! from the kernel side alone (the system call it blocked in, how its wakeup
//! came, its kernel stack), so it is right for any language and needs no
//! runtime symbols.
//!
//! 1. A kernel stack through the page-fault handler, or no system call at
//!    all (the thread blocked in an exception), is `page_fault`.
//! 2. `nanosleep` and `clock_nanosleep` are `sleep`. A futex wait is `futex`
//!    unless its wakeup came from the timer of its own deadline
//!    (`hrtimer_wakeup` on the wakeup's kernel stack): then no thread
//!    released it and it was a sleep (CoreCLR's `Thread.Sleep` is a timed
//!    wait on a condition variable, a futex with a deadline).
//! 3. Reads, writes, socket calls, `poll`/`select`/`epoll`, `io_uring` and
//!    syncs are `io`, as is any wait whose kernel stack passed through
//!    `io_schedule`.
//! 4. Everything else is `other`.
//!
//! System call numbers are x86_64's (the kernel side reads `orig_rax`); an
//! aarch64 port adds its table here.

use std::fmt;

/// Why an off-CPU sample's thread waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WaitKind {
    /// Locks, condition variables, wait handles: a futex another thread released.
    Futex,
    /// `nanosleep`, or a timed wait that ran to its deadline.
    Sleep,
    /// File, socket and pipe I/O, `poll`/`epoll`, block I/O.
    Io,
    /// A page fault (reading a mapped file, swap).
    PageFault,
    Other,
}

impl WaitKind {
    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Futex => "futex",
            Self::Sleep => "sleep",
            Self::Io => "io",
            Self::PageFault => "page_fault",
            Self::Other => "other",
        }
    }
}

impl fmt::Display for WaitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// x86_64 system call numbers (arch/x86/entry/syscalls/syscall_64.tbl).
mod x86_64 {
    pub const SLEEP: &[u32] = &[
        35,  // nanosleep
        230, // clock_nanosleep
    ];
    pub const FUTEX: &[u32] = &[
        202, // futex
        449, // futex_waitv
        454, // futex_wake
        455, // futex_wait
        456, // futex_requeue
    ];
    pub const IO: &[u32] = &[
        0,   // read
        1,   // write
        2,   // open
        7,   // poll
        17,  // pread64
        18,  // pwrite64
        19,  // readv
        20,  // writev
        23,  // select
        26,  // msync
        40,  // sendfile
        42,  // connect
        43,  // accept
        44,  // sendto
        45,  // recvfrom
        46,  // sendmsg
        47,  // recvmsg
        74,  // fsync
        75,  // fdatasync
        162, // sync
        208, // io_getevents
        232, // epoll_wait
        257, // openat
        270, // pselect6
        271, // ppoll
        275, // splice
        276, // tee
        277, // sync_file_range
        281, // epoll_pwait
        285, // fallocate
        288, // accept4
        295, // preadv
        296, // pwritev
        299, // recvmmsg
        306, // syncfs
        307, // sendmmsg
        326, // copy_file_range
        327, // preadv2
        328, // pwritev2
        333, // io_pgetevents
        426, // io_uring_enter
        437, // openat2
        441, // epoll_pwait2
    ];
}

/// Kernel functions on the page-fault path.
const PAGE_FAULT_FRAMES: &[&str] = &[
    "asm_exc_page_fault",
    "exc_page_fault",
    "do_user_addr_fault",
    "handle_mm_fault",
];

/// Kernel functions of a block-I/O wait.
const IO_FRAMES: &[&str] = &["io_schedule", "io_schedule_timeout"];

/// Kernel functions that only run in interrupt context (or for it, in
/// `ksoftirqd`): a wakeup whose kernel stack has one was not a thread's.
const INTERRUPT_FRAMES: &[&str] = &[
    "hrtimer_wakeup",
    "hrtimer_interrupt",
    "__hrtimer_run_queues",
    "handle_softirqs",
    "__do_softirq",
    "irq_exit_rcu",
    "__irq_exit_rcu",
    "run_ksoftirqd",
    "common_interrupt",
];

/// Whether a wakeup (its kernel stack's function names, leaf first) came
/// from its thread's own timer: a timed wait that ran out.
pub fn woken_by_timer<'a>(waker_kernel_frames: impl IntoIterator<Item = &'a str>) -> bool {
    waker_kernel_frames
        .into_iter()
        .any(|f| f == "hrtimer_wakeup")
}

/// Whether a wakeup came from interrupt context: then the thread the
/// kernel side saw running was only interrupted, not the waker.
pub fn woken_in_interrupt<'a>(waker_kernel_frames: impl IntoIterator<Item = &'a str>) -> bool {
    waker_kernel_frames.into_iter().any(|f| {
        INTERRUPT_FRAMES.contains(&f) || f.starts_with("asm_sysvec_") || f.starts_with("sysvec_")
    })
}

/// Classifies one off-CPU sample. `kernel_frames` are its kernel function
/// names, leaf first; `timed_out`: [`woken_by_timer`] of its wakeup.
pub fn classify<'a>(
    syscall: Option<u32>,
    timed_out: bool,
    kernel_frames: impl IntoIterator<Item = &'a str> + Clone,
) -> WaitKind {
    let through = |names: &[&str]| {
        kernel_frames
            .clone()
            .into_iter()
            .any(|f| names.contains(&f))
    };
    if through(PAGE_FAULT_FRAMES) {
        return WaitKind::PageFault;
    }
    let Some(nr) = syscall else {
        return WaitKind::PageFault;
    };
    if x86_64::SLEEP.contains(&nr) {
        WaitKind::Sleep
    } else if x86_64::FUTEX.contains(&nr) {
        if timed_out {
            WaitKind::Sleep
        } else {
            WaitKind::Futex
        }
    } else if x86_64::IO.contains(&nr) || through(IO_FRAMES) {
        WaitKind::Io
    } else {
        WaitKind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FUTEX_STACK: [&str; 4] = ["__schedule", "schedule", "futex_wait_queue", "futex_wait"];

    #[test]
    fn a_futex_released_by_a_thread_is_futex() {
        assert_eq!(classify(Some(202), false, FUTEX_STACK), WaitKind::Futex);
        assert_eq!(classify(Some(449), false, FUTEX_STACK), WaitKind::Futex);
    }

    #[test]
    fn a_timed_wait_that_ran_out_is_sleep() {
        assert_eq!(classify(Some(202), true, FUTEX_STACK), WaitKind::Sleep);
        assert_eq!(
            classify(Some(230), false, ["do_nanosleep"]),
            WaitKind::Sleep
        );
        assert_eq!(classify(Some(35), true, ["do_nanosleep"]), WaitKind::Sleep);
    }

    #[test]
    fn reads_polls_and_block_io_are_io() {
        assert_eq!(classify(Some(0), false, ["pipe_read"]), WaitKind::Io);
        assert_eq!(classify(Some(232), true, ["do_epoll_wait"]), WaitKind::Io);
        assert_eq!(
            classify(Some(999), false, ["io_schedule", "folio_wait_bit"]),
            WaitKind::Io
        );
    }

    #[test]
    fn page_faults_win_over_the_system_call() {
        let fault = [
            "io_schedule",
            "filemap_fault",
            "handle_mm_fault",
            "exc_page_fault",
        ];
        assert_eq!(classify(Some(0), false, fault), WaitKind::PageFault);
        assert_eq!(classify(None, false, fault), WaitKind::PageFault);
        assert_eq!(classify(None, false, []), WaitKind::PageFault);
    }

    #[test]
    fn wakeups_are_told_apart_by_their_kernel_stack() {
        let by_thread = ["try_to_wake_up", "wake_up_q", "futex_wake", "do_futex"];
        let by_timer = [
            "try_to_wake_up",
            "hrtimer_wakeup",
            "__hrtimer_run_queues",
            "hrtimer_interrupt",
            "__sysvec_apic_timer_interrupt",
            "asm_sysvec_apic_timer_interrupt",
        ];
        assert!(!woken_by_timer(by_thread) && !woken_in_interrupt(by_thread));
        assert!(woken_by_timer(by_timer) && woken_in_interrupt(by_timer));
        let by_network = [
            "try_to_wake_up",
            "sock_def_readable",
            "net_rx_action",
            "handle_softirqs",
        ];
        assert!(!woken_by_timer(by_network) && woken_in_interrupt(by_network));
    }

    #[test]
    fn the_rest_is_other() {
        assert_eq!(classify(Some(61), false, ["do_wait"]), WaitKind::Other);
        assert_eq!(WaitKind::Other.to_string(), "other");
    }
}
