//! Windows and a loopback HTTP receiver for the sinks' tests. The receiver
//! stands in for Pyroscope and an OpenTelemetry collector, neither of which
//! can be installed here: it records each request for the test to decode
//! with the published message types, and answers what the test scripts.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, UNIX_EPOCH},
};

use axum::{
    body::Bytes,
    http::{HeaderMap, StatusCode, Uri},
};

use super::{ProfileType, ServiceProfile, WindowBatch, series_keys};
use crate::export::test_profile;

/// A 15 s window starting `second` seconds after the epoch, with the
/// shared test profile for service `checkout`.
pub(crate) fn window(second: u64) -> WindowBatch {
    WindowBatch {
        start: UNIX_EPOCH + Duration::from_secs(second),
        duration: Duration::from_secs(15),
        profiles: vec![service_profile("checkout", ProfileType::ProcessCpu)],
    }
}

/// The shared test profile without a time range (the window gives it).
pub(crate) fn service_profile(service: &str, profile_type: ProfileType) -> ServiceProfile {
    let mut profile = test_profile::profile();
    profile.start_unix_ns = 0;
    profile.duration_ns = 0;
    ServiceProfile {
        service_name: service.to_owned(),
        profile_type,
        labels: vec![
            (
                series_keys::PROCESS_EXECUTABLE_NAME.to_owned(),
                "dotnet".to_owned(),
            ),
            (
                series_keys::K8S_NAMESPACE_NAME.to_owned(),
                "shop".to_owned(),
            ),
        ],
        profile,
    }
}

/// A scripted "status" that never answers.
pub(crate) const HANG: u16 = 0;

/// One request the receiver got.
#[derive(Clone, Debug)]
pub(crate) struct ReceivedRequest {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// A loopback HTTP server on 127.0.0.1:0 that records every POST and
/// answers with the next scripted status (200 once the script is used up);
/// [`HANG`] in the script holds the answer back for a minute (a sink that
/// accepts the connection and never answers). The body of every answer is
/// plain text, garbage to a protobuf client.
pub(crate) struct Receiver {
    pub addr: SocketAddr,
    pub requests: Arc<Mutex<Vec<ReceivedRequest>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    pub(crate) async fn start(script: Vec<u16>) -> Self {
        let requests = Arc::new(Mutex::new(Vec::new()));
        let script = Arc::new(Mutex::new(script.into_iter()));
        let recorded = Arc::clone(&requests);
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let recorded = Arc::clone(&recorded);
            let script = Arc::clone(&script);
            async move {
                recorded.lock().unwrap().push(ReceivedRequest {
                    path: uri.path().to_owned(),
                    headers,
                    body,
                });
                let status = script.lock().unwrap().next().unwrap_or(200);
                if status == HANG {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
                (
                    StatusCode::from_u16(status.max(200)).unwrap(),
                    "scripted answer",
                )
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            addr,
            requests,
            task,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub(crate) fn requests(&self) -> Vec<ReceivedRequest> {
        self.requests.lock().unwrap().clone()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A loopback backend gone wrong: it answers every request with `status`
/// and a body that never ends (chunked, or under a `Content-Length` of a
/// terabyte), written as fast as the client takes it, until the client
/// closes the connection. Counts the body bytes it got out.
pub(crate) struct EndlessAnswer {
    pub addr: SocketAddr,
    pub sent: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl EndlessAnswer {
    pub(crate) async fn start(status: u16, chunked: bool) -> Self {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = Arc::clone(&sent);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let counter = Arc::clone(&counter);
                tokio::spawn(async move {
                    // The request: its head, then Content-Length bytes.
                    let mut request = Vec::new();
                    let mut buf = [0u8; 16 * 1024];
                    let body_start = loop {
                        if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                            break at + 4;
                        }
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&request[..body_start]).to_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while request.len() < body_start + length {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let framing = if chunked {
                        "Transfer-Encoding: chunked".to_owned()
                    } else {
                        format!("Content-Length: {}", 1u64 << 40)
                    };
                    let head = format!("HTTP/1.1 {status} Scripted\r\n{framing}\r\n\r\n");
                    if stream.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    let block = vec![b'x'; 64 * 1024];
                    let mut frame = Vec::with_capacity(block.len() + 16);
                    if chunked {
                        frame.extend_from_slice(format!("{:x}\r\n", block.len()).as_bytes());
                        frame.extend_from_slice(&block);
                        frame.extend_from_slice(b"\r\n");
                    } else {
                        frame = block;
                    }
                    while stream.write_all(&frame).await.is_ok() {
                        counter.fetch_add(frame.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        Self { addr, sent, task }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub(crate) fn sent(&self) -> u64 {
        self.sent.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for EndlessAnswer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
