//! `cargo xtask bench`, naming (`CLRBPF_BENCH_ONLY=naming`): what naming
//! stacks costs where it happens all at once, beside three warm .NET 8
//! apps (`Demo.dll`, started without perf maps) and whatever else the host
//! runs:
//!
//! - the end of `record -a -d 10 -F 99`: the summary's "naming N distinct
//!   CPU stacks took X s at the end" (perf maps read once more, every
//!   stack of the recording named: symbol tables, perf maps, the runtimes'
//!   images and memory), beside clrbpf's whole CPU for the run. perf's
//!   counterpart is `perf script` over a `perf record -a -g -F 99` of the
//!   same length: perf names nothing while it records;
//! - the agent's windows (`--upload-interval 10s`, 45 s): its
//!   `clrbpf_agent_stack_naming_seconds_total` and
//!   `clrbpf_agent_stacks_named_total` from `/metrics`, per window, beside
//!   the agent's CPU.
//!
//! Rounds interleave clrbpf and perf; medians.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::bench::{BenchInputs, cpu_seconds, median, wait_with_usage};

const ROUNDS: usize = 3;
const APPS: usize = 3;
const RECORD_SECONDS: u64 = 10;
const AGENT_RUN: Duration = Duration::from_secs(45);
const AGENT_INTERVAL: &str = "10s";

/// The summary's `naming N distinct CPU stacks took X s at the end and Y s
/// before` line: (stacks, at the end, before).
fn naming_of(stderr: &str) -> Option<(u64, f64, f64)> {
    let rest = stderr
        .lines()
        .find_map(|l| l.split("clrbpf: naming ").nth(1))?;
    let words: Vec<&str> = rest.split_whitespace().collect();
    // N distinct CPU stacks took X s at the end and Y s before
    Some((
        words.first()?.parse().ok()?,
        words.get(5)?.parse().ok()?,
        words.get(11)?.parse().ok()?,
    ))
}

/// A counter's value in an OpenMetrics text (`name value` line).
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (key, value) = l.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

fn get_metrics(port: u32) -> anyhow::Result<String> {
    let mut stream =
        TcpStream::connect(("127.0.0.1", port as u16)).context("connect to the agent")?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(text)
}

/// One `record -a`: (stacks, naming at the end s, before s, clrbpf CPU s,
/// seconds from the end of `-d` to its exit).
fn record_once(inputs: &BenchInputs<'_>) -> anyhow::Result<(u64, f64, f64, f64, f64)> {
    let stderr_path = inputs.scratch.join("naming.stderr");
    let started = Instant::now();
    let mut child = Command::new(inputs.clrbpf)
        .args(["record", "-v", "-a", "-F", "99", "-d"])
        .arg(RECORD_SECONDS.to_string())
        .arg("-o")
        .arg(inputs.scratch.join("naming.pb.gz"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).context("create the stderr file")?)
        .spawn()
        .context("start clrbpf record -a")?;
    let (status, usage) = wait_with_usage(&mut child)?;
    let wall = started.elapsed().as_secs_f64();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    anyhow::ensure!(status.success(), "clrbpf record failed:\n{stderr}");
    let (stacks, end, before) =
        naming_of(&stderr).with_context(|| format!("no naming line in the summary:\n{stderr}"))?;
    Ok((
        stacks,
        end,
        before,
        usage.cpu.as_secs_f64(),
        wall - RECORD_SECONDS as f64,
    ))
}

/// `perf record -a -g` for as long, then `perf script`: the CPU seconds of
/// the script (perf's naming) and its stack count.
fn perf_once(inputs: &BenchInputs<'_>) -> anyhow::Result<(f64, u64)> {
    let data = inputs.scratch.join("naming.perf.data");
    let status = Command::new("perf")
        .args(["record", "-q", "-a", "-g", "-F", "99", "-o"])
        .arg(&data)
        .args(["--", "sleep", &RECORD_SECONDS.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("run perf record")?;
    anyhow::ensure!(status.success(), "perf record failed");
    let out = inputs.scratch.join("naming.perf.txt");
    let mut script = Command::new("perf")
        .args(["script", "-i"])
        .arg(&data)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).context("create the perf script output")?)
        .stderr(Stdio::null())
        .spawn()
        .context("run perf script")?;
    let (status, usage) = wait_with_usage(&mut script)?;
    anyhow::ensure!(status.success(), "perf script failed");
    // One blank line ends each sample's stack.
    let samples = std::fs::read_to_string(&out)
        .map(|t| t.lines().filter(|l| l.is_empty()).count() as u64)
        .unwrap_or(0);
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&data);
    Ok((usage.cpu.as_secs_f64(), samples))
}

/// The agent for [`AGENT_RUN`]: (windows, stacks named, naming s, agent
/// CPU s).
fn agent_once(inputs: &BenchInputs<'_>) -> anyhow::Result<(f64, f64, f64, f64)> {
    let windows = inputs.scratch.join("naming-windows");
    let _ = std::fs::remove_dir_all(&windows);
    let port_base = 22000;
    let mut agent = crate::bench::spawn_agent(
        inputs,
        &windows,
        port_base,
        &["--exe", "dotnet", "--upload-interval", AGENT_INTERVAL],
    )?;
    let port = port_base + std::process::id() % 1000;
    thread::sleep(AGENT_RUN);
    let result = (|| {
        let text = get_metrics(port)?;
        let cpu = cpu_seconds(agent.id()).context("the agent exited early")?;
        let get = |name: &str| {
            metric(&text, name).with_context(|| format!("no {name} in /metrics:\n{text}"))
        };
        Ok((
            get("clrbpf_agent_windows_shipped_total{sink=\"directory\"}")?,
            get("clrbpf_agent_stacks_named_total")?,
            get("clrbpf_agent_stack_naming_seconds_total")?,
            cpu,
        ))
    })();
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(agent.id() as libc::pid_t, libc::SIGTERM) };
    let _ = agent.wait();
    let _ = std::fs::remove_dir_all(&windows);
    result
}

pub fn run(inputs: &BenchInputs<'_>, have_perf: bool) -> anyhow::Result<()> {
    println!(
        "\nbench: naming: beside {APPS} warm Demo.dll (.NET 8, no perf maps at their start): the end of `record -a -d {RECORD_SECONDS} -F 99` ({ROUNDS} rounds, interleaved with `perf record -a -g -F 99` + `perf script`), and the agent's {AGENT_INTERVAL} windows over {} s; medians",
        AGENT_RUN.as_secs()
    );
    let mut apps = Vec::new();
    let result = (|| -> anyhow::Result<()> {
        for _ in 0..APPS {
            apps.push(
                inputs
                    .dotnet8_workload("Demo")
                    .arg("900")
                    .env_remove("DOTNET_PerfMapEnabled")
                    .stdout(Stdio::null())
                    .spawn()
                    .context("start Demo.dll")?,
            );
        }
        thread::sleep(Duration::from_secs(5));
        // Warms the unwind-table cache, as a host's second recording finds it.
        record_once(inputs)?;
        let (mut records, mut perfs) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let r = record_once(inputs)?;
            eprintln!(
                "bench: naming: record -a: {} stacks, {:.3} s at the end, {:.3} s before, {:.2} s CPU, exit {:.2} s after -d",
                r.0, r.1, r.2, r.3, r.4
            );
            records.push(r);
            if have_perf {
                let p = perf_once(inputs)?;
                eprintln!(
                    "bench: naming: perf script: {:.2} s CPU, {} samples",
                    p.0, p.1
                );
                perfs.push(p);
            }
        }
        let col = |f: fn(&(u64, f64, f64, f64, f64)) -> f64| {
            median(&mut records.iter().map(f).collect::<Vec<_>>())
        };
        let (stacks, end, before, cpu, exit) = (
            col(|r| r.0 as f64),
            col(|r| r.1),
            col(|r| r.2),
            col(|r| r.3),
            col(|r| r.4),
        );
        println!(
            "| `record -a -d {RECORD_SECONDS}` | distinct stacks named | naming at the end | per stack | naming before the end | clrbpf CPU, whole run | exit after `-d` |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        println!(
            "| clrbpf | {stacks:.0} | {:.0} ms | {:.0} us | {:.0} ms | {cpu:.2} s | {exit:.2} s |",
            end * 1000.0,
            end * 1e6 / stacks.max(1.0),
            before * 1000.0
        );
        if !perfs.is_empty() {
            let script = median(&mut perfs.iter().map(|p| p.0).collect::<Vec<_>>());
            let samples = median(&mut perfs.iter().map(|p| p.1 as f64).collect::<Vec<_>>());
            println!(
                "| perf (`perf script`, {samples:.0} samples) | | {:.0} ms | | 0 | | |",
                script * 1000.0
            );
        }
        let (windows, named, naming, cpu) = agent_once(inputs)?;
        println!(
            "\n| agent, {AGENT_INTERVAL} windows | windows | stacks named per window | naming per window | per stack | share of the agent's CPU |"
        );
        println!("| --- | --- | --- | --- | --- | --- |");
        println!(
            "| clrbpf agent | {windows:.0} | {:.0} | {:.1} ms | {:.0} us | {:.1}% |",
            named / windows.max(1.0),
            naming * 1000.0 / windows.max(1.0),
            naming * 1e6 / named.max(1.0),
            100.0 * naming / cpu.max(f64::MIN_POSITIVE)
        );
        Ok(())
    })();
    for mut app in apps {
        let _ = app.kill();
        let _ = app.wait();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_gives_the_naming_time() {
        let stderr = "clrbpf: recorded 3 samples\nclrbpf: naming 1234 distinct CPU stacks took 0.412 s at the end and 0.051 s before\n";
        assert_eq!(naming_of(stderr), Some((1234, 0.412, 0.051)));
        assert_eq!(naming_of("nothing"), None);
    }

    #[test]
    fn a_counter_is_read_by_its_whole_name() {
        let text = "# TYPE x counter\nclrbpf_agent_stacks_named_total 42\nclrbpf_agent_stacks_named_total_x 1\n";
        assert_eq!(metric(text, "clrbpf_agent_stacks_named_total"), Some(42.0));
        assert_eq!(
            metric(text, "clrbpf_agent_stack_naming_seconds_total"),
            None
        );
    }
}
