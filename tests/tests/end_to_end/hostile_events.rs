//! A target that sends crafted CLR events (issue 33, defect 1): an
//! unprivileged user's stand-in runtime (`tests/fakes/fake_dotnet9.py`; no
//! .NET 9 runtime can be installed here) answers clrbpf's sessions with
//!
//! - two ContentionStop events whose DurationNs is 2^63;
//! - two GCAllocationTick events (`--alloc`) that claim u64::MAX bytes;
//! - WaitHandleWait pairs that last 2^63 ns, that began before the
//!   machine booted (timestamp 0), that end before they begin, and a Stop
//!   with no Start;
//! - two exceptions of two types, each thrown once, against an
//!   `exception-count` counter (the EventCounters session clrbpf asks for
//!   with an exception budget) that claims u64::MAX every second.
//!
//! The apportioning of a window's delay, bytes or exceptions used to wrap
//! and count down from u64::MAX, which hung the main loop for good: `-d`
//! and Ctrl-C were no longer looked at. Beside it runs a real .NET 8 app,
//! whose samples must all be there, named. One set-up per test serves
//! every attack.

use std::{
    path::Path,
    process::{Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf::pprof_proto::Profile;
use clrbpf_integration_tests::{
    Env, LabelValue, Runtime, TempDir, TestProcess, assert_some_stack_contains, assert_success,
    attackers::{self, ALLOCATION_EVENTS, EXCEPTION_TYPES, PAIRED_WAITS},
    read_profile, samples, value_index,
};

/// Most bytes clrbpf lets one allocation event stand for: a user address
/// space (`profile::alloc_sampling::MAX_EVENT_BYTES`).
const MAX_EVENT_BYTES: i128 = 1 << 47;

/// Most exceptions clrbpf believes a runtime's `exception-count` counted
/// in a second (`clr::budget::MAX_EXCEPTIONS_PER_SECOND`).
const MAX_EXCEPTIONS_PER_SECOND: i128 = 100_000_000;

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
    let run_ns = i128::from(profile.duration_nanos).max(ran.as_nanos() as i128);
    assert_waits(&profile, attacker, run_ns, stderr);
    assert_exceptions(&profile, attacker, run_ns, stderr);
    assert_allocations(out, attacker, stderr);
}

/// The attacker's value of sample type `name`, summed.
fn attacker_total(profile: &Profile, attacker: &TestProcess, name: &str) -> i128 {
    let at = value_index(profile, name);
    samples(profile)
        .iter()
        .filter(|s| s.pid() == Some(attacker.pid()))
        .map(|s| i128::from(s.values[at]))
        .sum()
}

/// The crafted waits are all taken (the Stop alone is none), and none
/// lasted longer than clrbpf ran.
fn assert_waits(profile: &Profile, attacker: &TestProcess, run_ns: i128, stderr: &str) {
    let waits = attacker_total(profile, attacker, "waits/count");
    let delay = attacker_total(profile, attacker, "wait_delay/nanoseconds");
    assert_eq!(
        waits, PAIRED_WAITS,
        "the attacker's waits: {waits}, not {PAIRED_WAITS}:\n{stderr}"
    );
    let most = PAIRED_WAITS * run_ns;
    assert!(
        (0..=most).contains(&delay),
        "the attacker's wait delay {delay} ns is over {PAIRED_WAITS} waits of clrbpf's whole run ({run_ns} ns):\n{stderr}"
    );
}

/// Both exception types are there, and the counter's u64::MAX a second
/// counts for no more than a real runtime could throw in clrbpf's run
/// (one counter value a second, and the first one's interval).
fn assert_exceptions(profile: &Profile, attacker: &TestProcess, run_ns: i128, stderr: &str) {
    let at = value_index(profile, "exceptions/count");
    let mine: Vec<_> = samples(profile)
        .into_iter()
        .filter(|s| s.pid() == Some(attacker.pid()))
        .collect();
    for ty in EXCEPTION_TYPES {
        let n: i128 = mine
            .iter()
            .filter(|s| s.label("exception.type") == Some(&LabelValue::Str(ty.to_owned())))
            .map(|s| i128::from(s.values[at]))
            .sum();
        assert!(n >= 1, "no {ty} in the attacker's exceptions:\n{stderr}");
    }
    let thrown: i128 = mine.iter().map(|s| i128::from(s.values[at])).sum();
    let seconds = run_ns / 1_000_000_000 + 2;
    let most = EXCEPTION_TYPES.len() as i128 + MAX_EXCEPTIONS_PER_SECOND * seconds;
    assert!(
        (2..=most).contains(&thrown),
        "the attacker's exceptions {thrown} are not within 2..={most}:\n{stderr}"
    );
    eprintln!("the attacker's exceptions: {thrown} (at most {most})");
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
    let attacker = attackers::event_attacker(&dir);
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
    [
        "contention_stop",
        "allocation",
        "start",
        "stop",
        "exception",
    ]
    .iter()
    .all(|kind| {
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
    let attacker = attackers::event_attacker(&dir);
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
