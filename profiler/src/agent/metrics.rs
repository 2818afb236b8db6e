//! The agent's `/metrics`: a [`prometheus_client`] registry with two kinds
//! of series, rendered in the OpenMetrics text format Prometheus scrapes.
//!
//! - The agent's own (`clrbpf_agent_*`): counters and gauges the pipeline
//!   and the delivery queues update as they go ([`AgentMetrics`],
//!   [`SinkCounters`]), plus the agent's RSS read at each scrape.
//! - .NET runtime metrics per .NET process (`dotnet_*`), read from the
//!   `System.Runtime` EventCounters of each process
//!   ([`crate::clr::counters`]) and kept in a [`RuntimeMetricsStore`] that
//!   encodes them at each scrape, so a process that exits just disappears.

use std::{
    collections::BTreeMap,
    fmt,
    sync::{Arc, Mutex},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::Histogram,
    },
    registry::{Registry, Unit},
};

use super::queue::DropReason;
pub use crate::clr::counters::ProcessRuntimeMetrics;

/// Labels of a per-sink series.
type SinkLabels = Vec<(&'static str, &'static str)>;

/// Buckets of the upload time histogram, in seconds.
const UPLOAD_BUCKETS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Every series the agent exports; cheap to clone (the metrics are shared).
#[derive(Clone)]
pub struct AgentMetrics {
    registry: Arc<Registry>,
    /// Samples taken, by `kind` (`cpu`, `off_cpu`, ...). The pipeline adds
    /// each window's count.
    pub samples: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// Samples the kernel could not hand over (full rings).
    pub samples_lost: Counter,
    /// Time the BPF programs ran (`bpf_stats`), in seconds.
    pub bpf_run_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    pub processes_tracked: Gauge,
    pub dotnet_processes_tracked: Gauge,
    /// Kernel memory held by unwind tables.
    pub unwind_table_bytes: Gauge,
    /// EventCounters payloads that could not be decoded.
    pub runtime_counter_errors: Counter,
    /// Services shipped as the overflow service (over `--max-services`).
    pub services_over_cap: Counter,
    /// On-demand profiles being taken (`/debug/pprof/profile`).
    pub pulls_running: Gauge,
    /// Time the loop spent naming CPU stacks at window ends, in seconds.
    pub stack_naming_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    /// Distinct raw CPU stacks named (once per window).
    pub stacks_named: Counter,
    /// Debug files asked of symbol servers, by `outcome` (`requested`,
    /// `downloaded`, `missing`, `refused`, `dropped`).
    pub symbol_downloads: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// Connections to `--listen` closed to make room, by the cap reached.
    http_connections_shed: Family<Vec<(&'static str, &'static str)>, Counter>,
    shipped: Family<SinkLabels, Counter>,
    failed: Family<SinkLabels, Counter>,
    dropped: Family<SinkLabels, Counter>,
    queue_length: Family<SinkLabels, Gauge>,
    upload_seconds: Family<SinkLabels, Histogram>,
    runtime: Arc<RuntimeMetricsStore>,
    /// Each sink's "accepting" flag, by name.
    sinks: Arc<Mutex<BTreeMap<&'static str, Arc<std::sync::atomic::AtomicBool>>>>,
}

/// One sink's series, handed to its [`super::queue::DeliveryQueue`].
#[derive(Clone, Debug)]
pub struct SinkCounters {
    pub shipped: Counter,
    /// Upload attempts that failed (a window retried 3 times counts 3).
    pub failed: Counter,
    pub queue_length: Gauge,
    pub upload_seconds: Histogram,
    sink: &'static str,
    dropped: Family<SinkLabels, Counter>,
    /// Whether the last upload went through (true until one fails).
    accepting: Arc<std::sync::atomic::AtomicBool>,
}

impl SinkCounters {
    /// Records whether the sink's last upload went through (`/readyz`).
    pub fn set_accepting(&self, accepting: bool) {
        self.accepting
            .store(accepting, std::sync::atomic::Ordering::Relaxed);
    }

    /// The counter of windows dropped for `reason`.
    pub fn dropped(&self, reason: DropReason) -> Counter {
        self.dropped
            .get_or_create(&vec![("sink", self.sink), ("reason", reason.name())])
            .clone()
    }
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentMetrics").finish_non_exhaustive()
    }
}

/// Registers a clone of `metric` in `registry` as `name` (with `unit`,
/// when given).
fn register<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    metric: &M,
) {
    match unit {
        Some(unit) => registry.register_with_unit(name, help, unit, metric.clone()),
        None => registry.register(name, help, metric.clone()),
    }
}

impl AgentMetrics {
    pub fn new() -> Self {
        let mut metrics = Self {
            registry: Arc::default(),
            samples: Family::default(),
            samples_lost: Counter::default(),
            bpf_run_seconds: Counter::default(),
            processes_tracked: Gauge::default(),
            dotnet_processes_tracked: Gauge::default(),
            unwind_table_bytes: Gauge::default(),
            runtime_counter_errors: Counter::default(),
            services_over_cap: Counter::default(),
            pulls_running: Gauge::default(),
            stack_naming_seconds: Counter::default(),
            stacks_named: Counter::default(),
            symbol_downloads: Family::default(),
            shipped: Family::default(),
            failed: Family::default(),
            dropped: Family::default(),
            queue_length: Family::default(),
            upload_seconds: Family::<SinkLabels, Histogram>::new_with_constructor(
                (|| Histogram::new(UPLOAD_BUCKETS)) as fn() -> Histogram,
            ),
            http_connections_shed: Family::default(),
            runtime: Arc::new(RuntimeMetricsStore::default()),
            sinks: Arc::default(),
        };
        let mut registry = Registry::default();
        let agent = registry.sub_registry_with_prefix("clrbpf_agent");
        metrics.register_pipeline_series(agent);
        metrics.register_sink_series(agent);
        agent.register_collector(Box::new(SelfCollector));
        agent.register_collector(Box::new(MemoryBudgetCollector));
        agent.register_collector(Box::new(MemoryNamingCollector));
        registry.register_collector(Box::new(Arc::clone(&metrics.runtime)));
        metrics.registry = Arc::new(registry);
        metrics
    }

    /// The series of what the agent samples, tracks and names.
    fn register_pipeline_series(&self, agent: &mut Registry) {
        register(
            agent,
            "samples",
            "Samples taken, by kind",
            None,
            &self.samples,
        );
        register(
            agent,
            "samples_lost",
            "Samples lost before userspace read them (full rings)",
            None,
            &self.samples_lost,
        );
        register(
            agent,
            "bpf_run",
            "Time the BPF programs ran",
            Some(Unit::Seconds),
            &self.bpf_run_seconds,
        );
        register(
            agent,
            "processes_tracked",
            "Processes the agent tracks",
            None,
            &self.processes_tracked,
        );
        register(
            agent,
            "dotnet_processes_tracked",
            ".NET processes the agent tracks",
            None,
            &self.dotnet_processes_tracked,
        );
        register(
            agent,
            "unwind_table",
            "Kernel memory held by unwind tables",
            Some(Unit::Bytes),
            &self.unwind_table_bytes,
        );
        register(
            agent,
            "runtime_counter_errors",
            "System.Runtime EventCounters payloads that could not be decoded",
            None,
            &self.runtime_counter_errors,
        );
        register(
            agent,
            "services_over_cap",
            "Services shipped as clrbpf-overflow because a window had more than --max-services",
            None,
            &self.services_over_cap,
        );
        register(
            agent,
            "pulls_running",
            "On-demand profiles being taken (/debug/pprof/profile); a pull ends when its client goes away",
            None,
            &self.pulls_running,
        );
        register(
            agent,
            "stack_naming",
            "Time spent naming CPU stacks at window ends (symbol tables, debug files, perf maps, runtime memory)",
            Some(Unit::Seconds),
            &self.stack_naming_seconds,
        );
        register(
            agent,
            "stacks_named",
            "Distinct CPU stacks named, once per window",
            None,
            &self.stacks_named,
        );
        register(
            agent,
            "symbol_downloads",
            "Debug files asked of symbol servers, by outcome (requested, downloaded, missing, refused, dropped)",
            None,
            &self.symbol_downloads,
        );
    }

    /// The series of the sinks' deliveries and of the `--listen` server.
    fn register_sink_series(&self, agent: &mut Registry) {
        register(
            agent,
            "http_connections_shed",
            "Connections to --listen closed to make room (an idle one evicted or the new one refused), by the cap reached (per_peer: 16 from one address; total: 128)",
            None,
            &self.http_connections_shed,
        );
        register(
            agent,
            "windows_shipped",
            "Windows delivered, per sink",
            None,
            &self.shipped,
        );
        register(
            agent,
            "window_upload_failures",
            "Failed upload attempts, per sink",
            None,
            &self.failed,
        );
        register(
            agent,
            "windows_dropped",
            "Windows given up, per sink and reason (queue_full, rejected, retries_exhausted, shutdown)",
            None,
            &self.dropped,
        );
        register(
            agent,
            "queue_length",
            "Windows waiting for delivery, per sink",
            None,
            &self.queue_length,
        );
        register(
            agent,
            "upload_duration",
            "Time of one upload attempt, per sink",
            Some(Unit::Seconds),
            &self.upload_seconds,
        );
    }

    /// The counters the HTTP server bumps when it sheds a connection.
    pub fn shed_connections(&self) -> super::server::ShedConnections {
        let reason = |name| {
            self.http_connections_shed
                .get_or_create(&vec![("cap", name)])
                .clone()
        };
        super::server::ShedConnections {
            per_peer: reason("per_peer"),
            total: reason("total"),
        }
    }

    /// Whether at least one sink's last upload went through (a sink that
    /// has not uploaded yet counts as accepting).
    pub fn any_sink_accepting(&self) -> bool {
        self.sinks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .any(|flag| flag.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The series of sink `name` (created at 0, so they show before the
    /// first window).
    pub fn sink_counters(&self, name: &'static str) -> SinkCounters {
        let labels = vec![("sink", name)];
        let accepting = Arc::clone(
            self.sinks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .entry(name)
                .or_insert_with(|| Arc::new(std::sync::atomic::AtomicBool::new(true))),
        );
        SinkCounters {
            accepting,
            shipped: self.shipped.get_or_create(&labels).clone(),
            failed: self.failed.get_or_create(&labels).clone(),
            queue_length: self.queue_length.get_or_create(&labels).clone(),
            upload_seconds: self.upload_seconds.get_or_create(&labels).clone(),
            sink: name,
            dropped: self.dropped.clone(),
        }
    }

    /// The per-process .NET runtime metrics.
    pub fn runtime(&self) -> &Arc<RuntimeMetricsStore> {
        &self.runtime
    }

    /// The OpenMetrics text of every series.
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail; an encoder error would be a
        // bug in a collector, and a partial page is still worth serving.
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::warn!(%error, "encoding the metrics failed");
        }
        text
    }
}

/// Reads the agent's own RSS at each scrape.
#[derive(Debug)]
struct SelfCollector;

/// The memory budget ([`crate::memory_budget`]): its size, its pools'
/// use, and what went over it, read at each scrape.
#[derive(Debug)]
struct MemoryBudgetCollector;

impl Collector for MemoryBudgetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        use crate::memory_budget::{self, Pool};
        let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let budget = ConstGauge::new(as_i64(memory_budget::current().total_bytes));
        let metric = encoder.encode_descriptor(
            "memory_budget",
            "The memory budget for what profiled processes can make the agent hold (--memory-budget-mb)",
            Some(&Unit::Bytes),
            budget.metric_type(),
        )?;
        budget.encode(metric)?;

        let mut pools = encoder.encode_descriptor(
            "memory_budget_pool_used",
            "Bytes charged now to a pool of the memory budget",
            Some(&Unit::Bytes),
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (name, pool) in [
            ("mappings", Pool::Mappings),
            ("nettrace", Pool::Nettrace),
            ("memory_names", Pool::MemoryNames),
            ("metadata", Pool::Metadata),
            ("debug_files", Pool::DebugFiles),
        ] {
            let (used, _, _) = pool.usage();
            ConstGauge::new(as_i64(used)).encode(pools.encode_family(&[("pool", name)])?)?;
        }

        let d = memory_budget::drops().snapshot();
        let mut dropped = encoder.encode_descriptor(
            "memory_budget_dropped",
            "What profiled processes' input would have grown past the memory budget, dropped, by what (mappings, maps_files_truncated, files, file_bytes, nettrace_metadata, nettrace_stack_resets, sessions, managed_symbols, memory_names, images)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (what, n) in [
            ("mappings", d.mappings),
            ("maps_files_truncated", d.maps_files_truncated),
            ("files", d.files),
            ("file_bytes", d.file_bytes),
            ("nettrace_metadata", d.nettrace_metadata),
            ("nettrace_stack_resets", d.nettrace_stack_resets),
            ("sessions", d.sessions),
            ("managed_symbols", d.managed_symbols),
            ("memory_names", d.memory_names),
            ("images", d.images),
        ] {
            ConstCounter::new(n).encode(dropped.encode_family(&[("what", what)])?)?;
        }
        encode_refused_files(&mut encoder)
    }
}

/// What the naming budgets of the runtimes' memory refused
/// ([`crate::clr::memory::budget`]), read at each scrape.
#[derive(Debug)]
struct MemoryNamingCollector;

impl Collector for MemoryNamingCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let n = crate::clr::memory::budget::global().counts.snapshot();
        let mut refused = encoder.encode_descriptor(
            "memory_naming_refused",
            "Lookups of .NET frames in a process's memory not made, the frame left unnamed, by why (over_budget: the process's budget for the window was spent; recently_failed: a lookup there had just failed; put_aside: every lookup of the process failed)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (why, count) in [
            ("over_budget", n.over_budget),
            ("recently_failed", n.known_bad),
            ("put_aside", n.put_aside),
        ] {
            ConstCounter::new(count).encode(refused.encode_family(&[("why", why)])?)?;
        }
        let aside = ConstCounter::new(n.processes_put_aside);
        let metric = encoder.encode_descriptor(
            "memory_naming_processes_put_aside",
            "Times a process was put aside by the memory naming path, every lookup of its frames having failed",
            None,
            aside.metric_type(),
        )?;
        aside.encode(metric)?;
        let mut scans = encoder.encode_descriptor(
            "code_heap_scans_over_budget",
            "Scans of .NET code heaps put off (deferred) or stopped at their deadline (cut_short), all processes' scans sharing their time",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (what, count) in [
            ("deferred", n.scans_deferred),
            ("cut_short", n.scans_cut_short),
        ] {
            ConstCounter::new(count).encode(scans.encode_family(&[("what", what)])?)?;
        }
        Ok(())
    }
}

/// The targets' files refused as hostile, by why
/// ([`crate::process::mapped_file`], [`crate::clr::memory::runtime_image`]).
fn encode_refused_files(encoder: &mut DescriptorEncoder) -> Result<(), fmt::Error> {
    let files = crate::process::mapped_file::counts();
    let mut refused = encoder.encode_descriptor(
        "target_files_refused",
        "Files profiled processes map that were refused unread, by why (not_regular: a device, FIFO or directory; replaced: the path is another file than the one mapped; runtime_image: a libcoreclr.so over its caps or sparse)",
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    for (why, n) in [
        ("not_regular", files.not_regular),
        ("replaced", files.replaced),
        (
            "runtime_image",
            crate::clr::memory::runtime_image::refused_images(),
        ),
    ] {
        ConstCounter::new(n).encode(refused.encode_family(&[("why", why)])?)?;
    }
    Ok(())
}

impl Collector for SelfCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        if let Some(bytes) = self_rss_bytes() {
            let gauge = ConstGauge::new(i64::try_from(bytes).unwrap_or(i64::MAX));
            let metric = encoder.encode_descriptor(
                "resident_memory",
                "The agent's resident set size",
                Some(&Unit::Bytes),
                gauge.metric_type(),
            )?;
            gauge.encode(metric)?;
        }
        Ok(())
    }
}

/// The agent's RSS from `/proc/self/statm`.
fn self_rss_bytes() -> Option<u64> {
    crate::process::ProcFs::default().resident_bytes("self")
}

/// The `dotnet_*` series: one entry per .NET process, replaced as its
/// counters arrive, removed when it exits.
#[derive(Debug, Default)]
pub struct RuntimeMetricsStore {
    processes: Mutex<BTreeMap<u32, ProcessRuntimeMetrics>>,
}

impl RuntimeMetricsStore {
    pub fn update(&self, metrics: ProcessRuntimeMetrics) {
        self.lock().insert(metrics.pid, metrics);
    }

    pub fn remove(&self, pid: u32) {
        self.lock().remove(&pid);
    }

    pub fn pids(&self) -> Vec<u32> {
        self.lock().keys().copied().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, ProcessRuntimeMetrics>> {
        self.processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Collector for RuntimeMetricsStore {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let processes: Vec<ProcessRuntimeMetrics> = self.lock().values().cloned().collect();
        if processes.is_empty() {
            return Ok(());
        }
        for family in crate::clr::counters::RUNTIME_FAMILIES {
            let mut rows = Vec::new();
            for process in &processes {
                for (attribute, value) in family.values(&process.snapshot) {
                    let mut labels = vec![
                        ("pid".to_owned(), process.pid.to_string()),
                        ("executable".to_owned(), process.executable.clone()),
                    ];
                    labels.extend(
                        process
                            .k8s
                            .iter()
                            .map(|(key, value)| ((*key).to_owned(), value.clone())),
                    );
                    if let Some((key, value)) = attribute {
                        labels.push((key.to_owned(), value.to_owned()));
                    }
                    rows.push((labels, value));
                }
            }
            if rows.is_empty() {
                continue;
            }
            let unit = family.unit.map(|unit| Unit::Other(unit.to_owned()));
            if family.monotonic {
                let mut metric = encoder.encode_descriptor(
                    family.name,
                    family.help,
                    unit.as_ref(),
                    prometheus_client::metrics::MetricType::Counter,
                )?;
                for (labels, value) in rows {
                    ConstCounter::new(value).encode(metric.encode_family(&labels)?)?;
                }
            } else {
                let mut metric = encoder.encode_descriptor(
                    family.name,
                    family.help,
                    unit.as_ref(),
                    prometheus_client::metrics::MetricType::Gauge,
                )?;
                for (labels, value) in rows {
                    ConstGauge::new(value).encode(metric.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// Displays an error with its sources, `a: b: c`, for log fields.
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            write!(f, ": {error}")?;
            source = error.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clr::counters::{CounterSample, ProcessUsage, RuntimeCounters};

    #[test]
    fn sink_series_exist_before_the_first_window() {
        let metrics = AgentMetrics::new();
        let counters = metrics.sink_counters("pyroscope");
        counters.shipped.inc();
        counters.dropped(DropReason::QueueFull).inc_by(2);
        counters.queue_length.set(3);
        metrics.processes_tracked.set(12);
        metrics
            .samples
            .get_or_create(&vec![("kind", "cpu")])
            .inc_by(190);
        metrics.stack_naming_seconds.inc_by(0.25);
        metrics.stacks_named.inc_by(40);
        metrics
            .symbol_downloads
            .get_or_create(&vec![("outcome", "missing")])
            .inc_by(2);
        metrics.shed_connections().per_peer.inc();
        let text = metrics.render();
        for line in [
            "clrbpf_agent_http_connections_shed_total{cap=\"per_peer\"} 1",
            "clrbpf_agent_stack_naming_seconds_total 0.25",
            "clrbpf_agent_stacks_named_total 40",
            "clrbpf_agent_symbol_downloads_total{outcome=\"missing\"} 2",
            "clrbpf_agent_windows_shipped_total{sink=\"pyroscope\"} 1",
            "clrbpf_agent_windows_dropped_total{sink=\"pyroscope\",reason=\"queue_full\"} 2",
            "clrbpf_agent_queue_length{sink=\"pyroscope\"} 3",
            "clrbpf_agent_window_upload_failures_total{sink=\"pyroscope\"} 0",
            "clrbpf_agent_processes_tracked 12",
            "clrbpf_agent_samples_total{kind=\"cpu\"} 190",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(
            text.contains("clrbpf_agent_resident_memory_bytes "),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn dotnet_series_per_process_come_and_go() {
        use crate::clr::counters::CounterKind;
        let metrics = AgentMetrics::new();
        let sample = |name: &str, kind, value| CounterSample {
            name: name.into(),
            kind,
            value,
            interval_sec: 15.0,
            display_units: String::new(),
            time_ns: 0,
        };
        let mut counters = RuntimeCounters::new();
        for counter in [
            sample("gen-0-gc-count", CounterKind::Sum, 4.0),
            sample("gen-1-gc-count", CounterKind::Sum, 1.0),
            sample("gen-2-gc-count", CounterKind::Sum, 1.0),
            sample("exception-count", CounterKind::Sum, 9.0),
            sample("gc-heap-size", CounterKind::Mean, 12.0),
            sample("threadpool-queue-length", CounterKind::Mean, 3.0),
        ] {
            counters.observe(&counter);
        }
        counters.set_usage(Some(ProcessUsage {
            user_seconds: 1.5,
            system_seconds: 0.5,
            resident_bytes: 1 << 20,
        }));
        metrics.runtime().update(ProcessRuntimeMetrics {
            pid: 4242,
            executable: "Shop.Api".into(),
            k8s: Vec::new(),
            snapshot: counters.snapshot().clone(),
        });
        let text = metrics.render();
        for line in [
            "# TYPE dotnet_gc_collections counter",
            r#"dotnet_gc_collections_total{pid="4242",executable="Shop.Api",dotnet_gc_heap_generation="gen0"} 3.0"#,
            r#"dotnet_gc_collections_total{pid="4242",executable="Shop.Api",dotnet_gc_heap_generation="gen2"} 1.0"#,
            r#"dotnet_exceptions_total{pid="4242",executable="Shop.Api"} 9.0"#,
            r#"dotnet_gc_heap_size_bytes{pid="4242",executable="Shop.Api"} 12000000.0"#,
            r#"dotnet_thread_pool_queue_length{pid="4242",executable="Shop.Api"} 3.0"#,
            r#"dotnet_process_cpu_time_seconds_total{pid="4242",executable="Shop.Api",cpu_mode="user"} 1.5"#,
            r#"dotnet_process_memory_working_set_bytes{pid="4242",executable="Shop.Api"} 1048576.0"#,
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(
            !text.contains("dotnet_gc_pause_time"),
            "absent counters give no series"
        );
        metrics.runtime().remove(4242);
        assert!(!metrics.render().contains("# TYPE dotnet_"));
    }

    #[test]
    fn dotnet_series_of_a_pod_carry_its_labels() {
        let metrics = AgentMetrics::new();
        let mut counters = RuntimeCounters::new();
        counters.set_usage(Some(ProcessUsage {
            user_seconds: 1.0,
            system_seconds: 0.0,
            resident_bytes: 4096,
        }));
        metrics.runtime().update(ProcessRuntimeMetrics {
            pid: 7,
            executable: "dotnet".into(),
            k8s: vec![
                ("namespace", "shop".into()),
                ("pod", "api-7d9f".into()),
                ("container", "api".into()),
            ],
            snapshot: counters.snapshot().clone(),
        });
        let text = metrics.render();
        let line = r#"dotnet_process_memory_working_set_bytes{pid="7",executable="dotnet",namespace="shop",pod="api-7d9f",container="api"} 4096.0"#;
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}
