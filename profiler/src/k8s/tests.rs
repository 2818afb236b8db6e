//! The pod cache fed an API-server list and watch stream.
//!
//! The one fake of these tests: no Kubernetes API server can run on this
//! machine, so `testdata/` holds what one sends for
//! `GET /api/v1/pods?fieldSelector=spec.nodeName=node-a` (a `PodList`) and
//! for the watch that follows (one `WatchEvent` JSON object per line), in the
//! API server's wire format. They go through the same decoding (kube's types)
//! and the same [`PodMetadata::on_event`] the real watcher feeds.

use super::*;
use crate::profile::{Label, LabelValue};
use kube::core::{ObjectList, WatchEvent};

const LIST: &str = include_str!("testdata/pods-node-a.list.json");
const WATCH: &str = include_str!("testdata/pods-node-a.watch.jsonl");

fn id(c: char) -> String {
    c.to_string().repeat(64)
}

/// A PodMetadata after the recorded list (what the watcher's initial list
/// delivers), before the watch.
fn listed() -> Arc<PodMetadata> {
    let metadata = Arc::new(PodMetadata {
        node_name: Some("node-a".into()),
        cache: RwLock::new(PodCache::new(Some("node-a".into()))),
        listed: (Mutex::new(false), Condvar::new()),
    });
    let list: ObjectList<Pod> = serde_json::from_str(LIST).expect("recorded PodList decodes");
    metadata.on_event(watcher::Event::Init);
    for pod in list.items {
        metadata.on_event(watcher::Event::InitApply(pod));
    }
    metadata.on_event(watcher::Event::InitDone);
    metadata
}

fn watch(metadata: &PodMetadata) {
    for line in WATCH.lines() {
        let event: WatchEvent<Pod> =
            serde_json::from_str(line).expect("recorded watch event decodes");
        match event {
            WatchEvent::Added(pod) | WatchEvent::Modified(pod) => {
                metadata.on_event(watcher::Event::Apply(pod));
            }
            WatchEvent::Deleted(pod) => metadata.on_event(watcher::Event::Delete(pod)),
            WatchEvent::Bookmark(_) => {}
            WatchEvent::Error(e) => panic!("recorded stream has an error event: {e:?}"),
        }
    }
}

fn labels_of(metadata: &PodMetadata, container: &str) -> Vec<(String, String)> {
    let labels = metadata
        .labels_for(Some(container), None)
        .unwrap_or_else(|| panic!("no labels for {container}"));
    labels
        .sample_labels()
        .map(|Label { key, value }| match value {
            LabelValue::Str(v) => (key.to_string(), v.to_string()),
            LabelValue::Num { .. } => panic!("pod labels are strings"),
        })
        .collect()
}

fn expected(
    pod: &str,
    uid: &str,
    ns: &str,
    container: &str,
    service: &str,
) -> Vec<(String, String)> {
    [
        ("k8s.pod.name", pod),
        ("k8s.pod.uid", uid),
        ("k8s.namespace.name", ns),
        ("k8s.container.name", container),
        ("k8s.node.name", "node-a"),
        ("service.name", service),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
    .collect()
}

#[test]
fn listed_pods_name_their_containers_and_services() {
    let metadata = listed();
    let checkout = (
        "checkout-7d4b9c6f5d-x2k8p",
        "11111111-1111-4111-8111-111111111111",
    );
    // A Deployment's pod: the ReplicaSet name without the pod-template-hash.
    assert_eq!(
        labels_of(&metadata, &id('a')),
        expected(checkout.0, checkout.1, "shop", "app", "checkout")
    );
    assert_eq!(
        labels_of(&metadata, &id('b')),
        expected(checkout.0, checkout.1, "shop", "istio-proxy", "checkout")
    );
    // Init containers are indexed too.
    assert_eq!(
        labels_of(&metadata, &id('c')),
        expected(checkout.0, checkout.1, "shop", "migrate", "checkout")
    );
    // The annotation wins over app.kubernetes.io/name.
    assert_eq!(
        labels_of(&metadata, &id('d')),
        expected(
            "payments-5f6d7c8b9-abcde",
            "22222222-2222-4222-8222-222222222222",
            "shop",
            "api",
            "payments-api"
        )
    );
    // app.kubernetes.io/instance wins over app.kubernetes.io/name (CRI-O id).
    assert_eq!(
        labels_of(&metadata, &id('e')),
        expected(
            "orders-0",
            "33333333-3333-4333-8333-333333333333",
            "shop",
            "orders",
            "orders-prod"
        )
    );
    // A CronJob's Job: the scheduled-minute suffix is removed (Docker id).
    assert_eq!(
        labels_of(&metadata, &id('f')),
        expected(
            "nightly-report-29123456-7xk2q",
            "44444444-4444-4444-8444-444444444444",
            "batch",
            "report",
            "nightly-report"
        )
    );
    // A bare pod: the container's name.
    assert_eq!(
        labels_of(&metadata, &"0123456789abcdef".repeat(4)),
        expected(
            "debug-shell",
            "55555555-5555-4555-8555-555555555555",
            "default",
            "shell",
            "shell"
        )
    );
}

#[test]
fn watch_events_add_replace_and_remove_containers() {
    let metadata = listed();
    watch(&metadata);
    // Added while Pending (no container id yet), then Running.
    assert_eq!(
        labels_of(&metadata, &id('9')),
        expected(
            "checkout-7d4b9c6f5d-q9w8e",
            "66666666-6666-4666-8666-666666666666",
            "shop",
            "app",
            "checkout"
        )
    );
    // The restarted container has a new id; the old one is gone.
    assert_eq!(labels_of(&metadata, &id('8'))[3].1, "app");
    let stale = metadata
        .labels_for(Some(&id('a')), None)
        .expect("node name is known");
    assert_eq!(
        stale.pod_name, None,
        "the replaced container id no longer names the pod"
    );
    assert_eq!(labels_of(&metadata, &id('b'))[3].1, "istio-proxy");
    // The deleted pod's container falls back to local labels.
    let deleted = metadata
        .labels_for(Some(&id('f')), Some("44444444-4444-4444-8444-444444444444"))
        .expect("local labels");
    assert_eq!(deleted.pod_name, None);
    assert_eq!(
        deleted.pod_uid.as_deref(),
        Some("44444444-4444-4444-8444-444444444444")
    );
    assert_eq!(deleted.node_name.as_deref(), Some("node-a"));
    let cache = metadata.cache.read().expect("not poisoned");
    assert_eq!(cache.pod_count(), 5);
}

#[test]
fn a_process_seen_before_its_container_status_gets_its_pods_labels() {
    let metadata = listed();
    let labels = metadata
        .labels_for(Some(&id('7')), Some("11111111-1111-4111-8111-111111111111"))
        .expect("pod known by uid");
    assert_eq!(
        labels.pod_name.as_deref(),
        Some("checkout-7d4b9c6f5d-x2k8p")
    );
    assert_eq!(labels.container_name, None);
    assert_eq!(labels.service_name.as_deref(), Some("checkout"));
}

#[test]
fn without_an_api_server_the_labels_are_local() {
    let metadata = PodMetadata::local(Some("node-b".into()));
    let labels = metadata
        .labels_for(Some(&id('a')), Some("11111111-1111-4111-8111-111111111111"))
        .expect("local labels");
    let pairs: Vec<_> = labels.pairs().map(|(k, v)| (k, v.to_string())).collect();
    assert_eq!(
        pairs,
        vec![
            (
                "k8s.pod.uid",
                "11111111-1111-4111-8111-111111111111".to_string()
            ),
            ("k8s.node.name", "node-b".to_string()),
        ]
    );
    // A host process (no container, no pod) has none.
    assert_eq!(metadata.labels_for(None, None), None);
    // Outside Kubernetes, a container without a pod has none either.
    assert_eq!(
        PodMetadata::local(None).labels_for(Some(&id('a')), None),
        None
    );
}

/// A container id is a pod's only where that pod's `containerStatuses`
/// list it: a process whose cgroup names another pod gets that pod's
/// labels, never those of the pod the id belongs to.
#[test]
fn a_container_id_under_another_pod_gets_none_of_its_labels() {
    let metadata = listed();
    let owner = metadata
        .labels_for(Some(&id('a')), None)
        .expect("the container is listed");
    let other_uid = "22222222-2222-4222-8222-222222222222";
    assert_ne!(owner.pod_uid.as_deref(), Some(other_uid));
    let labels = metadata
        .labels_for(Some(&id('a')), Some(other_uid))
        .expect("the other pod is known by uid");
    assert_eq!(labels.pod_uid.as_deref(), Some(other_uid));
    assert_eq!(labels.container_name, None);
    assert_ne!(labels.pod_name, owner.pod_name);
}
