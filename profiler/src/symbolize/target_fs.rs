//! Reading (and removing) files inside a profiled process's own view of the
//! filesystem, the first step of managed symbolization: the runtime writes
//! `perf-NSPID.map` and `jit-NSPID.dump` in *its* mount namespace, which we
//! reach through `/proc/PID/root`.
//!
//! Everything under that root belongs to the target, so it is hostile: a
//! symlink such as `/tmp/perf-1.map -> /etc/shadow` must resolve inside the
//! target's root, never in ours. Paths are therefore opened with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` relative to a directory
//! descriptor of the root (the resolver of [`crate::process::root`], shared
//! with the IPC side), the last component is never a symlink
//! (`O_NOFOLLOW`), opening never blocks on a FIFO (`O_NONBLOCK`), and anything
//! that is not a regular file is refused. Every read is bounded.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::process::{ProcFs, root};

/// Environment variable that moves CoreCLR's perf map and jitdump out of
/// `/tmp` (read once by the runtime at startup).
pub const PERF_MAP_DIR_ENV: &str = "DOTNET_PerfMapJitDumpPath";
/// The legacy spelling of [`PERF_MAP_DIR_ENV`]; the runtime reads it when
/// the `DOTNET_` one is absent.
pub const PERF_MAP_DIR_ENV_LEGACY: &str = "COMPlus_PerfMapJitDumpPath";
/// The temp directory variable the runtime's PAL honours.
pub const TMPDIR_ENV: &str = "TMPDIR";
/// Where CoreCLR writes its perf files when [`PERF_MAP_DIR_ENV`] is unset.
pub const DEFAULT_PERF_MAP_DIR: &str = "/tmp";

/// Bound on `/proc/PID/environ`. An environment larger than this is read
/// partially; the variable cut at the bound is dropped.
const MAX_ENVIRON_BYTES: usize = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum TargetFsError {
    #[error("cannot open the target root directory {root}")]
    OpenRoot {
        root: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open {path} inside the target root {root}")]
    Open {
        root: PathBuf,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} inside the target root {root} is not a regular file")]
    NotRegularFile { root: PathBuf, path: PathBuf },
    #[error("path {path} is not usable in a target root (NUL byte or not a plain file name)")]
    InvalidPath { path: PathBuf },
    #[error(
        "{path} inside the target root {root} is owned by {}, not by the process's uid {}: not read",
        .owner.map_or("an unknown user".to_owned(), |uid| format!("uid {uid}")),
        .expected.map_or("(unknown)".to_owned(), |uid| uid.to_string())
    )]
    NotOwned {
        root: PathBuf,
        path: PathBuf,
        owner: Option<u32>,
        expected: Option<u32>,
    },
}

impl TargetFsError {
    /// Whether the error only says the file (or the root) does not exist:
    /// perf files appear some time after a runtime starts, and processes exit.
    pub fn is_not_found(&self) -> bool {
        match self {
            Self::OpenRoot { source, .. } | Self::Open { source, .. } => {
                source.kind() == io::ErrorKind::NotFound
            }
            Self::NotRegularFile { .. } | Self::InvalidPath { .. } | Self::NotOwned { .. } => false,
        }
    }
}

/// `/proc/PID/root`: the process's root directory as the kernel sees it.
pub fn proc_root(pid: u32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root"))
}

/// Opens `path_in_target` (an absolute path as the process sees it) for
/// reading, resolved inside the root of process `pid`.
pub fn open_in_root(pid: u32, path_in_target: &Path) -> Result<File, TargetFsError> {
    open_in_root_dir(&proc_root(pid), path_in_target)
}

/// Opens `path_in_root` for reading, resolved as if `root` were `/`:
/// absolute symlinks and `..` cannot leave `root`, magic links
/// (`/proc/self/fd/N`) are refused, the last component must not be a symlink
/// and the result must be a regular file.
pub fn open_in_root_dir(root: &Path, path_in_root: &Path) -> Result<File, TargetFsError> {
    let fd = resolve_in(
        root,
        path_in_root,
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY,
    )?;
    let file = File::from(fd);
    let metadata = file.metadata().map_err(|source| TargetFsError::Open {
        root: root.to_owned(),
        path: path_in_root.to_owned(),
        source,
    })?;
    if !metadata.file_type().is_file() {
        return Err(TargetFsError::NotRegularFile {
            root: root.to_owned(),
            path: path_in_root.to_owned(),
        });
    }
    Ok(file)
}

/// What a bounded read returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundedRead {
    pub bytes: Vec<u8>,
    /// The source had more than the bound; `bytes` holds exactly the bound.
    pub truncated: bool,
}

/// Reads at most `max_bytes` from `reader` (one more byte is requested to
/// tell whether the source was longer).
pub fn read_bounded(reader: impl Read, max_bytes: usize) -> io::Result<BoundedRead> {
    let limit = u64::try_from(max_bytes)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    let mut bytes = Vec::new();
    reader.take(limit).read_to_end(&mut bytes)?;
    let truncated = bytes.len() > max_bytes;
    bytes.truncate(max_bytes);
    Ok(BoundedRead { bytes, truncated })
}

/// Appends to `buf` the bytes of `file` from `offset` up to its current end
/// or until `max_bytes` were read, whichever comes first. The file may grow
/// while it is read (perf maps are written live): what is appended is a
/// prefix of the data after `offset`. Returns the number of bytes appended.
pub fn read_from_offset(
    file: &File,
    offset: u64,
    buf: &mut Vec<u8>,
    max_bytes: usize,
) -> io::Result<usize> {
    const CHUNK: usize = 256 * 1024;
    let mut total = 0usize;
    while total < max_bytes {
        let want = CHUNK.min(max_bytes - total);
        let old_len = buf.len();
        buf.resize(old_len + want, 0);
        let position = offset.saturating_add(total as u64);
        let result = file.read_at(&mut buf[old_len..], position);
        let n = match result {
            Ok(n) => n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {
                buf.truncate(old_len);
                continue;
            }
            Err(error) => {
                buf.truncate(old_len);
                return Err(error);
            }
        };
        buf.truncate(old_len + n);
        total += n;
        if n == 0 {
            break;
        }
    }
    Ok(total)
}

/// When process `pid` started, from `/proc/PID/stat` (clock ticks after
/// boot) and the boot time in `/proc/stat` (whole seconds, so about one
/// second of error). `None` when the process is gone.
pub fn process_start_time(pid: u32) -> Option<SystemTime> {
    let procfs = ProcFs::default();
    let ticks = procfs.start_time_ticks(pid).ok()?;
    let boot = procfs.boot_time()?;
    let ticks_per_second = crate::process::clock_ticks_per_second()?;
    let after_boot = Duration::from_secs(ticks / ticks_per_second)
        + Duration::from_nanos((ticks % ticks_per_second) * 1_000_000_000 / ticks_per_second);
    UNIX_EPOCH
        .checked_add(Duration::from_secs(boot))?
        .checked_add(after_boot)
}

/// The directories (as the target sees them) where its runtime may write
/// its perf files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerfDirs {
    /// .NET 8+ writes `perf-NSPID.map` and `jit-NSPID.dump` here:
    /// `DOTNET_PerfMapJitDumpPath` (or `COMPlus_PerfMapJitDumpPath`), else
    /// `/tmp`. Older runtimes write their jitdump here.
    pub perf_dir: PathBuf,
    /// Older runtimes (verified on .NET Core 3.1) write `perf-NSPID.map` in
    /// the PAL temp directory instead: `$TMPDIR`, else `/tmp`.
    pub legacy_perf_map_dir: PathBuf,
}

/// The directory (as the target sees it) where its runtime writes
/// `perf-NSPID.map` and `jit-NSPID.dump`: the value of
/// `DOTNET_PerfMapJitDumpPath` (or `COMPlus_PerfMapJitDumpPath`) in the
/// process's initial environment, else `/tmp`. See [`target_perf_dirs`].
#[cfg(test)]
pub fn target_tmp_dir(pid: u32) -> PathBuf {
    target_perf_dirs(pid).perf_dir
}

/// Where process `pid`'s runtime writes its perf files, from its initial
/// environment.
///
/// Limits: `/proc/PID/environ` is the environment at `execve`; a variable
/// set later by the process itself is not seen. A relative directory is
/// relative to the runtime's working directory, which we do not follow:
/// `/tmp` is used instead.
pub fn target_perf_dirs(pid: u32) -> PerfDirs {
    let environ = File::open(format!("/proc/{pid}/environ"))
        .and_then(|file| read_bounded(file, MAX_ENVIRON_BYTES));
    match environ {
        Ok(environ) => perf_dirs_from_environ(&environ.bytes, environ.truncated),
        Err(_) => PerfDirs {
            perf_dir: PathBuf::from(DEFAULT_PERF_MAP_DIR),
            legacy_perf_map_dir: PathBuf::from(DEFAULT_PERF_MAP_DIR),
        },
    }
}

/// The perf directories named by a NUL-separated environment block (the
/// format of `/proc/PID/environ`). When `truncated`, the last entry may be
/// cut and is ignored.
pub fn perf_dirs_from_environ(environ: &[u8], truncated: bool) -> PerfDirs {
    let mut entries: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
    if truncated {
        entries.pop();
    }
    let value_of = |name: &str| {
        entries.iter().find_map(|entry| {
            entry
                .strip_prefix(name.as_bytes())
                .and_then(|rest| rest.strip_prefix(b"="))
        })
    };
    let absolute_or_default = |value: &[u8]| {
        let dir = Path::new(std::ffi::OsStr::from_bytes(value));
        if dir.is_absolute() {
            dir.to_owned()
        } else {
            PathBuf::from(DEFAULT_PERF_MAP_DIR)
        }
    };
    // The runtime's CLRConfig looks up the DOTNET_ name first, then COMPlus_.
    let perf_dir = match value_of(PERF_MAP_DIR_ENV).or_else(|| value_of(PERF_MAP_DIR_ENV_LEGACY)) {
        None => PathBuf::from(DEFAULT_PERF_MAP_DIR),
        // The runtime formats "%s/perf-%d.map": an empty value means "/".
        Some([]) => PathBuf::from("/"),
        Some(value) => absolute_or_default(value),
    };
    // The PAL's GetTempPath: TMPDIR when set and not empty.
    let legacy_perf_map_dir = match value_of(TMPDIR_ENV) {
        None | Some([]) => PathBuf::from(DEFAULT_PERF_MAP_DIR),
        Some(value) => absolute_or_default(value),
    };
    PerfDirs {
        perf_dir,
        legacy_perf_map_dir,
    }
}

/// Opens `path_in_root` below the host directory `root` with
/// [`root::open_in_root`] (`openat2(RESOLVE_IN_ROOT)`), with this module's
/// errors.
fn resolve_in(root: &Path, path_in_root: &Path, flags: i32) -> Result<OwnedFd, TargetFsError> {
    if path_in_root.as_os_str().as_bytes().contains(&0) {
        return Err(TargetFsError::InvalidPath {
            path: path_in_root.to_owned(),
        });
    }
    let root_dir = root::open_root_dir(root).map_err(|source| TargetFsError::OpenRoot {
        root: root.to_owned(),
        source,
    })?;
    root::open_in_root(root_dir.as_fd(), path_in_root.as_os_str(), flags).map_err(|source| {
        TargetFsError::Open {
            root: root.to_owned(),
            path: path_in_root.to_owned(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::symlink;

    /// A fake target root with `/tmp/perf-1.map` and a secret outside it.
    struct Fixture {
        _dir: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("tmp")).expect("mkdir");
        std::fs::create_dir_all(root.join("etc")).expect("mkdir");
        let outside = dir.path().join("secret");
        std::fs::write(&outside, b"host secret").expect("write");
        std::fs::write(root.join("etc/secret"), b"target file").expect("write");
        std::fs::write(root.join("tmp/perf-1.map"), b"0x10 4 f()\n").expect("write");
        Fixture {
            _dir: dir,
            root,
            outside,
        }
    }

    fn read_all(mut file: File) -> Vec<u8> {
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).expect("read");
        bytes
    }

    #[test]
    fn opens_a_regular_file_inside_the_root() {
        let fx = fixture();
        let file = open_in_root_dir(&fx.root, Path::new("/tmp/perf-1.map")).expect("open");
        assert_eq!(read_all(file), b"0x10 4 f()\n");
        // A relative path is relative to the root too.
        let file = open_in_root_dir(&fx.root, Path::new("tmp/perf-1.map")).expect("open");
        assert_eq!(read_all(file), b"0x10 4 f()\n");
    }

    #[test]
    fn final_symlink_is_refused_even_when_it_points_outside() {
        let fx = fixture();
        symlink(&fx.outside, fx.root.join("tmp/perf-2.map")).expect("symlink");
        let error = open_in_root_dir(&fx.root, Path::new("/tmp/perf-2.map")).unwrap_err();
        assert!(matches!(error, TargetFsError::Open { .. }), "{error:?}");
    }

    #[test]
    fn symlinked_directory_resolves_inside_the_root() {
        let fx = fixture();
        // An absolute symlink to the host's directory of the secret: inside
        // the root, `/<dir>` does not exist, so the open fails.
        let outside_dir = fx.outside.parent().expect("parent");
        symlink(outside_dir, fx.root.join("escape")).expect("symlink");
        let error = open_in_root_dir(&fx.root, Path::new("/escape/secret")).unwrap_err();
        assert!(error.is_not_found(), "{error:?}");
        // `/etc` in a symlink means the root's `/etc`, not the host's.
        symlink("/etc", fx.root.join("tmp/etcdir")).expect("symlink");
        let file = open_in_root_dir(&fx.root, Path::new("/tmp/etcdir/secret")).expect("open");
        assert_eq!(read_all(file), b"target file");
    }

    #[test]
    fn dot_dot_cannot_climb_out_of_the_root() {
        let fx = fixture();
        let error = open_in_root_dir(&fx.root, Path::new("/../../../../secret")).unwrap_err();
        assert!(error.is_not_found(), "{error:?}");
        let error = open_in_root_dir(&fx.root, Path::new("../secret")).unwrap_err();
        assert!(error.is_not_found(), "{error:?}");
        symlink("../../secret", fx.root.join("tmp/up")).expect("symlink");
        let error = open_in_root_dir(&fx.root, Path::new("/tmp/up/x")).unwrap_err();
        assert!(matches!(error, TargetFsError::Open { .. }), "{error:?}");
    }

    #[test]
    fn magic_links_are_refused() {
        // Magic links only exist under /proc, so use the real root: the
        // same path without the magic link opens, with it fails.
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("plain");
        std::fs::write(&path, b"x").expect("write");
        open_in_root_dir(Path::new("/"), &path).expect("open");
        let through_magic =
            Path::new("/proc/self/root").join(path.strip_prefix("/").expect("absolute"));
        let error = open_in_root_dir(Path::new("/"), &through_magic).unwrap_err();
        assert!(matches!(error, TargetFsError::Open { .. }), "{error:?}");
    }

    #[test]
    fn directories_and_fifos_are_not_regular_files() {
        let fx = fixture();
        let error = open_in_root_dir(&fx.root, Path::new("/tmp")).unwrap_err();
        assert!(
            matches!(error, TargetFsError::NotRegularFile { .. }),
            "{error:?}"
        );
        let fifo =
            std::ffi::CString::new(fx.root.join("tmp/fifo").as_os_str().as_bytes()).expect("path");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        // Must not block waiting for a writer.
        let error = open_in_root_dir(&fx.root, Path::new("/tmp/fifo")).unwrap_err();
        assert!(
            matches!(error, TargetFsError::NotRegularFile { .. }),
            "{error:?}"
        );
    }

    #[test]
    fn missing_file_and_missing_root_are_not_found() {
        let fx = fixture();
        let error = open_in_root_dir(&fx.root, Path::new("/tmp/none")).unwrap_err();
        assert!(error.is_not_found());
        let error = open_in_root_dir(&fx.root.join("nope"), Path::new("/tmp/none")).unwrap_err();
        assert!(matches!(error, TargetFsError::OpenRoot { .. }));
        assert!(error.is_not_found());
        let error = open_in_root_dir(&fx.root, Path::new("/tmp/a\0b")).unwrap_err();
        assert!(matches!(error, TargetFsError::InvalidPath { .. }));
    }

    #[test]
    fn opens_through_proc_pid_root_of_this_process() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("perf-self.map");
        std::fs::write(&path, b"x").expect("write");
        let file = open_in_root(std::process::id(), &path).expect("open");
        assert_eq!(read_all(file), b"x");
    }

    #[test]
    fn bounded_read_reports_truncation() {
        let read = read_bounded(&b"abcdef"[..], 4).expect("read");
        assert_eq!(read.bytes, b"abcd");
        assert!(read.truncated);
        let read = read_bounded(&b"abcd"[..], 4).expect("read");
        assert_eq!(read.bytes, b"abcd");
        assert!(!read.truncated);
        let read = read_bounded(&b""[..], 0).expect("read");
        assert!(read.bytes.is_empty() && !read.truncated);
    }

    #[test]
    fn read_from_offset_reads_new_bytes_only() {
        let mut file = tempfile::tempfile().expect("temp file");
        file.write_all(b"0123456789").expect("write");
        let mut buf = b"keep".to_vec();
        assert_eq!(read_from_offset(&file, 4, &mut buf, 100).expect("read"), 6);
        assert_eq!(buf, b"keep456789");
        buf.clear();
        assert_eq!(read_from_offset(&file, 2, &mut buf, 3).expect("read"), 3);
        assert_eq!(buf, b"234");
        buf.clear();
        assert_eq!(read_from_offset(&file, 50, &mut buf, 3).expect("read"), 0);
        assert!(buf.is_empty());
    }

    #[test]
    fn perf_map_dir_honours_the_runtime_variables() {
        let dir = |env: &[u8]| perf_dirs_from_environ(env, false).perf_dir;
        assert_eq!(dir(b"PATH=/bin\0HOME=/root\0"), Path::new("/tmp"));
        assert_eq!(
            dir(b"PATH=/bin\0DOTNET_PerfMapJitDumpPath=/var/perf\0"),
            Path::new("/var/perf")
        );
        assert_eq!(
            dir(b"COMPlus_PerfMapJitDumpPath=/old\0DOTNET_PerfMapJitDumpPath=/new\0"),
            Path::new("/new")
        );
        assert_eq!(dir(b"COMPlus_PerfMapJitDumpPath=/old\0"), Path::new("/old"));
        assert_eq!(dir(b"DOTNET_PerfMapJitDumpPath=\0"), Path::new("/"));
        assert_eq!(dir(b"DOTNET_PerfMapJitDumpPath=rel\0"), Path::new("/tmp"));
        assert_eq!(dir(b"XDOTNET_PerfMapJitDumpPath=/x\0"), Path::new("/tmp"));
        assert_eq!(dir(b"DOTNET_PerfMapJitDumpPathX=/x\0"), Path::new("/tmp"));
        assert_eq!(dir(b"TMPDIR=/x\0"), Path::new("/tmp"));
        // A variable cut by the read bound is not trusted.
        assert_eq!(
            perf_dirs_from_environ(b"A=1\0DOTNET_PerfMapJitDumpPath=/var/pe", true).perf_dir,
            Path::new("/tmp")
        );
        assert_eq!(target_tmp_dir(u32::MAX), Path::new("/tmp"));
    }

    #[test]
    fn start_time_fields() {
        assert_eq!(
            crate::process::parse_boot_time("cpu  1 2 3\nintr 5\nbtime 1700000000\nprocesses 9\n"),
            Some(1_700_000_000)
        );
        assert_eq!(crate::process::parse_boot_time("cpu 1\n"), None);
        let started = process_start_time(std::process::id()).expect("own start time");
        let now = SystemTime::now();
        assert!(started <= now + Duration::from_secs(2));
        assert!(process_start_time(u32::MAX).is_none());
    }

    #[test]
    fn legacy_perf_map_dir_is_tmpdir() {
        let legacy = |env: &[u8]| perf_dirs_from_environ(env, false).legacy_perf_map_dir;
        assert_eq!(legacy(b"PATH=/bin\0"), Path::new("/tmp"));
        assert_eq!(legacy(b"TMPDIR=/var/tmp/\0"), Path::new("/var/tmp/"));
        assert_eq!(legacy(b"TMPDIR=\0"), Path::new("/tmp"));
        assert_eq!(legacy(b"TMPDIR=rel\0"), Path::new("/tmp"));
        assert_eq!(
            legacy(b"DOTNET_PerfMapJitDumpPath=/p\0"),
            Path::new("/tmp"),
            "not moved by the .NET 8 variable"
        );
    }
}
