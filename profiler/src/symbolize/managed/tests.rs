//! Unit tests of [`super::ManagedSymbols`]: perf map and jitdump parsing,
//! reading a target's files, naming frames over time.

use super::bench::{bench_perf_map_load, synthetic_location, synthetic_perf_map};
use super::*;
use std::io::Write;

#[test]
fn split_tier_strips_only_tiers() {
    let cases = [
        (
            "int64 [Hot] Hot::Spin(int64)[QuickJitted]",
            ("int64 [Hot] Hot::Spin(int64)", Some("QuickJitted")),
        ),
        (
            "int64 [App] Hot::Spin(int64)[OptimizedTier1OSR]",
            ("int64 [App] Hot::Spin(int64)", Some("OptimizedTier1OSR")),
        ),
        (
            "void [System.Private.CoreLib] System.AppContext::Setup(char**,char**,int32)[PreJIT]",
            (
                "void [System.Private.CoreLib] System.AppContext::Setup(char**,char**,int32)",
                Some("PreJIT"),
            ),
        ),
        ("f()[PreJit-cold]", ("f()", Some("PreJit-cold"))),
        ("f()[FutureTier2]", ("f()", Some("FutureTier2"))),
        // A known tier after a name that does not end in ')'.
        ("odd[Optimized]", ("odd", Some("Optimized"))),
        // Not tiers.
        (
            "stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>",
            ("stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>", None),
        ),
        ("Foo`1[System.__Canon]", ("Foo`1[System.__Canon]", None)),
        ("f()[two words]", ("f()[two words]", None)),
        ("f()[]", ("f()[]", None)),
        ("[QuickJitted]", ("[QuickJitted]", None)),
        ("x]", ("x]", None)),
        ("", ("", None)),
        ("f()[Tier\u{e9}]", ("f()[Tier\u{e9}]", None)),
    ];
    for (raw, want) in cases {
        assert_eq!(split_tier(raw), want, "{raw}");
    }
}

#[test]
fn assembly_is_the_bracket_before_the_type() {
    let cases = [
        ("int64 [Hot] Hot::Spin(int64)", Some("Hot")),
        (
            "instance void [System.Private.CoreLib] System.Collections.Generic.Dictionary`2[System.__Canon,System.__Canon]::.ctor(int32)",
            Some("System.Private.CoreLib"),
        ),
        (
            "valuetype System.ReadOnlySpan`1<!!1> [System.Private.CoreLib] System.Runtime.InteropServices.MemoryMarshal::Cast(valuetype System.ReadOnlySpan`1<!!0>)",
            Some("System.Private.CoreLib"),
        ),
        (
            "class [System.Runtime]System.String [App] App::Name(class [System.Runtime]System.Object)",
            Some("App"),
        ),
        ("int32[] [App] Hot::Arr(int32)", Some("App")),
        ("[Lead] X::Y()", Some("Lead")),
        ("stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>", None),
        ("f(class [A] B)", None),
        ("x [unterminated", None),
        ("x [] y()", None),
    ];
    for (name, want) in cases {
        assert_eq!(assembly_of(name), want, "{name}");
    }
}

#[test]
fn symbol_from_a_real_name() {
    let mut interner = SymbolInterner::default();
    let symbol = ManagedSymbol::from_raw_name(
        "int64 [Hot] Hot::Spin(int64)[QuickJitted]",
        0x7f3684c12170,
        0x9a,
        &mut interner,
    );
    assert_eq!(&*symbol.name, "int64 [Hot] Hot::Spin(int64)");
    assert_eq!(symbol.jit_tier.as_deref(), Some("QuickJitted"));
    assert_eq!(
        &*symbol.raw_name,
        "int64 [Hot] Hot::Spin(int64)[QuickJitted]"
    );
    assert_eq!(symbol.assembly.as_deref(), Some("Hot"));
    assert!(!symbol.is_stub);
    assert_eq!(symbol.end(), 0x7f3684c1220a);
    let stub = ManagedSymbol::from_raw_name(
        "stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>",
        0x7f3684b50000,
        0xd8,
        &mut interner,
    );
    assert!(stub.is_stub);
    assert!(Arc::ptr_eq(&stub.name, &stub.raw_name));
    assert_eq!(stub.jit_tier, None);
    let other =
        ManagedSymbol::from_raw_name("void [Hot] Hot::Main()[QuickJitted]", 1, 1, &mut interner);
    let (Some(a), Some(b)) = (&symbol.jit_tier, &other.jit_tier) else {
        panic!("tiers expected");
    };
    assert!(Arc::ptr_eq(a, b), "tiers are interned");
}

/// A fake target: `<root>/tmp` with writable perf files.
pub(super) struct Target {
    _dir: tempfile::TempDir,
    pub(super) location: TargetLocation,
}

impl Target {
    pub(super) fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("tmp")).expect("mkdir");
        Self {
            _dir: dir,
            location: synthetic_location(root),
        }
    }

    fn host_path(&self, name: &str) -> PathBuf {
        self.location.root.join("tmp").join(name)
    }

    pub(super) fn append(&self, name: &str, bytes: &[u8]) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.host_path(name))
            .expect("open");
        file.write_all(bytes).expect("write");
    }

    fn symbols(&self) -> ManagedSymbols {
        ManagedSymbols::at(self.location.clone(), ManagedSymbolsConfig::default())
    }
}

/// First stub and first method of [`synthetic_perf_map`].
const SYNTHETIC_STUB: u64 = 0x7f5c_2d98_0000;
const SYNTHETIC_METHOD: u64 = 0x7f5c_2da4_0000;

fn synthetic_targets(n: usize, entries: usize) -> Vec<Target> {
    let map = synthetic_perf_map(entries);
    (0..n)
        .map(|_| {
            let target = Target::new();
            target.append("perf-7.map", &map);
            target
        })
        .collect()
}

fn perf_map_config(entries: usize) -> ManagedSymbolsConfig {
    ManagedSymbolsConfig {
        perf_map: PerfMapLimits {
            max_entries: entries as u64,
            ..PerfMapLimits::default()
        },
        ..ManagedSymbolsConfig::default()
    }
}

/// The symbols of `targets` (perf maps of `entries` entries), all charged
/// to one budget with room for `halves` halves of one of them (measured
/// on a probe of the first, read on its own).
fn sharing_a_budget(
    targets: &[Target],
    entries: usize,
    halves: u64,
) -> (ManagedSymbolBudget, Vec<ManagedSymbols>) {
    let mut probe = ManagedSymbols::at(targets[0].location.clone(), perf_map_config(entries));
    probe.refresh(1);
    let budget = ManagedSymbolBudget::new(probe.memory_bytes() * halves / 2);
    let all = targets
        .iter()
        .map(|t| {
            ManagedSymbols::at_with_budget(t.location.clone(), perf_map_config(entries), &budget)
        })
        .collect();
    (budget, all)
}

#[test]
fn many_large_perf_maps_stay_within_the_budget() {
    const ENTRIES: usize = 20_000;
    let targets = synthetic_targets(8, ENTRIES);
    // One process's tables, measured without a budget.
    let mut alone = ManagedSymbols::at(targets[0].location.clone(), perf_map_config(ENTRIES));
    alone.refresh(1);
    let one = alone.memory_bytes();
    assert!(
        one > (ENTRIES * 100) as u64,
        "{one} bytes for {ENTRIES} entries"
    );
    // Room for about two and a half processes.
    let budget = ManagedSymbolBudget::new(one * 5 / 2);
    let mut all: Vec<ManagedSymbols> = targets
        .iter()
        .map(|t| {
            ManagedSymbols::at_with_budget(t.location.clone(), perf_map_config(ENTRIES), &budget)
        })
        .collect();
    for (i, symbols) in all.iter_mut().enumerate() {
        symbols.refresh(10 + i as u64);
        assert_eq!(symbols.len(), ENTRIES);
        let stats = budget.stats();
        assert!(stats.used_bytes <= stats.limit_bytes, "{stats:?}");
    }
    let stats = budget.stats();
    let held: u64 = all.iter().map(ManagedSymbols::memory_bytes).sum();
    assert_eq!(stats.used_bytes, held, "the book matches the tables");
    assert_eq!(stats.processes, 8);
    assert_eq!(stats.evictions, 6, "{stats:?}");
    assert!(stats.peak_bytes <= stats.limit_bytes);
    // The least recently used went first: the last two are whole.
    let evicted: Vec<bool> = all.iter().map(ManagedSymbols::is_evicted).collect();
    assert_eq!(evicted, [true, true, true, true, true, true, false, false]);
    assert!(all[7].lookup(SYNTHETIC_STUB + 1, 0).is_some());
    assert!(all[0].lookup(SYNTHETIC_STUB + 1, 0).is_none());
    drop(all);
    let stats = budget.stats();
    assert_eq!((stats.used_bytes, stats.processes), (0, 0));
}

#[test]
fn an_evicted_process_resolves_again_after_a_refresh() {
    const ENTRIES: usize = 5_000;
    let targets = synthetic_targets(3, ENTRIES);
    // Room for one process, not two.
    let (budget, mut all) = sharing_a_budget(&targets, ENTRIES, 3);
    all[0].refresh(1);
    let method = all[0].lookup(SYNTHETIC_METHOD + 1, 1).expect("a method");
    // Charging the second drops the first.
    all[1].refresh(2);
    assert!(all[0].is_evicted());
    assert!(all[0].lookup(SYNTHETIC_METHOD + 1, 1).is_none());
    assert_eq!(all[0].len(), 0);
    all[0].refresh(3);
    assert!(!all[0].is_evicted());
    assert_eq!(all[0].len(), ENTRIES, "the whole perf map was read again");
    assert_eq!(all[0].lookup(SYNTHETIC_METHOD + 1, 1), Some(method));
    assert!(all[1].is_evicted());
    let stats = budget.stats();
    assert_eq!(stats.evictions, 2);
    assert_eq!(stats.reloads, 1);
    assert!(stats.evicted_bytes > 0);
    // A lookup counts as use: the one looked up outlives the other.
    all[2].refresh(4);
    assert!(all[0].is_evicted());
    all[1].refresh(5);
    all[2].refresh(6);
    let _ = all[2].lookup(SYNTHETIC_METHOD + 1, 1);
    all[0].refresh(7);
    assert!(all[1].is_evicted() && all[2].is_evicted());
    assert_eq!(budget.stats().used_bytes, all[0].memory_bytes());
}

#[test]
fn a_process_with_methods_from_events_is_never_dropped() {
    const ENTRIES: usize = 2_000;
    let targets = synthetic_targets(2, ENTRIES);
    let budget = ManagedSymbolBudget::new(1 << 20);
    let mut from_events = ManagedSymbols::at_with_budget(
        targets[0].location.clone(),
        perf_map_config(ENTRIES),
        &budget,
    );
    assert!(from_events.insert_method(0x1000, 0x10, "void [A] A::B()[PreJIT]", 0));
    from_events.refresh(1);
    let mut other = ManagedSymbols::at_with_budget(
        targets[1].location.clone(),
        perf_map_config(ENTRIES),
        &budget,
    );
    other.refresh(2);
    other.refresh(3);
    assert!(!from_events.is_evicted());
    assert!(from_events.lookup(0x1008, 1).is_some());
}

#[test]
fn lookups_mark_a_process_as_used() {
    const ENTRIES: usize = 2_000;
    let targets = synthetic_targets(3, ENTRIES);
    // Room for two processes, not three.
    let (_budget, mut all) = sharing_a_budget(&targets, ENTRIES, 5);
    all[0].refresh(1);
    all[1].refresh(2);
    assert!(all[0].lookup(SYNTHETIC_STUB, 1).is_some());
    all[2].refresh(3);
    assert!(!all[0].is_evicted(), "looked up after the second was read");
    assert!(all[1].is_evicted());
}

pub(super) fn jitdump_header() -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&0x4A69_5444u32.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&40u32.to_le_bytes());
    out.extend_from_slice(&62u32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&7u32.to_le_bytes());
    out.extend_from_slice(&1000u64.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out
}

pub(super) fn code_load(timestamp_ns: u64, addr: u64, code_size: u64, name: &str) -> Vec<u8> {
    let total = 56 + name.len() + 1 + code_size as usize;
    let mut out = Vec::new();
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(total as u32).to_le_bytes());
    out.extend_from_slice(&timestamp_ns.to_le_bytes());
    out.extend_from_slice(&7u32.to_le_bytes());
    out.extend_from_slice(&8u32.to_le_bytes());
    out.extend_from_slice(&addr.to_le_bytes());
    out.extend_from_slice(&addr.to_le_bytes());
    out.extend_from_slice(&code_size.to_le_bytes());
    out.extend_from_slice(&1u64.to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    out.resize(total, 0xcc);
    out
}

fn lookup_name(symbols: &ManagedSymbols, addr: u64, time: u64) -> Option<String> {
    symbols.lookup(addr, time).map(|s| s.raw_name.to_string())
}

#[test]
fn missing_files_are_not_errors() {
    let target = Target::new();
    let mut symbols = target.symbols();
    let stats = symbols.refresh(1);
    assert_eq!(stats.perf_map.status, FileStatus::Missing);
    assert_eq!(stats.jitdump.status, FileStatus::Missing);
    assert_eq!(symbols.errors(), ManagedSymbolErrors::default());
    assert_eq!(symbols.files().perf_map, Path::new("/tmp/perf-7.map"));
    assert_eq!(symbols.files().jitdump, Path::new("/tmp/jit-7.dump"));
    // A process that is gone: its root does not exist either.
    let mut gone = ManagedSymbols::at(
        TargetLocation {
            root: target.location.root.join("nope"),
            ..target.location.clone()
        },
        ManagedSymbolsConfig::default(),
    );
    assert_eq!(gone.refresh(1).perf_map.status, FileStatus::Missing);
}

#[test]
fn perf_map_lines_are_read_incrementally_and_stamped_when_read() {
    let target = Target::new();
    let mut symbols = target.symbols();
    target.append(
        "perf-7.map",
        b"0x1000 10 void [A] A::F()[QuickJitted]\n0x2000 10 void [A] A::",
    );
    let stats = symbols.refresh(100);
    assert_eq!(stats.perf_map.status, FileStatus::Read);
    assert_eq!(stats.perf_map.symbols_added, 1);
    assert_eq!(
        lookup_name(&symbols, 0x1005, 100).as_deref(),
        Some("void [A] A::F()[QuickJitted]")
    );
    assert_eq!(
        lookup_name(&symbols, 0x2005, 100),
        None,
        "partial line waits"
    );
    target.append("perf-7.map", b"G()[OptimizedTier1]\n");
    let stats = symbols.refresh(200);
    assert_eq!(stats.perf_map.symbols_added, 1);
    assert_eq!(stats.perf_map.bytes_read, 20);
    let g = symbols.lookup(0x2005, 300).expect("G");
    assert_eq!(&*g.name, "void [A] A::G()");
    assert_eq!(g.jit_tier.as_deref(), Some("OptimizedTier1"));
    // Re-JIT of F at G's freed address, read at t=300.
    target.append("perf-7.map", b"0x2000 8 void [A] A::F()[OptimizedTier1]\n");
    symbols.refresh(300);
    assert_eq!(
        lookup_name(&symbols, 0x2005, 250).as_deref(),
        Some("void [A] A::G()[OptimizedTier1]")
    );
    assert_eq!(
        lookup_name(&symbols, 0x2005, 300).as_deref(),
        Some("void [A] A::F()[OptimizedTier1]")
    );
    // Before anything was read: the oldest entry.
    assert_eq!(
        lookup_name(&symbols, 0x2005, 5).as_deref(),
        Some("void [A] A::G()[OptimizedTier1]")
    );
    assert_eq!(symbols.len(), 3);
    assert_eq!(symbols.refresh(400).perf_map.bytes_read, 0);
}

#[test]
fn jitdump_is_preferred_and_uses_its_timestamps() {
    let target = Target::new();
    let mut symbols = target.symbols();
    target.append("perf-7.map", b"0x1000 10 from perf map()\n");
    let mut dump = jitdump_header();
    dump.extend(code_load(
        5_000,
        0x1000,
        0x10,
        "void [A] A::F()[QuickJitted]",
    ));
    dump.extend(code_load(6_000, 0x3000, 0x10, "void [B] B::R2R()[PreJIT]"));
    target.append("jit-7.dump", &dump[..dump.len() - 3]);
    let stats = symbols.refresh(1_000_000);
    assert_eq!(stats.jitdump.status, FileStatus::Read);
    assert_eq!(
        stats.jitdump.symbols_added, 2,
        "the name is complete, code bytes may lag"
    );
    assert_eq!(stats.perf_map.status, FileStatus::NotNeeded);
    let f = symbols.lookup(0x1008, 5_000).expect("F");
    assert_eq!(&*f.name, "void [A] A::F()");
    let r2r = symbols.lookup(0x3000, 7_000).expect("R2R");
    assert_eq!(r2r.jit_tier.as_deref(), Some("PreJIT"));
    assert_eq!(r2r.assembly.as_deref(), Some("B"));
    target.append("jit-7.dump", &dump[dump.len() - 3..]);
    // Same address reused later.
    target.append(
        "jit-7.dump",
        &code_load(9_000, 0x1000, 0x10, "void [A] A::H()[QuickJitted]"),
    );
    let stats = symbols.refresh(2_000_000);
    assert_eq!(stats.jitdump.symbols_added, 1);
    assert_eq!(
        lookup_name(&symbols, 0x1008, 8_999).as_deref(),
        Some("void [A] A::F()[QuickJitted]")
    );
    assert_eq!(
        lookup_name(&symbols, 0x1008, 9_000).as_deref(),
        Some("void [A] A::H()[QuickJitted]")
    );
    assert_eq!(
        symbols.errors().perf_map,
        PerfMapCounts::default(),
        "perf map not read"
    );
}

#[test]
fn a_corrupt_jitdump_falls_back_to_the_perf_map() {
    let target = Target::new();
    let mut symbols = target.symbols();
    let mut dump = jitdump_header();
    dump.extend(code_load(
        5_000,
        0x1000,
        0x10,
        "void [A] A::F()[QuickJitted]",
    ));
    let mut bad = code_load(6_000, 0x2000, 0x10, "void [A] A::G()[QuickJitted]");
    bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    dump.extend(bad);
    target.append("jit-7.dump", &dump);
    target.append(
        "perf-7.map",
        b"0x1000 10 void [A] A::F()[QuickJitted]\n0x2000 10 void [A] A::G()[QuickJitted]\n",
    );
    let stats = symbols.refresh(10_000);
    assert_eq!(stats.jitdump.status, FileStatus::Stopped);
    assert_eq!(stats.jitdump.symbols_added, 1);
    assert_eq!(stats.perf_map.status, FileStatus::Read);
    assert_eq!(stats.perf_map.symbols_added, 2);
    assert!(matches!(
        symbols.errors().jitdump_stop,
        Some(JitDumpError::RecordTooLarge { .. })
    ));
    // F keeps its jitdump time; G comes from the perf map.
    assert_eq!(symbols.lookup(0x1000, 5_000).map(|s| s.start), Some(0x1000));
    assert_eq!(
        lookup_name(&symbols, 0x2000, 20_000).as_deref(),
        Some("void [A] A::G()[QuickJitted]")
    );
    // Stopped stays stopped (no spinning on the same bytes).
    let stats = symbols.refresh(20_000);
    assert_eq!(stats.jitdump.status, FileStatus::Stopped);
    assert_eq!(stats.jitdump.bytes_read, 0);
}

#[test]
fn a_replaced_or_truncated_file_is_parsed_again() {
    let target = Target::new();
    let mut symbols = target.symbols();
    target.append("perf-7.map", b"0x1000 10 first()\n0x1100 10 second()\n");
    symbols.refresh(100);
    // Rewritten shorter (truncated), then a new file (new inode).
    std::fs::write(target.host_path("perf-7.map"), b"0x5000 10 third()\n").expect("write");
    let stats = symbols.refresh(200);
    assert!(stats.perf_map.restarted);
    assert_eq!(
        lookup_name(&symbols, 0x5000, 200).as_deref(),
        Some("third()")
    );
    std::fs::remove_file(target.host_path("perf-7.map")).expect("rm");
    target.append(
        "perf-7.map",
        b"0x6000 10 fourth()\n0x7000 10 fifth()\n0x8000 10 sixth()\n",
    );
    let stats = symbols.refresh(300);
    assert!(stats.perf_map.restarted);
    assert_eq!(stats.perf_map.symbols_added, 3);
    // Same length or longer but different first bytes.
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open(target.host_path("perf-7.map"))
        .expect("open");
    file.write_all(b"0x9000 10 other1()\n0x9100 10 other2()\n0x9200 10 other3()\n0x9300 10 x()\n")
        .expect("write");
    let stats = symbols.refresh(400);
    assert!(stats.perf_map.restarted);
    assert_eq!(stats.perf_map.symbols_added, 4);
    assert_eq!(symbols.errors().restarts, 3);
    // Old entries stay for the time they were valid.
    assert_eq!(
        lookup_name(&symbols, 0x1000, 150).as_deref(),
        Some("first()")
    );
}

#[test]
fn a_removed_jitdump_is_reported_missing_and_read_again_when_recreated() {
    // Another recorder attached to the same process ends: it turns the
    // runtime's perf maps off and removes the files under this reader.
    let target = Target::new();
    let mut symbols = target.symbols();
    let mut bytes = jitdump_header();
    bytes.extend(code_load(
        100,
        0x1000,
        16,
        "void [A] A::F()[OptimizedTier1]",
    ));
    target.append("jit-7.dump", &bytes);
    assert_eq!(symbols.refresh(200).jitdump.symbols_added, 1);
    std::fs::remove_file(target.host_path("jit-7.dump")).expect("rm");
    let stats = symbols.refresh(300);
    assert_eq!(
        stats.jitdump.status,
        FileStatus::Missing,
        "what the pipeline re-enables on"
    );
    // Turned on again: a new file with every method replayed.
    let mut bytes = jitdump_header();
    bytes.extend(code_load(
        400,
        0x1000,
        16,
        "void [A] A::F()[OptimizedTier1]",
    ));
    bytes.extend(code_load(
        400,
        0x2000,
        16,
        "void [A] A::G()[OptimizedTier1]",
    ));
    target.append("jit-7.dump", &bytes);
    let stats = symbols.refresh(500);
    assert!(stats.jitdump.restarted);
    assert_eq!(stats.jitdump.symbols_added, 2);
    assert_eq!(
        lookup_name(&symbols, 0x2000, 500).as_deref(),
        Some("void [A] A::G()[OptimizedTier1]")
    );
}

#[test]
fn a_symlinked_perf_map_is_not_followed() {
    let target = Target::new();
    let outside = target
        .location
        .root
        .parent()
        .expect("parent")
        .join("outside.map");
    std::fs::write(&outside, b"0x1000 10 secret()\n").expect("write");
    std::os::unix::fs::symlink(&outside, target.host_path("perf-7.map")).expect("symlink");
    let mut symbols = target.symbols();
    let stats = symbols.refresh(1);
    assert_eq!(stats.perf_map.status, FileStatus::Failed);
    assert!(symbols.lookup(0x1000, 1).is_none());
    let errors = symbols.errors();
    assert_eq!(errors.open_errors, 1);
    assert!(errors.last_io_error.is_some());
}

#[test]
fn the_byte_bound_spreads_a_big_file_over_refreshes() {
    let target = Target::new();
    let config = ManagedSymbolsConfig {
        max_bytes_per_refresh: 10,
        ..ManagedSymbolsConfig::default()
    };
    let mut symbols = ManagedSymbols::at(target.location.clone(), config);
    target.append("perf-7.map", b"0x1000 10 a()\n0x2000 10 b()\n");
    assert_eq!(symbols.refresh(1).perf_map.bytes_read, 10);
    assert_eq!(symbols.refresh(2).perf_map.symbols_added, 1);
    assert_eq!(symbols.refresh(3).perf_map.symbols_added, 1);
    assert_eq!(symbols.len(), 2);
}

#[test]
fn one_process_of_long_names_is_bounded_in_bytes() {
    let target = Target::new();
    let config = ManagedSymbolsConfig {
        max_table_bytes: 256 << 10,
        ..ManagedSymbolsConfig::default()
    };
    let mut symbols = ManagedSymbols::at(target.location.clone(), config);
    // 1,000 distinct names of 4 KiB: about 8 MiB held without the bound.
    let text: String = (0..1000)
        .map(|i| format!("{:x} 10 M{i}{}()\n", 0x1000 + i * 0x10, "x".repeat(4096)))
        .collect();
    target.append("perf-7.map", text.as_bytes());
    let refresh = symbols.refresh(1).perf_map;
    assert!(refresh.symbols_over_budget > 900, "{refresh:?}");
    assert_eq!(refresh.symbols_added + refresh.symbols_over_budget, 1000);
    // The entry that crossed the bound is kept whole.
    assert!(
        symbols.memory_bytes() < (256 << 10) + (64 << 10),
        "{}",
        symbols.memory_bytes()
    );
}

#[test]
fn perf_map_of_an_older_runtime_is_found_in_tmpdir() {
    let mut target = Target::new();
    std::fs::create_dir_all(target.location.root.join("var/tmp")).expect("mkdir");
    target.location.legacy_perf_map_dir = PathBuf::from("/var/tmp");
    let mut symbols = target.symbols();
    assert_eq!(
        symbols.files().legacy_perf_map.as_deref(),
        Some(Path::new("/var/tmp/perf-7.map"))
    );
    assert_eq!(symbols.refresh(1).perf_map.status, FileStatus::Missing);
    // .NET Core 3.1 writes upper-case addresses without 0x.
    std::fs::write(
        target.location.root.join("var/tmp/perf-7.map"),
        b"00007F7ECE058150 24 int64 [App] Hot::Spin(int64)[Optimized]\n",
    )
    .expect("write");
    let stats = symbols.refresh(2);
    assert_eq!(stats.perf_map.symbols_added, 1);
    assert_eq!(symbols.files().perf_map, Path::new("/var/tmp/perf-7.map"));
    assert_eq!(
        symbols.files().perfinfo,
        Path::new("/var/tmp/perfinfo-7.map")
    );
    assert_eq!(symbols.files().legacy_perf_map, None);
    let spin = symbols.lookup(0x7F7ECE058160, 2).expect("Spin");
    assert_eq!(spin.jit_tier.as_deref(), Some("Optimized"));
    // The choice sticks: a later file in /tmp is not read.
    target.append("perf-7.map", b"0x1000 10 other()\n");
    assert_eq!(symbols.refresh(3).perf_map.bytes_read, 0);
}

#[test]
fn files_left_by_an_earlier_process_are_ignored() {
    let mut target = Target::new();
    target.append("perf-7.map", b"0x1000 10 old()\n");
    let mut dump = jitdump_header();
    dump.extend(code_load(5, 0x1000, 0x10, "old()"));
    target.append("jit-7.dump", &dump);
    let long_ago = SystemTime::now() - Duration::from_secs(3600);
    for name in ["perf-7.map", "jit-7.dump"] {
        File::options()
            .write(true)
            .open(target.host_path(name))
            .expect("open")
            .set_modified(long_ago)
            .expect("set mtime");
    }
    target.location.started_at = Some(SystemTime::now() - Duration::from_secs(10));
    let mut symbols = target.symbols();
    let stats = symbols.refresh(1);
    assert_eq!(stats.jitdump.status, FileStatus::Stale);
    assert_eq!(stats.perf_map.status, FileStatus::Stale);
    assert!(symbols.is_empty());
    symbols.refresh(2);
    assert_eq!(symbols.errors().stale_files, 2, "each file counted once");
    // The new process enables perf maps later: the file is rewritten.
    std::fs::write(target.host_path("perf-7.map"), b"0x2000 10 new()\n").expect("write");
    let stats = symbols.refresh(3);
    assert_eq!(stats.perf_map.symbols_added, 1);
    assert_eq!(lookup_name(&symbols, 0x2000, 3).as_deref(), Some("new()"));
    assert!(symbols.lookup(0x1000, 3).is_none());
}

#[test]
fn perf_files_of_another_owner_are_not_read() {
    let mut target = Target::new();
    target.append("perf-7.map", b"0x1000 10 secret()\n");
    target.location.owner = Some(FsIdentity {
        uid: FsIdentity::current().uid.wrapping_add(1),
        ..FsIdentity::current()
    });
    let mut symbols = target.symbols();
    let stats = symbols.refresh(1);
    assert_eq!(stats.perf_map.status, FileStatus::Failed);
    assert!(symbols.is_empty());
    let errors = symbols.errors();
    assert_eq!(errors.open_errors, 1);
    assert!(
        errors
            .last_io_error
            .as_deref()
            .is_some_and(|e| e.contains("not by the process's uid")),
        "{errors:?}"
    );
    target.location.owner = None;
    assert_eq!(
        target.symbols().refresh(1).perf_map.status,
        FileStatus::Failed
    );
}

#[test]
fn synthetic_perf_map_parses_completely() {
    let text = synthetic_perf_map(1000);
    let mut parser = PerfMapParser::new(PerfMapLimits::default());
    let mut names = Vec::new();
    parser.feed(&text, |entry| names.push(entry.name.into_owned()));
    assert_eq!(names.len(), 1000);
    assert_eq!(parser.counts().malformed_lines, 0);
    assert!(
        names
            .iter()
            .any(|n| split_tier(n).1 == Some("OptimizedTier1"))
    );
    // The benchmark itself runs (its time is not asserted).
    bench_perf_map_load(1000);
}
