//! What a parser charges for the heap it keeps between inputs: the
//! profiler's memory budget is shared by every target on the host, so a
//! stream parser asks its owner for room before it grows and says what it
//! dropped when there was none. The owner implements [`StreamBudget`] (the
//! profiler's `memory_budget` does, over its pool for event streams);
//! [`Unbounded`] stands in where only the parser's own limits apply (unit
//! tests, fuzz targets, offline tools).

use std::fmt;

/// What a parser dropped because [`StreamBudget::try_add`] had no room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetDrop {
    /// A nettrace metadata record was not kept.
    NettraceMetadata,
    /// A nettrace stream's stack cache was emptied early.
    NettraceStackReset,
}

/// The charge of one parser's state to a shared budget.
pub trait StreamBudget: fmt::Debug + Send {
    /// Adds `bytes` if there is room for them; `false` (nothing added) when
    /// there is not.
    fn try_add(&mut self, bytes: u64) -> bool;
    /// Gives back up to `bytes` of what was added.
    fn release(&mut self, bytes: u64);
    /// Counts one `drop` for the budget's owner.
    fn count_drop(&self, drop: BudgetDrop);
}

/// Room for everything: only the parser's own limits bound it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unbounded;

impl StreamBudget for Unbounded {
    fn try_add(&mut self, _bytes: u64) -> bool {
        true
    }

    fn release(&mut self, _bytes: u64) {}

    fn count_drop(&self, _drop: BudgetDrop) {}
}
