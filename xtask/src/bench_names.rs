//! `cargo xtask bench`, managed names (`CLRBPF_BENCH_ONLY=names`): what
//! each source of JIT frame names costs clrbpf on the same warm .NET 8 app
//! (`Demo.dll`, two worker threads, started without perf maps), recorded
//! with `record -p` for 5 s at 499 Hz in interleaved rounds: the perf map
//! path (`--managed-names perf-map`: the runtime is asked over its
//! diagnostic socket to write its perf map and jitdump, replaying what it
//! compiled, and clrbpf reads them) against the memory path
//! (`--managed-names memory`: ReadyToRun images and the runtime's memory,
//! nothing asked of the runtime). The figures are clrbpf's own CPU and
//! peak RSS (its rusage) and the managed frames its summary says were
//! named; the unwind-table cache is warm, so both pay the same start.

use std::{
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::Context as _;

use crate::bench::{BenchInputs, median};

const ROUNDS: usize = 5;
const SECONDS: &str = "5";

/// One `record -p`: its CPU, peak RSS and named managed frames.
struct NamesRun {
    cpu_ms: f64,
    max_rss_mib: f64,
    named: u64,
    /// Most bytes of perf map and jitdump in the target's `/tmp` at once.
    written: u64,
}

/// The managed frames of the summary's
/// `managed frames named: A by perf map or runtime events, B by ReadyToRun
/// images, C by runtime memory` line, summed.
fn named_frames(stderr: &str) -> Option<u64> {
    let line = stderr
        .lines()
        .find_map(|l| l.split("managed frames named: ").nth(1))?;
    line.split(", ")
        .map(|part| part.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The perf map and jitdump a runtime writes when asked.
fn perf_files(pid: u32) -> [std::path::PathBuf; 2] {
    [
        format!("/tmp/perf-{pid}.map").into(),
        format!("/tmp/jit-{pid}.dump").into(),
    ]
}

fn record_once(
    inputs: &BenchInputs<'_>,
    pid: u32,
    source: &str,
    cache: &str,
) -> anyhow::Result<NamesRun> {
    let stderr_path = inputs.scratch.join("names.stderr");
    let mut child = Command::new(inputs.clrbpf)
        .args(["record", "-p", &pid.to_string(), "-F", "499", "-d", SECONDS])
        .args([
            "--no-clr-events",
            "--managed-names",
            source,
            "--cache-dir",
            cache,
        ])
        .arg("-o")
        .arg(inputs.scratch.join("names.pb.gz"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).context("create the stderr file")?)
        .spawn()
        .context("start clrbpf record -p")?;
    // clrbpf removes the files when it turns perf maps off: their size is
    // watched while it runs.
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let done = done.clone();
        thread::spawn(move || {
            let mut most = 0;
            while !done.load(Ordering::Relaxed) {
                let size: u64 = perf_files(pid)
                    .iter()
                    .filter_map(|p| std::fs::metadata(p).ok())
                    .map(|m| m.len())
                    .sum();
                most = most.max(size);
                thread::sleep(Duration::from_millis(50));
            }
            most
        })
    };
    let waited = crate::bench::wait_with_usage(&mut child);
    done.store(true, Ordering::Relaxed);
    let written = watcher.join().unwrap_or(0);
    let (status, usage) = waited?;
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    anyhow::ensure!(status.success(), "clrbpf record failed:\n{stderr}");
    let named = named_frames(&stderr)
        .with_context(|| format!("no named frames in the summary:\n{stderr}"))?;
    Ok(NamesRun {
        cpu_ms: usage.cpu.as_secs_f64() * 1000.0,
        max_rss_mib: usage.max_rss_kib as f64 / 1024.0,
        named,
        written,
    })
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    println!(
        "\nbench: managed names: record -p of a warm Demo.dll (.NET 8), {SECONDS} s at 499 Hz, no CLR events, {ROUNDS} interleaved rounds per path; medians"
    );
    let mut app = inputs
        .dotnet8_workload("Demo")
        .arg("600")
        .env_remove("DOTNET_PerfMapEnabled")
        .stdout(Stdio::null())
        .spawn()
        .context("start Demo.dll")?;
    let pid = app.id();
    thread::sleep(Duration::from_secs(5));
    let cache = inputs.scratch.join("names-cache");
    let cache_arg = cache.to_string_lossy().into_owned();
    let sources = ["perf-map", "memory"];
    let result = (|| -> anyhow::Result<Vec<Vec<NamesRun>>> {
        // Fills the unwind-table cache both paths then read.
        record_once(inputs, pid, "memory", &cache_arg)?;
        let mut runs: Vec<Vec<NamesRun>> = sources.iter().map(|_| Vec::new()).collect();
        for _ in 0..ROUNDS {
            for (source, runs) in sources.iter().zip(runs.iter_mut()) {
                let run = record_once(inputs, pid, source, &cache_arg)?;
                // Each round, for a noisy machine's outliers.
                eprintln!(
                    "bench: names: {source}: {:.0} ms, {:.1} MiB, {} frames, {} bytes written",
                    run.cpu_ms, run.max_rss_mib, run.named, run.written
                );
                runs.push(run);
            }
        }
        Ok(runs)
    })();
    let _ = app.kill();
    let _ = app.wait();
    let runs = result?;
    println!(
        "| names from | clrbpf CPU per run (range) | managed frames named | CPU per named frame | peak RSS | written into the target |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (source, runs) in sources.iter().zip(&runs) {
        let mut cpus: Vec<f64> = runs.iter().map(|r| r.cpu_ms).collect();
        let cpu = median(&mut cpus);
        let (low, high) = (cpus[0], cpus[cpus.len() - 1]);
        let written = median(&mut runs.iter().map(|r| r.written as f64).collect::<Vec<_>>());
        let named = median(&mut runs.iter().map(|r| r.named as f64).collect::<Vec<_>>());
        let per_frame = median(
            &mut runs
                .iter()
                .map(|r| r.cpu_ms * 1000.0 / r.named.max(1) as f64)
                .collect::<Vec<_>>(),
        );
        let rss = median(&mut runs.iter().map(|r| r.max_rss_mib).collect::<Vec<_>>());
        let label = match *source {
            "perf-map" => "perf map (`--managed-names perf-map`)",
            _ => "runtime memory (`--managed-names memory`)",
        };
        println!(
            "| {label} | {cpu:.0} ms ({low:.0}-{high:.0}) | {named:.0} | {per_frame:.1} us | {rss:.1} MiB | {:.1} MiB |",
            written / (1024.0 * 1024.0)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_gives_the_named_frames() {
        let stderr = "clrbpf: pid 4242: managed frames named: 10 by perf map or runtime events, 1311 by ReadyToRun images, 7 by runtime memory\n";
        assert_eq!(named_frames(stderr), Some(1328));
        assert_eq!(named_frames("nothing"), None);
    }
}
