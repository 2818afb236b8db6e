//! A target that sends crafted CLR events (issue 33, defect 1): an
//! unprivileged user's stand-in runtime (`tests/fakes/fake_dotnet9.py`)
//! answers clrbpf's contention session with two ContentionStop events whose
//! DurationNs is 2^63, and its allocation session (`--alloc`) with two
//! GCAllocationTick events that claim u64::MAX bytes each. The
//! apportioning of a window's delay or bytes used to wrap and count down
//! from u64::MAX, which hung the main loop for good: `-d` and Ctrl-C were
//! no longer looked at. Beside it runs a real .NET 8 app, whose samples
//! must all be there. One set-up per test serves both attacks.

use std::{
    ffi::OsString,
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    Env, Runtime, TempDir, TestProcess, assert_some_stack_contains, assert_success, read_profile,
    samples, value_index,
};

/// An unprivileged user: the attacker.
const USER: u32 = 65534;

/// Most bytes clrbpf lets one allocation event stand for: a user address
/// space (`profile::alloc_sampling::MAX_EVENT_BYTES`).
const MAX_EVENT_BYTES: i128 = 1 << 47;

/// The crafted allocation events: each claims u64::MAX bytes.
const ALLOCATION_EVENTS: i128 = 2;

/// The scenario: two ContentionStops of 2^63 ns on two threads, and
/// [`ALLOCATION_EVENTS`] allocation ticks of u64::MAX bytes on two others.
fn hostile_scenario(dir: &TempDir) -> PathBuf {
    let path = dir.join("contention.json");
    let stack = r#"["void [Evil] Evil.Program::Spin()[Optimized]"]"#;
    let mut events: Vec<String> = [(21, 1_000_000), (22, 2_000_000)]
        .iter()
        .map(|(tid, at)| {
            format!(
                r#"{{"tid": {tid}, "at_ns": {at}, "kind": "contention_stop", "duration_ns": 9223372036854775808, "stack": {stack}}}"#
            )
        })
        .collect();
    events.extend([(23, 1_500_000), (24, 2_500_000)].iter().map(|(tid, at)| {
        format!(
            r#"{{"tid": {tid}, "at_ns": {at}, "kind": "allocation", "amount": {}, "object_size": 24, "type": "Evil.Blob", "stack": {stack}}}"#,
            u64::MAX
        )
    }));
    fs::write(
        &path,
        format!(r#"{{"end": "stop", "events": [{}]}}"#, events.join(", ")),
    )
    .expect("write the scenario");
    path
}

/// The stand-in, run as [`USER`] with its files in a directory of its own.
fn hostile_runtime(dir: &TempDir) -> TestProcess {
    let scenario = hostile_scenario(dir);
    let own = dir.join("attacker");
    fs::create_dir_all(&own).expect("create the attacker's directory");
    // SAFETY: chown has no memory preconditions; the path is a C string.
    let path = std::ffi::CString::new(own.as_os_str().as_encoded_bytes()).expect("no NUL");
    assert_eq!(unsafe { libc::chown(path.as_ptr(), USER, USER) }, 0);
    for p in [dir.path(), scenario.as_path()] {
        let mode = if p.is_dir() { 0o755 } else { 0o644 };
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fakes")
        .join("fake_dotnet9.py");
    let argv: Vec<OsString> = vec![
        "/usr/bin/python3".into(),
        script.into_os_string(),
        scenario.into_os_string(),
        "120".into(),
        own.into_os_string(),
    ];
    TestProcess::start_as_user("hostile .NET (contention)", &argv, USER)
}

/// Waits for `child` at most `limit`; kills it and panics past that.
fn wait_at_most(child: std::process::Child, limit: Duration, what: &str) -> (Output, Duration) {
    let started = Instant::now();
    let mut child = child;
    loop {
        if child.try_wait().expect("wait").is_some() {
            return (child.wait_with_output().expect("output"), started.elapsed());
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "{what}: clrbpf still ran after {limit:?}:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn record_all(env: &Env, out: &Path, duration: Option<&str>) -> std::process::Child {
    let mut command = Command::new(&env.clrbpf);
    command.args(["record", "-a", "--alloc"]);
    if let Some(d) = duration {
        command.args(["-d", d]);
    }
    command
        .arg("-o")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start clrbpf")
}

/// The profile of `out` holds the app's hot method, and the attacker's
/// contention delay is no more than clrbpf could have seen: its two
/// threads for clrbpf's whole run, `ran` (a wait is clamped to the time
/// clrbpf has taken the process's events, and its sessions open during
/// the attach, before the profile's own duration starts).
fn assert_profile(
    out: &Path,
    app: &TestProcess,
    attacker: &TestProcess,
    ran: Duration,
    stderr: &str,
) {
    let profile = read_profile(out);
    assert_some_stack_contains(&profile, Some(app.pid()), &["Hot.Spin"]);
    let delay = value_index(&profile, "delay/nanoseconds");
    let attacker_delay: i128 = samples(&profile)
        .iter()
        .filter(|s| s.pid() == Some(attacker.pid()))
        .map(|s| i128::from(s.values[delay]))
        .sum();
    let most = 2 * i128::from(profile.duration_nanos).max(ran.as_nanos() as i128);
    assert!(
        (0..=most).contains(&attacker_delay),
        "the attacker's contention delay {attacker_delay} ns is over two threads for {most} / 2 ns:\n{stderr}"
    );
    assert!(
        samples(&profile)
            .iter()
            .filter(|s| s.pid() == Some(app.pid()))
            .all(|s| s.values.iter().all(|&v| v >= 0)),
        "negative values in the app's samples"
    );
    assert_allocations(out, attacker, stderr);
}

/// The attacker's allocation ticks are taken, each capped at
/// [`MAX_EVENT_BYTES`]: its bytes in the allocation profile are more than
/// nothing and at most [`ALLOCATION_EVENTS`] times the cap.
fn assert_allocations(out: &Path, attacker: &TestProcess, stderr: &str) {
    let profile = read_profile(out);
    let bytes = value_index(&profile, "alloc_size/bytes");
    let attacker_bytes: i128 = samples(&profile)
        .iter()
        .filter(|s| s.pid() == Some(attacker.pid()))
        .map(|s| i128::from(s.values[bytes]))
        .sum();
    let most = ALLOCATION_EVENTS * MAX_EVENT_BYTES;
    assert!(
        (1..=most).contains(&attacker_bytes),
        "the attacker's allocated bytes {attacker_bytes} are not within 1..={most} \
         ({ALLOCATION_EVENTS} ticks of u64::MAX bytes, each capped at 2^47):\n{stderr}"
    );
    assert!(
        samples(&profile)
            .iter()
            .all(|s| s.values.iter().all(|&v| v >= 0)),
        "negative values in the allocation profile"
    );
}

/// `record -a -d 10` beside the attacker ends on time, with the app's
/// samples all there and the attacker's delay bounded.
#[test]
fn crafted_contention_durations_do_not_hang_record() {
    let env = Env::privileged();
    let dir = TempDir::new("hostile-events-d");
    let attacker = hostile_runtime(&dir);
    let app = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], false);
    let out = dir.join("out.pb.gz");
    let spawned = Instant::now();
    let child = record_all(&env, &out, Some("10"));
    let peer = child.id();
    let (output, took) = wait_at_most(child, Duration::from_secs(15), "record -a -d 10");
    assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let (_, lost) = clrbpf_integration_tests::summary_samples_and_lost(&stderr);
    assert_eq!(lost, 0, "samples lost:\n{stderr}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let lines = attacker.lines();
    assert!(
        sent_both(&attacker, peer),
        "the attacker did not send both kinds of events: {lines:?}\n{stderr}"
    );
    assert_profile(&out, &app, &attacker, spawned.elapsed(), &stderr);
}

/// The attacker wrote both its contention and its allocation events to
/// the sessions of clrbpf `peer` (other profilers on the host open
/// sessions too).
fn sent_both(attacker: &TestProcess, peer: u32) -> bool {
    let lines = attacker.lines();
    let peer = format!(" peer={peer}");
    ["contention_stop", "allocation"].iter().all(|kind| {
        lines.iter().any(|l| {
            l.strip_prefix("SENT kinds=")
                .and_then(|rest| rest.strip_suffix(peer.as_str()))
                .is_some_and(|kinds| kinds.split(',').any(|k| k == *kind))
        })
    })
}

/// Ctrl-C is still honoured once the crafted events are in: clrbpf stops
/// within 2 s and writes the profile.
#[test]
fn ctrl_c_is_honoured_after_crafted_contention_durations() {
    let env = Env::privileged();
    let dir = TempDir::new("hostile-events-int");
    let attacker = hostile_runtime(&dir);
    let app = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], false);
    let out = dir.join("out.pb.gz");
    let spawned = Instant::now();
    let child = record_all(&env, &out, None);
    // Ctrl-C once both sessions' crafted events went out (about 3 s in).
    let started = Instant::now();
    while !sent_both(&attacker, child.id()) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the attacker sent no events within 10 s: {:?}",
            attacker.lines()
        );
        thread::sleep(Duration::from_millis(100));
    }
    thread::sleep(Duration::from_secs(1));
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let (output, took) = wait_at_most(child, Duration::from_secs(30), "after Ctrl-C");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    assert!(
        took < Duration::from_secs(2),
        "clrbpf took {took:?} to stop after Ctrl-C:\n{stderr}"
    );
    assert_profile(&out, &app, &attacker, spawned.elapsed(), &stderr);
}
