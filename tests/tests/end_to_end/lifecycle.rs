//! Process lifecycle from the kernel: the real eBPF programs tell
//! userspace, through the sample ring buffer, when a profiled process
//! execs and when it ends, with the right pids, in whole-host mode and for
//! a target set that follows forks. Run by `cargo xtask test` (root).

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use clrbpf::bpf::{OffCpuConfig, ProcessEvent, ProcessEventAt, Sampler, SamplerConfig};
use clrbpf_integration_tests::{BusyShell, must_have_privileges};

/// Drains `sampler` until `done` holds for the events read so far, or
/// panics after a generous deadline.
fn drain_until(sampler: &mut Sampler, done: impl Fn(&[ProcessEvent]) -> bool) -> Vec<ProcessEvent> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut samples = Vec::new();
    let mut at: Vec<ProcessEventAt> = Vec::new();
    let mut events = Vec::new();
    loop {
        samples.clear();
        at.clear();
        let malformed = sampler.drain_with_events(&mut samples, &mut at);
        assert_eq!(malformed, 0, "the ring buffer held malformed records");
        events.extend(at.iter().map(|a| a.event));
        if done(&events) {
            return events;
        }
        assert!(
            Instant::now() < deadline,
            "the expected process events did not arrive; got {events:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_to_end(script: &str) -> u32 {
    let mut child = Command::new("sh")
        .args(["-c", script])
        .stdin(Stdio::null())
        .spawn()
        .expect("start sh");
    let pid = child.id();
    let status = child.wait().expect("wait for sh");
    assert!(status.success(), "sh -c {script:?} failed: {status}");
    pid
}

fn exited(events: &[ProcessEvent], pid: u32) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, ProcessEvent::Exited { pid: p, .. } if *p == pid))
        .count()
}

fn position(events: &[ProcessEvent], wanted: impl Fn(&ProcessEvent) -> bool) -> Option<usize> {
    events.iter().position(wanted)
}

#[test]
fn whole_host_mode_sees_every_exit_and_exec() {
    must_have_privileges();
    let mut sampler = Sampler::start(&SamplerConfig::default()).expect("start the sampler");
    let before = sampler.counters();
    let started_ns = clock_monotonic_ns();
    let short: Vec<u32> = (0..5).map(|_| run_to_end(":")).collect();
    // `sh` execs `sleep` in place of itself: the same pid execs twice
    // (the spawn, then `exec`), and ends once.
    let execing = run_to_end("exec sleep 0.05");
    let events = drain_until(&mut sampler, |events| {
        short.iter().all(|&pid| exited(events, pid) > 0) && exited(events, execing) > 0
    });
    for &pid in short.iter().chain([&execing]) {
        assert_eq!(exited(&events, pid), 1, "pid {pid} ended once: {events:?}");
    }
    let execs = |pid: u32| {
        events
            .iter()
            .filter(|e| matches!(e, ProcessEvent::Exec { pid: p, .. } if *p == pid))
            .count()
    };
    assert!(
        execs(execing) >= 2,
        "pid {execing} exec'd sh then sleep: {events:?}"
    );
    let exec_at = position(
        &events,
        |e| matches!(e, ProcessEvent::Exec { pid, .. } if *pid == execing),
    )
    .expect("an exec");
    let exit_at = position(
        &events,
        |e| matches!(e, ProcessEvent::Exited { pid, .. } if *pid == execing),
    )
    .expect("an exit");
    assert!(
        exec_at < exit_at,
        "the exec comes before the exit: {events:?}"
    );
    // The samples' clock: after the test started, not after now.
    let now_ns = clock_monotonic_ns();
    for event in events.iter().filter(|e| short.contains(&e.pid())) {
        assert!(
            (started_ns..=now_ns).contains(&event.time_ns()),
            "{event:?} is stamped outside [{started_ns}, {now_ns}]"
        );
    }
    let after = sampler.counters();
    assert!(after.process_exits >= before.process_exits + 6, "{after:?}");
    assert!(after.process_execs >= before.process_execs + 7, "{after:?}");
    assert_eq!(after.process_events_lost, 0);
    let counts = sampler.process_event_counts();
    assert!(counts.exits >= 6 && counts.execs >= 7, "{counts:?}");
}

#[test]
fn a_target_set_reports_its_own_processes_and_their_children_only() {
    must_have_privileges();
    // Not itself a target: only processes added below and their children are.
    let mut sampler = Sampler::start(&SamplerConfig {
        target_pids: Some(Vec::new()),
        ..SamplerConfig::default()
    })
    .expect("start the sampler");
    let mut target = Command::new("sh")
        // `read` waits, without a process of its own, until the target is
        // in the set.
        .args(["-c", "read go; sh -c 'echo $$'"])
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .expect("start the target");
    let target_pid = target.id();
    sampler.add_target(target_pid).expect("add the target");
    let outsider = run_to_end(":");
    std::io::Write::write_all(&mut target.stdin.take().expect("stdin"), b"go\n")
        .expect("let the target go on");
    let output = std::io::Read::bytes(target.stdout.take().expect("stdout"))
        .map(|b| b.expect("read the child's pid"))
        .collect::<Vec<u8>>();
    assert!(target.wait().expect("wait").success());
    let child: u32 = String::from_utf8_lossy(&output)
        .trim()
        .parse()
        .expect("the child printed its pid");
    let events = drain_until(&mut sampler, |events| {
        exited(events, target_pid) > 0 && exited(events, child) > 0
    });
    assert_eq!(
        exited(&events, outsider),
        0,
        "an outsider was reported: {events:?}"
    );
    assert!(
        events
            .iter()
            .all(|e| e.pid() == target_pid || e.pid() == child),
        "only the target and its child: {events:?}"
    );
    // The child exec'd `sh` after the fork the kernel side followed.
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ProcessEvent::Exec { pid, .. } if *pid == child)),
        "{events:?}"
    );
}

#[test]
fn forgetting_a_process_drops_its_unwind_index_from_the_kernel() {
    must_have_privileges();
    let mut sampler = Sampler::start(&SamplerConfig {
        user_unwind: true,
        unwind_table_memory_bytes: 16 << 20,
        ..SamplerConfig::default()
    })
    .expect("start the sampler");
    let mut maps = sampler.take_unwind_maps().expect("unwind maps");
    let mut child = Command::new("sleep")
        .arg("30")
        .stdin(Stdio::null())
        .spawn()
        .expect("start sleep");
    let pid = child.id();
    // `sleep` is mapped once exec is done; the index is written then.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .is_ok_and(|maps| maps.contains("libc"))
    {
        assert!(Instant::now() < deadline, "sleep never mapped libc");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(maps.track_process(pid));
    assert!(maps.kernel_has_index(pid));
    let memory = maps.memory();
    assert_eq!(memory.processes, 1);
    assert!(memory.tables >= 1, "{memory:?}");
    let _ = child.kill();
    let _ = child.wait();
    maps.forget_process(pid);
    assert!(!maps.kernel_has_index(pid), "the kernel entry is gone");
    let after = maps.memory();
    assert_eq!(after.processes, 0);
    assert_eq!(maps.stats().processes_forgotten, 1);
    // Tables stay for reuse (unused ones are evicted first).
    assert_eq!(after.tables, memory.tables);
}

fn clock_monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a valid out pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// A thread that exits hands its exact off-CPU totals to userspace through
/// the ring and leaves the kernel's map, which would otherwise fill on a
/// host that starts threads for weeks; the totals are not lost.
#[test]
fn an_exited_threads_off_cpu_totals_move_from_the_kernel_map_to_userspace() {
    must_have_privileges();
    let mut sampler = Sampler::start(&SamplerConfig {
        off_cpu: Some(OffCpuConfig {
            min_ns: 1_000_000,
            max_stacks_per_cpu_second: 500,
        }),
        ..SamplerConfig::default()
    })
    .expect("start the sampler");
    // sh blocks in wait4 for each sleep: two waits of about 100 ms.
    let pid = run_to_end("sleep 0.1; sleep 0.1");
    drain_until(&mut sampler, |events| exited(events, pid) > 0);
    let in_kernel = sampler.off_cpu_threads_in_kernel();
    assert!(
        !in_kernel.contains(&pid),
        "the exited thread {pid} is still in the kernel's totals map ({} threads there)",
        in_kernel.len()
    );
    let totals = sampler.off_cpu_totals();
    let (_, sh) = totals
        .threads
        .iter()
        .find(|(tid, _)| *tid == pid)
        .unwrap_or_else(|| panic!("no off-CPU totals for the exited thread {pid}"));
    assert_eq!(sh.pid, pid);
    assert!(sh.intervals >= 2, "{sh:?}");
    assert!(
        (180_000_000..2_000_000_000).contains(&sh.blocked_ns),
        "sh waited about 200 ms for its two sleeps: {sh:?}"
    );
}

/// Records wait in the ring for userspace's timer while it is under a
/// quarter full (no wakeup per record); past that, the kernel side wakes
/// userspace, so a burst is drained before the ring fills.
#[test]
fn a_ring_filling_past_a_quarter_wakes_userspace() {
    must_have_privileges();
    let mut sampler = Sampler::start(&SamplerConfig {
        frequency_hz: 999,
        // About 30 records: a quarter fills in a few ticks of one CPU.
        ring_buffer_bytes: 64 * 1024,
        target_pids: Some(Vec::new()),
        ..SamplerConfig::default()
    })
    .expect("start the sampler");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .expect("a tokio runtime");
    let busy = BusyShell::start();
    runtime.block_on(async {
        let ring = sampler.ring_wakeups().expect("poll the sample ring");
        // Nothing is profiled yet: the ring stays empty, nothing wakes.
        assert!(
            tokio::time::timeout(Duration::from_millis(300), ring.woken())
                .await
                .is_err(),
            "woken with nothing profiled"
        );
        sampler
            .add_target(busy.pid())
            .expect("profile the busy shell");
        tokio::time::timeout(Duration::from_secs(5), ring.woken())
            .await
            .expect("the kernel side never woke userspace while a busy thread filled the ring");
    });
    let mut samples = Vec::new();
    let mut events = Vec::new();
    sampler.drain_with_events(&mut samples, &mut events);
    assert!(
        samples.iter().filter(|s| s.pid == busy.pid()).count() >= 7,
        "the wakeup came before a quarter of the ring was used: {} samples",
        samples.len()
    );
}
