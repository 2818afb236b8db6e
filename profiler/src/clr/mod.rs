//! The .NET runtime from the outside: the diagnostic IPC client (EnablePerfMap,
//! ProcessInfo, EventPipe sessions) and what is decoded from it: CLR events
//! for profiles, `System.Runtime` EventCounters for runtime metrics.
//! [`instance`] is .NET behind the runtime seam ([`crate::runtime`]): what
//! the pipeline asks of one process's runtime.

pub mod alloc_session;
pub mod budget;
pub mod collector;
pub mod counters;
mod describe;
pub mod instance;
pub mod intake;
pub mod ipc;
pub mod jobs;
pub mod memory;
pub mod name_sources;
pub mod perf_map_attach;
pub mod perf_map_ledger;
pub mod session;
pub(crate) mod session_reader;
pub mod waits;
