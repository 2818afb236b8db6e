//! Acting on a target's files as the target's own user.
//!
//! clrbpf runs as root, but the few things it does inside a target's
//! filesystem (connect to its diagnostic socket, remove the perf files it
//! asked the runtime to write) must be things the target itself could do,
//! or an unprivileged user becomes root's deputy: a .NET app that points
//! `DOTNET_PerfMapJitDumpPath` at a root-owned directory, or that runs in a
//! pid namespace where it picks its own pid, would otherwise get root to
//! remove `perf-<pid>.map` files that are not its own.
//!
//! 1. [`FsIdentity::of_process`] reads the target's filesystem uid, gid and
//!    supplementary groups from `/proc/PID/status` (host ids, the way the
//!    host sees the owners of its files).
//! 2. [`FsIdentity::run`] runs a closure on a fresh thread that first
//!    switches its filesystem ids to those (`setfsgid`, `setgroups`,
//!    `setfsuid`, all per thread as raw system calls: glibc's wrappers of
//!    `setgroups` would change every thread). When the filesystem uid
//!    changes from 0, the kernel drops `CAP_DAC_OVERRIDE`, `CAP_FOWNER` and
//!    the other filesystem capabilities from that thread, so every check
//!    (the socket's mode, the sticky `/tmp`, a directory's write bit) is
//!    made exactly as for the target. The thread ends with the closure, so
//!    no other work ever runs with those ids.
//!
//! Switching needs `CAP_SETUID` and `CAP_SETGID`; without them the closure
//! does not run and the error names the capability.

use std::{io, thread};

use super::{ProcError, ProcFs};

/// Most supplementary groups kept (the kernel allows 65 536; `status`
/// lists them all).
const MAX_GROUPS: usize = 1024;

/// The filesystem identity of a process: who owns what it creates, and who
/// the kernel checks its file accesses against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsIdentity {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// Why a closure could not run as another user.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(
        "cannot switch to uid {uid} / gid {gid} to act as the target's user: {source} (clrbpf needs CAP_SETUID and CAP_SETGID for this)"
    )]
    Switch {
        uid: u32,
        gid: u32,
        #[source]
        source: io::Error,
    },
    #[error("cannot start a thread to act as uid {uid}: {source}")]
    Thread {
        uid: u32,
        #[source]
        source: io::Error,
    },
}

impl FsIdentity {
    /// The filesystem ids of host process `pid`.
    pub fn of_process(procfs: &ProcFs, pid: u32) -> Result<Self, ProcError> {
        let (status, _) = procfs.read_pid_file(pid, "status", super::STATUS_MAX_BYTES)?;
        parse_fs_identity(&String::from_utf8_lossy(&status)).ok_or(ProcError::Malformed {
            pid,
            file: "status",
            reason: "no Uid, Gid or Groups line",
        })
    }

    /// This thread's filesystem ids.
    pub fn current() -> Self {
        // SAFETY: setfsuid/setfsgid(-1) change nothing (an invalid id) and
        // return the current one; getgroups writes at most `len` entries.
        let (uid, gid) = unsafe {
            (
                libc::setfsuid(u32::MAX) as u32,
                libc::setfsgid(u32::MAX) as u32,
            )
        };
        let mut groups = vec![0; MAX_GROUPS];
        // SAFETY: the buffer has room for MAX_GROUPS gid_t.
        let n = unsafe { libc::getgroups(MAX_GROUPS as libc::c_int, groups.as_mut_ptr()) };
        groups.truncate(usize::try_from(n).unwrap_or(0));
        Self { uid, gid, groups }
    }

    /// Runs `work` with this filesystem identity, on a thread of its own
    /// that ends with it. When the calling thread already has this uid and
    /// gid, `work` runs right here.
    pub fn run<T: Send>(&self, work: impl FnOnce() -> T + Send) -> Result<T, IdentityError> {
        let current = Self::current();
        if current.uid == self.uid && current.gid == self.gid {
            return Ok(work());
        }
        let switch_error = |source| IdentityError::Switch {
            uid: self.uid,
            gid: self.gid,
            source,
        };
        thread::scope(|scope| {
            let worker = thread::Builder::new()
                .name("clrbpf-as-target".into())
                .spawn_scoped(scope, || {
                    self.switch_this_thread()?;
                    Ok(work())
                })
                .map_err(|source| IdentityError::Thread {
                    uid: self.uid,
                    source,
                })?;
            match worker.join() {
                Ok(result) => result.map_err(switch_error),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// Switches the calling thread's filesystem ids, gid and groups first
    /// (changing them needs the uid that may still be 0), and checks that
    /// each took: `setfsuid` reports no error, it returns the previous id.
    fn switch_this_thread(&self) -> io::Result<()> {
        let groups: &[u32] = &self.groups[..self.groups.len().min(MAX_GROUPS)];
        // SAFETY: a raw setgroups(2) with a valid pointer and length: it
        // changes this thread's credentials only (glibc's wrapper would
        // signal every thread to change theirs).
        let rc = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: setfsgid/setfsuid take any id; they affect this thread only.
        unsafe {
            libc::setfsgid(self.gid);
            libc::setfsuid(self.uid);
        }
        let now = Self::current();
        if now.uid != self.uid || now.gid != self.gid {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        Ok(())
    }
}

/// The filesystem uid and gid (fourth of `Uid:`/`Gid:`) and `Groups:` of
/// a `/proc/PID/status` file.
fn parse_fs_identity(status: &str) -> Option<FsIdentity> {
    let (mut uid, mut gid, mut groups) = (None, None, None);
    for line in status.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        // Real, effective, saved, filesystem.
        let fs_id = || value.split_whitespace().nth(3)?.parse::<u32>().ok();
        match key {
            "Uid" => uid = fs_id(),
            "Gid" => gid = fs_id(),
            "Groups" => {
                groups = Some(
                    value
                        .split_whitespace()
                        .take(MAX_GROUPS)
                        .map(str::parse)
                        .collect::<Result<Vec<u32>, _>>()
                        .ok()?,
                )
            }
            _ => {}
        }
    }
    Some(FsIdentity {
        uid: uid?,
        gid: gid?,
        groups: groups.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_ids_and_groups_come_from_status() {
        let status = "Name:\tdotnet\nUid:\t1000\t1001\t1002\t1003\nGid:\t2000\t2001\t2002\t2003\nGroups:\t4 24 27 \nNSpid:\t9\n";
        assert_eq!(
            parse_fs_identity(status),
            Some(FsIdentity {
                uid: 1003,
                gid: 2003,
                groups: vec![4, 24, 27]
            })
        );
        let no_groups = "Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t\n";
        assert_eq!(parse_fs_identity(no_groups).map(|i| i.groups), Some(vec![]));
        assert_eq!(parse_fs_identity("Uid:\t0\t0\t0\n"), None, "three ids only");
        assert_eq!(parse_fs_identity("Gid:\t0\t0\t0\t0\n"), None, "no Uid line");
        assert_eq!(
            parse_fs_identity("Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\tx\n"),
            None
        );
    }

    #[test]
    fn running_as_the_current_identity_runs_in_place() {
        let me = FsIdentity::current();
        let caller = thread::current().id();
        let ran_on = me.run(|| thread::current().id()).expect("no switch needed");
        assert_eq!(ran_on, caller);
    }

    /// Needs root (CAP_SETUID, CAP_SETGID): `cargo xtask test` runs it.
    #[test]
    #[ignore = "needs root"]
    fn another_identity_gets_the_targets_permissions_and_no_more() {
        let dir = tempfile::tempdir().expect("temp dir");
        let secret = dir.path().join("root-only");
        std::fs::write(&secret, b"x").expect("write");
        std::os::unix::fs::chown(&secret, Some(0), Some(0)).expect("chown");
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod");
        let nobody = FsIdentity {
            uid: 65534,
            gid: 65534,
            groups: vec![],
        };
        let opened = nobody
            .run(|| std::fs::File::open(&secret).map(drop))
            .expect("switch to nobody");
        assert_eq!(
            opened.map_err(|e| e.kind()),
            Err(io::ErrorKind::PermissionDenied),
            "CAP_DAC_OVERRIDE must be gone with the filesystem uid"
        );
        assert!(
            std::fs::File::open(&secret).is_ok(),
            "the calling thread keeps its own ids"
        );
        assert_eq!(FsIdentity::current().uid, 0);
    }
}
