//! Continuous mode (`clrbpf agent`): the last stage of the data flow for
//! profiles that leave the host. The driver ([`crate::pipeline::driver`])
//! cuts a window every upload interval ([`cuts::Cuts`]) and hands it to
//! [`ship::ServiceSinks`], the agent's
//! [`ProfileSink`](crate::export::sink::ProfileSink), which splits it into
//! one [`WindowBatch`] (one [`ServiceProfile`] per service and
//! [`ProfileType`]); from there:
//!
//! 1. [`queue::DeliveryQueue`] (one per configured backend) takes the
//!    batch without ever blocking the caller: a bounded queue per backend,
//!    the oldest window dropped first when it is full, retries with
//!    exponential backoff and jitter, on its own tokio task.
//!    [`queue::FanOut`] hands one batch to several queues.
//! 2. A [`WindowUploader`] is one backend's protocol client:
//!    [`pyroscope::PyroscopeUploader`] (Pyroscope's push API),
//!    [`otlp::OtlpUploader`] (OTLP profiles over HTTP) or
//!    [`directory::DirectoryUploader`] (rolling `.pb.gz` files, the default).
//! 3. [`http`] serves `/metrics` ([`metrics::AgentMetrics`], with the .NET
//!    runtime counters of [`crate::clr::counters`]), `/healthz`, `/readyz`
//!    and, with `--enable-pull`, `/debug/pprof/profile`, on the
//!    connections [`server`] keeps in bounds.
//!
//! [`batch::window_batch`] splits a window's combined profile into the
//! batch; [`config`] turns the command's options into these parts.
//!
//! The profiles themselves are the [`crate::profile::Profile`] model that
//! [`crate::export::pprof`] encodes; nothing here changes their samples.

pub mod batch;
pub mod config;
pub mod cuts;
pub mod directory;
pub mod http;
pub mod metrics;
pub mod otlp;
pub mod pyroscope;
pub mod queue;
pub mod run;
pub mod server;
pub mod ship;

use std::{
    fmt,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::profile::Profile;

pub use crate::export::sink::{BoxFuture, FlushReport};

pub use crate::profile::kinds::ProfileType;

/// Label keys of a [`ServiceProfile`] (OpenTelemetry resource attribute
/// names; each sink maps them to its backend's conventions). A pid or a
/// container id is not among them: a series named by one would be new at
/// every restart. They are labels of the samples inside the profile.
pub mod series_keys {
    pub const SERVICE_NAME: &str = "service.name";
    pub const PROCESS_EXECUTABLE_NAME: &str = "process.executable.name";
    pub const HOST_NAME: &str = "host.name";
    pub const K8S_NAMESPACE_NAME: &str = "k8s.namespace.name";
    pub const K8S_POD_NAME: &str = "k8s.pod.name";
    pub const K8S_POD_UID: &str = "k8s.pod.uid";
    pub const K8S_CONTAINER_NAME: &str = "k8s.container.name";
    pub const K8S_NODE_NAME: &str = "k8s.node.name";
    pub const K8S_DEPLOYMENT_NAME: &str = "k8s.deployment.name";
}

/// One service's profile of one type for one window.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceProfile {
    /// The service, named as the issue orders it (`OTEL_SERVICE_NAME`,
    /// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`, `DD_SERVICE`, the
    /// Kubernetes workload, the executable): chosen by the pipeline.
    pub service_name: String,
    pub profile_type: ProfileType,
    /// The series' process and Kubernetes labels, keyed by OpenTelemetry
    /// resource attribute names ([`series_keys`]), without
    /// `service.name` (that is [`Self::service_name`]). A key appears at
    /// most once; sinks keep the first.
    pub labels: Vec<(String, String)>,
    /// The samples. Its `start_unix_ns`/`duration_ns` should be the
    /// window's; sinks fill them from the window when they are 0.
    pub profile: Profile,
}

/// One closed window: everything the pipeline aggregated between `start`
/// and `start + duration`.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowBatch {
    /// Wall-clock start, aligned to the upload interval.
    pub start: SystemTime,
    pub duration: Duration,
    pub profiles: Vec<ServiceProfile>,
}

impl WindowBatch {
    /// The window start in nanoseconds since the Unix epoch (0 before it).
    pub fn start_unix_ns(&self) -> i64 {
        self.start.duration_since(UNIX_EPOCH).map_or(0, |since| {
            i64::try_from(since.as_nanos()).unwrap_or(i64::MAX)
        })
    }

    /// `profile` with the window's time range filled in where it has none.
    pub(crate) fn timed(&self, profile: &Profile) -> Profile {
        let mut profile = profile.clone();
        if profile.start_unix_ns == 0 {
            profile.start_unix_ns = self.start_unix_ns();
        }
        if profile.duration_ns == 0 {
            profile.duration_ns = i64::try_from(self.duration.as_nanos()).unwrap_or(i64::MAX);
        }
        profile
    }
}

/// One backend's protocol client: delivers one window, once. Retries are
/// the queue's business.
pub trait WindowUploader: Send + Sync + 'static {
    /// The sink's name in metrics and logs (`pyroscope`, `otlp`, `directory`).
    fn name(&self) -> &'static str;

    fn upload(&self, batch: Arc<WindowBatch>) -> BoxFuture<'_, Result<(), UploadError>>;
}

/// Why a window was not delivered.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("{sink} answered HTTP {status}: {body}")]
    Status {
        sink: &'static str,
        status: u16,
        /// The start of the answer, for the log.
        body: String,
    },
    #[error("cannot reach {sink} at {url}")]
    Transport {
        sink: &'static str,
        url: SinkUrl,
        /// Without its URL ([`reqwest::Error::without_url`]): `url` is the
        /// one to print.
        #[source]
        source: reqwest::Error,
    },
    #[error("cannot encode the window for {sink}")]
    Encode {
        sink: &'static str,
        #[source]
        source: crate::export::ExportError,
    },
    #[error("cannot write the window to `{path}`")]
    Write {
        path: std::path::PathBuf,
        #[source]
        source: crate::export::ExportError,
    },
    #[error("the output directory cannot be used (fix it, or pick another with --output-dir)")]
    OutputDir {
        #[source]
        source: crate::process::root::PrivateDirError,
    },
    #[error("the {sink} writer stopped")]
    WriterStopped { sink: &'static str },
}

impl UploadError {
    /// Whether trying again later may work: connection failures, timeouts,
    /// 408, 429 and 5xx answers. Other 4xx answers (bad request, bad
    /// credentials, an unsupported OTLP revision) and local encoding or
    /// disk errors are final for that window.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Status { status, .. } => matches!(status, 408 | 429 | 500..=599),
            Self::Transport { .. } => true,
            Self::Encode { .. }
            | Self::Write { .. }
            | Self::OutputDir { .. }
            | Self::WriterStopped { .. } => false,
        }
    }
}

/// A backend's URL as given on the command line. `Display` and `Debug`
/// print it through [`redact_url`], so a credential in it (a token as the
/// userinfo's password, an API key in the query) reaches no log, error or
/// debug dump; only the request sees [`Self::expose`].
#[derive(Clone, PartialEq, Eq)]
pub struct SinkUrl(String);

impl SinkUrl {
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL with `path` appended (a trailing `/` of the base dropped).
    pub fn join(&self, path: &str) -> Self {
        Self(format!("{}{path}", self.0.trim_end_matches('/')))
    }

    /// The whole URL, for the request only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SinkUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.0))
    }
}

impl fmt::Debug for SinkUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", redact_url(&self.0))
    }
}

/// `url` fit for a log: a userinfo (`user:glc_...@`) becomes
/// `[redacted]@`, and so do the query and fragment (`?[redacted]`). Works
/// on any text, parsable as a URL or not.
pub fn redact_url(url: &str) -> String {
    const REDACTED: &str = "[redacted]";
    let (scheme, rest) = match url.find("://") {
        Some(at) => url.split_at(at + 3),
        None => ("", url),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    match authority.rfind('@') {
        Some(at) => {
            out.push_str(REDACTED);
            out.push_str(&authority[at..]);
        }
        None => out.push_str(authority),
    }
    match tail.find(['?', '#']) {
        Some(at) => {
            out.push_str(&tail[..=at]);
            out.push_str(REDACTED);
        }
        None => out.push_str(tail),
    }
    out
}

/// Installs rustls' ring crypto provider as the process default (once),
/// which the HTTP clients of the sinks use. No OpenSSL, no aws-lc.
pub fn install_tls_provider() {
    // Err means a provider is already installed: fine either way.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Builds the HTTP client the network sinks share: rustls, a request
/// timeout, no proxy from the environment (an agent talks to the URL it
/// was given).
pub fn http_client(timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    install_tls_provider();
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout.min(Duration::from_secs(10)))
        .user_agent(concat!("clrbpf/", env!("CARGO_PKG_VERSION")))
        .no_proxy()
        .build()
}

/// `N` random bytes from the standard library's per-process random hasher
/// keys (for ids; not for secrets).
pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut out = [0u8; N];
    for (index, chunk) in out.chunks_mut(8).enumerate() {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(crate::profile::monotonic_ns());
        hasher.write_usize(index);
        let word = hasher.finish().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    out
}

/// Most bytes of a backend's answer the agent reads. An answer is a short
/// status or an error message; a backend that sends more (an endless
/// chunked body, gigabytes with an error) is cut off there.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The start of a backend's answer, as [`read_answer`] took it.
#[derive(Debug, Default)]
pub(crate) struct Answer {
    /// At most [`MAX_ANSWER_BYTES`].
    pub body: Vec<u8>,
    /// The backend sent more than `body`, or the read failed: the rest was
    /// not read.
    pub cut: bool,
}

/// Reads at most `limit` bytes of `response`'s body, chunk by chunk, then
/// drops it: hyper closes a connection whose body was not read to its
/// end, so an endless or huge body costs `limit` bytes and no more time;
/// a body that trickles is cut by the client's request timeout.
pub(crate) async fn read_answer(mut response: reqwest::Response, limit: usize) -> Answer {
    let mut answer = Answer::default();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - answer.body.len();
                answer
                    .body
                    .extend_from_slice(&chunk[..chunk.len().min(room)]);
                if chunk.len() >= room {
                    // Full: whatever follows is not read (an answer of
                    // exactly `limit` bytes counts as cut too).
                    answer.cut = true;
                    return answer;
                }
            }
            Ok(None) => return answer,
            Err(_) => {
                answer.cut = true;
                return answer;
            }
        }
    }
}

/// The first `limit` bytes of an HTTP answer as text, for error messages.
pub(crate) fn body_excerpt(body: &[u8], limit: usize) -> String {
    let end = body.len().min(limit);
    let mut text = String::from_utf8_lossy(&body[..end]).into_owned();
    text.retain(|c| !c.is_control() || c == ' ');
    if body.len() > limit {
        text.push_str("...");
    }
    text
}

#[cfg(test)]
pub(crate) mod test_support;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_logged_without_their_secrets() {
        for (url, shown) in [
            (
                "https://user:glc_abc@profiles.grafana.net/",
                "https://[redacted]@profiles.grafana.net/",
            ),
            (
                "http://glc_abc@host:4040/push?token=glc_def#x",
                "http://[redacted]@host:4040/push?[redacted]",
            ),
            ("http://collector:4318", "http://collector:4318"),
            ("collector:4318/a#glc_abc", "collector:4318/a#[redacted]"),
            ("user:p@ss@host", "[redacted]@host"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        let url = SinkUrl::new("https://user:glc_abc@host/");
        assert_eq!(url.join("/v1").expose(), "https://user:glc_abc@host/v1");
        for text in [format!("{url}"), format!("{url:?}")] {
            assert!(!text.contains("glc_abc"), "{text}");
            assert!(text.contains("host"), "{text}");
        }
    }
}
