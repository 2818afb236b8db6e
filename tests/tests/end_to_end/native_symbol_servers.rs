//! Debug files of a stripped library from symbol servers (issue 35): the
//! `NativeHot` workload's C library (see `native_debug_files.rs`) named
//! through
//! 1. a real debuginfod (Debian's `debuginfod`, scanning a directory,
//!    on loopback) named in `DEBUGINFOD_URLS`;
//! 2. a static HTTP server (python's `http.server`) laid out as a
//!    Microsoft symbol store, given with `--symbol-server`;
//! 3. hostile servers: one that accepts and never answers, one that
//!    serves a file of another build id. The recording names nothing from
//!    them, ends within its bound and keeps its samples.
//!
//! One workload run, three short recordings, each with a cache directory
//! of its own. Run by `cargo xtask test` (root, one test at a time).

use std::{
    io::{Read as _, Write as _},
    net::TcpListener,
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf::symbolize::debug_file;
use clrbpf_integration_tests::{
    Env, Launch, Runtime, SampleView, TempDir, TestProcess,
    native_lib::{CALLER, ENTRY, INNER, LIBRARY, OUTER, build_split_library, place},
    read_profile, run_clrbpf, samples, summary_samples_and_lost,
};

/// A server process, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Waits until `url` answers 200 (curl), or panics after `timeout`.
fn wait_for(url: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let ok = Command::new("curl")
            .args(["-sf", "-o", "/dev/null", url])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return;
        }
        assert!(Instant::now() < deadline, "{url} never answered");
        thread::sleep(Duration::from_millis(200));
    }
}

/// A server that accepts connections and never answers.
fn never_answers() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    port
}

/// A server that answers every request with `body` (200).
fn answers_with(body: Vec<u8>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    port
}

fn weight(sample: &SampleView) -> i64 {
    sample.values.first().copied().unwrap_or(0)
}

/// `record -p PID -d 3s` with `flags` and `env`, a cache directory of its
/// own: (profile samples of `pid`, stderr, wall time).
fn record(
    env: &Env,
    dir: &TempDir,
    pid: u32,
    name: &str,
    flags: &[String],
    vars: &[(&str, &str)],
) -> (Vec<SampleView>, String, Duration) {
    let out = dir.join(&format!("{name}.pb.gz"));
    let cache = dir.join(&format!("cache-{name}"));
    let mut args: Vec<String> = ["record", "-p", &pid.to_string(), "-d", "3s", "-v"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    args.extend(["--cache-dir".to_owned(), cache.display().to_string()]);
    args.extend(flags.iter().cloned());
    args.extend(["-o".to_owned(), out.display().to_string()]);
    let started = Instant::now();
    let output = if vars.is_empty() {
        run_clrbpf(env, &args, dir.path(), Duration::from_secs(120))
    } else {
        let bin = std::env::var(clrbpf_integration_tests::ENV_BIN).expect("CLRBPF_BIN");
        Command::new(bin)
            .args(&args)
            .envs(vars.iter().copied())
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .output()
            .expect("run clrbpf")
    };
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{name}: clrbpf failed:\n{stderr}");
    let ours = samples(&read_profile(&out))
        .into_iter()
        .filter(|s| s.pid() == Some(pid))
        .collect();
    (ours, stderr, took)
}

fn named(ours: &[SampleView]) -> i64 {
    ours.iter()
        .filter(|s| s.stack_contains(&[INNER, OUTER, ENTRY, CALLER]))
        .map(weight)
        .sum()
}

#[test]
fn debug_files_come_from_debuginfod_and_a_symbol_store_and_hostile_servers_cost_nothing() {
    let env = Env::privileged();
    let dir = TempDir::new("native-servers");
    let (_lib, dbg, build_id) = build_split_library(dir.path());
    // debuginfod scans a directory holding the debug file.
    let scanned = dir.join("scanned");
    place(&dbg, &scanned, Path::new(&format!("{LIBRARY}.debug")));
    let debuginfod_port = free_port();
    let _debuginfod = Server(
        Command::new("debuginfod")
            .args(["-F", "-p", &debuginfod_port.to_string(), "-t", "1", "-d"])
            .arg(dir.join("debuginfod.sqlite"))
            .arg(&scanned)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start debuginfod (apt-get install debuginfod)"),
    );
    let debuginfod_url = format!("http://127.0.0.1:{debuginfod_port}");
    wait_for(
        &format!("{debuginfod_url}/buildid/{build_id}/debuginfo"),
        Duration::from_secs(60),
    );
    // A symbol store, served as static files.
    let store = dir.join("store");
    let [key, _] = debug_file::symbol_store_keys(LIBRARY, &build_id).expect("store keys");
    place(&dbg, &store, Path::new(&key));
    let store_port = free_port();
    let _store = Server(
        Command::new("python3")
            .args(["-m", "http.server", "--bind", "127.0.0.1"])
            .arg(store_port.to_string())
            .arg("--directory")
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start python3 -m http.server"),
    );
    let store_url = format!("http://127.0.0.1:{store_port}");
    wait_for(&format!("{store_url}/{key}"), Duration::from_secs(30));

    let lib_dir = dir.path().to_string_lossy().into_owned();
    let workload = TestProcess::launch(
        &env,
        Runtime::Net8,
        "NativeHot",
        &["60"],
        &Launch {
            env: &[("LD_LIBRARY_PATH", &lib_dir)],
            ..Launch::default()
        },
    );
    let pid = workload.pid();

    let (ours, stderr, _) = record(
        &env,
        &dir,
        pid,
        "debuginfod",
        &[],
        &[("DEBUGINFOD_URLS", &debuginfod_url)],
    );
    assert!(
        named(&ours) >= 10,
        "debuginfod: named {}\n{stderr}",
        named(&ours)
    );

    let (ours, stderr, _) = record(
        &env,
        &dir,
        pid,
        "ssqp",
        &["--symbol-server".to_owned(), store_url],
        &[],
    );
    assert!(
        named(&ours) >= 10,
        "symbol store: named {}\n{stderr}",
        named(&ours)
    );

    // Hostile: never answers, and a file of another build id.
    let silent = never_answers();
    let wrong = answers_with(std::fs::read("/proc/self/exe").expect("read a file"));
    let (ours, stderr, took) = record(
        &env,
        &dir,
        pid,
        "hostile",
        &[
            "--symbol-server".to_owned(),
            format!("http://127.0.0.1:{wrong}"),
            "--symbol-server".to_owned(),
            format!("http://127.0.0.1:{silent}"),
            "--symbol-download-wait".to_owned(),
            "4s".to_owned(),
        ],
        &[],
    );
    assert_eq!(named(&ours), 0, "nothing named from hostile servers");
    let grouped: i64 = ours
        .iter()
        .filter(|s| s.frames.iter().any(|f| f == &format!("[{LIBRARY}]")))
        .map(weight)
        .sum();
    assert!(
        grouped >= 10,
        "the samples are kept, grouped: {grouped}\n{stderr}"
    );
    assert!(
        took < Duration::from_secs(40),
        "the recording ends within its bound: {took:?}"
    );
    let (_, lost) = summary_samples_and_lost(&stderr);
    assert_eq!(lost, 0, "no samples lost to the servers:\n{stderr}");
    drop(workload);
}
