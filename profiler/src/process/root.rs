//! Files inside a target process's root filesystem (`/proc/PID/root`),
//! reached without ever following a symlink out of that root.
//!
//! A process in a container sees its own `/tmp`; its diagnostic socket and
//! perf maps live there, and the profiler reaches them through
//! `/proc/PID/root`. That tree belongs to the target: a hostile container
//! can make `/tmp` a symlink to `/etc`, or plant a symlink where a socket or
//! a perf map should be, hoping a privileged tool on the host follows it.
//! So:
//!
//! 1. [`TargetRoot::open`] opens `/proc/PID/root` itself (a "magic link"
//!    the kernel resolves to the process's root directory, which is what we
//!    want) as an `O_PATH` directory fd.
//! 2. Paths below it are resolved with `openat2(RESOLVE_IN_ROOT |
//!    RESOLVE_NO_MAGICLINKS)`: absolute symlinks and `..` stay inside the
//!    target's root, exactly as the target itself would see them. On kernels
//!    before 5.6 (no `openat2`) we walk the path one component at a time with
//!    `O_NOFOLLOW` and refuse any symlink.
//! 3. A [`TargetDir`] works on single names relative to its fd (`fstatat`,
//!    `openat`, `unlinkat` with `AT_SYMLINK_NOFOLLOW` / `O_NOFOLLOW`), so the
//!    last component is never followed either.
//!
//! To hand such a file to an API that wants a path (a Unix socket's
//! `connect`), use [`fd_path`]: `/proc/self/fd/N` names the exact inode we
//! opened and is short enough for `sun_path` (108 bytes), however long the
//! path inside the container is.

use std::{
    ffi::{CString, OsStr, OsString},
    fs::File,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use super::{ProcError, ProcFs};

/// Directories with more entries than this are read only this far (a `/tmp`
/// with a million files must not stall a profiler).
const MAX_DIR_ENTRIES: usize = 100_000;
/// `openat2` returns EAGAIN with `RESOLVE_IN_ROOT` when a concurrent rename
/// could have let `..` escape (and EINTR on a signal); retry a few times.
const OPENAT2_RETRIES: usize = 8;

/// The root directory of one process, as an fd.
#[derive(Debug)]
pub struct TargetRoot {
    fd: OwnedFd,
    host_path: PathBuf,
}

impl TargetRoot {
    /// Opens `<procfs>/<pid>/root`. Needs the same uid as the target, or
    /// `CAP_SYS_PTRACE` (root, or a privileged container with `hostPID`).
    pub fn open(procfs: &ProcFs, pid: u32) -> Result<Self, ProcError> {
        let host_path = procfs.pid_path(pid, "root");
        let fd = open_root_dir(&host_path).map_err(|e| ProcError::from_io(pid, &host_path, e))?;
        Ok(Self { fd, host_path })
    }

    /// A directory of the host taken as a target's root: `/` for the
    /// processes of a command clrbpf launched in its own mount namespace,
    /// which may be gone (and their `/proc/PID/root` with them) by the end.
    pub fn at_host_path(host_path: &Path) -> io::Result<Self> {
        let fd = open_root_dir(host_path)?;
        Ok(Self {
            fd,
            host_path: host_path.to_path_buf(),
        })
    }

    /// `<procfs>/<pid>/root`, for messages.
    pub fn host_path(&self) -> &Path {
        &self.host_path
    }

    /// The host path of `path_in_root`, for messages only: opening it would
    /// follow the target's symlinks on the host side.
    pub fn display_path(&self, path_in_root: impl AsRef<Path>) -> PathBuf {
        let path = path_in_root.as_ref();
        self.host_path.join(path.strip_prefix("/").unwrap_or(path))
    }

    /// Opens a directory by its path as the target sees it (`/tmp`).
    pub fn open_dir(&self, path_in_root: impl AsRef<Path>) -> io::Result<TargetDir> {
        let path_in_root = path_in_root.as_ref();
        let fd = self.resolve(path_in_root, libc::O_RDONLY | libc::O_DIRECTORY)?;
        Ok(TargetDir {
            fd,
            display: self.display_path(path_in_root),
        })
    }

    /// Opens a regular file for reading by its path as the target sees it
    /// (`/tmp/perf-7.map`). A symlink as last component is refused.
    pub fn open_file(&self, path_in_root: impl AsRef<Path>) -> io::Result<File> {
        let path_in_root = path_in_root.as_ref();
        // O_NONBLOCK: a FIFO planted in place of a file must not block us.
        let fd = self.resolve(
            path_in_root,
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
        )?;
        let file = File::from(fd);
        if !file.metadata()?.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        Ok(file)
    }

    /// An `O_PATH | O_NOFOLLOW` handle on `path_in_root` (as the target
    /// sees it): opens nothing (a device or FIFO is not touched), and a
    /// symlink as last component is the link itself, for [`fstat`] to
    /// refuse.
    pub fn open_path(&self, path_in_root: impl AsRef<Path>) -> io::Result<OwnedFd> {
        self.resolve(path_in_root.as_ref(), libc::O_PATH | libc::O_NOFOLLOW)
    }

    /// `(st_dev, st_ino)` of the root: processes in the same container share it.
    pub fn identity(&self) -> io::Result<(u64, u64)> {
        let stat = fstat(self.fd.as_fd())?;
        Ok((stat.st_dev, stat.st_ino))
    }

    fn resolve(&self, path_in_root: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
        open_in_root(self.fd.as_fd(), path_in_root.as_os_str(), flags)
    }
}

/// Opens a directory on the host (`/proc/PID/root`, following that magic
/// link, which is the point) as the `O_PATH` fd [`open_in_root`] resolves
/// below.
pub fn open_root_dir(path: &Path) -> io::Result<OwnedFd> {
    open_path(
        libc::AT_FDCWD,
        path.as_os_str(),
        libc::O_PATH | libc::O_DIRECTORY,
    )
}

/// Opens `path_in_root` (as the target sees it, absolute or not) below the
/// root directory fd `root`, with `flags`: `openat2(RESOLVE_IN_ROOT |
/// RESOLVE_NO_MAGICLINKS)`, or the component walk that refuses every
/// symlink on kernels without `openat2`.
pub fn open_in_root(
    root: BorrowedFd<'_>,
    path_in_root: &OsStr,
    flags: libc::c_int,
) -> io::Result<OwnedFd> {
    // Relative to the root fd; RESOLVE_IN_ROOT treats a leading '/' the
    // same, but the fallback walk wants components.
    let bytes = path_in_root.as_bytes();
    let start = bytes.iter().position(|&b| b != b'/').unwrap_or(bytes.len());
    let relative = if start == bytes.len() {
        OsStr::new(".")
    } else {
        OsStr::from_bytes(&bytes[start..])
    };
    match openat2_in_root(root, relative, flags) {
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => walk_nofollow(root, relative, flags),
        other => other,
    }
}

/// What [`TargetDir::stat`] tells about one entry (the entry itself, never
/// a symlink's target).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryStat {
    pub kind: EntryKind,
    pub uid: u32,
    pub modified: SystemTime,
    pub size: u64,
    /// What it takes on disk (`st_blocks` in bytes).
    pub disk_bytes: u64,
}

/// The type of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Socket,
    Other,
}

/// Why a directory of clrbpf's own ([`TargetDir::open_private`]) is not
/// used.
#[derive(Debug, thiserror::Error)]
pub enum PrivateDirError {
    #[error("cannot create or open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is {problem}: it must be a directory owned by uid {uid} with mode 0700")]
    Untrusted {
        path: PathBuf,
        problem: String,
        uid: u32,
    },
}

/// What [`TargetDir::open_private`] does with a directory of clrbpf's
/// user that others may read but not write (`0755`, as kubelet creates a
/// `hostPath`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WiderMode {
    Refuse,
    /// `fchmod` it to 0700 through the fd just checked: nobody else could
    /// have put anything in it.
    Tighten,
}

/// A directory inside a target's root, opened with [`TargetRoot::open_dir`].
/// Every method takes a single file name and never follows a symlink.
#[derive(Debug)]
pub struct TargetDir {
    fd: OwnedFd,
    display: PathBuf,
}

impl TargetDir {
    /// Opens a host directory of clrbpf's own (its cache); the last
    /// component is not followed when it is a symlink.
    pub fn open_own(path: &Path) -> io::Result<Self> {
        let fd = open_path(
            libc::AT_FDCWD,
            path.as_os_str(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        )?;
        Ok(Self {
            fd,
            display: path.to_owned(),
        })
    }

    /// Opens (creating it and its missing parents, mode 0700) a directory
    /// of clrbpf's own at `path`: refused unless it is a real directory (a
    /// symlink there is not followed) owned by the user clrbpf runs as,
    /// with no access for group or others (see [`WiderMode`]). Everything
    /// done through the returned fd stays in that directory, whatever
    /// happens to `path` afterwards.
    pub fn open_private(path: &Path, wider: WiderMode) -> Result<Self, PrivateDirError> {
        use std::os::unix::fs::DirBuilderExt as _;
        let open_error = |source| PrivateDirError::Open {
            path: path.to_owned(),
            source,
        };
        // SAFETY: a call without arguments or memory access.
        let uid = unsafe { libc::geteuid() };
        let untrusted = |problem: String| PrivateDirError::Untrusted {
            path: path.to_owned(),
            problem,
            uid,
        };
        match std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
        {
            Ok(()) => {}
            // A symlink or file where the directory should be: said below.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(open_error(e)),
        }
        let dir = match Self::open_own(path) {
            Ok(dir) => dir,
            // O_NOFOLLOW|O_DIRECTORY on a symlink: ENOTDIR (or ELOOP).
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                let symlink = std::fs::symlink_metadata(path).is_ok_and(|m| m.is_symlink());
                let problem = if symlink {
                    "a symlink"
                } else {
                    "not a directory"
                };
                return Err(untrusted(problem.to_owned()));
            }
            Err(e) => return Err(open_error(e)),
        };
        let stat = dir.stat_self().map_err(open_error)?;
        let mode = stat.st_mode & 0o7777;
        if stat.st_uid != uid {
            return Err(untrusted(format!("owned by uid {}", stat.st_uid)));
        }
        if mode & 0o077 == 0 {
            return Ok(dir);
        }
        if wider == WiderMode::Refuse || mode & 0o022 != 0 {
            return Err(untrusted(format!("mode {mode:04o}")));
        }
        // SAFETY: the fd is open for the call; no memory is passed.
        if unsafe { libc::fchmod(dir.fd.as_raw_fd(), 0o700) } != 0 {
            return Err(open_error(io::Error::last_os_error()));
        }
        Ok(dir)
    }

    /// `fstat` of the directory itself.
    pub fn stat_self(&self) -> io::Result<libc::stat> {
        fstat(self.fd.as_fd())
    }

    /// Creates the new regular file `name` (mode 0600) for writing; an
    /// existing entry, symlink or not, is an error.
    pub fn create_new(&self, name: &OsStr) -> io::Result<File> {
        let name = single_component(name)?;
        // SAFETY: `name` is NUL-terminated; the returned fd is checked and owned.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                name.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Renames `from` to `to` within this directory (`renameat`: an entry
    /// at `to` is replaced, a symlink there itself).
    pub fn rename(&self, from: &OsStr, to: &OsStr) -> io::Result<()> {
        let (from, to) = (single_component(from)?, single_component(to)?);
        // SAFETY: both names are NUL-terminated and the fd is open.
        let rc = unsafe {
            libc::renameat(
                self.fd.as_raw_fd(),
                from.as_ptr(),
                self.fd.as_raw_fd(),
                to.as_ptr(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The host path of this directory, for messages.
    pub fn display_path(&self) -> &Path {
        &self.display
    }

    /// The host path of `name` in this directory, for messages.
    pub fn display_child(&self, name: &OsStr) -> PathBuf {
        self.display.join(name)
    }

    /// The names in the directory (at most 100 000), without `.` and `..`.
    pub fn entries(&self) -> io::Result<Vec<OsString>> {
        // Reading through our own fd's magic link lists exactly the directory
        // we opened, whatever happened to its path since.
        let mut names = Vec::new();
        for entry in std::fs::read_dir(fd_path(self.fd.as_fd()))? {
            if names.len() >= MAX_DIR_ENTRIES {
                break;
            }
            names.push(entry?.file_name());
        }
        Ok(names)
    }

    /// `fstatat(AT_SYMLINK_NOFOLLOW)` of `name`.
    pub fn stat(&self, name: &OsStr) -> io::Result<EntryStat> {
        let name = single_component(name)?;
        let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `name` is NUL-terminated, `stat` points to writable memory
        // of the right size, and the fd is open for our lifetime.
        let rc = unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                name.as_ptr(),
                stat.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fstatat returned 0, so it filled the buffer.
        let stat = unsafe { stat.assume_init() };
        Ok(entry_stat(&stat))
    }

    /// Opens `name` with `O_PATH | O_NOFOLLOW`: a handle on that exact inode
    /// (a socket, say) that can be used through [`fd_path`]. A symlink gives
    /// a handle on the link itself, which [`fstat`] reports as such.
    pub fn open_path(&self, name: &OsStr) -> io::Result<OwnedFd> {
        let name = single_component(name)?;
        openat_raw(self.fd.as_fd(), &name, libc::O_PATH | libc::O_NOFOLLOW)
    }

    /// Opens the regular file `name` for reading; a symlink is refused.
    pub fn open_file(&self, name: &OsStr) -> io::Result<File> {
        let name = single_component(name)?;
        let file = File::from(openat_raw(
            self.fd.as_fd(),
            &name,
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
        )?);
        if !file.metadata()?.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        Ok(file)
    }

    /// Removes `name` from this directory (`unlinkat`; a symlink is removed
    /// itself, never its target).
    pub fn unlink(&self, name: &OsStr) -> io::Result<()> {
        let name = single_component(name)?;
        // SAFETY: `name` is NUL-terminated and the fd is open.
        let rc = unsafe { libc::unlinkat(self.fd.as_raw_fd(), name.as_ptr(), 0) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// `/proc/self/fd/<fd>`: a short path naming exactly the inode of `fd`.
pub fn fd_path(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// `fstat` of an fd (also of an `O_PATH` one).
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: the fd is valid for the borrow and the buffer is writable.
    let rc = unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat returned 0, so it filled the buffer.
    Ok(unsafe { stat.assume_init() })
}

/// The [`EntryKind`] of a `stat` mode.
pub fn entry_kind(mode: libc::mode_t) -> EntryKind {
    match mode & libc::S_IFMT {
        libc::S_IFREG => EntryKind::File,
        libc::S_IFDIR => EntryKind::Dir,
        libc::S_IFLNK => EntryKind::Symlink,
        libc::S_IFSOCK => EntryKind::Socket,
        _ => EntryKind::Other,
    }
}

fn entry_stat(stat: &libc::stat) -> EntryStat {
    let modified = match (
        u64::try_from(stat.st_mtime),
        u32::try_from(stat.st_mtime_nsec),
    ) {
        (Ok(secs), Ok(nanos)) if nanos < 1_000_000_000 => {
            SystemTime::UNIX_EPOCH + Duration::new(secs, nanos)
        }
        _ => SystemTime::UNIX_EPOCH,
    };
    EntryStat {
        kind: entry_kind(stat.st_mode),
        uid: stat.st_uid,
        modified,
        size: u64::try_from(stat.st_size).unwrap_or(0),
        disk_bytes: u64::try_from(stat.st_blocks)
            .unwrap_or(0)
            .saturating_mul(512),
    }
}

/// Checks that `name` is one path component and makes it a C string.
fn single_component(name: &OsStr) -> io::Result<CString> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a single file name",
        ));
    }
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in file name"))
}

fn open_path(dirfd: libc::c_int, path: &OsStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: `path` is NUL-terminated; the returned fd is checked and owned.
    let fd = unsafe { libc::openat(dirfd, path.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn openat_raw(dir: BorrowedFd<'_>, name: &CString, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: `name` is NUL-terminated; the returned fd is checked and owned.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[doc(alias = "openat2")]
#[doc(alias = "RESOLVE_IN_ROOT")]
fn openat2_in_root(
    root: BorrowedFd<'_>,
    relative: &OsStr,
    flags: libc::c_int,
) -> io::Result<OwnedFd> {
    let path = CString::new(relative.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: open_how is plain integers; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = u64::try_from(flags | libc::O_CLOEXEC).expect("open flags are non-negative");
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    for _ in 0..OPENAT2_RETRIES {
        // SAFETY: the pointers are valid for the call and `size` is the size
        // of the struct they point to.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root.as_raw_fd(),
                path.as_ptr(),
                &how as *const libc::open_how,
                size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            let fd = libc::c_int::try_from(fd).expect("the kernel returns int fds");
            // SAFETY: openat2 returned a new fd that nothing else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let err = io::Error::last_os_error();
        if !matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) {
            return Err(err);
        }
    }
    Err(io::Error::from_raw_os_error(libc::EAGAIN))
}

/// Before Linux 5.6: opens `relative` one component at a time, refusing
/// symlinks and `..` anywhere. Stricter than `RESOLVE_IN_ROOT` (a target
/// whose `/tmp` is a symlink is not reachable), never less safe.
fn walk_nofollow(
    root: BorrowedFd<'_>,
    relative: &OsStr,
    flags: libc::c_int,
) -> io::Result<OwnedFd> {
    let components: Vec<&OsStr> = relative
        .as_bytes()
        .split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
        .map(OsStr::from_bytes)
        .collect();
    if components.iter().any(|c| c.as_bytes() == b"..") {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "'..' in a path inside a target root",
        ));
    }
    let Some((last, parents)) = components.split_last() else {
        return openat_raw(root, &c".".into(), flags);
    };
    let mut dir: Option<OwnedFd> = None;
    for component in parents {
        let name = single_component(component)?;
        let parent = dir.as_ref().map_or(root, |d| d.as_fd());
        dir = Some(openat_raw(
            parent,
            &name,
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        )?);
    }
    let parent = dir.as_ref().map_or(root, |d| d.as_fd());
    openat_raw(parent, &single_component(last)?, flags | libc::O_NOFOLLOW)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{fs, os::unix::fs::symlink};

    /// `<proc>/<pid>/root` as a real directory tree with hostile symlinks.
    fn fake_root() -> (tempfile::TempDir, ProcFs) {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("proc/5/root");
        fs::create_dir_all(root.join("tmp")).expect("mkdir");
        fs::create_dir_all(root.join("var/tmp")).expect("mkdir");
        fs::create_dir_all(dir.path().join("host-secret")).expect("mkdir");
        fs::write(dir.path().join("host-secret/key"), "host").expect("write");
        fs::write(root.join("tmp/perf-1.map"), "1 2 x\n").expect("write");
        fs::write(root.join("var/tmp/inner"), "inner").expect("write");
        // Absolute symlinks: from inside the root they point inside it.
        symlink("/var/tmp", root.join("linked-tmp")).expect("symlink");
        symlink(dir.path().join("host-secret"), root.join("escape")).expect("symlink");
        symlink("../../../../host-secret/key", root.join("tmp/dotdot")).expect("symlink");
        symlink(
            dir.path().join("host-secret/key"),
            root.join("tmp/perf-2.map"),
        )
        .expect("symlink");
        (dir, ProcFs::new(dir_path_proc(&root)))
    }

    fn dir_path_proc(root: &Path) -> PathBuf {
        root.parent()
            .and_then(Path::parent)
            .expect("root has a proc parent")
            .to_path_buf()
    }

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let (_dir, procfs) = fake_root();
        let root = TargetRoot::open(&procfs, 5).expect("open root");
        // /linked-tmp -> /var/tmp resolves to <root>/var/tmp.
        let linked = root.open_dir("/linked-tmp").expect("open linked dir");
        assert_eq!(
            linked.entries().expect("list"),
            vec![OsString::from("inner")]
        );
        // /escape -> <host>/host-secret is re-rooted: that path does not exist inside.
        assert!(root.open_dir("/escape").is_err());
        // .. cannot climb above the root either.
        assert!(root.open_file("/tmp/dotdot").is_err());
        assert!(root.open_dir("/../../..").is_ok_and(|d| {
            d.entries()
                .is_ok_and(|e| e.iter().all(|n| n != "host-secret"))
        }));
    }

    #[test]
    fn dir_operations_never_follow_the_last_symlink() {
        let (dir, procfs) = fake_root();
        let root = TargetRoot::open(&procfs, 5).expect("open root");
        let tmp = root.open_dir("/tmp").expect("open tmp");
        let mut names = tmp.entries().expect("list");
        names.sort();
        assert_eq!(names, ["dotdot", "perf-1.map", "perf-2.map"]);
        assert_eq!(
            tmp.stat(OsStr::new("perf-2.map")).expect("stat").kind,
            EntryKind::Symlink
        );
        assert!(tmp.open_file(OsStr::new("perf-2.map")).is_err());
        let link = tmp.open_path(OsStr::new("perf-2.map")).expect("O_PATH");
        assert_eq!(
            entry_kind(fstat(link.as_fd()).expect("fstat").st_mode),
            EntryKind::Symlink
        );
        tmp.unlink(OsStr::new("perf-2.map")).expect("unlink link");
        assert!(
            dir.path().join("host-secret/key").exists(),
            "target of the link survives"
        );

        let stat = tmp.stat(OsStr::new("perf-1.map")).expect("stat");
        assert_eq!((stat.kind, stat.size), (EntryKind::File, 6));
        assert!(tmp.open_file(OsStr::new("perf-1.map")).is_ok());
        for bad in ["", ".", "..", "a/b", "../tmp"] {
            assert!(tmp.stat(OsStr::new(bad)).is_err(), "{bad}");
            assert!(tmp.unlink(OsStr::new(bad)).is_err(), "{bad}");
        }
        assert!(tmp.display_path().ends_with("5/root/tmp"));
    }

    #[test]
    fn fallback_walk_refuses_symlinks_and_dotdot() {
        let (_dir, procfs) = fake_root();
        let root = TargetRoot::open(&procfs, 5).expect("open root");
        let flags = libc::O_RDONLY | libc::O_DIRECTORY;
        assert!(walk_nofollow(root.fd.as_fd(), OsStr::new("var/tmp"), flags).is_ok());
        assert!(walk_nofollow(root.fd.as_fd(), OsStr::new(""), flags).is_ok());
        assert!(walk_nofollow(root.fd.as_fd(), OsStr::new("linked-tmp"), flags).is_err());
        assert!(walk_nofollow(root.fd.as_fd(), OsStr::new("escape/key"), libc::O_RDONLY).is_err());
        assert!(walk_nofollow(root.fd.as_fd(), OsStr::new("tmp/../tmp"), flags).is_err());
    }

    #[test]
    fn missing_root_is_no_such_process() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = TargetRoot::open(&ProcFs::new(dir.path()), 1).expect_err("no root");
        assert!(
            matches!(err, ProcError::NoSuchProcess { pid: 1 }),
            "{err:?}"
        );
    }
}
