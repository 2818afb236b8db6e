//! Kubernetes metadata: which pod and container a process belongs to.
//!
//! Place in the data flow: when the pipeline first sees a process, it asks
//! [`PodMetadata::labels_for`] with the container id and pod uid that
//! [`crate::process`] read from the process's cgroup; the answer's labels go
//! on every sample of that process (nothing is looked up per sample).
//!
//! The source is the API server: a watch of the pods of this node
//! (`fieldSelector=spec.nodeName=$NODE_NAME`) with the pod's service
//! account, kept in a [`PodCache`] by a background thread. Without an API
//! server (outside Kubernetes, or RBAC denied) the labels are what is known
//! locally (the pod uid from the cgroup path, the node name from
//! `NODE_NAME`), and one warning says why.

mod cache;

use std::{
    sync::{Arc, Condvar, Mutex, OnceLock, RwLock},
    thread,
    time::Duration,
};

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;

pub use cache::{PodCache, PodLabels};

/// The environment variable the chart sets from `spec.nodeName`.
pub const NODE_NAME_ENV: &str = "NODE_NAME";
/// Set by the kubelet in every pod: the sign that an API server exists.
const SERVICE_HOST_ENV: &str = "KUBERNETES_SERVICE_HOST";
/// How long the first lookup waits for the initial pod list, so processes
/// already running at start get their labels.
const INITIAL_LIST_WAIT: Duration = Duration::from_secs(5);

/// Why the API server is not used.
#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    #[error("no in-cluster configuration (service account token or KUBERNETES_SERVICE_HOST): {0}")]
    Config(#[source] kube::Error),
    #[error(
        "watching the pods of node {node} failed (the ClusterRole must allow pods get/list/watch): {source}"
    )]
    Watch {
        node: String,
        #[source]
        source: watcher::Error,
    },
    #[error("could not start the pod watcher thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Where the pod labels come from; shared by the pipeline and the watcher.
#[derive(Debug)]
pub struct PodMetadata {
    node_name: Option<Arc<str>>,
    cache: RwLock<PodCache>,
    /// Set once the first list is in (or the watch gave up).
    listed: (Mutex<bool>, Condvar),
}

impl PodMetadata {
    /// Local labels only: no API server.
    pub fn local(node_name: Option<Arc<str>>) -> Arc<Self> {
        Arc::new(Self {
            node_name: node_name.clone(),
            cache: RwLock::new(PodCache::new(node_name)),
            listed: (Mutex::new(true), Condvar::new()),
        })
    }

    /// The process-wide instance: inside Kubernetes (NODE_NAME and
    /// KUBERNETES_SERVICE_HOST set) it watches the API server; elsewhere it
    /// gives local labels only.
    pub fn global() -> &'static Arc<Self> {
        static GLOBAL: OnceLock<Arc<PodMetadata>> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let node = std::env::var(NODE_NAME_ENV).ok().filter(|n| !n.is_empty());
            let in_cluster = std::env::var_os(SERVICE_HOST_ENV).is_some();
            match node {
                Some(node) if in_cluster => Self::watch(node),
                Some(node) => {
                    tracing::warn!(
                        "{NODE_NAME_ENV} is set but {SERVICE_HOST_ENV} is not: no Kubernetes API server, so samples carry only the pod uid and node name"
                    );
                    Self::local(Some(node.into()))
                }
                None => Self::local(None),
            }
        })
    }

    /// Starts a background thread watching the pods of `node`. Failures
    /// are logged once and leave local labels.
    pub fn watch(node: String) -> Arc<Self> {
        let metadata = Arc::new(Self {
            node_name: Some(Arc::from(node.as_str())),
            cache: RwLock::new(PodCache::new(Some(Arc::from(node.as_str())))),
            listed: (Mutex::new(false), Condvar::new()),
        });
        let worker = Arc::clone(&metadata);
        let spawned = thread::Builder::new()
            .name("clrbpf-k8s".into())
            .spawn(move || {
                if let Err(e) = worker.run_watch(&node) {
                    tracing::warn!("Kubernetes pod metadata unavailable, samples carry only the pod uid and node name: {e}");
                }
                worker.mark_listed();
            });
        if let Err(e) = spawned {
            tracing::warn!("{}", K8sError::Thread(e));
            metadata.mark_listed();
        }
        metadata
    }

    /// The labels of the process whose cgroup gave `container_id` and
    /// `pod_uid`. Waits (once, at most [`INITIAL_LIST_WAIT`]) for the first
    /// pod list. `None` for a process outside any container or pod.
    pub fn labels_for(
        &self,
        container_id: Option<&str>,
        pod_uid: Option<&str>,
    ) -> Option<Arc<PodLabels>> {
        if container_id.is_none() && pod_uid.is_none() {
            return None;
        }
        self.wait_listed();
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        cache
            .labels_for(container_id.unwrap_or(""), pod_uid)
            .or_else(|| {
                // Local labels: what the cgroup path and NODE_NAME say.
                Some(Arc::new(PodLabels {
                    pod_uid: pod_uid.map(Arc::from),
                    node_name: self.node_name.clone(),
                    ..PodLabels::default()
                }))
                .filter(|l| l.pod_uid.is_some() || l.node_name.is_some())
            })
    }

    fn wait_listed(&self) {
        let (lock, ready) = &self.listed;
        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        let _ = ready
            .wait_timeout_while(guard, INITIAL_LIST_WAIT, |listed| !*listed)
            .unwrap_or_else(|e| e.into_inner());
    }

    fn mark_listed(&self) {
        let (lock, ready) = &self.listed;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        ready.notify_all();
    }

    /// Applies one watcher event to the cache.
    fn on_event(&self, event: watcher::Event<Pod>) {
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        match event {
            watcher::Event::Init => cache.clear(),
            watcher::Event::InitApply(pod) | watcher::Event::Apply(pod) => cache.apply(&pod),
            watcher::Event::Delete(pod) => cache.delete(&pod),
            watcher::Event::InitDone => {
                drop(cache);
                self.mark_listed();
            }
        }
    }

    fn run_watch(&self, node: &str) -> Result<(), K8sError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(K8sError::Thread)?;
        runtime.block_on(async {
            let client = kube::Client::try_default()
                .await
                .map_err(K8sError::Config)?;
            let pods: kube::Api<Pod> = kube::Api::all(client);
            let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
            let mut events = watcher(pods, config).boxed();
            let mut backoff_errors = 0u32;
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => {
                        backoff_errors = 0;
                        self.on_event(event);
                    }
                    // Forbidden (RBAC) or unauthorized: retrying will not help.
                    Err(source) if is_denied(&source) => {
                        return Err(K8sError::Watch {
                            node: node.to_string(),
                            source,
                        });
                    }
                    Err(source) => {
                        backoff_errors += 1;
                        if backoff_errors == 1 {
                            tracing::warn!("pod watch of node {node}: {source}; retrying");
                        }
                        self.mark_listed();
                        tokio::time::sleep(Duration::from_secs(u64::from(backoff_errors.min(30))))
                            .await;
                    }
                }
            }
            Ok(())
        })
    }
}

fn is_denied(error: &watcher::Error) -> bool {
    let api_status = match error {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => Some(s.code),
        watcher::Error::WatchError(s) => Some(s.code),
        _ => None,
    };
    matches!(api_status, Some(401 | 403))
}

#[cfg(test)]
mod tests;
