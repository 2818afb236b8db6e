//! The server under the agent's HTTP routes ([`super::http::router`]): the
//! connections themselves, which come from anyone who reaches `--listen`
//! and must never hold the agent.
//!
//! - It runs on a thread of its own ([`HttpServer`]), so `/healthz` is
//!   answered whatever the agent's other tasks (uploads, encoding) do.
//! - At most [`ServerLimits::max_connections`] connections are open, far
//!   below the descriptor budget. A connection over the cap closes the
//!   oldest one that is not running a request: a flood of half-sent
//!   requests cannot keep the kubelet's probe out. When every open one
//!   runs a request, the new one is closed at once.
//! - One peer address holds at most [`ServerLimits::max_per_peer`] of
//!   them: a connection over it closes that peer's oldest idle one (or
//!   itself, when all of them run a request), so one client churns only
//!   its own places and never evicts another peer's. Connections closed
//!   for either cap are counted ([`ShedConnections`], on `/metrics`).
//! - A request's head must arrive within
//!   [`ServerLimits::header_read_timeout`] (also the limit on a kept-alive
//!   connection waiting for its next request), and a connection where
//!   nothing moves for [`ServerLimits::idle_timeout`] while no request
//!   runs (a client that stops reading its answer) is closed.
//! - At shutdown, no new connection is taken, those open get
//!   [`ServerLimits::shutdown_grace`] to finish and are closed after it.

use std::{
    collections::BTreeMap,
    io,
    net::IpAddr,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
    sync::{Notify, oneshot, watch},
    task::JoinSet,
};
use tower_service::Service as _;

/// The largest request head (and read buffer) of a connection: the
/// endpoint's requests are one line and a few headers.
const MAX_REQUEST_BUFFER_BYTES: usize = 16 * 1024;
/// How long to wait before accepting again after `accept` failed (out of
/// descriptors: the failure repeats until a connection closes).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How often a connection checks whether it is idle.
const IDLE_CHECK_EVERY: Duration = Duration::from_secs(1);

/// What a client may hold; see the module documentation.
#[derive(Clone, Copy, Debug)]
pub struct ServerLimits {
    pub max_connections: usize,
    pub max_per_peer: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub shutdown_grace: Duration,
}

impl ServerLimits {
    /// The agent's limits; `shutdown_grace` is `--grace-period`.
    pub fn agent(shutdown_grace: Duration) -> Self {
        Self {
            // Prometheus, the kubelet's probes and a pull collector need a
            // handful; the agent's own descriptors (perf events, maps,
            // /proc files) need the rest of even a 1024 limit.
            max_connections: 128,
            // The kubelet, Prometheus and a pull each need one or two; a
            // peer with more is a flood (pods behind one node address
            // share it, hence not 2).
            max_per_peer: 16,
            header_read_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            shutdown_grace,
        }
    }
}

/// The connections closed to make room (an idle one evicted, or the new
/// one refused), by the cap that was reached; cheap to clone (the counters
/// are shared with `/metrics`).
#[derive(Clone, Debug, Default)]
pub struct ShedConnections {
    /// The peer already held [`ServerLimits::max_per_peer`].
    pub per_peer: Counter,
    /// [`ServerLimits::max_connections`] were open.
    pub total: Counter,
}

/// The HTTP server on a thread of its own, with a single-threaded runtime.
pub struct HttpServer {
    stop: oneshot::Sender<()>,
    stopped: oneshot::Receiver<()>,
    grace: Duration,
}

impl HttpServer {
    /// Serves `router` on `listener` (bound by the caller, so a bad
    /// `--listen` is reported at start) from a new thread.
    pub fn start(
        listener: std::net::TcpListener,
        router: axum::Router,
        limits: ServerLimits,
        shed: ShedConnections,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop, stop_requested) = oneshot::channel::<()>();
        let (stopped_tx, stopped) = oneshot::channel();
        std::thread::Builder::new()
            .name("clrbpf-http".into())
            .spawn(move || {
                runtime.block_on(async move {
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => {
                            serve(listener, router, limits, shed, async {
                                let _ = stop_requested.await;
                            })
                            .await;
                        }
                        Err(error) => tracing::error!(%error, "the HTTP endpoint cannot listen"),
                    }
                });
                // Blocking tasks still encoding a profile are not waited
                // for.
                runtime.shutdown_background();
                let _ = stopped_tx.send(());
            })?;
        Ok(Self {
            stop,
            stopped,
            grace: limits.shutdown_grace,
        })
    }

    /// Stops the server: connections get the shutdown grace, then are
    /// closed. Returns within the grace and a little more, whatever the
    /// clients do.
    pub async fn stop(self) {
        let Self {
            stop,
            stopped,
            grace,
        } = self;
        let _ = stop.send(());
        if tokio::time::timeout(grace + Duration::from_secs(1), stopped)
            .await
            .is_err()
        {
            tracing::warn!("the HTTP endpoint did not stop in time");
        }
    }
}

/// Serves `router` on `listener` until `shutdown` completes, then closes
/// every connection within `limits.shutdown_grace`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limits: ServerLimits,
    shed: ShedConnections,
    shutdown: impl Future<Output = ()>,
) {
    let open = Arc::new(OpenConnections::new(
        limits.max_connections,
        limits.max_per_peer,
    ));
    let (closing, closing_seen) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        while tasks.try_join_next().is_some() {}
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::debug!(%error, "accepting an HTTP connection failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let (admitted, cap) = OpenConnections::admit(&open, peer.ip());
        if let Some(cap) = cap {
            match cap {
                Cap::PerPeer => shed.per_peer.inc(),
                Cap::Total => shed.total.inc(),
            };
        }
        let Some(connection) = admitted else {
            continue;
        };
        tasks.spawn(serve_connection(
            stream,
            router.clone(),
            limits,
            connection,
            closing_seen.clone(),
        ));
    }
    drop(listener);
    let _ = closing.send(true);
    let all_done = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.shutdown_grace, all_done)
        .await
        .is_err()
    {
        tracing::debug!(
            open = tasks.len(),
            "closing the HTTP connections still open"
        );
    }
    tasks.shutdown().await;
}

/// The open connections, oldest first (ids grow).
struct OpenConnections {
    max: usize,
    max_per_peer: usize,
    by_id: Mutex<BTreeMap<u64, Arc<ConnectionState>>>,
    next_id: AtomicU64,
    epoch: Instant,
}

/// What the server knows of one connection.
struct ConnectionState {
    /// The peer's address (an IPv4-mapped IPv6 address as IPv4).
    peer: IpAddr,
    /// Requests whose handler runs (a connection with one is never
    /// evicted).
    running: AtomicUsize,
    /// Milliseconds after [`OpenConnections::epoch`] of the last byte read
    /// or written.
    last_io_ms: AtomicU64,
    /// Set when a newer connection needs its place.
    evicted: Notify,
}

/// A connection's place among the open ones, given up on drop.
struct Admitted {
    open: Arc<OpenConnections>,
    id: u64,
    state: Arc<ConnectionState>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.open.lock().remove(&self.id);
    }
}

/// The cap a new connection reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cap {
    PerPeer,
    Total,
}

impl OpenConnections {
    fn new(max: usize, max_per_peer: usize) -> Self {
        Self {
            max: max.max(1),
            max_per_peer: max_per_peer.max(1),
            by_id: Mutex::default(),
            next_id: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<ConnectionState>>> {
        self.by_id
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A place for a new connection from `peer`, and the cap it reached:
    /// at the peer's share, the peer's oldest connection running no request
    /// is told to close; at the total cap, the oldest of all. `None` when
    /// every candidate runs a request (the new connection is closed).
    fn admit(open: &Arc<Self>, peer: IpAddr) -> (Option<Admitted>, Option<Cap>) {
        let peer = peer.to_canonical();
        let mut by_id = open.lock();
        // At most `max` entries: counting them is cheaper than keeping a
        // second map in step.
        let from_peer = by_id.values().filter(|state| state.peer == peer).count();
        let cap = if from_peer >= open.max_per_peer {
            Some(Cap::PerPeer)
        } else if by_id.len() >= open.max {
            Some(Cap::Total)
        } else {
            None
        };
        if let Some(cap) = cap {
            let oldest_idle = by_id
                .iter()
                .find(|(_, state)| {
                    state.running.load(Ordering::Relaxed) == 0
                        && (cap == Cap::Total || state.peer == peer)
                })
                .map(|(&id, _)| id);
            let Some(state) = oldest_idle.and_then(|id| by_id.remove(&id)) else {
                return (None, Some(cap));
            };
            state.evicted.notify_one();
        }
        let id = open.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnectionState {
            peer,
            running: AtomicUsize::new(0),
            last_io_ms: AtomicU64::new(open.now_ms()),
            evicted: Notify::new(),
        });
        by_id.insert(id, Arc::clone(&state));
        drop(by_id);
        let admitted = Admitted {
            open: Arc::clone(open),
            id,
            state,
        };
        (Some(admitted), cap)
    }
}

/// Counts a running request while it lives.
struct RunningRequest(Arc<ConnectionState>);

impl RunningRequest {
    fn new(state: &Arc<ConnectionState>) -> Self {
        state.running.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(state))
    }
}

impl Drop for RunningRequest {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve_connection(
    stream: TcpStream,
    router: axum::Router,
    limits: ServerLimits,
    admitted: Admitted,
    mut closing: watch::Receiver<bool>,
) {
    let state = Arc::clone(&admitted.state);
    let io = TokioIo::new(Tracked {
        stream,
        open: Arc::clone(&admitted.open),
        state: Arc::clone(&state),
    });
    let request_state = Arc::clone(&state);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let mut router = router.clone();
        let running = RunningRequest::new(&request_state);
        async move {
            let _running = running;
            router.call(request.map(axum::body::Body::new)).await
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_REQUEST_BUFFER_BYTES);
    let mut connection = std::pin::pin!(builder.serve_connection(io, service));
    let mut idle_check = tokio::time::interval(IDLE_CHECK_EVERY);
    let idle_ms = u64::try_from(limits.idle_timeout.as_millis()).unwrap_or(u64::MAX);
    let mut shutting_down = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "HTTP connection ended");
                }
                break;
            }
            () = state.evicted.notified() => break,
            changed = closing.changed(), if !shutting_down => {
                shutting_down = true;
                if changed.is_ok() {
                    connection.as_mut().graceful_shutdown();
                }
            }
            _ = idle_check.tick() => {
                let quiet = admitted
                    .open
                    .now_ms()
                    .saturating_sub(state.last_io_ms.load(Ordering::Relaxed));
                if state.running.load(Ordering::Relaxed) == 0 && quiet >= idle_ms {
                    break;
                }
            }
        }
    }
    drop(admitted);
}

/// A connection's socket, noting when bytes last moved.
struct Tracked {
    stream: TcpStream,
    open: Arc<OpenConnections>,
    state: Arc<ConnectionState>,
}

impl Tracked {
    fn moved(&self) {
        self.state
            .last_io_ms
            .store(self.open.now_ms(), Ordering::Relaxed);
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.moved();
        }
        result
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            this.moved();
        }
        result
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            this.moved();
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    fn limits() -> ServerLimits {
        ServerLimits {
            max_connections: 4,
            max_per_peer: 64,
            header_read_timeout: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(2),
            shutdown_grace: Duration::from_millis(300),
        }
    }

    async fn start(
        limits: ServerLimits,
    ) -> (
        std::net::SocketAddr,
        oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let (address, stop, task, _) = start_counted(limits).await;
        (address, stop, task)
    }

    /// [`start`] on every loopback address, with the refusal counters.
    async fn start_counted(
        limits: ServerLimits,
    ) -> (
        std::net::SocketAddr,
        oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
        ShedConnections,
    ) {
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let (stop, stopped) = oneshot::channel::<()>();
        let shed = ShedConnections::default();
        let task = tokio::spawn(serve(listener, router, limits, shed.clone(), async {
            let _ = stopped.await;
        }));
        (address, stop, task, shed)
    }

    /// A connection to `address` from the loopback address `from`.
    async fn connect_from(from: [u8; 4], address: std::net::SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(std::net::SocketAddr::from((from, 0))).unwrap();
        socket.connect(address).await.unwrap()
    }

    /// Connects and sends half a request.
    async fn half_sent(address: std::net::SocketAddr) -> TcpStream {
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        stream
    }

    /// A whole `GET /healthz`: the status line.
    async fn healthz(address: std::net::SocketAddr) -> String {
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        reply.lines().next().unwrap_or_default().to_owned()
    }

    /// Whether the server closed `stream` (EOF or reset) within `within`.
    async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 256];
        matches!(
            tokio::time::timeout(within, stream.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_half_sent_request_is_closed_after_the_header_timeout() {
        let (address, _stop, _task) = start(limits()).await;
        let mut stream = half_sent(address).await;
        let started = Instant::now();
        assert!(closed_within(&mut stream, Duration::from_secs(3)).await);
        assert!(started.elapsed() >= Duration::from_millis(400));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn over_the_cap_the_oldest_idle_connection_makes_room() {
        let (address, _stop, _task) = start(limits()).await;
        let mut held = Vec::new();
        for _ in 0..10 {
            held.push(half_sent(address).await);
        }
        let started = Instant::now();
        assert_eq!(healthz(address).await, "HTTP/1.1 200 OK");
        assert!(started.elapsed() < Duration::from_millis(300));
        // The six oldest were closed to make room (and one more for the
        // probe), the newest stay open.
        assert!(closed_within(&mut held[0], Duration::from_millis(200)).await);
        assert!(!closed_within(&mut held[9], Duration::from_millis(100)).await);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn one_peer_over_its_share_churns_only_its_own_places() {
        let mut limits = limits();
        limits.max_connections = 16;
        limits.max_per_peer = 3;
        limits.header_read_timeout = Duration::from_secs(60);
        let (address, _stop, _task, shed) = start_counted(limits).await;
        let half = b"GET /healthz HTTP/1.1\r\nHost: x\r\n";
        let mut other = connect_from([127, 0, 0, 2], address).await;
        other.write_all(half).await.unwrap();
        let mut held = Vec::new();
        for _ in 0..10 {
            let mut stream = connect_from([127, 0, 0, 1], address).await;
            stream.write_all(half).await.unwrap();
            held.push(stream);
        }
        // Each over the share of three closed the peer's oldest: the
        // seven oldest are closed, the three newest and the other peer's
        // connection stay open.
        for stream in &mut held[..7] {
            assert!(closed_within(stream, Duration::from_millis(500)).await);
        }
        for stream in held[7..].iter_mut().chain([&mut other]) {
            assert!(!closed_within(stream, Duration::from_millis(50)).await);
        }
        assert_eq!(shed.per_peer.get(), 7);
        assert_eq!(shed.total.get(), 0);
        // The flooding peer itself still gets an answer.
        assert_eq!(healthz(address).await, "HTTP/1.1 200 OK");
    }

    #[test]
    fn admit_refuses_when_every_candidate_runs_a_request() {
        let open = Arc::new(OpenConnections::new(3, 2));
        let a = IpAddr::from([10, 0, 0, 1]);
        let b = IpAddr::from([10, 0, 0, 2]);
        let first = OpenConnections::admit(&open, a).0.unwrap();
        // An IPv4-mapped IPv6 address is the same peer.
        let mapped = IpAddr::from(std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
        let second = OpenConnections::admit(&open, mapped).0.unwrap();
        let third = OpenConnections::admit(&open, b).0.unwrap();
        let _running: Vec<_> = [&first, &second]
            .iter()
            .map(|admitted| RunningRequest::new(&admitted.state))
            .collect();
        // a's two places run requests: refused, though b's is idle.
        let (admitted, cap) = OpenConnections::admit(&open, a);
        assert!(admitted.is_none());
        assert_eq!(cap, Some(Cap::PerPeer));
        // At the total cap, another peer evicts b's idle one.
        let (admitted, cap) = OpenConnections::admit(&open, IpAddr::from([10, 0, 0, 3]));
        assert_eq!(cap, Some(Cap::Total));
        let fourth = admitted.unwrap();
        let _running = RunningRequest::new(&fourth.state);
        let (admitted, cap) = OpenConnections::admit(&open, b);
        assert!(admitted.is_none());
        assert_eq!(cap, Some(Cap::Total));
        drop((first, third, fourth));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn shutdown_does_not_wait_for_clients() {
        let mut limits = limits();
        limits.header_read_timeout = Duration::from_secs(60);
        let (address, stop, task) = start(limits).await;
        let _held: Vec<TcpStream> =
            futures_util::future::join_all((0..3).map(|_| half_sent(address))).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = Instant::now();
        stop.send(()).unwrap();
        task.await.unwrap();
        assert!(
            started.elapsed() < limits.shutdown_grace + Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_idle_connection_is_closed() {
        let mut limits = limits();
        limits.header_read_timeout = Duration::from_secs(60);
        limits.idle_timeout = Duration::from_millis(1500);
        let (address, _stop, _task) = start(limits).await;
        let mut stream = half_sent(address).await;
        assert!(closed_within(&mut stream, Duration::from_secs(4)).await);
    }
}
