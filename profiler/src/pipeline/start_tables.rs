//! Whole stacks from the first sample for the processes a recording knows
//! when it starts: they are listed ([`start_targets`]), handed to the unwind
//! worker before any sampling program is attached
//! ([`crate::bpf::start_tables`]), and the start waits for their tables,
//! a bounded time ([`wait_for_tables`]), with progress on a terminal. For
//! a .NET process that means its files' tables and, once its perf map
//! attach has replayed the methods compiled so far, its JIT table: a
//! framework wrapper re-jitted at tier 1 without a frame keeps its caller
//! from the first sample. What was not ready goes to the summary
//! ([`TablesAtStart`]).
//!
//! Order: the `-p` targets first, then (whole-host mode) the .NET
//! processes, then the other processes with code. Sampling waits for the
//! first two kinds only; the worker goes on through the others after it
//! started. A .NET runtime whose perf map answer takes longer than
//! [`JIT_ATTACH_WAIT`] is not waited for.

use std::{
    io::Write as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use super::{Pipeline, tracked::TrackedProcess};
use crate::runtime::RuntimeInstance;
use crate::{
    bpf::start_tables::StartIndexing,
    process::{ProcFs, dotnet::DotnetRuntime, list_pids},
};

/// Default of `record --start-wait`.
pub const DEFAULT_START_WAIT: Duration = Duration::from_secs(5);

/// How long the start waits for a .NET runtime to answer its perf map
/// request (a .NET 8 app answers and replays its methods in well under a
/// second).
const JIT_ATTACH_WAIT: Duration = Duration::from_secs(1);

/// How often the waiting loop looks at the worker (and redraws progress).
const POLL_EVERY: Duration = Duration::from_millis(20);

/// The processes to index before sampling, in order, and how many of the
/// first must be ready before sampling starts.
pub fn start_targets(procfs: &ProcFs, pids: &[u32], whole_host: bool) -> (Vec<u32>, usize) {
    let mut ordered: Vec<u32> = Vec::with_capacity(pids.len());
    for &pid in pids {
        if !ordered.contains(&pid) {
            ordered.push(pid);
        }
    }
    if !whole_host {
        let required = ordered.len();
        return (ordered, required);
    }
    let me = std::process::id();
    let mut others = Vec::new();
    for pid in list_pids(procfs) {
        if pid == me || ordered.contains(&pid) {
            continue;
        }
        // Kernel threads (no mappings) and processes gone meanwhile have
        // nothing to index.
        let Ok(maps) = procfs.maps(pid) else {
            continue;
        };
        if !maps
            .iter()
            .any(|m| m.is_executable() && m.file_path().is_some())
        {
            continue;
        }
        if DotnetRuntime::detect(&maps).is_some() {
            ordered.push(pid);
        } else {
            others.push(pid);
        }
    }
    let required = ordered.len();
    ordered.extend(others);
    (ordered, required)
}

/// What was ready when sampling started, for the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TablesAtStart {
    /// How long the start waited, and its bound (`--start-wait`).
    pub waited: Duration,
    pub limit: Duration,
    /// Processes whose tables were loaded before the first sample.
    pub ready: usize,
    /// `-p` targets and .NET processes whose tables were not loaded yet
    /// (pid, name): their first stacks were walked by frame pointers.
    pub not_ready: Vec<(u32, String)>,
    /// Whole-host mode's other processes, indexed after sampling started.
    pub left_to_first_sample: usize,
}

impl TablesAtStart {
    /// The summary's line about it; `None` when there was nothing to load.
    pub fn summary_line(&self) -> Option<String> {
        let total = self.ready + self.not_ready.len() + self.left_to_first_sample;
        if total == 0 {
            return None;
        }
        let mut line = format!(
            "unwind tables of {} of {} processes known at start loaded before sampling ({:.1} s)",
            self.ready,
            total,
            self.waited.as_secs_f64()
        );
        if self.left_to_first_sample > 0 {
            line.push_str(&format!(
                "; {} other processes were indexed after sampling started",
                self.left_to_first_sample
            ));
        }
        Some(line)
    }

    /// The warning for the processes that were not ready; `None` if all
    /// were.
    pub fn warning(&self) -> Option<String> {
        if self.not_ready.is_empty() {
            return None;
        }
        let named: Vec<String> = self
            .not_ready
            .iter()
            .take(5)
            .map(|(pid, name)| format!("{pid} ({name})"))
            .collect();
        let more = self.not_ready.len().saturating_sub(named.len());
        Some(format!(
            "the unwind tables of {} processes were not ready when sampling started after {:.1} s (--start-wait): until they were, their stacks were walked by frame pointers and may miss callers: pid {}{}",
            self.not_ready.len(),
            self.waited.as_secs_f64(),
            named.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        ))
    }
}

/// Where a process's JIT-compiled code stands at the start.
enum StartJit {
    /// Its perf map attach is under way.
    Waiting,
    /// Its methods so far went to the unwind worker.
    Sent,
    /// No .NET runtime (or it is still starting): nothing to wait for.
    NotManaged,
}

impl Pipeline {
    /// Hands the JIT-compiled methods of `pid` to the unwind worker once
    /// its perf map attach is done (the runtime replays every method
    /// compiled so far into the perf map): a method re-jitted without a
    /// frame before the recording started gets its rows before the first
    /// sample too.
    fn start_jit_code(&mut self, pid: u32) -> StartJit {
        let Some(runtime) = self
            .processes
            .get_mut(&pid)
            .and_then(TrackedProcess::runtime_mut)
        else {
            return StartJit::NotManaged;
        };
        runtime.poll_attach();
        if runtime.attach_pending() {
            return StartJit::Waiting;
        }
        if !runtime.names_code() {
            return StartJit::NotManaged;
        }
        runtime.refresh_names(true);
        if runtime.attach_pending() {
            // The files were gone (another recorder's end removed them):
            // perf maps are being turned on again; their methods come then.
            return StartJit::Waiting;
        }
        let (ranges, dropped) = runtime.take_new_code(true);
        if let Some(unwind) = self.unwind.as_ref() {
            unwind.add_jit_code(pid, ranges, dropped);
        }
        StartJit::Sent
    }
}

/// Queues `pids` on the pipeline's unwind worker (the first `required` are
/// tracked now, so their .NET runtimes are asked for perf maps) and waits
/// until their tables, JIT ones included, are loaded, `limit` has passed,
/// or `stop` resolves (Ctrl-C: its reason is returned), drawing progress
/// on stderr when `progress`.
pub async fn wait_for_tables(
    pipeline: &mut Pipeline,
    (pids, required): (Vec<u32>, usize),
    limit: Duration,
    progress: bool,
    stop: impl Future<Output = &'static str>,
) -> (TablesAtStart, Option<&'static str>) {
    let started = Instant::now();
    let Some(worker) = pipeline.unwind.as_ref().filter(|_| !pids.is_empty()) else {
        // Launch mode: the command starts after sampling does.
        return (TablesAtStart::default(), None);
    };
    // Every process is indexed, in order; sampling waits only for the
    // first `required` (the -p targets and the .NET processes): a
    // whole-host start does not wait for every process on the host.
    let required = required.min(pids.len());
    let start = Arc::new(StartIndexing::new(pids));
    worker.index_at_start(Arc::clone(&start));
    let mut jit_waiting: Vec<u32> = start.pids()[..required].to_vec();
    for &pid in &jit_waiting {
        pipeline.track(pid);
    }
    let mut jit_loading: Vec<(u32, Arc<AtomicBool>)> = Vec::new();
    let mut stop = std::pin::pin!(stop);
    let mut stopped = None;
    let mut drawn = false;
    loop {
        jit_waiting.retain(|&pid| match pipeline.start_jit_code(pid) {
            StartJit::Waiting => true,
            StartJit::NotManaged => false,
            StartJit::Sent => {
                let done = Arc::new(AtomicBool::new(false));
                if let Some(worker) = pipeline.unwind.as_ref() {
                    worker.jit_table_now(pid, Arc::clone(&done));
                }
                jit_loading.push((pid, done));
                false
            }
        });
        // A runtime that has not answered its perf map request by now is
        // not waited for (a hostile or stuck diagnostic socket must not
        // hold the start): its methods come when it answers.
        let jit_ready = (jit_waiting.is_empty() || started.elapsed() >= JIT_ATTACH_WAIT)
            && jit_loading
                .iter()
                .all(|(_, done)| done.load(Ordering::Relaxed));
        let required_done = start.is_finished() || start.done_count() >= required;
        if (required_done && jit_ready) || started.elapsed() >= limit {
            break;
        }
        tokio::select! {
            () = tokio::time::sleep(POLL_EVERY) => {}
            reason = &mut stop => {
                stopped = Some(reason);
                break;
            }
        }
        // A quick start draws nothing.
        if progress && started.elapsed() >= Duration::from_millis(200) {
            drawn = true;
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\rclrbpf: loading unwind tables before sampling: {}/{} processes, {:.1} s (at most {:.0} s, --start-wait) ",
                start.done_count(),
                start.pids().len(),
                started.elapsed().as_secs_f64(),
                limit.as_secs_f64()
            );
            let _ = err.flush();
        }
    }
    if drawn {
        eprint!("\r{:110}\r", "");
    }
    let done = start.done();
    let jit_late = |pid: &u32| {
        jit_waiting.contains(pid)
            || jit_loading
                .iter()
                .any(|(p, done)| p == pid && !done.load(Ordering::Relaxed))
    };
    let not_ready: Vec<(u32, String)> = start.pids()[..required]
        .iter()
        .filter(|pid| !done.contains(pid) || jit_late(pid))
        .map(|&pid| {
            let name = pipeline
                .procfs
                .process_info(pid)
                .map_or_else(|_| "exited".to_owned(), |info| info.exe_name);
            (pid, name)
        })
        .collect();
    let ready = done.iter().filter(|pid| !jit_late(pid)).count();
    let tables = TablesAtStart {
        waited: started.elapsed(),
        limit,
        ready,
        left_to_first_sample: start.pids().len() - ready - not_ready.len(),
        not_ready,
    };
    (tables, stopped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_come_first_once_and_must_be_ready() {
        let procfs = ProcFs::default();
        assert_eq!(start_targets(&procfs, &[7, 9, 7], false), (vec![7, 9], 2));
        // Whole host: this process is never in the list; the targets lead.
        let me = std::process::id();
        let (all, required) = start_targets(&procfs, &[4_000_000], true);
        assert_eq!(all[0], 4_000_000);
        assert!(required >= 1 && required <= all.len());
        assert!(!all.contains(&me));
    }

    #[test]
    fn the_summary_names_what_was_not_ready() {
        let tables = TablesAtStart {
            waited: Duration::from_millis(5000),
            limit: Duration::from_secs(5),
            ready: 3,
            not_ready: vec![(42, "dotnet".to_owned())],
            left_to_first_sample: 2,
        };
        let line = tables.summary_line().expect("a line");
        assert!(line.contains("3 of 6 processes"), "{line}");
        assert!(line.contains("2 other processes"), "{line}");
        let warning = tables.warning().expect("a warning");
        assert!(warning.contains("42 (dotnet)"), "{warning}");
        assert!(TablesAtStart::default().summary_line().is_none());
        assert!(TablesAtStart::default().warning().is_none());
    }
}
