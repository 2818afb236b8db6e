//! The perf files a .NET runtime writes for one process
//! (`perf-NSPID.map`, `perfinfo-NSPID.map`, `jit-NSPID.dump`) and how
//! clrbpf removes the ones it asked for when a recording ends.
//!
//! The names and the directory come from the target (its namespace pid,
//! which a process in its own pid namespace can choose, and
//! `DOTNET_PerfMapJitDumpPath`), so a file of that name may belong to
//! someone else: root's own `/tmp/perf-77777.map`, or any file of a
//! root-owned directory the target names. A file is removed only when
//! every one of these holds:
//!
//! 1. it is a regular file (a symlink is neither followed nor removed), in a
//!    directory resolved inside the target's root ([`TargetRoot`]);
//! 2. it is owned by the target's filesystem uid;
//! 3. it was written since clrbpf asked the runtime for it (attach, or the
//!    launch of the command), so it is the file of this recording;
//! 4. the `unlinkat` itself runs with the target's filesystem identity
//!    ([`FsIdentity::run`]), relative to the directory fd: the kernel checks
//!    it as if the target removed the file, so no swap of the file between
//!    the check and the removal can make root remove something the target
//!    could not.
//!
//! Anything else is left alone and reported.

use std::{
    ffi::OsStr,
    io,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use crate::process::{
    identity::{FsIdentity, IdentityError},
    root::{EntryKind, TargetRoot},
};

/// File times are compared with this much slack: a file written in the
/// same second as the request counts as written after it.
const WRITTEN_SINCE_SLACK: Duration = Duration::from_secs(2);

/// `perf-<pid>.map`, `jit-<pid>.dump`, `perfinfo-<pid>.map`, where `pid` is
/// the process's own (namespace) pid.
pub fn perf_file_names(ns_pid: u32) -> [String; 3] {
    [
        format!("perf-{ns_pid}.map"),
        format!("jit-{ns_pid}.dump"),
        format!("perfinfo-{ns_pid}.map"),
    ]
}

/// What [`remove_perf_files`] did with each file it found.
#[derive(Debug, Default)]
pub struct PerfFileCleanup {
    /// Host paths of the files removed.
    pub removed: Vec<PathBuf>,
    /// Files that were the target's but could not be removed, and why.
    pub failed: Vec<(PathBuf, io::Error)>,
    /// Files of those names that were not ours to remove, and why.
    pub left_alone: Vec<(PathBuf, String)>,
}

impl PerfFileCleanup {
    /// The summary's warnings about process `pid`'s perf files: those that
    /// could not be removed, and one line for those left alone.
    pub fn warnings(&self, pid: u32) -> Vec<String> {
        let mut warnings: Vec<String> = self
            .failed
            .iter()
            .map(|(path, e)| format!("pid {pid}: removing {}: {e}", path.display()))
            .collect();
        warnings.extend(self.left_alone_warning(pid));
        warnings
    }

    /// One line for the summary about the files left alone, if any.
    pub fn left_alone_warning(&self, pid: u32) -> Option<String> {
        if self.left_alone.is_empty() {
            return None;
        }
        let files: Vec<String> = self
            .left_alone
            .iter()
            .map(|(path, why)| format!("{} ({why})", path.display()))
            .collect();
        Some(format!(
            "pid {pid}: left alone perf files that were not this process's own output: {}",
            files.join(", ")
        ))
    }
}

/// Removes the perf files of the process whose namespace pid is `ns_pid`
/// from `dirs` (as the process sees them) inside `root`, under the rules of
/// the module doc: regular files owned by `owner`, written at or after
/// `written_since`, unlinked with `owner`'s filesystem identity.
pub fn remove_perf_files(
    root: &TargetRoot,
    dirs: &[&Path],
    ns_pid: u32,
    owner: &FsIdentity,
    written_since: SystemTime,
) -> Result<PerfFileCleanup, IdentityError> {
    let since = written_since
        .checked_sub(WRITTEN_SINCE_SLACK)
        .unwrap_or(written_since);
    let mut unique: Vec<&Path> = Vec::with_capacity(dirs.len());
    for dir in dirs {
        if !unique.contains(dir) {
            unique.push(dir);
        }
    }
    owner.run(|| {
        let mut cleanup = PerfFileCleanup::default();
        for dir_path in unique {
            let dir = match root.open_dir(dir_path) {
                Ok(dir) => dir,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => {
                    cleanup.failed.push((root.display_path(dir_path), e));
                    continue;
                }
            };
            for name in perf_file_names(ns_pid) {
                let name = OsStr::new(&name);
                let path = dir.display_child(name);
                let stat = match dir.stat(name) {
                    Ok(stat) => stat,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        cleanup.failed.push((path, e));
                        continue;
                    }
                };
                let refusal = if stat.kind != EntryKind::File {
                    Some("not a regular file".to_owned())
                } else if stat.uid != owner.uid {
                    Some(format!(
                        "owned by uid {}, not by the process's uid {}",
                        stat.uid, owner.uid
                    ))
                } else if stat.modified < since {
                    Some("not written during this recording".to_owned())
                } else {
                    None
                };
                if let Some(why) = refusal {
                    cleanup.left_alone.push((path, why));
                    continue;
                }
                match dir.unlink(name) {
                    Ok(()) => cleanup.removed.push(path),
                    Err(e) => cleanup.failed.push((path, e)),
                }
            }
        }
        cleanup
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::ProcFs;
    use std::{fs, os::unix::fs::symlink};

    /// `<tmp>/proc/9/root/{tmp,other}` with three perf files of ns pid 7.
    fn target() -> (tempfile::TempDir, TargetRoot, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("proc/9/root");
        fs::create_dir_all(root.join("tmp")).expect("mkdir");
        fs::create_dir_all(root.join("other")).expect("mkdir");
        for name in perf_file_names(7) {
            fs::write(root.join("tmp").join(name), "x").expect("write");
        }
        let procfs = ProcFs::new(dir.path().join("proc"));
        let opened = TargetRoot::open(&procfs, 9).expect("root");
        (dir, opened, root)
    }

    fn long_ago() -> SystemTime {
        SystemTime::UNIX_EPOCH
    }

    #[test]
    fn removes_the_targets_own_files_in_each_directory_once() {
        let (_dir, root, host) = target();
        fs::write(host.join("other/perf-7.map"), "x").expect("write");
        let me = FsIdentity::current();
        let dirs = [Path::new("/tmp"), Path::new("/other"), Path::new("/tmp")];
        let cleanup = remove_perf_files(&root, &dirs, 7, &me, long_ago()).expect("run");
        assert_eq!(cleanup.removed.len(), 4, "{cleanup:?}");
        assert!(cleanup.failed.is_empty() && cleanup.left_alone.is_empty());
        assert!(fs::read_dir(host.join("tmp")).expect("ls").next().is_none());
        let again = remove_perf_files(&root, &dirs, 7, &me, long_ago()).expect("run");
        assert!(again.removed.is_empty(), "nothing left to remove");
    }

    #[test]
    fn files_older_than_the_request_are_left_alone() {
        let (_dir, root, host) = target();
        let me = FsIdentity::current();
        let future = SystemTime::now() + Duration::from_secs(3600);
        let cleanup = remove_perf_files(&root, &[Path::new("/tmp")], 7, &me, future).expect("run");
        assert!(cleanup.removed.is_empty());
        assert_eq!(cleanup.left_alone.len(), 3);
        assert!(
            cleanup
                .left_alone
                .iter()
                .all(|(_, why)| why == "not written during this recording")
        );
        assert_eq!(fs::read_dir(host.join("tmp")).expect("ls").count(), 3);
        let warning = cleanup.left_alone_warning(9).expect("a warning");
        assert!(warning.starts_with("pid 9: left alone"), "{warning}");
    }

    /// Switching to another uid needs CAP_SETUID: `cargo xtask test` runs it
    /// as root.
    #[test]
    #[ignore = "needs root"]
    fn only_the_owners_files_go_and_as_the_owner() {
        use std::os::unix::fs::{PermissionsExt as _, chown};
        let (_dir, root, host) = target();
        let tmp = host.join("tmp");
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777)).expect("chmod");
        let target_user = FsIdentity {
            uid: 54321,
            gid: 54321,
            groups: vec![],
        };
        chown(tmp.join("perf-7.map"), Some(54321), Some(54321)).expect("chown");
        chown(tmp.join("jit-7.dump"), Some(54321), Some(54321)).expect("chown");
        // perfinfo-7.map stays root's.
        let cleanup = remove_perf_files(&root, &[Path::new("/tmp")], 7, &target_user, long_ago())
            .expect("switch identity");
        assert_eq!(cleanup.removed.len(), 2, "{cleanup:?}");
        assert_eq!(cleanup.left_alone.len(), 1, "{cleanup:?}");
        assert!(cleanup.left_alone[0].1.contains("owned by uid 0"));
        assert!(tmp.join("perfinfo-7.map").exists());
        // A root-owned directory the target cannot write to: even a file
        // the target owns there stays, because the kernel checks the unlink
        // as the target.
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)).expect("chmod");
        fs::write(tmp.join("perf-7.map"), "x").expect("write");
        chown(tmp.join("perf-7.map"), Some(54321), Some(54321)).expect("chown");
        let cleanup = remove_perf_files(&root, &[Path::new("/tmp")], 7, &target_user, long_ago())
            .expect("switch identity");
        assert!(cleanup.removed.is_empty(), "{cleanup:?}");
        assert_eq!(
            cleanup.failed.first().map(|(_, e)| e.kind()),
            Some(io::ErrorKind::PermissionDenied)
        );
        assert!(tmp.join("perf-7.map").exists());
    }

    #[test]
    fn symlinks_and_directories_are_neither_followed_nor_removed() {
        let (dir, root, host) = target();
        let secret = dir.path().join("secret");
        fs::write(&secret, "keep").expect("write");
        fs::remove_file(host.join("tmp/perf-7.map")).expect("rm");
        symlink(&secret, host.join("tmp/perf-7.map")).expect("symlink");
        fs::remove_file(host.join("tmp/jit-7.dump")).expect("rm");
        fs::create_dir(host.join("tmp/jit-7.dump")).expect("mkdir");
        let me = FsIdentity::current();
        let cleanup =
            remove_perf_files(&root, &[Path::new("/tmp")], 7, &me, long_ago()).expect("run");
        assert_eq!(cleanup.removed.len(), 1, "only perfinfo: {cleanup:?}");
        assert_eq!(cleanup.left_alone.len(), 2);
        assert!(fs::symlink_metadata(host.join("tmp/perf-7.map")).is_ok());
        assert_eq!(fs::read_to_string(&secret).expect("read"), "keep");
    }
}
