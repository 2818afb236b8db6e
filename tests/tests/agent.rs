//! `clrbpf agent` end to end: the real agent on the real kernel, a real
//! .NET 8 workload, the directory sink (the default; the Pyroscope and OTLP
//! uploaders are tested against loopback receivers in the library, since
//! no Pyroscope or collector server can be installed here), the HTTP
//! endpoint, and SIGTERM.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::PathBuf,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess, assert_some_stack_contains, read_profile,
};

/// `GET path` on the agent's endpoint: (status, body).
fn http_get(port: u16, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the agent");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Windows arrive at the interval with consecutive time ranges, named by
/// the service the process declares, with the hot method named; the
/// endpoint answers; SIGTERM ships the last window and exits 0.
#[test]
fn agent_ships_windows_per_service_and_flushes_on_sigterm() {
    let env = Env::privileged();
    let app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["60"],
        &Launch {
            env: &[("OTEL_SERVICE_NAME", "hot-service")],
            ..Launch::default()
        },
    );
    let dir = TempDir::new("agent");
    let out = dir.join("windows");
    let port = 17000 + (std::process::id() % 1000) as u16;
    let mut agent = Command::new(&env.clrbpf)
        .args(["agent", "--upload-interval", "5s", "--output-dir"])
        .arg(&out)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start clrbpf agent");
    thread::sleep(Duration::from_secs(13));
    let (health, _) = http_get(port, "/healthz");
    let (ready, _) = http_get(port, "/readyz");
    let (metrics_status, metrics) = http_get(port, "/metrics");
    // SAFETY: kill has no memory preconditions; the pid is our child.
    unsafe { libc::kill(agent.id() as libc::pid_t, libc::SIGTERM) };
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = agent.try_wait().expect("wait") {
            break status;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(30),
            "the agent still runs 30 s after SIGTERM"
        );
        thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = agent.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    assert!(status.success(), "agent exit {status}:\n{stderr}");
    assert_eq!((health, ready, metrics_status), (200, 200, 200));
    assert!(
        metrics.contains("clrbpf_agent_windows_shipped_total{sink=\"directory\"}"),
        "{metrics}"
    );

    let mut windows: Vec<PathBuf> = fs::read_dir(&out)
        .expect("the output directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("hot-service.process_cpu."))
        })
        .collect();
    windows.sort();
    assert!(
        windows.len() >= 3,
        "expected at least 3 windows of hot-service (two full, and the last on SIGTERM), got {windows:?}"
    );
    let profiles: Vec<_> = windows.iter().map(|p| read_profile(p)).collect();
    for pair in profiles.windows(2) {
        assert_eq!(
            pair[0].time_nanos + pair[0].duration_nanos,
            pair[1].time_nanos,
            "windows are not consecutive"
        );
    }
    // The full windows are 5 s, on 5 s boundaries of the wall clock.
    let full = &profiles[1];
    assert_eq!(full.duration_nanos, 5_000_000_000);
    assert_eq!(full.time_nanos % 5_000_000_000, 0);
    assert_some_stack_contains(full, Some(app.pid()), &["Hot.Spin"]);
}
