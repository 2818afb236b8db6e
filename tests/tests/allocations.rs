//! Allocation profiles in `clrbpf record --alloc`: the runtime's allocation
//! ticks with their stacks, from a real .NET 8 and .NET Core 3.1 process
//! that measures its own bytes per method (the `Allocs` workload), checked
//! through the `--split` allocation file and `go tool pprof`. Run by
//! `cargo xtask test` (root, one test at a time). .NET 10's
//! AllocationSampled cannot run here (no such runtime): unit tests only.

use std::time::Duration;

use clrbpf_integration_tests::{
    Env, LabelValue, Runtime, SampleView, TempDir, TestProcess, go_pprof_top, parse_value,
    read_profile, record_pid, sample_types, samples, string,
};

const TIMEOUT: Duration = Duration::from_secs(120);
/// How long the workload waits before it allocates, so that clrbpf has
/// attached and its sessions run.
const START_DELAY_S: &str = "4";
const ARRAYS: &str = "Allocs.AllocArrays";
const NODES: &str = "Allocs.AllocNodes";
const LARGE: &str = "Allocs.AllocLarge";

struct Recorded {
    samples: Vec<SampleView>,
    lines: Vec<String>,
    top: String,
    /// The summary's line of the workload's process.
    summary: String,
}

/// `record --alloc --split -p PID` of the Allocs workload (40 MB/s for 6 s).
fn record_allocs(runtime: Runtime, flags: &[&str]) -> Recorded {
    let env = Env::privileged();
    let dir = TempDir::new(&format!("allocations-{runtime:?}"));
    let workload = TestProcess::start(&env, runtime, "Allocs", &[START_DELAY_S, "6", "40"], false);
    let pid = workload.pid();
    let mut args = vec!["--alloc", "--split"];
    args.extend_from_slice(flags);
    let (output, _) = record_pid(&env, &dir, pid, &args, "allocs.pb.gz");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let summary = stderr
        .lines()
        .find(|l| l.contains(&format!("pid {pid} (")) && l.contains("MB allocated"))
        .unwrap_or_else(|| panic!("no allocation totals in the summary:\n{stderr}"))
        .to_owned();
    let (status, lines) = workload.wait(TIMEOUT);
    assert!(status.success(), "workload failed: {lines:?}");
    let path = dir.join("allocs.allocations.pb.gz");
    let profile = read_profile(&path);
    assert_eq!(
        sample_types(&profile),
        ["alloc_samples/count", "alloc_size/bytes"]
    );
    let period = profile.period_type.as_ref().expect("a period type");
    assert_eq!(
        (
            string(&profile, period.r#type),
            string(&profile, period.unit)
        ),
        ("space", "bytes"),
        "Pyroscope's memory profiles"
    );
    let top = go_pprof_top(&path);
    let samples = samples(&profile)
        .into_iter()
        .filter(|s| s.pid() == Some(pid))
        .collect();
    Recorded {
        samples,
        lines,
        top,
        summary,
    }
}

fn value(lines: &[String], key: &str) -> i64 {
    parse_value(lines, key).unwrap_or_else(|| panic!("no {key} in {lines:?}"))
}

/// (alloc_samples, alloc_size) of the samples whose stack holds `method`.
fn of_method(samples: &[SampleView], method: &str) -> (i64, i64) {
    samples
        .iter()
        .filter(|s| s.frames.iter().any(|f| f.contains(method)))
        .fold((0, 0), |(c, b), s| (c + s.values[0], b + s.values[1]))
}

fn types_of(samples: &[SampleView], method: &str) -> Vec<String> {
    let mut types: Vec<String> = samples
        .iter()
        .filter(|s| s.frames.iter().any(|f| f.contains(method)))
        .filter_map(|s| match s.label("allocation.type") {
            Some(LabelValue::Str(t)) => Some(t.clone()),
            _ => None,
        })
        .collect();
    types.sort();
    types.dedup();
    types
}

/// Returns the summary's line of the process.
fn assert_allocations(runtime: Runtime, flags: &[&str]) -> String {
    let Recorded {
        samples,
        lines,
        top,
        summary,
    } = record_allocs(runtime, flags);
    assert!(!samples.is_empty(), "no allocation sample of the workload");
    // Shares of the two small-object methods, against the workload's own
    // per-thread figures (.NET Core 3.1's leave the large object heap out).
    let (arrays, nodes) = (
        value(&lines, "BYTES_Allocs.AllocArrays"),
        value(&lines, "BYTES_Allocs.AllocNodes"),
    );
    let want = arrays as f64 / (arrays + nodes) as f64;
    let (arrays_count, arrays_bytes) = of_method(&samples, ARRAYS);
    let (nodes_count, nodes_bytes) = of_method(&samples, NODES);
    let got = arrays_bytes as f64 / (arrays_bytes + nodes_bytes) as f64;
    assert!(
        (got - want).abs() <= 0.05,
        "AllocArrays' share of the bytes: profile {got:.3}, workload {want:.3}"
    );
    // Total bytes against the process's own count.
    let process = value(&lines, "BYTES_PROCESS");
    let total: i64 = samples.iter().map(|s| s.values[1]).sum();
    let error = (total - process).abs() as f64 / process as f64;
    assert!(
        error <= 0.25,
        "the profile's bytes {total}, the process allocated {process}"
    );
    // The types, as labels and leaf frames; large objects marked.
    assert_eq!(types_of(&samples, ARRAYS), ["System.Byte[]"]);
    // The runtime names a nested class without its outer one.
    assert_eq!(types_of(&samples, NODES), ["Node"]);
    for s in &samples {
        let Some(LabelValue::Str(ty)) = s.label("allocation.type") else {
            panic!("a sample without allocation.type: {:?}", s.labels);
        };
        assert_eq!(s.frames.first(), Some(ty), "the type is the leaf frame");
    }
    let large: Vec<_> = samples
        .iter()
        .filter(|s| s.frames.iter().any(|f| f.contains(LARGE)))
        .collect();
    assert!(!large.is_empty(), "no sample of {LARGE}");
    assert!(
        large
            .iter()
            .all(|s| s.label("allocation.heap") == Some(&LabelValue::Str("loh".to_owned()))),
        "large objects are marked loh"
    );
    assert!(
        top.contains(ARRAYS) && top.contains("System.Byte[]"),
        "{top}"
    );
    if runtime == Runtime::Net8 {
        // V4 ticks: objects from the object size.
        let within = |got: i64, want: f64| (got as f64 - want).abs() / want <= 0.25;
        assert!(
            within(nodes_count, nodes as f64 / 40.0),
            "{nodes_count} nodes of 40 bytes in {nodes}"
        );
        assert!(
            within(arrays_count, arrays as f64 / 2024.0),
            "{arrays_count} arrays in {arrays}"
        );
        let (large_count, _) = of_method(&samples, LARGE);
        let rounds = value(&lines, "BYTES_Allocs.AllocLarge") as f64 / 100_024.0;
        assert!(
            within(large_count, rounds),
            "{large_count} large objects, {rounds} allocated"
        );
    } else {
        // V3 ticks carry no object size: one sample per tick.
        assert!(arrays_count > 0 && nodes_count > 0);
        assert!(
            arrays_count < arrays_bytes / 50_000,
            "counts are ticks on 3.1"
        );
    }
    summary
}

#[test]
fn net8_allocation_profile_matches_the_workload() {
    let summary = assert_allocations(Runtime::Net8, &["--allocs-per-second", "0"]);
    assert!(!summary.contains("over the budget"), "{summary}");
}

#[test]
fn netcore31_allocation_profile_matches_the_workload() {
    assert_allocations(Runtime::NetCore31, &["--allocs-per-second", "0"]);
}

/// `record --alloc` with its default budget (1000 events/s): 40 MB/s,
/// about 400 ticks a second, stays within it.
#[test]
fn net8_allocation_profile_under_the_default_budget() {
    let summary = assert_allocations(Runtime::Net8, &[]);
    assert!(!summary.contains("over the budget"), "{summary}");
}

/// Over the budget the allocation session backs off; the runtime's
/// alloc-rate counter keeps the bytes right and the kept events the shape.
#[test]
fn net8_allocations_over_the_budget_keep_their_totals() {
    let summary = assert_allocations(Runtime::Net8, &["--allocs-per-second", "50"]);
    assert!(
        summary.contains("counted while their events were off over the budget"),
        "the events were never turned off: {summary}"
    );
}

/// The agent with `--clr-events ...,allocations` ships a `memory` profile
/// per window (directory sink: the same profiles the Pyroscope and OTLP
/// sinks send) whose bytes add up to the workload's.
#[test]
fn agent_ships_allocation_profiles() {
    let env = Env::privileged();
    let dir = TempDir::new("agent-allocations");
    let out = dir.join("windows");
    let port = 23000 + (std::process::id() % 1000) as u16;
    let mut agent = std::process::Command::new(&env.clrbpf)
        .arg("agent")
        .args(["--upload-interval", "5s", "--clr-events"])
        .arg("contention,exceptions,waits,allocations")
        .arg("--output-dir")
        .arg(&out)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start clrbpf agent");
    std::thread::sleep(Duration::from_secs(2));
    // Allocates from 8 s in: the agent looks for new .NET processes every
    // 5 s.
    let workload = TestProcess::start(&env, Runtime::Net8, "Allocs", &["8", "6", "40"], false);
    let pid = workload.pid();
    let (status, lines) = workload.wait(TIMEOUT);
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: a signal to the agent this test started.
    unsafe { libc::kill(agent.id() as libc::pid_t, libc::SIGTERM) };
    let agent_status = agent.wait().expect("wait for the agent");
    assert!(status.success(), "workload failed: {lines:?}");
    assert!(agent_status.success(), "agent exit {agent_status}");
    let mut total = 0;
    let mut files = 0;
    for entry in std::fs::read_dir(&out).expect("the output directory") {
        let path = entry.expect("an entry").path();
        if !path.to_string_lossy().contains(".memory.") {
            continue;
        }
        files += 1;
        let profile = read_profile(&path);
        assert_eq!(
            sample_types(&profile),
            ["alloc_samples/count", "alloc_size/bytes"]
        );
        let period = profile.period_type.as_ref().expect("a period type");
        assert_eq!(string(&profile, period.r#type), "space");
        for s in samples(&profile).iter().filter(|s| s.pid() == Some(pid)) {
            total += s.values[1];
            assert!(s.label("allocation.type").is_some());
        }
    }
    assert!(files > 0, "no memory profile in {}", out.display());
    let process = value(&lines, "BYTES_PROCESS");
    let error = (total - process).abs() as f64 / process as f64;
    assert!(
        error <= 0.25,
        "the windows' bytes {total}, the process allocated {process}"
    );
}
