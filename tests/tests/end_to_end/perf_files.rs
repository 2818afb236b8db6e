//! The perf maps clrbpf turns on in .NET 8 apps (EnablePerfMap over the
//! diagnostic socket) are turned off again, and their `/tmp/perf-PID.map`
//! and `/tmp/jit-PID.dump` removed, however clrbpf or the apps end:
//!
//! - an agent killed with SIGKILL (as the OOM killer does) cannot do it
//!   itself: its next start with the same `--cache-dir` does, from the
//!   ledger the killed run kept there.
//!
//! That a whole-host recording under process churn leaves no perf file of
//! an app that exited, whether the app exited before, during or after its
//! runtime answered EnablePerfMap, is checked by the churn test
//! (`churn.rs`), on its churn.

use std::{
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{Env, Runtime, TempDir, TestProcess};

/// The ledger files of the run with host pid `pid` in cache dir `cache`.
fn ledgers_of(cache: &Path, pid: u32) -> Vec<PathBuf> {
    let prefix = format!("perf-maps-{pid}-");
    fs::read_dir(cache)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix) && !n.ends_with(".lock"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether process `pid` has the file with inode (`dev`, `ino`) open: the
/// runtime holds its perf map open while perf maps are on, and closes it
/// at DisablePerfMap. (.NET 8 keeps its jitdump open and mapped even
/// then, so the jitdump tells nothing.)
fn holds_inode(pid: u32, dev: u64, ino: u64) -> bool {
    fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(Result::ok)
                .filter_map(|fd| fs::metadata(fd.path()).ok())
                .any(|m| m.dev() == dev && m.ino() == ino)
        })
        .unwrap_or(false)
}

fn wait_for(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + timeout;
    while Instant::now() < until {
        if done() {
            return true;
        }
        thread::sleep(Duration::from_millis(100));
    }
    done()
}

/// A running agent, killed if a failing test leaves it running.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `clrbpf agent` with its own cache dir, windows dir and loopback port.
fn start_agent(env: &Env, dir: &TempDir, port: u16) -> Agent {
    let child = Command::new(&env.clrbpf)
        .args(["agent", "--upload-interval", "5s", "--cache-dir"])
        .arg(dir.join("cache"))
        .arg("--output-dir")
        .arg(dir.join("windows"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start clrbpf agent");
    Agent(child)
}

/// SIGKILL: the agent has no chance to turn the app's perf maps off. The
/// next agent started with the same cache directory turns them off and
/// removes the files before it asks for perf maps itself: the runtime
/// closes the perf map the killed agent made it write (which the test
/// keeps open, so that its inode cannot be reused by the next agent's), it
/// and the jitdump are unlinked, and the killed run's ledger is consumed.
#[test]
fn a_killed_agents_perf_maps_are_turned_off_at_the_next_start() {
    let env = Env::privileged();
    let dir = TempDir::new("killed-agent");
    let cache = dir.join("cache");
    let port = 22000 + (std::process::id() % 1000) as u16;
    let app = TestProcess::start(&env, Runtime::Net8, "Hot", &["300"], false);
    let pid = app.pid();
    let jitdump = PathBuf::from(format!("/tmp/jit-{pid}.dump"));
    let perf_map = PathBuf::from(format!("/tmp/perf-{pid}.map"));

    let mut killed = start_agent(&env, &dir, port);
    let killed_pid = killed.0.id();
    assert!(
        wait_for(Duration::from_secs(60), || jitdump.exists()
            && perf_map.exists()
            && !ledgers_of(&cache, killed_pid).is_empty()),
        "the agent did not turn perf maps on in pid {pid} (and write it down in {cache:?}) within 60 s"
    );
    // The ledger names the app.
    let ledger = fs::read_to_string(&ledgers_of(&cache, killed_pid)[0]).expect("the ledger");
    assert!(
        ledger
            .lines()
            .any(|l| l.split(' ').next() == Some(&pid.to_string())),
        "the ledger does not name pid {pid}:\n{ledger}"
    );
    killed.0.kill().expect("SIGKILL the agent");
    let _ = killed.0.wait();

    let held = fs::File::open(&perf_map).expect("open the perf map");
    let held_jitdump = fs::File::open(&jitdump).expect("open the jitdump");
    let meta = held.metadata().expect("stat the perf map");
    let (dev, ino) = (meta.dev(), meta.ino());
    thread::sleep(Duration::from_secs(2));
    assert!(
        holds_inode(pid, dev, ino),
        "perf maps should still be on in pid {pid} after the agent was killed"
    );

    let mut next = start_agent(&env, &dir, port + 1);
    let unlinked = |file: &fs::File| file.metadata().is_ok_and(|m| m.nlink() == 0);
    let undone = wait_for(Duration::from_secs(60), || {
        unlinked(&held) && unlinked(&held_jitdump) && !holds_inode(pid, dev, ino)
    });
    let ledger_left = ledgers_of(&cache, killed_pid);
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(next.0.id() as libc::pid_t, libc::SIGTERM) };
    let status = next.0.wait().expect("wait for the agent");
    assert!(
        undone,
        "the next agent did not turn off and remove the perf maps the killed one left on in pid {pid} (perf map removed: {}, jitdump removed: {}, perf map still open in the app: {})",
        unlinked(&held),
        unlinked(&held_jitdump),
        holds_inode(pid, dev, ino)
    );
    assert!(
        ledger_left.is_empty(),
        "the killed run's ledger was not consumed: {ledger_left:?}"
    );
    assert!(status.success(), "the second agent exited with {status}");
    assert!(
        !jitdump.exists() && !perf_map.exists(),
        "the second agent left the perf files it made behind"
    );
    assert!(
        ledgers_of(&cache, next.0.id()).is_empty(),
        "the second agent left its ledger after a clean stop"
    );
}
