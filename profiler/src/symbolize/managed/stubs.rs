//! The runtime's stub blocks of one process, kept compact. Part of the
//! managed half of the `symbolize/` stage: a .NET 8 process's jitdump lists
//! thousands of them (2,500 in an idle service after an attach, the
//! largest part of its entries), each named `stub<N> KIND` with a serial
//! number `N` and one of a few kinds
//! (`stub<2364> AllocateTemporaryEntryPoints<PRECODE_STUB>`). Held as
//! symbols they cost ~230 bytes each (the symbol, its range, its own
//! name); here 24 bytes, the kind interned, and the symbol is made again
//! when a sample falls in one (rare: stubs are a few instructions).
//!
//! Stub blocks are not freed while the process runs, so their ranges carry
//! no time: a JIT-compiled method over the same range (indexed by time in
//! [`super::JitCodeIndex`]) is looked up first.

use std::sync::Arc;

use super::{ManagedSymbol, SymbolInterner};

/// Kinds remembered at most; stubs of other kinds stay full symbols.
const MAX_KINDS: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StubRange {
    start: u64,
    size: u32,
    serial: u32,
    kind: u16,
}

/// A process's stub blocks, by address.
#[derive(Debug, Default)]
pub struct StubIndex {
    /// Sorted by start from `..sorted`, then appended since [`Self::commit`].
    ranges: Vec<StubRange>,
    sorted: usize,
    kinds: Vec<Arc<str>>,
}

impl StubIndex {
    /// Keeps `raw` if it is a stub's name of the usual shape
    /// (`stub<N> KIND`); false otherwise (the caller keeps it as a symbol).
    pub fn insert(&mut self, start: u64, size: u64, raw: &str) -> bool {
        let Some((serial, kind)) = raw
            .strip_prefix("stub<")
            .and_then(|rest| rest.split_once("> "))
        else {
            return false;
        };
        let (Ok(serial), Ok(size)) = (serial.parse::<u32>(), u32::try_from(size)) else {
            return false;
        };
        // The same text again: `serial.to_string()` must give back `N`.
        if size == 0 || serial.to_string().len() != raw.len() - kind.len() - "stub<> ".len() {
            return false;
        }
        let kind = match self.kinds.iter().position(|k| **k == *kind) {
            Some(known) => known,
            None if self.kinds.len() < MAX_KINDS => {
                self.kinds.push(kind.into());
                self.kinds.len() - 1
            }
            None => return false,
        };
        self.ranges.push(StubRange {
            start,
            size,
            serial,
            kind: kind as u16,
        });
        true
    }

    /// Sorts what was added since the last commit in (a replayed jitdump
    /// lists the same stubs again: duplicates are dropped).
    pub fn commit(&mut self) {
        if self.sorted == self.ranges.len() {
            return;
        }
        self.ranges.sort_unstable_by_key(|r| (r.start, r.size));
        self.ranges.dedup_by_key(|r| r.start);
        self.sorted = self.ranges.len();
    }

    /// The stub block holding `addr`, as a symbol.
    pub fn lookup(&self, addr: u64) -> Option<ManagedSymbol> {
        let at = self.ranges[..self.sorted].partition_point(|r| r.start <= addr);
        let sorted = at.checked_sub(1).map(|i| &self.ranges[i]);
        let holds = |r: &&StubRange| addr - r.start < u64::from(r.size);
        let range = sorted.filter(|r| holds(r)).or_else(|| {
            self.ranges[self.sorted..]
                .iter()
                .find(|r| r.start <= addr && holds(r))
        })?;
        let kind = self.kinds.get(usize::from(range.kind))?;
        let raw = format!("stub<{}> {kind}", range.serial);
        let symbol = ManagedSymbol::from_raw_name(
            &raw,
            range.start,
            u64::from(range.size),
            &mut SymbolInterner::default(),
        );
        Some(symbol)
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Heap bytes held.
    pub fn memory_bytes(&self) -> u64 {
        let kinds: u64 = self
            .kinds
            .iter()
            .map(|k| super::arc_str_bytes(k.len()) + 16)
            .sum();
        (self.ranges.capacity() * size_of::<StubRange>()) as u64 + kinds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stubs_are_named_as_the_runtime_wrote_them() {
        let mut stubs = StubIndex::default();
        let name = "stub<2364> AllocateTemporaryEntryPoints<PRECODE_STUB>";
        assert!(stubs.insert(0x7f00_0000_1000, 0x100, name));
        assert!(stubs.insert(0x7f00_0000_0000, 0x80, "stub<7> FixupPrecode"));
        // Before the commit too.
        let found = stubs.lookup(0x7f00_0000_10ff).expect("the stub");
        assert_eq!(&*found.raw_name, name);
        stubs.commit();
        let found = stubs.lookup(0x7f00_0000_1010).expect("the stub");
        assert_eq!(&*found.raw_name, name);
        assert!(found.is_stub);
        assert_eq!((found.start, found.size), (0x7f00_0000_1000, 0x100));
        assert_eq!(
            stubs
                .lookup(0x7f00_0000_0004)
                .map(|s| s.raw_name.to_string()),
            Some("stub<7> FixupPrecode".into())
        );
        assert!(stubs.lookup(0x7f00_0000_0080).is_none());
        assert!(stubs.lookup(0x7f00_0000_1100).is_none());
        // A replay lists them again.
        assert!(stubs.insert(0x7f00_0000_1000, 0x100, name));
        stubs.commit();
        assert_eq!(stubs.len(), 2);
    }

    #[test]
    fn other_shapes_stay_symbols() {
        let mut stubs = StubIndex::default();
        for name in [
            "stub<007> X",
            "stub<1>",
            "stub<x> X",
            "stub 1 X",
            "void [App] App::Run()",
        ] {
            assert!(!stubs.insert(0x1000, 0x10, name), "{name}");
        }
        assert!(!stubs.insert(0x1000, 0, "stub<1> X"));
    }
}
