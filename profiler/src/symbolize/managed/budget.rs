//! One memory bound on the managed symbols of every process of a run: the
//! book of what each process's tables cost, and the least-recently-used
//! eviction that keeps the total within the limit. The tables it drops
//! are read again from the process's files at its next refresh.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use super::{SymbolTables, lock_tables};
use crate::symbolize::jit_index::JitCodeIndex;

/// Heap bytes of one perf map entry of a real service (a signature of about
/// 100 bytes with a tier: the name and the name with its tier, the symbol,
/// its range), as [`JitCodeIndex::memory_bytes`] counts them.
pub const TYPICAL_ENTRY_BYTES: u64 = 448;

/// Default of [`ManagedSymbolBudget::new`]'s limit for a run.
pub const DEFAULT_MANAGED_SYMBOL_BUDGET_BYTES: u64 = 64 << 20;

/// One bound on the memory of managed symbols across every process of a
/// run. Each [`super::ManagedSymbols`] made with a budget
/// charges its tables (an estimate from their capacities and string
/// sizes); when the total passes the limit, the tables of the least
/// recently used processes (by refresh and lookup) are dropped, never
/// those of the process being charged, and read again at that process's
/// next refresh. Cheap to clone: clones share the book.
#[derive(Clone, Debug)]
pub struct ManagedSymbolBudget {
    book: Arc<Mutex<BudgetBook>>,
}

#[derive(Debug)]
struct BudgetBook {
    limit_bytes: u64,
    clock: u64,
    next_id: u64,
    members: HashMap<u64, BudgetMember>,
    stats: ManagedSymbolBudgetStats,
}

#[derive(Debug)]
struct BudgetMember {
    tables: Weak<Mutex<SymbolTables>>,
    bytes: u64,
    last_used: u64,
    /// Holds methods named from runtime events, which no file can give
    /// back: never dropped.
    pinned: bool,
}

/// What a [`ManagedSymbolBudget`] holds and has let go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManagedSymbolBudgetStats {
    pub limit_bytes: u64,
    /// Charged now, over all processes.
    pub used_bytes: u64,
    pub peak_bytes: u64,
    /// Processes charged now.
    pub processes: u64,
    /// Times a process's tables were dropped to stay within the limit.
    pub evictions: u64,
    pub evicted_bytes: u64,
    /// Evicted processes whose tables were read again.
    pub reloads: u64,
}

impl ManagedSymbolBudget {
    pub fn new(limit_bytes: u64) -> Self {
        Self {
            book: Arc::new(Mutex::new(BudgetBook {
                limit_bytes,
                clock: 0,
                next_id: 0,
                members: HashMap::new(),
                stats: ManagedSymbolBudgetStats {
                    limit_bytes,
                    ..ManagedSymbolBudgetStats::default()
                },
            })),
        }
    }

    pub fn stats(&self) -> ManagedSymbolBudgetStats {
        let book = self.lock();
        ManagedSymbolBudgetStats {
            processes: book.members.len() as u64,
            ..book.stats
        }
    }

    fn lock(&self) -> MutexGuard<'_, BudgetBook> {
        // The book's numbers stay consistent at every await-free step.
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn join(&self, tables: &Arc<Mutex<SymbolTables>>) -> u64 {
        let mut book = self.lock();
        book.next_id += 1;
        book.clock += 1;
        let (id, now) = (book.next_id, book.clock);
        book.members.insert(
            id,
            BudgetMember {
                tables: Arc::downgrade(tables),
                bytes: 0,
                last_used: now,
                pinned: false,
            },
        );
        id
    }

    pub(super) fn leave(&self, id: u64) {
        let mut book = self.lock();
        if let Some(member) = book.members.remove(&id) {
            book.stats.used_bytes -= member.bytes;
        }
    }

    pub(super) fn touch(&self, id: u64) {
        let mut book = self.lock();
        book.clock += 1;
        let now = book.clock;
        if let Some(member) = book.members.get_mut(&id) {
            member.last_used = now;
        }
    }

    pub(super) fn pin(&self, id: u64) {
        if let Some(member) = self.lock().members.get_mut(&id) {
            member.pinned = true;
        }
    }

    pub(super) fn count_reload(&self) {
        self.lock().stats.reloads += 1;
    }

    /// Sets member `id`'s charge to `bytes` and marks it used, then drops
    /// other members' tables, least recently used first, until the total
    /// is within the limit. The caller must not hold `id`'s tables lock.
    pub(super) fn charge(&self, id: u64, bytes: u64) {
        let mut book = self.lock();
        book.clock += 1;
        let now = book.clock;
        let evictions_before = book.stats.evictions;
        let Some(member) = book.members.get_mut(&id) else {
            return;
        };
        let old = std::mem::replace(&mut member.bytes, bytes);
        member.last_used = now;
        book.stats.used_bytes = book.stats.used_bytes - old + bytes;
        while book.stats.used_bytes > book.limit_bytes {
            let Some((&victim, _)) = book
                .members
                .iter()
                .filter(|(other, m)| **other != id && m.bytes > 0 && !m.pinned)
                .min_by_key(|(_, m)| m.last_used)
            else {
                break; // only the charged process is left: it stays
            };
            let Some(member) = book.members.get_mut(&victim) else {
                break;
            };
            let freed = std::mem::take(&mut member.bytes);
            if let Some(tables) = member.tables.upgrade() {
                // Lock order: book, then a member's tables. Members never
                // call the budget while holding their own tables.
                let mut tables = lock_tables(&tables);
                tables.index = JitCodeIndex::new();
                tables.interner.clear();
                tables.stubs = Default::default();
                if let Some(images) = tables.images.as_mut() {
                    images.forget_declared();
                }
                tables.evicted = true;
            }
            book.stats.used_bytes -= freed;
            book.stats.evictions += 1;
            book.stats.evicted_bytes += freed;
        }
        book.stats.peak_bytes = book.stats.peak_bytes.max(book.stats.used_bytes);
        let evicted = book.stats.evictions > evictions_before;
        drop(book);
        if evicted {
            crate::release_freed_heap();
        }
    }
}
