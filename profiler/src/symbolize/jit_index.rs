//! `JitCodeIndex`: one process's managed code ranges, looked up by address
//! *and time*. The perf map and jitdump parsers (through
//! [`super::managed::ManagedSymbols`]) insert ranges; symbolization asks which
//! method owned an address when a sample was taken.
//!
//! Time matters because addresses are reused: tiering re-JITs a method at a
//! new address and frees the old code, whose memory later holds another
//! method; collectible assemblies unload. Each range carries the time it
//! became valid. A lookup picks, among the ranges covering the address, the
//! newest that was valid at the sample's time; if none was yet, the oldest
//! one after it, because perf map lines carry no timestamp and are stamped
//! when read, after the code became valid.
//!
//! Structure: a `Vec` sorted by start address, rebuilt by [`JitCodeIndex::commit`]
//! after each batch of inserts (a refresh appends thousands of ranges at
//! once, then lookups dominate), plus a running maximum of range ends. A
//! lookup binary-searches the last range starting at or below the address
//! and walks backwards while that running maximum says an earlier range
//! could still cover it: O(log n) plus the ranges that overlap the address,
//! with 32 bytes per range and no per-node allocation, where a `BTreeMap`
//! keyed by start would neither answer "covering" queries for overlapping
//! ranges nor be as compact. Ranges larger than [`MAX_CODE_RANGE`] are
//! refused and the backward walk is bounded, so hostile input cannot make
//! one lookup scan the whole index.

use std::{
    collections::HashMap,
    hash::{BuildHasher as _, RandomState},
    sync::atomic::{AtomicU64, Ordering},
};

use std::sync::Arc;

use super::managed::{ManagedSymbol, arc_str_bytes};
use crate::unwind::jit_code::JitMethod;

/// Largest code range accepted. Real methods and stub blocks are KiBs.
pub const MAX_CODE_RANGE: u64 = 64 * 1024 * 1024;
/// Ranges a lookup examines at most.
const MAX_LOOKUP_STEPS: usize = 4096;
/// New ranges kept for [`JitCodeIndex::take_new_code`] between two calls;
/// more are dropped (their methods are unwound by frame pointer).
const MAX_NEW_CODE: usize = 1 << 16;
/// The tier of OSR methods, and the tiers whose code has the patchpoints
/// they are entered from.
const OSR_TIER: &str = "OptimizedTier1OSR";
const PATCHPOINT_TIERS: [&str; 2] = ["QuickJitted", "InstrumentedTier"];
/// Tier-0 methods remembered for the OSR methods that may follow (past it,
/// an OSR method of a tier-0 method not remembered is walked by frame
/// pointer): 24 bytes and a hash each.
const MAX_PATCHPOINT_CODE: usize = 1 << 17;

/// A symbol's range with the time it became valid, `symbol` indexing
/// [`JitCodeIndex::symbols`] (so also the insertion order, the tiebreak).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CodeRange {
    start: u64,
    end: u64,
    valid_from_ns: u64,
    symbol: u32,
}

impl CodeRange {
    fn sort_key(&self) -> (u64, u64, u32) {
        (self.start, self.valid_from_ns, self.symbol)
    }
}

/// Managed code ranges of one process, keyed by address and time.
#[derive(Debug, Default)]
pub struct JitCodeIndex {
    symbols: Vec<ManagedSymbol>,
    /// Committed ranges, sorted by [`CodeRange::sort_key`].
    ranges: Vec<CodeRange>,
    /// `reach[i]` = the largest `end` among `ranges[..=i]`.
    reach: Vec<u64>,
    /// Inserted since the last commit, unsorted (still found by lookups).
    pending: Vec<CodeRange>,
    /// Heap bytes of the symbols' own strings (shared ones not counted).
    string_bytes: u64,
    rejected_ranges: u64,
    lookup_step_limit_hits: AtomicU64,
    /// The methods (not stubs) inserted since the last
    /// [`Self::take_new_code`]: the code whose unwind rows are still to be
    /// made.
    new_code: Vec<JitMethod>,
    new_code_dropped: u64,
    /// Hash of a method's name -> the start of its latest code with
    /// patchpoints ([`PATCHPOINT_TIERS`]): where its OSR method's frame
    /// comes from.
    patchpoint_code: HashMap<u64, u64>,
    name_hasher: RandomState,
}

impl JitCodeIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `symbol`'s range `[start, start + size)`, valid from
    /// `valid_from_ns` (CLOCK_MONOTONIC). Returns false, and counts it, for
    /// an empty, overflowing or oversized range.
    pub fn insert(&mut self, symbol: ManagedSymbol, valid_from_ns: u64) -> bool {
        let end = symbol.start.checked_add(symbol.size);
        let Some(end) = end.filter(|_| symbol.size > 0 && symbol.size <= MAX_CODE_RANGE) else {
            self.rejected_ranges += 1;
            return false;
        };
        let Ok(id) = u32::try_from(self.symbols.len()) else {
            self.rejected_ranges += 1;
            return false;
        };
        self.pending.push(CodeRange {
            start: symbol.start,
            end,
            valid_from_ns,
            symbol: id,
        });
        // Stub blocks (`stub<N> ...`) hold many stubs of one kind, some
        // of which push (resolve stubs): one prologue does not describe
        // them, so they keep the frame-pointer rule.
        let tier = symbol.jit_tier.as_deref();
        let osr_base = if tier == Some(OSR_TIER) {
            let name = self.name_hasher.hash_one(&*symbol.name);
            self.patchpoint_code.get(&name).copied()
        } else {
            if tier.is_some_and(|t| PATCHPOINT_TIERS.contains(&t)) {
                let name = self.name_hasher.hash_one(&*symbol.name);
                if self.patchpoint_code.len() < MAX_PATCHPOINT_CODE
                    || self.patchpoint_code.contains_key(&name)
                {
                    self.patchpoint_code.insert(name, symbol.start);
                }
            }
            None
        };
        if symbol.is_stub {
        } else if self.new_code.len() < MAX_NEW_CODE {
            self.new_code.push(JitMethod {
                start: symbol.start,
                end,
                osr_base,
            });
        } else {
            self.new_code_dropped += 1;
        }
        self.string_bytes += arc_str_bytes(symbol.name.len());
        if !Arc::ptr_eq(&symbol.raw_name, &symbol.name) {
            self.string_bytes += arc_str_bytes(symbol.raw_name.len());
        }
        self.symbols.push(symbol);
        true
    }

    /// Sorts the ranges inserted since the last commit into the index.
    /// Lookups are correct without it, but scan uncommitted ranges linearly.
    pub fn commit(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let mut pending = std::mem::take(&mut self.pending);
        pending.sort_unstable_by_key(CodeRange::sort_key);
        let appends = self
            .ranges
            .last()
            .is_none_or(|last| last.sort_key() <= pending[0].sort_key());
        let first_changed = if appends {
            // The common case when code is allocated upwards.
            let at = self.ranges.len();
            self.ranges.append(&mut pending);
            at
        } else {
            let old = std::mem::take(&mut self.ranges);
            let first = old.partition_point(|r| r.sort_key() <= pending[0].sort_key());
            let mut merged = Vec::with_capacity(old.len() + pending.len());
            merged.extend_from_slice(&old[..first]);
            let (mut a, mut b) = (old[first..].iter().peekable(), pending.iter().peekable());
            loop {
                let next = match (a.peek(), b.peek()) {
                    (Some(x), Some(y)) if x.sort_key() <= y.sort_key() => a.next(),
                    (Some(_), Some(_)) => b.next(),
                    (Some(_), None) => a.next(),
                    (None, Some(_)) => b.next(),
                    (None, None) => break,
                };
                merged.extend(next.copied());
            }
            self.ranges = merged;
            pending.clear();
            first
        };
        self.pending = pending; // keeps its allocation
        self.reach.truncate(first_changed);
        let mut reach = self.reach.last().copied().unwrap_or(0);
        for range in &self.ranges[first_changed..] {
            reach = reach.max(range.end);
            self.reach.push(reach);
        }
    }

    /// The symbol that owned `addr` at `time_ns`: among the ranges covering
    /// `addr`, the newest valid at `time_ns`, else the oldest valid after it.
    pub fn lookup(&self, addr: u64, time_ns: u64) -> Option<&ManagedSymbol> {
        let mut choice = Choice::new(time_ns);
        let mut i = self.ranges.partition_point(|r| r.start <= addr);
        let mut steps = 0;
        while i > 0 {
            i -= 1;
            if self.reach[i] <= addr {
                break; // no range at or before i reaches addr
            }
            steps += 1;
            if steps > MAX_LOOKUP_STEPS {
                self.lookup_step_limit_hits.fetch_add(1, Ordering::Relaxed);
                break;
            }
            let range = &self.ranges[i];
            if range.end > addr {
                choice.consider(range);
            }
        }
        for range in &self.pending {
            if range.start <= addr && addr < range.end {
                choice.consider(range);
            }
        }
        choice
            .best()
            .map(|range| &self.symbols[range.symbol as usize])
    }

    /// Estimated heap bytes: the vectors' capacities and the symbols'
    /// strings.
    pub fn memory_bytes(&self) -> u64 {
        let vectors = self.symbols.capacity() * size_of::<ManagedSymbol>()
            + (self.ranges.capacity() + self.pending.capacity()) * size_of::<CodeRange>()
            + self.reach.capacity() * size_of::<u64>()
            + self.new_code.capacity() * size_of::<JitMethod>()
            + self.patchpoint_code.capacity() * (2 * size_of::<u64>() + 8);
        vectors as u64 + self.string_bytes
    }

    /// The methods inserted since the last call, in insertion order, and
    /// how many were dropped past [`MAX_NEW_CODE`].
    pub fn take_new_code(&mut self) -> (Vec<JitMethod>, u64) {
        (
            std::mem::take(&mut self.new_code),
            std::mem::take(&mut self.new_code_dropped),
        )
    }

    /// Ranges held (committed and pending).
    pub fn len(&self) -> usize {
        self.symbols.len()
    }

    pub fn is_empty(&self) -> bool {
        self.symbols.is_empty()
    }

    /// Ranges refused by [`Self::insert`].
    pub fn rejected_ranges(&self) -> u64 {
        self.rejected_ranges
    }

    /// Lookups that stopped at the step bound (overlapping hostile ranges).
    pub fn lookup_step_limit_hits(&self) -> u64 {
        self.lookup_step_limit_hits.load(Ordering::Relaxed)
    }
}

/// The running choice among the ranges covering an address.
struct Choice<'a> {
    time_ns: u64,
    /// Newest with `valid_from_ns <= time_ns`.
    valid: Option<&'a CodeRange>,
    /// Oldest with `valid_from_ns > time_ns`.
    later: Option<&'a CodeRange>,
}

impl<'a> Choice<'a> {
    fn new(time_ns: u64) -> Self {
        Self {
            time_ns,
            valid: None,
            later: None,
        }
    }

    fn consider(&mut self, range: &'a CodeRange) {
        let order = |r: &CodeRange| (r.valid_from_ns, r.symbol);
        if range.valid_from_ns <= self.time_ns {
            if self.valid.is_none_or(|v| order(range) > order(v)) {
                self.valid = Some(range);
            }
        } else if self.later.is_none_or(|l| order(range) < order(l)) {
            self.later = Some(range);
        }
    }

    fn best(&self) -> Option<&'a CodeRange> {
        self.valid.or(self.later)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn symbol(name: &str, start: u64, size: u64) -> ManagedSymbol {
        ManagedSymbol {
            name: name.into(),
            short_name: name.into(),
            jit_tier: None,
            raw_name: name.into(),
            assembly: None,
            is_stub: false,
            start,
            size,
        }
    }

    fn name(index: &JitCodeIndex, addr: u64, time: u64) -> Option<Arc<str>> {
        index.lookup(addr, time).map(|s| s.name.clone())
    }

    #[test]
    fn finds_the_range_covering_an_address() {
        let mut index = JitCodeIndex::new();
        assert!(index.insert(symbol("a", 0x1000, 0x10), 0));
        assert!(index.insert(symbol("b", 0x1010, 0x20), 0));
        index.commit();
        assert_eq!(name(&index, 0x0fff, 5), None);
        assert_eq!(name(&index, 0x1000, 5).as_deref(), Some("a"));
        assert_eq!(name(&index, 0x100f, 5).as_deref(), Some("a"));
        assert_eq!(name(&index, 0x1010, 5).as_deref(), Some("b"));
        assert_eq!(name(&index, 0x102f, 5).as_deref(), Some("b"));
        assert_eq!(name(&index, 0x1030, 5), None);
        assert_eq!(index.len(), 2);
    }

    #[test]
    fn new_code_is_handed_out_once() {
        let mut index = JitCodeIndex::new();
        index.insert(symbol("a", 0x1000, 0x10), 0);
        assert!(!index.insert(symbol("empty", 0x2000, 0), 0));
        index.insert(symbol("b", 0x1010, 0x20), 0);
        let stub = ManagedSymbol {
            is_stub: true,
            ..symbol("stub<1> AllocateTemporaryEntryPoints", 0x3000, 0x40)
        };
        assert!(index.insert(stub, 0));
        let method = |start, end| JitMethod {
            start,
            end,
            osr_base: None,
        };
        assert_eq!(
            index.take_new_code(),
            (vec![method(0x1000, 0x1010), method(0x1010, 0x1030)], 0)
        );
        assert_eq!(index.take_new_code(), (vec![], 0));
    }

    #[test]
    fn osr_methods_name_their_tier0_code() {
        let tiered = |name: &str, tier: &str, start| ManagedSymbol {
            jit_tier: Some(Arc::from(tier)),
            ..symbol(name, start, 0x100)
        };
        let mut index = JitCodeIndex::new();
        index.insert(tiered("M", "QuickJitted", 0x1000), 0);
        index.insert(tiered("Other", "QuickJitted", 0x2000), 0);
        index.insert(tiered("M", "OptimizedTier1OSR", 0x3000), 0);
        index.insert(tiered("Lonely", "OptimizedTier1OSR", 0x4000), 0);
        index.insert(tiered("M", "OptimizedTier1", 0x5000), 0);
        let (new, _) = index.take_new_code();
        let bases: Vec<Option<u64>> = new.iter().map(|m| m.osr_base).collect();
        assert_eq!(bases, [None, None, Some(0x1000), None, None]);
        // A re-jitted tier-0 version is the base of the OSR methods after it.
        index.insert(tiered("M", "QuickJitted", 0x6000), 0);
        index.insert(tiered("M", "OptimizedTier1OSR", 0x7000), 0);
        assert_eq!(index.take_new_code().0[1].osr_base, Some(0x6000));
    }

    #[test]
    fn patchpoint_code_is_bounded() {
        let mut index = JitCodeIndex::new();
        for i in 0..MAX_PATCHPOINT_CODE as u64 + 10 {
            index.insert(
                ManagedSymbol {
                    jit_tier: Some(Arc::from("QuickJitted")),
                    ..symbol(&format!("M{i}"), 0x1000 + i * 0x10, 0x10)
                },
                0,
            );
        }
        assert_eq!(index.patchpoint_code.len(), MAX_PATCHPOINT_CODE);
    }

    #[test]
    fn reused_address_resolves_by_time() {
        let mut index = JitCodeIndex::new();
        // Tier0 code at 0x1000 from t=100, freed and reused by another
        // method from t=200, then by a third from t=300 (overlapping).
        index.insert(symbol("first", 0x1000, 0x40), 100);
        index.insert(symbol("second", 0x1000, 0x40), 200);
        index.insert(symbol("third", 0x1020, 0x40), 300);
        index.commit();
        assert_eq!(name(&index, 0x1010, 150).as_deref(), Some("first"));
        assert_eq!(name(&index, 0x1010, 200).as_deref(), Some("second"));
        assert_eq!(name(&index, 0x1030, 250).as_deref(), Some("second"));
        assert_eq!(name(&index, 0x1030, 300).as_deref(), Some("third"));
        assert_eq!(name(&index, 0x1010, 300).as_deref(), Some("second"));
        assert_eq!(name(&index, 0x1050, 250).as_deref(), Some("third"));
        // Before anything was valid: the oldest one after the time.
        assert_eq!(name(&index, 0x1010, 10).as_deref(), Some("first"));
        assert_eq!(name(&index, 0x1050, 10).as_deref(), Some("third"));
    }

    #[test]
    fn same_time_prefers_the_later_insert() {
        let mut index = JitCodeIndex::new();
        index.insert(symbol("old", 0x1000, 0x10), 100);
        index.insert(symbol("new", 0x1000, 0x10), 100);
        index.commit();
        assert_eq!(name(&index, 0x1000, 100).as_deref(), Some("new"));
        assert_eq!(name(&index, 0x1000, 50).as_deref(), Some("old"));
    }

    #[test]
    fn a_large_earlier_range_is_still_found_behind_small_ones() {
        let mut index = JitCodeIndex::new();
        index.insert(symbol("big", 0x1000, 0x1000), 1);
        for i in 0..100 {
            index.insert(symbol("small", 0x1100 + i * 0x10, 0x8), 1);
        }
        index.commit();
        // Inside a gap between small ranges: only "big" covers it.
        assert_eq!(name(&index, 0x1108, 5).as_deref(), Some("big"));
        assert_eq!(name(&index, 0x1100, 5).as_deref(), Some("small"));
        assert_eq!(name(&index, 0x2000, 5), None);
    }

    #[test]
    fn pending_ranges_are_found_before_commit_and_merge_correctly() {
        let mut index = JitCodeIndex::new();
        index.insert(symbol("c", 0x3000, 0x10), 1);
        index.insert(symbol("a", 0x1000, 0x10), 1);
        assert_eq!(name(&index, 0x1005, 5).as_deref(), Some("a"));
        index.commit();
        // Out of order after a commit: merged, not appended.
        index.insert(symbol("b", 0x2000, 0x10), 1);
        index.insert(symbol("d", 0x4000, 0x10), 1);
        index.insert(symbol("a2", 0x1000, 0x10), 3);
        assert_eq!(name(&index, 0x2005, 5).as_deref(), Some("b"));
        assert_eq!(name(&index, 0x1005, 5).as_deref(), Some("a2"));
        index.commit();
        for (addr, want) in [(0x1005, "a2"), (0x2005, "b"), (0x3005, "c"), (0x4005, "d")] {
            assert_eq!(name(&index, addr, 5).as_deref(), Some(want), "{addr:#x}");
        }
        assert_eq!(name(&index, 0x1005, 2).as_deref(), Some("a"));
        // Appending in order keeps the running maximum right.
        index.insert(symbol("e", 0x5000, 0x10), 1);
        index.commit();
        assert_eq!(name(&index, 0x5005, 5).as_deref(), Some("e"));
        assert_eq!(index.ranges.len(), 6);
        assert!(
            index
                .ranges
                .windows(2)
                .all(|w| w[0].sort_key() <= w[1].sort_key())
        );
    }

    #[test]
    fn hostile_ranges_are_refused() {
        let mut index = JitCodeIndex::new();
        assert!(!index.insert(symbol("empty", 0x1000, 0), 1));
        assert!(!index.insert(symbol("wraps", u64::MAX, 2), 1));
        assert!(!index.insert(symbol("huge", 0, MAX_CODE_RANGE + 1), 1));
        assert!(index.insert(symbol("max", 0, MAX_CODE_RANGE), 1));
        assert_eq!(index.rejected_ranges(), 3);
        index.commit();
        assert_eq!(name(&index, 0x1000, 1).as_deref(), Some("max"));
    }

    #[test]
    fn overlapping_pile_stops_at_the_step_bound() {
        let mut index = JitCodeIndex::new();
        for i in 0..(MAX_LOOKUP_STEPS as u64 + 10) {
            index.insert(symbol("pile", i, MAX_CODE_RANGE), i);
        }
        index.commit();
        assert!(index.lookup(MAX_LOOKUP_STEPS as u64 + 20, 0).is_some());
        assert_eq!(index.lookup_step_limit_hits(), 1);
    }

    #[test]
    fn many_ranges_in_random_order() {
        // A deterministic shuffle of 10k ranges inserted in 7 batches.
        let mut index = JitCodeIndex::new();
        let n = 10_000u64;
        let mut x = 12345u64;
        let mut order: Vec<u64> = (0..n).collect();
        for i in (1..order.len()).rev() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            order.swap(i, (x >> 33) as usize % (i + 1));
        }
        for (k, i) in order.iter().enumerate() {
            index.insert(symbol(&i.to_string(), 0x10_0000 + i * 0x100, 0x80), 1);
            if k % 1500 == 0 {
                index.commit();
            }
        }
        index.commit();
        for i in (0..n).step_by(97) {
            let addr = 0x10_0000 + i * 0x100 + 0x7f;
            assert_eq!(
                name(&index, addr, 1).as_deref(),
                Some(i.to_string().as_str())
            );
            assert_eq!(name(&index, addr + 1, 1), None);
        }
    }
}
