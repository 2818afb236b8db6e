//! clrbpf against a hostile local user: an unprivileged user who starts
//! processes that root then profiles. Each test here is the regression test
//! of one defect of a hostile review (issue 9), run against the real
//! runtime, the real kernel and the real binary.

use std::{
    fs,
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use clrbpf_integration_tests::{Env, Launch, Runtime, TempDir, TestProcess, record_pid};

/// The unprivileged user the hostile targets run as.
const USER: u32 = 1000;
/// A pid the target picks for itself in its own pid namespace: the one in
/// the names of root's files below (under the default `pid_max`, 32768).
const CHOSEN_PID: u32 = 31337;

/// A root-owned, root-only file with its contents and an access time far in
/// the past: any read by clrbpf would move the access time (`relatime`
/// updates an access time older than the modification time).
struct RootFile {
    path: PathBuf,
    content: String,
    accessed: SystemTime,
}

impl RootFile {
    fn plant(path: PathBuf) -> Self {
        let content = format!("root's own data in {}\n", path.display());
        let _ = fs::remove_file(&path);
        fs::write(&path, &content).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod 0600");
        std::os::unix::fs::chown(&path, Some(0), Some(0)).expect("chown root");
        let accessed = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_times(fs::FileTimes::new().set_accessed(accessed)))
            .expect("set the access time");
        Self {
            path,
            content,
            accessed,
        }
    }

    /// The file is still there, root's, unchanged and unread.
    fn assert_untouched(&self) {
        let metadata = fs::metadata(&self.path).unwrap_or_else(|e| {
            panic!(
                "{} is gone: clrbpf removed root's file for an unprivileged target ({e})",
                self.path.display()
            )
        });
        assert_eq!(metadata.uid(), 0, "{} changed owner", self.path.display());
        assert_eq!(
            fs::read_to_string(&self.path).expect("read back"),
            self.content,
            "{} changed",
            self.path.display()
        );
        assert_eq!(
            metadata.accessed().expect("atime"),
            self.accessed,
            "{} was read by clrbpf (its access time moved)",
            self.path.display()
        );
    }
}

impl Drop for RootFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

fn perf_file_names(pid: u32) -> [String; 3] {
    [
        format!("perf-{pid}.map"),
        format!("perfinfo-{pid}.map"),
        format!("jit-{pid}.dump"),
    ]
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A .NET 8 app run by uid 1000 in its own user and pid namespaces picks
/// pid 31337 for itself. Root's `/tmp/perf-31337.map` and friends, which
/// uid 1000 cannot remove from the sticky `/tmp`, must survive a recording
/// of it unread, and its managed frames stay unnamed rather than named from
/// root's file.
#[test]
fn a_target_that_picks_its_pid_cannot_make_root_read_or_remove_root_files() {
    let env = Env::privileged();
    let planted: Vec<RootFile> = perf_file_names(CHOSEN_PID)
        .into_iter()
        .map(|name| RootFile::plant(Path::new("/tmp").join(name)))
        .collect();
    let app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["30"],
        &Launch {
            user: Some(USER),
            pid_in_namespace: Some(CHOSEN_PID),
            ..Launch::default()
        },
    );
    let dir = TempDir::new("chosen-pid");
    let (output, _) = record_pid(&env, &dir, app.pid(), &["-d", "3"], "out.pb.gz");
    drop(app);
    for file in &planted {
        file.assert_untouched();
    }
    let stderr = stderr(&output);
    assert!(
        stderr.contains("left alone perf files") && stderr.contains("owned by uid 0"),
        "the summary does not say which files were left alone:\n{stderr}"
    );
}

/// A .NET 8 app run by uid 1000 with `DOTNET_PerfMapJitDumpPath` naming a
/// root-owned directory: root's files there with the app's names survive
/// unread.
#[test]
fn a_target_that_picks_its_perf_directory_cannot_make_root_read_or_remove_root_files() {
    let env = Env::privileged();
    let root_dir = TempDir::new("root-owned-perf-dir");
    let dir_path = root_dir.path().to_string_lossy().into_owned();
    let app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["30"],
        &Launch {
            user: Some(USER),
            env: &[("DOTNET_PerfMapJitDumpPath", &dir_path)],
            ..Launch::default()
        },
    );
    let planted: Vec<RootFile> = perf_file_names(app.pid())
        .into_iter()
        .map(|name| RootFile::plant(root_dir.join(&name)))
        .collect();
    let out = TempDir::new("chosen-dir");
    let (output, _) = record_pid(&env, &out, app.pid(), &["-d", "3"], "out.pb.gz");
    drop(app);
    for file in &planted {
        file.assert_untouched();
    }
    let stderr = stderr(&output);
    assert!(
        stderr.contains("left alone perf files"),
        "the summary does not say which files were left alone:\n{stderr}"
    );
}

/// The other side of the rule: a uid 1000 app's own perf files, which root
/// asked for, are read (its JIT frames are named) and removed from the
/// sticky `/tmp` as uid 1000.
#[test]
fn a_non_root_targets_own_perf_files_are_read_and_removed_as_its_user() {
    let env = Env::privileged();
    let app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["30"],
        &Launch {
            user: Some(USER),
            ..Launch::default()
        },
    );
    let pid = app.pid();
    let dir = TempDir::new("own-files");
    let (output, profile_path) = record_pid(&env, &dir, pid, &["-d", "3"], "out.pb.gz");
    let profile = clrbpf_integration_tests::read_profile(&profile_path);
    clrbpf_integration_tests::assert_some_stack_contains(&profile, Some(pid), &["Hot::Spin"]);
    for name in perf_file_names(pid) {
        let path = Path::new("/tmp").join(&name);
        assert!(
            !path.exists(),
            "{} was left behind; stderr:\n{}",
            path.display(),
            stderr(&output)
        );
    }
    drop(app);
}
