//! The seam between the pipeline and a language runtime, after the
//! OpenTelemetry eBPF profiler's interpreter contract (its `Loader` and
//! `Instance`):
//!
//! 1. A [`RuntimeLoader`] recognises its runtime in a process from the
//!    process's mappings, each time they are read until it does, and makes
//!    the process's [`RuntimeInstance`].
//! 2. The instance lives as long as the pipeline tracks the process. It
//!    keeps the runtime's code in step with the process
//!    ([`RuntimeInstance::sync_mappings`], [`RuntimeInstance::refresh_names`],
//!    [`RuntimeInstance::take_new_code`] for the unwinder), names the frames
//!    of that code ([`RuntimeInstance::frame`]), polls the runtime's events
//!    ([`RuntimeInstance::poll`], [`RuntimeInstance::take_events`]) and, at
//!    the process's or the run's end, stops them and detaches, undoing what
//!    it asked of the runtime ([`RuntimeInstance::stop_events`],
//!    [`RuntimeInstance::detach`]).
//!
//! `clrbpf ps` asks the loader alone ([`RuntimeLoader::describe`]). How an
//! instance names frames (its name sources) is its own business.
//! .NET is the one runtime today: [`crate::clr::instance`].

use std::{path::PathBuf, sync::Arc, time::Instant};

use crate::{
    process::{MappingTable, ProcFs, ProcessInfo},
    profile::Frame,
    unwind::jit_code::JitMethod,
};

/// What a runtime is told of the process it runs in.
#[derive(Clone, Copy, Debug)]
pub struct ProcessContext<'a> {
    pub procfs: &'a ProcFs,
    /// The host pid.
    pub pid: u32,
    /// Started by the command clrbpf launched, in clrbpf's own mount and
    /// PID namespaces: what the runtime writes is clrbpf's to remove.
    pub launched_here: bool,
}

/// What `clrbpf ps` shows of the runtime in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeSummary {
    /// `"8.0.4"`; `None` if nothing told.
    pub version: Option<String>,
    /// The runtime writes the files its frames are named from already
    /// (for .NET, perf maps), without clrbpf asking.
    pub names_written: bool,
    /// Host path of the socket the runtime is controlled through, if found.
    pub control_socket: Option<PathBuf>,
}

/// Recognises a runtime in a process; see the module doc.
pub trait RuntimeLoader {
    type Instance: RuntimeInstance;

    /// Whether the executable mappings show the runtime.
    fn recognises(&self, mappings: &MappingTable) -> bool;
    /// The instance for a process whose executable mappings show the
    /// runtime; `None` when they do not (yet).
    fn load(&self, process: &ProcessContext<'_>, mappings: &MappingTable)
    -> Option<Self::Instance>;
    /// What `clrbpf ps` shows of the runtime in process `info` (whose
    /// mappings are `mappings`), asking nothing of it but its version;
    /// `None` when it runs none.
    fn describe(
        &self,
        procfs: &ProcFs,
        info: &ProcessInfo,
        mappings: &MappingTable,
    ) -> Option<RuntimeSummary>;
}

/// One runtime in one process; see the module doc.
pub trait RuntimeInstance {
    /// The samples the runtime's events become, with their weights.
    type Events;
    /// How the events ended: totals, warnings, the last samples.
    type EventsEnd;
    /// What is left to undo in the process after [`Self::detach`].
    type Detached;

    /// The process's mappings were read again (a runtime still starting
    /// waits for the mappings that say it has started).
    fn sync_mappings(&mut self, mappings: &MappingTable);
    /// Whether the mappings should be read again at the next poll (the
    /// runtime is still starting).
    fn needs_mappings(&self) -> bool;
    /// Whether the runtime names code it compiles: an anonymous frame no
    /// name source named yet may be named by a later read.
    fn names_code(&self) -> bool;
    /// The frame of the runtime's code at `lookup` (the address, or a
    /// return address minus one) as it was at `time_ns`, reported at
    /// `addr`; `None` when the runtime has no name for it.
    fn frame(&self, lookup: u64, addr: u64, time_ns: u64) -> Option<Arc<Frame>>;
    /// `samples` CPU samples had these user frames (named by
    /// [`Self::frame`] or not): for the summary of which name source named
    /// how many.
    fn count_names(&mut self, frames: &[Arc<Frame>], samples: u64) {
        let _ = (frames, samples);
    }
    /// Reads the name sources again (what they added since the last
    /// read); rate limited unless `force`.
    fn refresh_names(&mut self, force: bool);
    /// The code compiled since the last call, and how much more was
    /// dropped, for the unwinder. `read_first`: the name sources are read
    /// first if they were not lately.
    fn take_new_code(&mut self, read_first: bool) -> (Vec<JitMethod>, u64);
    /// Takes what the runtime answered or sent since the last poll;
    /// returns how many events came.
    fn poll(&mut self) -> usize;
    /// Whether [`Self::poll`] has work due at every tick (a start, an
    /// attach or a stop under way). A runtime that is not busy is polled
    /// when its sessions deliver, and at the pipeline's backstop.
    fn busy(&self) -> bool;
    /// The event samples of the sampling windows closed so far.
    fn take_events(&mut self) -> Self::Events;
    /// Asks the runtime to stop its events, without waiting: every
    /// process is asked at once, then each drained ([`Self::stop_events`]).
    fn begin_stop(&mut self);
    /// Drains the events until their end (`until` at most) and hands out
    /// what they came to; `None` when there were none to stop.
    fn stop_events(&mut self, until: Instant) -> Option<Self::EventsEnd>;
    /// Detaches from the runtime at the process's or the run's end: what
    /// was asked of it is handed back to be undone (`keep_files`: the files
    /// it wrote for clrbpf stay).
    fn detach(&mut self, keep_files: bool) -> Self::Detached;
}
