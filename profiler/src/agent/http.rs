//! The agent's HTTP endpoint (`--listen`, default `127.0.0.1:7071`, the
//! port Parca's agent uses), its routes and handlers; [`super::server`]
//! runs them (connection cap, timeouts, shutdown):
//!
//! - `GET /metrics`: [`AgentMetrics::render`], OpenMetrics text. Open to
//!   whoever reaches the port, as Prometheus exporters are: it carries the
//!   agent's own counters and, per .NET process, its pid, executable name,
//!   pod labels and runtime counters; never a stack, an exception message
//!   or a command line.
//! - `GET /healthz`: 200 while the agent's loop beats
//!   ([`AgentHealth::beat`]) at least every `stale_after`, 503 after.
//! - `GET /readyz`: 200 once the BPF programs are attached
//!   ([`AgentHealth::set_bpf_attached`]) and at least one sink accepts
//!   windows (its last upload did not fail), 503 before or otherwise.
//! - `GET /debug/pprof/profile?seconds=N`, only with `--enable-pull` (404
//!   otherwise): a fresh profile of the selected processes over N seconds
//!   (default 30, like Go's handler) as gzip pprof, for ad-hoc use and
//!   pull-based collectors. It holds stacks, thread names and exception
//!   messages, so with `--http-token-file` every request needs `Authorization:
//!   Bearer TOKEN` (401 otherwise). It comes from a [`PullProfiler`] the
//!   loop provides; one at a time (429 while another runs; a pull whose
//!   client went away no longer counts), at most `--max-pull-seconds` (400
//!   above). The profile is encoded on a blocking thread, so the other
//!   routes answer meanwhile.
//!
//! Anything else is 404.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    extract::{RawQuery, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use subtle::ConstantTimeEq as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{BoxFuture, metrics::AgentMetrics, pyroscope::Secret};
use crate::{export::write_pprof, profile::Profile};

/// The default `--listen` address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7071";
/// `seconds` when the query gives none (Go's `net/http/pprof` default).
const DEFAULT_PULL_SECONDS: u64 = 30;
/// The OpenMetrics text content type prometheus-client writes.
const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Makes a profile on demand: the loop's side of `/debug/pprof/profile`.
pub trait PullProfiler: Send + Sync + 'static {
    /// Profiles for `duration` and returns the result, holding `slot` (the
    /// endpoint's one-pull-at-a-time permit) while the profile is taken.
    /// Dropping the future (the client went away) ends the profile and
    /// frees the slot.
    fn profile(
        &self,
        duration: Duration,
        slot: OwnedSemaphorePermit,
    ) -> BoxFuture<'_, Result<Profile, String>>;
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

/// `/debug/pprof/profile`, when it is served.
#[derive(Clone)]
pub struct PullEndpoint {
    profiler: Arc<dyn PullProfiler>,
    max_seconds: u64,
    /// The bearer token every request must carry; `None` on a loopback
    /// address only (see [`super::config::PullConfig`]).
    token: Option<Secret>,
    slot: Arc<Semaphore>,
}

impl PullEndpoint {
    pub fn new(profiler: Arc<dyn PullProfiler>, max_seconds: u64, token: Option<Secret>) -> Self {
        Self {
            profiler,
            max_seconds,
            token,
            slot: Arc::new(Semaphore::new(1)),
        }
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct HttpState {
    pub metrics: AgentMetrics,
    pub health: Arc<AgentHealth>,
    /// `None`: no `/debug/pprof/profile` (`--enable-pull` not given).
    pub pull: Option<PullEndpoint>,
}

impl HttpState {
    pub fn new(
        metrics: AgentMetrics,
        health: Arc<AgentHealth>,
        pull: Option<PullEndpoint>,
    ) -> Self {
        Self {
            metrics,
            health,
            pull,
        }
    }
}

/// The routes; see the module documentation.
pub fn router(state: HttpState) -> axum::Router {
    let router = axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    let router = if state.pull.is_some() {
        router.route("/debug/pprof/profile", get(pull_profile))
    } else {
        router
    };
    router.with_state(state)
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

/// Whether `headers` carry `Authorization: Bearer TOKEN` with the
/// endpoint's token (always, without one). The comparison takes the same
/// time wherever the first wrong byte is.
fn authorized(headers: &HeaderMap, token: Option<&Secret>) -> bool {
    let Some(token) = token else {
        return true;
    };
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return false;
    };
    let Some((scheme, given)) = value.as_bytes().split_first_chunk::<7>() else {
        return false;
    };
    scheme.eq_ignore_ascii_case(b"bearer ") && bool::from(given.ct_eq(token.expose().as_bytes()))
}

async fn pull_profile(
    State(state): State<HttpState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let Some(pull) = state.pull else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if !authorized(&headers, pull.token.as_ref()) {
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "a bearer token is required\n",
        )
            .into_response();
    }
    let seconds = match seconds_parameter(query.as_deref()).map(str::parse::<u64>) {
        None => DEFAULT_PULL_SECONDS.min(pull.max_seconds),
        Some(Ok(seconds)) if (1..=pull.max_seconds).contains(&seconds) => seconds,
        Some(_) => {
            return (
                StatusCode::BAD_REQUEST,
                format!(
                    "seconds must be a whole number from 1 to {} (--max-pull-seconds)\n",
                    pull.max_seconds
                ),
            )
                .into_response();
        }
    };
    let Ok(slot) = Arc::clone(&pull.slot).try_acquire_owned() else {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            "another profile is being taken\n",
        )
            .into_response();
    };
    let profile = match pull
        .profiler
        .profile(Duration::from_secs(seconds), slot)
        .await
    {
        Ok(profile) => profile,
        Err(message) => {
            return (StatusCode::INTERNAL_SERVER_ERROR, format!("{message}\n")).into_response();
        }
    };
    let encoded = tokio::task::spawn_blocking(move || {
        let mut body = Vec::new();
        write_pprof(&profile, &mut body)
            .map(|()| body)
            .map_err(|error| super::metrics::ErrorChain(&error).to_string())
    })
    .await
    .unwrap_or_else(|error| Err(format!("encoding the profile failed: {error}")));
    match encoded {
        Ok(body) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (
                    header::CONTENT_DISPOSITION,
                    "attachment; filename=\"profile.pb.gz\"",
                ),
            ],
            body,
        )
            .into_response(),
        Err(message) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{message}\n")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use super::*;
    use crate::{
        agent::server::{ServerLimits, ShedConnections, serve},
        export::{read_pprof, test_profile},
    };

    /// Sleeps `sleep` holding the slot and returns the test profile;
    /// counts calls.
    struct SlowProfiler {
        calls: AtomicU32,
        sleep: Duration,
    }

    impl SlowProfiler {
        fn new(sleep: Duration) -> Arc<Self> {
            Arc::new(Self {
                calls: AtomicU32::new(0),
                sleep,
            })
        }
    }

    impl PullProfiler for SlowProfiler {
        fn profile(
            &self,
            duration: Duration,
            slot: OwnedSemaphorePermit,
        ) -> BoxFuture<'_, Result<Profile, String>> {
            Box::pin(async move {
                let _slot = slot;
                self.calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(self.sleep).await;
                let mut profile = test_profile::profile();
                profile.duration_ns = duration.as_nanos() as i64;
                Ok(profile)
            })
        }
    }

    async fn start(state: HttpState) -> (String, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let limits = ServerLimits::agent(Duration::from_secs(1));
        let task = tokio::spawn(serve(
            listener,
            router(state),
            limits,
            ShedConnections::default(),
            std::future::pending(),
        ));
        (url, task)
    }

    fn pull_state(
        profiler: &Arc<SlowProfiler>,
        max_seconds: u64,
        token: Option<&str>,
    ) -> HttpState {
        let health = Arc::new(AgentHealth::new(Duration::from_secs(60)));
        let endpoint = PullEndpoint::new(
            Arc::clone(profiler) as Arc<dyn PullProfiler>,
            max_seconds,
            token.map(Secret::new),
        );
        HttpState::new(AgentMetrics::new(), health, Some(endpoint))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn health_readiness_and_metrics() {
        let metrics = AgentMetrics::new();
        let health = Arc::new(AgentHealth::new(Duration::from_secs(60)));
        let state = HttpState::new(metrics.clone(), Arc::clone(&health), None);
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

        assert_eq!(
            get("/debug/pprof/profile").await.unwrap().status(),
            404,
            "no pull endpoint without --enable-pull"
        );
        assert_eq!(get("/nope").await.unwrap().status(), 404);
        server.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pull_profiles_are_bounded_and_one_at_a_time() {
        let profiler = SlowProfiler::new(Duration::from_millis(300));
        let (url, server) = start(pull_state(&profiler, 10, None)).await;
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pulls_need_the_bearer_token() {
        let profiler = SlowProfiler::new(Duration::ZERO);
        let (url, server) = start(pull_state(&profiler, 10, Some("s3cr3t"))).await;
        let client = crate::agent::http_client(Duration::from_secs(30)).unwrap();
        let pull = |authorization: Option<&str>| {
            let request = client.get(format!("{url}/debug/pprof/profile?seconds=1"));
            match authorization {
                Some(value) => request.header("authorization", value),
                None => request,
            }
            .send()
        };
        for wrong in [
            None,
            Some("Bearer s3cr3"),
            Some("Bearer s3cr3t4"),
            Some("Basic s3cr3t"),
        ] {
            let response = pull(wrong).await.unwrap();
            assert_eq!(response.status(), 401, "{wrong:?}");
            assert_eq!(response.headers()["www-authenticate"], "Bearer");
        }
        assert_eq!(profiler.calls.load(Ordering::SeqCst), 0);
        assert_eq!(pull(Some("Bearer s3cr3t")).await.unwrap().status(), 200);
        assert_eq!(pull(Some("bearer s3cr3t")).await.unwrap().status(), 200);
        assert_eq!(
            client
                .get(format!("{url}/metrics"))
                .send()
                .await
                .unwrap()
                .status(),
            200,
            "/metrics stays open"
        );
        server.abort();
    }

    /// A client that hangs up ends its pull: the slot is free for the next
    /// one at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pull_ends_with_its_connection() {
        use tokio::io::AsyncWriteExt as _;
        let profiler = SlowProfiler::new(Duration::from_secs(3600));
        let (url, server) = start(pull_state(&profiler, 10, None)).await;
        let address = url.trim_start_matches("http://");
        for _ in 0..3 {
            let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
            stream
                .write_all(b"GET /debug/pprof/profile?seconds=5 HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(stream);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            profiler.calls.load(Ordering::SeqCst),
            3,
            "none was refused (429)"
        );
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
