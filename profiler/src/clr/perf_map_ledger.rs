//! The perf maps a running clrbpf turned on, written down in its cache
//! directory (`--cache-dir`), so that a clrbpf killed before it could turn
//! them off again (SIGKILL, the OOM killer, a node drain) does not leave
//! every .NET app of the host writing `/tmp/perf-PID.map` and
//! `/tmp/jit-PID.dump` for the rest of its life: the next clrbpf to start
//! with that directory does it ([`recover`]).
//!
//! Place in the data flow: the pipeline hands [`PerfMapLedger::record`] the
//! processes it asked for perf maps (or is asking) whenever that set
//! changes; `record` and `agent` call [`recover`] before their pipeline
//! asks any runtime for anything.
//!
//! 1. Each run owns one ledger, `perf-maps-<pid>-<nanos>`, and holds an
//!    exclusive `flock` on its companion `<name>.lock` while it runs: a
//!    ledger whose lock can be taken is a dead run's (whatever pid
//!    namespace either run lives in). The ledger is rewritten whole under
//!    a temporary name and renamed ([`write_entry`]), so it is never seen
//!    half written.
//! 2. Its content is untrusted at [`recover`]: at most
//!    [`MAX_LEDGER_BYTES`], strictly parsed, entries of another boot
//!    ignored; an entry is acted on only when its pid runs now with the
//!    recorded start time (so it is the same process), and does not set
//!    `DOTNET_PerfMapEnabled` itself. Then, as the dead run's end would
//!    have: DisablePerfMap over the diagnostic socket and removal of the
//!    perf files written since the request, under [`PerfMapAttach::finish`]'s
//!    rules ([`crate::symbolize::perf_files`]).

use std::{
    collections::BTreeMap,
    ffi::{OsStr, OsString},
    fs::File,
    io::Read as _,
    os::fd::AsRawFd as _,
    path::Path,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use super::perf_map_attach::PerfMapAttach;
use crate::{
    process::{ProcFs, root::TargetDir},
    unwind::disk_cache::{DiskCacheError, open_cache_dir, write_entry},
};

/// Largest ledger read (a line is at most 53 bytes: about 1 200 processes).
pub const MAX_LEDGER_BYTES: u64 = 64 * 1024;
/// Most processes one ledger names; more are left out (and said so once).
pub const MAX_ENTRIES: usize = 1024;
/// Most dead runs' ledgers one start undoes (the rest: at the next start).
const MAX_LEDGERS_PER_START: usize = 16;
/// How long [`recover`] waits for the runtimes, all together.
const RECOVER_DEADLINE: Duration = Duration::from_secs(5);

const PREFIX: &str = "perf-maps-";
const LOCK_SUFFIX: &str = ".lock";
const MAGIC: &str = "clrbpf perf maps 1";

/// Why no ledger is kept (the run goes on without one).
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error(transparent)]
    Dir(#[from] DiskCacheError),
    #[error("cannot create the perf map ledger lock {name} in the cache directory")]
    Lock {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read this boot's id (/proc/sys/kernel/random/boot_id)")]
    BootId,
}

/// One process in a ledger: enough to know it again and to tell its
/// perf files from older ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LedgerEntry {
    pub pid: u32,
    /// Field 22 of `/proc/PID/stat` when perf maps were asked for.
    pub start_time_ticks: u64,
    /// When they were asked for (whole seconds since the epoch).
    pub enabled_at_secs: u64,
}

/// This run's ledger.
pub struct PerfMapLedger {
    dir: TargetDir,
    name: OsString,
    lock_name: OsString,
    /// Held (with its `flock`) while this run lives.
    _lock: File,
    boot_id: String,
    entries: BTreeMap<u32, LedgerEntry>,
    /// The last write failed or left entries out: said once.
    warned: bool,
}

impl PerfMapLedger {
    /// Opens this run's ledger in the cache directory `cache_dir` (checked
    /// and created as the unwind table cache does). Nothing is written
    /// until a process is [`Self::record`]ed.
    pub fn open(cache_dir: &Path) -> Result<Self, LedgerError> {
        let dir = open_cache_dir(cache_dir)?;
        let boot_id = boot_id().ok_or(LedgerError::BootId)?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("{PREFIX}{}-{nanos}", std::process::id());
        let lock_name = OsString::from(format!("{name}{LOCK_SUFFIX}"));
        let lock_error = |source| LedgerError::Lock {
            name: lock_name.to_string_lossy().into_owned(),
            source,
        };
        let lock = dir.create_new(&lock_name).map_err(lock_error)?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(lock_error(std::io::Error::last_os_error()));
        }
        Ok(Self {
            dir,
            name: OsString::from(name),
            lock_name,
            _lock: lock,
            boot_id,
            entries: BTreeMap::new(),
            warned: false,
        })
    }

    /// Makes the ledger name exactly the processes `pids` (the ones clrbpf
    /// turned perf maps on in, or is asking): a pid new to it is written
    /// with its start time and the time now; nothing is written when the
    /// set did not change.
    pub fn record(&mut self, procfs: &ProcFs, pids: impl IntoIterator<Item = u32>) {
        let mut next = BTreeMap::new();
        let now_secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        for pid in pids {
            let entry = match self.entries.get(&pid) {
                Some(entry) => *entry,
                None => match procfs.start_time_ticks(pid) {
                    Ok(start_time_ticks) => LedgerEntry {
                        pid,
                        start_time_ticks,
                        enabled_at_secs: now_secs,
                    },
                    // Gone already: nothing left on in it.
                    Err(_) => continue,
                },
            };
            next.insert(pid, entry);
        }
        if next == self.entries {
            return;
        }
        self.entries = next;
        self.write();
    }

    fn write(&mut self) {
        if self.entries.is_empty() {
            let _ = self.dir.unlink(&self.name);
            return;
        }
        let mut text = format!("{MAGIC}\nboot {}\n", self.boot_id);
        let mut left_out = 0;
        for (i, entry) in self.entries.values().enumerate() {
            let line = format!(
                "{} {} {}\n",
                entry.pid, entry.start_time_ticks, entry.enabled_at_secs
            );
            if i >= MAX_ENTRIES || (text.len() + line.len()) as u64 > MAX_LEDGER_BYTES {
                left_out += 1;
                continue;
            }
            text.push_str(&line);
        }
        let written = write_entry(&self.dir, &self.name, text.as_bytes());
        if (written.is_err() || left_out > 0) && !self.warned {
            self.warned = true;
            tracing::warn!(
                ledger = %self.dir.display_child(&self.name).display(),
                error = ?written.err(),
                left_out,
                "the ledger of perf maps clrbpf turned on is incomplete: if clrbpf is killed, the next start cannot turn them all off"
            );
        }
    }
}

impl Drop for PerfMapLedger {
    /// A run that ends has turned its perf maps off: its ledger goes, the
    /// state file first, then the lock. The processes whose runtime did not
    /// answer in time stay written down, for the next start to try again.
    fn drop(&mut self) {
        if self.entries.is_empty() {
            let _ = self.dir.unlink(&self.name);
        }
        let _ = self.dir.unlink(&self.lock_name);
    }
}

/// What [`recover`] did.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Dead runs' ledgers read (and removed).
    pub ledgers: usize,
    /// Processes whose perf maps were turned off again.
    pub turned_off: Vec<u32>,
    /// Perf files removed.
    pub files_removed: usize,
    /// What could not be done, one line each.
    pub warnings: Vec<String>,
}

/// Undoes what dead runs left on (see the module doc): reads the ledgers
/// of `cache_dir` whose run is gone, turns off the perf maps of their
/// processes that still run, removes their perf files, and removes the
/// ledgers. Waits for the runtimes at most [`RECOVER_DEADLINE`].
pub fn recover(procfs: &ProcFs, cache_dir: &Path) -> Recovery {
    let mut recovery = Recovery::default();
    // A cache directory that is not there yet holds no ledger; one that is
    // not clrbpf's is not read (the unwind cache says why).
    let Ok(dir) = TargetDir::open_own(cache_dir) else {
        return recovery;
    };
    if open_cache_dir(cache_dir).is_err() {
        return recovery;
    }
    let this_boot = boot_id();
    let mut jobs = Vec::new();
    let names = dir.entries().unwrap_or_default();
    let ledgers = names.iter().filter(|name| is_ledger_name(name));
    for name in ledgers.take(MAX_LEDGERS_PER_START) {
        let Some(entries) = take_dead_ledger(&dir, name, this_boot.as_deref()) else {
            continue;
        };
        recovery.ledgers += 1;
        for entry in entries {
            if let Some(job) = undo_entry(procfs, entry) {
                jobs.push((entry.pid, job));
            }
        }
    }
    let until = Instant::now() + RECOVER_DEADLINE;
    crate::stop::wait_until(until, || jobs.iter().all(|(_, job)| job.is_finished()));
    for (pid, job) in jobs {
        if !job.is_finished() {
            recovery.warnings.push(format!(
                "pid {pid}: its runtime did not answer DisablePerfMap in time: perf maps an earlier clrbpf turned on may stay on"
            ));
            continue;
        }
        match job.join() {
            Ok(Ok(Some(cleanup))) => {
                if let Err(e) = cleanup.disable {
                    recovery.warnings.push(format!(
                        "pid {pid}: turning off perf maps an earlier clrbpf turned on: {e}"
                    ));
                } else {
                    recovery.turned_off.push(pid);
                }
                recovery.files_removed += cleanup.files.removed.len();
                recovery.warnings.extend(
                    cleanup
                        .files
                        .failed
                        .iter()
                        .map(|(path, e)| format!("pid {pid}: removing {}: {e}", path.display())),
                );
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) => recovery.warnings.push(format!(
                "pid {pid}: cannot reach its runtime to turn off perf maps an earlier clrbpf turned on: {e}"
            )),
            Err(_) => {}
        }
    }
    recovery
}

/// A joinable undo of one entry: `None` inside when there was nothing to
/// undo (the app writes perf maps by itself).
type UndoJob = std::thread::JoinHandle<
    Result<Option<super::perf_map_attach::PerfMapCleanup>, super::ipc::IpcError>,
>;

/// Starts undoing `entry` on a thread of its own when its process is the
/// one the entry names.
fn undo_entry(procfs: &ProcFs, entry: LedgerEntry) -> Option<UndoJob> {
    let pid = entry.pid;
    if pid == std::process::id() || pid == 0 {
        return None;
    }
    // The same process, not a later one under its pid.
    if procfs.start_time_ticks(pid).ok()? != entry.start_time_ticks {
        return None;
    }
    // Never before the process started, never in the future: the time
    // decides which of its files are removed.
    let recorded = UNIX_EPOCH + Duration::from_secs(entry.enabled_at_secs);
    let started = crate::symbolize::target_fs::process_start_time(pid).unwrap_or(UNIX_EPOCH);
    let enabled_at = recorded.max(started).min(SystemTime::now());
    let procfs = procfs.clone();
    std::thread::Builder::new()
        .name(format!("clrbpf-undo-{pid}"))
        .spawn(move || {
            let adopted = PerfMapAttach::adopt(&procfs, pid, enabled_at)?;
            Ok(adopted.map(|attach| attach.finish(false)))
        })
        .ok()
}

fn is_ledger_name(name: &OsStr) -> bool {
    let Some(text) = name.to_str() else {
        return false;
    };
    text.strip_prefix(PREFIX).is_some_and(|rest| {
        !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit() || b == b'-')
    })
}

/// The entries of ledger `name` if its run is dead (its lock can be
/// taken); the ledger and its lock are removed then. `None` when its run
/// lives, or another start took it first.
fn take_dead_ledger(
    dir: &TargetDir,
    name: &OsStr,
    this_boot: Option<&str>,
) -> Option<Vec<LedgerEntry>> {
    let mut lock_name = name.to_owned();
    lock_name.push(LOCK_SUFFIX);
    let lock = dir.open_file(&lock_name).ok();
    if let Some(lock) = &lock {
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return None;
        }
    }
    // Read under the lock: a start that took it first removed the ledger.
    let text = read_ledger(dir, name);
    let _ = dir.unlink(name);
    let _ = dir.unlink(&lock_name);
    let text = text?;
    let entries = parse_ledger(&text, this_boot?);
    if entries.is_none() {
        tracing::warn!(
            ledger = %dir.display_child(name).display(),
            "ignored a malformed perf map ledger"
        );
    }
    entries
}

fn read_ledger(dir: &TargetDir, name: &OsStr) -> Option<String> {
    let file = dir.open_file(name).ok()?;
    let mut bytes = Vec::new();
    file.take(MAX_LEDGER_BYTES + 1)
        .read_to_end(&mut bytes)
        .ok()?;
    if bytes.len() as u64 > MAX_LEDGER_BYTES {
        return None;
    }
    String::from_utf8(bytes).ok()
}

/// The entries of a ledger's text written during boot `this_boot` (none
/// for another boot: its processes are all gone); `None` when malformed.
pub fn parse_ledger(text: &str, this_boot: &str) -> Option<Vec<LedgerEntry>> {
    let mut lines = text.lines();
    if lines.next()? != MAGIC {
        return None;
    }
    let boot = lines.next()?.strip_prefix("boot ")?;
    if boot != this_boot {
        return Some(Vec::new());
    }
    let mut entries = Vec::new();
    for line in lines {
        let mut fields = line.split(' ');
        let entry = LedgerEntry {
            pid: fields.next()?.parse().ok()?,
            start_time_ticks: fields.next()?.parse().ok()?,
            enabled_at_secs: fields.next()?.parse().ok()?,
        };
        if fields.next().is_some() || entries.len() >= MAX_ENTRIES {
            return None;
        }
        entries.push(entry);
    }
    Some(entries)
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`), checked.
fn boot_id() -> Option<String> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = text.trim();
    (!id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-'))
        .then(|| id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ledgers_parse_strictly() {
        let boot = "0b3c-77";
        let text = format!("{MAGIC}\nboot {boot}\n12 345 1700000000\n13 346 1700000001\n");
        let entries = parse_ledger(&text, boot).expect("well formed");
        assert_eq!(
            entries,
            [
                LedgerEntry {
                    pid: 12,
                    start_time_ticks: 345,
                    enabled_at_secs: 1_700_000_000
                },
                LedgerEntry {
                    pid: 13,
                    start_time_ticks: 346,
                    enabled_at_secs: 1_700_000_001
                },
            ]
        );
        assert_eq!(parse_ledger(&text, "another-boot"), Some(Vec::new()));
        for bad in [
            String::new(),
            format!("{MAGIC}\n"),
            format!("nope\nboot {boot}\n"),
            format!("{MAGIC}\nboot {boot}\n12 345\n"),
            format!("{MAGIC}\nboot {boot}\n12 345 1 9\n"),
            format!("{MAGIC}\nboot {boot}\n-1 345 1\n"),
            format!("{MAGIC}\nboot {boot}\n99999999999 1 1\n"),
        ] {
            assert_eq!(parse_ledger(&bad, boot), None, "{bad:?}");
        }
        let many: String = (0..=MAX_ENTRIES).map(|i| format!("{i} 1 1\n")).collect();
        assert_eq!(
            parse_ledger(&format!("{MAGIC}\nboot {boot}\n{many}"), boot),
            None
        );
    }

    #[test]
    fn a_live_runs_ledger_is_left_alone_and_a_dead_ones_taken_once() {
        let cache = tempfile::tempdir().expect("tempdir");
        let dir_path = cache.path().join("cache");
        let procfs = ProcFs::default();
        let me = std::process::id();
        let mut ledger = PerfMapLedger::open(&dir_path).expect("ledger");
        ledger.record(&procfs, [me]);
        let dir = open_cache_dir(&dir_path).expect("dir");
        let name = ledger.name.clone();
        let text = read_ledger(&dir, &name).expect("written");
        let entries = parse_ledger(&text, &boot_id().expect("boot id")).expect("parses");
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].pid, me);
        // Its run lives (the lock is held): not taken.
        assert!(take_dead_ledger(&dir, &name, boot_id().as_deref()).is_none());
        assert!(read_ledger(&dir, &name).is_some());
        // Unchanged set: no write; an empty set removes the file.
        ledger.record(&procfs, []);
        assert!(read_ledger(&dir, &name).is_none());
        drop(ledger);
        assert!(
            dir.entries().expect("ls").is_empty(),
            "a run that ends leaves nothing"
        );
        // A dead run's ledger: its lock file is there, nobody holds it.
        let name = OsString::from(format!("{PREFIX}1-2"));
        let lock_name = OsString::from(format!("{PREFIX}1-2{LOCK_SUFFIX}"));
        write_entry(&dir, &name, text.as_bytes()).expect("write");
        drop(dir.create_new(&lock_name).expect("lock file"));
        let taken = take_dead_ledger(&dir, &name, boot_id().as_deref()).expect("dead run's");
        assert_eq!(taken.len(), 1);
        assert!(read_ledger(&dir, &name).is_none(), "consumed");
        assert!(dir.open_file(&lock_name).is_err(), "its lock removed");
        assert!(take_dead_ledger(&dir, &name, boot_id().as_deref()).is_none());
    }
}
