//! The pod cache: what the API server says about the pods of this node,
//! indexed by container id (and by pod uid for processes whose container id
//! is not in a status yet). Pure: fed pod objects by the watcher in
//! [`super`], and by recorded API-server streams in the tests.

use std::{collections::HashMap, sync::Arc};

use k8s_openapi::api::core::v1::Pod;

use crate::profile::{Label, label_keys};

/// Pod annotation that names the service (OpenTelemetry k8s attributes rule).
const SERVICE_NAME_ANNOTATION: &str = "resource.opentelemetry.io/service.name";
/// Well-known labels, in the order the OpenTelemetry rule consults them.
const SERVICE_NAME_LABELS: [&str; 2] = ["app.kubernetes.io/instance", "app.kubernetes.io/name"];
/// The label the Deployment controller puts on its ReplicaSets' pods; the
/// ReplicaSet is named `<deployment>-<hash>`.
const POD_TEMPLATE_HASH_LABEL: &str = "pod-template-hash";

/// The Kubernetes identity of one container, as OpenTelemetry names it.
/// Missing parts (no API server) are `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodLabels {
    pub pod_name: Option<Arc<str>>,
    pub pod_uid: Option<Arc<str>>,
    pub namespace: Option<Arc<str>>,
    pub container_name: Option<Arc<str>>,
    pub node_name: Option<Arc<str>>,
    pub service_name: Option<Arc<str>>,
}

impl PodLabels {
    /// `(OpenTelemetry key, value)` for each part that is known.
    pub fn pairs(&self) -> impl Iterator<Item = (&'static str, Arc<str>)> + '_ {
        [
            (label_keys::K8S_POD_NAME, &self.pod_name),
            (label_keys::K8S_POD_UID, &self.pod_uid),
            (label_keys::K8S_NAMESPACE_NAME, &self.namespace),
            (label_keys::K8S_CONTAINER_NAME, &self.container_name),
            (label_keys::K8S_NODE_NAME, &self.node_name),
            (label_keys::SERVICE_NAME, &self.service_name),
        ]
        .into_iter()
        .filter_map(|(key, value)| value.clone().map(|v| (key, v)))
    }

    /// The sample labels: one per known part.
    pub fn sample_labels(&self) -> impl Iterator<Item = Label> + '_ {
        self.pairs().map(|(key, value)| Label::str(key, value))
    }
}

/// Pods of this node by uid, and the labels of each of their containers.
#[derive(Debug, Default)]
pub struct PodCache {
    node_name: Option<Arc<str>>,
    /// container id (bare hex) -> labels of that container.
    by_container: HashMap<String, Arc<PodLabels>>,
    /// pod uid -> labels without a container name, and its container ids.
    by_pod: HashMap<String, (Arc<PodLabels>, Vec<String>)>,
}

impl PodCache {
    pub fn new(node_name: Option<Arc<str>>) -> Self {
        Self {
            node_name,
            ..Self::default()
        }
    }

    /// The labels of the container `container_id`, as the `containerStatuses`
    /// of the pod listing it say, when that pod is the one the process's
    /// cgroup names (a container id alone never borrows another pod's
    /// labels); else, when the cgroup named its pod, the pod's labels
    /// without a container name.
    pub fn labels_for(&self, container_id: &str, pod_uid: Option<&str>) -> Option<Arc<PodLabels>> {
        self.by_container
            .get(container_id)
            .filter(|labels| pod_uid.is_none_or(|uid| labels.pod_uid.as_deref() == Some(uid)))
            .or_else(|| {
                pod_uid
                    .and_then(|uid| self.by_pod.get(uid))
                    .map(|(pod, _)| pod)
            })
            .cloned()
    }

    #[cfg(test)]
    pub fn pod_count(&self) -> usize {
        self.by_pod.len()
    }

    /// A pod was listed, added or modified: (re)index its containers.
    pub fn apply(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        self.delete_uid(&uid);
        let base = PodLabels {
            pod_name: pod.metadata.name.as_deref().map(Arc::from),
            pod_uid: Some(Arc::from(uid.as_str())),
            namespace: pod.metadata.namespace.as_deref().map(Arc::from),
            container_name: None,
            node_name: pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .map(Arc::from)
                .or_else(|| self.node_name.clone()),
            service_name: None,
        };
        let mut ids = Vec::new();
        let statuses = pod.status.iter().flat_map(|s| {
            [
                &s.container_statuses,
                &s.init_container_statuses,
                &s.ephemeral_container_statuses,
            ]
            .into_iter()
            .flatten()
            .flatten()
        });
        for status in statuses {
            let Some(id) = status.container_id.as_deref().and_then(bare_container_id) else {
                continue;
            };
            let labels = PodLabels {
                container_name: Some(Arc::from(status.name.as_str())),
                service_name: Some(service_name(pod, &status.name).into()),
                ..base.clone()
            };
            self.by_container.insert(id.clone(), Arc::new(labels));
            ids.push(id);
        }
        let pod_labels = PodLabels {
            service_name: workload_service_name(pod).map(Arc::from),
            ..base
        };
        self.by_pod.insert(uid, (Arc::new(pod_labels), ids));
    }

    /// A pod was deleted.
    pub fn delete(&mut self, pod: &Pod) {
        if let Some(uid) = &pod.metadata.uid {
            self.delete_uid(uid);
        }
    }

    /// The watch restarted: forget everything (a fresh list follows).
    pub fn clear(&mut self) {
        self.by_container.clear();
        self.by_pod.clear();
    }

    fn delete_uid(&mut self, uid: &str) {
        if let Some((_, ids)) = self.by_pod.remove(uid) {
            for id in ids {
                self.by_container.remove(&id);
            }
        }
    }
}

/// `containerd://<hex>`, `cri-o://<hex>`, `docker://<hex>` -> `<hex>`, the
/// form [`crate::process::cgroup::identity_from_cgroup`] finds.
fn bare_container_id(id: &str) -> Option<String> {
    let hex = id.rsplit_once("://").map_or(id, |(_, hex)| hex);
    (!hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| hex.to_ascii_lowercase())
}

/// `service.name` by the OpenTelemetry rule: the pod's
/// `resource.opentelemetry.io/service.name` annotation, then the
/// `app.kubernetes.io/instance` and `app.kubernetes.io/name` labels, then the
/// owning workload's name, then the container's name.
fn service_name(pod: &Pod, container: &str) -> String {
    workload_service_name(pod).unwrap_or_else(|| container.to_string())
}

fn workload_service_name(pod: &Pod) -> Option<String> {
    let meta = &pod.metadata;
    let non_empty = |v: &String| (!v.is_empty()).then(|| v.clone());
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(SERVICE_NAME_ANNOTATION))
        .and_then(non_empty)
        .or_else(|| {
            let labels = meta.labels.as_ref()?;
            SERVICE_NAME_LABELS
                .iter()
                .find_map(|key| labels.get(*key).and_then(non_empty))
        })
        .or_else(|| owner_workload_name(pod))
}

/// The name of the workload that owns the pod: a ReplicaSet made by a
/// Deployment gives the Deployment's name (the pod-template-hash suffix
/// removed); a Job made by a CronJob gives the CronJob's name (the
/// scheduled-minute suffix removed); StatefulSets, DaemonSets and others give
/// their own name.
fn owner_workload_name(pod: &Pod) -> Option<String> {
    let owners = pod.metadata.owner_references.as_ref()?;
    let owner = owners
        .iter()
        .find(|o| o.controller == Some(true))
        .or_else(|| owners.first())?;
    let name = owner.name.as_str();
    let stripped = match owner.kind.as_str() {
        "ReplicaSet" => pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(POD_TEMPLATE_HASH_LABEL))
            .and_then(|hash| name.strip_suffix(hash.as_str()))
            .and_then(|n| n.strip_suffix('-')),
        // CronJob controller: `<cronjob>-<scheduled time in minutes>`.
        "Job" => name
            .rsplit_once('-')
            .filter(|(_, t)| t.len() >= 8 && t.bytes().all(|b| b.is_ascii_digit()))
            .map(|(cronjob, _)| cronjob),
        _ => None,
    };
    Some(stripped.unwrap_or(name).to_string())
}
