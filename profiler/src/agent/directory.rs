//! The directory sink, the default when no URL is given: every window
//! becomes one gzip pprof per service and profile type in one directory,
//! `SERVICE.TYPE.YYYYMMDDTHHMMSSZ.pb.gz` (the window start, UTC), which
//! `go tool pprof` and Pyroscope's `profilecli` read as they are.
//!
//! 1. Files are written with [`crate::export::create_output`]: a new
//!    temporary opened `O_CREAT|O_EXCL|O_NOFOLLOW`, synced, renamed into
//!    place, so no symlink planted in the directory is followed and no
//!    reader sees half a file.
//! 2. After each window, retention removes this sink's own files (the name
//!    pattern above, regular files only) older than the maximum age, then
//!    the oldest until the total fits the size budget (counted in the
//!    blocks the files take on disk).
//! 3. A write that fails (a full disk, a read-only directory) fails the
//!    window: the queue drops and counts it, the agent goes on, and the
//!    next window tries again. The part already written is removed.
//!
//! Two profiles of one service and type in one window (two processes with
//! their own labels) are `SERVICE.TYPE...` and `SERVICE+2.TYPE...`.
//!
//! Service names are made safe for a file name: characters other than
//! ASCII letters, digits, `-` and `_` become `_`, at most 100 of them.

use std::{
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use super::{BoxFuture, ProfileType, UploadError, WindowBatch, WindowUploader};
use crate::export::{ExportError, create_output, write_pprof};

/// The file-name suffix of every profile this sink writes.
const SUFFIX: &str = ".pb.gz";
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
    /// Creates the directory if needed (mode 0755, parents included).
    pub fn new(config: DirectoryConfig) -> Result<Self, std::io::Error> {
        fs::create_dir_all(&config.dir)?;
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

/// Writes every profile of `batch`, then applies retention as of `now`.
/// The first failure fails the window (the files already written stay).
fn write_window(
    config: &DirectoryConfig,
    batch: &WindowBatch,
    now: SystemTime,
) -> Result<(), UploadError> {
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
        let path = config.dir.join(name);
        let written = write_file(&path, &batch.timed(&profile.profile));
        if let Err(source) = written {
            result = Err(UploadError::Write { path, source });
            break;
        }
    }
    // Retention runs even after a failure: a full disk is what it fixes.
    if let Err(error) = apply_retention(config, now) {
        tracing::warn!(dir = %config.dir.display(), %error, "retention failed");
    }
    result
}

fn write_file(path: &Path, profile: &crate::profile::Profile) -> Result<(), ExportError> {
    let mut output = create_output(path, None)?;
    write_pprof(profile, &mut output).map_err(|error| match error {
        ExportError::Write { source, .. } => ExportError::WriteOutput {
            path: path.to_owned(),
            source,
        },
        error => error,
    })?;
    output.commit()
}

/// `SERVICE.TYPE.STAMP.pb.gz`.
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
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "unknown".to_owned()
    } else {
        name
    }
}

/// Whether `name` is a file this sink wrote: `SERVICE.TYPE.STAMP.pb.gz`.
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
    stamp.len() == STAMP_LEN
        && stamp.ends_with('Z')
        && stamp.as_bytes().get(8) == Some(&b'T')
        && ProfileType::ALL.iter().any(|t| t.name() == profile_type)
        && !service.is_empty()
        && !service.starts_with('.')
}

/// Removes this sink's files past the age limit, then the oldest while the
/// total is above the size budget. Other files are never touched; a file
/// that vanished meanwhile is fine.
fn apply_retention(config: &DirectoryConfig, now: SystemTime) -> std::io::Result<()> {
    let mut files = Vec::new();
    for entry in fs::read_dir(&config.dir)? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !is_our_file(name) {
            continue;
        }
        // DirEntry::metadata does not follow symlinks.
        let Ok(metadata) = entry.metadata() else {
            continue;
        };
        if !metadata.file_type().is_file() {
            continue;
        }
        let modified = metadata.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        // What the file takes on disk (whole blocks), which is what fills it.
        let size = metadata.len().max(metadata.blocks().saturating_mul(512));
        files.push((modified, name.to_owned(), size));
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
        match fs::remove_file(config.dir.join(&name)) {
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
    use std::os::unix::fs::symlink;

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
        assert_eq!(name, "___etc_passwd_svc.lock.20261118T110640Z.pb.gz");
        assert!(is_our_file(&name));
        assert_eq!(
            file_name("", ProfileType::ProcessCpu, &stamp),
            "unknown.process_cpu.20261118T110640Z.pb.gz"
        );
        for other in [
            "notes.txt",
            "a.process_cpu.pb.gz",
            "a.bogus.20261118T110640Z.pb.gz",
            "a.wall.2026111808064Z.pb.gz",
            ".process_cpu.20261118T110640Z.pb.gz",
        ] {
            assert!(!is_our_file(other), "{other}");
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
                "billing.exception.20261118T110640Z.pb.gz",
                "checkout+2.process_cpu.20261118T110640Z.pb.gz",
                "checkout.process_cpu.20261118T110640Z.pb.gz"
            ]
        );
        assert!(is_our_file("checkout+2.process_cpu.20261118T110640Z.pb.gz"));
        let pprof = read_pprof(
            &fs::read(
                dir.path()
                    .join("checkout.process_cpu.20261118T110640Z.pb.gz"),
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
        write("a.process_cpu.20260101T000000Z.pb.gz", 7200, 4096); // too old
        write("b.process_cpu.20260101T000100Z.pb.gz", 1800, 4096); // oldest young
        write("c.process_cpu.20260101T000200Z.pb.gz", 600, 4096);
        write("d.process_cpu.20260101T000300Z.pb.gz", 60, 4096);
        write("user-notes.pb.gz", 99_999, 5000); // not ours: kept
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        symlink(&victim, dir.path().join("e.wall.20260101T000000Z.pb.gz")).unwrap();
        let config = DirectoryConfig {
            max_total_bytes: 9000,
            ..config(dir.path())
        };
        apply_retention(&config, now).unwrap();
        assert_eq!(
            names(dir.path()),
            [
                "c.process_cpu.20260101T000200Z.pb.gz",
                "d.process_cpu.20260101T000300Z.pb.gz",
                "e.wall.20260101T000000Z.pb.gz",
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
            .join("checkout.process_cpu.20261118T110640Z.pb.gz");
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        symlink(&victim, &target).unwrap();
        write_window(&config(dir.path()), &batch, SystemTime::now()).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        assert!(fs::symlink_metadata(&target).unwrap().file_type().is_file());
    }

    /// A directory that cannot take files fails the window as a final
    /// write error (the queue drops and counts it), without panicking.
    #[test]
    fn write_errors_fail_the_window_without_retry() {
        let dir = tempfile::tempdir().unwrap();
        let missing = DirectoryConfig {
            dir: dir.path().join("gone"),
            ..config(dir.path())
        };
        let result = write_window(&missing, &window(1), SystemTime::now());
        assert!(
            matches!(result, Err(UploadError::Write { .. })),
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
            ProfileSink as _,
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
            .args(["-t", "tmpfs", "-o", "size=32k", "tmpfs"])
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
