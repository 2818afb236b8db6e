//! Exception totals by type that are exact at a process's exit (issue 34,
//! item 1): a .NET 8 and a .NET Core 3.1 app throw known counts of three
//! types over about 3 s and exit at once, under `record -p`, `record -a`
//! and the agent's directory sink (summed over its windows) watching the
//! same run, with the default bound. Run by `cargo xtask test` (root, one
//! test at a time).

use std::{fs, path::Path, time::Duration};

use clrbpf::pprof_proto::Profile;

use clrbpf_integration_tests::{
    EXCEPTIONS_WORKLOAD_TYPES, Env, LabelValue, Runtime, TempDir, TestProcess, agent::TestAgent,
    parse_value, read_profile, samples, start_whole_host_recording, value_index,
};

const TIMEOUT: Duration = Duration::from_secs(90);

/// The profiles' exceptions of `pid` by type, summed, and whether the type
/// thrown once came with its stack.
fn by_type(profiles: &[Profile], pid: u32) -> (Vec<i64>, bool) {
    let all: Vec<_> = profiles
        .iter()
        .flat_map(|profile| {
            let at = value_index(profile, "exceptions/count");
            samples(profile).into_iter().map(move |s| (at, s))
        })
        .collect();
    let mine: Vec<_> = all.iter().filter(|(_, s)| s.pid() == Some(pid)).collect();
    let counts = EXCEPTIONS_WORKLOAD_TYPES
        .iter()
        .map(|ty| {
            mine.iter()
                .filter(|(_, s)| {
                    s.label("exception.type") == Some(&LabelValue::Str((*ty).to_owned()))
                })
                .map(|(at, s)| s.values[*at])
                .sum()
        })
        .collect();
    let once_with_stack = mine.iter().any(|(at, s)| {
        s.values[*at] > 0
            && s.label("exception.type")
                == Some(&LabelValue::Str("System.TimeoutException".to_owned()))
            && s.stack_contains(&["Exceptions.ThrowOnce"])
    });
    (counts, once_with_stack)
}

/// The agent's exception windows in `out`, every one.
fn exception_windows(out: &Path) -> Vec<Profile> {
    fs::read_dir(out)
        .expect("the agent's output directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().contains(".exception."))
        .map(|p| read_profile(&p))
        .collect()
}

/// One agent and one `record -a` beside a .NET 8 and a .NET Core 3.1 app
/// at once (a `record -p` each): every recorder's per-type totals of each
/// app are within 1% of what it threw, the type thrown once included, with
/// its stack.
#[test]
fn exception_totals_by_type_are_exact_at_exit_on_net8_and_netcore31() {
    let env = Env::privileged();
    let dir = TempDir::new("exact-exceptions");
    let whole_host = dir.join("all.pb.gz");
    let log = dir.join("all.txt");
    let out = dir.join("windows");
    let agent = TestAgent::start_with_windows(&env, &dir, &out, &[]).wait_ready();
    let mut all = start_whole_host_recording(&env, &["-d", "20"], &whole_host, &log);
    // 20,000 + 500 + 1 over 3 s, no linger: the process exits right after
    // its last throw, before any later counter value. It waits 8 s first:
    // the agent looks for new .NET processes every 5 s (an idle one is
    // not sampled sooner).
    let runs: Vec<_> = [Runtime::Net8, Runtime::NetCore31]
        .into_iter()
        .map(|runtime| {
            let workload = TestProcess::start(
                &env,
                runtime,
                "Exceptions",
                &["8", "20000", "500", "1", "frequent", "x", "0", "3"],
                false,
            );
            let pid = workload.pid();
            let recorder = clrbpf_integration_tests::record_pid_in_background(
                pid,
                &[],
                "p.pb.gz",
                dir.join(&format!("p-{pid}.pb.gz")),
            );
            (runtime, workload, recorder)
        })
        .collect();
    let runs: Vec<_> = runs
        .into_iter()
        .map(|(runtime, workload, recorder)| {
            let pid = workload.pid();
            let (status, lines) = workload.wait(TIMEOUT);
            assert!(status.success(), "{runtime:?}: workload failed: {lines:?}");
            let thrown: Vec<i64> = EXCEPTIONS_WORKLOAD_TYPES
                .iter()
                .map(|ty| {
                    parse_value(&lines, &format!("THROWN_{ty}"))
                        .unwrap_or_else(|| panic!("{runtime:?}: no THROWN_{ty} in {lines:?}"))
                })
                .collect();
            let (stderr, path) = recorder.join().expect("record -p");
            (runtime, pid, thrown, stderr, path)
        })
        .collect();
    let status = all.wait().expect("wait for record -a");
    let all_stderr = fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "record -a failed:\n{all_stderr}");
    // The agent has seen the exits by now; SIGTERM flushes its last window.
    let agent_log = agent.stop();
    let whole_host = read_profile(&whole_host);
    let windows = exception_windows(&out);
    for (runtime, pid, thrown, stderr, path) in runs {
        for (mode, profiles, stderr) in [
            ("record -p", vec![read_profile(&path)], &stderr),
            ("record -a", vec![whole_host.clone()], &all_stderr),
            ("the agent's directory sink", windows.clone(), &agent_log),
        ] {
            let (counts, once_with_stack) = by_type(&profiles, pid);
            eprintln!("{runtime:?}, {mode}: thrown {thrown:?}, in the profile {counts:?}");
            for ((ty, &want), &got) in EXCEPTIONS_WORKLOAD_TYPES.iter().zip(&thrown).zip(&counts) {
                assert!(
                    (got - want).abs() as f64 <= 0.01 * want as f64,
                    "{runtime:?}, {mode}: {got} {ty} of {want} thrown\n{stderr}"
                );
            }
            assert!(
                once_with_stack,
                "{runtime:?}, {mode}: no TimeoutException with Exceptions.ThrowOnce on its stack\n{stderr}"
            );
        }
    }
}
