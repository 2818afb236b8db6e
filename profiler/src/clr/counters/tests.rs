use std::sync::Arc;

use super::*;
use crate::clr::nettrace::{EventMetadata, EventRecord, FieldDescription};

fn field(name: &str, type_code: u32) -> FieldDescription {
    FieldDescription {
        name: name.into(),
        type_code,
        fields: Box::new([]),
    }
}

/// The `EventCounters` metadata as the runtime describes it: one
/// `Payload` object with the fields of `CounterPayload` (polling) or
/// `IncrementingCounterPayload` (incrementing).
fn metadata(id: u32, incrementing: bool) -> EventMetadata {
    let mut fields = vec![
        field("Name", type_code::STRING),
        field("DisplayName", type_code::STRING),
    ];
    if incrementing {
        fields.push(field("DisplayRateTimeScale", type_code::STRING));
        fields.push(field("Increment", type_code::DOUBLE));
    } else {
        fields.push(field("Mean", type_code::DOUBLE));
        fields.push(field("StandardDeviation", type_code::DOUBLE));
        fields.push(field("Count", type_code::INT32));
        fields.push(field("Min", type_code::DOUBLE));
        fields.push(field("Max", type_code::DOUBLE));
    }
    fields.extend([
        field("IntervalSec", type_code::SINGLE),
        field("Series", type_code::STRING),
        field("CounterType", type_code::STRING),
        field("Metadata", type_code::STRING),
        field("DisplayUnits", type_code::STRING),
    ]);
    EventMetadata {
        metadata_id: id,
        provider: Arc::from(RUNTIME_COUNTERS_PROVIDER),
        event_id: 0,
        event_name: EVENT_COUNTERS_EVENT.into(),
        keywords: 0,
        version: 0,
        level: 0,
        fields: Box::new([FieldDescription {
            name: "Payload".into(),
            type_code: type_code::OBJECT,
            fields: fields.into(),
        }]),
    }
}

fn utf16z(text: &str, out: &mut Vec<u8>) {
    for unit in text.encode_utf16().chain([0]) {
        out.extend(unit.to_le_bytes());
    }
}

fn polling_payload(name: &str, mean: f64, units: &str) -> Vec<u8> {
    let mut out = Vec::new();
    utf16z(name, &mut out);
    utf16z("Display", &mut out);
    out.extend(mean.to_le_bytes());
    out.extend(0f64.to_le_bytes());
    out.extend(1i32.to_le_bytes());
    out.extend(mean.to_le_bytes());
    out.extend(mean.to_le_bytes());
    out.extend(1.0f32.to_le_bytes());
    utf16z("Interval=1000", &mut out);
    utf16z("Mean", &mut out);
    utf16z("", &mut out);
    utf16z(units, &mut out);
    out
}

fn incrementing_payload(name: &str, increment: f64) -> Vec<u8> {
    let mut out = Vec::new();
    utf16z(name, &mut out);
    utf16z("Display", &mut out);
    utf16z("00:01:00", &mut out);
    out.extend(increment.to_le_bytes());
    out.extend(1.0f32.to_le_bytes());
    utf16z("Interval=1000", &mut out);
    utf16z("Sum", &mut out);
    utf16z("", &mut out);
    utf16z("", &mut out);
    out
}

fn record<'a>(provider: &'a Arc<str>, metadata_id: u32, payload: &'a [u8]) -> EventRecord<'a> {
    EventRecord {
        metadata_id,
        provider,
        event_id: 0,
        version: 0,
        event_name: EVENT_COUNTERS_EVENT,
        thread_id: 1,
        capture_thread_id: 1,
        processor: 0,
        sequence: 1,
        timestamp: 0,
        activity_id: [0; 16],
        related_activity_id: [0; 16],
        is_sorted: true,
        stack: None,
        payload,
    }
}

#[test]
fn decodes_both_payload_kinds_by_their_metadata() {
    let provider: Arc<str> = Arc::from(RUNTIME_COUNTERS_PROVIDER);
    let mut decoder = CounterDecoder::new();
    decoder.on_metadata(&metadata(7, false));
    decoder.on_metadata(&metadata(8, true));
    let polling = polling_payload("gc-heap-size", 12.0, "MB");
    let sample = decoder
        .decode(&record(&provider, 7, &polling))
        .unwrap()
        .unwrap();
    assert_eq!(
        sample,
        CounterSample {
            name: "gc-heap-size".into(),
            kind: CounterKind::Mean,
            value: 12.0,
            interval_sec: 1.0,
            display_units: "MB".into(),
            time_ns: 0,
        }
    );
    let incrementing = incrementing_payload("gen-0-gc-count", 3.0);
    let sample = decoder
        .decode(&record(&provider, 8, &incrementing))
        .unwrap()
        .unwrap();
    assert_eq!(sample.kind, CounterKind::Sum);
    assert_eq!(sample.value, 3.0);
    // Not a counter event: not ours.
    assert!(
        decoder
            .decode(&record(&provider, 9, &incrementing))
            .is_none()
    );
}

#[test]
fn hostile_payloads_are_errors_not_panics() {
    let provider: Arc<str> = Arc::from(RUNTIME_COUNTERS_PROVIDER);
    let mut decoder = CounterDecoder::new();
    decoder.on_metadata(&metadata(7, false));
    let payload = polling_payload("cpu-usage", 1.0, "%");
    for cut in 0..payload.len() {
        let result = decoder
            .decode(&record(&provider, 7, &payload[..cut]))
            .unwrap();
        assert!(result.is_err(), "cut at {cut}");
    }
    let mut odd = metadata(3, false);
    odd.fields = Box::new([field("Payload", type_code::STRING)]);
    decoder.on_metadata(&odd);
    assert_eq!(
        decoder.decode(&record(&provider, 3, &payload)).unwrap(),
        Err(CounterDecodeError::NoPayloadObject)
    );
}

#[test]
fn snapshots_map_to_the_semantic_convention_families() {
    let mut counters = RuntimeCounters::new();
    let sum = |name: &str, value: f64| CounterSample {
        name: name.into(),
        kind: CounterKind::Sum,
        value,
        interval_sec: 1.0,
        display_units: String::new(),
        time_ns: 0,
    };
    let mean = |name: &str, value: f64| CounterSample {
        kind: CounterKind::Mean,
        ..sum(name, value)
    };
    for _ in 0..2 {
        counters.observe(&sum("gen-0-gc-count", 5.0));
        counters.observe(&sum("gen-1-gc-count", 2.0));
        counters.observe(&sum("gen-2-gc-count", 1.0));
        counters.observe(&sum("exception-count", 10.0));
    }
    counters.observe(&mean("gc-heap-size", 3.0));
    counters.observe(&mean("gen-0-size", 100.0));
    counters.observe(&sum("exception-count", f64::NAN));
    counters.set_usage(Some(ProcessUsage {
        user_seconds: 1.5,
        system_seconds: 0.25,
        resident_bytes: 4096,
    }));
    let snapshot = counters.snapshot();
    let values = |name: &str| {
        RUNTIME_FAMILIES
            .iter()
            .find(|family| family.name == name)
            .unwrap()
            .values(snapshot)
    };
    assert_eq!(
        values("dotnet_gc_collections"),
        vec![
            (Some((GENERATION_LABEL, "gen0")), 6.0),
            (Some((GENERATION_LABEL, "gen1")), 2.0),
            (Some((GENERATION_LABEL, "gen2")), 2.0),
        ]
    );
    assert_eq!(values("dotnet_exceptions"), vec![(None, 20.0)]);
    assert_eq!(values("dotnet_gc_heap_size"), vec![(None, 3e6)]);
    assert_eq!(
        values("dotnet_gc_last_collection_heap_size"),
        vec![(Some((GENERATION_LABEL, "gen0")), 100.0)]
    );
    assert_eq!(
        values("dotnet_process_memory_working_set"),
        vec![(None, 4096.0)]
    );
    assert_eq!(values("dotnet_process_cpu_time").len(), 2);
    assert!(
        values("dotnet_gc_pause_time").is_empty(),
        "absent on this runtime"
    );
}

#[test]
fn process_usage_parses_stat_with_hostile_command_names() {
    let stat = "4242 (a) b) (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 1000000 300 18446744073709551615";
    let usage = ProcessUsage::parse(stat, "1000 300 100 1 0 200 0", 100.0, 4096).unwrap();
    assert_eq!(usage.user_seconds, 2.5);
    assert_eq!(usage.system_seconds, 0.5);
    assert_eq!(usage.resident_bytes, 300 * 4096);
    assert!(ProcessUsage::parse("garbage", "", 100.0, 4096).is_none());
}

#[test]
fn the_provider_asks_for_the_interval() {
    let provider = counters_provider(15);
    assert_eq!(provider.name, "System.Runtime");
    assert_eq!(provider.filter, "EventCounterIntervalSec=15");
    assert_eq!(counters_provider(0).filter, "EventCounterIntervalSec=1");
}

/// Real runtimes: the counters a .NET 8 and a .NET Core 3.1 process
/// publish over a real EventPipe session match what the process counts
/// itself (GC.CollectionCount, thrown exceptions).
mod real_runtimes {
    use std::{
        io::{BufRead as _, BufReader, Write as _},
        path::{Path, PathBuf},
        process::{Child, ChildStdin, ChildStdout, Command, Stdio},
        time::{Duration, Instant},
    };

    use super::*;
    use crate::clr::session::{ClrEventKinds, ClrSession};

    /// Collects twice, prints its GC counts, waits for a line, collects and
    /// throws, prints its counts again, then idles without allocating.
    const APP: &str = r#"
using System;
using System.Threading;
public static class GcApp {
    static int exceptions;
    static string Counts() {
        return GC.CollectionCount(0) + " " + GC.CollectionCount(1) + " " + GC.CollectionCount(2)
            + " " + Interlocked.CompareExchange(ref exceptions, 0, 0);
    }
    public static void Main() {
        // Every exception the runtime counts, the runtime's own included.
        AppDomain.CurrentDomain.FirstChanceException += (s, e) => Interlocked.Increment(ref exceptions);
        // Collections before the agent attaches: its totals must not
        // include them.
        GC.Collect();
        GC.Collect(0);
        Console.WriteLine("ready " + Counts());
        Console.Out.Flush();
        Console.In.ReadLine();
        for (int i = 0; i < 7; i++) GC.Collect();
        for (int i = 0; i < 5; i++) GC.Collect(0);
        for (int i = 0; i < 3; i++) GC.Collect(1);
        for (int i = 0; i < 13; i++) { try { throw new InvalidOperationException("x"); } catch (Exception) {} }
        Console.WriteLine("done " + Counts());
        Console.Out.Flush();
        while (true) Thread.Sleep(100);
    }
}
"#;

    #[derive(Clone, Copy, Debug)]
    enum Runtime {
        Net8,
        NetCore31,
    }

    impl Runtime {
        fn dotnet(self) -> PathBuf {
            let (var, default) = match self {
                Runtime::Net8 => ("CLRBPF_DOTNET8", "net8/dnv/net/runtime/.net/dotnet"),
                Runtime::NetCore31 => ("CLRBPF_DOTNET31", "netcore31/dotnetcore2/bin/dotnet"),
            };
            std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../target/runtimes")
                    .join(default)
            })
        }

        fn runtime_config(self) -> &'static str {
            match self {
                Runtime::Net8 => {
                    r#"{"runtimeOptions":{"tfm":"net8.0","framework":{"name":"Microsoft.NETCore.App","version":"8.0.0"}}}"#
                }
                Runtime::NetCore31 => {
                    r#"{"runtimeOptions":{"tfm":"netcoreapp3.1","framework":{"name":"Microsoft.NETCore.App","version":"3.1.0"},"configProperties":{"System.Globalization.Invariant":true}}}"#
                }
            }
        }
    }

    struct GcApp {
        child: Child,
        stdin: ChildStdin,
        stdout: BufReader<ChildStdout>,
        _dir: tempfile::TempDir,
    }

    impl GcApp {
        fn start(runtime: Runtime) -> (Self, [f64; 4]) {
            let dir = tempfile::tempdir().expect("tempdir");
            std::fs::write(dir.path().join("App.cs"), APP).expect("write App.cs");
            std::fs::write(
                dir.path().join("App.runtimeconfig.json"),
                runtime.runtime_config(),
            )
            .expect("write the runtime config");
            let status = Command::new("mcs")
                .args(["-out:App.dll", "App.cs"])
                .current_dir(dir.path())
                .status()
                .expect("run mcs (Debian package mono-mcs)");
            assert!(status.success(), "mcs failed");
            let mut child = Command::new(runtime.dotnet())
                .arg("App.dll")
                .current_dir(dir.path())
                .env_remove("TMPDIR")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", runtime.dotnet().display()));
            let stdin = child.stdin.take().expect("piped stdin");
            let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
            let mut app = Self {
                child,
                stdin,
                stdout,
                _dir: dir,
            };
            let counts = app.read_counts("ready");
            (app, counts)
        }

        /// Collections of generations 0, 1, 2, then exceptions thrown.
        fn read_counts(&mut self, tag: &str) -> [f64; 4] {
            let mut line = String::new();
            self.stdout
                .read_line(&mut line)
                .expect("read the app's line");
            let rest = line
                .trim()
                .strip_prefix(tag)
                .unwrap_or_else(|| panic!("expected {tag:?}, got {line:?}"));
            let numbers: Vec<f64> = rest
                .split_whitespace()
                .map(|n| n.parse().expect("a count"))
                .collect();
            [numbers[0], numbers[1], numbers[2], numbers[3]]
        }

        fn go(&mut self) -> [f64; 4] {
            writeln!(self.stdin, "go").expect("write to the app");
            self.stdin.flush().expect("flush");
            self.read_counts("done")
        }
    }

    impl Drop for GcApp {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// `dotnet_gc_collections_total` of `pid` for gen0, gen1, gen2, read
    /// back from the agent's `/metrics` over HTTP.
    fn served_gc_collections(pid: u32, counters: &RuntimeCounters) -> [f64; 3] {
        use crate::agent::{
            http::{AgentHealth, HttpState, router},
            metrics::AgentMetrics,
            server::{ServerLimits, serve},
        };
        let metrics = AgentMetrics::new();
        let mut counters = counters.clone();
        counters.set_usage(None);
        metrics.runtime().update(ProcessRuntimeMetrics {
            pid,
            executable: "dotnet".into(),
            k8s: Vec::new(),
            snapshot: counters.snapshot().clone(),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let text = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let url = format!("http://{}/metrics", listener.local_addr().expect("address"));
            let state = HttpState::new(
                metrics,
                Arc::new(AgentHealth::new(Duration::from_secs(60))),
                None,
            );
            let limits = ServerLimits::agent(Duration::from_secs(1));
            let server = tokio::spawn(serve(
                listener,
                router(state),
                limits,
                std::future::pending(),
            ));
            let client = crate::agent::http_client(Duration::from_secs(10)).expect("client");
            let text = client
                .get(url)
                .send()
                .await
                .expect("GET /metrics")
                .text()
                .await
                .expect("body");
            server.abort();
            text
        });
        let mut counts = [f64::NAN; 3];
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("dotnet_gc_collections_total{") else {
                continue;
            };
            let (labels, value) = rest.split_once("} ").expect("labels then value");
            if !labels.contains(&format!("pid=\"{pid}\"")) {
                continue;
            }
            let generation = labels
                .split("dotnet_gc_heap_generation=\"gen")
                .nth(1)
                .and_then(|rest| rest.chars().next())
                .and_then(|digit| digit.to_digit(10))
                .expect("a generation label") as usize;
            counts[generation] = value.trim().parse().expect("a number");
        }
        counts
    }

    /// Drains counter values for `wait`.
    fn collect_for(session: &mut ClrSession, counters: &mut RuntimeCounters, wait: Duration) {
        let until = Instant::now() + wait;
        while Instant::now() < until {
            session.drain(&mut |_| {});
            for sample in session.take_counters() {
                counters.observe(&sample);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    #[test]
    #[ignore = "needs a .NET runtime: run by cargo xtask test"]
    fn gc_and_exception_counts_match_the_process_own_counts() {
        for runtime in [Runtime::Net8, Runtime::NetCore31] {
            let (mut app, before) = GcApp::start(runtime);
            let procfs = ProcFs::default();
            let pid = app.child.id();
            let mut session = None;
            for _ in 0..100 {
                let started =
                    crate::clr::ipc::DiagnosticClient::discover(&procfs, pid).and_then(|client| {
                        ClrSession::start_with_counters(&client, ClrEventKinds::NONE, None, Some(1))
                    });
                match started {
                    Ok(started) => {
                        session = Some(started);
                        break;
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
            let mut session = session.unwrap_or_else(|| panic!("{runtime:?}: no session"));
            let mut counters = RuntimeCounters::new();
            // The runtime takes its baseline when the counters are enabled;
            // wait for the first values before the app starts counting.
            collect_for(&mut session, &mut counters, Duration::from_millis(2500));
            assert!(
                counters.snapshot().totals.contains_key("gen-0-gc-count"),
                "{runtime:?}: no counters after 2.5 s: {:?}",
                counters.snapshot()
            );
            let after = app.go();
            collect_for(&mut session, &mut counters, Duration::from_millis(3500));
            counters.set_usage(ProcessUsage::read(&procfs, pid));
            let (end, _) = session.stop(Instant::now() + Duration::from_secs(5), &mut |_| {});
            for sample in &end.counters {
                counters.observe(sample);
            }
            let snapshot = counters.snapshot();
            assert!(before[0] >= 2.0, "{runtime:?}: the startup collections ran");
            let total = |name: &str| snapshot.totals.get(name).copied().unwrap_or(-1.0);
            for generation in 0..3 {
                assert_eq!(
                    total(&format!("gen-{generation}-gc-count")),
                    after[generation] - before[generation],
                    "{runtime:?} gen {generation}: {snapshot:?}"
                );
            }
            assert!(after[3] - before[3] >= 13.0);
            assert_eq!(
                total("exception-count"),
                after[3] - before[3],
                "{runtime:?}: {snapshot:?}"
            );
            let family = RUNTIME_FAMILIES
                .iter()
                .find(|family| family.name == "dotnet_gc_collections")
                .expect("the family");
            let values = family.values(snapshot);
            let gen2 = after[2] - before[2];
            assert_eq!(values[2], (Some((GENERATION_LABEL, "gen2")), gen2));
            assert!(snapshot.last.contains_key("gc-heap-size"), "{snapshot:?}");
            assert!(snapshot.usage.is_some_and(|usage| usage.resident_bytes > 0));
            assert_eq!(end.counter_errors, 0, "{runtime:?}");

            // The same numbers, as the agent's /metrics serves them.
            let served = served_gc_collections(pid, &counters);
            let delta = |generation: usize| after[generation] - before[generation];
            assert_eq!(
                served,
                [delta(0) - delta(1), delta(1) - delta(2), delta(2)],
                "{runtime:?}: /metrics disagrees with GC.CollectionCount"
            );
        }
    }

    /// Captures the raw stream of a counters-only session of each runtime
    /// and checks that it decodes; with `CLRBPF_CAPTURE_DIR` set, keeps it
    /// there as `<runtime>.counters.nettrace` (how the fixtures in
    /// `nettrace/testdata/` were made).
    #[test]
    #[ignore = "needs a .NET runtime: run by cargo xtask test"]
    fn capture_a_counters_stream() {
        use std::io::Read as _;

        use crate::clr::{
            ipc::DiagnosticClient,
            nettrace::{NettraceParser, ParsedItem},
            session::{SESSION_BUFFER_MB, collect_tracing2_payload},
        };
        let scratch = tempfile::tempdir().expect("tempdir");
        let dir = std::env::var_os("CLRBPF_CAPTURE_DIR")
            .map_or_else(|| scratch.path().to_owned(), PathBuf::from);
        for runtime in [Runtime::Net8, Runtime::NetCore31] {
            let (mut app, _) = GcApp::start(runtime);
            let procfs = ProcFs::default();
            let client = DiagnosticClient::discover(&procfs, app.child.id()).expect("socket");
            let payload =
                collect_tracing2_payload(SESSION_BUFFER_MB, false, &[counters_provider(1)]);
            let (mut stream, session_id) = client.collect_tracing(&payload).expect("session");
            let reader = std::thread::spawn(move || {
                let mut raw = Vec::new();
                let _ = stream.read_to_end(&mut raw);
                raw
            });
            std::thread::sleep(Duration::from_millis(1500));
            app.go();
            std::thread::sleep(Duration::from_millis(1500));
            client.stop_tracing(session_id).expect("stop");
            let raw = reader.join().expect("reader");
            let name = match runtime {
                Runtime::Net8 => "net8.counters.nettrace",
                Runtime::NetCore31 => "netcore31.counters.nettrace",
            };
            std::fs::write(dir.join(name), &raw).expect("write the capture");
            let mut parser = NettraceParser::new();
            let mut decoder = CounterDecoder::new();
            let mut names = Vec::new();
            parser
                .feed(&raw, &mut |item| match item {
                    ParsedItem::Metadata(metadata) => decoder.on_metadata(metadata),
                    ParsedItem::Event(record) => {
                        if let Some(sample) = decoder.decode(&record) {
                            names.push(sample.expect("decodes").name);
                        }
                    }
                    _ => {}
                })
                .expect("parses");
            assert!(
                names.iter().any(|name| name == "gen-0-gc-count"),
                "{runtime:?}: {names:?}"
            );
        }
    }
}

/// The totals of every counter in a captured stream (see
/// `nettrace/testdata/README.md`).
fn capture_totals(name: &str) -> (RuntimeSnapshot, usize) {
    use std::io::Read as _;

    use crate::clr::nettrace::{NettraceParser, ParsedItem};
    let path = format!(
        "{}/src/clr/nettrace/testdata/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let gz = std::fs::read(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz.as_slice())
        .read_to_end(&mut raw)
        .expect("gunzip");
    let mut parser = NettraceParser::new();
    let mut decoder = CounterDecoder::new();
    let mut counters = RuntimeCounters::new();
    let mut events = 0;
    parser
        .feed(&raw, &mut |item| match item {
            ParsedItem::Metadata(metadata) => decoder.on_metadata(metadata),
            ParsedItem::Event(record) => {
                if let Some(sample) = decoder.decode(&record) {
                    events += 1;
                    counters.observe(&sample.expect("every payload decodes"));
                }
            }
            _ => {}
        })
        .expect("parses");
    parser.finish().expect("ends cleanly");
    (counters.snapshot().clone(), events)
}

/// The captured workload collected 7 full, 3 gen-1 and 5 gen-0 times and
/// threw 13 exceptions while the session ran.
#[test]
fn captured_streams_decode_to_the_workload_counts() {
    for name in [
        "net8.counters.nettrace.gz",
        "netcore31.counters.nettrace.gz",
    ] {
        let (snapshot, events) = capture_totals(name);
        assert!(events >= 40, "{name}: {events} counter events");
        let total = |counter: &str| snapshot.totals.get(counter).copied();
        assert_eq!(total("gen-0-gc-count"), Some(15.0), "{name}: {snapshot:?}");
        assert_eq!(total("gen-1-gc-count"), Some(10.0), "{name}");
        assert_eq!(total("gen-2-gc-count"), Some(7.0), "{name}");
        assert_eq!(total("exception-count"), Some(13.0), "{name}");
        assert!(snapshot.last.contains_key("gc-heap-size"), "{name}");
        assert!(
            snapshot.last.contains_key("threadpool-thread-count"),
            "{name}"
        );
    }
    // Only .NET 6+ has the JIT counters.
    let (net8, _) = capture_totals("net8.counters.nettrace.gz");
    assert!(
        net8.last
            .get("methods-jitted-count")
            .is_some_and(|n| *n > 0.0)
    );
    let (net31, _) = capture_totals("netcore31.counters.nettrace.gz");
    assert!(!net31.last.contains_key("methods-jitted-count"));
}
