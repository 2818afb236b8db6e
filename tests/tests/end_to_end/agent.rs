//! `clrbpf agent` end to end: the real agent on the real kernel, a real
//! .NET 8 workload, the directory sink (the default; the Pyroscope and OTLP
//! uploaders are tested against loopback receivers in the library, since
//! no Pyroscope or collector server can be installed here), the HTTP
//! endpoint, and SIGTERM.

use std::{
    fs,
    io::Write as _,
    os::unix::fs::PermissionsExt as _,
    path::PathBuf,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess,
    agent::TestAgent,
    assert_some_stack_contains,
    http::{self, Answer, Backend},
    read_profile, samples, value_index,
};
use prost::Message as _;

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
    let agent = TestAgent::start_with_windows(&env, &dir, &out, &[]);
    let port = agent.port();
    thread::sleep(Duration::from_secs(13));
    let (health, _) = http::get_text(port, "/healthz");
    let (ready, _) = http::get_text(port, "/readyz");
    let (metrics_status, metrics) = http::get_text(port, "/metrics");
    agent.stop();
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

/// An exception storm under the agent's defaults: its exception events go
/// off over the budget (200 a second), and the windows still hold exactly
/// the exceptions the workload threw, most from its throwing method. The
/// workload lives `linger` seconds after its last throw: the runtime's
/// exception counter, read every `counters_interval`, counts the throws
/// while the events are off, and writes no last value at exit.
fn assert_agent_bounds_an_exception_storm(runtime: Runtime, counters_interval: &str, linger: &str) {
    let env = Env::privileged();
    let dir = TempDir::new(&format!("agent-storm-{runtime:?}"));
    let out = dir.join("windows");
    let agent = TestAgent::start_with_windows(
        &env,
        &dir,
        &out,
        &[
            "--runtime-counters-interval".as_ref(),
            counters_interval.as_ref(),
        ],
    );
    thread::sleep(Duration::from_secs(2));
    // The storm starts 8 s in: the agent looks for new .NET processes every
    // 5 s (sooner when one is sampled), and exceptions thrown before it
    // attached are in no profile.
    let storm = TestProcess::start(
        &env,
        runtime,
        "Exceptions",
        &["8", "300000", "300", "1", "frequent", "-", linger],
        false,
    );
    let pid = storm.pid();
    let (status, lines) = storm.wait(Duration::from_secs(120));
    assert!(status.success(), "the storm failed: {lines:?}");
    // Let the agent see the exit and take the last counter value.
    thread::sleep(Duration::from_secs(2));
    let log = agent.stop();
    let thrown = clrbpf_integration_tests::exceptions_thrown(&lines);
    // The runtime's counter, to which the windows are upscaled, counts the
    // exceptions the runtime throws of its own too (.NET Core 3.1's
    // working-set counter was seen throwing DirectoryNotFoundException for
    // the `/proc/PID/task/TID/stat` of a thread that had just exited),
    // sampled or not: the windows hold what the process saw, no more.
    let counted = clrbpf_integration_tests::exceptions_counted(&lines);
    let (mut total, mut frequent) = (0, 0);
    for entry in fs::read_dir(&out).expect("the output directory") {
        let path = entry.expect("an entry").path();
        if !path.to_string_lossy().contains(".exception.") {
            continue;
        }
        let profile = read_profile(&path);
        let at = value_index(&profile, "exceptions/count");
        for sample in samples(&profile).iter().filter(|s| s.pid() == Some(pid)) {
            total += sample.values[at];
            if sample.stack_contains(&["Exceptions.ThrowFrequent"]) {
                frequent += sample.values[at];
            }
        }
    }
    assert!(
        counted.contains(&total),
        "the windows hold {total} exceptions against the process's own {counted:?}; agent log:\n{log}"
    );
    assert!(
        frequent as f64 >= 0.95 * thrown as f64,
        "Exceptions.ThrowFrequent holds {frequent} of {thrown}"
    );
}

#[test]
fn agent_bounds_an_exception_storm_net8() {
    // The default counters interval, 5 s.
    assert_agent_bounds_an_exception_storm(Runtime::Net8, "5s", "6");
}

#[test]
fn agent_bounds_an_exception_storm_netcore31() {
    // Counters every second: a storm that ends 1 s before its process
    // exits is counted in full (at 5 s, it was in no counter value).
    assert_agent_bounds_an_exception_storm(Runtime::NetCore31, "1s", "1");
}

/// A sample as the script prints it: name, labels, value.
type Row = (String, Vec<(String, String)>, f64);

/// One sample of `/metrics`.
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// The agent's `/metrics` as the reference Prometheus client library parses
/// it (OpenMetrics text).
fn parse_metrics(text: &str) -> Vec<Sample> {
    let python = std::env::var_os("CLRBPF_TEST_PYTHON").expect(
        "CLRBPF_TEST_PYTHON is not set: run the integration tests through `cargo xtask test`, which installs prometheus-client",
    );
    let script = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
rows = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        rows.append([s.name, sorted(s.labels.items()), s.value])
print(json.dumps(rows))
"#;
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the test python");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("send the metrics");
    let output = child.wait_with_output().expect("python");
    assert!(
        output.status.success(),
        "prometheus-client rejects /metrics: {}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Vec<Row> = serde_json::from_slice(&output.stdout).expect("the script's JSON");
    rows.into_iter()
        .map(|(name, labels, value)| Sample {
            name,
            labels,
            value,
        })
        .collect()
}

/// `dotnet_*` runtime metrics of a .NET process, read by the agent from
/// outside it, agree with the process's own GC.CollectionCount; the agent's
/// own series are there; `/debug/pprof/profile?seconds=N` (with
/// `--enable-pull`) answers with a fresh profile of N seconds while the
/// windows go on.
#[test]
fn agent_serves_runtime_metrics_and_profiles_on_demand() {
    let env = Env::privileged();
    let dir = TempDir::new("agent-metrics");
    let windows = dir.join("windows");
    // The pull endpoint needs a token, on loopback too.
    let token_file = dir.join("token");
    fs::write(&token_file, "pull-token-0123456789\n").expect("write the token");
    fs::set_permissions(&token_file, fs::Permissions::from_mode(0o600)).expect("chmod");
    let agent = TestAgent::start_with_windows(
        &env,
        &dir,
        &windows,
        &[
            "--enable-pull".as_ref(),
            "--http-token-file".as_ref(),
            token_file.as_os_str(),
        ],
    );
    let port = agent.port();
    thread::sleep(Duration::from_secs(3));
    let hot = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], false);
    // Idle 10 s (the agent's session starts and the counters take their
    // baseline), 30 collections, then idle while they are reported.
    let gc = TestProcess::start(&env, Runtime::Net8, "GcCounts", &["10", "30", "40"], false);

    let (pull_status, pulled) = http::get(
        port,
        "/debug/pprof/profile?seconds=3",
        &[("Authorization", "Bearer pull-token-0123456789")],
    );
    assert_eq!(pull_status, 200, "{}", String::from_utf8_lossy(&pulled));
    let pulled_path = dir.join("pulled.pb.gz");
    fs::write(&pulled_path, &pulled).expect("write the pulled profile");
    let pulled = read_profile(&pulled_path);
    assert_eq!(pulled.duration_nanos, 3_000_000_000);
    assert_some_stack_contains(&pulled, Some(hot.pid()), &["Hot.Spin"]);

    let deadline = Instant::now() + Duration::from_secs(60);
    let counts = |tag: &str| -> Option<[f64; 3]> {
        let line = gc.lines().into_iter().find(|l| l.starts_with(tag))?;
        let n: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        Some([n[0], n[1], n[2]])
    };
    let (before, after) = loop {
        if let (Some(b), Some(a)) = (counts("GC_BEFORE"), counts("GC_AFTER")) {
            break (b, a);
        }
        assert!(
            Instant::now() < deadline,
            "GcCounts printed {:?}",
            gc.lines()
        );
        thread::sleep(Duration::from_millis(200));
    };
    // Two counter intervals, so the collections are reported.
    thread::sleep(Duration::from_secs(11));
    let (status, text) = http::get_text(port, "/metrics");
    assert_eq!(status, 200);
    let rows = parse_metrics(&text);
    let value = |name: &str, want: &[(&str, &str)]| -> Option<f64> {
        rows.iter()
            .find(|s| {
                s.name == name
                    && want
                        .iter()
                        .all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|s| s.value)
    };
    let pid = gc.pid().to_string();
    let delta = |g: usize| after[g] - before[g];
    let expected = [delta(0) - delta(1), delta(1) - delta(2), delta(2)];
    for (g, generation) in ["gen0", "gen1", "gen2"].into_iter().enumerate() {
        let served = value(
            "dotnet_gc_collections_total",
            &[("pid", &pid), ("dotnet_gc_heap_generation", generation)],
        )
        .unwrap_or_else(|| {
            panic!("no dotnet_gc_collections_total for pid {pid} {generation}:\n{text}")
        });
        assert_eq!(
            served, expected[g],
            "{generation} collections of pid {pid}: /metrics says {served}, GC.CollectionCount {before:?} -> {after:?}"
        );
    }
    for name in [
        "dotnet_gc_heap_size_bytes",
        "dotnet_process_cpu_time_seconds_total",
    ] {
        assert!(
            value(name, &[("pid", &pid)]).is_some(),
            "no {name} for pid {pid}:\n{text}"
        );
    }
    let own = |name: &str| value(name, &[]).unwrap_or_else(|| panic!("no {name}:\n{text}"));
    assert!(own("clrbpf_agent_processes_tracked") >= 2.0);
    assert!(own("clrbpf_agent_dotnet_processes_tracked") >= 2.0);
    assert!(own("clrbpf_agent_bpf_run_seconds_total") > 0.0);
    assert!(own("clrbpf_agent_resident_memory_bytes") > 0.0);

    agent.stop();
    drop(hot);
    drop(gc);
}

/// CPU nanoseconds of `pid` in a pprof profile.
fn cpu_of(profile: &clrbpf::pprof_proto::Profile, pid: u32) -> i64 {
    let cpu = value_index(profile, "cpu/nanoseconds");
    samples(profile)
        .iter()
        .filter(|s| s.pid() == Some(pid))
        .map(|s| s.values[cpu])
        .sum()
}

/// The agent ships to Pyroscope and to an OpenTelemetry collector at once
/// (a loopback receiver decodes both with the published message types).
/// The receiver fails for the first 30 s: the windows wait in the queues
/// and all arrive after it recovers, consecutive, named by service, with
/// the hot method named. The agent's CPU totals of a busy thread agree with
/// `record`'s over the same time within 5%.
#[test]
fn agent_ships_to_pyroscope_and_otlp_through_a_receiver_outage() {
    let env = Env::privileged();
    let app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["120"],
        &Launch {
            env: &[("OTEL_SERVICE_NAME", "hot-service")],
            ..Launch::default()
        },
    );
    let outage = Duration::from_secs(15);
    let fail_until = Instant::now() + outage;
    let receiver = Backend::start(move |_| {
        Answer::Status(if Instant::now() < fail_until {
            500
        } else {
            200
        })
    });
    let dir = TempDir::new("agent-sinks");
    let url = receiver.url();
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--pyroscope-url".as_ref(),
            url.as_ref(),
            "--otlp-url".as_ref(),
            url.as_ref(),
        ],
    );
    let port = agent.port();
    // `record` of the same process for 10 s while the agent runs.
    thread::sleep(Duration::from_secs(8));
    let recorded = dir.join("record.pb.gz");
    let output = Command::new(&env.clrbpf)
        .args([
            "record",
            "-F",
            "19",
            "-p",
            &app.pid().to_string(),
            "-d",
            "10",
            "-o",
        ])
        .arg(&recorded)
        .stdin(Stdio::null())
        .output()
        .expect("run clrbpf record");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Past the outage, and long enough for the retries to get through.
    thread::sleep(outage + Duration::from_secs(12));
    let (_, metrics) = http::get_text(port, "/metrics");
    agent.stop();
    let requests = receiver.take();
    assert!(
        requests.iter().any(|r| r.status == 500),
        "the outage refused nothing"
    );
    // The outage in the agent's own series: uploads failed, no window was
    // dropped, and the windows shipped are those the receiver took (by the
    // time /metrics was read).
    let series = parse_metrics(&metrics);
    let of_pyroscope = |name: &str| -> f64 {
        series
            .iter()
            .filter(|s| {
                s.name == name
                    && s.labels
                        .iter()
                        .any(|(k, v)| k == "sink" && v == "pyroscope")
            })
            .map(|s| s.value)
            .sum()
    };
    let accepted = requests
        .iter()
        .filter(|r| r.status == 200 && r.path == "/push.v1.pusherservice/push")
        .count() as f64;
    assert!(
        of_pyroscope("clrbpf_agent_window_upload_failures_total") > 0.0,
        "no failed upload counted:\n{metrics}"
    );
    assert_eq!(
        of_pyroscope("clrbpf_agent_windows_dropped_total"),
        0.0,
        "windows dropped:\n{metrics}"
    );
    let shipped = of_pyroscope("clrbpf_agent_windows_shipped_total");
    assert!(
        shipped > 0.0 && shipped <= accepted,
        "{shipped} windows shipped, {accepted} pushes accepted:\n{metrics}"
    );

    // Pyroscope: one series per service and profile type, the pprof gzip.
    let mut windows = Vec::new();
    for request in requests
        .iter()
        .filter(|r| r.status == 200 && r.path == "/push.v1.pusherservice/push")
    {
        let push = clrbpf::pyroscope_proto::push::v1::PushRequest::decode(request.body.as_slice())
            .expect("a PushRequest");
        for series in push.series {
            let label = |name: &str| {
                series
                    .labels
                    .iter()
                    .find(|l| l.name == name)
                    .map(|l| l.value.clone())
            };
            if label("service_name").as_deref() != Some("hot-service")
                || label("__name__").as_deref() != Some("process_cpu")
            {
                continue;
            }
            for sample in &series.samples {
                let profile = clrbpf::pprof_proto::Profile::decode(
                    http::gunzip(&sample.raw_profile).as_slice(),
                )
                .expect("a pprof profile");
                windows.push(profile);
            }
        }
    }
    windows.sort_by_key(|p| p.time_nanos);
    assert!(
        windows.len() >= 8,
        "expected the windows of ~50 s of hot-service, got {}",
        windows.len()
    );
    for pair in windows.windows(2) {
        assert_eq!(
            pair[0].time_nanos + pair[0].duration_nanos,
            pair[1].time_nanos,
            "a window is missing (dropped during the outage?)"
        );
    }
    let full: Vec<_> = windows[1..windows.len() - 1].to_vec();
    for window in &full {
        assert_eq!(window.duration_nanos, 5_000_000_000);
    }
    assert_some_stack_contains(&full[0], Some(app.pid()), &["Hot.Spin"]);
    let agent_rate = full.iter().map(|w| cpu_of(w, app.pid())).sum::<i64>() as f64
        / full.iter().map(|w| w.duration_nanos).sum::<i64>() as f64;
    let record = read_profile(&recorded);
    let record_rate = cpu_of(&record, app.pid()) as f64 / record.duration_nanos as f64;
    assert!(
        (agent_rate / record_rate - 1.0).abs() <= 0.05,
        "CPU of the busy thread per second: agent {agent_rate:.3}, record {record_rate:.3}"
    );

    // OTLP: the same windows, with the service as a resource attribute.
    let otlp: Vec<_> = requests
        .iter()
        .filter(|r| r.status == 200 && r.path == "/v1development/profiles")
        .map(|r| {
            let body = if r.gzip { http::gunzip(&r.body) } else { r.body.clone() };
            opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest::decode(body.as_slice())
                .expect("an ExportProfilesServiceRequest")
        })
        .collect();
    assert!(otlp.len() >= 8, "{} OTLP requests", otlp.len());
    let hot = otlp.iter().any(|request| {
        let names_hot = request
            .dictionary
            .as_ref()
            .is_some_and(|d| d.string_table.iter().any(|s| s.contains("Hot.Spin")));
        let service = request.resource_profiles.iter().any(|rp| {
            rp.resource.as_ref().is_some_and(|r| {
                r.attributes.iter().any(|kv| {
                    kv.key == "service.name" && format!("{:?}", kv.value).contains("hot-service")
                })
            })
        });
        names_hot && service
    });
    assert!(hot, "no OTLP request names hot-service and Hot.Spin");
}
