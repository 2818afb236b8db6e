//! Wait-handle waits (.NET 9+) end to end: `record` and the agent against
//! a stand-in runtime.
//!
//! The stand-in (`tests/fakes/fake_dotnet9.py`) is a fake: no .NET 9
//! runtime can be installed on this machine (the package registries carry
//! .NET 8 and .NET Core 3.1 only), and the WaitHandle events exist from
//! .NET 9 on. It looks like a .NET 9 runtime to clrbpf (its mappings name
//! `Microsoft.NETCore.App/9.0.0`, ProcessInfo2 says 9.0.0) and speaks the
//! real diagnostic protocol: clrbpf finds it, turns its perf map on, and
//! asks it for a session exactly as it asks a real runtime, through the
//! same code. The stand-in sends WaitHandleWaitStart/Stop only if that
//! session asks for the WaitHandle keyword at level Verbose, as a runtime
//! does, so the version check that decides the keyword is tested too. The
//! events carry stacks whose addresses its perf map names, and times the
//! test chose, so the durations are known to the nanosecond.
//!
//! The scenario holds every edge of the pairing: interleaved threads, a
//! thread waiting twice, a Stop whose Start came before the session, and a
//! wait still open when the stream ends (cut mid-block for `record`,
//! stopped by StopTracing for the agent). What a real .NET 9 runtime adds
//! (which waits it reports, its stacks through CoreLib) is not checked
//! here.

use std::{
    fs, thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    Env, LabelValue, SampleView, TempDir, TestProcess, agent::TestAgent, read_profile, record_pid,
    sample_types, samples, string,
};

/// Leaf first, as the runtime walks them; names as in a .NET perf map.
const WAIT_ONE_NO_CHECK: &str =
    "bool [System.Private.CoreLib] System.Threading.WaitHandle::WaitOneNoCheck(int32)[Optimized]";
const WAIT_ONE: &str =
    "bool [System.Private.CoreLib] System.Threading.WaitHandle::WaitOne(int32)[Optimized]";
const MONITOR_WAIT: &str =
    "bool [System.Private.CoreLib] System.Threading.Monitor::Wait(object,int32)[Optimized]";
const MUTEX_WAITER: &str = "void [Waits] Waits.Program::MutexWaiter()[OptimizedTier1]";
const MONITOR_WAITER: &str = "void [Waits] Waits.Program::MonitorWaiter()[OptimizedTier1]";
const EVENT_WAITER: &str = "void [Waits] Waits.Program::EventWaiter()[Tier0]";
const SEMAPHORE_WAITER: &str = "void [Waits] Waits.Program::SemaphoreWaiter()[Tier0]";
const AFTER_WAIT: &str = "void [Waits] Waits.Program::AfterWait()[Tier0]";
const START_CALLBACK: &str =
    "void [System.Private.CoreLib] System.Threading.Thread::StartCallback()[Optimized]";

/// The finished waits: (thread, duration ns, `wait.source`, frames the
/// stack holds leaf first, as pprof names them).
const WAITS: [(i64, i64, &str, &[&str]); 3] = [
    (
        4101,
        120_000_123,
        "wait_handle",
        &[
            "System.Threading.WaitHandle.WaitOneNoCheck",
            "System.Threading.WaitHandle.WaitOne",
            "Waits.Program.MutexWaiter",
        ],
    ),
    (
        4102,
        45_500_077,
        "monitor_wait",
        &[
            "System.Threading.Monitor.Wait",
            "Waits.Program.MonitorWaiter",
        ],
    ),
    (
        4101,
        7_250_009,
        "wait_handle",
        &[
            "System.Threading.WaitHandle.WaitOne",
            "Waits.Program.EventWaiter",
        ],
    ),
];

/// Writes the scenario: the three waits of [`WAITS`] interleaved, a Stop of
/// thread 4103 with no Start (its wait began before the session) and a
/// wait of thread 4104 that never ends. `end` is `cut` or `stop`.
fn write_scenario(dir: &TempDir, end: &str) -> std::path::PathBuf {
    let start = |tid: u64, at_ns: u64, source: u8, stack: &[&str]| serde_json::json!({"tid": tid, "at_ns": at_ns, "kind": "start", "source": source, "stack": stack});
    let stop = |tid: u64, at_ns: u64| serde_json::json!({"tid": tid, "at_ns": at_ns, "kind": "stop", "stack": [AFTER_WAIT, START_CALLBACK]});
    let events = vec![
        start(
            4101,
            1_000_000,
            0,
            &[WAIT_ONE_NO_CHECK, WAIT_ONE, MUTEX_WAITER, START_CALLBACK],
        ),
        start(
            4102,
            2_000_000,
            1,
            &[MONITOR_WAIT, MONITOR_WAITER, START_CALLBACK],
        ),
        stop(4103, 3_000_000),
        stop(4102, 2_000_000 + 45_500_077),
        stop(4101, 1_000_000 + 120_000_123),
        start(
            4101,
            130_000_000,
            0,
            &[WAIT_ONE, EVENT_WAITER, START_CALLBACK],
        ),
        stop(4101, 130_000_000 + 7_250_009),
        start(
            4104,
            150_000_000,
            0,
            &[WAIT_ONE, SEMAPHORE_WAITER, START_CALLBACK],
        ),
    ];
    let path = dir.join(&format!("scenario-{end}.json"));
    let scenario = serde_json::json!({"end": end, "events": events});
    fs::write(&path, scenario.to_string()).expect("write the scenario");
    path
}

/// Waits until the stand-in has sent its events to a session of process
/// `peer` (it does once a session asks for the WaitHandle keyword; other
/// profilers on the host may ask too).
fn wait_for_waits_sent(fake: &TestProcess, peer: u32, within: Duration) {
    let until = Instant::now() + within;
    let sent = format!("WAITS_SENT peer={peer}");
    while !fake.lines().contains(&sent) {
        assert!(
            Instant::now() < until,
            "the stand-in sent no waits within {within:?} (no session asked for the WaitHandle keyword at Verbose?): {:?}",
            fake.lines()
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// The profile of waits alone (`waits/count`, `delay/nanoseconds`) holds
/// exactly the finished waits of [`WAITS`] for `pid`, each on its Start's
/// stack with its source and thread: nothing of the unpaired Stop, the
/// unfinished wait or a Stop's stack.
fn assert_exact_waits(waits: &[SampleView], pid: u32, what: &str) {
    let of_pid: Vec<&SampleView> = waits.iter().filter(|s| s.pid() == Some(pid)).collect();
    let total_count: i64 = of_pid.iter().map(|s| s.values[0]).sum();
    let total_delay: i64 = of_pid.iter().map(|s| s.values[1]).sum();
    let expected: i64 = WAITS.iter().map(|w| w.1).sum();
    assert_eq!(
        (total_count, total_delay),
        (3, expected),
        "{what}: waits and their total delay, exact"
    );
    for (tid, duration, source, frames) in WAITS {
        let matching: Vec<&&SampleView> =
            of_pid.iter().filter(|s| s.stack_contains(frames)).collect();
        assert_eq!(
            matching.len(),
            1,
            "{what}: one sample on the stack {frames:?}: {of_pid:#?}"
        );
        let sample = matching[0];
        assert_eq!(sample.values, [1, duration], "{what}: {frames:?}");
        assert_eq!(
            sample.label("wait.source"),
            Some(&LabelValue::Str(source.to_owned())),
            "{what}: {frames:?}"
        );
        assert_eq!(sample.label_num("thread.id"), Some(tid), "{what}");
    }
    for sample in &of_pid {
        assert!(
            !sample.stack_contains(&["AfterWait"]) && !sample.stack_contains(&["SemaphoreWaiter"]),
            "{what}: a Stop's stack or the unfinished wait in the profile: {sample:#?}"
        );
    }
}

/// `record --off-cpu --split` of the stand-in, whose stream is cut in the
/// middle of an event block while thread 4104 waits: the waits profile
/// holds the exact total, the Start stacks and `wait.source`; the summary
/// counts the Stop without a Start and the unfinished wait; no wait is in
/// the contention or off-CPU profiles.
#[test]
fn record_writes_exact_waits_from_a_net9_stand_in() {
    let env = Env::privileged();
    let dir = TempDir::new("waits-record");
    let scenario = write_scenario(&dir, "cut");
    let fake = TestProcess::fake_dotnet9(&scenario, 120, &[], &dir);
    let (output, _) = record_pid(
        &env,
        &dir,
        fake.pid(),
        &["-d", "6", "--off-cpu", "--split"],
        "waits.pb.gz",
    );
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let lines = fake.lines();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("SESSION keywords=0x40000") && l.contains(" level=5 ")),
        "no session asked for the WaitHandle keyword at Verbose: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("WAITS_SENT")),
        "{lines:?}"
    );

    let part = read_profile(&dir.join("waits.waits.pb.gz"));
    assert_eq!(sample_types(&part), ["waits/count", "delay/nanoseconds"]);
    assert_exact_waits(&samples(&part), fake.pid(), "record --split");

    // Neither the contention nor the off-CPU profile counts these waits:
    // each kind is in its own profile only. (The stand-in's waits are not
    // real sleeps, so the scheduler saw none of them.)
    let contention = read_profile(&dir.join("waits.contention.pb.gz"));
    assert!(
        samples(&contention)
            .iter()
            .all(|s| s.pid() != Some(fake.pid())),
        "the stand-in's waits in the contention profile"
    );
    let off_cpu = read_profile(&dir.join("waits.offcpu.pb.gz"));
    assert!(
        samples(&off_cpu)
            .iter()
            .all(|s| !s.stack_contains(&["Waits.Program"])),
        "a wait's managed stack in the off-CPU profile"
    );

    let summary = stderr
        .lines()
        .find(|l| l.starts_with(&format!("clrbpf: pid {} ", fake.pid())))
        .unwrap_or_else(|| panic!("no CLR line for the stand-in:\n{stderr}"));
    assert!(
        summary.contains(
            "3 waits, 172.8 ms waiting (not counted: 1 stops without a start, 1 unfinished)"
        ) && summary.contains("incomplete"),
        "{summary}"
    );
    assert!(
        !stderr.contains("wait-handle events need .NET 9+"),
        "a .NET 9 runtime is told it is too old:\n{stderr}"
    );
}

/// The agent finds the stand-in by itself, and its `wait` series (the
/// directory sink's `<service>.wait.<time>.pb.gz`) holds the same exact
/// waits, this time with thread 4104 still waiting when the session is
/// stopped; no wait goes to the `lock` series.
#[test]
fn agent_ships_exact_waits_of_a_net9_stand_in_as_the_wait_series() {
    let env = Env::privileged();
    let dir = TempDir::new("waits-agent");
    let out = dir.join("windows");
    let scenario = write_scenario(&dir, "stop");
    let agent = TestAgent::start_with_windows(&env, &dir, &out, &[]);
    let fake = TestProcess::fake_dotnet9(
        &scenario,
        120,
        &[("OTEL_SERVICE_NAME", "waits-stand-in")],
        &dir,
    );
    // The agent looks for new .NET processes every 5 s.
    wait_for_waits_sent(&fake, agent.pid(), Duration::from_secs(30));
    thread::sleep(Duration::from_secs(1));
    let log = agent.stop();
    let mut waits = Vec::new();
    let mut files = Vec::new();
    for entry in fs::read_dir(&out).expect("the output directory") {
        let path = entry.expect("an entry").path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        assert!(
            !name.starts_with("waits-stand-in.lock."),
            "a lock profile for the stand-in, which has no contention: {name}"
        );
        if name.starts_with("waits-stand-in.wait.") {
            let profile = read_profile(&path);
            assert_eq!(sample_types(&profile), ["waits/count", "delay/nanoseconds"]);
            // Pyroscope's profile types are `wait:waits:count:cpu:nanoseconds`
            // and `wait:delay:nanoseconds:cpu:nanoseconds` (README).
            let period = profile.period_type.as_ref().map(|t| {
                (
                    string(&profile, t.r#type).to_owned(),
                    string(&profile, t.unit).to_owned(),
                )
            });
            assert_eq!(period, Some(("cpu".to_owned(), "nanoseconds".to_owned())));
            waits.extend(samples(&profile));
            files.push(name.into_owned());
        }
    }
    assert!(!files.is_empty(), "no wait series; agent log:\n{log}");
    assert_exact_waits(&waits, fake.pid(), "agent");
}
