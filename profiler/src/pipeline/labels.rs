//! The labels of a profile sample, built in one place for every kind
//! (CPU, off-CPU, waker, CLR event): the process's and the thread's, in
//! OpenTelemetry's names ([`label_keys`]), then what the kind adds.

use std::sync::Arc;

use super::tracked::TrackedProcess;
use crate::profile::{Label, Waker, label_keys};

/// The labels of a sample of `tid` in `process`, in this order: pid,
/// executable, thread id and thread name (when known), container, pod.
pub(super) fn sample_labels(
    process: &TrackedProcess,
    tid: Option<i64>,
    thread_name: Option<&Arc<str>>,
) -> Vec<Label> {
    let mut labels = vec![
        Label::num(label_keys::PROCESS_PID, i64::from(process.pid)),
        Label::str(
            label_keys::PROCESS_EXECUTABLE_NAME,
            process.exe_name.clone(),
        ),
    ];
    if let Some(tid) = tid {
        labels.push(Label::num(label_keys::THREAD_ID, tid));
    }
    if let Some(name) = thread_name {
        labels.push(Label::str(label_keys::THREAD_NAME, name.clone()));
    }
    if let Some(id) = &process.container_id {
        labels.push(Label::str(label_keys::CONTAINER_ID, id.clone()));
    }
    labels.extend(process.pod.iter().flat_map(|pod| pod.sample_labels()));
    labels
}

/// The pod's labels of a process's runtime metrics (the agent's
/// `dotnet_*` series): `namespace`, `pod`, `container`.
pub(super) fn metric_k8s_labels(process: &TrackedProcess) -> Vec<(&'static str, String)> {
    process
        .pod
        .iter()
        .flat_map(|pod| pod.pairs())
        .filter_map(|(key, value)| {
            let name = match key {
                label_keys::K8S_NAMESPACE_NAME => "namespace",
                label_keys::K8S_POD_NAME => "pod",
                label_keys::K8S_CONTAINER_NAME => "container",
                _ => return None,
            };
            Some((name, value.to_string()))
        })
        .collect()
}

/// What a wakeup's sample adds: the thread that woke the blocked one.
pub(super) fn push_waker_labels(labels: &mut Vec<Label>, waker: &Waker) {
    labels.push(Label::num(
        label_keys::WAKER_PROCESS_PID,
        i64::from(waker.pid),
    ));
    labels.push(Label::num(
        label_keys::WAKER_THREAD_ID,
        i64::from(waker.tid),
    ));
    labels.push(Label::str(
        label_keys::WAKER_THREAD_NAME,
        waker.thread_name.clone(),
    ));
}
