use std::sync::Arc;

use super::*;
use clrbpf_parse::nettrace::{EventMetadata, EventRecord, FieldDescription};

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
    let dir = tempfile::tempdir().expect("tempdir");
    let stat = "4242 (a) b) (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 1000000 300 18446744073709551615";
    std::fs::create_dir_all(dir.path().join("4242")).expect("mkdir");
    std::fs::write(dir.path().join("4242/stat"), stat).expect("stat");
    std::fs::write(dir.path().join("4242/statm"), "1000 300 100 1 0 200 0").expect("statm");
    std::fs::create_dir_all(dir.path().join("7")).expect("mkdir");
    std::fs::write(dir.path().join("7/stat"), "garbage").expect("stat");
    let procfs = ProcFs::new(dir.path());
    assert_eq!(procfs.cpu_ticks(4242), Some((250, 50)));
    let ticks = crate::process::clock_ticks_per_second().expect("ticks") as f64;
    let usage = ProcessUsage::read(&procfs, 4242).expect("usage");
    assert_eq!(usage.user_seconds, 250.0 / ticks);
    assert_eq!(usage.system_seconds, 50.0 / ticks);
    assert_eq!(usage.resident_bytes, 300 * crate::process::page_size());
    assert!(ProcessUsage::read(&procfs, 7).is_none());
}

#[test]
fn the_provider_asks_for_the_interval() {
    let provider = counters_provider(15);
    assert_eq!(provider.name, "System.Runtime");
    assert_eq!(provider.filter, "EventCounterIntervalSec=15");
    assert_eq!(counters_provider(0).filter, "EventCounterIntervalSec=1");
}

/// The totals of every counter in a captured stream (see
/// `nettrace/testdata/README.md`).
fn capture_totals(name: &str) -> (RuntimeSnapshot, usize) {
    use std::io::Read as _;

    use clrbpf_parse::nettrace::{NettraceParser, ParsedItem};
    let path = format!(
        "{}/../profiler-parse/src/nettrace/testdata/{name}",
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

/// A counter value of `name` measured over `interval_sec`.
fn sample(name: &str, kind: CounterKind, value: f64, interval_sec: f32) -> CounterSample {
    CounterSample {
        name: name.to_owned(),
        kind,
        value,
        interval_sec,
        display_units: String::new(),
        time_ns: 0,
    }
}

#[test]
fn totals_are_the_same_at_any_counter_interval() {
    // The same 10 s of a process, as ten values a second apart and as two
    // values 5 s apart: incrementing counters add up to the same totals,
    // polling ones keep the last value.
    let increments = [3.0, 0.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0];
    let heap = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0, 19.0];
    let mut every_second = RuntimeCounters::new();
    for (increment, heap) in increments.iter().zip(heap) {
        every_second.observe(&sample("gen-0-gc-count", CounterKind::Sum, *increment, 1.0));
        every_second.observe(&sample("gc-heap-size", CounterKind::Mean, heap, 1.0));
    }
    let mut every_5s = RuntimeCounters::new();
    for half in increments.chunks(5) {
        let increment = half.iter().sum();
        every_5s.observe(&sample("gen-0-gc-count", CounterKind::Sum, increment, 5.0));
    }
    every_5s.observe(&sample("gc-heap-size", CounterKind::Mean, 15.0, 5.0));
    every_5s.observe(&sample("gc-heap-size", CounterKind::Mean, 19.0, 5.0));
    assert_eq!(every_second.snapshot(), every_5s.snapshot());
    assert_eq!(every_5s.snapshot().totals["gen-0-gc-count"], 36.0);
    assert_eq!(every_5s.snapshot().last["gc-heap-size"], 19.0);
    // A negative increment or a value that is not a number changes nothing.
    every_5s.observe(&sample("gen-0-gc-count", CounterKind::Sum, -4.0, 5.0));
    every_5s.observe(&sample("gc-heap-size", CounterKind::Mean, f64::NAN, 5.0));
    assert_eq!(every_second.snapshot(), every_5s.snapshot());
}

#[test]
fn only_the_needed_strings_are_read_and_the_others_still_bounded() {
    let provider: Arc<str> = Arc::from(RUNTIME_COUNTERS_PROVIDER);
    let mut decoder = CounterDecoder::new();
    decoder.on_metadata(&metadata(8, true));
    // A display name far over the kept length is stepped over whole.
    let mut payload = Vec::new();
    utf16z("exception-count", &mut payload);
    utf16z(&"x".repeat(10_000), &mut payload);
    utf16z("00:01:00", &mut payload);
    payload.extend(7.0f64.to_le_bytes());
    // IntervalSec, as .NET 8 writes it in the first value of a 5 s period:
    // the period comes from Series.
    payload.extend(1.0f32.to_le_bytes());
    utf16z("Interval=5000", &mut payload);
    utf16z("Sum", &mut payload);
    utf16z("", &mut payload);
    utf16z("", &mut payload);
    let decoded = decoder.decode(&record(&provider, 8, &payload)).unwrap();
    assert_eq!(
        decoded,
        Ok(sample("exception-count", CounterKind::Sum, 7.0, 5.0))
    );
    // The same display name without its terminator.
    let name_len = "exception-count".len() * 2 + 2;
    let unterminated = &payload[..name_len + 10_000 * 2];
    assert_eq!(
        decoder.decode(&record(&provider, 8, unterminated)).unwrap(),
        Err(CounterDecodeError::Truncated)
    );
}

#[test]
fn a_counter_that_jumps_to_the_top_stays_finite() {
    // The target writes the values: one that goes backwards counts as no
    // increment, and two of f64::MAX do not make +Inf on /metrics.
    let mut counters = RuntimeCounters::new();
    for value in [5.0, -1e300, f64::MAX, f64::MAX, u64::MAX as f64] {
        counters.observe(&sample("exception-count", CounterKind::Sum, value, 1.0));
    }
    let total = counters.snapshot().totals["exception-count"];
    assert!(total.is_finite() && total == f64::MAX, "{total}");
}
