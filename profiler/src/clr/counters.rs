//! .NET runtime metrics read from outside the process: the `System.Runtime`
//! EventCounters (.NET Core 3.0 and later), enabled on the EventPipe
//! session the agent already holds and turned into the OpenTelemetry .NET
//! runtime metrics (`dotnet.*`) in their Prometheus form.
//!
//! 1. [`counters_provider`] asks for the provider with the filter
//!    `EventCounterIntervalSec=N`: every N seconds the runtime writes one
//!    `EventCounters` event per counter.
//! 2. Those events are self-describing: their metadata carries the field
//!    list ([`clrbpf_parse::nettrace::FieldDescription`]), one `Payload`
//!    object holding `Name`, `Mean` (polling counters: the value now) or
//!    `Increment` (incrementing counters: the change over the interval),
//!    `CounterType` (`Mean`/`Sum`), `IntervalSec`, `DisplayUnits`, ...
//!    [`CounterDecoder`] reads the payload by that list, whatever the field
//!    order or the runtime version, into a [`CounterSample`].
//! 3. [`RuntimeCounters`] keeps, per process, the sum of each incrementing
//!    counter and the last value of each polling one ([`RuntimeSnapshot`]).
//!    [`RUNTIME_FAMILIES`] maps them to the metric families.
//!
//! Limits: incrementing counters only say how much happened since the
//! session began (the runtime takes its baseline when the counters are
//! enabled), so `dotnet_gc_collections_total` and the other `_total`
//! series count from the moment the agent attached, which is what
//! Prometheus' `rate()` and `increase()` need. Sizes the runtime reports in
//! MB (`gc-heap-size`, `gc-committed`) are rounded by the runtime to 1 MB.
//! CPU time and the working set come from `/proc` ([`ProcessUsage`]):
//! exact, and available for every process.

use std::collections::BTreeMap;

use clrbpf_parse::nettrace::{
    EventMetadata, EventRecord, FieldDescription, reader::ByteReader, type_code,
};

use super::session::ProviderConfig;
use crate::process::ProcFs;

/// The runtime's EventSource of counters.
pub const RUNTIME_COUNTERS_PROVIDER: &str = "System.Runtime";
/// The event every counter value arrives in.
pub const EVENT_COUNTERS_EVENT: &str = "EventCounters";
/// Longest counter name or unit kept, in UTF-16 code units.
const MAX_COUNTER_TEXT_UNITS: usize = 128;
/// Counters kept per process: the runtime has about 25.
const MAX_COUNTERS_PER_PROCESS: usize = 128;

/// The provider entry of a CollectTracing request that makes the runtime
/// publish its counters every `interval_sec` seconds (at least 1).
pub fn counters_provider(interval_sec: u32) -> ProviderConfig {
    ProviderConfig {
        name: RUNTIME_COUNTERS_PROVIDER.to_owned(),
        // The counters are written at LogAlways with no keyword; all
        // keywords as dotnet-counters asks, so nothing is filtered out.
        keywords: 0xffff_ffff,
        level: 4,
        filter: format!("EventCounterIntervalSec={}", interval_sec.max(1)),
    }
}

/// How a counter's value is to be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterKind {
    /// A polling counter: `value` is the value now (the mean over the
    /// interval for an EventCounter).
    Mean,
    /// An incrementing counter: `value` is the change over the interval.
    Sum,
}

/// One counter value, as decoded from an `EventCounters` event.
#[derive(Clone, Debug, PartialEq)]
pub struct CounterSample {
    /// `gen-0-gc-count`, `cpu-usage`, ...
    pub name: String,
    pub kind: CounterKind,
    pub value: f64,
    /// The runtime's counter period, from `Series` (`Interval=5000`, in
    /// ms), else the `IntervalSec` it measured. Not the first value's time
    /// since the counters' baseline: .NET 8 writes `IntervalSec` 1.0 in the
    /// first value of a 5 s period.
    pub interval_sec: f32,
    /// `MB`, `B`, `%`, `ms` or empty.
    pub display_units: String,
    /// When the runtime wrote it (CLOCK_MONOTONIC ns; 0 if unknown).
    pub time_ns: u64,
}

/// Why an `EventCounters` payload could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CounterDecodeError {
    #[error("the EventCounters metadata has no `Payload` object")]
    NoPayloadObject,
    #[error("the payload is shorter than its metadata says")]
    Truncated,
    #[error("field `{name}` has type code {type_code}, which payloads cannot hold")]
    UnsupportedType { name: String, type_code: u32 },
    #[error("the counter has no `Name`, or neither `Mean` nor `Increment`")]
    MissingField,
}

/// Decodes the `EventCounters` events of [`RUNTIME_COUNTERS_PROVIDER`],
/// learning their layouts from the metadata records of the stream.
#[derive(Debug, Default)]
pub struct CounterDecoder {
    /// Metadata id -> the fields of the `Payload` object.
    layouts: BTreeMap<u32, Box<[FieldDescription]>>,
}

impl CounterDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed every metadata record of the stream.
    pub fn on_metadata(&mut self, metadata: &EventMetadata) {
        if &*metadata.provider != RUNTIME_COUNTERS_PROVIDER
            || &*metadata.event_name != EVENT_COUNTERS_EVENT
        {
            return;
        }
        // The runtime describes `{ "": { Payload: { Name, ... } } }` (an
        // unnamed wrapper object); an empty list means no layout.
        let layout = if has_payload_object(&metadata.fields, 0) {
            metadata.fields.clone()
        } else {
            Box::new([])
        };
        self.layouts.insert(metadata.metadata_id, layout);
    }

    /// `None` for events that are not counters; an error for a counter
    /// event whose payload does not match its metadata.
    pub fn decode(
        &self,
        record: &EventRecord<'_>,
    ) -> Option<Result<CounterSample, CounterDecodeError>> {
        let fields = self.layouts.get(&record.metadata_id)?;
        if fields.is_empty() {
            return Some(Err(CounterDecodeError::NoPayloadObject));
        }
        Some(decode_counter_payload(fields, record.payload))
    }
}

/// Whether an `Object` field called `Payload` is among `fields`, at any
/// depth.
fn has_payload_object(fields: &[FieldDescription], depth: u32) -> bool {
    depth < 8
        && fields.iter().any(|field| {
            field.type_code == type_code::OBJECT
                && (&*field.name == "Payload" || has_payload_object(&field.fields, depth + 1))
        })
}

/// The fields of a `Payload` object that make a [`CounterSample`], as read.
#[derive(Default)]
struct PayloadFields {
    name: Option<String>,
    mean: Option<f64>,
    increment: Option<f64>,
    /// `CounterType` is `Sum` (an incrementing counter).
    sum: Option<bool>,
    interval_sec: f32,
    /// The period in `Series`, in seconds.
    period_sec: Option<f32>,
    display_units: String,
}

impl PayloadFields {
    /// Whether a string field is one of ours: the others (`DisplayName`,
    /// `Metadata`) are stepped over undecoded.
    fn wants_text(name: &str) -> bool {
        matches!(name, "Name" | "CounterType" | "DisplayUnits" | "Series")
    }

    fn text(&mut self, name: &str, text: String) {
        match name {
            "Name" => self.name = Some(text),
            "CounterType" => self.sum = Some(text == "Sum"),
            "DisplayUnits" => self.display_units = text,
            "Series" => {
                self.period_sec = text
                    .strip_prefix("Interval=")
                    .and_then(|ms| ms.parse::<u32>().ok())
                    .map(|ms| ms as f32 / 1000.0);
            }
            _ => {}
        }
    }

    fn number(&mut self, name: &str, value: f64) {
        match name {
            "Mean" => self.mean = Some(value),
            "Increment" => self.increment = Some(value),
            "IntervalSec" => self.interval_sec = value as f32,
            _ => {}
        }
    }
}

/// Reads the `Payload` object's fields in metadata order. Field names are
/// unique within the payload object.
fn decode_counter_payload(
    fields: &[FieldDescription],
    payload: &[u8],
) -> Result<CounterSample, CounterDecodeError> {
    let mut r = ByteReader::new(payload);
    let mut read = PayloadFields::default();
    for field in fields {
        read_field(&mut r, field, 0, &mut read)?;
    }
    let PayloadFields {
        name,
        mean,
        increment,
        sum,
        interval_sec,
        period_sec,
        display_units,
    } = read;
    let name = name.filter(|name| !name.is_empty());
    let (kind, value) = match (sum, mean, increment) {
        (Some(true), _, Some(value)) | (None, None, Some(value)) => (CounterKind::Sum, value),
        (_, Some(value), _) => (CounterKind::Mean, value),
        (_, None, Some(value)) => (CounterKind::Sum, value),
        _ => return Err(CounterDecodeError::MissingField),
    };
    Ok(CounterSample {
        name: name.ok_or(CounterDecodeError::MissingField)?,
        kind,
        value,
        interval_sec: period_sec.unwrap_or(interval_sec),
        display_units,
        time_ns: 0,
    })
}

/// Reads one field into `read`: numbers by name, strings only when
/// [`PayloadFields::wants_text`] (the others cost no allocation).
fn read_field(
    r: &mut ByteReader<'_>,
    field: &FieldDescription,
    depth: u32,
    read: &mut PayloadFields,
) -> Result<(), CounterDecodeError> {
    let truncated = |_| CounterDecodeError::Truncated;
    let skip = |r: &mut ByteReader<'_>, len: usize| r.skip(len, "field").map_err(truncated);
    let number = match field.type_code {
        type_code::OBJECT if depth < 8 => {
            for nested in &field.fields {
                read_field(r, nested, depth + 1, read)?;
            }
            return Ok(());
        }
        type_code::BOOLEAN | type_code::INT32 => {
            f64::from(r.u32("field").map_err(truncated)? as i32)
        }
        type_code::UINT32 => f64::from(r.u32("field").map_err(truncated)?),
        type_code::INT64 => r.u64("field").map_err(truncated)? as i64 as f64,
        type_code::UINT64 => r.u64("field").map_err(truncated)? as f64,
        type_code::SINGLE => f64::from(f32::from_bits(r.u32("field").map_err(truncated)?)),
        type_code::DOUBLE => r.f64("field").map_err(truncated)?,
        type_code::STRING if PayloadFields::wants_text(&field.name) => {
            let text = r
                .utf16z(MAX_COUNTER_TEXT_UNITS, "field")
                .map_err(truncated)?;
            read.text(&field.name, text);
            return Ok(());
        }
        type_code::STRING => return r.skip_utf16z("field").map_err(truncated),
        type_code::SBYTE | type_code::BYTE => return skip(r, 1),
        type_code::CHAR | type_code::INT16 | type_code::UINT16 => return skip(r, 2),
        type_code::DATE_TIME => return skip(r, 8),
        type_code::DECIMAL | type_code::GUID => return skip(r, 16),
        type_code => {
            return Err(CounterDecodeError::UnsupportedType {
                name: field.name.to_string(),
                type_code,
            });
        }
    };
    read.number(&field.name, number);
    Ok(())
}

/// CPU time and memory of a process from `/proc/PID/stat` and `statm`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcessUsage {
    pub user_seconds: f64,
    pub system_seconds: f64,
    pub resident_bytes: u64,
}

impl ProcessUsage {
    /// Reads host process `pid`; `None` when it is gone or unreadable.
    pub fn read(procfs: &ProcFs, pid: u32) -> Option<Self> {
        let (user, system) = procfs.cpu_ticks(pid)?;
        let ticks = crate::process::clock_ticks_per_second()? as f64;
        Some(Self {
            user_seconds: user as f64 / ticks,
            system_seconds: system as f64 / ticks,
            resident_bytes: procfs.resident_bytes(&pid.to_string())?,
        })
    }
}

/// What is known of one process's runtime counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RuntimeSnapshot {
    /// Incrementing counters: the sum of their increments since the
    /// session began.
    pub totals: BTreeMap<String, f64>,
    /// Polling counters: the last value.
    pub last: BTreeMap<String, f64>,
    pub usage: Option<ProcessUsage>,
}

/// A .NET process's runtime metrics as last read, with its labels.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessRuntimeMetrics {
    pub pid: u32,
    pub executable: String,
    /// Its pod's labels, Prometheus-named (`namespace`, `pod`,
    /// `container`), in Kubernetes.
    pub k8s: Vec<(&'static str, String)>,
    pub snapshot: RuntimeSnapshot,
}

/// The counters of one process; see the module documentation.
#[derive(Clone, Debug, Default)]
pub struct RuntimeCounters {
    snapshot: RuntimeSnapshot,
}

impl RuntimeCounters {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn observe(&mut self, sample: &CounterSample) {
        let known = self.snapshot.totals.len() + self.snapshot.last.len();
        let map = match sample.kind {
            CounterKind::Sum => &mut self.snapshot.totals,
            CounterKind::Mean => &mut self.snapshot.last,
        };
        if !sample.value.is_finite()
            || (!map.contains_key(&sample.name) && known >= MAX_COUNTERS_PER_PROCESS)
        {
            return;
        }
        let value = match sample.kind {
            CounterKind::Sum => sample.value.max(0.0),
            CounterKind::Mean => sample.value,
        };
        // The name is copied once, when the counter is first seen.
        match map.get_mut(&sample.name) {
            // The values are the target's: a sum stays finite (a counter
            // that jumps to 1e308 twice is not +Inf on /metrics).
            Some(slot) if sample.kind == CounterKind::Sum => *slot = (*slot + value).min(f64::MAX),
            Some(slot) => *slot = value,
            None => {
                map.insert(sample.name.clone(), value);
            }
        }
    }

    pub fn set_usage(&mut self, usage: Option<ProcessUsage>) {
        self.snapshot.usage = usage;
    }

    pub fn snapshot(&self) -> &RuntimeSnapshot {
        &self.snapshot
    }
}

/// Where a family's values come from.
#[derive(Clone, Copy, Debug)]
enum Source {
    /// The sum of an incrementing counter, times a scale.
    Total(&'static str, f64),
    /// The last value of a polling counter, times a scale.
    Last(&'static str, f64),
    /// Collections of each generation: `gen-N-gc-count` counts the
    /// collections of generation N *or higher* (GC.CollectionCount); the
    /// OpenTelemetry metric counts those of exactly that generation.
    GcCollections,
    /// `gen-0-size` .. `poh-size` by generation.
    HeapSizes,
    CpuTime,
    WorkingSet,
}

/// One `dotnet_*` metric family.
#[derive(Clone, Copy, Debug)]
pub struct RuntimeFamily {
    /// The name without its unit and `_total` suffixes (the encoder adds
    /// them).
    pub name: &'static str,
    pub help: &'static str,
    pub unit: Option<&'static str>,
    /// A counter (`_total`) rather than a gauge.
    pub monotonic: bool,
    source: Source,
}

/// The attribute of the generation families (OpenTelemetry
/// `dotnet.gc.heap.generation`).
pub const GENERATION_LABEL: &str = "dotnet_gc_heap_generation";
/// The attribute of the CPU time family (OpenTelemetry `cpu.mode`).
pub const CPU_MODE_LABEL: &str = "cpu_mode";

impl RuntimeFamily {
    /// The family's values for one process: `(attribute, value)` pairs.
    pub fn values(&self, s: &RuntimeSnapshot) -> Vec<(Option<(&'static str, &'static str)>, f64)> {
        let total = |name: &str| s.totals.get(name).copied();
        match self.source {
            Source::Total(name, scale) => {
                total(name).map(|v| (None, v * scale)).into_iter().collect()
            }
            Source::Last(name, scale) => s
                .last
                .get(name)
                .map(|v| (None, v * scale))
                .into_iter()
                .collect(),
            Source::GcCollections => {
                let (Some(gen0), Some(gen1), Some(gen2)) = (
                    total("gen-0-gc-count"),
                    total("gen-1-gc-count"),
                    total("gen-2-gc-count"),
                ) else {
                    return Vec::new();
                };
                vec![
                    (Some((GENERATION_LABEL, "gen0")), (gen0 - gen1).max(0.0)),
                    (Some((GENERATION_LABEL, "gen1")), (gen1 - gen2).max(0.0)),
                    (Some((GENERATION_LABEL, "gen2")), gen2),
                ]
            }
            Source::HeapSizes => [
                ("gen-0-size", "gen0"),
                ("gen-1-size", "gen1"),
                ("gen-2-size", "gen2"),
                ("loh-size", "loh"),
                ("poh-size", "poh"),
            ]
            .into_iter()
            .filter_map(|(counter, generation)| {
                s.last
                    .get(counter)
                    .map(|v| (Some((GENERATION_LABEL, generation)), *v))
            })
            .collect(),
            Source::CpuTime => s
                .usage
                .map(|usage| {
                    vec![
                        (Some((CPU_MODE_LABEL, "user")), usage.user_seconds),
                        (Some((CPU_MODE_LABEL, "system")), usage.system_seconds),
                    ]
                })
                .unwrap_or_default(),
            Source::WorkingSet => match s.usage {
                Some(usage) => vec![(None, usage.resident_bytes as f64)],
                None => s
                    .last
                    .get("working-set")
                    .map(|mb| (None, mb * 1e6))
                    .into_iter()
                    .collect(),
            },
        }
    }
}

const fn family(
    name: &'static str,
    help: &'static str,
    unit: Option<&'static str>,
    monotonic: bool,
    source: Source,
) -> RuntimeFamily {
    RuntimeFamily {
        name,
        help,
        unit,
        monotonic,
        source,
    }
}

/// Every `dotnet_*` family, named after the OpenTelemetry .NET runtime
/// semantic conventions (`dotnet.gc.collections` ->
/// `dotnet_gc_collections_total`), plus `dotnet_gc_heap_size_bytes` (the
/// EventCounter `gc-heap-size`, which has no OpenTelemetry twin).
pub const RUNTIME_FAMILIES: &[RuntimeFamily] = &[
    family(
        "dotnet_gc_collections",
        "Garbage collections of each generation since the agent attached",
        None,
        true,
        Source::GcCollections,
    ),
    family(
        "dotnet_gc_heap_size",
        "GC heap size (GC.GetTotalMemory), 1 MB resolution",
        Some("bytes"),
        false,
        Source::Last("gc-heap-size", 1e6),
    ),
    family(
        "dotnet_gc_last_collection_heap_size",
        "Size of each generation after the last collection",
        Some("bytes"),
        false,
        Source::HeapSizes,
    ),
    family(
        "dotnet_gc_heap_total_allocated",
        "Bytes allocated on the GC heap since the agent attached",
        Some("bytes"),
        true,
        Source::Total("alloc-rate", 1.0),
    ),
    family(
        "dotnet_gc_pause_time",
        "Time paused by the GC since the agent attached (.NET 7+)",
        Some("seconds"),
        true,
        Source::Total("total-pause-time-by-gc", 1e-3),
    ),
    family(
        "dotnet_gc_committed_memory_size",
        "Memory committed by the GC (.NET 6+), 1 MB resolution",
        Some("bytes"),
        false,
        Source::Last("gc-committed", 1e6),
    ),
    family(
        "dotnet_thread_pool_thread_count",
        "Thread pool threads",
        None,
        false,
        Source::Last("threadpool-thread-count", 1.0),
    ),
    family(
        "dotnet_thread_pool_queue_length",
        "Work items queued to the thread pool",
        None,
        false,
        Source::Last("threadpool-queue-length", 1.0),
    ),
    family(
        "dotnet_thread_pool_work_item_count",
        "Thread pool work items completed since the agent attached",
        None,
        true,
        Source::Total("threadpool-completed-items-count", 1.0),
    ),
    family(
        "dotnet_monitor_lock_contentions",
        "Monitor lock contentions since the agent attached",
        None,
        true,
        Source::Total("monitor-lock-contention-count", 1.0),
    ),
    family(
        "dotnet_exceptions",
        "Exceptions thrown since the agent attached",
        None,
        true,
        Source::Total("exception-count", 1.0),
    ),
    family(
        "dotnet_jit_compiled_methods",
        "Methods JIT-compiled since the process started (.NET 6+)",
        None,
        true,
        Source::Last("methods-jitted-count", 1.0),
    ),
    family(
        "dotnet_jit_compiled_il_size",
        "IL bytes JIT-compiled since the process started (.NET 6+)",
        Some("bytes"),
        true,
        Source::Last("il-bytes-jitted", 1.0),
    ),
    family(
        "dotnet_jit_compilation_time",
        "Time spent JIT-compiling since the agent attached (.NET 6+)",
        Some("seconds"),
        true,
        Source::Total("time-in-jit", 1e-3),
    ),
    family(
        "dotnet_timer_count",
        "Active timers",
        None,
        false,
        Source::Last("active-timer-count", 1.0),
    ),
    family(
        "dotnet_assembly_count",
        "Assemblies loaded",
        None,
        false,
        Source::Last("assembly-count", 1.0),
    ),
    family(
        "dotnet_process_memory_working_set",
        "Resident set size of the process",
        Some("bytes"),
        false,
        Source::WorkingSet,
    ),
    family(
        "dotnet_process_cpu_time",
        "CPU time of the process since it started, by mode",
        Some("seconds"),
        true,
        Source::CpuTime,
    ),
];

#[cfg(test)]
mod tests;
