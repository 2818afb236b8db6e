//! The managed-symbol sources of a real .NET 8 process started with
//! `DOTNET_PerfMapEnabled=1`, read through the library's API: its perf map
//! and jitdump parse completely and agree, and `ManagedSymbols` names the
//! workload's hot method from them while the process runs.

use std::{collections::BTreeMap, collections::HashSet, path::Path, thread, time::Duration};

use clrbpf::{
    profile::monotonic_ns,
    symbolize::managed::{ManagedSymbols, split_tier},
};
use clrbpf_integration_tests::{Env, Runtime, TestProcess};
use clrbpf_parse::{
    jitdump::{JitDumpLimits, JitDumpParser},
    perf_map::{PerfMapLimits, PerfMapParser},
};

/// Removes the perf files of `pid` when dropped.
struct PerfFiles(u32);

impl Drop for PerfFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/tmp/perf-{}.map", self.0));
        let _ = std::fs::remove_file(format!("/tmp/jit-{}.dump", self.0));
    }
}

/// The start address of the first perf map line naming `method`.
fn perf_map_address(pid: u32, method: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/tmp/perf-{pid}.map")).ok()?;
    text.lines().filter(|l| l.contains(method)).find_map(|l| {
        let start = l.split(' ').next()?;
        u64::from_str_radix(start.trim_start_matches("0x"), 16).ok()
    })
}

#[test]
fn a_real_perf_map_and_jitdump_parse_completely_and_agree() {
    let env = Env::from_env();
    let app = TestProcess::start(&env, Runtime::Net8, "Hot", &["2"], true);
    let files = PerfFiles(app.pid());
    let (status, _) = app.wait(Duration::from_secs(60));
    assert!(status.success(), "Hot exited with {status}");
    let pid = files.0;

    let bytes = std::fs::read(format!("/tmp/perf-{pid}.map")).expect("read the perf map");
    let mut parser = PerfMapParser::new(PerfMapLimits::default());
    let mut perf_names = HashSet::new();
    parser.feed(&bytes, |entry| {
        perf_names.insert(entry.name.into_owned());
    });
    let counts = parser.counts();
    assert_eq!(counts.malformed_lines, 0, "{counts:?}");
    assert_eq!(parser.pending_len(), 0);
    assert!(
        perf_names.iter().any(|n| n.contains("Hot::Spin")),
        "{counts:?}"
    );

    let bytes = std::fs::read(format!("/tmp/jit-{pid}.dump")).expect("read the jitdump");
    let mut parser = JitDumpParser::new(JitDumpLimits::default());
    let mut tiers = BTreeMap::<String, usize>::new();
    let mut jit_names = HashSet::new();
    parser.feed(&bytes, |load| {
        let (_, tier) = split_tier(&load.name);
        *tiers.entry(tier.unwrap_or("-").to_owned()).or_default() += 1;
        jit_names.insert(load.name.into_owned());
    });
    eprintln!(
        "perf map {counts:?}; jitdump {:?} {:?} tiers {tiers:?}",
        parser.header(),
        parser.counts()
    );
    assert_eq!(parser.error(), None);
    assert_eq!(parser.offset(), bytes.len() as u64);
    assert!(
        tiers.contains_key("PreJIT"),
        "ReadyToRun code is in the jitdump: {tiers:?}"
    );
    let missing: Vec<&String> = perf_names.difference(&jit_names).take(5).collect();
    assert!(
        missing.is_empty(),
        "perf map lines missing from the jitdump: {missing:?}"
    );
}

#[test]
fn managed_symbols_name_the_hot_method_of_a_live_process() {
    let env = Env::from_env();
    let app = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], true);
    let _files = PerfFiles(app.pid());
    let mut address = None;
    for _ in 0..200 {
        address = perf_map_address(app.pid(), "Hot::Spin");
        if address.is_some() {
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    let address = address.expect("Hot::Spin in the perf map");
    let mut symbols = ManagedSymbols::new(app.pid());
    for _ in 0..20 {
        symbols.refresh(monotonic_ns());
        if symbols.lookup(address + 1, monotonic_ns()).is_some() {
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    let found = symbols
        .lookup(address + 1, monotonic_ns())
        .unwrap_or_else(|| panic!("no symbol at {address:#x}; {} held", symbols.len()));
    assert!(found.name.contains("Hot::Spin"), "{found:?}");
    assert_eq!(symbols.errors().jitdump_stop, None);
    assert!(Path::new(&format!("/proc/{}", app.pid())).exists());
}
