//! Where each loaded table's rows live in the kernel's shared row array
//! (`UNWIND_ROW_CHUNKS`): a first-fit allocator of row ranges over an array
//! that grows by chunks, and the builder of a process's mapping index. Pure bookkeeping, so it is unit-tested here; the
//! map I/O is in `crate::bpf::unwind_maps`.

use clrbpf_common::unwind::{MAX_PROCESS_MAPPINGS, MappingEntry, ProcessMappings};

/// Free and used ranges of an array of `capacity` rows.
#[derive(Clone, Debug)]
pub struct RowArena {
    capacity: u32,
    /// Free ranges (offset, len), sorted by offset, never adjacent.
    free: Vec<(u32, u32)>,
    used: u64,
}

impl RowArena {
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            free: if capacity > 0 {
                vec![(0, capacity)]
            } else {
                Vec::new()
            },
            used: 0,
        }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Rows handed out and not freed.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The offset of `len` free rows (first fit), or `None` when no free
    /// range is long enough (or `len` is 0).
    pub fn allocate(&mut self, len: u32) -> Option<u32> {
        if len == 0 {
            return None;
        }
        let at = self.free.iter().position(|&(_, free)| free >= len)?;
        let (offset, free) = self.free[at];
        if free == len {
            self.free.remove(at);
        } else {
            self.free[at] = (offset + len, free - len);
        }
        self.used += u64::from(len);
        Some(offset)
    }

    /// Returns a range given by [`Self::allocate`]; merges it with its free
    /// neighbours. A range that is out of bounds or overlaps a free one is
    /// ignored (a bookkeeping bug must not corrupt the free list).
    pub fn free(&mut self, offset: u32, len: u32) {
        let Some(end) = offset.checked_add(len) else {
            return;
        };
        if len == 0 || end > self.capacity {
            return;
        }
        let at = self.free.partition_point(|&(o, _)| o < offset);
        let overlaps_prev = at > 0 && {
            let (o, l) = self.free[at - 1];
            o + l > offset
        };
        let overlaps_next = self.free.get(at).is_some_and(|&(o, _)| o < end);
        if overlaps_prev || overlaps_next {
            return;
        }
        self.used -= u64::from(len);
        let merge_prev = at > 0 && {
            let (o, l) = self.free[at - 1];
            o + l == offset
        };
        let merge_next = self.free.get(at).is_some_and(|&(o, _)| o == end);
        match (merge_prev, merge_next) {
            (true, true) => {
                let (_, next_len) = self.free.remove(at);
                self.free[at - 1].1 += len + next_len;
            }
            (true, false) => self.free[at - 1].1 += len,
            (false, true) => self.free[at] = (offset, self.free[at].1 + len),
            (false, false) => self.free.insert(at, (offset, len)),
        }
    }

    /// Adds `rows` free rows at the end (the array grew by a chunk).
    pub fn grow(&mut self, rows: u32) {
        let Some(capacity) = self.capacity.checked_add(rows) else {
            return;
        };
        if rows == 0 {
            return;
        }
        match self.free.last_mut() {
            Some((offset, len)) if *offset + *len == self.capacity => *len += rows,
            _ => self.free.push((self.capacity, rows)),
        }
        self.capacity = capacity;
    }

    /// The longest free range: the largest table that fits without eviction.
    #[cfg(test)]
    pub fn largest_free(&self) -> u32 {
        self.free.iter().map(|&(_, l)| l).max().unwrap_or(0)
    }
}

/// A process's mapping index from its executable mappings (any order):
/// sorted, overlaps dropped, contiguous mappings unwound alike merged (JIT
/// code often comes in many adjacent pieces), at most
/// [`MAX_PROCESS_MAPPINGS`] kept. Returns the index and how many mappings
/// did not fit.
pub fn build_process_mappings(mut entries: Vec<MappingEntry>) -> (Box<ProcessMappings>, usize) {
    entries.retain(|e| e.start < e.end);
    entries.sort_by_key(|e| e.start);
    let mut merged: Vec<MappingEntry> = Vec::with_capacity(entries.len());
    for e in entries {
        match merged.last_mut() {
            Some(last) if e.start < last.end => {} // overlap: keep the first
            // Contiguous and unwound alike: no rows, or the same table at
            // the same bias (a process's JIT table over adjacent pieces of
            // its code heap).
            Some(last) if last.end == e.start && same_rows(last, &e) => {
                last.end = e.end;
            }
            _ => merged.push(e),
        }
    }
    let dropped = merged.len().saturating_sub(MAX_PROCESS_MAPPINGS);
    let mut index = Box::new(ProcessMappings::EMPTY);
    for (slot, e) in index.entries.iter_mut().zip(&merged) {
        *slot = *e;
    }
    index.len = merged.len().min(MAX_PROCESS_MAPPINGS) as u32;
    (index, dropped)
}

fn same_rows(a: &MappingEntry, b: &MappingEntry) -> bool {
    if a.row_count == 0 || b.row_count == 0 {
        return a.row_count == b.row_count;
    }
    a.row_offset == b.row_offset
        && a.row_count == b.row_count
        && a.bias == b.bias
        && a.table_serial == b.table_serial
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_first_fit_and_merge_on_free() {
        let mut a = RowArena::new(100);
        assert_eq!(a.allocate(0), None);
        assert_eq!(a.allocate(30), Some(0));
        assert_eq!(a.allocate(30), Some(30));
        assert_eq!(a.allocate(30), Some(60));
        assert_eq!(a.allocate(30), None);
        assert_eq!(a.used(), 90);
        assert_eq!(a.largest_free(), 10);
        a.free(30, 30);
        assert_eq!(a.allocate(31), None, "fragmented: 30 + 10");
        a.free(0, 30);
        assert_eq!(a.largest_free(), 60);
        a.free(60, 30);
        assert_eq!(a.largest_free(), 100, "everything merged");
        assert_eq!(a.used(), 0);
        assert_eq!(a.allocate(100), Some(0));
    }

    #[test]
    fn bad_frees_are_ignored() {
        let mut a = RowArena::new(100);
        let at = a.allocate(50).expect("fits");
        a.free(60, 10); // already free
        a.free(90, 20); // out of bounds
        a.free(u32::MAX, 2); // overflows
        assert_eq!(a.used(), 50);
        a.free(at, 50);
        a.free(at, 50); // double free
        assert_eq!(a.used(), 0);
        assert_eq!(a.largest_free(), 100);
        assert_eq!(RowArena::new(0).allocate(1), None);
    }

    #[test]
    fn growth_adds_free_rows_at_the_end() {
        let mut a = RowArena::new(0);
        assert_eq!(a.allocate(10), None);
        a.grow(16);
        assert_eq!(a.allocate(10), Some(0));
        assert_eq!(a.allocate(10), None, "6 left");
        a.grow(16);
        assert_eq!(a.largest_free(), 22, "merged with the tail");
        assert_eq!(a.allocate(22), Some(10));
        a.grow(16);
        a.free(0, 10);
        assert_eq!(a.capacity(), 48);
        assert_eq!(a.allocate(16), Some(32));
        assert_eq!(a.used(), 38);
        a.grow(u32::MAX); // overflows: ignored
        assert_eq!(a.capacity(), 48);
    }

    fn entry(start: u64, end: u64, row_count: u32) -> MappingEntry {
        MappingEntry {
            start,
            end,
            row_count,
            ..MappingEntry::default()
        }
    }

    #[test]
    fn index_is_sorted_merged_and_bounded() {
        let (index, dropped) = build_process_mappings(vec![
            entry(0x5000, 0x6000, 3),
            entry(0x1000, 0x2000, 0),
            entry(0x2000, 0x3000, 0),
            entry(0x3000, 0x4000, 5),
            entry(0x3800, 0x3900, 0), // overlaps: dropped
            entry(0x9000, 0x9000, 0), // empty: dropped
        ]);
        assert_eq!(dropped, 0);
        assert_eq!(index.len, 3);
        assert_eq!(index.entries[0], entry(0x1000, 0x3000, 0));
        assert_eq!(index.entries[1], entry(0x3000, 0x4000, 5));
        assert_eq!(index.entries[2], entry(0x5000, 0x6000, 3));

        let many = (0..MAX_PROCESS_MAPPINGS as u64 + 7)
            .map(|i| entry(i * 0x2000, i * 0x2000 + 0x1000, 1))
            .collect();
        let (index, dropped) = build_process_mappings(many);
        assert_eq!((index.len as usize, dropped), (MAX_PROCESS_MAPPINGS, 7));
    }
}
