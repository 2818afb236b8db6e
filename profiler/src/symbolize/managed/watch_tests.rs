//! [`super::ManagedSymbols::jit_code_unchanged`]: a watched jitdump is left
//! unread while nothing is written to it, and read again as soon as
//! anything is (a new method, the file replaced or removed).

use super::tests::{Target, code_load, jitdump_header};
use super::{FileStatus, ManagedSymbols, ManagedSymbolsConfig};
use crate::symbolize::file_watch::FileWatch;

fn watched(target: &Target, watch: &FileWatch, config: ManagedSymbolsConfig) -> ManagedSymbols {
    let mut symbols = ManagedSymbols::at(target.location.clone(), config);
    symbols.watch_files(watch.clone());
    symbols
}

#[test]
fn an_unwritten_jitdump_is_unchanged_until_a_method_is_added() {
    let target = Target::new();
    let watch = FileWatch::new();
    let mut symbols = watched(&target, &watch, ManagedSymbolsConfig::default());
    assert!(!symbols.jit_code_unchanged(), "never read");
    symbols.refresh(1);
    assert!(!symbols.jit_code_unchanged(), "no file yet: polled");
    let mut dump = jitdump_header();
    dump.extend(code_load(5, 0x1000, 0x10, "void [A] A::F()[QuickJitted]"));
    target.append("jit-7.dump", &dump);
    assert_eq!(symbols.refresh(2).jitdump.status, FileStatus::Read);
    watch.drain();
    assert!(symbols.jit_code_unchanged());
    assert_eq!(watch.watched(), 1);
    // A method compiled while the process idles.
    target.append(
        "jit-7.dump",
        &code_load(6, 0x2000, 0x10, "void [A] A::G()[QuickJitted]"),
    );
    watch.drain();
    assert!(!symbols.jit_code_unchanged(), "the write is seen");
    assert_eq!(symbols.refresh(3).jitdump.symbols_added, 1);
    let (code, _) = symbols.take_new_code();
    assert_eq!(code.len(), 2, "both methods go to the unwinder");
    watch.drain();
    assert!(symbols.jit_code_unchanged());
}

#[test]
fn a_removed_or_replaced_jitdump_is_read_again() {
    let target = Target::new();
    let watch = FileWatch::new();
    let mut symbols = watched(&target, &watch, ManagedSymbolsConfig::default());
    let mut dump = jitdump_header();
    dump.extend(code_load(5, 0x1000, 0x10, "void [A] A::F()[QuickJitted]"));
    target.append("jit-7.dump", &dump);
    symbols.refresh(1);
    watch.drain();
    assert!(symbols.jit_code_unchanged());
    let path = target.location.root.join("tmp/jit-7.dump");
    std::fs::remove_file(&path).unwrap();
    watch.drain();
    assert!(!symbols.jit_code_unchanged(), "a removal is a change");
    assert_eq!(symbols.refresh(2).jitdump.status, FileStatus::Missing);
    watch.drain();
    assert!(!symbols.jit_code_unchanged(), "a missing file is polled");
    assert_eq!(watch.watched(), 0, "the old file's watch is gone");
    target.append("jit-7.dump", &dump);
    symbols.refresh(3);
    watch.drain();
    assert!(symbols.jit_code_unchanged(), "the new file is watched");
    assert_eq!(watch.watched(), 1);
}

#[test]
fn a_read_cut_short_by_the_byte_bound_is_not_caught_up() {
    let target = Target::new();
    let watch = FileWatch::new();
    let config = ManagedSymbolsConfig {
        max_bytes_per_refresh: 64,
        ..ManagedSymbolsConfig::default()
    };
    let mut symbols = watched(&target, &watch, config);
    let mut dump = jitdump_header();
    dump.extend(code_load(5, 0x1000, 0x10, "void [A] A::F()[QuickJitted]"));
    dump.extend(code_load(6, 0x2000, 0x10, "void [A] A::G()[QuickJitted]"));
    target.append("jit-7.dump", &dump);
    symbols.refresh(1);
    watch.drain();
    assert!(
        !symbols.jit_code_unchanged(),
        "the rest of the file is still to read"
    );
    for now in 2..20 {
        symbols.refresh(now);
    }
    watch.drain();
    assert!(symbols.jit_code_unchanged());
    assert_eq!(symbols.len(), 2);
}

#[test]
fn without_inotify_the_jitdump_is_polled() {
    let target = Target::new();
    let watch = FileWatch::unavailable();
    let mut symbols = watched(&target, &watch, ManagedSymbolsConfig::default());
    let mut dump = jitdump_header();
    dump.extend(code_load(5, 0x1000, 0x10, "void [A] A::F()[QuickJitted]"));
    target.append("jit-7.dump", &dump);
    symbols.refresh(1);
    assert!(!symbols.jit_code_unchanged());
}
