//! The runtime counters a real .NET 8 and .NET Core 3.1 process publish over
//! an EventPipe session (the `System.Runtime` EventCounters provider),
//! through the library's API: their totals match what the process counts
//! itself (`GC.CollectionCount`, first-chance exceptions), and the agent's
//! `/metrics` serves the same numbers. The `GcCounts` workload idles, then
//! collects and throws a known number of times.

use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use clrbpf::{
    agent::{
        http::{AgentHealth, HttpState, router},
        metrics::AgentMetrics,
        server::{ServerLimits, ShedConnections, serve},
    },
    clr::{
        counters::{
            CounterDecoder, CounterSample, GENERATION_LABEL, ProcessRuntimeMetrics, ProcessUsage,
            RUNTIME_FAMILIES, RuntimeCounters, counters_provider,
        },
        ipc::DiagnosticClient,
        session::{ClrEventKinds, ClrSession, SESSION_BUFFER_MB, collect_tracing2_payload},
    },
    process::ProcFs,
    profile::monotonic_ns,
};
use clrbpf_integration_tests::{Env, Runtime, TestProcess, parse_value};
use clrbpf_parse::nettrace::{NettraceParser, ParsedItem};

/// Seconds `GcCounts` idles before it counts: the session is up and the
/// counters have their baseline by then.
const WAIT_SECONDS: &str = "5";
const THROWS: f64 = 13.0;

/// `GcCounts` on `runtime`: idles, collects 30 times, throws 13 times.
fn start_gc_counts(env: &Env, runtime: Runtime) -> TestProcess {
    TestProcess::start(
        env,
        runtime,
        "GcCounts",
        &[WAIT_SECONDS, "30", "30", "13"],
        false,
    )
}

/// Collections of generations 0, 1, 2 and exceptions, as `app` printed them
/// after `tag` (`BEFORE` or `AFTER`), once it has.
fn wait_counts(app: &TestProcess, tag: &str) -> [f64; 4] {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let lines = app.lines();
        let gc: Option<String> = parse_value(&lines, &format!("GC_{tag}"));
        let exceptions: Option<f64> = parse_value(&lines, &format!("EXCEPTIONS_{tag}"));
        if let (Some(gc), Some(exceptions)) = (gc, exceptions) {
            let gc: Vec<f64> = gc
                .split_whitespace()
                .map(|n| n.parse().expect("a count"))
                .collect();
            return [gc[0], gc[1], gc[2], exceptions];
        }
        assert!(Instant::now() < until, "no GC_{tag} line: {lines:?}");
        thread::sleep(Duration::from_millis(50));
    }
}

/// Drains counter values for `wait`; returns the first `exception-count`
/// value seen, if any.
fn collect_for(
    session: &mut ClrSession,
    counters: &mut RuntimeCounters,
    wait: Duration,
) -> Option<CounterSample> {
    let until = Instant::now() + wait;
    let mut first = None;
    while Instant::now() < until {
        session.drain(&mut |_| {});
        for sample in session.take_counters() {
            counters.observe(&sample);
            if first.is_none() && sample.name == "exception-count" {
                first = Some(sample);
            }
        }
        thread::sleep(Duration::from_millis(100));
    }
    first
}

/// A counters-only session with `pid` at `interval_sec`, retried while its
/// runtime starts, and the monotonic times just before the request that
/// started it and just after.
fn counters_session(procfs: &ProcFs, pid: u32, interval_sec: u32) -> (ClrSession, u64, u64) {
    let mut last = None;
    for _ in 0..100 {
        let asked = monotonic_ns();
        let started = DiagnosticClient::discover(procfs, pid).and_then(|client| {
            ClrSession::start_with_counters(&client, ClrEventKinds::NONE, None, Some(interval_sec))
        });
        match started {
            Ok(session) => return (session, asked, monotonic_ns()),
            Err(e) => last = Some(e),
        }
        thread::sleep(Duration::from_millis(50));
    }
    panic!("no counters session with {pid}: {last:?}");
}

/// `dotnet_gc_collections_total` of `pid` for gen0, gen1, gen2, read back
/// from the agent's `/metrics` over HTTP.
fn served_gc_collections(pid: u32, counters: &RuntimeCounters) -> [f64; 3] {
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
        let address = listener.local_addr().expect("address");
        let state = HttpState::new(
            metrics,
            Arc::new(AgentHealth::new(Duration::from_secs(60))),
            None,
        );
        let server = tokio::spawn(serve(
            listener,
            router(state),
            ServerLimits::agent(Duration::from_secs(1)),
            ShedConnections::default(),
            std::future::pending(),
        ));
        let text = tokio::task::spawn_blocking(move || {
            let mut stream = TcpStream::connect(address).expect("connect");
            stream
                .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                .expect("GET /metrics");
            let mut text = String::new();
            stream.read_to_string(&mut text).expect("the response");
            text
        })
        .await
        .expect("the client");
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

/// At every second (`record`) and at the agent's 5 s, four apps and
/// sessions at once (each app its own runtime and counter timer).
#[test]
fn gc_and_exception_counts_match_the_process_own_counts() {
    let env = Env::from_env();
    thread::scope(|scope| {
        let cases = [
            (Runtime::Net8, 1),
            (Runtime::NetCore31, 1),
            (Runtime::Net8, 5),
            (Runtime::NetCore31, 5),
        ]
        .map(|(runtime, interval_sec)| {
            let env = &env;
            scope.spawn(move || counts_match(env, runtime, interval_sec))
        });
        for case in cases {
            if let Err(panic) = case.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
}

fn counts_match(env: &Env, runtime: Runtime, interval_sec: u32) {
    let label = format!("{runtime:?} at {interval_sec} s");
    let app = start_gc_counts(env, runtime);
    let procfs = ProcFs::default();
    let pid = app.pid();
    let (mut session, asked_ns, started_ns) = counters_session(&procfs, pid, interval_sec);
    let mut counters = RuntimeCounters::new();
    // The runtime takes its baseline when the counters are enabled;
    // wait for the first values.
    let interval = Duration::from_secs(interval_sec.into());
    let first = collect_for(
        &mut session,
        &mut counters,
        interval + Duration::from_millis(1500),
    );
    assert!(
        counters.snapshot().totals.contains_key("gen-0-gc-count"),
        "{label}: no counters after {interval:?} and 1.5 s: {:?}",
        counters.snapshot()
    );
    // The first value comes one period (`Series`) after the baseline,
    // which the runtime takes as it enables the counters, shortly after
    // it answered the request (26-212 ms later on a host at load 300):
    // the agent's budgets take the baseline from it. The runtime keeps
    // one timer at the shortest period any session asked for, and takes
    // a new baseline when a session asks for a shorter one: another
    // profiler on the host at 1 s makes the first value come at its
    // timer's next tick, counting from the one before.
    let first = first.expect("an exception-count value");
    assert!(
        first.interval_sec > 0.0 && first.interval_sec <= interval_sec as f32,
        "{label}: a period of {} s",
        first.interval_sec
    );
    let baseline_ns = first
        .time_ns
        .saturating_sub((f64::from(first.interval_sec) * 1e9) as u64);
    assert!(
        baseline_ns + 20_000_000 >= asked_ns && baseline_ns < first.time_ns,
        "{label}: first value at {} ns over {} s, the session asked at {asked_ns} and started at {started_ns}",
        first.time_ns,
        first.interval_sec
    );
    let before = wait_counts(&app, "BEFORE");
    let after = wait_counts(&app, "AFTER");
    // A value after the last throw.
    collect_for(
        &mut session,
        &mut counters,
        interval + Duration::from_millis(2500),
    );
    counters.set_usage(ProcessUsage::read(&procfs, pid));
    let (end, _) = session.stop(Instant::now() + Duration::from_secs(5), &mut |_| {});
    for sample in &end.counters {
        counters.observe(sample);
    }
    let snapshot = counters.snapshot();
    let total = |name: &str| snapshot.totals.get(name).copied().unwrap_or(-1.0);
    for generation in 0..3 {
        assert_eq!(
            total(&format!("gen-{generation}-gc-count")),
            after[generation] - before[generation],
            "{label} gen {generation}: {snapshot:?}"
        );
    }
    assert!(after[3] - before[3] >= THROWS, "{label}: {after:?}");
    assert_eq!(
        total("exception-count"),
        after[3] - before[3],
        "{label}: {snapshot:?}"
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
    assert_eq!(end.counter_errors, 0, "{label}");

    // The same numbers, as the agent's /metrics serves them.
    let served = served_gc_collections(pid, &counters);
    let delta = |generation: usize| after[generation] - before[generation];
    assert_eq!(
        served,
        [delta(0) - delta(1), delta(1) - delta(2), delta(2)],
        "{label}: /metrics disagrees with GC.CollectionCount"
    );
}

/// Captures the raw stream of a counters-only session of each runtime and
/// checks that it decodes; with `CLRBPF_CAPTURE_DIR` set, keeps it there as
/// `<runtime>.counters.nettrace` (how the fixtures in
/// `profiler-parse/src/nettrace/testdata/` were made).
#[test]
fn capture_a_counters_stream() {
    let env = Env::from_env();
    let keep = std::env::var_os("CLRBPF_CAPTURE_DIR").map(std::path::PathBuf::from);
    for runtime in [Runtime::Net8, Runtime::NetCore31] {
        let app = start_gc_counts(&env, runtime);
        let client = DiagnosticClient::discover(&ProcFs::default(), app.pid()).expect("socket");
        let payload = collect_tracing2_payload(SESSION_BUFFER_MB, false, &[counters_provider(1)]);
        let (mut stream, session_id) = client.collect_tracing(&payload).expect("session");
        let reader = thread::spawn(move || {
            let mut raw = Vec::new();
            let _ = stream.read_to_end(&mut raw);
            raw
        });
        wait_counts(&app, "AFTER");
        thread::sleep(Duration::from_millis(1500));
        client.stop_tracing(session_id).expect("stop");
        let raw = reader.join().expect("reader");
        if let Some(dir) = &keep {
            let name = match runtime {
                Runtime::Net8 => "net8.counters.nettrace",
                Runtime::NetCore31 => "netcore31.counters.nettrace",
            };
            std::fs::write(dir.join(name), &raw).expect("write the capture");
        }
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
