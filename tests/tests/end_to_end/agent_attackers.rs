//! The agent beside the four hostile tenants of issue 33 at once, all
//! unprivileged ([`attackers::NOBODY`]), and a real .NET 8 app:
//!
//! - the crafted code heap (frames costly to name from memory);
//! - the memory hog (a 120 MB maps file);
//! - the hostile files (a sparse `libcoreclr.so` whose `.dynsym` claims
//!   4 GiB);
//! - the event attacker (a stand-in .NET 9 runtime, as no .NET 9 can be
//!   installed here: contentions of 2^63 ns, waits that wrap, exceptions
//!   against a counter of u64::MAX a second).
//!
//! For ~35 s the agent (directory sink, 5 s windows) must answer
//! `/healthz` with 200 at every poll (every 0.5 s), ship every window
//! within one interval of its end (the window files' times), stay within
//! its memory budget plus 64 MiB of resident memory, and ship the app's
//! windows with its hot method named.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess,
    agent::{TestAgent, status_bytes, tail},
    assert_some_stack_contains, attackers, http, pids, read_profile,
};

const MIB: u64 = 1 << 20;
/// The agent's `--memory-budget-mb`.
const BUDGET_MB: u64 = 256;
/// The agent's `--upload-interval`, in seconds.
const INTERVAL_S: u64 = 5;
/// How long the agent runs beside the attackers once ready.
const RUN: Duration = Duration::from_secs(35);
/// The app's service: its windows are `hot-service.process_cpu.*`.
const SERVICE: &str = "hot-service";

/// The four attackers, each as [`attackers::NOBODY`].
fn four_attackers(dir: &TempDir) -> Vec<TestProcess> {
    let (binary, framework) = attackers::build_crafted_code_heap(&dir.join("code-heap"));
    let sparse = attackers::attacker_dir(dir, "sparse");
    vec![
        attackers::start_crafted_code_heap(&binary, &framework),
        attackers::memory_hog("maps", 120, 120, attackers::NOBODY),
        attackers::hostile_files(&["sparse".into(), sparse.into_os_string(), "120".into()]),
        attackers::event_attacker(dir),
    ]
}

/// What was seen of the agent while it ran.
#[derive(Debug, Default)]
struct Watch {
    polls: usize,
    /// Polls of `/healthz` that did not answer 200 within 2 s.
    health_failures: Vec<(Duration, u16)>,
    peak_rss: u64,
    peak_anon: u64,
}

/// Polls `/healthz` and the agent's resident set every 0.5 s for [`RUN`].
fn watch(agent: &TestAgent) -> Watch {
    let mut seen = Watch::default();
    let started = Instant::now();
    while started.elapsed() < RUN {
        let poll = Instant::now();
        let (status, _) = http::get_within(agent.port(), "/healthz", &[], Duration::from_secs(2));
        seen.polls += 1;
        if status != 200 {
            seen.health_failures.push((started.elapsed(), status));
        }
        let bytes = |field| status_bytes(agent.pid(), field).unwrap_or(0);
        seen.peak_rss = seen.peak_rss.max(bytes("VmRSS:"));
        seen.peak_anon = seen.peak_anon.max(bytes("RssAnon:"));
        thread::sleep(Duration::from_millis(500).saturating_sub(poll.elapsed()));
    }
    seen
}

/// A shipped window: its file's name, its time range and how long after
/// its end the file was written.
struct Shipped {
    path: PathBuf,
    name: String,
    start_ns: i64,
    end_ns: i64,
    delay: Duration,
    /// The processes it holds samples of.
    pids: BTreeSet<u32>,
}

/// Every window file in `out`, read.
fn shipped(out: &Path) -> Vec<Shipped> {
    let mut all = Vec::new();
    for entry in fs::read_dir(out).expect("the output directory") {
        let path = entry.expect("an entry").path();
        let name = path
            .file_name()
            .expect("a name")
            .to_string_lossy()
            .into_owned();
        if !name.ends_with(".clrbpf.pb.gz") {
            continue;
        }
        let written = fs::metadata(&path)
            .and_then(|m| m.modified())
            .expect("the file's time");
        let written_ns = written
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_nanos() as i64;
        let profile = read_profile(&path);
        let end_ns = profile.time_nanos + profile.duration_nanos;
        all.push(Shipped {
            path,
            name,
            start_ns: profile.time_nanos,
            end_ns,
            delay: Duration::from_nanos(written_ns.saturating_sub(end_ns).max(0) as u64),
            pids: pids(&profile),
        });
    }
    all
}

#[test]
fn agent_beside_four_attackers_stays_healthy_on_time_and_in_budget() {
    let env = Env::privileged();
    let dir = TempDir::new("agent-attackers");
    let attackers = four_attackers(&dir);
    let app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["120"],
        &Launch {
            env: &[("OTEL_SERVICE_NAME", SERVICE)],
            ..Launch::default()
        },
    );
    let out = dir.join("windows");
    let budget = BUDGET_MB.to_string();
    let interval = format!("{INTERVAL_S}s");
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--upload-interval".as_ref(),
            interval.as_ref(),
            "--output-dir".as_ref(),
            out.as_os_str(),
            "--memory-budget-mb".as_ref(),
            budget.as_ref(),
        ],
    )
    .wait_ready();
    let agent_pid = agent.pid();
    let seen = watch(&agent);
    let page = agent.metrics();
    let stopped_at = SystemTime::now();
    let log = agent.stop();
    // What the agent refused or put aside of the attackers, for the record.
    for line in page.lines().filter(|l| {
        !l.starts_with('#')
            && ["refused", "naming", "dropped", "lost", "put_aside"]
                .iter()
                .any(|w| l.contains(w))
    }) {
        eprintln!("{line}");
    }
    let event_attacker = &attackers[3];
    let reached = event_attacker
        .lines()
        .iter()
        .any(|l| l.starts_with("SENT kinds=") && l.ends_with(&format!(" peer={agent_pid}")));
    let windows = shipped(&out);
    let late = windows.iter().map(|w| w.delay).max().unwrap_or_default();
    eprintln!(
        "healthz: {} of {} polls failed {:?}; {} windows, the latest {late:?} after its end; \
         peak RSS {} MiB (anonymous {} MiB), budget {BUDGET_MB} MiB",
        seen.health_failures.len(),
        seen.polls,
        seen.health_failures,
        windows.len(),
        seen.peak_rss / MIB,
        seen.peak_anon / MIB,
    );
    let services: BTreeSet<&str> = windows
        .iter()
        .filter_map(|w| w.name.split('.').next())
        .collect();
    eprintln!("services shipped: {services:?}");
    for attacker in &attackers {
        assert!(
            windows.iter().any(|w| w.pids.contains(&attacker.pid())),
            "no window holds attacker {}: the agent never profiled it; services {services:?}",
            attacker.pid()
        );
    }
    assert!(
        reached,
        "the event attacker sent nothing to the agent's sessions: {:?}",
        event_attacker.lines()
    );
    assert!(
        seen.health_failures.is_empty(),
        "/healthz failed at {:?}:\n{}",
        seen.health_failures,
        tail(&log)
    );
    assert!(
        seen.peak_rss <= (BUDGET_MB + 64) * MIB,
        "the agent's RSS peaked at {} MiB, over its {BUDGET_MB} MiB budget plus 64 MiB",
        seen.peak_rss / MIB
    );
    assert_windows_on_time(&windows, &app, stopped_at, &log);
    drop(attackers);
}

/// The app's windows follow one another from the first to the one
/// SIGTERM flushed, the full ones with its hot method named, and every
/// window of every service was written within one interval of its end.
fn assert_windows_on_time(
    windows: &[Shipped],
    app: &TestProcess,
    stopped_at: SystemTime,
    log: &str,
) {
    let interval = Duration::from_secs(INTERVAL_S);
    for w in windows {
        assert!(
            w.delay <= interval,
            "{} was written {:?} after its window ended:\n{}",
            w.name,
            w.delay,
            tail(log)
        );
    }
    let mut mine: BTreeMap<i64, &Shipped> = BTreeMap::new();
    for w in windows
        .iter()
        .filter(|w| w.name.starts_with(&format!("{SERVICE}.process_cpu.")))
    {
        mine.insert(w.start_ns, w);
    }
    let ranges: Vec<(i64, i64)> = mine.values().map(|w| (w.start_ns, w.end_ns)).collect();
    // A run of RUN seconds holds at least RUN / INTERVAL - 1 full windows.
    let full_windows = RUN.as_secs() / INTERVAL_S - 1;
    assert!(
        ranges.len() as u64 > full_windows,
        "{} windows of {SERVICE}: {ranges:?}",
        ranges.len()
    );
    for pair in ranges.windows(2) {
        assert_eq!(
            pair[0].1, pair[1].0,
            "a window of {SERVICE} is missing: {ranges:?}"
        );
    }
    let stopped_ns = stopped_at
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos() as i64;
    let last_end = ranges.last().map_or(0, |r| r.1);
    assert!(
        last_end >= stopped_ns - (INTERVAL_S as i64) * 1_000_000_000,
        "the last window of {SERVICE} ends {} s before SIGTERM",
        (stopped_ns - last_end) / 1_000_000_000
    );
    let full = INTERVAL_S as i64 * 1_000_000_000;
    for w in mine.values().filter(|w| w.end_ns - w.start_ns == full) {
        assert_some_stack_contains(&read_profile(&w.path), Some(app.pid()), &["Hot.Spin"]);
    }
}
