//! Opening the file a target has mapped: the one way clrbpf reads a file a
//! target names (its `libcoreclr.so`, its assemblies, its native
//! libraries), next to [`super::root`] (paths inside a target's root) and
//! [`super::maps`] (which says what is mapped).
//!
//! A path in `/proc/PID/maps` is only what the file was called when it was
//! mapped. The target owns the directories on that path and can swap one
//! for a symlink to a directory only root may read, or to `/dev`, between
//! the mapping and the profiler's open: root opening that path would read
//! a file the target never could (and name its frames after it), or open a
//! device or FIFO. So:
//!
//! 1. `/proc/PID/map_files/START-END` names the exact file mapped (the
//!    kernel keeps it, whatever the path has become). It is opened
//!    `O_PATH` first (which opens nothing: no device or FIFO side effect),
//!    `fstat`ed, and only a regular file is reopened for reading through
//!    `/proc/self/fd`, `O_RDONLY | O_NOCTTY | O_NONBLOCK | O_CLOEXEC`.
//! 2. `map_files` needs `CAP_SYS_ADMIN` (or `CAP_CHECKPOINT_RESTORE`) in
//!    the initial user namespace; without it, the path is resolved inside
//!    the target's root ([`super::root`]: no symlink leaves it) on a
//!    thread running as the target's filesystem uid and groups
//!    ([`super::identity`]), so every directory on the way is checked as
//!    for the target. Again `O_PATH | O_NOFOLLOW` first: a regular file
//!    whose device and inode are the mapping's is reopened for reading (as
//!    the target too), anything else is refused.
//!
//! Each open is counted by how it went ([`counts`]), for the summary line.

use std::{
    fs::File,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    sync::atomic::{AtomicU64, Ordering},
};

use super::{
    ProcFs,
    identity::{FsIdentity, IdentityError},
    root::{TargetRoot, fstat},
};

/// What identifies one file mapping of a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedFileRef<'a> {
    pub start: u64,
    pub end: u64,
    pub dev_major: u32,
    pub dev_minor: u32,
    pub inode: u64,
    /// The path `/proc/PID/maps` shows, in the target's mount namespace.
    pub path: &'a str,
}

impl<'a> From<&'a super::Mapping> for MappedFileRef<'a> {
    fn from(m: &'a super::Mapping) -> Self {
        Self {
            start: m.start,
            end: m.end,
            dev_major: m.dev_major,
            dev_minor: m.dev_minor,
            inode: m.inode,
            path: m.path.as_deref().unwrap_or(""),
        }
    }
}

/// Why a mapped file was not opened.
#[derive(Debug, thiserror::Error)]
pub enum MappedFileError {
    #[error("{path} is not a regular file (refused)")]
    NotRegular { path: String },
    #[error("{path} is no longer the file mapped (device or inode differ; refused)")]
    Replaced { path: String },
    #[error("cannot open {path} as the target's user: {source}")]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot reach the root or identity of process {pid}: {reason}")]
    Target { pid: u32, reason: String },
    #[error(transparent)]
    Identity(#[from] IdentityError),
}

/// How the opens of mapped files went, since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MappedFileCounts {
    /// Opened through `/proc/PID/map_files`.
    pub map_files: u64,
    /// Opened by path in the target's root, as the target's user.
    pub by_path: u64,
    /// Refused: a device, FIFO, directory or symlink.
    pub not_regular: u64,
    /// Refused: the path is now another file than the one mapped.
    pub replaced: u64,
    /// Could not be opened (gone, or not readable by the target's user).
    pub failed: u64,
}

static MAP_FILES: AtomicU64 = AtomicU64::new(0);
static BY_PATH: AtomicU64 = AtomicU64::new(0);
static NOT_REGULAR: AtomicU64 = AtomicU64::new(0);
static REPLACED: AtomicU64 = AtomicU64::new(0);
static FAILED: AtomicU64 = AtomicU64::new(0);

/// The counts of every open so far.
pub fn counts() -> MappedFileCounts {
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    MappedFileCounts {
        map_files: get(&MAP_FILES),
        by_path: get(&BY_PATH),
        not_regular: get(&NOT_REGULAR),
        replaced: get(&REPLACED),
        failed: get(&FAILED),
    }
}

/// Opens the file `mapping` of process `pid` maps, for reading; see the
/// module doc.
pub fn open_mapped(
    procfs: &ProcFs,
    pid: u32,
    mapping: &MappedFileRef<'_>,
) -> Result<File, MappedFileError> {
    let result = match open_map_files(procfs, pid, mapping) {
        Ok(file) => {
            MAP_FILES.fetch_add(1, Ordering::Relaxed);
            return Ok(file);
        }
        // A file map_files shows that is no regular file: refused, not
        // looked up again by its path.
        Err(e @ MappedFileError::NotRegular { .. }) => Err(e),
        Err(_) => open_as_target(procfs, pid, mapping).inspect(|_| {
            BY_PATH.fetch_add(1, Ordering::Relaxed);
        }),
    };
    let counter = match &result {
        Ok(_) => return result,
        Err(MappedFileError::NotRegular { .. }) => &NOT_REGULAR,
        Err(MappedFileError::Replaced { .. }) => &REPLACED,
        Err(_) => &FAILED,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    result
}

/// Through `/proc/PID/map_files/START-END`, as clrbpf's own user.
fn open_map_files(
    procfs: &ProcFs,
    pid: u32,
    mapping: &MappedFileRef<'_>,
) -> Result<File, MappedFileError> {
    let link = procfs.pid_path(
        pid,
        &format!("map_files/{:x}-{:x}", mapping.start, mapping.end),
    );
    let open_error = |source| MappedFileError::Open {
        path: link.display().to_string(),
        source,
    };
    let fd = open_o_path(&link).map_err(open_error)?;
    regular_file(&fd, mapping.path)?;
    reopen_for_reading(fd.as_fd()).map_err(open_error)
}

/// By its path inside the target's root, on a thread running as the
/// target's filesystem user, checked against the mapping's device and inode.
fn open_as_target(
    procfs: &ProcFs,
    pid: u32,
    mapping: &MappedFileRef<'_>,
) -> Result<File, MappedFileError> {
    let target_error = |e: super::ProcError| MappedFileError::Target {
        pid,
        reason: e.to_string(),
    };
    // The root fd is opened as clrbpf (it needs ptrace access to the
    // target); everything below it is resolved as the target.
    let root = TargetRoot::open(procfs, pid).map_err(target_error)?;
    let identity = FsIdentity::of_process(procfs, pid).map_err(target_error)?;
    identity.run(|| open_in_root_checked(&root, mapping))?
}

fn open_in_root_checked(
    root: &TargetRoot,
    mapping: &MappedFileRef<'_>,
) -> Result<File, MappedFileError> {
    let path = mapping.path;
    let open_error = |source| MappedFileError::Open {
        path: path.to_owned(),
        source,
    };
    let fd = root.open_path(path).map_err(open_error)?;
    let stat = regular_file(&fd, path)?;
    let (major, minor) = (libc::major(stat.st_dev), libc::minor(stat.st_dev));
    if stat.st_ino != mapping.inode || (major, minor) != (mapping.dev_major, mapping.dev_minor) {
        return Err(MappedFileError::Replaced {
            path: path.to_owned(),
        });
    }
    reopen_for_reading(fd.as_fd()).map_err(open_error)
}

/// The `fstat` of an `O_PATH` fd that must be a regular file.
fn regular_file(fd: &OwnedFd, path: &str) -> Result<libc::stat, MappedFileError> {
    let stat = fstat(fd.as_fd()).map_err(|source| MappedFileError::Open {
        path: path.to_owned(),
        source,
    })?;
    if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(MappedFileError::NotRegular {
            path: path.to_owned(),
        });
    }
    Ok(stat)
}

/// `O_PATH` (following the magic link of `map_files`, which is the point):
/// opens nothing, so a device or FIFO is not touched.
fn open_o_path(path: &std::path::Path) -> io::Result<OwnedFd> {
    raw_open(path.as_os_str(), libc::O_PATH)
}

/// The inode an `O_PATH` fd holds, opened for reading through
/// `/proc/self/fd` (the permission check is made again, as this thread's
/// filesystem user), checked to be that same inode.
fn reopen_for_reading(fd: BorrowedFd<'_>) -> io::Result<File> {
    let before = fstat(fd)?;
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let file = File::from(raw_open(
        std::ffi::OsStr::new(&path),
        libc::O_RDONLY | libc::O_NOCTTY | libc::O_NONBLOCK,
    )?);
    let after = fstat(file.as_fd())?;
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino)
        || after.st_mode & libc::S_IFMT != libc::S_IFREG
    {
        return Err(io::Error::other("reopened another file"));
    }
    Ok(file)
}

fn raw_open(path: &std::ffi::OsStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt as _;
    let path = std::ffi::CString::new(path.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: `path` is NUL-terminated; the returned fd is checked and owned.
    let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: open returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use std::{
        os::unix::{fs::MetadataExt as _, fs::symlink},
        path::Path,
    };

    use super::*;

    /// A file of this test process, described as a mapping would be.
    fn mapping_of(path: &Path) -> (u32, u32, u64) {
        let meta = std::fs::metadata(path).expect("stat");
        (libc::major(meta.dev()), libc::minor(meta.dev()), meta.ino())
    }

    fn tempdir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("clrbpf-mapped-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("real")).expect("mkdir");
        dir
    }

    #[test]
    fn by_path_opens_only_the_inode_mapped() {
        let dir = tempdir("swap");
        let file = dir.join("real/X.dll");
        std::fs::write(&file, b"mine").expect("write");
        let (dev_major, dev_minor, inode) = mapping_of(&file);
        let path = file.to_str().expect("utf-8");
        let mapping = MappedFileRef {
            start: 0,
            end: 0,
            dev_major,
            dev_minor,
            inode,
            path,
        };
        let root = TargetRoot::at_host_path(Path::new("/")).expect("root");
        let mut read = String::new();
        io::Read::read_to_string(
            &mut open_in_root_checked(&root, &mapping).expect("the file mapped"),
            &mut read,
        )
        .expect("read");
        assert_eq!(read, "mine");

        // The directory swapped for a symlink to another with a file of the
        // same name: refused, as another inode.
        std::fs::create_dir_all(dir.join("secret")).expect("mkdir");
        std::fs::write(dir.join("secret/X.dll"), b"secret").expect("write");
        std::fs::rename(dir.join("real"), dir.join("old")).expect("rename");
        symlink(dir.join("secret"), dir.join("real")).expect("symlink");
        assert!(matches!(
            open_in_root_checked(&root, &mapping),
            Err(MappedFileError::Replaced { .. })
        ));

        // A FIFO in its place: refused without blocking (O_PATH opens
        // nothing), as no regular file.
        std::fs::remove_file(dir.join("real")).expect("unlink");
        std::fs::create_dir_all(dir.join("real")).expect("mkdir");
        let fifo = std::ffi::CString::new(path).expect("path");
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(matches!(
            open_in_root_checked(&root, &mapping),
            Err(MappedFileError::NotRegular { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_device_is_refused_unopened() {
        let root = TargetRoot::at_host_path(Path::new("/")).expect("root");
        let (dev_major, dev_minor, inode) = mapping_of(Path::new("/dev/null"));
        let mapping = MappedFileRef {
            start: 0,
            end: 0,
            dev_major,
            dev_minor,
            inode,
            path: "/dev/null",
        };
        assert!(matches!(
            open_in_root_checked(&root, &mapping),
            Err(MappedFileError::NotRegular { .. })
        ));
    }

    #[test]
    fn map_files_of_this_process_open_its_own_mappings() {
        let procfs = ProcFs::default();
        let pid = std::process::id();
        let maps = procfs.maps(pid).expect("maps");
        let mapping = maps
            .iter()
            .find(|m| m.file_path().is_some() && m.inode != 0)
            .expect("a file mapping");
        let file = open_mapped(&procfs, pid, &MappedFileRef::from(mapping)).expect("opened");
        assert_eq!(file.metadata().expect("stat").ino(), mapping.inode);
    }
}
