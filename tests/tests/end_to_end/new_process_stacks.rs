//! Whole stacks from the first sample for processes that start while a
//! whole-host recording runs (issue 25, part 2): until a new process's
//! unwind tables are in the kernel, its on-CPU samples carry a copy of the
//! user stack, which clrbpf unwinds once the tables exist. The workload
//! spends its whole life (about a second) in managed code calling glibc's
//! `qsort` (no frame pointers) with a managed comparer: a frame-pointer
//! walk stops in glibc and loses `Qsort.SortMany` and what calls it.
//! clrbpf holds the app's tables back for its first 0.9 s (a hidden
//! option), as a cold cache or a busy unwind worker does (1-2 s for a new
//! .NET process then): without the copies, most samples of the sort lose
//! their callers.
//! Real perf_event programs and real .NET 8 processes; run by
//! `cargo xtask test` (root, one test at a time).

use std::{fs, thread, time::Duration};

use clrbpf_integration_tests::{
    Env, Runtime, TempDir, TestProcess, read_profile, samples, start_whole_host_recording,
};

/// Apps started one after the other during the recording.
const APPS: usize = 3;
/// How long each sorts, in seconds: with the runtime's start, its first
/// second and a half.
const SORT_SECONDS: &str = "1.2";
/// Leaf to root, the chain a whole stack of the sort has: glibc's sort,
/// `qsort` (`__GI___qsort_r`), the managed caller, and the host's entry
/// point, so the stack goes all the way down (`Main` itself shows as a
/// second `SortMany` frame, named as the existing qsort test names it).
const WHOLE_CHAIN: [&str; 4] = ["msort_with_tmp", "qsort", "Qsort.SortMany", "corehost_main"];
/// Samples of the sort the apps must have in all: each sorts for a
/// second of wall time, but a saturated host gives it less CPU.
const MIN_SORT_SAMPLES: i64 = 30;

#[test]
fn a_process_started_during_a_whole_host_recording_keeps_its_first_stacks_whole() {
    let env = Env::privileged();
    let dir = TempDir::new("new-process-stacks");
    let out = dir.join("new.pb.gz");
    let log = dir.join("stderr.txt");
    let mut clrbpf = start_whole_host_recording(
        &env,
        &[
            // Room for every table of a busy host (other tests' processes
            // too): evictions under the cap walk a table's users by frame
            // pointer, another limit than the one tested here.
            "--unwind-table-memory-mb",
            "512",
            // A new process's tables come within ~100 ms on a warm host,
            // before the app's sort starts: hold them back for the app's
            // first 0.9 s, as a cold cache or a busy worker does, so that
            // the start of the sort runs without them.
            "--hold-new-processes-ms",
            "900",
            // Every process other tests start meanwhile is held back too
            // and copies its stacks: room for them in the budget.
            "--stack-copy-kib-per-second",
            "32768",
            "-d",
            "20",
        ],
        &out,
        &log,
    );
    // The processes running at the start that sampling did not wait for
    // are indexed right after it starts: the apps come after them, so
    // that what holds their tables back is the hold alone.
    thread::sleep(Duration::from_secs(5));
    let mut pids = Vec::new();
    for _ in 0..APPS {
        let app = TestProcess::start(&env, Runtime::Net8, "Qsort", &[SORT_SECONDS], false);
        pids.push(app.pid());
        let (status, _) = app.wait(Duration::from_secs(30));
        assert!(status.success(), "Qsort exited with {status}");
    }
    let status = clrbpf.wait().expect("wait for clrbpf");
    let stderr = fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "clrbpf failed:\n{stderr}");
    let summary: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("stack copies") || l.contains("unwind tables"))
        .collect();
    eprintln!("{}", summary.join("\n"));

    let profile = read_profile(&out);
    let all = samples(&profile);
    let (mut sorted, mut whole) = (0, 0);
    for &pid in &pids {
        // Samples of the sort: in glibc's merge sort, or in the comparer
        // it calls.
        let in_sort: Vec<_> = all
            .iter()
            .filter(|s| s.pid() == Some(pid) && s.stack_contains(&["msort_with_tmp"]))
            .collect();
        let weight = |s: &&clrbpf_integration_tests::SampleView| s.values[0];
        let app_sorted: i64 = in_sort.iter().map(weight).sum();
        let app_whole: i64 = in_sort
            .iter()
            .filter(|s| s.stack_contains(&WHOLE_CHAIN))
            .map(weight)
            .sum();
        let broken = in_sort
            .iter()
            .filter(|s| !s.stack_contains(&WHOLE_CHAIN))
            .take(3)
            .map(|s| format!("  {}", s.frames.join(" <- ")))
            .collect::<Vec<_>>()
            .join("\n");
        eprintln!(
            "pid {pid}: {app_whole} of {app_sorted} samples of the sort carry the whole chain{}",
            if broken.is_empty() {
                String::new()
            } else {
                format!("; without it:\n{broken}")
            }
        );
        assert!(
            app_sorted >= MIN_SORT_SAMPLES / APPS as i64 / 2,
            "pid {pid}: only {app_sorted} samples of the sort"
        );
        sorted += app_sorted;
        whole += app_whole;
    }
    assert!(
        sorted >= MIN_SORT_SAMPLES,
        "only {sorted} samples of the sort in {APPS} apps:\n{stderr}"
    );
    let share = whole as f64 / sorted as f64;
    assert!(
        share >= 0.95,
        "only {whole} of {sorted} samples of the sort ({:.1}%) carry {WHOLE_CHAIN:?}:\n{}",
        share * 100.0,
        summary.join("\n")
    );
}
