//! Whole stacks from the first sample (issue 25): a recording attached to a
//! running .NET 8 process loads the process's unwind tables before it takes
//! a sample, so the first waits of threads blocked under frameless
//! ReadyToRun framework code keep the user method that called it. Before,
//! the waits of the first second after the attach were walked by frame
//! pointers and lost it (about 7.6% of a thread's off-CPU time).
//! Real `sched_switch` programs and real .NET processes; run by
//! `cargo xtask test` (root, one test at a time).

use std::{collections::HashMap, path::Path, time::Duration};

use clrbpf_integration_tests::{
    Env, Runtime, SampleView, TempDir, TestProcess, read_profile, record_pid, samples, value_index,
};

/// Recordings, each attached to a new process.
const RUNS: usize = 3;
/// The workload's wait timeout, in milliseconds.
const WAIT_MS: &str = "300";

/// Each waiting thread's name in the workload's `TID` lines, and its user
/// method.
const THREADS: [(&str, &str); 5] = [
    ("mres", "Waits.WaitMres"),
    ("semaphore", "Waits.WaitSemaphore"),
    ("task", "Waits.WaitTask"),
    ("take", "Waits.WaitTake"),
    ("join", "Waits.WaitJoin"),
];

/// The thread ids the workload printed (`TID name tid`).
fn thread_ids(lines: &[String]) -> HashMap<String, i64> {
    lines
        .iter()
        .filter_map(|line| {
            let mut fields = line.strip_prefix("TID ")?.split_whitespace();
            Some((fields.next()?.to_owned(), fields.next()?.parse().ok()?))
        })
        .collect()
}

/// The count the summary gives of user stacks walked by frame pointers
/// because their process was not indexed yet.
fn walked_before_indexed(stderr: &str) -> Option<u64> {
    let line = stderr
        .lines()
        .find(|l| l.contains("user stacks walked with them"))?;
    let before = line
        .split(" by frame pointers (process not indexed yet)")
        .next()?;
    before.rsplit(' ').next()?.parse().ok()
}

/// One attach: `record --off-cpu -p PID -d 8` of a new Waits process; every
/// waiting thread's user method holds at least 99% of its off-CPU time.
fn attach_once(env: &Env, run: usize) {
    let app = TestProcess::start(env, Runtime::Net8, "Waits", &["60", WAIT_MS], false);
    let tids = thread_ids(&app.lines());
    assert_eq!(tids.len(), THREADS.len(), "the workload printed {tids:?}");
    let dir = TempDir::new(&format!("first-stacks-{run}"));
    let (output, path) = record_pid(
        env,
        &dir,
        app.pid(),
        // -v: the unwind-table line is one of clrbpf's own figures.
        &["-v", "--off-cpu", "-d", "8"],
        "waits.pb.gz",
    );

    let profile = read_profile(&path);
    let off_cpu = value_index(&profile, "off_cpu/nanoseconds");
    let all = samples(&profile);
    for (thread, method) in THREADS {
        let tid = tids[thread];
        let waits: Vec<&SampleView> = all
            .iter()
            .filter(|s| s.values[off_cpu] > 0 && s.label_num("thread.id") == Some(tid))
            .collect();
        let total: i64 = waits.iter().map(|s| s.values[off_cpu]).sum();
        let on_method: i64 = waits
            .iter()
            .filter(|s| s.stack_contains(&[method]))
            .map(|s| s.values[off_cpu])
            .sum();
        let share = on_method as f64 / total.max(1) as f64;
        let without = waits
            .iter()
            .filter(|s| !s.stack_contains(&[method]))
            .take(3)
            .map(|s| format!("  {} {}", s.values[off_cpu], s.frames.join(" <- ")))
            .collect::<Vec<_>>()
            .join("\n");
        eprintln!(
            "run {run} {thread}: {:.2}% of {:.1} ms off-CPU on {method}",
            share * 100.0,
            total as f64 / 1e6
        );
        assert!(
            total > 5_000_000_000,
            "run {run} {thread}: only {:.1} ms off-CPU in 8 s",
            total as f64 / 1e6
        );
        assert!(
            share >= 0.99,
            "run {run} {thread}: {method} is on {:.2}% of its {:.1} ms off-CPU; without it:\n{without}",
            share * 100.0,
            total as f64 / 1e6
        );
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        walked_before_indexed(&stderr),
        Some(0),
        "run {run}: user stacks of the -p process were walked before its tables were loaded:\n{stderr}"
    );
}

#[test]
fn attached_recording_keeps_the_user_method_from_the_first_wait() {
    let env = Env::privileged();
    for run in 1..=RUNS {
        attach_once(&env, run);
    }
}

/// Two recordings of one process: the runtime keeps one perf map state per
/// process, so when the shorter one ends it turns perf maps off for both and
/// removes the files both read. The longer one must turn them on again (a
/// read after the removal found nothing, and a whole recording had no
/// managed name when that read was its first), and still name the user
/// methods from the files it reads after.
#[test]
fn a_recording_turns_perf_maps_on_again_when_another_recording_removes_them() {
    let env = Env::privileged();
    let app = TestProcess::start(&env, Runtime::Net8, "Waits", &["60", WAIT_MS], false);
    let pid = app.pid();
    let jitdump = format!("/tmp/jit-{pid}.dump");
    let long_dir = TempDir::new("first-stacks-long");
    let short_dir = TempDir::new("first-stacks-short");
    let (long, back_after_short) = std::thread::scope(|scope| {
        let long = scope.spawn(|| {
            record_pid(
                &env,
                &long_dir,
                pid,
                &["--off-cpu", "-d", "8"],
                "long.pb.gz",
            )
        });
        std::thread::sleep(Duration::from_secs(2));
        let (short, _) = record_pid(&env, &short_dir, pid, &["-d", "1"], "short.pb.gz");
        assert!(
            String::from_utf8_lossy(&short.stderr).contains("turned perf maps on and off again"),
            "the short recording did not attach:\n{}",
            String::from_utf8_lossy(&short.stderr)
        );
        // The long recording reads its files every 100 ms or so.
        std::thread::sleep(Duration::from_millis(1500));
        let back = Path::new(&jitdump).exists();
        (long.join().expect("the long recording"), back)
    });
    let (output, path) = long;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        back_after_short,
        "{jitdump} was still gone 1.5 s after the short recording ended:\n{stderr}"
    );
    assert!(
        stderr.contains(&format!("pid {pid}: its perf files were gone")),
        "the long recording did not report turning perf maps on again:\n{stderr}"
    );
    let profile = read_profile(&path);
    let all = samples(&profile);
    let named = all.iter().any(|s| s.stack_contains(&["Waits.WaitMres"]));
    assert!(named, "no stack names Waits.WaitMres:\n{stderr}");
}
