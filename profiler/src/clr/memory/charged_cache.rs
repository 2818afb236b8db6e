//! The memory path's per-process caches (code blocks in
//! [`super::ClrMemoryReader`], method names in [`super::names`]): bounded
//! in entries, and each entry's real bytes charged to
//! [`Pool::MemoryNames`], which every process's caches share. A process
//! whose cache meets a full pool empties its own first (its entries are
//! the ones it can do without); what still does not fit is not cached,
//! counted in [`memory_budget::Drops::memory_names`] and warned about once
//! per process, and looked up again the next time.

use std::{collections::HashMap, hash::Hash};

use crate::memory_budget::{self, Charge, Drops, OverBudget, Pool};

/// Bytes an entry costs besides the bytes its key and value point to: the
/// hash table's slot and its control byte, rounded up.
const ENTRY_OVERHEAD: u64 = 48;

/// A map of at most `max_entries`, charged to [`Pool::MemoryNames`].
#[derive(Debug)]
pub struct ChargedCache<K, V> {
    /// Each value with the bytes it was charged.
    entries: HashMap<K, (V, u64)>,
    max_entries: usize,
    charge: Charge,
}

impl<K: Eq + Hash, V> ChargedCache<K, V> {
    pub fn new(max_entries: usize) -> Self {
        Self {
            entries: HashMap::new(),
            max_entries,
            charge: Charge::new(Pool::MemoryNames),
        }
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|(value, _)| value)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes charged for the entries held.
    pub fn charged_bytes(&self) -> u64 {
        self.charge.bytes()
    }

    /// Keeps `value` under `key`, charged `heap_bytes` (what it points to)
    /// plus the entry itself; `false` when the pool has no room for it
    /// even with this cache emptied (counted, warned once for `pid`).
    pub fn insert(&mut self, pid: u32, key: K, value: V, heap_bytes: u64) -> bool {
        let bytes = entry_bytes::<K, V>(heap_bytes);
        if self.entries.len() >= self.max_entries {
            self.clear();
        }
        if !self.charge.try_add(bytes) {
            self.clear();
            if !self.charge.try_add(bytes) {
                Drops::count(&memory_budget::drops().memory_names, 1);
                memory_budget::warn_once(pid, OverBudget::MemoryNames, || {
                    format!(
                        "the memory path's name caches are at their share of the memory budget ({} MiB): names of this process are looked up again each time",
                        Pool::MemoryNames.usage().2 >> 20
                    )
                });
                return false;
            }
        }
        if let Some((_, replaced)) = self.entries.insert(key, (value, bytes)) {
            self.charge.release(replaced);
        }
        true
    }

    /// Drops every entry and gives back their bytes.
    pub fn clear(&mut self) {
        self.entries = HashMap::new();
        let bytes = self.charge.bytes();
        self.charge.release(bytes);
    }
}

fn entry_bytes<K, V>(heap_bytes: u64) -> u64 {
    size_of::<(K, (V, u64))>() as u64 + ENTRY_OVERHEAD + heap_bytes
}

/// `name` cut to at most [`memory_budget::MAX_MEMORY_NAME_BYTES`], at a
/// character boundary.
pub fn capped_name(mut name: String) -> String {
    let max = memory_budget::MAX_MEMORY_NAME_BYTES;
    if name.len() > max {
        let mut end = max;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
        name.shrink_to_fit();
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_charged_and_given_back() {
        let mut cache = ChargedCache::<u64, u64>::new(4);
        assert!(cache.insert(1, 1, 10, 100));
        let one = cache.charged_bytes();
        assert_eq!(one, 24 + ENTRY_OVERHEAD + 100);
        assert!(cache.insert(1, 2, 20, 100));
        assert_eq!(cache.charged_bytes(), 2 * one);
        // Replaced: the old entry's bytes are given back.
        assert!(cache.insert(1, 2, 21, 100));
        assert_eq!(cache.charged_bytes(), 2 * one);
        cache.clear();
        assert_eq!(cache.charged_bytes(), 0);
        assert!(cache.get(&1).is_none());
    }

    #[test]
    fn the_entry_count_is_bounded() {
        let mut cache = ChargedCache::<u64, u64>::new(4);
        for key in 0..10 {
            assert!(cache.insert(1, key, key, 0));
        }
        assert!(cache.len() <= 4);
        assert_eq!(cache.get(&9), Some(&9));
    }

    #[test]
    fn what_the_pool_cannot_hold_is_refused_and_counted() {
        let limit = Pool::MemoryNames.usage().2;
        let before = memory_budget::drops().snapshot().memory_names;
        let mut cache = ChargedCache::<u64, u64>::new(4);
        assert!(!cache.insert(2, 1, 1, limit + 1), "over the whole pool");
        assert!(cache.get(&1).is_none());
        assert_eq!(cache.charged_bytes(), 0);
        assert!(memory_budget::drops().snapshot().memory_names > before);
    }

    #[test]
    fn names_are_capped_at_a_character_boundary() {
        let max = memory_budget::MAX_MEMORY_NAME_BYTES;
        assert_eq!(capped_name("short".into()), "short");
        assert_eq!(capped_name("a".repeat(max + 10)).len(), max);
        // U+FFFD is 3 bytes: what invalid bytes turn into.
        let replaced = capped_name("\u{fffd}".repeat(max));
        assert!(replaced.len() <= max && replaced.len() > max - 3);
        assert!(replaced.chars().all(|c| c == '\u{fffd}'));
    }
}
