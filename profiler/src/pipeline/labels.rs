//! The labels of a profile sample, built in one place for every kind
//! (CPU, off-CPU, waker, CLR event): the process's and the thread's, in
//! OpenTelemetry's names ([`label_keys`]), then what the kind adds.

use std::sync::Arc;

use super::tracked::TrackedProcess;
use crate::profile::{Label, Waker, label_keys};

/// The labels of a sample of `tid` in `process`, in this order: pid,
/// executable, thread id, thread name (when known), container, pod.
pub(super) fn sample_labels(
    process: &TrackedProcess,
    tid: i64,
    thread_name: Option<&Arc<str>>,
) -> Vec<Label> {
    let mut labels = vec![
        Label::num(label_keys::PROCESS_PID, i64::from(process.pid)),
        Label::str(
            label_keys::PROCESS_EXECUTABLE_NAME,
            process.exe_name.clone(),
        ),
        Label::num(label_keys::THREAD_ID, tid),
    ];
    if let Some(name) = thread_name {
        labels.push(Label::str(label_keys::THREAD_NAME, name.clone()));
    }
    if let Some(id) = &process.container_id {
        labels.push(Label::str(label_keys::CONTAINER_ID, id.clone()));
    }
    labels.extend(process.pod.iter().flat_map(|pod| pod.sample_labels()));
    labels
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
