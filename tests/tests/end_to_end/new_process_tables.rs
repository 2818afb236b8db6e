//! How a process that starts during a whole-host recording gets its unwind
//! tables (issue 25): the kernel reports each executable mapping it makes
//! (`mmap`/`mprotect` with `PROT_EXEC`), and clrbpf rescans it then rather
//! than on a timer, so that its runtime's libraries and the framework's
//! ReadyToRun images are in its index as they are mapped; its JIT code's
//! table follows its first methods. The summary (`-v`) gives the process's
//! way from its exec: first index, files' tables, JIT table, and the scans
//! its code mappings asked for. How long each step takes is measured by
//! `cargo xtask bench` (part `first`), not asserted here.
//! Real tracepoint programs and a real .NET 8 process; run by
//! `cargo xtask test` (root, one test at a time).

use std::{fs, thread, time::Duration};

use clrbpf_integration_tests::{Env, Runtime, TempDir, TestProcess, start_whole_host_recording};

/// The figure after `key` in `line` (`key 0.123 s`, `key 4 on`, ...).
fn after(line: &str, key: &str) -> Option<f64> {
    let word = line.split(key).nth(1)?.split_whitespace().next()?;
    word.trim_end_matches([',', ';', ')']).parse().ok()
}

#[test]
fn a_new_dotnet_process_is_rescanned_as_it_maps_code_and_gets_its_jit_table() {
    let env = Env::privileged();
    let dir = TempDir::new("new-process-tables");
    let log = dir.join("stderr.txt");
    let mut clrbpf = start_whole_host_recording(
        &env,
        // Room for every table of a busy host: evictions are another
        // matter than the one tested here.
        &["--unwind-table-memory-mb", "512", "-d", "14"],
        &dir.join("out.pb.gz"),
        &log,
    );
    // The host's processes are indexed right after sampling starts.
    thread::sleep(Duration::from_secs(3));
    let app = TestProcess::start(&env, Runtime::Net8, "CpuBound", &["2", "1"], false);
    let pid = app.pid();
    let (status, _) = app.wait(Duration::from_secs(30));
    assert!(status.success(), "CpuBound exited with {status}");
    let status = clrbpf.wait().expect("wait for clrbpf");
    let stderr = fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "clrbpf failed:\n{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains(&format!("unwind tables of a new process: pid {pid} ")))
        .unwrap_or_else(|| panic!("no line for pid {pid} in the summary:\n{stderr}"));
    eprintln!("{line}");
    let figure =
        |key| after(line, key).unwrap_or_else(|| panic!("no figure after {key:?} in:\n{line}"));
    let (indexed, files, jit_table) = (figure("indexed "), figure("files "), figure("JIT table "));
    assert!(
        indexed <= files,
        "its files' tables came with or after its first index: {line}"
    );
    assert!(
        figure(" s (") >= 10.0,
        "a .NET process maps its host, runtime and framework images: {line}"
    );
    assert!(
        figure("scans, ") >= 1.0,
        "its code mappings asked for a rescan: {line}"
    );
    assert!(jit_table > 0.0, "its JIT code got a table: {line}");
    // A .NET 8 process maps about 110 executable pieces of files (its
    // ReadyToRun images in several), most in its first second, and is
    // scanned 10-20 times meanwhile: a scan opens (through
    // `/proc/PID/map_files`) only the pieces its last scan did not see.
    // Opening every piece at every scan made this about 550.
    assert!(
        figure("on code mappings, ") <= 250.0,
        "its scans opened each mapped file once: {line}"
    );
}
