//! `cargo xtask bench`, stack copies (`CLRBPF_BENCH_ONLY=first`, after the
//! first-sample rows): what the on-CPU program costs while it copies user
//! stacks (processes without unwind tables yet) against the walk it does
//! once the tables are in the kernel. A running Qsort.dll (.NET 8: managed
//! code, glibc's qsort and a managed comparer) is recorded with `record -p`
//! for 3 s per round, walking as usual, then with
//! `--stack-copy-every-sample` (every sample copied, as if the process had
//! no tables, and walked in userspace), rows alternating. The figures are
//! clrbpf's own summary: BPF time per sample, and the bytes of the copies.

use std::{
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::Context as _;

use crate::bench::{BenchInputs, bpf_us_per_sample_of, median};

const ROUNDS: usize = 3;
/// `size_of::<RawSampleEvent>()` (profiler-common, which xtask does not
/// build): the ring-buffer record of a walked sample.
const SAMPLE_RECORD_BYTES: f64 = 2144.0;

/// Bytes per copy in a summary's stack-copy line (`(X MiB, Y KiB each)`).
fn copy_kib_of(stderr: &str) -> Option<f64> {
    let line = stderr.lines().find(|l| l.contains("stack copies while"))?;
    line.split(" MiB, ")
        .nth(1)?
        .split(" KiB each")
        .next()?
        .trim()
        .parse()
        .ok()
}

/// BPF time per sample and KiB per copy (0 without copies) of one round.
fn record_once(inputs: &BenchInputs<'_>, pid: u32, copy: bool) -> anyhow::Result<(f64, f64)> {
    let mut command = Command::new(inputs.clrbpf);
    command
        .args(["record", "-v", "-p", &pid.to_string(), "-d", "3"])
        .args(["--no-clr-events", "-o"])
        .arg(inputs.scratch.join("stack-copy.pb.gz"));
    if copy {
        command.args([
            "--stack-copy-every-sample",
            "--stack-copy-kib-per-second",
            "1048576",
        ]);
    }
    let output = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .context("run clrbpf record -p")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(output.status.success(), "clrbpf record failed:\n{stderr}");
    let us = bpf_us_per_sample_of(&stderr)
        .with_context(|| format!("no BPF time in the summary:\n{stderr}"))?;
    let kib = if copy {
        copy_kib_of(&stderr)
            .with_context(|| format!("no stack copies in the summary:\n{stderr}"))?
    } else {
        0.0
    };
    Ok((us, kib))
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    println!(
        "\nbench: stack copies: record -p of a running Qsort.dll (.NET 8), 3 s, {ROUNDS} rounds per row alternating; medians"
    );
    let mut app = inputs
        .dotnet8_workload("Qsort")
        .arg("600")
        .stdout(Stdio::null())
        .spawn()
        .context("start Qsort.dll")?;
    thread::sleep(Duration::from_secs(3));
    let pid = app.id();
    let result = (|| -> anyhow::Result<[(Vec<f64>, Vec<f64>); 2]> {
        let mut rows: [(Vec<f64>, Vec<f64>); 2] = Default::default();
        for _ in 0..ROUNDS {
            for (copy, row) in [false, true].into_iter().zip(rows.iter_mut()) {
                let (us, kib) = record_once(inputs, pid, copy)?;
                row.0.push(us);
                row.1.push(kib);
            }
        }
        Ok(rows)
    })();
    let _ = app.kill();
    let _ = app.wait();
    let [(mut walk_us, _), (mut copy_us, mut copy_kib)] = result?;
    let walk_us = median(&mut walk_us);
    let copy_us = median(&mut copy_us);
    let copy_kib = median(&mut copy_kib);
    let record_kib = SAMPLE_RECORD_BYTES / 1024.0;
    println!("| on-CPU sample | BPF time per sample | ratio to the walk | bytes per sample |");
    println!("| --- | --- | --- | --- |");
    println!(
        "| walked in the kernel (tables loaded) | {walk_us:.2} us | 1.00x | {record_kib:.1} KiB |"
    );
    println!(
        "| stack copied (no tables yet) | {copy_us:.2} us | {:.2}x | {copy_kib:.1} KiB |",
        copy_us / walk_us.max(f64::MIN_POSITIVE)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_size_of_the_copies() {
        let stderr = "clrbpf: stack copies while processes had no unwind tables: 16 (0.3 MiB, 16.7 KiB each), 16 unwound once the tables came\n";
        assert_eq!(copy_kib_of(stderr), Some(16.7));
        assert_eq!(copy_kib_of("nothing"), None);
    }
}
