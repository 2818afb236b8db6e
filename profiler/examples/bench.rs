//! Micro-benchmarks `cargo xtask bench` runs, kept out of the shipped
//! binary (the library's `bench` feature holds their entry points):
//!
//! - `bench perf-map [--entries N] [--runs R]`: time to parse and index a
//!   perf map of N entries, in memory;
//! - `bench clr-intake --file F [--copies C] [--runs R]`: parse and decode
//!   a nettrace capture (gzip or raw) repeated C times, on one core;
//! - `bench managed-symbol-memory [--budget-mib M]`: RSS growth holding 6
//!   processes' symbols of 200,000 perf map entries each, against the
//!   tables' own estimate, with the default budget or M MiB (0: none).
//!
//! Each prints one line with the median, which xtask reads.

use std::{io::Read as _, path::PathBuf, time::Duration};

use anyhow::Context as _;
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// Time loading a perf map of N entries.
    PerfMap {
        #[arg(long, default_value_t = 100_000)]
        entries: usize,
        #[arg(long, default_value_t = 11)]
        runs: usize,
    },
    /// Time parsing and decoding a nettrace capture, repeated COPIES times.
    ClrIntake {
        #[arg(long)]
        file: PathBuf,
        #[arg(long, default_value_t = 200)]
        copies: usize,
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
    /// RSS of 6 processes' managed symbols against their estimate.
    ManagedSymbolMemory {
        /// The shared budget in MiB; 0 for none.
        #[arg(long, default_value_t = clrbpf::symbolize::managed::DEFAULT_MANAGED_SYMBOL_BUDGET_BYTES >> 20)]
        budget_mib: u64,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().bench {
        Bench::PerfMap { entries, runs } => {
            let mut times: Vec<Duration> = (0..runs.max(1))
                .map(|_| clrbpf::symbolize::managed::bench::bench_perf_map_load(entries))
                .collect();
            times.sort();
            println!(
                "perf map load, {entries} entries: median {:.2} ms over {} runs",
                times[times.len() / 2].as_secs_f64() * 1e3,
                times.len()
            );
        }
        Bench::ClrIntake { file, copies, runs } => clr_intake(&file, copies, runs)?,
        Bench::ManagedSymbolMemory { budget_mib } => {
            const PROCESSES: usize = 6;
            const ENTRIES: usize = 200_000;
            let scratch = std::env::temp_dir().join(format!("clrbpf-bench-{}", std::process::id()));
            let budget = (budget_mib > 0).then_some(budget_mib << 20);
            let measured = clrbpf::symbolize::managed::bench::bench_managed_symbol_memory(
                &scratch, PROCESSES, ENTRIES, budget,
            );
            let _ = std::fs::remove_dir_all(&scratch);
            let m = measured.context("load the synthetic perf maps")?;
            println!(
                "managed symbols, {PROCESSES} processes x {ENTRIES} perf map entries, budget {budget_mib} MiB: RSS +{} MiB, estimate {} MiB ({} B/entry), {} entries held",
                m.rss_growth_bytes >> 20,
                m.estimated_bytes >> 20,
                m.estimated_bytes / m.entries_held.max(1) as u64,
                m.entries_held
            );
        }
    }
    Ok(())
}

fn clr_intake(file: &std::path::Path, copies: usize, runs: usize) -> anyhow::Result<()> {
    use clrbpf_parse::nettrace::bench::{bench_clr_event_intake, replicate_nettrace};
    let raw = std::fs::read(file).with_context(|| format!("read {}", file.display()))?;
    let capture = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .with_context(|| format!("gunzip {}", file.display()))?;
        out
    } else {
        raw
    };
    let stream = replicate_nettrace(&capture, copies.max(1))
        .with_context(|| format!("replicate {}", file.display()))?;
    let mut rates = Vec::new();
    let mut events = 0;
    for _ in 0..runs.max(1) {
        let (n, elapsed) = bench_clr_event_intake(&stream);
        events = n;
        rates.push(n as f64 / elapsed.as_secs_f64().max(1e-9));
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "clr event intake: median {:.0} events/s over {} runs of {events} events, one core",
        rates[rates.len() / 2],
        rates.len()
    );
    Ok(())
}
