//! CLR events in `clrbpf record`: lock contention and exceptions from a real
//! runtime's EventPipe session, checked against what the workloads measured
//! themselves. Run by `cargo xtask test` (root, one test at a time).

use std::{process::Command, time::Duration};

use clrbpf_integration_tests::{
    EXCEPTIONS_WORKLOAD_TYPES, Env, LabelValue, Launch, Runtime, TempDir, TestProcess,
    assert_success, exceptions_counted, exceptions_thrown, go_pprof_top, number_before,
    parse_value, read_profile, record_pid, run_clrbpf, sample_types, samples, value_index,
};

const TIMEOUT: Duration = Duration::from_secs(120);
/// How long the workloads wait before the measured part, so that clrbpf has
/// attached and started its session.
const START_DELAY_S: &str = "4";

/// `record -p PID` of a Contention workload; returns (profile path, the
/// workload's own total wait, in ns).
fn record_contention(env: &Env, runtime: Runtime, dir: &TempDir) -> (std::path::PathBuf, i64) {
    let workload = TestProcess::start(
        env,
        runtime,
        "Contention",
        &[START_DELAY_S, "4", "20", "25"],
        false,
    );
    let (_, output_path) = record_pid(env, dir, workload.pid(), &[], "contention.pb.gz");
    let (status, lines) = workload.wait(TIMEOUT);
    assert!(status.success(), "workload failed: {lines:?}");
    let waited: i64 =
        parse_value(&lines, "WAITED_NS").unwrap_or_else(|| panic!("no WAITED_NS in {lines:?}"));
    (output_path, waited)
}

fn assert_contention_matches(runtime: Runtime) {
    let env = Env::privileged();
    let dir = TempDir::new("contention");
    let (path, waited_ns) = record_contention(&env, runtime, &dir);
    let profile = read_profile(&path);
    assert_eq!(
        sample_types(&profile),
        [
            "samples/count",
            "cpu/nanoseconds",
            "contentions/count",
            "delay/nanoseconds",
            "exceptions/count",
            "waits/count",
            "wait_delay/nanoseconds"
        ]
    );
    let delay = value_index(&profile, "delay/nanoseconds");
    let contentions = value_index(&profile, "contentions/count");
    let all = samples(&profile);
    let on_waiter: i64 = all
        .iter()
        .filter(|s| s.stack_contains(&["Contention.WaitForGate"]))
        .map(|s| s.values[delay])
        .sum();
    let total: i64 = all.iter().map(|s| s.values[delay]).sum();
    let count: i64 = all.iter().map(|s| s.values[contentions]).sum();
    assert!(count > 0, "no contention recorded");
    let error = (on_waiter - waited_ns).abs() as f64 / waited_ns as f64;
    assert!(
        error <= 0.15,
        "delay on Contention.WaitForGate {on_waiter} ns, workload measured {waited_ns} ns ({:.1}% off; total delay {total} ns over {count} contentions)",
        error * 100.0
    );
    let top = Command::new("go")
        .args(["tool", "pprof", "-sample_index=delay", "-top"])
        .arg(&path)
        .output()
        .expect("run go tool pprof");
    let text = String::from_utf8_lossy(&top.stdout);
    assert!(top.status.success(), "go tool pprof failed: {text}");
    assert!(
        text.contains("Contention.WaitForGate"),
        "pprof -sample_index=delay -top does not show the waiting method:\n{text}"
    );
}

#[test]
fn net8_contention_delay_matches_the_waiting_threads() {
    assert_contention_matches(Runtime::Net8);
}

#[test]
fn netcore31_contention_delay_matches_the_waiting_threads() {
    assert_contention_matches(Runtime::NetCore31);
}

/// A .NET 8 app in a PID namespace of its own, as in a container: its
/// runtime reports the thread ids of that namespace. Contention samples
/// carry the host's ids (those of its CPU samples) and the thread's name,
/// and a lock owner's id is a host thread of the app too.
#[test]
fn contention_in_a_pid_namespace_carries_host_thread_ids_and_names() {
    let env = Env::privileged();
    let dir = TempDir::new("contention-pidns");
    let workload = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Contention",
        &[START_DELAY_S, "4", "20", "25"],
        &Launch {
            pid_in_namespace: Some(500),
            ..Launch::default()
        },
    );
    let pid = workload.pid();
    // The app's host thread ids, gathered while it runs.
    let watcher = std::thread::spawn(move || {
        let mut tids = std::collections::HashSet::new();
        while let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            tids.extend(
                tasks
                    .flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<i64>().ok()),
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        tids
    });
    let (_, path) = record_pid(&env, &dir, pid, &[], "contention.pb.gz");
    let (status, lines) = workload.wait(TIMEOUT);
    assert!(status.success(), "workload failed: {lines:?}");
    let host_tids = watcher.join().expect("watcher");
    let profile = read_profile(&path);
    let contentions = value_index(&profile, "contentions/count");
    let contended: Vec<_> = samples(&profile)
        .into_iter()
        .filter(|s| s.values[contentions] > 0)
        .collect();
    assert!(!contended.is_empty(), "no contention recorded");
    for sample in &contended {
        let tid = sample.label_num("thread.id");
        assert!(
            tid.is_some_and(|tid| host_tids.contains(&tid)),
            "contention sample with thread.id {tid:?}, not one of the app's host threads {host_tids:?}"
        );
        assert!(
            matches!(sample.label("thread.name"), Some(LabelValue::Str(name)) if !name.is_empty()),
            "contention sample of thread {tid:?} without thread.name"
        );
        if let Some(owner) = sample.label_num("lock.owner.thread.id") {
            assert!(
                host_tids.contains(&owner),
                "lock.owner.thread.id {owner} is not one of the app's host threads {host_tids:?}"
            );
        }
    }
    assert!(
        contended
            .iter()
            .any(|s| s.label_num("lock.owner.thread.id").is_some()),
        "no contention sample names the lock's owner"
    );
}

#[test]
fn net8_exception_counts_are_upscaled_per_type() {
    let env = Env::privileged();
    let dir = TempDir::new("exceptions");
    let workload = TestProcess::start(
        &env,
        Runtime::Net8,
        "Exceptions",
        &[START_DELAY_S, "20000", "300", "1"],
        false,
    );
    // Every event: the per-type upscaling of the sampler alone (the budget,
    // on by default, has its own tests below).
    let (output, _) = record_pid(
        &env,
        &dir,
        workload.pid(),
        &["--split", "--exceptions-per-second", "0"],
        "exceptions.pb.gz",
    );
    let (status, lines) = workload.wait(TIMEOUT);
    assert!(status.success(), "workload failed: {lines:?}");
    for kind in ["cpu", "contention"] {
        let part = dir.join(&format!("exceptions.{kind}.pb.gz"));
        assert!(part.exists(), "--split did not write {}", part.display());
    }
    let path = dir.join("exceptions.exceptions.pb.gz");
    let profile = read_profile(&path);
    assert_eq!(sample_types(&profile), ["exceptions/count"]);
    let all = samples(&profile);
    let mut sampled = 0usize;
    for ty in EXCEPTIONS_WORKLOAD_TYPES {
        let thrown: i64 = parse_value(&lines, &format!("THROWN_{ty}"))
            .unwrap_or_else(|| panic!("no THROWN_{ty} in {lines:?}"));
        let of_type: Vec<_> = all
            .iter()
            .filter(|s| s.label("exception.type") == Some(&LabelValue::Str(ty.to_owned())))
            .collect();
        sampled += of_type.len();
        let counted: i64 = of_type.iter().map(|s| s.values[0]).sum();
        let error = (counted - thrown).abs() as f64 / thrown as f64;
        assert!(
            error <= 0.10,
            "{ty}: profile says {counted}, the workload threw {thrown}"
        );
        assert!(
            of_type
                .iter()
                .any(|s| s.frames.iter().any(|f| f.contains("Exceptions.Throw"))),
            "{ty}: no sample names a throwing method of the workload"
        );
    }
    // Sampled, not every exception kept: aggregated samples are far fewer.
    assert!(sampled < 5000, "{sampled} distinct exception samples");
    let top = go_pprof_top(&path);
    assert!(top.contains("Exceptions.Throw"), "{top}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("20301 exceptions thrown"),
        "the summary lacks the exact count:\n{stderr}"
    );
}

/// An exception storm under `--exceptions-per-second`: the exception
/// events go off over the budget, and the runtime's counter keeps the
/// totals exact (to the exception) while the events taken before give the
/// stacks and types.
fn assert_storm_under_a_budget(runtime: Runtime) {
    let env = Env::privileged();
    let dir = TempDir::new(&format!("exception-budget-{runtime:?}"));
    let workload = TestProcess::start(
        &env,
        runtime,
        "Exceptions",
        &[START_DELAY_S, "200000", "300", "1"],
        false,
    );
    let (output, path) = record_pid(
        &env,
        &dir,
        workload.pid(),
        &["--exceptions-per-second", "100"],
        "storm.pb.gz",
    );
    let (status, lines) = workload.wait(TIMEOUT);
    assert!(status.success(), "workload failed: {lines:?}");
    let thrown = exceptions_thrown(&lines);
    // The runtime's own exceptions are in its counter too.
    let counted = exceptions_counted(&lines);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .find(|l| l.contains("exceptions thrown"))
        .unwrap_or_else(|| panic!("no exception totals in the summary:\n{stderr}"));
    let summed = number_before(line, "exceptions thrown (") as i64;
    assert!(
        counted.contains(&summed),
        "the process saw {counted:?} exceptions: {line}"
    );
    assert!(
        line.contains("while their stacks were off over the budget"),
        "the events were never turned off: {line}"
    );

    let profile = read_profile(&path);
    let at = value_index(&profile, "exceptions/count");
    let all = samples(&profile);
    let total: i64 = all.iter().map(|s| s.values[at]).sum();
    assert_eq!(
        total, summed,
        "the profile's exceptions against the summary's"
    );
    let frequent: i64 = all
        .iter()
        .filter(|s| {
            s.label("exception.type")
                == Some(&LabelValue::Str(
                    "System.InvalidOperationException".to_owned(),
                ))
                && s.stack_contains(&["Exceptions.ThrowFrequent"])
        })
        .map(|s| s.values[at])
        .sum();
    assert!(
        frequent as f64 >= 0.95 * thrown as f64,
        "InvalidOperationException from Exceptions.ThrowFrequent: {frequent} of {thrown}"
    );
}

#[test]
fn net8_exception_storm_under_a_budget_keeps_exact_totals() {
    assert_storm_under_a_budget(Runtime::Net8);
}

#[test]
fn netcore31_exception_storm_under_a_budget_keeps_exact_totals() {
    assert_storm_under_a_budget(Runtime::NetCore31);
}

#[test]
fn no_clr_events_gives_cpu_sample_types_only() {
    let env = Env::privileged();
    let dir = TempDir::new("no-clr-events");
    let workload = TestProcess::start(&env, Runtime::Net8, "Hot", &["3"], false);
    let (_, output_path) = record_pid(&env, &dir, workload.pid(), &["--no-clr-events"], "p.pb.gz");
    let profile = read_profile(&output_path);
    assert_eq!(sample_types(&profile), ["samples/count", "cpu/nanoseconds"]);
}

#[test]
fn diagnostics_disabled_warns_and_profiles_the_cpu() {
    let env = Env::privileged();
    let dir = TempDir::new("diagnostics-disabled");
    let dotnet = env.dotnet(Runtime::Net8).to_path_buf();
    let workload = env.workload(Runtime::Net8, "Hot");
    let output_path = dir.join("p.pb.gz");
    let mut args = vec![
        "record".to_owned(),
        "-o".to_owned(),
        output_path.to_string_lossy().into_owned(),
        "--".to_owned(),
        "env".to_owned(),
        "DOTNET_EnableDiagnostics=0".to_owned(),
    ];
    args.push(dotnet.to_string_lossy().into_owned());
    args.push(workload.to_string_lossy().into_owned());
    args.push("12".to_owned());
    let output = run_clrbpf(&env, &args, dir.path(), TIMEOUT);
    assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no CLR events"),
        "no warning about the missing diagnostic socket:\n{stderr}"
    );
    let profile = read_profile(&output_path);
    let cpu = value_index(&profile, "cpu/nanoseconds");
    let on_spin: i64 = samples(&profile)
        .iter()
        .filter(|s| s.stack_contains(&["Hot.Spin"]))
        .map(|s| s.values[cpu])
        .sum();
    assert!(on_spin > 0, "no CPU on Hot.Spin");
}

#[test]
fn netcore31_attach_names_methods_compiled_before_it() {
    let env = Env::privileged();
    let dir = TempDir::new("netcore31-attach");
    // No DOTNET_PerfMapEnabled: only the method rundown can name Hot.Spin,
    // compiled long before clrbpf attaches.
    let hot = TestProcess::start(&env, Runtime::NetCore31, "Hot", &["60"], false);
    std::thread::sleep(Duration::from_secs(1));
    let (_, output_path) = record_pid(&env, &dir, hot.pid(), &["-d", "3"], "p.pb.gz");
    let profile = read_profile(&output_path);
    clrbpf_integration_tests::assert_some_stack_contains(
        &profile,
        Some(hot.pid()),
        &["Hot.Spin", "Hot.Main"],
    );
}
