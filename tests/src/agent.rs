//! A real `clrbpf agent` for the tests: started on a free loopback port
//! with its log in a file (a debug log would fill a pipe nobody reads),
//! stopped with SIGTERM as Kubernetes does, and killed if a failing test
//! leaves it running.

use std::{
    ffi::OsStr,
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use crate::{Env, TempDir, http};

/// A loopback port free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A `/proc/PID/status` field given in kB (`"VmRSS:"`, `"VmHWM:"`), in
/// bytes; `None` once the process is gone.
pub fn status_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

/// The last 60 lines of a log, for a failure message.
pub fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

/// A running `clrbpf agent`.
pub struct TestAgent {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl TestAgent {
    /// `clrbpf agent ARGS... --listen 127.0.0.1:PORT` on a free port, its
    /// log in `dir`.
    pub fn start(env: &Env, dir: &TempDir, args: &[&OsStr]) -> Self {
        Self::start_with_open_files(env, dir, args, None)
    }

    /// [`Self::start`] with 5 s windows written to the directory sink
    /// `windows`, then `more`: the set-up most agent tests share.
    pub fn start_with_windows(env: &Env, dir: &TempDir, windows: &Path, more: &[&OsStr]) -> Self {
        let mut args: Vec<&OsStr> = vec![
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--output-dir".as_ref(),
            windows.as_os_str(),
        ];
        args.extend_from_slice(more);
        Self::start(env, dir, &args)
    }

    /// [`Self::start`] under a soft RLIMIT_NOFILE of `open_files`.
    pub fn start_with_open_files(
        env: &Env,
        dir: &TempDir,
        args: &[&OsStr],
        open_files: Option<u64>,
    ) -> Self {
        let port = free_port();
        let log = dir.join("agent.log");
        let mut command = Command::new(&env.clrbpf);
        command
            .arg("agent")
            .args(args)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).expect("create the agent's log"));
        if let Some(soft) = open_files {
            use std::os::unix::process::CommandExt as _;
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                command.pre_exec(move || {
                    let mut limit = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: 0,
                    };
                    libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
                    limit.rlim_cur = soft.min(limit.rlim_max);
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = command.spawn().expect("start clrbpf agent");
        Self { child, port, log }
    }

    /// Returns once `/readyz` answers 200 (its BPF programs attached);
    /// panics if the agent exits first or is not ready within 60 s.
    pub fn wait_ready(mut self) -> Self {
        let deadline = Instant::now() + Duration::from_secs(60);
        while http::get_within(self.port, "/readyz", &[], Duration::from_secs(5)).0 != 200 {
            if let Some(status) = self.child.try_wait().expect("wait") {
                panic!("the agent exited {status}:\n{}", tail(&self.log()));
            }
            assert!(
                Instant::now() < deadline,
                "the agent is not ready after 60 s:\n{}",
                tail(&self.log())
            );
            thread::sleep(Duration::from_millis(200));
        }
        self
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The loopback port of its HTTP endpoint.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether it exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("wait")
    }

    /// Its `/metrics` text ("" when it did not answer).
    pub fn metrics(&self) -> String {
        let (_, body) = http::get_within(self.port, "/metrics", &[], Duration::from_secs(30));
        String::from_utf8_lossy(&body).into_owned()
    }

    /// Its resident set, in KiB.
    pub fn rss_kib(&self) -> u64 {
        status_bytes(self.pid(), "VmRSS:").expect("the agent's VmRSS") / 1024
    }

    /// Its open file descriptors.
    pub fn open_fds(&self) -> usize {
        fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .expect("the agent's fds")
            .count()
    }

    /// SIGTERM, then its exit, which must be 0 within `within`; returns
    /// how long it took and its log.
    pub fn stop_within(mut self, within: Duration) -> (Duration, String) {
        // SAFETY: kill has no memory preconditions; the pid is our child.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGTERM) };
        let stopped = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            assert!(
                stopped.elapsed() < within,
                "the agent still runs {within:?} after SIGTERM:\n{}",
                tail(&self.log())
            );
            thread::sleep(Duration::from_millis(20));
        };
        let took = stopped.elapsed();
        let log = self.log();
        assert!(status.success(), "agent exit {status}:\n{}", tail(&log));
        (took, log)
    }

    /// SIGTERM, then its exit, which must be 0 within 30 s; returns its
    /// log.
    pub fn stop(self) -> String {
        self.stop_within(Duration::from_secs(30)).1
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
