//! The perf map load benchmark (`cargo xtask bench`, through the `bench`
//! example of this crate, built with the `bench` feature): parse and index
//! a synthetic perf map shaped like a real service's. Not in the shipped
//! binary.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    ManagedSymbols, ManagedSymbolsConfig, SymbolTables, TargetLocation, ingest_perf_map,
    lock_tables,
};
use crate::process::identity::FsIdentity;
use clrbpf_parse::perf_map::PerfMapLimits;

/// A target whose files are under `root` (its perf maps in `root/tmp`),
/// pid 4242 on the host, 7 in its namespace, owned by this user.
pub fn synthetic_location(root: PathBuf) -> TargetLocation {
    TargetLocation {
        pid: 4242,
        ns_pid: 7,
        root,
        perf_dir: PathBuf::from("/tmp"),
        legacy_perf_map_dir: PathBuf::from("/tmp"),
        owner: Some(FsIdentity::current()),
        started_at: None,
    }
}

/// A perf map of `entries` lines shaped like a real .NET service's: stubs
/// and methods from two code heaps interleaved (so not sorted), tiers,
/// generic signatures.
pub fn synthetic_perf_map(entries: usize) -> Vec<u8> {
    use std::fmt::Write as _;
    const TIERS: &[&str] = &[
        "QuickJitted",
        "OptimizedTier1",
        "Optimized",
        "OptimizedTier1OSR",
    ];
    let mut text = String::with_capacity(entries * 120);
    let (mut stubs, mut methods) = (0x7f5c_2d98_0000u64, 0x7f5c_2da4_0000u64);
    for i in 0..entries {
        let line = if i % 4 == 0 {
            let size = 0x18 + (i as u64 % 7) * 0x30;
            let line = format!(
                "0x{stubs:x} {size:x} stub<{}> AllocateTemporaryEntryPoints<PRECODE_STUB>",
                i / 4 + 1
            );
            stubs += size;
            line
        } else {
            let size = 0x40 + (i as u64 * 37) % 0x600;
            let tier = TIERS[i % TIERS.len()];
            let line = if i % 3 == 0 {
                format!(
                    "0x{methods:x} {size:x} !!1 [System.Linq] System.Linq.Enumerable{i}::Sum(class \
                     [System.Runtime]System.Collections.Generic.IEnumerable`1<!!0>)[{tier}]"
                )
            } else {
                format!(
                    "0x{methods:x} {size:x} int64 [App.Service{}] App.Service.Worker{i}::Run(int64,class \
                     System.String)[{tier}]",
                    i % 50
                )
            };
            methods += size + 0x10;
            line
        };
        let _ = writeln!(text, "{line}");
    }
    text.into_bytes()
}

/// Benchmark: time to parse and index a perf map of `entries` lines (made by
/// [`synthetic_perf_map`] beforehand, in memory, so the file system is not
/// measured). Budget: 50 ms for 100,000 entries, release build.
pub fn bench_perf_map_load(entries: usize) -> Duration {
    let text = synthetic_perf_map(entries);
    let config = ManagedSymbolsConfig {
        perf_map: PerfMapLimits {
            max_entries: u64::try_from(entries).unwrap_or(u64::MAX),
            ..PerfMapLimits::default()
        },
        ..ManagedSymbolsConfig::default()
    };
    let location = TargetLocation {
        pid: 0,
        ns_pid: 0,
        root: PathBuf::from("/nonexistent"),
        perf_dir: PathBuf::from("/tmp"),
        legacy_perf_map_dir: PathBuf::from("/tmp"),
        owner: Some(FsIdentity::current()),
        started_at: None,
    };
    let started = Instant::now();
    let mut symbols = ManagedSymbols::at(location, config);
    let tables = Arc::clone(&symbols.tables);
    let mut tables = lock_tables(&tables);
    let SymbolTables {
        index, interner, ..
    } = &mut *tables;
    let (added, _) = ingest_perf_map(&mut symbols.perf_map, index, interner, &text, 1, u64::MAX);
    index.commit();
    drop(tables);
    let elapsed = started.elapsed();
    assert_eq!(
        added,
        u64::try_from(entries).unwrap_or(u64::MAX),
        "the synthetic perf map parses completely"
    );
    std::hint::black_box(&symbols);
    elapsed
}

/// What [`bench_managed_symbol_memory`] measured.
#[derive(Clone, Copy, Debug)]
pub struct SymbolMemory {
    /// Growth of this process's resident set while the symbols loaded.
    pub rss_growth_bytes: u64,
    /// What the tables say they hold ([`ManagedSymbols::memory_bytes`]).
    pub estimated_bytes: u64,
    /// Entries held after the budget's evictions.
    pub entries_held: usize,
}

/// Loads a synthetic perf map of `entries` lines for each of `processes`
/// targets (files in a scratch root under `scratch`), with a shared budget
/// of `budget_bytes` or none, and measures this process's RSS growth
/// against the tables' own estimate. Run it in a process of its own: the
/// RSS is the whole process's.
pub fn bench_managed_symbol_memory(
    scratch: &std::path::Path,
    processes: usize,
    entries: usize,
    budget_bytes: Option<u64>,
) -> std::io::Result<SymbolMemory> {
    let map = synthetic_perf_map(entries);
    let mut locations = Vec::new();
    for i in 0..processes {
        let root = scratch.join(format!("target-{i}"));
        std::fs::create_dir_all(root.join("tmp"))?;
        std::fs::write(root.join("tmp/perf-7.map"), &map)?;
        locations.push(synthetic_location(root));
    }
    let config = ManagedSymbolsConfig {
        perf_map: PerfMapLimits {
            max_entries: u64::try_from(entries).unwrap_or(u64::MAX),
            ..PerfMapLimits::default()
        },
        ..ManagedSymbolsConfig::default()
    };
    let budget = budget_bytes.map(super::ManagedSymbolBudget::new);
    let procfs = crate::process::ProcFs::default();
    let resident_bytes = || {
        procfs
            .resident_bytes("self")
            .ok_or_else(|| std::io::Error::other("no resident set in /proc/self/statm"))
    };
    let before = resident_bytes()?;
    let mut all: Vec<ManagedSymbols> = locations
        .into_iter()
        .map(|location| match &budget {
            Some(budget) => ManagedSymbols::at_with_budget(location, config, budget),
            None => ManagedSymbols::at(location, config),
        })
        .collect();
    for (i, symbols) in all.iter_mut().enumerate() {
        symbols.refresh(i as u64);
    }
    let after = resident_bytes()?;
    Ok(SymbolMemory {
        rss_growth_bytes: after.saturating_sub(before),
        estimated_bytes: all.iter().map(ManagedSymbols::memory_bytes).sum(),
        entries_held: all.iter().map(ManagedSymbols::len).sum(),
    })
}
