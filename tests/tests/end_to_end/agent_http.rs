//! The agent's HTTP endpoint as an attacker on the node sees it: the real
//! agent on the real kernel, real .NET 8 workloads as the other tenants,
//! clients from this test (some as uid 1000). `/debug/pprof/profile` is off
//! unless asked for, then needs its token and holds only the selected
//! processes; clients that hang up or never finish their requests hold
//! neither the agent's memory, nor its probes, nor its exit; one peer's flood
//! of connections closes only its own; `/metrics`
//! carries no exception message or command line.

use std::{
    ffi::OsStr,
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    os::unix::fs::PermissionsExt as _,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    Env, LabelValue, Runtime, TempDir, TestProcess, agent::TestAgent, assert_some_stack_contains,
    http, read_profile, samples,
};

/// `clrbpf agent --upload-interval 5s --output-dir DIR/windows ARGS...`,
/// ready (BPF attached) on return. With `open_files`, it starts under that
/// soft RLIMIT_NOFILE.
fn start_agent(env: &Env, dir: &TempDir, args: &[&OsStr], open_files: Option<u64>) -> TestAgent {
    let windows = dir.join("windows");
    let mut all: Vec<&OsStr> = vec![
        "--upload-interval".as_ref(),
        "5s".as_ref(),
        "--output-dir".as_ref(),
        windows.as_os_str(),
    ];
    all.extend_from_slice(args);
    TestAgent::start_with_open_files(env, dir, &all, open_files).wait_ready()
}

/// The agent's resident set once warm: it grows for a while after start,
/// as it learns the host's processes and symbols (by 100 MiB on a busy
/// host). Waits until it grew less than 4 MiB in 5 s (at most 60 s).
fn settled_rss_kib(agent: &TestAgent) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut history = vec![agent.rss_kib()];
    loop {
        thread::sleep(Duration::from_secs(1));
        history.push(agent.rss_kib());
        let now = history[history.len() - 1];
        let settled = history.len() > 5 && now <= history[history.len() - 6] + 4 * 1024;
        if settled || Instant::now() > deadline {
            return history.iter().copied().max().unwrap_or(now);
        }
    }
}

/// The status line of `GET path` sent by uid 1000 (bash's /dev/tcp under
/// `setpriv`): another user of the node.
fn get_as_uid_1000(port: u16, path: &str) -> String {
    let script = format!(
        "exec 3<>/dev/tcp/127.0.0.1/{port}; \
         printf 'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n' >&3; \
         head -n 1 <&3"
    );
    let output = Command::new("setpriv")
        .args(["--reuid", "1000", "--regid", "1000", "--clear-groups", "--"])
        .args(["bash", "-c", &script])
        .output()
        .expect("run bash as uid 1000");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// Pulls `seconds` with `headers` and reads the profile.
fn pull(
    port: u16,
    dir: &TempDir,
    seconds: u32,
    headers: &[(&str, &str)],
) -> clrbpf::pprof_proto::Profile {
    let (status, body) = http::get(
        port,
        &format!("/debug/pprof/profile?seconds={seconds}"),
        headers,
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let path = dir.join("pulled.pb.gz");
    fs::write(&path, &body).expect("write the pulled profile");
    read_profile(&path)
}

/// The pull endpoint is off by default (404, for root and uid 1000 alike);
/// on, it answers 401 without the token or with a wrong one, and uid 1000
/// can neither read the token nor pull; with the token, a pull holds only
/// the selected processes: under `--exe no-such-program` nothing of a
/// running .NET 8 workload (its pid, its frames), while under `--exe
/// dotnet` the same pull names its hot method.
#[test]
fn the_pull_endpoint_is_off_by_default_and_then_guarded() {
    let env = Env::privileged();
    let hot = TestProcess::start(&env, Runtime::Net8, "Hot", &["120"], false);
    let dir = TempDir::new("agent-http-pull");

    let agent = start_agent(&env, &dir, &[], None);
    let (status, _) = http::get(agent.port(), "/debug/pprof/profile?seconds=1", &[]);
    assert_eq!(status, 404, "the pull endpoint is on by default");
    assert_eq!(
        get_as_uid_1000(agent.port(), "/debug/pprof/profile?seconds=1"),
        "HTTP/1.1 404 Not Found"
    );
    assert_eq!(http::get(agent.port(), "/metrics", &[]).0, 200);
    agent.stop();

    let token_file = dir.join("token");
    fs::write(&token_file, "pull-token-0123456789\n").expect("write the token");
    fs::set_permissions(&token_file, fs::Permissions::from_mode(0o600)).expect("chmod");
    // The temporary directory is root's; uid 1000 must reach the file to be
    // refused by its mode rather than by the directory's.
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let token_args = |exe: &'static str| -> Vec<std::ffi::OsString> {
        vec![
            "--enable-pull".into(),
            "--http-token-file".into(),
            token_file.clone().into_os_string(),
            "--exe".into(),
            exe.into(),
        ]
    };
    let args = token_args("no-such-program");
    let args: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let agent = start_agent(&env, &dir, &args, None);
    let path = "/debug/pprof/profile?seconds=1";
    for headers in [
        &[][..],
        &[("Authorization", "Bearer pull-token-012345678")],
        &[("Authorization", "Bearer pull-token-0123456789x")],
        &[("Authorization", "Basic pull-token-0123456789")],
    ] {
        assert_eq!(http::get(agent.port(), path, headers).0, 401, "{headers:?}");
    }
    let read_as_uid_1000 = Command::new("setpriv")
        .args([
            "--reuid",
            "1000",
            "--regid",
            "1000",
            "--clear-groups",
            "--",
            "cat",
        ])
        .arg(&token_file)
        .output()
        .expect("run cat as uid 1000");
    assert!(
        !read_as_uid_1000.status.success(),
        "uid 1000 reads the token"
    );
    assert_eq!(
        get_as_uid_1000(agent.port(), path),
        "HTTP/1.1 401 Unauthorized"
    );
    let token = [("Authorization", "Bearer pull-token-0123456789")];
    let pulled = pull(agent.port(), &dir, 3, &token);
    agent.stop();
    assert_eq!(pulled.duration_nanos, 3_000_000_000);
    let of_hot = samples(&pulled)
        .into_iter()
        .filter(|s| s.pid() == Some(hot.pid()))
        .count();
    assert_eq!(of_hot, 0, "samples of an unselected process in the pull");
    let names: Vec<&str> = pulled
        .string_table
        .iter()
        .map(String::as_str)
        .filter(|s| s.contains("Hot.") || s.contains("Hot!"))
        .collect();
    assert!(
        names.is_empty(),
        "frames of an unselected process: {names:?}"
    );
    assert!(
        pulled.sample.is_empty(),
        "nothing is selected, yet the pull holds {} samples",
        pulled.sample.len()
    );

    // The same pull with the workload selected names it: the checks above
    // would see it.
    let args = token_args("dotnet");
    let args: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let agent = start_agent(&env, &dir, &args, None);
    let pulled = pull(agent.port(), &dir, 3, &token);
    agent.stop();
    assert_some_stack_contains(&pulled, Some(hot.pid()), &["Hot.Spin"]);
    for sample in samples(&pulled) {
        assert!(
            matches!(sample.label("process.executable.name"), Some(LabelValue::Str(e)) if e == "dotnet"),
            "a sample of another executable: {:?}",
            sample.labels
        );
    }
}

/// Clients that start a pull and hang up, hundreds of them: each pull ends
/// with its client (the agent never runs more than one,
/// `clrbpf_agent_pulls_running`), its memory stays near where it was
/// (before the fix, 600 such clients added 250-310 MiB in 20 s), and a
/// fresh pull starts at once.
#[test]
fn abandoned_pulls_end_with_their_clients() {
    let env = Env::privileged();
    let hot = TestProcess::start(&env, Runtime::Net8, "Hot", &["120"], false);
    let dir = TempDir::new("agent-http-abandoned");
    // Frame pointers only and no CLR sessions: the agent's memory then
    // moves little with what else runs on the host (other processes'
    // unwind tables and sessions), so the pulls' part stands out.
    let token_file = dir.join("token");
    fs::write(&token_file, "pull-token-0123456789\n").expect("write the token");
    fs::set_permissions(&token_file, fs::Permissions::from_mode(0o600)).expect("chmod");
    let token = [("Authorization", "Bearer pull-token-0123456789")];
    let agent = start_agent(
        &env,
        &dir,
        &[
            "--enable-pull".as_ref(),
            "--http-token-file".as_ref(),
            token_file.as_os_str(),
            "--frame-pointers-only".as_ref(),
            "--no-clr-events".as_ref(),
        ],
        None,
    );
    let before = settled_rss_kib(&agent);
    let started = Instant::now();
    let mut abandoned = 0;
    let mut most_running = 0.0f64;
    while started.elapsed() < Duration::from_secs(20) {
        if abandoned % 20 == 0 {
            most_running = most_running.max(pulls_running(agent.port()));
        }
        let mut stream = TcpStream::connect(("127.0.0.1", agent.port())).expect("connect");
        stream
            .write_all(
                b"GET /debug/pprof/profile?seconds=60 HTTP/1.1\r\nHost: x\r\n\
                  Authorization: Bearer pull-token-0123456789\r\n\r\n",
            )
            .expect("send");
        thread::sleep(Duration::from_millis(20));
        drop(stream);
        abandoned += 1;
        thread::sleep(Duration::from_millis(10));
    }
    thread::sleep(Duration::from_secs(2));
    let after = agent.rss_kib();
    let running_after = pulls_running(agent.port());
    // At once: the slot of the last abandoned pull is free.
    let pulled = pull(agent.port(), &dir, 2, &token);
    agent.stop();
    assert_some_stack_contains(&pulled, Some(hot.pid()), &["Hot.Spin"]);
    assert!(
        most_running <= 1.0 && running_after == 0.0,
        "{abandoned} abandoned pulls: up to {most_running} running at once, {running_after} after"
    );
    // The host's other processes move the agent's memory too (up to 100
    // MiB on a busy host): the bound is well below what the pulls took
    // before the fix.
    assert!(
        after <= before + 128 * 1024,
        "{abandoned} abandoned pulls took the agent from {before} KiB to {after} KiB"
    );
}

/// `clrbpf_agent_pulls_running` on the agent's `/metrics`.
fn pulls_running(port: u16) -> f64 {
    let (status, body) = http::get(port, "/metrics", &[]);
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    text.lines()
        .find_map(|l| l.strip_prefix("clrbpf_agent_pulls_running "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no clrbpf_agent_pulls_running on /metrics:\n{text}"))
}

/// Keeps `count` connections open that each sent half a request, replacing
/// those the agent closes, until `stop` is set.
fn hold_half_sent_requests(
    port: u16,
    count: usize,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<usize> {
    thread::spawn(move || {
        let mut held: Vec<TcpStream> = Vec::new();
        let mut opened = 0;
        while !stop.load(Ordering::Relaxed) {
            // Open while a read would block; closed at EOF or reset.
            held.retain(|stream| {
                let mut byte = [0u8; 1];
                let _ = stream.set_nonblocking(true);
                matches!((&*stream).read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            });
            while held.len() < count {
                let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
                    break;
                };
                let _ = stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n");
                held.push(stream);
                opened += 1;
            }
            thread::sleep(Duration::from_millis(50));
        }
        opened
    })
}

/// Raises this test process's soft RLIMIT_NOFILE to the hard limit (it
/// holds more connections than 1024).
fn raise_own_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the struct passed.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
}

/// An agent started under a soft limit of 1024 open files, and 1,100
/// half-sent requests held open against it (renewed as it closes them):
/// its limit was raised to the hard one, `/healthz` answers every probe
/// within 2 s, its descriptors stay bounded, and SIGTERM ends it within
/// its grace period and a little more.
#[test]
fn half_sent_requests_hold_neither_the_probes_nor_the_exit() {
    const GRACE: Duration = Duration::from_secs(2);
    let env = Env::privileged();
    raise_own_open_files_limit();
    let dir = TempDir::new("agent-http-slowloris");
    let agent = start_agent(
        &env,
        &dir,
        &["--grace-period".as_ref(), "2s".as_ref()],
        Some(1024),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = hold_half_sent_requests(agent.port(), 1100, Arc::clone(&stop));
    thread::sleep(Duration::from_secs(3));
    let mut most_fds = 0;
    for _ in 0..16 {
        let asked = Instant::now();
        let (status, body) =
            http::get_within(agent.port(), "/healthz", &[], Duration::from_secs(2));
        let took = asked.elapsed();
        assert!(
            status == 200 && took < Duration::from_secs(2),
            "/healthz under the flood: {status} after {took:?}: {}",
            String::from_utf8_lossy(&body)
        );
        most_fds = most_fds.max(agent.open_fds());
        thread::sleep(Duration::from_millis(500));
    }
    assert!(
        most_fds < 600,
        "the agent held {most_fds} descriptors under the flood"
    );
    let limits = fs::read_to_string(format!("/proc/{}/limits", agent.pid())).expect("limits");
    let open_files: Vec<String> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    assert_eq!(
        open_files[3], open_files[4],
        "the soft limit on open files is raised to the hard one: {open_files:?}"
    );
    let (took, _) = agent.stop_within(Duration::from_secs(90));
    stop.store(true, Ordering::Relaxed);
    let opened = attacker.join().expect("the attacker thread");
    assert!(opened >= 1100, "the flood opened only {opened} connections");
    assert!(
        took <= GRACE + Duration::from_secs(4),
        "SIGTERM took {took:?} with half-sent requests open (grace period {GRACE:?})"
    );
}

/// A connection to the agent from the loopback address `from` (another
/// peer than 127.0.0.1).
fn connect_from(from: [u8; 4], port: u16) -> TcpStream {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket
            .bind(std::net::SocketAddr::from((from, 0)))
            .expect("bind the source address");
        socket
            .connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
            .await
            .expect("connect to the agent")
    });
    let stream = stream.into_std().expect("a std stream");
    stream.set_nonblocking(false).expect("blocking");
    stream
}

/// Whether the agent closed `stream` (EOF or reset) within `within`.
fn closed_within(stream: &TcpStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).expect("timeout");
    let mut byte = [0u8; 1];
    match (&*stream).read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// One peer (127.0.0.1) opens 64 connections with half a request each
/// (under the total cap of 128): all but the newest 16 are closed at once,
/// counted on `/metrics`, while a connection from another peer (127.0.0.2)
/// opened before them stays open and is answered when it completes its
/// request.
#[test]
fn one_peer_flooding_connections_sheds_only_its_own() {
    const HALF: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\n";
    let env = Env::privileged();
    let dir = TempDir::new("agent-http-per-peer");
    let agent = start_agent(&env, &dir, &[], None);
    let mut other = connect_from([127, 0, 0, 2], agent.port());
    other
        .write_all(HALF)
        .expect("half a request from 127.0.0.2");
    let flood: Vec<TcpStream> = (0..64)
        .map(|_| {
            let mut stream = connect_from([127, 0, 0, 1], agent.port());
            stream.write_all(HALF).expect("half a request");
            stream
        })
        .collect();
    let closed = flood
        .iter()
        .filter(|stream| closed_within(stream, Duration::from_millis(100)))
        .count();
    assert_eq!(
        closed, 48,
        "of 64 connections from one peer, all but its share of 16 are closed"
    );
    other
        .write_all(b"Connection: close\r\n\r\n")
        .expect("the rest of the request from 127.0.0.2");
    other
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut reply = String::new();
    let _ = other.read_to_string(&mut reply);
    assert!(
        reply.starts_with("HTTP/1.1 200"),
        "the other peer's /healthz beside the flood: {reply:?}"
    );
    let (status, body) = http::get(agent.port(), "/metrics", &[]);
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    let shed: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("clrbpf_agent_http_connections_shed_total{cap=\"per_peer\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no per-peer shed count on /metrics:\n{text}"));
    assert!(shed >= 48.0, "{shed} connections shed for the per-peer cap");
    drop(flood);
}

/// `/metrics` while a .NET 8 workload throws exceptions with a message of
/// its own, given on its command line: the per-process series are there
/// (pid, executable), the message is in the profiles the sink writes, and
/// neither the message nor the command line is on `/metrics`.
#[test]
fn metrics_carry_no_exception_message_or_command_line() {
    const MESSAGE: &str = "canary-message-5d1f";
    const ARGUMENT: &str = "canary-argument-9c27";
    let env = Env::privileged();
    let dir = TempDir::new("agent-http-metrics");
    let agent = start_agent(&env, &dir, &[], None);
    let app = TestProcess::start(
        &env,
        Runtime::Net8,
        "Exceptions",
        &["8", "2000000", "300", "1", MESSAGE, ARGUMENT],
        false,
    );
    let pid = app.pid().to_string();
    let series = format!("dotnet_exceptions_total{{pid=\"{pid}\"");
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        let (status, body) = http::get(agent.port(), "/metrics", &[]);
        assert_eq!(status, 200);
        let text = String::from_utf8_lossy(&body).into_owned();
        let counted = text
            .lines()
            .find(|l| l.starts_with(&series))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if counted > 0.0 {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no {series} on /metrics:\n{text}"
        );
        thread::sleep(Duration::from_secs(1));
    };
    thread::sleep(Duration::from_secs(6));
    let (_, body) = http::get(agent.port(), "/metrics", &[]);
    let later = String::from_utf8_lossy(&body).into_owned();
    agent.stop();
    let dll = env.workload(Runtime::Net8, "Exceptions");
    for text in [&text, &later] {
        for needle in [MESSAGE, ARGUMENT, &*dll.to_string_lossy(), "Exceptions.dll"] {
            assert!(
                !text.contains(needle),
                "/metrics carries {needle:?}:\n{text}"
            );
        }
    }
    // The message did reach the agent: its windows carry it.
    let mut messages = 0;
    for entry in fs::read_dir(dir.join("windows")).expect("the windows") {
        let profile = read_profile(&entry.expect("an entry").path());
        messages += profile
            .string_table
            .iter()
            .filter(|s| s.starts_with(MESSAGE))
            .count();
    }
    assert!(messages > 0, "no window carries the exception message");
}
