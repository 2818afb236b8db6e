//! A process's threads as the runtime inside it numbers them. A CLR event
//! carries the thread id the runtime got from `gettid()`, which in a
//! container is the id in the container's PID namespace; the kernel's
//! samples carry the host's. CLR samples enter the profile through
//! [`ThreadIds::host`], so that a thread has one `thread.id` (and the
//! same `thread.name`) in every sample type, and a lock owner's id points
//! at a thread of the CPU samples.
//!
//! The table comes from `/proc/PID/task/*/status` (`NSpid:` and `Name:`),
//! read when events arrive (the threads that sent them are still there)
//! and when an id is missing, at most every [`RESCAN_EVERY`]; a scan reads
//! the status of threads it has not seen only. Threads the process
//! controls can be many: the table holds at most [`MAX_THREADS`].

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use super::{ProcFs, STATUS_MAX_BYTES, parse_status};

/// Threads read in one scan, and kept.
pub const MAX_THREADS: usize = 4096;
/// How often a missing id makes the threads be read again at most.
const RESCAN_EVERY: Duration = Duration::from_millis(250);

/// One thread as the host sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostThread {
    pub tid: u32,
    /// `comm`; `None` when it could not be read.
    pub name: Option<Arc<str>>,
}

/// The threads of one process by the id its runtime reports.
#[derive(Debug, Default)]
pub struct ThreadIds {
    /// Own-namespace tid to host thread.
    threads: HashMap<u32, HostThread>,
    /// Host tids read, so a scan reads only new threads.
    seen: HashSet<u32>,
    scanned_at: Option<Instant>,
    /// The process lives in a PID namespace of its own: its ids must be
    /// translated, and one not found is not a host id.
    own_namespace: bool,
}

impl ThreadIds {
    /// `own_namespace`: the process's pid in its namespace differs from
    /// the host's.
    pub fn new(own_namespace: bool) -> Self {
        Self {
            own_namespace,
            ..Self::default()
        }
    }

    /// The host thread behind `runtime_tid` of process `pid`. `None` when
    /// the process is in a namespace of its own and the thread is gone (or
    /// the id is not one of its threads): then no host id is known.
    pub fn host(&mut self, procfs: &ProcFs, pid: u32, runtime_tid: u64) -> Option<HostThread> {
        let tid = u32::try_from(runtime_tid).ok()?;
        if !self.threads.contains_key(&tid) {
            self.refresh(procfs, pid);
        }
        match self.threads.get(&tid) {
            Some(thread) => Some(thread.clone()),
            None if self.own_namespace => None,
            // Same namespace: the id is the host's, its name unknown.
            None => Some(HostThread { tid, name: None }),
        }
    }

    /// Reads the threads of process `pid` not seen yet, unless that was
    /// done in the last [`RESCAN_EVERY`]. Threads gone since are kept
    /// (their events may still be on the way) until the table is full.
    pub fn refresh(&mut self, procfs: &ProcFs, pid: u32) {
        if self
            .scanned_at
            .is_some_and(|at| at.elapsed() < RESCAN_EVERY)
        {
            return;
        }
        self.scanned_at = Some(Instant::now());
        let Ok(tasks) = std::fs::read_dir(procfs.pid_path(pid, "task")) else {
            return;
        };
        let new: Vec<u32> = tasks
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
            .filter(|tid| !self.seen.contains(tid))
            .take(MAX_THREADS)
            .collect();
        if self.seen.len() + new.len() > MAX_THREADS {
            self.threads.clear();
            self.seen.clear();
        }
        self.seen.extend(&new);
        let found = new.into_iter().filter_map(|tid| {
            let (status, _) = procfs
                .read_pid_file(pid, &format!("task/{tid}/status"), STATUS_MAX_BYTES)
                .ok()?;
            let status = parse_status(&String::from_utf8_lossy(&status))?;
            let thread = HostThread {
                tid,
                name: status.name.map(Arc::from),
            };
            Some((status.ns_pid.unwrap_or(tid), thread))
        });
        self.threads.extend(found);
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, path::Path};

    use super::*;

    const STATUS: &str = "Name:\t.NET TP Worker\nPPid:\t1\nUid:\t0\t0\t0\t0\n";

    /// Writes a fake `/proc/PID/task/TID/status` under `root`.
    fn thread(root: &Path, pid: u32, host: u32, ns: Option<u32>) {
        let dir = root.join(format!("{pid}/task/{host}"));
        fs::create_dir_all(&dir).expect("mkdir");
        let ns_line = match ns {
            Some(ns) => format!("NSpid:\t{host}\t{ns}\n"),
            None => format!("NSpid:\t{host}\n"),
        };
        fs::write(dir.join("status"), format!("{STATUS}{ns_line}")).expect("write");
    }

    #[test]
    fn ids_of_a_process_in_its_own_namespace_become_host_ids() {
        let root = tempfile::tempdir().expect("tempdir");
        thread(root.path(), 4242, 4242, Some(1));
        thread(root.path(), 4242, 4250, Some(9));
        let procfs = ProcFs::new(root.path());
        let mut ids = ThreadIds::new(true);
        let worker = ids.host(&procfs, 4242, 9).expect("thread 9");
        assert_eq!(worker.tid, 4250);
        assert_eq!(worker.name.as_deref(), Some(".NET TP Worker"));
        assert_eq!(ids.host(&procfs, 4242, 1).map(|t| t.tid), Some(4242));
        // Not a thread of the process: no host id is made up.
        assert_eq!(ids.host(&procfs, 4242, 4250), None);
        assert_eq!(ids.host(&procfs, 4242, u64::MAX), None);
    }

    #[test]
    fn ids_in_the_hosts_namespace_stay_and_get_names() {
        let root = tempfile::tempdir().expect("tempdir");
        thread(root.path(), 77, 78, None);
        let procfs = ProcFs::new(root.path());
        let mut ids = ThreadIds::new(false);
        let found = ids.host(&procfs, 77, 78).expect("thread 78");
        assert_eq!(
            (found.tid, found.name.as_deref()),
            (78, Some(".NET TP Worker"))
        );
        // Gone before it was read: the id is still the host's.
        assert_eq!(
            ids.host(&procfs, 77, 79),
            Some(HostThread {
                tid: 79,
                name: None
            })
        );
    }

    #[test]
    fn a_thread_seen_once_keeps_its_id_after_it_exits() {
        let root = tempfile::tempdir().expect("tempdir");
        thread(root.path(), 5, 6, Some(2));
        let procfs = ProcFs::new(root.path());
        let mut ids = ThreadIds::new(true);
        assert_eq!(ids.host(&procfs, 5, 2).map(|t| t.tid), Some(6));
        fs::remove_dir_all(root.path().join("5/task/6")).expect("rm");
        ids.scanned_at = None;
        assert_eq!(ids.host(&procfs, 5, 2).map(|t| t.tid), Some(6));
    }
}
