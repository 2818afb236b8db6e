//! Targets that pose as .NET: any process that maps a file named
//! `libcoreclr.so` looks like one to clrbpf, and an unprivileged user can
//! start as many as they like. Their diagnostic sockets never answer,
//! accept and stay silent, or stream junk. None of that may delay the
//! recording, lose samples, or make the profile's duration wrong.

use std::{
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    BusyShell, Env, Runtime, TempDir, TestProcess, assert_some_stack_contains, pids, read_profile,
    samples, value_index,
};

const USER: u32 = 1000;

/// One fake of each kind, living longer than any recording here.
fn hostile_targets() -> Vec<TestProcess> {
    ["silent", "mute", "junk"]
        .into_iter()
        .map(|mode| TestProcess::fake_dotnet(mode, 120, USER))
        .collect()
}

/// `record -p` of a real .NET app and the three fakes, stopped by `-d`:
/// on time, nothing lost, the app named, each fake reported, and the
/// app's CPU time in the profile no more than the profile's duration
/// (it has one busy thread).
#[test]
fn hostile_diagnostic_sockets_delay_nothing() {
    let env = Env::privileged();
    let fakes = hostile_targets();
    let app = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], false);
    let dir = TempDir::new("hostile-d");
    let out = dir.join("out.pb.gz");
    let mut args: Vec<String> = vec!["record".into(), "-d".into(), "4".into()];
    for pid in fakes.iter().map(TestProcess::pid).chain([app.pid()]) {
        args.push("-p".into());
        args.push(pid.to_string());
    }
    args.push("-o".into());
    args.push(out.to_string_lossy().into_owned());
    let started = Instant::now();
    let output =
        clrbpf_integration_tests::run_clrbpf(&env, &args, dir.path(), Duration::from_secs(120));
    let took = started.elapsed();
    clrbpf_integration_tests::assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        took < Duration::from_secs(8),
        "a 4 s recording took {took:?} with hostile targets:\n{stderr}"
    );
    let (_, lost) = clrbpf_integration_tests::summary_samples_and_lost(&stderr);
    assert_eq!(lost, 0, "samples lost:\n{stderr}");
    for fake in &fakes {
        assert!(
            clrbpf_integration_tests::warned_about(&stderr, fake.pid()),
            "fake .NET pid {} is not reported:\n{stderr}",
            fake.pid()
        );
    }
    let profile = read_profile(&out);
    assert_some_stack_contains(&profile, Some(app.pid()), &["Hot.Spin"]);
    let cpu = value_index(&profile, "cpu/nanoseconds");
    let app_cpu_ns: i64 = samples(&profile)
        .iter()
        .filter(|s| s.pid() == Some(app.pid()))
        .map(|s| s.values[cpu])
        .sum();
    assert!(
        app_cpu_ns as f64 <= profile.duration_nanos as f64 * 1.05,
        "one busy thread holds {app_cpu_ns} ns of CPU in a {} ns profile",
        profile.duration_nanos
    );
}

/// Ctrl-C with hostile targets attached: clrbpf stops, writes the profile
/// and exits within seconds, not after the targets' deadlines.
#[test]
fn ctrl_c_is_honoured_whatever_the_targets_do() {
    let env = Env::privileged();
    let fakes = hostile_targets();
    let busy = BusyShell::start();
    let dir = TempDir::new("hostile-int");
    let out = dir.join("out.pb.gz");
    let mut command = Command::new(&env.clrbpf);
    command.args(["record", "-a", "-o"]).arg(&out);
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start clrbpf");
    // Long enough for the fakes to be seen and their sessions asked for.
    thread::sleep(Duration::from_secs(4));
    let interrupted = Instant::now();
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let output = loop {
        if let Some(_status) = child.try_wait().expect("wait") {
            break child.wait_with_output().expect("output");
        }
        if interrupted.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("clrbpf still runs 60 s after Ctrl-C");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let took = interrupted.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    assert!(
        took < Duration::from_secs(4),
        "clrbpf took {took:?} to stop after Ctrl-C:\n{stderr}"
    );
    assert!(stderr.contains("(Ctrl-C)"), "{stderr}");
    let profile = read_profile(&out);
    assert!(
        pids(&profile).contains(&busy.pid()),
        "the busy shell {} is not in the profile:\n{stderr}",
        busy.pid()
    );
    drop(fakes);
}

/// A real .NET process stopped (SIGSTOP) after its EventPipe session
/// started never answers StopTracing: the end of the recording would wait
/// for it. A second Ctrl-C ends that wait at once, and the profile is
/// still written.
#[test]
fn a_second_ctrl_c_ends_the_waits_on_targets() {
    let env = Env::privileged();
    let app = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], false);
    let dir = TempDir::new("second-int");
    let out = dir.join("out.pb.gz");
    let mut child = Command::new(&env.clrbpf)
        .args(["record", "-p", &app.pid().to_string(), "-o"])
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start clrbpf");
    thread::sleep(Duration::from_secs(4));
    // SAFETY: kill has no memory preconditions; both pids are our children.
    unsafe {
        libc::kill(app.pid() as libc::pid_t, libc::SIGSTOP);
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    thread::sleep(Duration::from_millis(100));
    let interrupted = Instant::now();
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let output = loop {
        if child.try_wait().expect("wait").is_some() {
            break child.wait_with_output().expect("output");
        }
        assert!(
            interrupted.elapsed() < Duration::from_secs(60),
            "clrbpf still runs 60 s after the second Ctrl-C"
        );
        thread::sleep(Duration::from_millis(20));
    };
    // SAFETY: as above.
    unsafe { libc::kill(app.pid() as libc::pid_t, libc::SIGCONT) };
    let took = interrupted.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    assert!(
        took < Duration::from_secs(3),
        "clrbpf took {took:?} after the second Ctrl-C:\n{stderr}"
    );
    assert!(
        stderr.contains("a second stop request"),
        "the cut-short CLR stream is not reported:\n{stderr}"
    );
    assert!(!read_profile(&out).sample.is_empty());
    // Its runtime could not be asked to stop writing them: remove them.
    let pid = app.pid();
    drop(app);
    for name in [format!("perf-{pid}.map"), format!("jit-{pid}.dump")] {
        let _ = std::fs::remove_file(std::path::Path::new("/tmp").join(name));
    }
}
