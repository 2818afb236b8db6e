//! JIT-compiled frames named from the runtime's memory: a .NET 8 process
//! started with `DOTNET_EnableDiagnostics=0` has no diagnostic socket, so
//! no perf map can be asked for and no events come; `record -p` must still
//! name its managed frames, by walking the runtime's code range map and
//! reading the method's metadata from its assembly file, and write nothing
//! into the target. Run by `cargo xtask test` (root, one test at a time).

use std::{path::PathBuf, time::Duration};

use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess, parse_value, read_profile, record_pid, samples,
    value_index,
};

/// A frame nothing named in memory no file backs (JIT code and stubs):
/// native code shows as `file+0x...` instead.
const UNNAMED_ANONYMOUS: &str = "[unknown]";

/// A frame the memory path named: a method of the workload, a stub or a
/// dynamic method.
fn named_jit(frame: &str) -> bool {
    frame.starts_with("Ratio.")
        || frame.starts_with("[stub: ")
        || frame.starts_with("[dynamic method]")
}

#[test]
fn record_names_jit_frames_without_the_diagnostic_socket() {
    let env = Env::privileged();
    let dir = TempDir::new("jit-memory");
    let ratio = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Ratio",
        &["12"],
        &Launch {
            env: &[("DOTNET_EnableDiagnostics", "0")],
            ..Launch::default()
        },
    );
    let pid = ratio.pid();
    let socket_prefix = format!("dotnet-diagnostic-{pid}-");
    let has_socket = std::fs::read_dir("/tmp")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with(&socket_prefix));
    assert!(
        !has_socket,
        "pid {pid} has a diagnostic socket: the test needs none"
    );
    // HotA and HotB are compiled and tiered up by now.
    std::thread::sleep(Duration::from_secs(2));
    let (_, output_path) = record_pid(&env, &dir, pid, &["-F", "499", "-d", "5"], "p.pb.gz");
    let (_, lines) = ratio.wait(Duration::from_secs(60));
    let expected_ratio: f64 = parse_value(&lines, "RATIO_A")
        .unwrap_or_else(|| panic!("Ratio printed no RATIO_A: {lines:?}"));
    for file in [
        format!("/tmp/perf-{pid}.map"),
        format!("/tmp/jit-{pid}.dump"),
    ] {
        assert!(
            !PathBuf::from(&file).exists(),
            "{file} exists: the memory path must write nothing into the target"
        );
    }

    let profile = read_profile(&output_path);
    let cpu = value_index(&profile, "cpu/nanoseconds");
    let (mut managed, mut named, mut cpu_a, mut cpu_b) = (0i64, 0i64, 0i64, 0i64);
    let mut unnamed_examples = Vec::new();
    // The hot loop runs on the main thread, whose tid is the pid: its
    // samples whose leaf is JIT code (named by the memory path, or an
    // address in anonymous memory nothing named) are the managed ones;
    // ReadyToRun framework code is named from its files, not here.
    for sample in samples(&profile) {
        if sample.pid() != Some(pid) || sample.label_num("thread.id") != Some(i64::from(pid)) {
            continue;
        }
        let Some(leaf) = sample.frames.first() else {
            continue;
        };
        let weight = sample.values[cpu];
        if named_jit(leaf) {
            managed += weight;
            named += weight;
        } else if leaf == UNNAMED_ANONYMOUS {
            managed += weight;
            unnamed_examples.push(leaf.clone());
        }
        if sample.stack_contains(&["Ratio.HotA"]) {
            cpu_a += weight;
        } else if sample.stack_contains(&["Ratio.HotB"]) {
            cpu_b += weight;
        }
    }
    assert!(managed > 0, "no managed samples of pid {pid}");
    let named_share = named as f64 / managed as f64;
    unnamed_examples.truncate(5);
    assert!(
        named_share >= 0.95,
        "only {:.1}% of pid {pid}'s managed CPU is named (unnamed leaves: {unnamed_examples:?})",
        named_share * 100.0
    );
    assert!(
        cpu_a + cpu_b > 0,
        "no sample of pid {pid} holds Ratio.HotA or Ratio.HotB"
    );
    let measured = cpu_a as f64 / (cpu_a + cpu_b) as f64;
    eprintln!(
        "pid {pid}: {:.1}% of managed CPU named; HotA share {measured:.4}, workload says {expected_ratio:.4}",
        named_share * 100.0
    );
    assert!(
        (measured - expected_ratio).abs() <= 0.05,
        "HotA share {measured:.4} in the profile, {expected_ratio:.4} measured by the workload"
    );
}
