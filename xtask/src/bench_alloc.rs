//! `cargo xtask bench`, allocating-app part (issue 13): the kernel
//! walker's cost where it is highest. The CPU table's workload computes in
//! a few warm frames; the demo (Demo.dll: parsing, sorting, allocating,
//! so its samples land in the GC and its stacks are ~14 frames deep
//! through the runtime's library, ReadyToRun and JIT code) makes the
//! walker's data cold between samples. BPF time per on-CPU sample of
//! `record -a` with DWARF unwinding and with `--frame-pointers-only`,
//! back to back in each round over one warm demo process, their order
//! swapped every round (on this VM what ran just before a run moves its
//! BPF time).

use std::{
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::bench::{BenchInputs, bpf_us_per_sample_of, median};

const ROUNDS: usize = 7;
/// Seconds each `record` runs.
const SECONDS: u64 = 6;

/// The demo workload, killed when dropped.
struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn record(inputs: &BenchInputs<'_>, frame_pointers_only: bool) -> anyhow::Result<f64> {
    let seconds = SECONDS.to_string();
    let mut command = Command::new(inputs.clrbpf);
    command.args(["record", "-v", "-a", "-F", "99", "-d", &seconds]);
    if frame_pointers_only {
        command.arg("--frame-pointers-only");
    }
    let output = command
        .arg("-o")
        .arg(inputs.scratch.join("alloc.pb.gz"))
        .stdin(Stdio::null())
        .output()
        .context("run clrbpf record")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!("clrbpf record failed: {stderr}");
    }
    bpf_us_per_sample_of(&stderr).with_context(|| {
        format!("clrbpf printed no BPF time (is kernel.bpf_stats_enabled on?): {stderr}")
    })
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    // Long enough for every round: two records of SECONDS plus start-up.
    let lifetime = ROUNDS as u64 * 2 * (SECONDS + 3) + 30;
    let _demo = Demo(
        inputs
            .dotnet8_workload("Demo")
            .arg(lifetime.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start Demo.dll")?,
    );
    // Past the demo's start (JIT, first GCs).
    thread::sleep(Duration::from_secs(3));
    let (mut dwarf, mut fp, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let (d, f) = if round % 2 == 0 {
            let d = record(inputs, false)?;
            (d, record(inputs, true)?)
        } else {
            let f = record(inputs, true)?;
            (record(inputs, false)?, f)
        };
        dwarf.push(d);
        fp.push(f);
        ratios.push(d / f);
    }
    let rounds: Vec<String> = ratios.iter().map(|r| format!("{r:.2}x")).collect();
    let mut extra: Vec<f64> = dwarf.iter().zip(&fp).map(|(d, f)| d - f).collect();
    println!(
        "\nbench: allocating app (Demo.dll), record -a -F 99 -d {SECONDS}, DWARF and frame pointers back to back, {ROUNDS} rounds"
    );
    println!("| what | value | budget |");
    println!("| --- | --- | --- |");
    println!(
        "| BPF time per on-CPU sample, DWARF unwinding (median) | {:.2} us | |",
        median(&mut dwarf)
    );
    println!(
        "| BPF time per on-CPU sample, --frame-pointers-only (median) | {:.2} us | |",
        median(&mut fp)
    );
    println!(
        "| DWARF minus frame pointers, same round (median) | {:.2} us | |",
        median(&mut extra)
    );
    println!(
        "| BPF time per sample, DWARF / frame pointers (same round, median; rounds: {}) | {:.2}x | <= 1.2x |",
        rounds.join(", "),
        median(&mut ratios)
    );
    Ok(())
}
