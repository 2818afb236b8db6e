//! A pid reused after a lost exit event (issue 33, defect 8): the real
//! kernel's ring, really full, a real .NET 8 app in a containerd-style
//! cgroup as uid 65534, and another uid-65534 process under its pid.
//!
//! clrbpf is stopped (SIGSTOP: a main loop that fell behind, as a costly
//! tenant once made it) while two busy shells fill the 8 MiB ring at
//! `-F 999` (and 400 short processes its last bytes); the app exits then,
//! its exit event lost to the full ring, and
//! a shell is started under its pid (the test steers the pid with
//! `ns_last_pid`; an unprivileged user gets the same by forking until the
//! pid comes round). Its exec event is lost too. After SIGCONT the shell's
//! samples must carry none of the app's labels, and no frame named from
//! the app's tables, memory reader or stack copies.
//!
//! Before (pid, start time), the shell's samples were the app's: its
//! `container.id` and `process.executable.name=dotnet`. With the old entry
//! ended at once at a check, the app's own samples still in the ring were
//! taken for the shell's.

use std::{
    fs,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    BusyShell, ContainerTarget, Env, LabelValue, Runtime, TempDir, read_profile, samples,
    start_whole_host_recording, summary_samples_and_lost,
};

/// A busy shell as uid 65534 under host pid `pid`, or `None` when other
/// processes of the host kept taking it.
fn busy_shell_at(pid: u32) -> Option<Child> {
    // The app's pid is free once its namespace's parent has reaped it.
    let waiting = Instant::now();
    while fs::metadata(format!("/proc/{pid}")).is_ok() && waiting.elapsed() < Duration::from_secs(5)
    {
        thread::sleep(Duration::from_millis(10));
    }
    for _ in 0..200 {
        fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("write ns_last_pid (root)");
        let mut child = Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .args(["--", "sh", "-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .expect("start a shell");
        if child.id() == pid {
            return Some(child);
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    None
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

fn label_str<'a>(sample: &'a clrbpf_integration_tests::SampleView, key: &str) -> Option<&'a str> {
    match sample.label(key) {
        Some(LabelValue::Str(value)) => Some(value),
        _ => None,
    }
}

#[test]
fn a_pid_reused_after_a_lost_exit_gets_nothing_of_the_old_process() {
    let env = Env::privileged();
    let dir = TempDir::new("pid-reuse");
    let out = dir.join("out.pb.gz");
    let log = dir.join("record.log");
    let app = ContainerTarget::start(&env, Runtime::Net8, "Hot", &["120"], 65534);
    let (pid, container_id) = (app.pid(), app.container_id.clone());
    let _fill = [BusyShell::start(), BusyShell::start()];
    let mut clrbpf = start_whole_host_recording(&env, &["-F", "999"], &out, &log);
    // The app is learnt, attached to and named.
    thread::sleep(Duration::from_secs(8));
    signal(clrbpf.id(), libc::SIGSTOP);
    // 2 KiB a sample, 2,000 a second: the ring is full in about 2 s. The
    // whole stop is shorter than the 5 s between clrbpf's own checks.
    thread::sleep(Duration::from_millis(3500));
    // A sample no longer fits, but a 32-byte exit might: short processes'
    // exits and execs (a churning host's) take the last bytes.
    let churn = Command::new("sh")
        .args(["-c", "for i in $(seq 400); do /bin/true; done"])
        .status()
        .expect("run short processes");
    assert!(churn.success());
    drop(app);
    let shell = busy_shell_at(pid);
    thread::sleep(Duration::from_millis(300));
    signal(clrbpf.id(), libc::SIGCONT);
    let Some(mut shell) = shell else {
        signal(clrbpf.id(), libc::SIGKILL);
        let _ = clrbpf.wait();
        panic!("pid {pid} was not free again within 200 tries");
    };
    thread::sleep(Duration::from_secs(10));
    signal(clrbpf.id(), libc::SIGINT);
    let asked = Instant::now();
    while clrbpf.try_wait().expect("clrbpf's status").is_none() {
        if asked.elapsed() > Duration::from_secs(30) {
            let _ = clrbpf.kill();
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    let _ = shell.kill();
    let _ = shell.wait();
    let stderr = fs::read_to_string(&log).expect("read clrbpf's log");
    assert!(clrbpf.wait().expect("status").success(), "{stderr}");
    let (_, lost) = summary_samples_and_lost(&stderr);
    assert!(lost > 0, "the ring never filled:\n{stderr}");

    let all: Vec<_> = samples(&read_profile(&out))
        .into_iter()
        .filter(|s| s.pid() == Some(pid))
        .collect();
    let (shell_samples, app_samples): (Vec<_>, Vec<_>) = all
        .into_iter()
        .partition(|s| label_str(s, "thread.name") == Some("sh"));
    assert!(!app_samples.is_empty(), "no sample of the app:\n{stderr}");
    // Those still in the ring when clrbpf went on are the app's too, not
    // the shell's (ending the old entry at once would give them away).
    let relabelled = app_samples
        .iter()
        .filter(|s| {
            label_str(s, "container.id") != Some(container_id.as_str())
                || label_str(s, "process.executable.name") != Some("dotnet")
        })
        .count();
    assert_eq!(
        relabelled,
        0,
        "{relabelled} of the app's {} samples lack its container id or executable name:\n{stderr}",
        app_samples.len()
    );
    assert!(
        shell_samples.len() > 20,
        "{} samples of the shell under pid {pid}:\n{stderr}",
        shell_samples.len()
    );
    let borrowed: Vec<String> = shell_samples
        .iter()
        .filter_map(|s| {
            let exe = label_str(s, "process.executable.name");
            let container = label_str(s, "container.id");
            let app_frame = s.frames.iter().find(|f| {
                ["Hot.", "System.", "libcoreclr", "libclrjit", "dotnet"]
                    .iter()
                    .any(|n| f.contains(n))
            });
            (exe == Some("dotnet") || container.is_some() || app_frame.is_some())
                .then(|| format!("exe {exe:?}, container {container:?}, frame {app_frame:?}"))
        })
        .collect();
    assert!(
        borrowed.is_empty(),
        "{} of {} samples of the shell under the app's old pid carry the app's labels or frames, e.g. {}:\n{stderr}",
        borrowed.len(),
        shell_samples.len(),
        borrowed[0]
    );
    let events_lost = stderr
        .lines()
        .find(|l| l.contains("process exits and execs lost"))
        .unwrap_or_else(|| panic!("no process event was lost:\n{stderr}"));
    eprintln!(
        "{} samples of the shell, {} of the app under pid {pid}; {lost} samples lost; {events_lost}",
        shell_samples.len(),
        app_samples.len(),
    );
}
