//! Both ends of the HTTP the agent speaks, for the tests: a client for its
//! endpoint (`/metrics`, `/readyz`, the pull) and a loopback backend that
//! stands in for Pyroscope and an OpenTelemetry collector (neither can be
//! installed here), keeping every request for the test to decode with the
//! published message types.

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    sync::{Arc, Mutex},
    thread,
    time::Duration,
};

use crate::HttpRequest;

/// `GET path` on a loopback port with `headers`: (status, body); status 0
/// when nothing answered within 60 s.
pub fn get(port: u16, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<u8>) {
    get_within(port, path, headers, Duration::from_secs(60))
}

/// [`get`] with the body as text.
pub fn get_text(port: u16, path: &str) -> (u16, String) {
    let (status, body) = get(port, path, &[]);
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// [`get`] that gives up after `within`.
pub fn get_within(
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    within: Duration,
) -> (u16, Vec<u8>) {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, Vec::new());
    };
    stream.set_read_timeout(Some(within)).expect("timeout");
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return (0, Vec::new());
    }
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    let split = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(reply.len());
    let head = String::from_utf8_lossy(&reply[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "the test client reads whole bodies only: {head}"
    );
    (status, reply.get(split + 4..).unwrap_or_default().to_vec())
}

/// The value of the series `name{labels}` in a `/metrics` text (`labels`
/// empty or `{...}` exactly as the agent writes them); `None` when absent.
pub fn metric(metrics: &str, name: &str, labels: &str) -> Option<f64> {
    let wanted = format!("{name}{labels} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&wanted))
        .and_then(|value| value.trim().parse().ok())
}

/// What the [`Backend`] answers one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// This status with an empty body.
    Status(u16),
    /// 200 with a chunked body that never ends.
    EndlessOk,
    /// 500 under a `Content-Length` of a terabyte, written until the client
    /// hangs up.
    HugeError,
}

/// One request the [`Backend`] took.
#[derive(Debug)]
pub struct Received {
    pub path: String,
    pub body: Vec<u8>,
    pub gzip: bool,
    /// The status it answered.
    pub status: u16,
    /// Body bytes it sent back before the client hung up.
    pub answered_bytes: u64,
}

type AnswerFn = dyn Fn(&str) -> Answer + Send + Sync;

/// A loopback HTTP server standing in for Pyroscope and an OpenTelemetry
/// collector: `answer` says what each request path gets.
pub struct Backend {
    port: u16,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Backend {
    pub fn start(answer: impl Fn(&str) -> Answer + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fake backend");
        let port = listener.local_addr().expect("its address").port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let keep = Arc::clone(&received);
        let answer: Arc<AnswerFn> = Arc::new(answer);
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let keep = Arc::clone(&keep);
                let answer = Arc::clone(&answer);
                thread::spawn(move || serve(stream, &*answer, &keep));
            }
        });
        Self { port, received }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The requests taken since the last call.
    pub fn take(&self) -> Vec<Received> {
        std::mem::take(&mut *self.received.lock().expect("backend lock"))
    }
}

/// Reads one request (a body with Content-Length), answers as told, and
/// closes the connection.
fn serve(mut stream: TcpStream, answer: &AnswerFn, keep: &Mutex<Vec<Received>>) {
    let Some(request) = HttpRequest::read(&mut stream) else {
        return;
    };
    let path = request.path.clone();
    let mut answered_bytes = 0u64;
    let block = vec![b'x'; 64 * 1024];
    let answer = answer(&path);
    let status = match answer {
        Answer::Status(status) => {
            let reason = if status == 200 { "OK" } else { "Error" };
            let _ = write!(
                stream,
                "HTTP/1.1 {status} {reason}\r\nContent-Type: application/proto\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            status
        }
        Answer::EndlessOk => {
            let mut chunk = format!("{:x}\r\n", block.len()).into_bytes();
            chunk.extend_from_slice(&block);
            chunk.extend_from_slice(b"\r\n");
            if stream
                .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                .is_ok()
            {
                while stream.write_all(&chunk).is_ok() {
                    answered_bytes += chunk.len() as u64;
                }
            }
            200
        }
        Answer::HugeError => {
            let head = format!(
                "HTTP/1.1 500 Internal Server Error\r\nContent-Length: {}\r\n\r\n",
                1u64 << 40
            );
            if stream.write_all(head.as_bytes()).is_ok() {
                while stream.write_all(&block).is_ok() {
                    answered_bytes += block.len() as u64;
                }
            }
            500
        }
    };
    keep.lock().expect("backend lock").push(Received {
        path,
        gzip: request.is_gzip(),
        body: request.body,
        status,
        answered_bytes,
    });
}

/// The bytes of a gzip stream, uncompressed.
pub fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .expect("gunzip");
    out
}
