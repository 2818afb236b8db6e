//! The agent's HTTP endpoint (`--listen`, default `127.0.0.1:7071`, the
//! port Parca's agent uses):
//!
//! - `GET /metrics`: [`AgentMetrics::render`], OpenMetrics text.
//! - `GET /healthz`: 200 while the agent's loop beats
//!   ([`AgentHealth::beat`]) at least every `stale_after`, 503 after.
//! - `GET /readyz`: 200 once the BPF programs are attached
//!   ([`AgentHealth::set_bpf_attached`]) and at least one sink accepts
//!   windows (its last upload did not fail), 503 before or otherwise.
//! - `GET /debug/pprof/profile?seconds=N`: a fresh whole-host profile of N
//!   seconds (default 30, like Go's handler) as gzip pprof, for ad-hoc use
//!   and pull-based collectors. It comes from a [`PullProfiler`] the
//!   pipeline provides; one at a time (429 while another runs), at most
//!   `max_pull_seconds` (400 above), 501 without a profiler.
//!
//! Anything else is 404. The server only reads its requests' paths and
//! query strings; it holds no secrets.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    extract::{RawQuery, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use tokio::sync::Semaphore;

use super::{BoxFuture, metrics::AgentMetrics};
use crate::{export::write_pprof, profile::Profile};

/// The default `--listen` address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7071";
/// `seconds` when the query gives none (Go's `net/http/pprof` default).
const DEFAULT_PULL_SECONDS: u64 = 30;
/// The OpenMetrics text content type prometheus-client writes.
const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Makes a whole-host profile on demand: the pipeline's side of
/// `/debug/pprof/profile`.
pub trait PullProfiler: Send + Sync + 'static {
    /// Profiles for `duration` and returns the result.
    fn profile(&self, duration: Duration) -> BoxFuture<'_, Result<Profile, String>>;
}

/// Liveness and readiness, set by the agent's loop.
#[derive(Debug)]
pub struct AgentHealth {
    started: Instant,
    /// Milliseconds after `started` of the last beat; 0 = none yet.
    last_beat_ms: AtomicU64,
    stale_after: Duration,
    bpf_attached: AtomicBool,
}

impl AgentHealth {
    /// `stale_after`: how long without a beat `/healthz` tolerates (a few
    /// upload intervals).
    pub fn new(stale_after: Duration) -> Self {
        Self {
            started: Instant::now(),
            last_beat_ms: AtomicU64::new(0),
            stale_after,
            bpf_attached: AtomicBool::new(false),
        }
    }

    /// The loop is alive.
    pub fn beat(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_beat_ms.store(ms.max(1), Ordering::Relaxed);
    }

    pub fn set_bpf_attached(&self, attached: bool) {
        self.bpf_attached.store(attached, Ordering::Relaxed);
    }

    /// Alive: beaten within `stale_after`, or still starting (no beat yet,
    /// started less than `stale_after` ago).
    pub fn is_alive(&self) -> bool {
        let last = self.last_beat_ms.load(Ordering::Relaxed);
        let since_start = self.started.elapsed();
        let since_beat = since_start.saturating_sub(Duration::from_millis(last));
        since_beat <= self.stale_after
    }

    pub fn bpf_attached(&self) -> bool {
        self.bpf_attached.load(Ordering::Relaxed)
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct HttpState {
    pub metrics: AgentMetrics,
    pub health: Arc<AgentHealth>,
    pub profiler: Option<Arc<dyn PullProfiler>>,
    pub max_pull_seconds: u64,
    pull_slot: Arc<Semaphore>,
}

impl HttpState {
    pub fn new(
        metrics: AgentMetrics,
        health: Arc<AgentHealth>,
        profiler: Option<Arc<dyn PullProfiler>>,
        max_pull_seconds: u64,
    ) -> Self {
        Self {
            metrics,
            health,
            profiler,
            max_pull_seconds,
            pull_slot: Arc::new(Semaphore::new(1)),
        }
    }
}

/// The routes; see the module documentation.
pub fn router(state: HttpState) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/debug/pprof/profile", get(pull_profile))
        .with_state(state)
}

/// Serves `router(state)` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Binds `addr` (the `--listen` value).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

async fn metrics(State(state): State<HttpState>) -> Response {
    (
        [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
        state.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(state): State<HttpState>) -> Response {
    if state.health.is_alive() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the agent loop is stalled\n",
        )
            .into_response()
    }
}

async fn readyz(State(state): State<HttpState>) -> Response {
    if !state.health.bpf_attached() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "BPF programs not attached\n",
        )
            .into_response();
    }
    if !state.metrics.any_sink_accepting() {
        return (StatusCode::SERVICE_UNAVAILABLE, "no sink accepts windows\n").into_response();
    }
    (StatusCode::OK, "ready\n").into_response()
}

/// The `seconds` parameter of a query string, if present.
fn seconds_parameter(query: Option<&str>) -> Option<&str> {
    query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("seconds="))
}

async fn pull_profile(State(state): State<HttpState>, RawQuery(query): RawQuery) -> Response {
    let Some(profiler) = state.profiler.clone() else {
        return (
            StatusCode::NOT_IMPLEMENTED,
            "on-demand profiles are not available\n",
        )
            .into_response();
    };
    let seconds = match seconds_parameter(query.as_deref()).map(str::parse::<u64>) {
        None => DEFAULT_PULL_SECONDS.min(state.max_pull_seconds),
        Some(Ok(seconds)) if (1..=state.max_pull_seconds).contains(&seconds) => seconds,
        Some(_) => {
            return (
                StatusCode::BAD_REQUEST,
                format!(
                    "seconds must be a whole number from 1 to {} (--max-pull-seconds)\n",
                    state.max_pull_seconds
                ),
            )
                .into_response();
        }
    };
    let Ok(_slot) = Arc::clone(&state.pull_slot).try_acquire_owned() else {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            "another profile is being taken\n",
        )
            .into_response();
    };
    let profile = match profiler.profile(Duration::from_secs(seconds)).await {
        Ok(profile) => profile,
        Err(message) => {
            return (StatusCode::INTERNAL_SERVER_ERROR, format!("{message}\n")).into_response();
        }
    };
    let mut body = Vec::new();
    if let Err(error) = write_pprof(&profile, &mut body) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{}\n", super::metrics::ErrorChain(&error)),
        )
            .into_response();
    }
    (
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            (
                header::CONTENT_DISPOSITION,
                "attachment; filename=\"profile.pb.gz\"",
            ),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use super::*;
    use crate::export::{read_pprof, test_profile};

    /// Sleeps a little and returns the test profile; counts calls.
    struct SlowProfiler {
        calls: AtomicU32,
    }

    impl PullProfiler for SlowProfiler {
        fn profile(&self, duration: Duration) -> BoxFuture<'_, Result<Profile, String>> {
            Box::pin(async move {
                self.calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await;
                let mut profile = test_profile::profile();
                profile.duration_ns = duration.as_nanos() as i64;
                Ok(profile)
            })
        }
    }

    async fn start(state: HttpState) -> (String, tokio::task::JoinHandle<()>) {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            serve(listener, state, std::future::pending())
                .await
                .unwrap();
        });
        (url, task)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn health_readiness_and_metrics() {
        let metrics = AgentMetrics::new();
        let health = Arc::new(AgentHealth::new(Duration::from_secs(60)));
        let state = HttpState::new(metrics.clone(), Arc::clone(&health), None, 60);
        let (url, server) = start(state).await;
        let client = crate::agent::http_client(Duration::from_secs(30)).unwrap();
        let get = |path: &str| client.get(format!("{url}{path}")).send();

        assert_eq!(get("/healthz").await.unwrap().status(), 200);
        let ready = get("/readyz").await.unwrap();
        assert_eq!(ready.status(), 503);
        assert!(ready.text().await.unwrap().contains("BPF"));
        health.set_bpf_attached(true);
        assert_eq!(get("/readyz").await.unwrap().status(), 503, "no sink yet");
        let sink = metrics.sink_counters("directory");
        assert_eq!(get("/readyz").await.unwrap().status(), 200);
        sink.set_accepting(false);
        assert_eq!(get("/readyz").await.unwrap().status(), 503);
        sink.set_accepting(true);

        let response = get("/metrics").await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/openmetrics-text")
        );
        let text = response.text().await.unwrap();
        assert!(
            text.contains("clrbpf_agent_windows_shipped_total{sink=\"directory\"} 0"),
            "{text}"
        );

        assert_eq!(get("/debug/pprof/profile").await.unwrap().status(), 501);
        assert_eq!(get("/nope").await.unwrap().status(), 404);
        server.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pull_profiles_are_bounded_and_one_at_a_time() {
        let profiler = Arc::new(SlowProfiler {
            calls: AtomicU32::new(0),
        });
        let health = Arc::new(AgentHealth::new(Duration::from_secs(60)));
        let state = HttpState::new(
            AgentMetrics::new(),
            health,
            Some(profiler.clone() as Arc<dyn PullProfiler>),
            10,
        );
        let (url, server) = start(state).await;
        let client = crate::agent::http_client(Duration::from_secs(30)).unwrap();
        for bad in ["seconds=0", "seconds=11", "seconds=x", "seconds=-1"] {
            let response = client
                .get(format!("{url}/debug/pprof/profile?{bad}"))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 400, "{bad}");
        }
        let first = client
            .get(format!("{url}/debug/pprof/profile?seconds=2"))
            .send();
        let second = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            client
                .get(format!("{url}/debug/pprof/profile?seconds=1"))
                .send()
                .await
        };
        let (first, second) = tokio::join!(first, second);
        assert_eq!(second.unwrap().status(), 429);
        let first = first.unwrap();
        assert_eq!(first.status(), 200);
        let pprof = read_pprof(&first.bytes().await.unwrap()).unwrap();
        assert_eq!(pprof.duration_nanos, 2_000_000_000);
        assert_eq!(profiler.calls.load(Ordering::SeqCst), 1);
        // Without `seconds`: the default, capped by the maximum.
        let response = client
            .get(format!("{url}/debug/pprof/profile"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let pprof = read_pprof(&response.bytes().await.unwrap()).unwrap();
        assert_eq!(pprof.duration_nanos, 10_000_000_000);
        server.abort();
    }

    #[test]
    fn a_stalled_loop_is_not_alive() {
        let health = AgentHealth::new(Duration::from_millis(50));
        assert!(health.is_alive(), "starting");
        std::thread::sleep(Duration::from_millis(80));
        assert!(!health.is_alive());
        health.beat();
        assert!(health.is_alive());
        assert_eq!(seconds_parameter(Some("a=1&seconds=5")), Some("5"));
        assert_eq!(seconds_parameter(None), None);
    }
}
