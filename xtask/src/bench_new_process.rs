//! `cargo xtask bench`, new processes (`CLRBPF_BENCH_ONLY=first`, after the
//! first-sample rows): how long a .NET 8 process started while clrbpf
//! runs waits for its unwind tables in the kernel, from its exec to its
//! files' tables and its JIT code's, in a whole-host recording (`record
//! -a`) and in the agent, with a warm and a cold `--cache-dir`. Each round
//! starts clrbpf, waits for it to settle, then runs CpuBound.dll twice in
//! a row: the first process, and a second one of the same files (whose
//! tables are in the kernel already). The figures are clrbpf's own
//! (`record -v`'s summary, the agent's `clrbpf::table_times` log lines):
//! medians over the rounds. With `CLRBPF_BENCH_BEFORE=PATH`, the clrbpf
//! binary at PATH runs the same rounds, interleaved, as the "before" rows.

use std::{
    io::Read as _,
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::Context as _;

use crate::bench::{BenchInputs, median};

const ROUNDS: usize = 3;
/// How long clrbpf runs before the first process starts: its start-up
/// indexing of the host's processes is over.
const SETTLE: Duration = Duration::from_secs(10);
/// Seconds each CpuBound.dll runs.
const APP_SECONDS: &str = "2";

/// One process's figures, in seconds after its exec, and its work.
#[derive(Clone, Debug, Default, PartialEq)]
struct NewProcess {
    seen: f64,
    indexed: f64,
    files: f64,
    jit_table: f64,
    whole: f64,
    built: f64,
    read: f64,
    shared: f64,
    build_ms: f64,
    read_ms: f64,
    upload_ms: f64,
}

/// The number after `key` in `line` (`key 0.123 s`, `key 12 ms`, ...).
fn after(line: &str, key: &str) -> Option<f64> {
    let rest = line.split(key).nth(1)?;
    let word = rest.split_whitespace().next()?;
    word.trim_end_matches([',', ';', ')']).parse().ok()
}

/// The figures of `pid` in clrbpf's stderr.
fn parse_line(stderr: &str, pid: u32) -> Option<NewProcess> {
    let line = stderr
        .lines()
        .find(|l| l.contains(&format!("unwind tables of a new process: pid {pid} ")))?;
    Some(NewProcess {
        seen: after(line, "seen ")?,
        indexed: after(line, "indexed ")?,
        files: after(line, "files ")?,
        jit_table: after(line, "JIT table ")?,
        whole: after(line, "whole ")?,
        built: after(line, "files: ")?,
        read: after(line, " ms, ")?,
        shared: after(line, " read in ").and_then(|_| {
            let rest = line.split(" read in ").nth(1)?;
            after(rest, " ms, ")
        })?,
        build_ms: after(line, " built in ")?,
        read_ms: after(line, " read in ")?,
        upload_ms: after(line, "rows written in ")?,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Record,
    Agent,
}

/// Starts clrbpf (`binary`) in `mode` with `cache`, its stderr piped.
fn start_clrbpf(
    inputs: &BenchInputs<'_>,
    binary: &Path,
    mode: Mode,
    cache: &Path,
) -> anyhow::Result<Child> {
    let mut command = Command::new(binary);
    match mode {
        Mode::Record => {
            command
                .args(["record", "-a", "-v", "-d", "20", "-o"])
                .arg(inputs.scratch.join("new-process.pb.gz"));
        }
        Mode::Agent => {
            let windows = inputs.scratch.join("new-process-agent");
            let _ = std::fs::remove_dir_all(&windows);
            std::fs::create_dir_all(&windows)?;
            command
                .args(["--log-level", "warn,clrbpf::table_times=info", "agent"])
                .arg("--output-dir")
                .arg(&windows)
                .args([
                    "--listen",
                    &format!("127.0.0.1:{}", 23_000 + std::process::id() % 1000),
                ]);
        }
    }
    command
        // Room for every table of a busy host: evictions under the cap
        // are another matter than the wait measured here.
        .args(["--unwind-table-memory-mb", "512"])
        .arg("--cache-dir")
        .arg(cache)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("start clrbpf")
}

/// One round: clrbpf, then two CpuBound.dll in a row; their figures.
fn round(
    inputs: &BenchInputs<'_>,
    binary: &Path,
    mode: Mode,
    cache: &Path,
) -> anyhow::Result<[Option<NewProcess>; 2]> {
    let mut clrbpf = start_clrbpf(inputs, binary, mode, cache)?;
    thread::sleep(SETTLE);
    let mut pids = [0; 2];
    for pid in &mut pids {
        let mut app = inputs
            .dotnet8_workload("CpuBound")
            .args([APP_SECONDS, "1"])
            .stdout(Stdio::null())
            .spawn()
            .context("start CpuBound.dll")?;
        *pid = app.id();
        app.wait()?;
    }
    // The exits reach clrbpf, which then reports the processes.
    thread::sleep(Duration::from_secs(3));
    if mode == Mode::Agent {
        // SAFETY: a signal to the child we started.
        unsafe { libc::kill(clrbpf.id() as i32, libc::SIGINT) };
    }
    let mut stderr = String::new();
    if let Some(mut pipe) = clrbpf.stderr.take() {
        pipe.read_to_string(&mut stderr)?;
    }
    let status = clrbpf.wait()?;
    anyhow::ensure!(status.success(), "clrbpf failed:\n{stderr}");
    let figures = pids.map(|pid| parse_line(&stderr, pid));
    if figures.iter().any(Option::is_none) {
        // A busy host can keep the agent from reporting a process before
        // it stops: the round counts as missing.
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        println!(
            "bench: new processes: no figures for some of pids {pids:?}; clrbpf's last lines: {tail:?}"
        );
    }
    Ok(figures)
}

fn print_row(label: &str, runs: &[NewProcess]) {
    let m = |f: fn(&NewProcess) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
    println!(
        "| {label} ({} rounds) | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {:.0} built ({:.0} ms), {:.0} read ({:.0} ms), {:.0} already loaded | {:.1} ms |",
        runs.len(),
        m(|p| p.seen),
        m(|p| p.indexed),
        m(|p| p.files),
        m(|p| p.jit_table),
        m(|p| p.whole),
        m(|p| p.built),
        m(|p| p.build_ms),
        m(|p| p.read),
        m(|p| p.read_ms),
        m(|p| p.shared),
        m(|p| p.upload_ms),
    );
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    let before = std::env::var_os("CLRBPF_BENCH_BEFORE").map(std::path::PathBuf::from);
    let mut binaries = vec![("now", inputs.clrbpf.to_path_buf())];
    if let Some(before) = before {
        binaries.insert(0, ("before", before));
    }
    println!(
        "\nbench: new processes: CpuBound.dll (.NET 8) started twice in a row under record -a / the agent; seconds from its exec; {ROUNDS} rounds, medians"
    );
    println!(
        "| new .NET 8 process | seen | first index | files' tables | JIT table | whole stacks | its files' tables | rows written |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (mode, mode_name) in [(Mode::Record, "record -a"), (Mode::Agent, "agent")] {
        for cold in [false, true] {
            let mut runs = vec![(Vec::new(), Vec::new()); binaries.len()];
            for r in 0..ROUNDS {
                for (b, ((_, binary), (first, second))) in
                    binaries.iter().zip(runs.iter_mut()).enumerate()
                {
                    // A cache directory per binary: a build reads only
                    // the entries it wrote.
                    let cache = if cold {
                        inputs.scratch.join(format!("new-process-cold-{b}-{r}"))
                    } else {
                        inputs.scratch.join(format!("new-process-cache-{b}"))
                    };
                    if cold {
                        let _ = std::fs::remove_dir_all(&cache);
                    } else if r == 0 {
                        // Fills the warm cache with the app's files.
                        round(inputs, binary, mode, &cache)?;
                    }
                    let [a, b] = round(inputs, binary, mode, &cache)?;
                    first.extend(a);
                    second.extend(b);
                    if cold {
                        let _ = std::fs::remove_dir_all(&cache);
                    }
                }
            }
            let cache_name = if cold { "cold" } else { "warm" };
            for ((name, _), (first, second)) in binaries.iter().zip(runs) {
                let label = format!("{mode_name}, {cache_name} cache, {name}");
                // As they come: a later failure keeps them.
                print_row(&format!("{label}: first process"), &first);
                print_row(&format!("{label}: second process"), &second);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_new_process_line() {
        let stderr = "clrbpf: unwind tables of a new process: pid 42 from its exec: seen 0.051 s, indexed 0.060 s, files 0.950 s (23 files: 4 built in 85 ms, 2 read in 3 ms, 17 already loaded; rows written in 1.5 ms; 5 scans, 4 on code mappings), JIT code 0.700 s, JIT table 0.810 s, whole 0.950 s\n";
        let p = parse_line(stderr, 42).expect("figures");
        assert_eq!(
            p,
            NewProcess {
                seen: 0.051,
                indexed: 0.06,
                files: 0.95,
                jit_table: 0.81,
                whole: 0.95,
                built: 4.0,
                read: 2.0,
                shared: 17.0,
                build_ms: 85.0,
                read_ms: 3.0,
                upload_ms: 1.5,
            }
        );
        assert!(parse_line(stderr, 4).is_none());
    }
}
