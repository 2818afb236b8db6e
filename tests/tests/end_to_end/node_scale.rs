//! The agent on a node of many .NET processes: 50 idle .NET 8 services
//! (tests/workloads/Idle.cs) beside one `clrbpf agent`. Every one must have
//! its runtime metrics on `/metrics` and be named in the windows, and the
//! agent must not pay a thread per process: its EventPipe sessions are
//! read by one thread and its requests to the runtimes queue for a few
//! ([`clrbpf::clr::jobs`]).

use std::{
    collections::BTreeSet,
    fs,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    Env, Runtime, TempDir, TestProcess, agent::TestAgent, assert_success, read_profile, run_clrbpf,
    samples,
};

/// Idle .NET processes on the node.
const PROCESSES: usize = 50;
/// The agent's threads at most, however many processes it profiles.
const MAX_AGENT_THREADS: u64 = 16;

/// `Threads:` of `/proc/PID/status`.
fn threads_of(pid: u32) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .expect("the agent's thread count")
}

/// The pids with a `dotnet_gc_heap_size_bytes` series on `/metrics`.
fn pids_with_metrics(metrics: &str) -> BTreeSet<u32> {
    metrics
        .lines()
        .filter(|l| l.starts_with("dotnet_gc_heap_size_bytes{"))
        .filter_map(|l| {
            let at = l.find("pid=\"")? + 5;
            l[at..].split('"').next()?.parse().ok()
        })
        .collect()
}

/// The pids named in the profiles written to `windows` so far.
fn pids_in_profiles(windows: &Path) -> BTreeSet<u32> {
    let Ok(entries) = fs::read_dir(windows) else {
        return BTreeSet::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".pb.gz"))
        .flat_map(|p| {
            samples(&read_profile(&p))
                .iter()
                .filter_map(|s| s.pid())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// 50 idle .NET 8 processes: each has its `dotnet_*` series and is named
/// in the profiles, and the agent stays at or under 16 threads while it
/// attaches to them and after (it had two per process).
#[test]
fn agent_profiles_fifty_idle_dotnet_processes_on_a_few_threads() {
    let env = Env::privileged();
    let apps: Vec<TestProcess> = (0..PROCESSES)
        .map(|_| TestProcess::start(&env, Runtime::Net8, "Idle", &["600", "200"], false))
        .collect();
    // Each has printed READY: their runtimes are up before the agent
    // comes, as on a running node.
    let pids: BTreeSet<u32> = apps.iter().map(TestProcess::pid).collect();
    let dir = TempDir::new("node-scale");
    let windows = dir.join("windows");
    // Off-CPU on: a sleeping service shows in the profiles by its sleeps
    // (at 19 Hz it is almost never on a CPU when a sample is taken).
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--upload-interval".as_ref(),
            "10s".as_ref(),
            "--off-cpu".as_ref(),
            "--exe".as_ref(),
            "dotnet".as_ref(),
            "--output-dir".as_ref(),
            windows.as_os_str(),
        ],
    )
    .wait_ready();
    let mut most_threads = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    let (metrics_missing, profiles_missing) = loop {
        most_threads = most_threads.max(threads_of(agent.pid()));
        let with_metrics = pids_with_metrics(&agent.metrics());
        let named = pids_in_profiles(&windows);
        let metrics_missing: Vec<u32> = pids.difference(&with_metrics).copied().collect();
        let profiles_missing: Vec<u32> = pids.difference(&named).copied().collect();
        if (metrics_missing.is_empty() && profiles_missing.is_empty()) || Instant::now() >= deadline
        {
            break (metrics_missing, profiles_missing);
        }
        thread::sleep(Duration::from_secs(1));
    };
    // Steady state: a few more readings.
    for _ in 0..10 {
        most_threads = most_threads.max(threads_of(agent.pid()));
        thread::sleep(Duration::from_millis(500));
    }
    let log = agent.stop();
    assert!(
        metrics_missing.is_empty(),
        "{} of {PROCESSES} idle processes have no dotnet_* series: {metrics_missing:?}\n{}",
        metrics_missing.len(),
        clrbpf_integration_tests::agent::tail(&log)
    );
    assert!(
        profiles_missing.is_empty(),
        "{} of {PROCESSES} idle processes are named in no profile: {profiles_missing:?}\n{}",
        profiles_missing.len(),
        clrbpf_integration_tests::agent::tail(&log)
    );
    assert!(
        most_threads <= MAX_AGENT_THREADS,
        "the agent ran {most_threads} threads beside {PROCESSES} .NET processes (at most {MAX_AGENT_THREADS})"
    );
    drop(apps);
}

/// Idle .NET processes whose framework frames are named from their
/// jitdumps.
const SHARING_PROCESSES: usize = 8;

/// `[PreJIT]` (ReadyToRun) entries one idle .NET 8 process lists in its
/// jitdump, about (8.0.4: 2,100-2,150).
const READY_TO_RUN_ENTRIES: u64 = 2100;

/// The framework's ReadyToRun code, which every .NET process's jitdump
/// lists at its own addresses, is held once for all of them (it was held
/// once per process: most of the agent's memory per idle service), and
/// each process's frames in it are still named from its own jitdump
/// (`--managed-names perf-map`: no other source).
#[test]
fn record_holds_the_frameworks_jitdump_entries_once_for_many_processes() {
    let env = Env::privileged();
    let apps: Vec<TestProcess> = (0..SHARING_PROCESSES)
        .map(|_| TestProcess::start(&env, Runtime::Net8, "Idle", &["120", "100"], false))
        .collect();
    let dir = TempDir::new("node-share");
    let profile = dir.join("idle.pb.gz");
    let mut args = vec!["record", "-v", "--off-cpu", "-d", "6"];
    args.extend(["--managed-names", "perf-map", "-o"]);
    let profile_arg = profile.to_string_lossy().into_owned();
    args.push(&profile_arg);
    let pid_args: Vec<String> = apps.iter().map(|a| a.pid().to_string()).collect();
    for pid in &pid_args {
        args.extend(["-p", pid.as_str()]);
    }
    let output = run_clrbpf(&env, &args, dir.path(), Duration::from_secs(120));
    assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let shared: u64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix("clrbpf: ReadyToRun code named once for every process: "))
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no shared ReadyToRun code line:\n{stderr}"));
    // Each process lists about the same methods: held once, not once per
    // process (8 x 2,100).
    assert!(
        shared > READY_TO_RUN_ENTRIES / 2 && shared < READY_TO_RUN_ENTRIES * 2,
        "{shared} shared entries for {SHARING_PROCESSES} processes:\n{stderr}"
    );
    let samples = samples(&read_profile(&profile));
    for app in &apps {
        let pid = app.pid();
        assert!(
            samples.iter().any(|s| s.pid() == Some(pid)
                && s.stack_contains(&["System.Threading.Thread.Sleep", "Idle.Nap"])),
            "pid {pid}: no Thread.Sleep under Idle.Nap:\n{stderr}"
        );
    }
    drop(apps);
}
