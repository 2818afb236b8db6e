//! `cargo xtask bench`, first samples (`CLRBPF_BENCH_ONLY=first`): how long
//! `record -p PID` takes from its start to its first sample when that
//! sample's stack is whole, i.e. the process's unwind tables (its files'
//! and its JIT code's) are in the kernel before sampling starts. A running
//! CPU-bound .NET 8 app is recorded for 1 s per round, with the tables in
//! `--cache-dir` (warm), with an empty cache directory every round (cold),
//! and with `--start-wait 0` (sampling at once, the tables loaded
//! meanwhile) for comparison. The figures are clrbpf's own summary: the
//! first sample's time after `record` started, how long the start waited
//! for the tables, and the stacks walked before they were there.

use std::{
    path::Path,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::Context as _;

use crate::bench::BenchInputs;

const ROUNDS: usize = 5;

/// What one `record -p` said about its start.
#[derive(Default)]
struct StartFigures {
    first_sample_s: f64,
    tables_s: f64,
    walked_before_indexed: u64,
}

/// The number after `prefix` up to `suffix` in `line`.
fn number_between(line: &str, prefix: &str, suffix: &str) -> Option<f64> {
    let rest = line.split(prefix).nth(1)?;
    rest.split(suffix).next()?.trim().parse().ok()
}

fn parse_summary(stderr: &str) -> Option<StartFigures> {
    let mut figures = StartFigures::default();
    let start = stderr.lines().find(|l| l.contains("first sample "))?;
    figures.first_sample_s = number_between(start, "first sample ", " s after")?;
    figures.tables_s = number_between(start, "before sampling (", " s)").unwrap_or(0.0);
    let unwind = stderr
        .lines()
        .find(|l| l.contains(" by frame pointers (process not indexed yet)"))?;
    let before = unwind
        .split(" by frame pointers (process not indexed yet)")
        .next()?;
    figures.walked_before_indexed = before.rsplit(' ').next()?.parse().ok()?;
    Some(figures)
}

fn record_once(inputs: &BenchInputs<'_>, pid: u32, extra: &[&str]) -> anyhow::Result<StartFigures> {
    let output = Command::new(inputs.clrbpf)
        .args([
            "record",
            "-v",
            "-p",
            &pid.to_string(),
            "-d",
            "1",
            "--no-clr-events",
            "-o",
        ])
        .arg(inputs.scratch.join("first.pb.gz"))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .context("run clrbpf record -p")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(output.status.success(), "clrbpf record failed:\n{stderr}");
    parse_summary(&stderr).with_context(|| format!("no start figures in the summary:\n{stderr}"))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    println!(
        "\nbench: first samples: record -p of a running CpuBound.dll (.NET 8), 1 s, {ROUNDS} rounds per row; medians"
    );
    let mut app = inputs
        .dotnet8_workload("CpuBound")
        .args(["600", "1"])
        .stdout(Stdio::null())
        .spawn()
        .context("start CpuBound.dll")?;
    thread::sleep(Duration::from_secs(3));
    let pid = app.id();
    let cache = inputs.scratch.join("first-cache");
    let cache_arg = cache.to_string_lossy().into_owned();
    // One run fills the cache of the warm rows.
    let _ = std::fs::remove_dir_all(&cache);
    let result = (|| -> anyhow::Result<Vec<(&str, Vec<StartFigures>)>> {
        record_once(inputs, pid, &["--cache-dir", &cache_arg])?;
        let mut rows = Vec::new();
        for (name, cold, extra) in [
            ("warm cache", false, &[][..]),
            ("cold cache (empty --cache-dir)", true, &[][..]),
            (
                "warm cache, --start-wait 0 (sampling at once)",
                false,
                &["--start-wait", "0"][..],
            ),
        ] {
            let mut runs = Vec::new();
            for round in 0..ROUNDS {
                let dir = if cold {
                    let dir = inputs.scratch.join(format!("first-cold-{round}"));
                    let _ = std::fs::remove_dir_all(&dir);
                    dir
                } else {
                    cache.clone()
                };
                let dir_arg = dir.to_string_lossy().into_owned();
                let mut args = vec!["--cache-dir", dir_arg.as_str()];
                args.extend_from_slice(extra);
                runs.push(record_once(inputs, pid, &args)?);
                if cold {
                    let _ = std::fs::remove_dir_all(Path::new(&dir));
                }
            }
            rows.push((name, runs));
        }
        Ok(rows)
    })();
    let _ = app.kill();
    let _ = app.wait();
    let rows = result?;
    println!(
        "| record -p, time to the first sample | first sample after start | tables loaded before sampling | stacks walked before the tables (all rounds) |"
    );
    println!("| --- | --- | --- | --- |");
    for (name, runs) in rows {
        let first = median(runs.iter().map(|r| r.first_sample_s).collect());
        let tables = median(runs.iter().map(|r| r.tables_s).collect());
        let walked: u64 = runs.iter().map(|r| r.walked_before_indexed).sum();
        println!("| {name} | {first:.2} s | {tables:.1} s | {walked} |");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_gives_the_start_figures() {
        let stderr = "clrbpf: unwind tables of 1 of 1 processes known at start loaded before sampling (0.3 s); first sample 0.34 s after the start\n\
            clrbpf: unwind tables 10.8 MiB in 25 files, 1 processes indexed (12.0 MiB allocated, cap 64 MiB); 234 user stacks walked with them, 7 by frame pointers (process not indexed yet), 148 wakers' stacks in processes without tables; walks ended early: none\n";
        let figures = parse_summary(stderr).expect("figures");
        assert_eq!(figures.first_sample_s, 0.34);
        assert_eq!(figures.tables_s, 0.3);
        assert_eq!(figures.walked_before_indexed, 7);
        assert!(parse_summary("nothing").is_none());
    }
}
