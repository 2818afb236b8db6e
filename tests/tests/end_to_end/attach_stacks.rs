//! Whole stacks right after a whole-host attach, for JIT-compiled frameless
//! leaves (issue 34, item 2): `record -a` started 2 s after a .NET 8 app
//! whose hot method, `DictHot.Churn`, spends its time in
//! `Dictionary<int,long>`'s `FindValue` and `TryInsert`. That code is
//! JIT-compiled and re-jitted at tier 1 without an rbp frame, so a
//! frame-pointer walk of a sample in it goes from the leaf straight to
//! `Main` and loses `Churn`; only the app's JIT table gives the walk the
//! rows that keep it. Every sample of the app's main thread under a
//! `Dictionary` frame must carry `Churn`, from the first sample: whole
//! host as root, as a non-root user, in a container, and under the Helm
//! chart's capabilities.
//! Real perf_event programs and real .NET 8 processes; run by
//! `cargo xtask test` (root, one test at a time).

use std::{thread, time::Duration};

use clrbpf_integration_tests::{
    ContainerTarget, Env, Launch, Runtime, TempDir, TestProcess, assert_success,
    chart_capabilities, read_profile, run_clrbpf, run_clrbpf_with_capabilities, samples,
    value_index,
};

/// How long the app runs before the recording starts: its hot code is
/// compiled at tier 1 by then, as in a service that has been up a while.
const BEFORE_ATTACH: Duration = Duration::from_secs(2);
/// The app's lifetime, in seconds: longer than the wait, the recording's
/// start and its 5 s.
const APP_SECONDS: &str = "30";
const TIMEOUT: Duration = Duration::from_secs(120);
/// Share of the main thread's CPU under `Dictionary` that must carry the
/// hot method.
const MIN_SHARE: f64 = 0.98;
/// Samples of the main thread under `Dictionary` a run must have (5 s at
/// 19 Hz a CPU is ~95; a saturated host gives the app less).
const MIN_SAMPLES: i64 = 30;

/// `record -a -d 5` of the whole host, as `capabilities` allow (all, for
/// `None`), 2 s after `pid` started; then the check on `pid`'s stacks.
fn record_and_check(env: &Env, label: &str, pid: u32, capabilities: Option<&[String]>) {
    thread::sleep(BEFORE_ATTACH);
    let dir = TempDir::new(&format!("attach-stacks-{label}"));
    let path = dir.join("host.pb.gz");
    let args = [
        "record".to_owned(),
        "-a".to_owned(),
        "-v".to_owned(),
        "-d".to_owned(),
        "5".to_owned(),
        "-o".to_owned(),
        path.to_string_lossy().into_owned(),
    ];
    let output = match capabilities {
        None => run_clrbpf(env, &args, dir.path(), TIMEOUT),
        Some(capabilities) => {
            run_clrbpf_with_capabilities(env, capabilities, &args, dir.path(), TIMEOUT)
        }
    };
    assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let profile = read_profile(&path);
    let cpu = value_index(&profile, "cpu/nanoseconds");
    let all = samples(&profile);
    // The main thread (its tid is the pid) under the dictionary's code:
    // the runtime's own threads never run it.
    let in_dictionary: Vec<_> = all
        .iter()
        .filter(|s| {
            s.values[cpu] > 0
                && s.pid() == Some(pid)
                && s.label_num("thread.id") == Some(i64::from(pid))
                && s.frames.iter().any(|f| f.contains("Dictionary"))
        })
        .collect();
    // CPU time: one sample is a period's worth.
    let cpu_of = |whole: bool| -> i64 {
        in_dictionary
            .iter()
            .filter(|s| s.stack_contains(&["DictHot.Churn"]) == whole)
            .map(|s| s.values[cpu])
            .sum()
    };
    let (whole, total) = (cpu_of(true), cpu_of(true) + cpu_of(false));
    let share = whole as f64 / total.max(1) as f64;
    let period = profile.period.max(1);
    let examples = in_dictionary
        .iter()
        .filter(|s| !s.stack_contains(&["DictHot.Churn"]))
        .take(3)
        .map(|s| format!("  {}", s.frames.join(" <- ")))
        .collect::<Vec<_>>()
        .join("\n");
    eprintln!(
        "{label}: {} of {} samples under Dictionary carry DictHot.Churn ({:.2}%)",
        whole / period,
        total / period,
        share * 100.0
    );
    assert!(
        total / period >= MIN_SAMPLES,
        "{label}: only {} samples of pid {pid}'s main thread under Dictionary:\n{stderr}",
        total / period
    );
    assert!(
        share >= MIN_SHARE,
        "{label}: DictHot.Churn is on {:.2}% of {} samples under Dictionary; without it:\n{examples}\n{stderr}",
        share * 100.0,
        total / period
    );
}

#[test]
fn whole_host_attach_keeps_the_callers_of_frameless_jit_leaves() {
    let env = Env::privileged();
    let app = TestProcess::start(&env, Runtime::Net8, "DictHot", &[APP_SECONDS], false);
    record_and_check(&env, "root", app.pid(), None);
}

#[test]
fn whole_host_attach_keeps_the_callers_of_frameless_jit_leaves_of_a_non_root_app() {
    let env = Env::privileged();
    let launch = Launch {
        user: Some(1000),
        ..Launch::default()
    };
    let app = TestProcess::launch(&env, Runtime::Net8, "DictHot", &[APP_SECONDS], &launch);
    record_and_check(&env, "non-root", app.pid(), None);
}

#[test]
fn whole_host_attach_keeps_the_callers_of_frameless_jit_leaves_in_a_container() {
    let env = Env::privileged();
    let target = ContainerTarget::start(&env, Runtime::Net8, "DictHot", &[APP_SECONDS], 1000);
    record_and_check(&env, "container", target.pid(), None);
}

#[test]
fn whole_host_attach_keeps_the_callers_of_frameless_jit_leaves_under_the_charts_capabilities() {
    let env = Env::privileged();
    let target = ContainerTarget::start(&env, Runtime::Net8, "DictHot", &[APP_SECONDS], 1000);
    let capabilities = chart_capabilities();
    record_and_check(&env, "chart", target.pid(), Some(&capabilities));
}
