//! `cargo xtask bench`, churn soak (issue 10): what runs for weeks on a
//! node must not grow with the processes the node starts. `record -a`, then
//! the agent, each for ten minutes (`CLRBPF_BENCH_SOAK_SECONDS` shortens
//! it) while `sh -c :` starts 40 times a second and a short .NET 8 app every
//! 3 s: clrbpf's RSS and open files at 2 minutes and at the end, and what
//! its bounded caches evicted. `record` keeps one window, whose profile
//! holds every exited process's samples; the agent starts every window
//! empty. perf would grow here too (perf.data holds every sample), so no
//! comparison row.

use std::{
    fs,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::bench::BenchInputs;

const NATIVE_PER_SECOND: u32 = 40;
const APP_EVERY: Duration = Duration::from_secs(3);
const EARLY_MARK: Duration = Duration::from_secs(120);

/// RSS (KiB) and open files of a process.
fn footprint(pid: u32) -> Option<(u64, usize)> {
    let rss = crate::bench_steady::rss_kib(pid)?;
    let fds = fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some((rss, fds))
}

fn soak_seconds() -> u64 {
    std::env::var("CLRBPF_BENCH_SOAK_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&s: &u64| s >= 30)
        .unwrap_or(600)
}

/// The profiler a soak runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Soaked {
    Record,
    Agent,
}

/// What one soak measured.
struct Soak {
    natives: u64,
    apps: u64,
    failed_apps: u64,
    early: Option<(u64, usize)>,
    late: Option<(u64, usize)>,
    /// From `record`'s summary (the agent prints none).
    exited: Option<u64>,
    evictions: Option<String>,
}

pub fn run(inputs: &BenchInputs<'_>) -> anyhow::Result<()> {
    let seconds = soak_seconds();
    println!(
        "\nbench: churn soak: record -a, then the agent, each for {seconds} s while sh -c : starts {NATIVE_PER_SECOND}/s and a .NET 8 app (Hot, 1.5 s) every {} s",
        APP_EVERY.as_secs()
    );
    let record = soak(inputs, seconds, Soaked::Record)?;
    let agent = soak(inputs, seconds, Soaked::Agent)?;
    let show = |f: Option<(u64, usize)>| {
        f.map_or("?".to_owned(), |(rss, fds)| {
            format!("{:.1} MiB, {fds} fds", rss as f64 / 1024.0)
        })
    };
    let growth = |s: &Soak| match (s.early, s.late) {
        (Some((a, _)), Some((b, _))) => {
            format!("{:+.1}%", 100.0 * (b as f64 - a as f64) / a as f64)
        }
        _ => "?".to_owned(),
    };
    println!(
        "| churn soak | clrbpf record -a (one window) | clrbpf agent (defaults: 15 s windows) |"
    );
    println!("| --- | --- | --- |");
    println!(
        "| processes started | {} native, {} .NET ({} failed) | {} native, {} .NET ({} failed) |",
        record.natives,
        record.apps,
        record.failed_apps,
        agent.natives,
        agent.apps,
        agent.failed_apps
    );
    println!(
        "| processes exited, seen by clrbpf | {} | (no summary) |",
        record.exited.map_or("?".to_owned(), |n| n.to_string())
    );
    println!(
        "| at 2 min | {} | {} |",
        show(record.early),
        show(agent.early)
    );
    println!(
        "| at the end ({seconds} s) | {} | {} |",
        show(record.late),
        show(agent.late)
    );
    println!(
        "| RSS growth after 2 min (budget <= 10%) | {} | {} |",
        growth(&record),
        growth(&agent)
    );
    println!(
        "| evicted | {} | (no summary) |",
        record.evictions.as_deref().unwrap_or("(no line)")
    );
    let _ = agent.exited;
    Ok(())
}

/// Runs the churn for `seconds` under one profiler.
fn soak(inputs: &BenchInputs<'_>, seconds: u64, soaked: Soaked) -> anyhow::Result<Soak> {
    let stderr_path = inputs.scratch.join("churn.stderr");
    let stderr_file = fs::File::create(&stderr_path).context("create the churn log")?;
    let mut clrbpf = match soaked {
        Soaked::Record => Command::new(inputs.clrbpf)
            .args(["record", "-v", "-a", "-d", &seconds.to_string(), "-o"])
            .arg(inputs.scratch.join("churn.pb.gz"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr_file)
            .spawn()
            .context("start clrbpf")?,
        Soaked::Agent => {
            let windows = inputs.scratch.join("churn-windows");
            let _ = fs::remove_dir_all(&windows);
            fs::create_dir_all(&windows).context("create the agent's window directory")?;
            crate::bench::spawn_agent(inputs, &windows, 19000, &[])?
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let natives = Arc::new(AtomicU64::new(0));
    let churn = {
        let (stop, natives) = (stop.clone(), natives.clone());
        thread::spawn(move || {
            let step = Duration::from_secs(1) / NATIVE_PER_SECOND;
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mut child) = Command::new("sh").args(["-c", ":"]).spawn() {
                    let _ = child.wait();
                    natives.fetch_add(1, Ordering::Relaxed);
                }
                next += step;
                thread::sleep(next.saturating_duration_since(Instant::now()));
            }
        })
    };
    let app = [
        inputs.dotnet8.as_os_str().to_owned(),
        inputs.workloads.join("net8/Hot.dll").into_os_string(),
        "1.5".into(),
    ];
    let started = Instant::now();
    let total = Duration::from_secs(seconds);
    let mut early = None;
    let mut late = None;
    let mut apps = 0u64;
    let mut failed_apps = 0u64;
    let mut next_app = Duration::ZERO;
    while started.elapsed() < total.saturating_sub(Duration::from_secs(5)) {
        if started.elapsed() >= next_app {
            next_app += APP_EVERY;
            let status = Command::new(&app[0])
                .args(&app[1..])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            apps += 1;
            if !status.is_ok_and(|s| s.success()) {
                failed_apps += 1;
            }
        }
        if early.is_none() && started.elapsed() >= EARLY_MARK {
            early = footprint(clrbpf.id());
        }
        late = footprint(clrbpf.id()).or(late);
        thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = churn.join();
    if soaked == Soaked::Agent {
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(clrbpf.id() as i32, libc::SIGTERM) };
    }
    let status = clrbpf.wait().context("wait for clrbpf")?;
    if !status.success() {
        let stderr = fs::read_to_string(&stderr_path).unwrap_or_default();
        anyhow::bail!("clrbpf under churn exited with {status}:\n{stderr}");
    }
    let stderr = fs::read_to_string(&stderr_path).unwrap_or_default();
    let evictions = stderr
        .lines()
        .find_map(|l| l.split("caches stayed within their caps by ").nth(1))
        .map(str::to_owned);
    let exited = stderr.lines().find_map(|l| {
        l.strip_prefix("clrbpf: ")?
            .split(" processes exited")
            .next()?
            .parse::<u64>()
            .ok()
    });
    Ok(Soak {
        natives: natives.load(Ordering::Relaxed),
        apps,
        failed_apps,
        early,
        late,
        exited,
        evictions,
    })
}
