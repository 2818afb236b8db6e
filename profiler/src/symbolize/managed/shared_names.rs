//! Method names held once for every process: the JIT-compiled methods of
//! .NET services on one host are mostly the same framework methods
//! (`System.Threading.TimerQueue::FireNextTimers()[OptimizedTier1]`),
//! compiled at other addresses in each. Part of the managed half of the
//! `symbolize/` stage: each process's [`super::SymbolInterner`] asks here
//! for the strings of a new symbol ([`super::ManagedSymbol::from_raw_name`])
//! and gets the allocation another process's symbol already holds.
//!
//! Only weak references are kept: a name lives as long as some process's
//! symbol holds it, and is freed with the last one. Dead slots are swept
//! when the table has doubled since the last sweep and when a process's
//! symbols are dropped ([`SharedNames::sweep`]). Each process is still
//! charged its names' full size in its budget
//! ([`super::ManagedSymbolBudget`]): a name another process also holds may
//! outlive that process.

use std::collections::HashMap;
use std::hash::{BuildHasher as _, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

/// Slots kept at least before a sweep.
const FIRST_SWEEP_AT: usize = 4096;

/// Method names shared by every process's symbols. Cheap to clone: clones
/// share the table.
#[derive(Clone, Debug, Default)]
pub struct SharedNames {
    inner: Arc<Mutex<NamesInner>>,
}

#[derive(Debug, Default)]
struct NamesInner {
    /// Keyed by the text's hash (keyed SipHash: a process cannot make its
    /// names collide with others'); a slot whose text differs is replaced.
    by_hash: HashMap<u64, Weak<str>>,
    hasher: RandomState,
    sweep_at: usize,
}

impl SharedNames {
    fn lock(&self) -> MutexGuard<'_, NamesInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The shared allocation holding `text`, made if no symbol holds one.
    pub fn get(&self, text: &str) -> Arc<str> {
        let mut inner = self.lock();
        let hash = inner.hasher.hash_one(text);
        if let Some(known) = inner.by_hash.get(&hash).and_then(Weak::upgrade)
            && *known == *text
        {
            return known;
        }
        if inner.by_hash.len() >= inner.sweep_at.max(FIRST_SWEEP_AT) {
            inner.by_hash.retain(|_, name| name.strong_count() > 0);
            inner.sweep_at = inner.by_hash.len() * 2;
        }
        let name: Arc<str> = text.into();
        inner.by_hash.insert(hash, Arc::downgrade(&name));
        name
    }

    /// Forgets the names no symbol holds any more (their allocations stay
    /// until then).
    pub fn sweep(&self) {
        let mut inner = self.lock();
        inner.by_hash.retain(|_, name| name.strong_count() > 0);
        inner.by_hash.shrink_to_fit();
        inner.sweep_at = inner.by_hash.len() * 2;
    }

    /// Names held now (slots of names still alive).
    pub fn len(&self) -> usize {
        self.lock()
            .by_hash
            .values()
            .filter(|name| name.strong_count() > 0)
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_held_once_while_used() {
        let names = SharedNames::default();
        let a = names.get("void [App] App::Run()");
        let b = names.get("void [App] App::Run()");
        assert!(Arc::ptr_eq(&a, &b));
        let other = names.get("void [App] App::Stop()");
        assert!(!Arc::ptr_eq(&a, &other));
        assert_eq!(names.len(), 2);
        drop((a, b));
        names.sweep();
        assert_eq!(names.len(), 1);
        // A name made again after its last holder is gone is a new one.
        assert_eq!(
            &*names.get("void [App] App::Run()"),
            "void [App] App::Run()"
        );
    }

    #[test]
    fn dead_slots_do_not_pile_up() {
        let names = SharedNames::default();
        for i in 0..(FIRST_SWEEP_AT * 4) {
            drop(names.get(&format!("void [App] App::M{i}()")));
        }
        assert!(names.lock().by_hash.len() <= FIRST_SWEEP_AT + 1);
    }

    /// Two processes' symbols of the same method share their strings.
    #[test]
    fn symbols_of_two_processes_share_their_names() {
        use super::super::{ManagedSymbol, SymbolInterner};
        let names = SharedNames::default();
        let (mut one, mut two) = (
            SymbolInterner::sharing(names.clone()),
            SymbolInterner::sharing(names),
        );
        let raw = "void [System.Private.CoreLib] System.Threading.TimerQueue::FireNextTimers()[OptimizedTier1]";
        let a = ManagedSymbol::from_raw_name(raw, 0x1000, 0x40, &mut one);
        let b = ManagedSymbol::from_raw_name(raw, 0x9000, 0x40, &mut two);
        assert!(Arc::ptr_eq(&a.raw_name, &b.raw_name));
        assert!(Arc::ptr_eq(&a.name, &b.name));
        assert!(Arc::ptr_eq(&a.short_name, &b.short_name));
        assert_eq!(&*a.short_name, "System.Threading.TimerQueue.FireNextTimers");
        assert_eq!(a.jit_tier.as_deref(), Some("OptimizedTier1"));
    }
}
