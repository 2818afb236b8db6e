//! How long a process started while clrbpf runs waits for its unwind
//! tables: from its exec (the kernel's `sched_process_exec` event) to its
//! first index in the kernel, to the last of its files' tables, and to its
//! first JIT table; and what that took (tables built, read from
//! `--cache-dir`, already in the kernel for another process, rows written).
//! Kept by [`super::UnwindMaps`] on the worker thread, reported in the
//! summary (`record -v`) and logged for the agent
//! (`--log-level warn,clrbpf::table_times=info`) when the process exits.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use super::UnwindWorker;

/// Processes followed at once at most (a host that execs faster than its
/// processes exit keeps the oldest).
const MAX_FOLLOWED: usize = 4096;
/// Finished timelines of .NET processes kept for the summary at most
/// (the first ones).
const MAX_FINISHED: usize = 256;
/// The log target of the agent's lines.
pub const LOG_TARGET: &str = "clrbpf::table_times";

/// One process's way to its unwind tables. Times are CLOCK_MONOTONIC
/// nanoseconds (the clock of the kernel's events), `None` until reached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessTableTimes {
    pub pid: u32,
    /// Its exec.
    pub exec_ns: u64,
    /// The worker began its first scan (exec to here: discovery and queue).
    pub seen_ns: Option<u64>,
    /// Its first index was in the kernel.
    pub indexed_ns: Option<u64>,
    /// The last scan that gave it a file table it had not had.
    pub files_ns: Option<u64>,
    /// The most file tables its index used (a scan as it exits sees
    /// none).
    pub files: u32,
    /// Scans of its mappings, and how many of them its code mappings
    /// asked for (the kernel's `mmap`/`mprotect` events).
    pub scans: u32,
    pub code_mapped_scans: u32,
    /// `/proc/PID/map_files` entries its scans opened: a mapping unchanged
    /// since its last scan is not opened again.
    pub files_opened: u32,
    /// Its first JIT code came (its names: perf map, jitdump, events).
    pub jit_code_ns: Option<u64>,
    /// Its first JIT table was in the kernel.
    pub jit_table_ns: Option<u64>,
    /// Of the files its scans met: tables built, read from `--cache-dir`,
    /// and already in the kernel (another process's, or its own earlier).
    pub built: u32,
    pub read: u32,
    pub shared: u32,
    /// Time spent building, reading and writing rows into the kernel.
    pub build_ns: u64,
    pub read_ns: u64,
    pub upload_ns: u64,
}

impl ProcessTableTimes {
    /// `at` after the exec, in seconds.
    fn after_exec(&self, at: Option<u64>) -> Option<f64> {
        at.map(|t| t.saturating_sub(self.exec_ns) as f64 / 1e9)
    }

    /// When its stacks could be walked whole: files and JIT code both in.
    pub fn whole_ns(&self) -> Option<u64> {
        Some(self.files_ns?.max(self.jit_table_ns?))
    }

    /// The summary's and the log's line.
    pub fn line(&self) -> String {
        let s = |at: Option<u64>| {
            self.after_exec(at)
                .map_or_else(|| "-".to_owned(), |v| format!("{v:.3} s"))
        };
        format!(
            "pid {} from its exec: seen {}, indexed {}, files {} ({} files: {} built in {:.0} ms, {} read in {:.0} ms, {} already loaded; rows written in {:.1} ms; {} scans, {} on code mappings, {} mapped files opened), JIT code {}, JIT table {}, whole {}",
            self.pid,
            s(self.seen_ns),
            s(self.indexed_ns),
            s(self.files_ns),
            self.files,
            self.built,
            self.build_ns as f64 / 1e6,
            self.read,
            self.read_ns as f64 / 1e6,
            self.shared,
            self.upload_ns as f64 / 1e6,
            self.scans,
            self.code_mapped_scans,
            self.files_opened,
            s(self.jit_code_ns),
            s(self.jit_table_ns),
            s(self.whole_ns()),
        )
    }
}

/// Where a file's table came from, for [`TableTimes::file_done`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableSource {
    Built,
    Read,
    Loaded,
}

/// The timelines of the processes exec'd while clrbpf runs.
#[derive(Debug, Default)]
pub struct TableTimes {
    followed: HashMap<u32, ProcessTableTimes>,
    finished: Vec<ProcessTableTimes>,
    /// Rows written since the last file or JIT table was accounted.
    written: Duration,
}

/// Now on the kernel's clock.
fn now_ns() -> u64 {
    crate::profile::monotonic_ns()
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl TableTimes {
    /// `pid` exec'd at `exec_ns`: follow it (again, if it exec'd before).
    pub fn exec(&mut self, pid: u32, exec_ns: u64) {
        if let Some(old) = self.followed.remove(&pid) {
            self.finish(old);
        }
        if self.followed.len() >= MAX_FOLLOWED {
            // Those never indexed (never sampled, or gone at once) for
            // 10 s are let go of: nothing reports their exit.
            let recent = exec_ns.saturating_sub(10_000_000_000);
            self.followed
                .retain(|_, p| p.seen_ns.is_some() || p.exec_ns > recent);
        }
        if self.followed.len() < MAX_FOLLOWED {
            self.followed.insert(
                pid,
                ProcessTableTimes {
                    pid,
                    exec_ns,
                    ..ProcessTableTimes::default()
                },
            );
        }
    }

    /// A scan of `pid` began (the first one: it is seen), asked for by a
    /// code mapping or not.
    pub fn scan_began(&mut self, pid: u32, code_mapped: bool) {
        if let Some(p) = self.followed.get_mut(&pid) {
            p.seen_ns.get_or_insert_with(now_ns);
            p.scans += 1;
            p.code_mapped_scans += u32::from(code_mapped);
        }
    }

    /// A scan of `pid` opened one of its mapped files.
    pub fn file_opened(&mut self, pid: u32) {
        if let Some(p) = self.followed.get_mut(&pid) {
            p.files_opened += 1;
        }
    }

    /// A scan of `pid` wrote its index, using `files` file tables of which
    /// `new` it had not used before.
    pub fn scanned(&mut self, pid: u32, files: usize, new: usize) {
        if let Some(p) = self.followed.get_mut(&pid) {
            let now = now_ns();
            p.indexed_ns.get_or_insert(now);
            if new > 0 {
                p.files_ns = Some(now);
            }
            p.files = p.files.max(u32::try_from(files).unwrap_or(u32::MAX));
        }
    }

    /// A file of `pid` got its table from `source`, in `took` (the rows
    /// written meanwhile included).
    pub fn file_done(&mut self, pid: u32, source: TableSource, took: Duration) {
        let written = std::mem::take(&mut self.written);
        if let Some(p) = self.followed.get_mut(&pid) {
            p.upload_ns += nanos(written);
            let ns = nanos(took.saturating_sub(written));
            match source {
                TableSource::Built => (p.built += 1, p.build_ns += ns),
                TableSource::Read => (p.read += 1, p.read_ns += ns),
                TableSource::Loaded => (p.shared += 1, ()),
            };
        }
    }

    /// Rows were written into the kernel, in `took` (accounted to the
    /// file or JIT table they belong to).
    pub fn rows_written(&mut self, took: Duration) {
        self.written += took;
    }

    /// `pid`'s first JIT code came.
    pub fn jit_code(&mut self, pid: u32) {
        if let Some(p) = self.followed.get_mut(&pid) {
            p.jit_code_ns.get_or_insert_with(now_ns);
        }
    }

    /// A JIT table of `pid` is in the kernel (`loaded`), or could not be.
    pub fn jit_table(&mut self, pid: u32, loaded: bool) {
        let written = std::mem::take(&mut self.written);
        if let Some(p) = self.followed.get_mut(&pid) {
            p.upload_ns += nanos(written);
            if loaded {
                p.jit_table_ns.get_or_insert_with(now_ns);
            }
        }
    }

    /// `pid` exited: its timeline is final.
    pub fn forget(&mut self, pid: u32) {
        if let Some(p) = self.followed.remove(&pid) {
            self.finish(p);
        }
    }

    /// A finished timeline: logged (for the agent) and kept for the summary
    /// when it ran JIT code (.NET), the processes the summary reports.
    fn finish(&mut self, times: ProcessTableTimes) {
        if times.jit_code_ns.is_none() {
            tracing::debug!(target: LOG_TARGET, "unwind tables of a new process: {}", times.line());
            return;
        }
        tracing::info!(target: LOG_TARGET, "unwind tables of a new process: {}", times.line());
        if self.finished.len() < MAX_FINISHED {
            self.finished.push(times);
        }
    }

    /// The end: every timeline is final.
    pub fn finish_all(&mut self) {
        let followed: Vec<ProcessTableTimes> = self.followed.drain().map(|(_, p)| p).collect();
        for times in followed {
            self.finish(times);
        }
    }

    /// Every timeline, finished or not (the end of a recording), by pid.
    pub fn report(&self) -> Vec<ProcessTableTimes> {
        let mut all: Vec<ProcessTableTimes> = self
            .finished
            .iter()
            .chain(self.followed.values())
            .cloned()
            .collect();
        all.sort_by_key(|p| (p.exec_ns, p.pid));
        all
    }
}

impl UnwindWorker {
    /// `pid` exec'd at `exec_ns` (the kernel's event): follow its way to
    /// its tables, and rescan it if it is indexed (its old image's index is
    /// stale) (queued).
    pub fn process_exec(&self, pid: u32, exec_ns: u64) {
        self.run(Box::new(move |maps, _| {
            maps.times.exec(pid, exec_ns);
            maps.code_mapped(pid, exec_ns);
        }));
    }

    /// These processes mapped executable memory, at these times (the
    /// kernel's events): the indexed ones are rescanned (queued).
    pub fn code_mapped(&self, mapped: Vec<(u32, u64)>) {
        if !mapped.is_empty() {
            self.run(Box::new(move |maps, _| {
                for (pid, at_ns) in mapped {
                    maps.code_mapped(pid, at_ns);
                }
            }));
        }
    }
}

/// Times a piece of the worker's work.
pub struct Stopwatch(Instant);

impl Stopwatch {
    pub fn start() -> Self {
        Self(Instant::now())
    }

    pub fn took(&self) -> Duration {
        self.0.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeline_runs_from_exec_to_whole_and_is_reported_once() {
        let mut times = TableTimes::default();
        let exec = now_ns();
        times.exec(7, exec);
        times.scan_began(8, false); // not followed: no effect
        times.scan_began(7, false);
        times.rows_written(Duration::from_millis(5));
        times.file_done(7, TableSource::Built, Duration::from_millis(25));
        times.file_done(7, TableSource::Loaded, Duration::ZERO);
        times.scanned(7, 2, 2);
        let files = times.followed[&7].files_ns;
        times.scanned(7, 2, 0);
        assert_eq!(times.followed[&7].files_ns, files, "no new file: unchanged");
        times.scanned(7, 0, 0);
        assert_eq!(
            times.followed[&7].files, 2,
            "a scan as it exits keeps the count"
        );
        assert!(times.followed[&7].whole_ns().is_none(), "no JIT table yet");
        times.jit_code(7);
        times.jit_table(7, true);
        times.forget(7);
        times.forget(7);
        let report = times.report();
        assert_eq!(report.len(), 1);
        let p = &report[0];
        assert_eq!((p.built, p.shared, p.build_ns), (1, 1, 20_000_000));
        assert_eq!(p.upload_ns, 5_000_000);
        assert!(p.whole_ns().is_some_and(|w| w >= exec));
        assert!(p.line().starts_with("pid 7 from its exec: seen "));
    }
}
