//! `clrbpf agent` on a node it shares with other users: the real agent on
//! the real kernel, real .NET 8 workloads, and sinks that misbehave or are
//! tampered with. Pyroscope and an OpenTelemetry collector cannot be
//! installed here: loopback fakes stand in for them, answering what the
//! test needs (an endless answer, a huge error) and decoding what they get
//! with the published message types.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    ContainerTarget, Env, Launch, Runtime, TempDir, TestProcess,
    agent::{TestAgent, free_port, status_bytes, tail},
    http::{self, Answer, Backend},
    read_profile, samples,
};
use prost::Message as _;

/// The value of a series in a `/metrics` text, 0 when absent.
fn metric_or_0(metrics: &str, name: &str, labels: &str) -> f64 {
    http::metric(metrics, name, labels).unwrap_or(0.0)
}

const PUSH_PATH: &str = "/push.v1.pusherservice/push";
const OTLP_PATH: &str = "/v1development/profiles";

/// An OTLP receiver that answers 200 with an endless chunked body and a
/// Pyroscope that answers 500 with a terabyte: the agent reads the start
/// of each (64 KiB), hangs up, and goes on shipping, its memory bounded.
#[test]
fn backends_that_answer_without_end_cost_the_agent_no_memory() {
    let env = Env::privileged();
    let _app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["60"],
        &Launch {
            env: &[("OTEL_SERVICE_NAME", "hot-service")],
            ..Launch::default()
        },
    );
    let backend = Backend::start(|path| {
        if path == OTLP_PATH {
            Answer::EndlessOk
        } else {
            Answer::HugeError
        }
    });
    let dir = TempDir::new("agent-endless");
    let url = backend.url();
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--log-level".as_ref(),
            "warn".as_ref(),
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--pyroscope-url".as_ref(),
            url.as_ref(),
            "--otlp-url".as_ref(),
            url.as_ref(),
        ],
    );
    // The agent's RSS through four windows. On a busy host it moves by
    // hundreds of MiB with what the other processes make it symbolize, so
    // the bound is loose: below the 3.26 GiB an endless answer once took
    // it to (a runaway read fails the test at once, and the agent is
    // killed before it takes the host's memory). The exact measure is
    // what the backends got out to it, below.
    let started = Instant::now();
    let mut peak = 0;
    while started.elapsed() < Duration::from_secs(24) {
        thread::sleep(Duration::from_millis(250));
        peak = peak.max(status_bytes(agent.pid(), "VmRSS:").expect("the agent's VmRSS"));
        assert!(peak < 3 << 30, "the agent's RSS reached {} MiB", peak >> 20);
    }
    let metrics = agent.metrics();
    let log = agent.stop();
    let requests = backend.take();

    let otlp_shipped = metric_or_0(
        &metrics,
        "clrbpf_agent_windows_shipped_total",
        "{sink=\"otlp\"}",
    );
    assert!(
        otlp_shipped >= 3.0,
        "{otlp_shipped} windows shipped over OTLP in 24 s:\n{metrics}\n{}",
        tail(&log)
    );
    let pyroscope_failed = metric_or_0(
        &metrics,
        "clrbpf_agent_window_upload_failures_total",
        "{sink=\"pyroscope\"}",
    );
    assert!(pyroscope_failed >= 3.0, "{pyroscope_failed} failed pushes");
    assert!(
        log.contains("answered HTTP 500: xxxx"),
        "the error's start is logged:\n{}",
        tail(&log)
    );
    assert!(
        log.contains("longer than 64 KiB"),
        "the endless answer is logged:\n{}",
        tail(&log)
    );
    // The agent hung up after the start of each answer: what the fake got
    // out is what sat in the socket buffers, not gigabytes.
    for request in &requests {
        assert!(
            request.answered_bytes < 32 << 20,
            "{} bytes sent to the agent on {}",
            request.answered_bytes,
            request.path
        );
    }
    let sent: u64 = requests.iter().map(|r| r.answered_bytes).sum();
    println!(
        "agent RSS at most {} MiB; {} requests, {} KiB of answers sent to it",
        peak >> 20,
        requests.len(),
        sent >> 10
    );
}

/// Another user swaps the output directory for a symlink to a root-only
/// directory that holds a file named like a profile: the agent writes
/// nothing there and removes nothing, says why in its log, and refuses to
/// start on such a path.
#[test]
fn an_output_dir_swapped_for_a_symlink_is_refused() {
    let env = Env::privileged();
    let _app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["60"],
        &Launch {
            env: &[("OTEL_SERVICE_NAME", "hot-service")],
            ..Launch::default()
        },
    );
    let dir = TempDir::new("agent-swapped-dir");
    // uid 1000 owns the parent, root the rest.
    let shared = dir.join("shared");
    fs::create_dir(&shared).expect("mkdir");
    std::os::unix::fs::chown(&shared, Some(1000), Some(1000)).expect("chown");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let secret = dir.join("root-only");
    fs::create_dir(&secret).expect("mkdir");
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o700)).expect("chmod");
    // Sorted, as the listing below is.
    let planted = [
        "payroll.process_cpu.20200101T000000Z.clrbpf.pb.gz",
        "payroll.process_cpu.20200101T000000Z.pb.gz",
    ];
    for name in planted {
        let path = secret.join(name);
        fs::write(&path, "root's").expect("write");
        let old = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_577_836_800);
        fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(old))
            .expect("age it");
    }
    let out = shared.join("profiles");
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--log-level".as_ref(),
            "warn".as_ref(),
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--retention".as_ref(),
            "1m".as_ref(),
            "--output-dir".as_ref(),
            out.as_os_str(),
        ],
    );
    let written = Instant::now();
    while fs::read_dir(&out).map_or(0, |d| d.count()) == 0 {
        assert!(
            written.elapsed() < Duration::from_secs(20),
            "no window written:\n{}",
            tail(&agent.log())
        );
        thread::sleep(Duration::from_millis(200));
    }
    let mode = fs::metadata(&out).expect("the output dir").mode() & 0o7777;
    assert_eq!(mode, 0o700, "created private");
    // As uid 1000: the directory moved away, a symlink in its place.
    let swap = Command::new("setpriv")
        .args(["--reuid", "1000", "--regid", "1000", "--clear-groups", "--"])
        .args([
            "sh",
            "-c",
            "mv \"$1\" \"$1.old\" && ln -s \"$2\" \"$1\"",
            "sh",
        ])
        .arg(&out)
        .arg(&secret)
        .status()
        .expect("run setpriv");
    assert!(swap.success(), "uid 1000 could not swap the directory");
    thread::sleep(Duration::from_secs(12));
    let metrics = agent.metrics();
    let log = agent.stop();

    let mut names: Vec<String> = fs::read_dir(&secret)
        .expect("the root-only dir")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    assert_eq!(names, planted, "written or removed through the symlink");
    assert!(
        log.contains("is a symlink: it must be a directory owned by uid 0 with mode 0700"),
        "no clear error:\n{}",
        tail(&log)
    );
    let refused = metric_or_0(
        &metrics,
        "clrbpf_agent_windows_dropped_total",
        "{sink=\"directory\",reason=\"rejected\"}",
    );
    assert!(refused >= 1.0, "no window refused:\n{metrics}");

    // A new agent on that path does not start.
    let output = Command::new(&env.clrbpf)
        .args(["agent", "--output-dir"])
        .arg(&out)
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .stdin(Stdio::null())
        .output()
        .expect("run clrbpf agent");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "started on a symlink:\n{stderr}");
    assert!(
        stderr.contains("--output-dir") && stderr.contains("is a symlink"),
        "{stderr}"
    );
}

/// Retention removes the agent's own files only: a file someone else put
/// in the output directory under a profile's name, older than the
/// retention age, is still there after several windows.
#[test]
fn retention_spares_a_foreign_file_named_like_a_profile() {
    let env = Env::privileged();
    let _app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["60"],
        &Launch {
            env: &[("OTEL_SERVICE_NAME", "payroll")],
            ..Launch::default()
        },
    );
    let dir = TempDir::new("agent-foreign-file");
    let out = dir.join("profiles");
    fs::create_dir(&out).expect("mkdir");
    fs::set_permissions(&out, fs::Permissions::from_mode(0o700)).expect("chmod");
    let foreign = out.join("payroll.process_cpu.20200101T000000Z.pb.gz");
    fs::write(&foreign, "root's own").expect("write");
    fs::File::options()
        .write(true)
        .open(&foreign)
        .and_then(|f| {
            f.set_modified(std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_577_836_800))
        })
        .expect("age it");
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--log-level".as_ref(),
            "warn".as_ref(),
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--retention".as_ref(),
            "1m".as_ref(),
            "--output-dir".as_ref(),
            out.as_os_str(),
        ],
    );
    thread::sleep(Duration::from_secs(13));
    let log = agent.stop();
    assert_eq!(
        fs::read_to_string(&foreign).ok().as_deref(),
        Some("root's own"),
        "retention removed a file it did not write:\n{}",
        tail(&log)
    );
    let ours = fs::read_dir(&out)
        .expect("the output dir")
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("payroll.process_cpu.") && name.ends_with(".clrbpf.pb.gz")
        })
        .count();
    assert!(ours >= 2, "the agent wrote {ours} windows of payroll");
}

/// A token in a sink URL's userinfo never reaches the debug log (errors
/// with the URL print it redacted), and the series pushed carry no pid or
/// container id (those stay sample labels inside the profile).
#[test]
fn sink_credentials_stay_out_of_the_log_and_pids_out_of_series_names() {
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
    let backend = Backend::start(|_| Answer::Status(200));
    let dir = TempDir::new("agent-secrets");
    let pyroscope = format!(
        "http://grafana:glc_pyroscope_secret@127.0.0.1:{}",
        backend.port()
    );
    // Nothing listens there: every upload fails and is logged with the URL.
    let otlp = format!("http://glc_otlp_secret@127.0.0.1:{}", free_port());
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--log-level".as_ref(),
            "debug".as_ref(),
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--pyroscope-url".as_ref(),
            pyroscope.as_ref(),
            "--otlp-url".as_ref(),
            otlp.as_ref(),
        ],
    );
    thread::sleep(Duration::from_secs(13));
    let log = agent.stop();
    assert!(
        !log.contains("glc_"),
        "a credential in the log: {}",
        log.lines().find(|l| l.contains("glc_")).unwrap_or_default()
    );
    assert!(
        log.contains("cannot reach otlp at http://[redacted]@127.0.0.1:"),
        "the failing URL is not named:\n{}",
        tail(&log)
    );

    let pushes: Vec<_> = backend
        .take()
        .into_iter()
        .filter(|r| r.path == PUSH_PATH)
        .collect();
    assert!(pushes.len() >= 2, "{} pushes", pushes.len());
    let mut hot_series = 0;
    let mut hot_pid_in_samples = false;
    for push in &pushes {
        let request = clrbpf::pyroscope_proto::push::v1::PushRequest::decode(push.body.as_slice())
            .expect("a PushRequest");
        for series in &request.series {
            let labels: BTreeMap<&str, &str> = series
                .labels
                .iter()
                .map(|l| (l.name.as_str(), l.value.as_str()))
                .collect();
            for name in ["process_pid", "container_id", "process_executable_path"] {
                assert!(
                    !labels.contains_key(name),
                    "{name} names a series: {labels:?}"
                );
            }
            if labels.get("service_name") != Some(&"hot-service") {
                continue;
            }
            hot_series += 1;
            for sample in &series.samples {
                let profile = clrbpf::pprof_proto::Profile::decode(
                    http::gunzip(&sample.raw_profile).as_slice(),
                )
                .expect("a pprof profile");
                hot_pid_in_samples |= samples(&profile).iter().any(|s| s.pid() == Some(app.pid()));
            }
        }
    }
    assert!(hot_series > 0, "no series of hot-service");
    assert!(hot_pid_in_samples, "the pid is gone from the samples too");
    assert!(
        pushes.iter().all(|p| !p.gzip),
        "Pyroscope pushes are not gzip'd"
    );
}

/// Processes choose their own service names: over `--max-services` in a
/// window, the rest share one overflow service, counted and warned about.
/// Each process is told once, at info level, that wait-handle events need
/// .NET 9.
#[test]
fn services_per_window_are_capped_and_the_wait_handle_limit_said_once() {
    let env = Env::privileged();
    let dir = TempDir::new("agent-service-cap");
    let out = dir.join("profiles");
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--log-level".as_ref(),
            "info".as_ref(),
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--max-services".as_ref(),
            "3".as_ref(),
            "--exe".as_ref(),
            "dotnet".as_ref(),
            "--output-dir".as_ref(),
            out.as_os_str(),
        ],
    );
    thread::sleep(Duration::from_secs(2));
    let names: Vec<String> = (1..=8).map(|i| format!("flood-{i}")).collect();
    let apps: Vec<TestProcess> = names
        .iter()
        .map(|name| {
            TestProcess::launch(
                &env,
                Runtime::Net8,
                "Hot",
                &["14"],
                &Launch {
                    env: &[("OTEL_SERVICE_NAME", name)],
                    ..Launch::default()
                },
            )
        })
        .collect();
    let pids: BTreeSet<u32> = apps.iter().map(TestProcess::pid).collect();
    thread::sleep(Duration::from_secs(16));
    let metrics = agent.metrics();
    let log = agent.stop();

    // Services per window, from the file names (SERVICE[+N].TYPE.STAMP...).
    let mut by_window: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut seen_pids = BTreeSet::new();
    for entry in fs::read_dir(&out).expect("the output dir") {
        let path = entry.expect("an entry").path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let parts: Vec<&str> = name.split('.').collect();
        let [service, _, stamp, "clrbpf", "pb", "gz"] = parts[..] else {
            panic!("unexpected file {name}");
        };
        let service = service.split('+').next().unwrap_or(service).to_owned();
        by_window
            .entry(stamp.to_owned())
            .or_default()
            .insert(service);
        seen_pids.extend(samples(&read_profile(&path)).iter().filter_map(|s| s.pid()));
    }
    assert!(by_window.len() >= 3, "{by_window:?}");
    for (stamp, services) in &by_window {
        assert!(services.len() <= 3, "window {stamp}: {services:?}");
    }
    assert!(
        by_window.values().any(|s| s.contains("clrbpf-overflow")),
        "no overflow service: {by_window:?}"
    );
    assert!(
        pids.is_subset(&seen_pids),
        "samples lost: {pids:?} not all in {seen_pids:?}"
    );
    assert!(
        metric_or_0(&metrics, "clrbpf_agent_services_over_cap_total", "") >= 1.0,
        "{metrics}"
    );
    assert!(
        log.contains("more services in this window than --max-services"),
        "{}",
        tail(&log)
    );
    for pid in &pids {
        let said: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!("pid {pid}: wait-handle events need .NET 9+")))
            .collect();
        assert_eq!(said.len(), 1, "pid {pid}: {said:?}");
        assert!(said[0].contains("INFO"), "{}", said[0]);
    }
    drop(apps);
}

/// `--exe dotnet` ships what it shipped before, the selected .NET
/// process's samples with their frames named, and names nothing of the
/// other processes: a shell burning CPU beside it is sampled (the kernel
/// samples every process), but its samples are counted as
/// `clrbpf_agent_samples_total{kind="not_selected"}` and dropped before
/// naming. Before, every process's stacks were named each window and
/// only then left out by the sinks.
#[test]
fn processes_outside_the_selection_are_counted_and_never_named() {
    let env = Env::privileged();
    let dir = TempDir::new("agent-exe-selection");
    let out = dir.join("profiles");
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--exe".as_ref(),
            "dotnet".as_ref(),
            "--output-dir".as_ref(),
            out.as_os_str(),
        ],
    )
    .wait_ready();
    let app = TestProcess::launch(&env, Runtime::Net8, "Hot", &["14"], &Launch::default());
    let mut burner = Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .stdin(Stdio::null())
        .spawn()
        .expect("start a shell loop");
    thread::sleep(Duration::from_secs(13));
    let metrics = agent.metrics();
    let _ = burner.kill();
    let _ = burner.wait();
    let log = agent.stop();

    let all = metric_or_0(&metrics, "clrbpf_agent_samples_total", "{kind=\"all\"}");
    let not_selected = metric_or_0(
        &metrics,
        "clrbpf_agent_samples_total",
        "{kind=\"not_selected\"}",
    );
    eprintln!("agent-exe-selection: {not_selected} of {all} samples not selected");
    // The shell alone is on a CPU for most of 13 s at 19 Hz.
    assert!(
        not_selected >= 20.0,
        "the unselected samples were not counted apart:\n{metrics}\n{}",
        tail(&log)
    );
    assert!(not_selected < all, "{metrics}");
    let (pids, hot_named) = shipped(&out, app.pid());
    assert!(
        !pids.contains(&burner.id()),
        "the shell's samples were shipped: {pids:?}"
    );
    assert!(
        pids.contains(&app.pid()),
        "the .NET process is not in the profiles: {pids:?}"
    );
    assert!(hot_named > 0, "Hot.Spin is not named in the profiles");
    drop(app);
}

/// The pids the windows in `out` hold samples of, and how many samples of
/// `hot` name `Hot.Spin`.
fn shipped(out: &std::path::Path, hot: u32) -> (BTreeSet<u32>, usize) {
    let (mut pids, mut named) = (BTreeSet::new(), 0usize);
    for entry in fs::read_dir(out).expect("the output dir") {
        let path = entry.expect("an entry").path();
        for sample in samples(&read_profile(&path)) {
            pids.extend(sample.pid());
            named += usize::from(sample.pid() == Some(hot) && sample.stack_contains(&["Hot.Spin"]));
        }
    }
    (pids, named)
}

/// A .NET process outside the selection is left alone: the agent asks its
/// runtime nothing (no perf map or jitdump turned on, no EventPipe session,
/// no `dotnet_*` series), while the one selected, by its container, is
/// named and has its series.
#[test]
fn a_dotnet_process_outside_the_selection_is_left_alone() {
    let env = Env::privileged();
    let dir = TempDir::new("agent-container-selection");
    let out = dir.join("profiles");
    let selected = ContainerTarget::start(&env, Runtime::Net8, "Hot", &["16"], 1000);
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--container-id".as_ref(),
            selected.container_id.as_ref(),
            "--output-dir".as_ref(),
            out.as_os_str(),
        ],
    )
    .wait_ready();
    // Without `DOTNET_PerfMapEnabled`: only an attaching profiler writes
    // its perf map and jitdump.
    let other = TestProcess::launch(&env, Runtime::Net8, "Hot", &["14"], &Launch::default());
    thread::sleep(Duration::from_secs(12));
    let metrics = agent.metrics();
    let written: Vec<_> = [
        format!("/tmp/perf-{}.map", other.pid()),
        format!("/tmp/jit-{}.dump", other.pid()),
    ]
    .into_iter()
    .filter(|path| fs::metadata(path).is_ok())
    .collect();
    let log = agent.stop();

    let has_series = |pid: u32| {
        metrics
            .lines()
            .any(|l| l.starts_with("dotnet_") && l.contains(&format!("pid=\"{pid}\"")))
    };
    assert!(
        has_series(selected.pid()),
        "the selected process has no dotnet_* series:\n{metrics}\n{}",
        tail(&log)
    );
    assert!(
        !has_series(other.pid()),
        "the unselected process has dotnet_* series:\n{metrics}"
    );
    assert!(
        written.is_empty(),
        "the unselected process's runtime was asked to write {written:?}"
    );
    let (pids, named) = shipped(&out, selected.pid());
    assert!(
        !pids.contains(&other.pid()),
        "the unselected process was shipped: {pids:?}"
    );
    assert!(
        named > 0,
        "Hot.Spin of the selected process is not named: {pids:?}"
    );
}
