//! The `Garbage Collector` root end to end: a real .NET 8 workload with
//! server and background GC (`GcHeavy`, whose runtimeconfig turns both on),
//! recorded by `clrbpf record`, read back from the pprof file. Run by
//! `cargo xtask test` (root, one test at a time).
//!
//! Only .NET 8: .NET Core 3.1 names none of its threads on Linux (all are
//! `dotnet`), so its GC threads cannot be recognised.

use std::{fs, path::PathBuf, time::Duration};

use clrbpf_integration_tests::{
    Env, LabelValue, Runtime, SampleView, TempDir, assert_success, parse_value_in, read_profile,
    run_clrbpf, samples, value_index,
};

/// Generous: the run lasts seconds, but a loaded CI machine starts .NET slowly.
const TIMEOUT: Duration = Duration::from_secs(120);

const GC_ROOT: &str = "Garbage Collector";
const GC_THREADS: [&str; 2] = [".NET Server GC", ".NET BGC"];

/// Removes the perf files of the workload when dropped.
struct PerfMapFiles(u32);

impl Drop for PerfMapFiles {
    fn drop(&mut self) {
        let _ = fs::remove_file(PathBuf::from(format!("/tmp/perf-{}.map", self.0)));
        let _ = fs::remove_file(PathBuf::from(format!("/tmp/jit-{}.dump", self.0)));
    }
}

#[test]
fn gc_thread_samples_are_rooted_in_garbage_collector() {
    let env = Env::privileged();
    let dir = TempDir::new("gc");
    let output_path = dir.join("p.pb.gz");
    let mut args: Vec<String> = vec![
        "record".into(),
        "-F".into(),
        "499".into(),
        "-o".into(),
        output_path.to_string_lossy().into_owned(),
        "--".into(),
    ];
    args.extend(env.workload_command(Runtime::Net8, "GcHeavy", &["6"]));
    let output = run_clrbpf(&env, &args, dir.path(), TIMEOUT);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let pid: Option<u32> = parse_value_in(&stdout, "PID");
    let _files = pid.map(PerfMapFiles);
    assert_success(&output);
    let pid = pid.unwrap_or_else(|| panic!("GcHeavy printed no PID line; stdout:\n{stdout}"));
    assert!(
        stdout.contains("SERVER_GC True"),
        "GcHeavy did not run with server GC: its runtimeconfig lacks System.GC.Server; stdout:\n{stdout}"
    );

    let profile = read_profile(&output_path);
    let cpu = value_index(&profile, "cpu/nanoseconds");
    let all = samples(&profile);
    // CPU samples only: a CLR event's sample has no thread.name (the
    // runtime gives only the thread id), and the runtime may report a
    // contention of its own while clrbpf's sessions start.
    let of_child: Vec<_> = all
        .iter()
        .filter(|s| s.pid() == Some(pid) && s.values[cpu] > 0)
        .collect();
    assert!(!of_child.is_empty(), "no CPU sample has process.pid {pid}");

    let thread_name = |s: &SampleView| match s.label("thread.name") {
        Some(LabelValue::Str(name)) => name.clone(),
        other => panic!("a sample of pid {pid} has thread.name {other:?}"),
    };
    let (mut gc_cpu, mut total_cpu) = (0i64, 0i64);
    let mut gc_samples_per_thread = [0usize; GC_THREADS.len()];
    let mut allocating_samples = 0usize;
    for sample in &of_child {
        let name = thread_name(sample);
        let value = sample.values[cpu];
        total_cpu += value;
        let rooted = sample.frames.last().is_some_and(|f| f == GC_ROOT);
        let mentions_root = sample.frames.iter().any(|f| f == GC_ROOT);
        if let Some(i) = GC_THREADS.iter().position(|t| *t == name) {
            assert!(
                rooted,
                "a sample of GC thread `{name}` is not rooted in {GC_ROOT}: {:?}",
                sample.frames
            );
            assert_eq!(
                sample.frames.iter().filter(|f| *f == GC_ROOT).count(),
                1,
                "{GC_ROOT} appears more than once: {:?}",
                sample.frames
            );
            gc_samples_per_thread[i] += 1;
            gc_cpu += value;
        } else {
            assert!(
                !mentions_root,
                "a sample of thread `{name}` has a {GC_ROOT} frame: {:?}",
                sample.frames
            );
            if name.starts_with("gcheavy-") {
                allocating_samples += 1;
            }
        }
    }
    for (thread, n) in GC_THREADS.iter().zip(gc_samples_per_thread) {
        assert!(
            n >= 10,
            "only {n} samples of `{thread}` threads: the workload's collections did not run there"
        );
    }
    assert!(
        allocating_samples >= 100,
        "only {allocating_samples} samples of the allocating threads gcheavy-N"
    );
    let share = gc_cpu as f64 / total_cpu as f64;
    eprintln!(
        "{GC_ROOT}: {:.1}% of pid {pid}'s CPU; samples per GC thread kind {GC_THREADS:?}: {gc_samples_per_thread:?}; {allocating_samples} samples of gcheavy-N",
        share * 100.0
    );
    // The workload induces a full collection every 100 ms over a large live
    // set: its GC threads take most of its CPU (over 60% on the 2-core CI machine).
    assert!(
        share >= 0.20,
        "{GC_ROOT} holds {:.1}% of pid {pid}'s CPU; expected at least 20%",
        share * 100.0
    );
}
