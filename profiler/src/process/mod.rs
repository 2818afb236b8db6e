//! The `/proc` model of a profiled process: its mappings, PID namespace,
//! container, whether it runs .NET and which version.
//!
//! A raw sample carries a host pid; this stage turns that pid into what the
//! later stages need: the executable name and container for labels
//! ([`ProcessInfo`]), the address space for symbolization ([`maps`]), the
//! .NET runtime and its settings ([`dotnet`]), and a safe way to reach files
//! inside the process's own root filesystem ([`root`]). `clrbpf ps` ([`ps`])
//! is this model printed as a table.
//!
//! Everything is read through a [`ProcFs`] whose root is configurable, so
//! unit tests build a fake `/proc` tree in a temporary directory. Every file
//! under `/proc/PID` describes a process we do not trust (its command line,
//! environment and comm are whatever it chose): every read is bounded, and
//! malformed content gives an error or is skipped and counted, never a panic.

pub mod cgroup;
pub mod dotnet;
pub mod exit;
pub mod identity;
pub mod main_module;
pub mod mapped_file;
pub mod maps;
pub mod priority;
pub mod root;
pub mod threads;

use std::{
    fs::File,
    io::{self, Read},
    path::{Path, PathBuf},
};

pub use maps::{Mapping, MappingTable, Perms};

/// At most this much of `/proc/PID/status` is read (a real one is ~1.5 KiB).
const STATUS_MAX_BYTES: u64 = 64 * 1024;
/// `/proc/PID/stat` is one line; comm is at most 64 bytes even for kernel threads.
const STAT_MAX_BYTES: u64 = 4 * 1024;
/// `/proc/PID/statm`: seven numbers.
const STATM_MAX_BYTES: u64 = 512;
/// `/proc/stat`: a line per CPU before `btime`, so it grows with the CPUs.
const SYSTEM_STAT_MAX_BYTES: u64 = 1024 * 1024;
/// Command lines longer than this are cut (the kernel allows ~2 MiB).
const CMDLINE_MAX_BYTES: u64 = 64 * 1024;
/// At most this much of `/proc/PID/environ` is searched for a variable.
const ENVIRON_MAX_BYTES: u64 = 1024 * 1024;
/// A cgroup file has one line per hierarchy (13 on cgroup v1, 1 on v2).
const CGROUP_MAX_BYTES: u64 = 64 * 1024;

/// Errors reading the `/proc` model of one process.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// The pid does not exist, or exited while we read it.
    #[error("process {pid} does not exist (it may have exited)")]
    NoSuchProcess { pid: u32 },
    /// Files of other users' processes (environ, maps, root) need privileges.
    #[error("permission denied reading {path}: run clrbpf as root or as the process's user")]
    PermissionDenied {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Any other I/O error.
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The file was read but does not have the layout the kernel writes.
    #[error("malformed {file} of process {pid}: {reason}")]
    Malformed {
        pid: u32,
        file: &'static str,
        reason: &'static str,
    },
}

impl ProcError {
    /// Classifies an I/O error on a file of process `pid`.
    pub(crate) fn from_io(pid: u32, path: &Path, source: io::Error) -> Self {
        match source.kind() {
            // ESRCH shows up when the process exits while a file is open.
            io::ErrorKind::NotFound => ProcError::NoSuchProcess { pid },
            _ if source.raw_os_error() == Some(libc::ESRCH) => ProcError::NoSuchProcess { pid },
            io::ErrorKind::PermissionDenied => ProcError::PermissionDenied {
                path: path.to_path_buf(),
                source,
            },
            _ => ProcError::Read {
                path: path.to_path_buf(),
                source,
            },
        }
    }
}

/// The proc filesystem, rooted at a configurable path (`/proc` in production,
/// a temporary tree in tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcFs {
    root: PathBuf,
}

impl Default for ProcFs {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl ProcFs {
    /// A proc filesystem mounted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// Where this proc filesystem is mounted.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/<pid>`.
    pub fn pid_dir(&self, pid: u32) -> PathBuf {
        self.root.join(pid.to_string())
    }

    /// `<root>/<pid>/<name>`.
    pub fn pid_path(&self, pid: u32, name: &str) -> PathBuf {
        self.pid_dir(pid).join(name)
    }

    /// Reads at most `limit` bytes of `<root>/<pid>/<name>`; the flag says
    /// whether the file was longer.
    pub(crate) fn read_pid_file(
        &self,
        pid: u32,
        name: &str,
        limit: u64,
    ) -> Result<(Vec<u8>, bool), ProcError> {
        let path = self.pid_path(pid, name);
        read_bounded(&path, limit).map_err(|e| ProcError::from_io(pid, &path, e))
    }

    /// Everything [`ProcessInfo`] holds about `pid`.
    pub fn process_info(&self, pid: u32) -> Result<ProcessInfo, ProcError> {
        let (status, _) = self.read_pid_file(pid, "status", STATUS_MAX_BYTES)?;
        let status =
            parse_status(&String::from_utf8_lossy(&status)).ok_or(ProcError::Malformed {
                pid,
                file: "status",
                reason: "no PPid or Uid line",
            })?;
        let (stat, _) = self.read_pid_file(pid, "stat", STAT_MAX_BYTES)?;
        let stat = parse_stat(&stat).ok_or(ProcError::Malformed {
            pid,
            file: "stat",
            reason: "fewer than 22 fields after the command name",
        })?;
        // The remaining files are optional: a process keeps its identity even
        // if we may not read its command line or cgroup.
        let cmdline = match self.read_pid_file(pid, "cmdline", CMDLINE_MAX_BYTES) {
            Ok((bytes, _)) => parse_cmdline(&bytes),
            Err(ProcError::NoSuchProcess { pid }) => return Err(ProcError::NoSuchProcess { pid }),
            Err(_) => Vec::new(),
        };
        let cgroup::CgroupIdentity {
            container_id,
            pod_uid,
        } = self.cgroup_identity(pid);
        let comm = status.name.unwrap_or(stat.comm);
        let exe_name = std::fs::read_link(self.pid_path(pid, "exe"))
            .ok()
            .and_then(|target| exe_basename(&target.to_string_lossy()))
            .unwrap_or_else(|| comm.clone());
        Ok(ProcessInfo {
            pid,
            ns_pid: status.ns_pid.unwrap_or(pid),
            ppid: status.ppid,
            uid: status.uid,
            comm,
            exe_name,
            cmdline,
            start_time_ticks: stat.start_time_ticks,
            container_id,
            pod_uid,
        })
    }

    /// The container and pod `pid`'s cgroup places it in, read against
    /// pid 1's cgroup (our cgroup namespace's depth); none when unreadable.
    fn cgroup_identity(&self, pid: u32) -> cgroup::CgroupIdentity {
        let read = |pid| {
            self.read_pid_file(pid, "cgroup", CGROUP_MAX_BYTES)
                .map(|(bytes, _)| String::from_utf8_lossy(&bytes).into_owned())
        };
        let Ok(cgroup) = read(pid) else {
            return cgroup::CgroupIdentity::default();
        };
        let init = read(1).unwrap_or_default();
        cgroup::identity_from_cgroup(&cgroup, &init)
    }

    /// The pid of `pid` inside its own PID namespace (the last `NSpid:`
    /// value), or `pid` on kernels without `NSpid`.
    pub fn ns_pid(&self, pid: u32) -> Result<u32, ProcError> {
        let (status, _) = self.read_pid_file(pid, "status", STATUS_MAX_BYTES)?;
        let status = String::from_utf8_lossy(&status);
        Ok(parse_status(&status).and_then(|s| s.ns_pid).unwrap_or(pid))
    }

    /// Field 22 of `/proc/PID/stat`: start time in clock ticks since boot.
    pub fn start_time_ticks(&self, pid: u32) -> Result<u64, ProcError> {
        let (stat, _) = self.read_pid_file(pid, "stat", STAT_MAX_BYTES)?;
        parse_stat(&stat)
            .map(|s| s.start_time_ticks)
            .ok_or(ProcError::Malformed {
                pid,
                file: "stat",
                reason: "fewer than 22 fields after the command name",
            })
    }

    /// Boot time in whole seconds since the epoch: the `btime` line of
    /// `<root>/stat`.
    pub fn boot_time(&self) -> Option<u64> {
        let (stat, _) = read_bounded(&self.root.join("stat"), SYSTEM_STAT_MAX_BYTES).ok()?;
        parse_boot_time(&String::from_utf8_lossy(&stat))
    }

    /// Resident set of `<root>/<dir>/statm` in bytes; `dir` is a pid or
    /// `self`.
    pub fn resident_bytes(&self, dir: &str) -> Option<u64> {
        let (statm, _) = read_bounded(&self.root.join(dir).join("statm"), STATM_MAX_BYTES).ok()?;
        let statm = String::from_utf8_lossy(&statm);
        let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
        Some(pages.saturating_mul(page_size()))
    }

    /// User and system CPU time of `pid` in clock ticks: fields 14 and 15
    /// of `<root>/<pid>/stat`.
    pub fn cpu_ticks(&self, pid: u32) -> Option<(u64, u64)> {
        let (stat, _) = self.read_pid_file(pid, "stat", STAT_MAX_BYTES).ok()?;
        let stat = String::from_utf8_lossy(&stat);
        // The command name may hold spaces and parentheses: fields count
        // from the last `)`.
        let after_comm = &stat[stat.rfind(')')? + 1..];
        let mut fields = after_comm.split_whitespace().skip(11);
        Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
    }

    /// The value of environment variable `name` of `pid`, as it was at exec
    /// (`/proc/PID/environ` does not see later `setenv`). Only the first
    /// 1 MiB of the environment is searched.
    #[cfg(test)]
    pub fn environ_var(&self, pid: u32, name: &str) -> Result<Option<String>, ProcError> {
        let (environ, _) = self.read_pid_file(pid, "environ", ENVIRON_MAX_BYTES)?;
        Ok(environ_lookup(&environ, name))
    }

    /// The whole environment of `pid` (first 1 MiB), NUL-separated.
    pub fn environ(&self, pid: u32) -> Result<Environ, ProcError> {
        let (bytes, truncated) = self.read_pid_file(pid, "environ", ENVIRON_MAX_BYTES)?;
        Ok(Environ { bytes, truncated })
    }

    /// Whether `pid` is a running process: it exists and is neither a
    /// zombie nor dead (a zombie still answers `kill(pid, 0)`).
    pub fn is_running(&self, pid: u32) -> bool {
        self.read_pid_file(pid, "stat", STAT_MAX_BYTES)
            .is_ok_and(|(stat, _)| stat_says_running(&stat))
    }

    /// Whether any thread of `pid` still runs. After the group leader's
    /// exit (what the kernel reports as the process's exit, and what
    /// [`Self::is_running`] sees as a zombie), its other threads may run on
    /// for a while: a .NET runtime's diagnostic thread can still be writing
    /// its perf files. Gone or unreadable counts as not running.
    pub fn has_live_threads(&self, pid: u32) -> bool {
        /// Threads looked at; a dying process has few left.
        const MAX_THREADS: usize = 4096;
        let Ok(tasks) = std::fs::read_dir(self.pid_path(pid, "task")) else {
            return false;
        };
        tasks
            .filter_map(Result::ok)
            .take(MAX_THREADS)
            .filter_map(|task| task.file_name().to_str()?.parse::<u32>().ok())
            .any(|tid| {
                self.read_pid_file(pid, &format!("task/{tid}/stat"), STAT_MAX_BYTES)
                    .is_ok_and(|(stat, _)| stat_says_running(&stat))
            })
    }

    /// The parsed memory mappings of `pid`.
    pub fn maps(&self, pid: u32) -> Result<MappingTable, ProcError> {
        let path = self.pid_path(pid, "maps");
        let file = File::open(&path).map_err(|e| ProcError::from_io(pid, &path, e))?;
        MappingTable::parse(io::BufReader::new(file)).map_err(|e| ProcError::from_io(pid, &path, e))
    }
}

/// A process's environment as read from `/proc/PID/environ`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environ {
    bytes: Vec<u8>,
    truncated: bool,
}

impl Environ {
    /// An environment from raw `NAME=value\0` bytes (tests, other sources).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            bytes: bytes.into(),
            truncated: false,
        }
    }

    /// The value of `name`, if set (lossy UTF-8).
    pub fn var(&self, name: &str) -> Option<String> {
        environ_lookup(&self.bytes, name)
    }

    /// Whether the environment was longer than what was read.
    pub fn truncated(&self) -> bool {
        self.truncated
    }
}

/// What `/proc/PID/{status,stat,cmdline,cgroup,exe}` say about a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Host pid.
    pub pid: u32,
    /// Pid inside the process's own PID namespace (equals `pid` on the host).
    /// The runtime names its diagnostic socket and perf map with this one.
    pub ns_pid: u32,
    pub ppid: u32,
    /// Effective uid (the owner of the files the process creates).
    pub uid: u32,
    /// The kernel's short name (`comm`, at most 15 bytes, chosen by the process).
    pub comm: String,
    /// Base name of the executable (`exe` link), else `comm`.
    pub exe_name: String,
    /// Arguments, cut at 64 KiB, lossy UTF-8.
    pub cmdline: Vec<String>,
    /// Start time in clock ticks since boot (field 22 of `stat`); with the
    /// pid it identifies one process instance across pid reuse, and the .NET
    /// runtime uses it as the disambiguation key of its diagnostic socket.
    pub start_time_ticks: u64,
    /// 64-hex container id from the cgroup path; `None` on the host or
    /// when the container's cgroup namespace hides it.
    pub container_id: Option<String>,
    /// Kubernetes pod uid from the same path (`pod<uid>` cgroup); the
    /// pod's cgroup is visible even where the API server is not.
    pub pod_uid: Option<String>,
}

impl ProcessInfo {
    /// The arguments joined by spaces, like `ps` shows them; `[comm]` when
    /// there are none (kernel threads, zombies).
    pub fn command_line(&self) -> String {
        if self.cmdline.is_empty() {
            format!("[{}]", self.comm)
        } else {
            self.cmdline.join(" ")
        }
    }
}

/// Every numeric directory of the proc root, sorted. Unreadable roots give
/// an empty list: `ps` on a host without `/proc` has nothing to show.
pub fn list_pids(procfs: &ProcFs) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(procfs.root()) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| parse_pid_name(&entry.file_name().to_string_lossy()))
        .collect();
    pids.sort_unstable();
    pids
}

/// `"1234"` -> 1234; anything else (`self`, `1234x`, `+1`, `0`) -> None.
fn parse_pid_name(name: &str) -> Option<u32> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    name.parse().ok().filter(|&pid| pid != 0)
}

/// Reads at most `limit` bytes of `path`; returns whether there was more.
/// The `btime` line of `/proc/stat`: boot time, seconds since the epoch.
pub fn parse_boot_time(proc_stat: &str) -> Option<u64> {
    proc_stat
        .lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// `sysconf(name)`, when the system gives a positive value.
fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    u64::try_from(unsafe { libc::sysconf(name) })
        .ok()
        .filter(|&value| value > 0)
}

/// Clock ticks per second, the unit of `/proc` CPU and start times.
pub fn clock_ticks_per_second() -> Option<u64> {
    sysconf(libc::_SC_CLK_TCK)
}

/// The page size, the unit of `/proc/PID/statm`.
pub fn page_size() -> u64 {
    sysconf(libc::_SC_PAGESIZE).unwrap_or(4096)
}

pub(crate) fn read_bounded(path: &Path, limit: u64) -> io::Result<(Vec<u8>, bool)> {
    let file = File::open(path)?;
    read_bounded_from(file, limit)
}

/// Reads at most `limit` bytes from `reader`; returns whether there was more.
pub(crate) fn read_bounded_from(reader: impl Read, limit: u64) -> io::Result<(Vec<u8>, bool)> {
    let mut bytes = Vec::new();
    // One byte past the limit tells "exactly limit" from "longer".
    reader
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)?;
    let truncated = bytes.len() as u64 > limit;
    if truncated {
        bytes.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    }
    Ok((bytes, truncated))
}

/// The lines of `/proc/PID/status` we use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct StatusFields {
    name: Option<String>,
    ppid: u32,
    uid: u32,
    ns_pid: Option<u32>,
}

/// Parses `status`; `None` without the `PPid:` and `Uid:` lines every
/// kernel writes.
fn parse_status(status: &str) -> Option<StatusFields> {
    let mut fields = StatusFields::default();
    let (mut have_ppid, mut have_uid) = (false, false);
    for line in status.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key {
            // `Name:` escapes `\n` and `\\` in comm; good enough for display.
            "Name" => fields.name = Some(value.to_string()),
            "PPid" => {
                fields.ppid = value.parse().ok()?;
                have_ppid = true;
            }
            // Real, effective, saved, filesystem: the effective uid owns what
            // the process creates (sockets, perf maps).
            "Uid" => {
                fields.uid = value.split_whitespace().nth(1)?.parse().ok()?;
                have_uid = true;
            }
            // Outermost namespace first; the last value is the process's own view.
            "NSpid" => fields.ns_pid = value.split_whitespace().last()?.parse().ok(),
            _ => {}
        }
    }
    (have_ppid && have_uid).then_some(fields)
}

/// The fields of `/proc/PID/stat` we use.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StatFields {
    comm: String,
    start_time_ticks: u64,
}

/// Parses `stat`. The command name (field 2) is in parentheses and may
/// itself contain spaces and `)`, so the fixed fields start after the last
/// `)`; field 22 (starttime) is the 20th field after it.
fn parse_stat(stat: &[u8]) -> Option<StatFields> {
    let open = stat.iter().position(|&b| b == b'(')?;
    let close = stat.iter().rposition(|&b| b == b')')?;
    if close < open {
        return None;
    }
    let comm = String::from_utf8_lossy(&stat[open + 1..close]).into_owned();
    let rest = std::str::from_utf8(&stat[close + 1..]).ok()?;
    // Field 3 (state) is the first after ')', so field 22 is at index 19.
    let start_time_ticks = rest.split_ascii_whitespace().nth(19)?.parse().ok()?;
    Some(StatFields {
        comm,
        start_time_ticks,
    })
}

/// Splits NUL-separated `cmdline` into arguments (lossy UTF-8). A process
/// may rewrite its argv area, so a missing final NUL or embedded garbage is
/// taken as it is.
fn parse_cmdline(bytes: &[u8]) -> Vec<String> {
    let bytes = bytes.strip_suffix(&[0]).unwrap_or(bytes);
    if bytes.is_empty() {
        return Vec::new();
    }
    bytes
        .split(|&b| b == 0)
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect()
}

/// Looks up `name` in NUL-separated `NAME=value` entries. With duplicates
/// the first one wins, as in glibc's `getenv`.
fn environ_lookup(environ: &[u8], name: &str) -> Option<String> {
    if name.is_empty() || name.contains('=') {
        return None;
    }
    environ.split(|&b| b == 0).find_map(|entry| {
        let value = entry.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
        Some(String::from_utf8_lossy(value).into_owned())
    })
}

/// The base name of an `exe` link target, without the kernel's
/// ` (deleted)` suffix for replaced binaries.
fn exe_basename(target: &str) -> Option<String> {
    let target = target.strip_suffix(" (deleted)").unwrap_or(target);
    let name = target.rsplit('/').next()?;
    (!name.is_empty()).then(|| name.to_string())
}

/// Whether a `stat` line (of a process or a thread) has a state other than
/// zombie or dead; the state follows the last `)` (the name may hold one).
fn stat_says_running(stat: &[u8]) -> bool {
    stat.iter()
        .rposition(|&b| b == b')')
        .and_then(|close| stat[close + 1..].iter().find(|b| !b.is_ascii_whitespace()))
        .is_some_and(|state| !matches!(state, b'Z' | b'X'))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::fs;

    /// A fake `/proc/<pid>` in a temp dir; returns the ProcFs.
    pub(crate) fn fake_process(dir: &Path, pid: u32, files: &[(&str, &[u8])]) -> ProcFs {
        let pid_dir = dir.join(pid.to_string());
        fs::create_dir_all(&pid_dir).expect("create fake pid dir");
        for (name, content) in files {
            fs::write(pid_dir.join(name), content).expect("write fake proc file");
        }
        ProcFs::new(dir)
    }

    pub(crate) const STATUS: &str = "Name:\tdotnet\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nNgid:\t0\nPid:\t4242\nPPid:\t1\nTracerPid:\t0\nUid:\t1000\t1001\t1001\t1001\nGid:\t1000\t1000\t1000\t1000\nNSpid:\t4242\t7\nNStgid:\t4242\t7\n";

    pub(crate) fn stat_line(comm: &str, start: u64) -> Vec<u8> {
        format!("4242 ({comm}) S 1 4242 4242 0 -1 4194560 1 0 0 0 5 3 0 0 20 0 17 0 {start} 300000 1000 18446744073709551615 1 1 0 0 0 0 0 4096 17663 0 0 0 17 1 0 0 0 0 0\n").into_bytes()
    }

    #[test]
    fn process_info_reads_every_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let stat = stat_line("dotnet", 123456);
        let procfs = fake_process(
            dir.path(),
            4242,
            &[
                ("status", STATUS.as_bytes()),
                ("stat", &stat),
                ("cmdline", b"/usr/bin/dotnet\0App.dll\0--port\0\x80x\0"),
                (
                    "cgroup",
                    b"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1f2e3d4c_5b6a_4789_8abc_def012345678.slice/cri-containerd-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n",
                ),
            ],
        );
        std::os::unix::fs::symlink(
            "/usr/share/dotnet/dotnet (deleted)",
            dir.path().join("4242/exe"),
        )
        .expect("symlink");
        let info = procfs.process_info(4242).expect("process info");
        assert_eq!(
            info,
            ProcessInfo {
                pid: 4242,
                ns_pid: 7,
                ppid: 1,
                uid: 1001,
                comm: "dotnet".into(),
                exe_name: "dotnet".into(),
                cmdline: vec![
                    "/usr/bin/dotnet".into(),
                    "App.dll".into(),
                    "--port".into(),
                    "\u{fffd}x".into()
                ],
                start_time_ticks: 123456,
                container_id: Some(
                    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef".into()
                ),
                pod_uid: Some("1f2e3d4c-5b6a-4789-8abc-def012345678".into()),
            }
        );
        assert_eq!(
            info.command_line(),
            "/usr/bin/dotnet App.dll --port \u{fffd}x"
        );
    }

    #[test]
    fn process_info_without_optional_files_falls_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let stat = stat_line("worker", 9);
        let status = STATUS
            .replace("NSpid:\t4242\t7\n", "")
            .replace("Name:\tdotnet\n", "");
        let procfs = fake_process(
            dir.path(),
            4242,
            &[
                ("status", status.as_bytes()),
                ("stat", &stat),
                ("cmdline", b""),
            ],
        );
        let info = procfs.process_info(4242).expect("process info");
        assert_eq!(info.ns_pid, 4242);
        assert_eq!(info.comm, "worker");
        assert_eq!(info.exe_name, "worker");
        assert!(info.cmdline.is_empty());
        assert_eq!(info.command_line(), "[worker]");
        assert_eq!(info.container_id, None);
    }

    #[test]
    fn missing_process_is_no_such_process() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = ProcFs::new(dir.path())
            .process_info(99)
            .expect_err("no process");
        assert!(
            matches!(err, ProcError::NoSuchProcess { pid: 99 }),
            "{err:?}"
        );
    }

    #[test]
    fn malformed_status_and_stat_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let procfs = fake_process(
            dir.path(),
            1,
            &[("status", b"garbage"), ("stat", b"1 (x) S")],
        );
        assert!(matches!(
            procfs.process_info(1),
            Err(ProcError::Malformed { file: "status", .. })
        ));
        let procfs = fake_process(
            dir.path(),
            2,
            &[("status", STATUS.as_bytes()), ("stat", b"2 (x) S 1 2 3")],
        );
        assert!(matches!(
            procfs.process_info(2),
            Err(ProcError::Malformed { file: "stat", .. })
        ));
    }

    #[test]
    fn stat_comm_with_spaces_and_parens() {
        let stat = stat_line("evil) S 1 2 3 (x", 777);
        let parsed = parse_stat(&stat).expect("parse");
        assert_eq!(parsed.comm, "evil) S 1 2 3 (x");
        assert_eq!(parsed.start_time_ticks, 777);
        assert_eq!(parse_stat(b"1 x) S"), None);
        assert_eq!(parse_stat(b")("), None);
        assert_eq!(parse_stat(b""), None);
        // Non-numeric start time.
        let bad = String::from_utf8(stat_line("a", 1))
            .expect("utf8")
            .replace(" 1 300000", " x 300000");
        assert_eq!(parse_stat(bad.as_bytes()), None);
    }

    #[test]
    fn ns_pid_is_the_innermost_value() {
        let ns_pid = |status: &str| parse_status(status).and_then(|s| s.ns_pid);
        let status = "Name:\tdotnet\nPPid:\t1\nUid:\t0\t0\t0\t0\nTgid:\t4242\nPid:\t4242\nNSpid:\t4242\t17\t1\nNSsid:\t1\n";
        assert_eq!(ns_pid(status), Some(1));
        let with = |ns: &str| format!("PPid:\t1\nUid:\t0\t0\t0\t0\n{ns}");
        assert_eq!(ns_pid(&with("NSpid:\t4242\n")), Some(4242));
        assert_eq!(ns_pid(&with("Pid:\t4242\n")), None);
        assert_eq!(ns_pid(&with("NSpid:\n")), None);
        assert_eq!(ns_pid(&with("NSpid:\t12 x\n")), None);
        assert_eq!(ns_pid(&with("NSpid:\t99999999999\n")), None);
        // This process is in the host namespace in tests.
        let me = std::process::id();
        assert_eq!(ProcFs::default().ns_pid(me).expect("own status"), me);
    }

    #[test]
    fn stat_start_ticks() {
        let ticks = |stat: &str| parse_stat(stat.as_bytes()).map(|s| s.start_time_ticks);
        let stat = "4242 (dot net) (x)) S 1 4242 4242 0 -1 4194560 1234 0 0 0 5 6 0 0 20 0 \
                    12 0 98765 123456789 2000 18446744073709551615";
        assert_eq!(ticks(stat), Some(98765));
        assert_eq!(ticks("4242 (short) S 1 2"), None);
        assert_eq!(ticks("no parenthesis"), None);
    }

    #[test]
    fn status_parsing() {
        let parsed = parse_status(STATUS).expect("parse");
        assert_eq!(parsed.ns_pid, Some(7));
        assert_eq!(parsed.uid, 1001);
        assert_eq!(parse_status("PPid:\t1\nUid:\tnope\n"), None);
        assert_eq!(parse_status("PPid:\t1\n"), None);
        // A host process: one NSpid value.
        let host = parse_status("PPid:\t1\nUid:\t0\t0\t0\t0\nNSpid:\t55\n").expect("parse");
        assert_eq!(host.ns_pid, Some(55));
    }

    #[test]
    fn environ_lookup_matches_whole_names() {
        let env = b"TMPDIR=/var/tmp\0DOTNET_PerfMapEnabled=1\0DOTNET_PerfMapEnabledX=0\0EMPTY=\0NOEQ\0TMPDIR=/second\0";
        assert_eq!(environ_lookup(env, "TMPDIR").as_deref(), Some("/var/tmp"));
        assert_eq!(
            environ_lookup(env, "DOTNET_PerfMapEnabled").as_deref(),
            Some("1")
        );
        assert_eq!(environ_lookup(env, "EMPTY").as_deref(), Some(""));
        assert_eq!(environ_lookup(env, "NOEQ"), None);
        assert_eq!(environ_lookup(env, "DOTNET"), None);
        assert_eq!(environ_lookup(env, ""), None);
        assert_eq!(environ_lookup(env, "A=B"), None);
        assert_eq!(environ_lookup(b"", "X"), None);
    }

    #[test]
    fn environ_var_reads_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let procfs = fake_process(dir.path(), 3, &[("environ", b"A=1\0TMPDIR=/t\0")]);
        assert_eq!(
            procfs.environ_var(3, "TMPDIR").expect("read").as_deref(),
            Some("/t")
        );
        assert_eq!(procfs.environ_var(3, "B").expect("read"), None);
        let environ = procfs.environ(3).expect("read");
        assert_eq!(environ.var("A").as_deref(), Some("1"));
        assert!(!environ.truncated());
    }

    #[test]
    fn bounded_read_reports_truncation() {
        let (bytes, truncated) = read_bounded_from(&b"abcdef"[..], 4).expect("read");
        assert_eq!((bytes.as_slice(), truncated), (&b"abcd"[..], true));
        let (bytes, truncated) = read_bounded_from(&b"abcd"[..], 4).expect("read");
        assert_eq!((bytes.as_slice(), truncated), (&b"abcd"[..], false));
    }

    #[test]
    fn cmdline_parsing() {
        assert_eq!(parse_cmdline(b""), Vec::<String>::new());
        assert_eq!(parse_cmdline(b"\0"), Vec::<String>::new());
        assert_eq!(parse_cmdline(b"\0\0"), vec![String::new(), String::new()]);
        assert_eq!(
            parse_cmdline(b"a b\0c"),
            vec!["a b".to_string(), "c".to_string()]
        );
    }

    #[test]
    fn pids_are_numeric_dirs() {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in ["1", "42", "7", "self", "12a", "0", "99999999999"] {
            fs::create_dir(dir.path().join(name)).expect("mkdir");
        }
        assert_eq!(list_pids(&ProcFs::new(dir.path())), vec![1, 7, 42]);
        assert_eq!(
            list_pids(&ProcFs::new(dir.path().join("missing"))),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn exe_names() {
        assert_eq!(exe_basename("/usr/bin/dotnet").as_deref(), Some("dotnet"));
        assert_eq!(
            exe_basename("/app/My App (deleted)").as_deref(),
            Some("My App")
        );
        assert_eq!(exe_basename("/"), None);
    }
}
