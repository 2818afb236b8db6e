//! The agent's sink ([`ServiceSinks`]): each window the driver closes is
//! split per service and profile type ([`window_batch`]) and handed to
//! the backends' delivery queues, which never block the loop.
//!
//! A series is named by the service, the executable and the pod
//! ([`ServiceNames`]), never by a pid or a container id.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use super::{
    FlushReport,
    batch::{OVERFLOW_SERVICE, ServiceKey, window_batch},
    config::{ProcessSelection, service_name},
    metrics::AgentMetrics,
    queue::FanOut,
    series_keys,
};
use crate::{
    export::{
        ExportError,
        sink::{BoxFuture, ClosedWindow, ProfileSink},
    },
    pipeline::selection::{ProcessFilter, ProcessKey},
    process::ProcFs,
    profile::{LabelValue, ProfileSample, label_keys},
};

/// The Kubernetes labels a sample carries that name its series too.
const K8S_SERIES_KEYS: [&str; 5] = [
    series_keys::K8S_NAMESPACE_NAME,
    series_keys::K8S_POD_NAME,
    series_keys::K8S_POD_UID,
    series_keys::K8S_CONTAINER_NAME,
    series_keys::K8S_NODE_NAME,
];

/// The agent's sink: splits every window per service and ships it to
/// every configured backend.
pub struct ServiceSinks {
    queues: FanOut,
    metrics: AgentMetrics,
    /// The processes whose samples are shipped.
    selection: ProcessSelection,
    /// Series shipped per window at most (`--max-services`).
    max_services: usize,
    services: ServiceNames,
}

impl ServiceSinks {
    pub fn new(
        queues: FanOut,
        metrics: AgentMetrics,
        selection: ProcessSelection,
        max_services: usize,
    ) -> Self {
        Self {
            queues,
            metrics,
            selection,
            max_services,
            services: ServiceNames::default(),
        }
    }

    /// Labels put on every series (`--label`), after the agent's own.
    pub fn with_static_labels(mut self, labels: Vec<(String, String)>) -> Self {
        self.services.static_labels = labels;
        self
    }
}

impl ProfileSink for ServiceSinks {
    /// Submits a closed window's profiles, one per service and profile
    /// type. Never fails: the queues drop what they cannot deliver.
    fn submit(&mut self, window: ClosedWindow) -> Result<(), ExportError> {
        // The windows shipped before this one are encoded and sent by
        // now: what they held is free.
        crate::release_freed_heap();
        let ClosedWindow {
            profile,
            start,
            duration,
        } = window;
        let (services, selection) = (&mut self.services, &self.selection);
        let (batch, overflowed) =
            window_batch(start, duration, &profile, self.max_services, |sample| {
                services.key_of(sample, selection)
            });
        if overflowed > 0 {
            self.metrics.services_over_cap.inc_by(overflowed as u64);
            tracing::warn!(
                services = overflowed,
                max = self.max_services,
                "more services in this window than --max-services: the least busy were shipped as `{OVERFLOW_SERVICE}`"
            );
        }
        tracing::debug!(
            profiles = batch.profiles.len(),
            ?start,
            ?duration,
            "window closed"
        );
        self.services.forget_unseen();
        self.queues.submit(Arc::new(batch));
        Ok(())
    }

    fn flush(&mut self, grace: Duration) -> BoxFuture<'_, FlushReport> {
        self.queues.flush(grace)
    }
}

/// The entry assembly of a `dotnet` command line (`dotnet [options]
/// App.dll args`): the first argument ending in `.dll`, without it.
pub(crate) fn entry_assembly(cmdline: &[String]) -> Option<String> {
    let dll = cmdline.iter().skip(1).find(|arg| arg.ends_with(".dll"))?;
    let name = dll.rsplit('/').next()?.strip_suffix(".dll")?;
    (!name.is_empty()).then(|| name.to_owned())
}

/// The service of each process, named once (its environment is read when
/// its first sample of a window is split out) and forgotten when a window
/// has none of its samples.
///
/// A series is named by the service, the executable and the pod: never by
/// a pid or a container id, which change with every restart (a new series
/// each time, the old ones left to the backend's retention). Those stay
/// labels of the samples inside the profile. A process gone before its
/// executable was read is `unknown_service`, as OpenTelemetry names a
/// service nobody named, not a series of its own.
#[derive(Default)]
struct ServiceNames {
    by_pid: HashMap<u32, Option<ServiceKey>>,
    seen: HashSet<u32>,
    procfs: ProcFs,
    static_labels: Vec<(String, String)>,
}

/// OpenTelemetry's `service.name` when none is set.
const UNKNOWN_SERVICE: &str = "unknown_service";

/// The pipeline drops the samples of the processes the sinks would leave
/// out ([`crate::pipeline::selection`]), by the rule of
/// [`ServiceNames::key_of`].
impl ProcessFilter for ProcessSelection {
    fn selects(&self, process: &ProcessKey<'_>) -> bool {
        ProcessSelection::selects(
            self,
            process.executable.unwrap_or(UNKNOWN_SERVICE),
            process.container_id,
            process.k8s_namespace,
        )
    }
}

impl ServiceNames {
    fn key_of(
        &mut self,
        sample: &ProfileSample,
        selection: &ProcessSelection,
    ) -> Option<ServiceKey> {
        let mut pid = None;
        let mut executable = None;
        let mut container = None;
        let mut pod_service = None;
        // The pod's labels, as the pipeline put them on the sample (k8s/):
        // the same OpenTelemetry keys name the series.
        let mut k8s: Vec<(&'static str, Arc<str>)> = Vec::new();
        for label in &sample.labels {
            match (&*label.key, &label.value) {
                (label_keys::PROCESS_PID, LabelValue::Num { value, .. }) => {
                    pid = u32::try_from(*value).ok()
                }
                (label_keys::PROCESS_EXECUTABLE_NAME, LabelValue::Str(s)) => {
                    executable = Some(s.clone())
                }
                (label_keys::CONTAINER_ID, LabelValue::Str(s)) => container = Some(s.clone()),
                (label_keys::SERVICE_NAME, LabelValue::Str(s)) => pod_service = Some(s.clone()),
                (key, LabelValue::Str(s)) => {
                    if let Some(series_key) = K8S_SERIES_KEYS.iter().find(|k| **k == key) {
                        k8s.push((series_key, s.clone()));
                    }
                }
                _ => {}
            }
        }
        let pid = pid?;
        self.seen.insert(pid);
        let (procfs, static_labels) = (&self.procfs, &self.static_labels);
        self.by_pid
            .entry(pid)
            .or_insert_with(|| {
                // The pipeline's stand-in for a name it could not read.
                let executable = executable
                    .as_deref()
                    .filter(|name| *name != crate::pipeline::tracked::unknown_exe_name(pid));
                let namespace = k8s
                    .iter()
                    .find(|(k, _)| *k == series_keys::K8S_NAMESPACE_NAME)
                    .map(|(_, v)| &**v);
                if !selection.selects(
                    executable.unwrap_or(UNKNOWN_SERVICE),
                    container.as_deref(),
                    namespace,
                ) {
                    return None;
                }
                let environ = procfs.environ(pid).unwrap_or_default();
                // `dotnet App.dll`: the service is the entry assembly.
                let entry_assembly = (executable == Some("dotnet"))
                    .then(|| procfs.process_info(pid).ok())
                    .flatten()
                    .and_then(|info| entry_assembly(&info.cmdline));
                let program = entry_assembly.as_deref().or(executable);
                let mut labels = Vec::new();
                if let Some(executable) = executable {
                    labels.push((
                        series_keys::PROCESS_EXECUTABLE_NAME.to_owned(),
                        executable.to_owned(),
                    ));
                }
                labels.extend(k8s.iter().map(|(k, v)| ((*k).to_owned(), v.to_string())));
                labels.extend(static_labels.iter().cloned());
                Some(ServiceKey {
                    service_name: service_name(
                        &environ,
                        pod_service.as_deref(),
                        program.unwrap_or(UNKNOWN_SERVICE),
                    ),
                    labels,
                })
            })
            .clone()
    }

    /// Drops the names of processes that had no sample in the last window.
    fn forget_unseen(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.by_pid.retain(|pid, _| seen.contains(pid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_entry_assembly_names_a_dotnet_process() {
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            entry_assembly(&args(&[
                "/usr/bin/dotnet",
                "/srv/app/Shop.Api.dll",
                "--port",
                "80"
            ])),
            Some("Shop.Api".to_owned())
        );
        assert_eq!(
            entry_assembly(&args(&[
                "dotnet",
                "exec",
                "--runtimeconfig",
                "x.json",
                "App.dll"
            ])),
            Some("App".to_owned())
        );
        assert_eq!(entry_assembly(&args(&["dotnet", "run"])), None);
    }

    #[test]

    fn a_pods_samples_name_their_series_and_are_selected_by_namespace() {
        use crate::profile::Label;
        let sample = |namespace: &str| ProfileSample {
            stack: Vec::new(),
            values: vec![1],
            labels: vec![
                // A pid that does not exist: its environment reads empty.
                Label::num(label_keys::PROCESS_PID, i64::from(u32::MAX - 1)),
                Label::str(label_keys::PROCESS_EXECUTABLE_NAME, "dotnet"),
                Label::str(label_keys::K8S_NAMESPACE_NAME, namespace),
                Label::str(label_keys::K8S_POD_NAME, "api-7d9f"),
                Label::str(label_keys::SERVICE_NAME, "shop-api"),
                Label::str(label_keys::THREAD_NAME, "worker"),
            ],
        };
        let everything = ProcessSelection::default();
        let mut names = ServiceNames::default();
        let key = names.key_of(&sample("shop"), &everything).expect("kept");
        assert_eq!(key.service_name, "shop-api", "the pod's service name");
        assert!(key.labels.contains(&(
            series_keys::K8S_NAMESPACE_NAME.to_owned(),
            "shop".to_owned()
        )));
        assert!(
            key.labels
                .contains(&(series_keys::K8S_POD_NAME.to_owned(), "api-7d9f".to_owned()))
        );
        assert!(!key.labels.iter().any(|(k, _)| k == "thread.name"));
        let mut with_static = ServiceNames {
            static_labels: vec![("cluster".into(), "prod-eu".into())],
            ..ServiceNames::default()
        };
        let labels = with_static
            .key_of(&sample("shop"), &everything)
            .expect("kept")
            .labels;
        assert_eq!(
            labels.last(),
            Some(&("cluster".to_owned(), "prod-eu".to_owned())),
            "{labels:?}"
        );
        assert!(
            !key.labels.iter().any(|(k, _)| k == label_keys::PROCESS_PID),
            "a pid names no series: {:?}",
            key.labels
        );

        let only_shop = ProcessSelection {
            k8s_namespaces: vec!["shop".into()],
            ..Default::default()
        };
        assert!(
            ServiceNames::default()
                .key_of(&sample("shop"), &only_shop)
                .is_some()
        );
        assert!(
            ServiceNames::default()
                .key_of(&sample("billing"), &only_shop)
                .is_none()
        );
    }

    /// Processes gone before their name was read share one service, and
    /// neither a pid nor a container id names a series.
    #[test]
    fn short_lived_processes_do_not_make_a_series_each() {
        use crate::profile::Label;
        let everything = ProcessSelection::default();
        let mut names = ServiceNames::default();
        let mut keys = std::collections::BTreeSet::new();
        for pid in [u32::MAX - 10, u32::MAX - 11, u32::MAX - 12] {
            let sample = ProfileSample {
                stack: Vec::new(),
                values: vec![1],
                labels: vec![
                    Label::num(label_keys::PROCESS_PID, i64::from(pid)),
                    Label::str(
                        label_keys::PROCESS_EXECUTABLE_NAME,
                        crate::pipeline::tracked::unknown_exe_name(pid),
                    ),
                    Label::str(label_keys::CONTAINER_ID, format!("{pid:064x}")),
                ],
            };
            keys.insert(names.key_of(&sample, &everything).expect("kept"));
        }
        assert_eq!(
            keys.into_iter().collect::<Vec<_>>(),
            [ServiceKey {
                service_name: UNKNOWN_SERVICE.to_owned(),
                labels: Vec::new(),
            }]
        );
    }
}
