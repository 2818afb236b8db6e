//! The perf maps the pipeline turned on, from the request to the end:
//! what [`super::Pipeline`] needs so that none stays on, and no perf file
//! stays behind, whatever the order in which processes and the run end.
//!
//! - An attach still under way when its process exits (or the run ends)
//!   is not dropped: a thread of its own waits for its answer and, if the
//!   runtime turned perf maps on, turns them off again and removes the
//!   files ([`PerfMapKeeper::abandon`]). Dropping it used to turn them off
//!   but leave the files of a process that had just exited.
//! - The processes asked are written down in the cache directory
//!   ([`crate::clr::perf_map_ledger`]) while the run lives, and what a
//!   killed run left on is undone at the start ([`PerfMapKeeper::recover`]).

use std::{path::Path, thread::JoinHandle};

use crate::{
    clr::{
        instance::{AttachJob, DotnetInstance},
        perf_map_attach::{PerfMapAttach, PerfMapAttachOutcome, PerfMapCleanup},
        perf_map_ledger::{PerfMapLedger, recover},
    },
    process::ProcFs,
};

/// A turn-off under way on its own thread: `None` inside when the attach
/// it waited for had turned nothing on.
type DetachJob = JoinHandle<Option<PerfMapCleanup>>;

/// How long a detach waits for the last threads of an exiting process.
const LAST_THREAD_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits, [`LAST_THREAD_WAIT`] at most, until no thread of `pid` runs.
fn wait_for_last_thread(procfs: &ProcFs, pid: u32) {
    let until = std::time::Instant::now() + LAST_THREAD_WAIT;
    crate::stop::wait_until(until, || !procfs.has_live_threads(pid));
}

/// See the module doc.
#[derive(Default)]
pub struct PerfMapKeeper {
    ledger: Option<PerfMapLedger>,
    /// Abandoned attaches, by pid, each finishing on its own thread.
    detaching: Vec<(u32, DetachJob)>,
}

impl PerfMapKeeper {
    /// Undoes what killed runs left on in the ledgers of `cache_dir`, then
    /// (when this run turns perf maps on) opens this run's ledger there.
    /// Returns the warnings for the summary.
    pub fn recover(&mut self, procfs: &ProcFs, cache_dir: &Path, keep_ledger: bool) -> Vec<String> {
        let recovery = recover(procfs, cache_dir);
        if recovery.ledgers > 0 {
            tracing::info!(
                ledgers = recovery.ledgers,
                turned_off = ?recovery.turned_off,
                files_removed = recovery.files_removed,
                "turned off the perf maps an earlier clrbpf left on when it was killed"
            );
        }
        let mut warnings = recovery.warnings;
        if keep_ledger {
            match PerfMapLedger::open(cache_dir) {
                Ok(ledger) => self.ledger = Some(ledger),
                Err(e) => warnings.push(format!(
                    "perf maps turned on are not written down ({e}): if clrbpf is killed, they stay on until its next start with this cache directory"
                )),
            }
        }
        warnings
    }

    /// Writes down the processes clrbpf turned perf maps on in, or is
    /// asking, when that set changed: `pids`, plus the abandoned attaches
    /// still under way.
    pub fn sync(&mut self, procfs: &ProcFs, pids: impl IntoIterator<Item = u32>) {
        let Some(ledger) = self.ledger.as_mut() else {
            return;
        };
        let detaching = self
            .detaching
            .iter()
            .filter(|(_, job)| !job.is_finished())
            .map(|(pid, _)| *pid);
        ledger.record(procfs, pids.into_iter().chain(detaching));
    }

    /// Lets an attach of process `pid` that has not answered yet finish on
    /// a thread of its own: if it turns perf maps on, they are turned off
    /// again and, unless `keep_files`, their files removed. With `exiting`
    /// (the process's exit was reported), the files are removed once none
    /// of its threads runs ([`wait_for_last_thread`]).
    pub fn abandon(
        &mut self,
        procfs: &ProcFs,
        pid: u32,
        job: AttachJob,
        keep_files: bool,
        exiting: bool,
    ) {
        let procfs = procfs.clone();
        let detach = std::thread::Builder::new()
            .name(format!("clrbpf-detach-{pid}"))
            .spawn(move || match job.join() {
                Ok(Ok(PerfMapAttachOutcome::Enabled(handle))) => {
                    if exiting {
                        wait_for_last_thread(&procfs, pid);
                    }
                    Some(handle.finish(keep_files))
                }
                _ => None,
            });
        self.keep_detaching(pid, detach);
    }

    /// Turns off the perf maps clrbpf turned on in process `pid`, whose exit
    /// was just reported, and (unless `keep_files`) removes their files,
    /// on a thread of its own once none of its threads runs: the exit
    /// reported is its main thread's, and its runtime's diagnostic thread
    /// may still be creating those files (a file removed before it is
    /// created stays behind). The recording loop never waits for it.
    pub fn finish_exited(
        &mut self,
        procfs: &ProcFs,
        pid: u32,
        handle: PerfMapAttach,
        keep_files: bool,
    ) {
        let procfs = procfs.clone();
        let detach = std::thread::Builder::new()
            .name(format!("clrbpf-detach-{pid}"))
            .spawn(move || {
                wait_for_last_thread(&procfs, pid);
                Some(handle.finish(keep_files))
            });
        self.keep_detaching(pid, detach);
    }

    fn keep_detaching(&mut self, pid: u32, detach: std::io::Result<DetachJob>) {
        match detach {
            Ok(detach) => self.detaching.push((pid, detach)),
            Err(e) => {
                tracing::warn!(pid, error = %e, "cannot start a thread to turn perf maps off again")
            }
        }
    }

    /// The abandoned attaches that finished since the last call: the
    /// warnings about their perf files.
    pub fn reap(&mut self) -> Vec<String> {
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.detaching)
            .into_iter()
            .partition(|(_, job)| job.is_finished());
        self.detaching = running;
        done.into_iter()
            .filter_map(|(pid, job)| Some((pid, job.join().ok()??)))
            .flat_map(|(pid, cleanup)| cleanup.files.warnings(pid))
            .collect()
    }

    /// Whether every abandoned attach has finished.
    pub fn all_finished(&self) -> bool {
        self.detaching.iter().all(|(_, job)| job.is_finished())
    }

    /// At the end: the warnings of the abandoned attaches that finished,
    /// and one for each still under way (it stays in the ledger).
    pub fn drain(&mut self) -> Vec<String> {
        let mut warnings = self.reap();
        warnings.extend(self.detaching.iter().map(|(pid, _)| {
            format!(
                "pid {pid}: its runtime had not answered EnablePerfMap at the end: its perf maps may stay on until clrbpf's next start with this --cache-dir"
            )
        }));
        warnings
    }
}

impl super::Pipeline {
    /// Turns off the perf maps that runs killed before their end left on
    /// (their ledgers in `cache_dir`, `--cache-dir`; `None`: no ledger),
    /// and writes down this run's there (see the module doc). Call it before
    /// the first tick: no runtime has been asked for anything yet.
    pub fn keep_perf_map_ledger_in(&mut self, cache_dir: Option<&Path>) {
        let Some(cache_dir) = cache_dir else {
            return;
        };
        for warning in self
            .perf_maps
            .recover(&self.procfs, cache_dir, self.attach_perf_maps)
        {
            tracing::warn!("{warning}");
        }
    }

    /// Takes in the abandoned attaches that finished and writes down the
    /// processes perf maps are on (or asked for) in, if that changed.
    pub(super) fn keep_perf_map_ledger(&mut self) {
        let warnings = self.perf_maps.reap();
        self.summary.warnings.extend(warnings);
        let asked = self
            .processes
            .values()
            .filter(|p| p.runtime().is_some_and(DotnetInstance::asks_perf_maps))
            .map(|p| p.pid);
        self.perf_maps.sync(&self.procfs, asked);
    }
}
