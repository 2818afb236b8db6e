//! The directory sink, the default when no URL is given: every window
//! becomes one gzip pprof per service and profile type in one directory,
//! `SERVICE.TYPE.YYYYMMDDTHHMMSSZ.clrbpf.pb.gz` (the window start, UTC),
//! which `go tool pprof` and Pyroscope's `profilecli` read as they are.
//!
//! The agent runs as root and the directory's path may pass through
//! directories other users control, so it trusts nothing but the
//! directory itself:
//!
//! 1. Every window opens the directory anew with
//!    [`TargetDir::open_private`], the check `--cache-dir` has: a real
//!    directory (a symlink there is refused, not followed) owned by the
//!    agent's user with mode 0700 (one others may read but not write,
//!    such as kubelet's `hostPath`, is tightened to 0700). A directory
//!    that fails it fails the window with an error naming the problem.
//! 2. Everything else goes through that directory fd, one name at a time
//!    (`openat`, `renameat`, `unlinkat`, `fstatat` without following
//!    symlinks): a file is written under a new hidden temporary name
//!    (`O_CREAT|O_EXCL|O_NOFOLLOW`), synced and renamed into place, so no
//!    reader sees half a file and a path swapped meanwhile changes nothing.
//! 3. After each window, retention removes this sink's own files older
//!    than the maximum age, then the oldest until the total fits the size
//!    budget (counted in the blocks the files take on disk). Its own files
//!    are those with its marker (`.clrbpf.pb.gz` after the name pattern
//!    above), regular and owned by the agent's user: the names survive a
//!    restart, and nothing else in the directory is ever removed (a
//!    hidden temporary of its own is, once an hour old: a dead writer's).
//! 4. A write that fails (a full disk, a read-only directory) fails the
//!    window: the queue drops and counts it, the agent goes on, and the
//!    next window tries again. The part already written is removed.
//!
//! Two profiles of one service and type in one window (two processes with
//! their own labels) are `SERVICE.TYPE...` and `SERVICE+2.TYPE...`.
//!
//! Service names are made safe for a file name: characters other than
//! ASCII letters, digits, `-` and `_` become `_`, at most 100 of them.

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use super::{BoxFuture, ProfileType, UploadError, WindowBatch, WindowUploader};
use crate::{
    export::{ExportError, write_pprof},
    process::root::{EntryKind, PrivateDirError, TargetDir, WiderMode},
};

/// The file-name suffix of every profile this sink writes: its marker.
const SUFFIX: &str = ".clrbpf.pb.gz";
/// The suffix of its temporary files (`.NAME.PID.N.tmp`).
const TEMP_SUFFIX: &str = ".tmp";
/// Age past which a temporary file of this sink is a dead writer's.
const STALE_TEMP: Duration = Duration::from_secs(3600);
/// Longest service part of a file name.
const MAX_SERVICE_CHARS: usize = 100;
/// Length of the `YYYYMMDDTHHMMSSZ` part.
const STAMP_LEN: usize = 16;

/// Where and how long profiles are kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectoryConfig {
    pub dir: PathBuf,
    /// Files older than this are removed.
    pub max_age: Duration,
    /// The oldest files are removed while the total is above this.
    pub max_total_bytes: u64,
}

/// The directory sink; see the module documentation.
#[derive(Debug)]
pub struct DirectoryUploader {
    config: Arc<DirectoryConfig>,
}

impl DirectoryUploader {
    /// Creates the directory if needed (mode 0700, parents included) and
    /// checks it as every window will, so a bad one stops the agent at
    /// its start.
    pub fn new(config: DirectoryConfig) -> Result<Self, PrivateDirError> {
        open_dir(&config.dir)?;
        Ok(Self {
            config: Arc::new(config),
        })
    }
}

impl WindowUploader for DirectoryUploader {
    fn name(&self) -> &'static str {
        "directory"
    }

    fn upload(&self, batch: Arc<WindowBatch>) -> BoxFuture<'_, Result<(), UploadError>> {
        let config = Arc::clone(&self.config);
        Box::pin(async move {
            tokio::task::spawn_blocking(move || write_window(&config, &batch, SystemTime::now()))
                .await
                .map_err(|_| UploadError::WriterStopped { sink: "directory" })?
        })
    }
}

fn open_dir(path: &Path) -> Result<TargetDir, PrivateDirError> {
    TargetDir::open_private(path, WiderMode::Tighten)
}

/// Writes every profile of `batch`, then applies retention as of `now`.
/// The first failure fails the window (the files already written stay).
fn write_window(
    config: &DirectoryConfig,
    batch: &WindowBatch,
    now: SystemTime,
) -> Result<(), UploadError> {
    let dir = open_dir(&config.dir).map_err(|source| UploadError::OutputDir { source })?;
    let stamp = window_stamp(batch.start);
    let mut result = Ok(());
    // Two profiles of one service and type in a window (two processes
    // with their own labels) must not overwrite each other: the second is
    // `SERVICE+2.TYPE...`; `+` never appears in a sanitized service name.
    let mut seen: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    for profile in &batch.profiles {
        let mut name = file_name(&profile.service_name, profile.profile_type, &stamp);
        let count = seen.entry(name.clone()).or_insert(0);
        *count += 1;
        if *count > 1 {
            name = format!(
                "{}+{count}.{}.{stamp}{SUFFIX}",
                safe_service_name(&profile.service_name),
                profile.profile_type.name()
            );
        }
        let written = write_file(&dir, &name, &batch.timed(&profile.profile));
        if let Err(source) = written {
            result = Err(UploadError::Write {
                path: dir.display_child(OsStr::new(&name)),
                source,
            });
            break;
        }
    }
    // Retention runs even after a failure: a full disk is what it fixes.
    if let Err(error) = apply_retention(&dir, config, now) {
        tracing::warn!(dir = %config.dir.display(), %error, "retention failed");
    }
    result
}

/// Writes `name` in `dir` whole: a new temporary, synced, renamed over
/// `name` (a symlink planted there is replaced, never followed).
fn write_file(
    dir: &TargetDir,
    name: &str,
    profile: &crate::profile::Profile,
) -> Result<(), ExportError> {
    static NEXT_TEMP: AtomicU64 = AtomicU64::new(0);
    let temp = format!(
        ".{name}.{}.{}{TEMP_SUFFIX}",
        std::process::id(),
        NEXT_TEMP.fetch_add(1, Ordering::Relaxed)
    );
    let io_error = |source| ExportError::WriteOutput {
        path: dir.display_child(OsStr::new(name)),
        source,
    };
    let written = (|| {
        let file = dir.create_new(OsStr::new(&temp)).map_err(io_error)?;
        let mut output = std::io::BufWriter::new(file);
        write_pprof(profile, &mut output)?;
        let file = output
            .into_inner()
            .map_err(|error| io_error(error.into_error()))?;
        file.sync_all().map_err(io_error)?;
        dir.rename(OsStr::new(&temp), OsStr::new(name))
            .map_err(io_error)
    })();
    if written.is_err() {
        let _ = dir.unlink(OsStr::new(&temp));
    }
    written.map_err(|error| match error {
        ExportError::Write { source, .. } => io_error(source),
        error => error,
    })
}

/// `SERVICE.TYPE.STAMP.clrbpf.pb.gz`.
pub fn file_name(service: &str, profile_type: ProfileType, stamp: &str) -> String {
    format!(
        "{}.{}.{stamp}{SUFFIX}",
        safe_service_name(service),
        profile_type.name()
    )
}

/// `YYYYMMDDTHHMMSSZ` of a wall-clock time (UTC).
pub fn window_stamp(start: SystemTime) -> String {
    // `2026-11-23T21:30:15Z` -> `20261123T213015Z`.
    humantime::format_rfc3339_seconds(start)
        .to_string()
        .chars()
        .filter(|c| !matches!(c, '-' | ':'))
        .collect()
}

fn safe_service_name(service: &str) -> String {
    let name: String = service
        .chars()
        .take(MAX_SERVICE_CHARS)
        .map(|c| if is_service_char(c) { c } else { '_' })
        .collect();
    if name.is_empty() {
        "unknown".to_owned()
    } else {
        name
    }
}

fn is_service_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// Whether `name` is a file this sink writes:
/// `SERVICE[+N].TYPE.STAMP.clrbpf.pb.gz`.
fn is_our_file(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(SUFFIX) else {
        return false;
    };
    let mut parts = stem.rsplitn(3, '.');
    let (Some(stamp), Some(profile_type), Some(service)) =
        (parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let service = match service.split_once('+') {
        Some((service, copy)) if is_number(copy) => service,
        Some(_) => return false,
        None => service,
    };
    stamp.len() == STAMP_LEN
        && stamp.ends_with('Z')
        && stamp.as_bytes().get(8) == Some(&b'T')
        && ProfileType::ALL.iter().any(|t| t.name() == profile_type)
        && !service.is_empty()
        && service.len() <= MAX_SERVICE_CHARS
        && service.chars().all(is_service_char)
}

fn is_number(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `name` is a temporary file of this sink: `.NAME.PID.N.tmp`.
fn is_our_temp(name: &str) -> bool {
    let Some(inner) = name
        .strip_prefix('.')
        .and_then(|rest| rest.strip_suffix(TEMP_SUFFIX))
    else {
        return false;
    };
    let mut parts = inner.rsplitn(3, '.');
    let (Some(count), Some(pid), Some(file)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    is_number(count) && is_number(pid) && is_our_file(file)
}

/// Removes this sink's files past the age limit, then the oldest while the
/// total is above the size budget, and its stale temporaries. Other files
/// (other names, symlinks, files of another user) are never touched; a
/// file that vanished meanwhile is fine.
fn apply_retention(
    dir: &TargetDir,
    config: &DirectoryConfig,
    now: SystemTime,
) -> std::io::Result<()> {
    // SAFETY: a call without arguments or memory access.
    let uid = unsafe { libc::geteuid() };
    let mut files = Vec::new();
    for name in dir.entries()? {
        let Some(name) = name.to_str() else { continue };
        let temp = is_our_temp(name);
        if !temp && !is_our_file(name) {
            continue;
        }
        let Ok(stat) = dir.stat(OsStr::new(name)) else {
            continue;
        };
        if stat.kind != EntryKind::File || stat.uid != uid {
            continue;
        }
        let age = now.duration_since(stat.modified).unwrap_or_default();
        if temp {
            if age > STALE_TEMP {
                let _ = dir.unlink(OsStr::new(name));
            }
            continue;
        }
        // What the file takes on disk (whole blocks), which is what fills it.
        files.push((
            stat.modified,
            name.to_owned(),
            stat.size.max(stat.disk_bytes),
        ));
    }
    files.sort();
    let mut total: u64 = files.iter().map(|(_, _, len)| len).sum();
    for (modified, name, len) in files {
        let too_old = now
            .duration_since(modified)
            .is_ok_and(|age| age > config.max_age);
        if !too_old && total <= config.max_total_bytes {
            // Sorted oldest first: the rest is younger, and the size fits.
            break;
        }
        match dir.unlink(OsStr::new(&name)) {
            Ok(()) => total = total.saturating_sub(len),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                total = total.saturating_sub(len);
            }
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::symlink, path::Path};

    use super::*;
    use crate::{
        agent::test_support::{service_profile, window},
        export::read_pprof,
    };

    fn config(dir: &Path) -> DirectoryConfig {
        DirectoryConfig {
            dir: dir.to_owned(),
            max_age: Duration::from_secs(3600),
            max_total_bytes: 1 << 30,
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn names_carry_service_type_and_window_start() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_000_000);
        let stamp = window_stamp(start);
        assert_eq!(stamp, "20261118T110640Z");
        let name = file_name("../etc/passwd svc", ProfileType::Lock, &stamp);
        assert_eq!(name, "___etc_passwd_svc.lock.20261118T110640Z.clrbpf.pb.gz");
        assert!(is_our_file(&name));
        assert_eq!(
            file_name("", ProfileType::ProcessCpu, &stamp),
            "unknown.process_cpu.20261118T110640Z.clrbpf.pb.gz"
        );
        assert!(is_our_file("a+12.wall.20261118T110640Z.clrbpf.pb.gz"));
        assert!(is_our_temp(
            ".a.wall.20261118T110640Z.clrbpf.pb.gz.4242.7.tmp"
        ));
        for other in [
            "notes.txt",
            "a.process_cpu.clrbpf.pb.gz",
            "a.bogus.20261118T110640Z.clrbpf.pb.gz",
            "a.wall.2026111808064Z.clrbpf.pb.gz",
            ".process_cpu.20261118T110640Z.clrbpf.pb.gz",
            "a b.wall.20261118T110640Z.clrbpf.pb.gz",
            "a+x.wall.20261118T110640Z.clrbpf.pb.gz",
            // Without the marker: another tool's, or an older clrbpf's.
            "payroll.process_cpu.20200101T000000Z.pb.gz",
            ".notes.4242.7.tmp",
        ] {
            assert!(!is_our_file(other) && !is_our_temp(other), "{other}");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn writes_one_readable_pprof_per_service_and_type() {
        let dir = tempfile::tempdir().unwrap();
        let uploader = DirectoryUploader::new(config(dir.path())).unwrap();
        let mut batch = window(1_795_000_000);
        batch
            .profiles
            .push(service_profile("billing", ProfileType::Exception));
        batch
            .profiles
            .push(service_profile("checkout", ProfileType::ProcessCpu));
        uploader.upload(Arc::new(batch.clone())).await.unwrap();
        assert_eq!(
            names(dir.path()),
            [
                "billing.exception.20261118T110640Z.clrbpf.pb.gz",
                "checkout+2.process_cpu.20261118T110640Z.clrbpf.pb.gz",
                "checkout.process_cpu.20261118T110640Z.clrbpf.pb.gz"
            ]
        );
        assert!(is_our_file(
            "checkout+2.process_cpu.20261118T110640Z.clrbpf.pb.gz"
        ));
        let pprof = read_pprof(
            &fs::read(
                dir.path()
                    .join("checkout.process_cpu.20261118T110640Z.clrbpf.pb.gz"),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            pprof.time_nanos,
            batch.start_unix_ns(),
            "window start filled in"
        );
        assert_eq!(pprof.duration_nanos, 15_000_000_000);
        assert_eq!(pprof.sample.len(), batch.profiles[0].profile.samples.len());
    }

    #[test]
    fn retention_removes_old_then_oldest_and_only_its_own_files() {
        let dir = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        let write = |name: &str, age_secs: u64, len: usize| {
            let path = dir.path().join(name);
            fs::write(&path, vec![0u8; len]).unwrap();
            let file = fs::File::options().write(true).open(&path).unwrap();
            file.set_modified(now - Duration::from_secs(age_secs))
                .unwrap();
        };
        // Whole 4 KiB blocks, so the size on disk is the length.
        write("a.process_cpu.20260101T000000Z.clrbpf.pb.gz", 7200, 4096); // too old
        write("b.process_cpu.20260101T000100Z.clrbpf.pb.gz", 1800, 4096); // oldest young
        write("c.process_cpu.20260101T000200Z.clrbpf.pb.gz", 600, 4096);
        write("d.process_cpu.20260101T000300Z.clrbpf.pb.gz", 60, 4096);
        write("user-notes.pb.gz", 99_999, 5000); // not ours: kept
        // Named like a profile of an older clrbpf or another tool: kept.
        write("payroll.process_cpu.20200101T000000Z.pb.gz", 99_999, 4096);
        // A dead writer's temporary, and one being written.
        write(".a.wall.20260101T000000Z.clrbpf.pb.gz.1.1.tmp", 7200, 10);
        write(".a.wall.20260101T000000Z.clrbpf.pb.gz.1.2.tmp", 10, 10);
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        symlink(
            &victim,
            dir.path().join("e.wall.20260101T000000Z.clrbpf.pb.gz"),
        )
        .unwrap();
        let config = DirectoryConfig {
            max_total_bytes: 9000,
            ..config(dir.path())
        };
        let opened = open_dir(dir.path()).unwrap();
        apply_retention(&opened, &config, now).unwrap();
        assert_eq!(
            names(dir.path()),
            [
                ".a.wall.20260101T000000Z.clrbpf.pb.gz.1.2.tmp",
                "c.process_cpu.20260101T000200Z.clrbpf.pb.gz",
                "d.process_cpu.20260101T000300Z.clrbpf.pb.gz",
                "e.wall.20260101T000000Z.clrbpf.pb.gz",
                "payroll.process_cpu.20200101T000000Z.pb.gz",
                "user-notes.pb.gz",
                "victim"
            ]
        );
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
    }

    #[test]
    fn a_symlink_planted_at_the_target_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let batch = window(1_795_000_000);
        let target = dir
            .path()
            .join("checkout.process_cpu.20261118T110640Z.clrbpf.pb.gz");
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        symlink(&victim, &target).unwrap();
        write_window(&config(dir.path()), &batch, SystemTime::now()).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        assert!(fs::symlink_metadata(&target).unwrap().file_type().is_file());
    }

    /// The directory swapped for a symlink between windows: the next
    /// window is refused with the reason, and nothing is written or
    /// removed where the symlink points. A directory others may read but
    /// not write is tightened; one they may write is refused.
    #[test]
    fn the_directory_itself_is_checked_every_window() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("profiles");
        let uploader = DirectoryUploader::new(config(&out)).unwrap();
        let mode = |path: &Path| fs::metadata(path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&out), 0o700, "created private");
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        let planted = elsewhere.join("payroll.process_cpu.20200101T000000Z.clrbpf.pb.gz");
        fs::write(&planted, "payroll").unwrap();
        fs::rename(&out, dir.path().join("moved")).unwrap();
        symlink(&elsewhere, &out).unwrap();
        let aged = DirectoryConfig {
            max_age: Duration::ZERO,
            ..(*uploader.config).clone()
        };
        let error = write_window(&aged, &window(1), SystemTime::now()).unwrap_err();
        let text = crate::agent::metrics::ErrorChain(&error).to_string();
        assert!(text.contains("is a symlink"), "{text}");
        assert!(!error.is_retryable());
        assert_eq!(
            names(&elsewhere),
            ["payroll.process_cpu.20200101T000000Z.clrbpf.pb.gz"]
        );

        fs::remove_file(&out).unwrap();
        fs::create_dir(&out).unwrap();
        fs::set_permissions(&out, fs::Permissions::from_mode(0o755)).unwrap();
        write_window(&config(&out), &window(1), SystemTime::now()).unwrap();
        assert_eq!(mode(&out), 0o700, "tightened");
        fs::set_permissions(&out, fs::Permissions::from_mode(0o775)).unwrap();
        let error = DirectoryUploader::new(config(&out)).unwrap_err();
        assert!(error.to_string().contains("mode 0775"), "{error}");
    }

    /// A directory that cannot be made fails the window as a final
    /// error (the queue drops and counts it), without panicking.
    #[test]
    fn write_errors_fail_the_window_without_retry() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("file"), "").unwrap();
        let impossible = DirectoryConfig {
            dir: dir.path().join("file/profiles"),
            ..config(dir.path())
        };
        let result = write_window(&impossible, &window(1), SystemTime::now());
        assert!(
            matches!(result, Err(UploadError::OutputDir { .. })),
            "{result:?}"
        );
        assert!(!result.unwrap_err().is_retryable());
    }

    /// A real full disk: a 32 KiB tmpfs (mounting needs root). Windows
    /// that do not fit are dropped and counted, nothing half-written is
    /// left, and once retention frees room the sink delivers again.
    #[test]
    #[ignore = "needs root to mount a tmpfs: run by cargo xtask test"]
    fn a_full_disk_drops_windows_and_the_sink_keeps_going() {
        use crate::agent::{
            metrics::AgentMetrics,
            queue::{DeliveryQueue, DropReason, RetryPolicy},
        };
        /// Unmounts on drop, so a failing assertion leaves no mount behind.
        struct Mount(PathBuf);
        impl Drop for Mount {
            fn drop(&mut self) {
                let _ = std::process::Command::new("umount").arg(&self.0).status();
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=32k,mode=0700", "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(status.success(), "mount a tmpfs (needs root)");
        let _mount = Mount(dir.path().to_owned());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let metrics = AgentMetrics::new();
            let counters = metrics.sink_counters("directory");
            let mut config = config(dir.path());
            let uploader = Arc::new(DirectoryUploader::new(config.clone()).unwrap());
            let queue = DeliveryQueue::spawn(uploader, RetryPolicy::default(), counters.clone());
            let big = |second: u64| {
                let mut batch = window(second);
                for service in 0..20 {
                    batch.profiles.push(service_profile(
                        &format!("svc{service}"),
                        ProfileType::ProcessCpu,
                    ));
                }
                Arc::new(batch)
            };
            for second in 0..6 {
                queue.submit(big(second * 15));
            }
            assert_eq!(queue.flush(Duration::from_secs(30)).await.abandoned, 0);
            let dropped = counters.dropped(DropReason::Rejected).get();
            assert!(dropped > 0, "the disk never filled");
            assert!(
                !names(dir.path()).iter().any(|name| name.ends_with(".tmp")),
                "{:?}",
                names(dir.path())
            );
            // A size budget below the disk's: retention makes room.
            config.max_total_bytes = 8 << 10;
            let uploader = Arc::new(DirectoryUploader::new(config).unwrap());
            let queue = DeliveryQueue::spawn(uploader, RetryPolicy::default(), counters.clone());
            let shipped = counters.shipped.get();
            queue.submit(Arc::new(window(1000)));
            queue.submit(Arc::new(window(1015)));
            assert_eq!(queue.flush(Duration::from_secs(30)).await.abandoned, 0);
            let listing: Vec<(String, u64)> = fs::read_dir(dir.path())
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    (
                        e.file_name().into_string().unwrap(),
                        e.metadata().unwrap().len(),
                    )
                })
                .collect();
            assert_eq!(
                counters.shipped.get(),
                shipped + 1,
                "the second window fits: {listing:?}"
            );
        });
    }
}
