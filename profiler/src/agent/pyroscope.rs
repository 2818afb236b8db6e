//! The Pyroscope sink: Pyroscope's push API (Connect protocol, binary
//! protobuf over HTTP/1.1), which Pyroscope, Grafana Cloud Profiles and
//! Grafana Alloy's `pyroscope.receive_http` accept.
//!
//! 1. One `POST {url}/push.v1.PusherService/Push`,
//!    `Content-Type: application/proto`, per window; the body is a
//!    `PushRequest` with one series per [`super::ServiceProfile`].
//! 2. A series' labels: `__name__` (the profile type: `process_cpu`,
//!    `wall`, `lock`, `exception`, ... as grafana/pyroscope-dotnet names
//!    them), `service_name`, then the process and Kubernetes labels with
//!    Pyroscope's usual names (`namespace`, `pod`, `container`, `node`;
//!    other dotted keys with `_`), sorted by name.
//! 3. Its one sample is the gzip pprof. Lock and exception profiles get
//!    the sample type names of the Pyroscope .NET profiler (`lock_count`,
//!    `lock_time`, `exception`) and a `cpu/nanoseconds` period type, so
//!    their profile ids (`lock:lock_count:count:cpu:nanoseconds`,
//!    `exception:exception:count:cpu:nanoseconds`) are the ones Grafana's
//!    .NET views ask for.
//! 4. Authentication: HTTP basic auth or a bearer token, and the tenant in
//!    `X-Scope-OrgID`. The secrets are [`Secret`]s: their `Debug` prints
//!    `[redacted]` and they are never logged.
//! 5. Of an answer, at most the first 64 KiB are read
//!    ([`super::read_answer`]), for the log of an error.

use std::{fmt, sync::Arc};

use prost::Message as _;

use super::{
    BoxFuture, ProfileType, ServiceProfile, SinkUrl, UploadError, WindowBatch, WindowUploader,
};
use crate::{
    export::write_pprof,
    profile::{Profile, ValueType, kinds::pyroscope_sample_type},
    pyroscope_proto::{
        push::v1::{PushRequest, RawProfileSeries, RawSample},
        types::v1::LabelPair,
    },
};

/// The push endpoint, after the base URL.
pub const PUSH_PATH: &str = "/push.v1.PusherService/Push";
/// The tenant header of Pyroscope (and Grafana's other databases).
pub const TENANT_HEADER: &str = "X-Scope-OrgID";
/// Characters of an error answer kept for the log.
const ERROR_BODY_LIMIT: usize = 512;

/// A credential: shown as `[redacted]` by `Debug`, never logged.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the request that carries it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// How the agent authenticates to Pyroscope.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PyroscopeAuth {
    /// HTTP basic auth: user and password.
    pub basic: Option<(String, Secret)>,
    /// `Authorization: Bearer ...`.
    pub bearer_token: Option<Secret>,
    /// `X-Scope-OrgID`.
    pub tenant_id: Option<String>,
}

/// The Pyroscope sink's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyroscopeConfig {
    /// The server's base URL, e.g. `http://pyroscope:4040`.
    pub url: SinkUrl,
    pub auth: PyroscopeAuth,
}

/// The Pyroscope sink; see the module documentation.
#[derive(Debug)]
pub struct PyroscopeUploader {
    client: reqwest::Client,
    endpoint: SinkUrl,
    auth: PyroscopeAuth,
}

impl PyroscopeUploader {
    pub fn new(config: PyroscopeConfig, client: reqwest::Client) -> Self {
        let PyroscopeConfig { url, auth } = config;
        Self {
            client,
            endpoint: url.join(PUSH_PATH),
            auth,
        }
    }
}

impl WindowUploader for PyroscopeUploader {
    fn name(&self) -> &'static str {
        "pyroscope"
    }

    fn upload(&self, batch: Arc<WindowBatch>) -> BoxFuture<'_, Result<(), UploadError>> {
        Box::pin(async move {
            let body = push_request(&batch)?.encode_to_vec();
            let mut request = self
                .client
                .post(self.endpoint.expose())
                .header(reqwest::header::CONTENT_TYPE, "application/proto")
                .body(body);
            if let Some((user, password)) = &self.auth.basic {
                request = request.basic_auth(user, Some(password.expose()));
            }
            if let Some(token) = &self.auth.bearer_token {
                request = request.bearer_auth(token.expose());
            }
            if let Some(tenant) = &self.auth.tenant_id {
                request = request.header(TENANT_HEADER, tenant);
            }
            let transport = |source: reqwest::Error| UploadError::Transport {
                sink: "pyroscope",
                url: self.endpoint.clone(),
                source: source.without_url(),
            };
            let response = request.send().await.map_err(transport)?;
            let status = response.status();
            // Pyroscope answers a push with an empty message: only an
            // error's text is worth reading, and only its start.
            let answer = super::read_answer(response, super::MAX_ANSWER_BYTES).await;
            if status.is_success() {
                return Ok(());
            }
            Err(UploadError::Status {
                sink: "pyroscope",
                status: status.as_u16(),
                body: super::body_excerpt(&answer.body, ERROR_BODY_LIMIT),
            })
        })
    }
}

/// The `PushRequest` of one window.
pub fn push_request(batch: &WindowBatch) -> Result<PushRequest, UploadError> {
    let mut series = Vec::with_capacity(batch.profiles.len());
    for profile in &batch.profiles {
        let pprof = pyroscope_profile(&batch.timed(&profile.profile), profile.profile_type);
        let mut raw_profile = Vec::new();
        write_pprof(&pprof, &mut raw_profile).map_err(|source| UploadError::Encode {
            sink: "pyroscope",
            source,
        })?;
        series.push(RawProfileSeries {
            labels: series_labels(profile),
            samples: vec![RawSample {
                raw_profile,
                id: uuid_v4(),
            }],
        });
    }
    Ok(PushRequest { series })
}

/// `__name__`, `service_name`, then the series' labels in Pyroscope's
/// names, sorted; a name appears once (the first value wins).
pub fn series_labels(profile: &ServiceProfile) -> Vec<LabelPair> {
    let mut labels = vec![
        LabelPair {
            name: "__name__".to_owned(),
            value: profile.profile_type.name().to_owned(),
        },
        LabelPair {
            name: "service_name".to_owned(),
            value: profile.service_name.clone(),
        },
    ];
    for (key, value) in &profile.labels {
        let name = pyroscope_label_name(key);
        if value.is_empty() || labels.iter().any(|label| label.name == name) {
            continue;
        }
        labels.push(LabelPair {
            name,
            value: value.clone(),
        });
    }
    labels.sort_by(|a, b| a.name.cmp(&b.name));
    labels
}

/// Pyroscope's (and Alloy's) label name for an OpenTelemetry key.
fn pyroscope_label_name(key: &str) -> String {
    use super::series_keys as k;
    match key {
        k::K8S_NAMESPACE_NAME => "namespace".to_owned(),
        k::K8S_POD_NAME => "pod".to_owned(),
        k::K8S_CONTAINER_NAME => "container".to_owned(),
        k::K8S_NODE_NAME => "node".to_owned(),
        other => other
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect(),
    }
}

/// The profile with the sample type names Pyroscope's .NET views expect.
pub fn pyroscope_profile(profile: &Profile, profile_type: ProfileType) -> Profile {
    let mut profile = profile.clone();
    let mut renamed = false;
    for sample_type in &mut profile.sample_types {
        if let Some(to) = pyroscope_sample_type(profile_type, &sample_type.r#type) {
            sample_type.r#type = to.into();
            renamed = true;
        }
    }
    if !renamed {
        return profile;
    }
    if profile.period_type.is_none() {
        profile.period_type = Some(ValueType::new("cpu", "nanoseconds"));
    }
    profile
}

/// A random (version 4) UUID, for `RawSample.ID`.
fn uuid_v4() -> String {
    let mut bytes = super::random_bytes::<16>();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        agent::{
            metrics::AgentMetrics,
            queue::{DeliveryQueue, RetryPolicy},
            test_support::{Receiver, service_profile, window},
        },
        export::{read_pprof, test_profile},
    };

    fn label<'a>(labels: &'a [LabelPair], name: &str) -> Option<&'a str> {
        labels
            .iter()
            .find(|label| label.name == name)
            .map(|label| label.value.as_str())
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let config = PyroscopeConfig {
            url: SinkUrl::new("http://x"),
            auth: PyroscopeAuth {
                basic: Some(("user".into(), Secret::new("hunter2"))),
                bearer_token: Some(Secret::new("glc_token")),
                tenant_id: Some("team-a".into()),
            },
        };
        let uploader = PyroscopeUploader::new(config.clone(), reqwest::Client::new());
        for text in [format!("{config:?}"), format!("{uploader:?}")] {
            assert!(!text.contains("hunter2"), "{text}");
            assert!(!text.contains("glc_token"), "{text}");
            assert!(text.contains("[redacted]"), "{text}");
        }
    }

    #[test]
    fn labels_use_pyroscope_names() {
        let profile = service_profile("checkout", ProfileType::Lock);
        let labels = series_labels(&profile);
        assert_eq!(label(&labels, "__name__"), Some("lock"));
        assert_eq!(label(&labels, "service_name"), Some("checkout"));
        assert_eq!(label(&labels, "namespace"), Some("shop"));
        assert_eq!(label(&labels, "process_pid"), None, "no pid names a series");
        assert_eq!(label(&labels, "process_executable_name"), Some("dotnet"));
        let names: Vec<&str> = labels.iter().map(|l| l.name.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
    }

    #[test]
    fn lock_and_exception_profiles_get_the_dotnet_type_names() {
        let mut profile = test_profile::profile();
        profile.sample_types = vec![
            ValueType::new("contentions", "count"),
            ValueType::new("delay", "nanoseconds"),
        ];
        profile.period_type = None;
        let lock = pyroscope_profile(&profile, ProfileType::Lock);
        let types: Vec<(&str, &str)> = lock
            .sample_types
            .iter()
            .map(|t| (&*t.r#type, &*t.unit))
            .collect();
        assert_eq!(
            types,
            [("lock_count", "count"), ("lock_time", "nanoseconds")]
        );
        assert_eq!(lock.period_type, Some(ValueType::new("cpu", "nanoseconds")));
        let cpu = pyroscope_profile(&profile, ProfileType::ProcessCpu);
        assert_eq!(cpu, profile);
        assert_ne!(uuid_v4(), uuid_v4());
        assert_eq!(uuid_v4().len(), 36);
    }

    /// Against a loopback receiver standing in for Pyroscope (no server can
    /// be installed here): the request decodes as a `PushRequest` with
    /// the published field layout, carries the auth headers, and a 503
    /// answer is retried.
    #[tokio::test(flavor = "current_thread")]
    async fn pushes_a_decodable_request_with_auth_and_retries_a_503() {
        let receiver = Receiver::start(vec![503]).await;
        let config = PyroscopeConfig {
            url: SinkUrl::new(format!("{}/", receiver.url())),
            auth: PyroscopeAuth {
                basic: Some(("grafana".into(), Secret::new("s3cret"))),
                bearer_token: None,
                tenant_id: Some("tenant-1".into()),
            },
        };
        let client = crate::agent::http_client(Duration::from_secs(5)).unwrap();
        let uploader = Arc::new(PyroscopeUploader::new(config, client));
        let metrics = AgentMetrics::new();
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(5),
            ..RetryPolicy::default()
        };
        let queue = DeliveryQueue::spawn(uploader, policy, metrics.sink_counters("pyroscope"));
        let mut batch = window(1_795_000_000);
        batch
            .profiles
            .push(service_profile("billing", ProfileType::Exception));
        queue.submit(Arc::new(batch.clone()));
        assert_eq!(queue.flush(Duration::from_secs(10)).await.abandoned, 0);

        let requests = receiver.requests();
        assert_eq!(requests.len(), 2, "one 503, one retry");
        let request = &requests[1];
        assert_eq!(request.path, PUSH_PATH);
        assert_eq!(request.headers["content-type"], "application/proto");
        assert_eq!(request.headers[TENANT_HEADER], "tenant-1");
        // base64("grafana:s3cret")
        assert_eq!(
            request.headers["authorization"],
            "Basic Z3JhZmFuYTpzM2NyZXQ="
        );

        let push = PushRequest::decode(request.body.as_ref()).expect("a PushRequest");
        assert_eq!(push.series.len(), 2);
        let cpu = &push.series[0];
        assert_eq!(label(&cpu.labels, "__name__"), Some("process_cpu"));
        assert_eq!(label(&cpu.labels, "service_name"), Some("checkout"));
        assert_eq!(cpu.samples.len(), 1);
        assert!(
            cpu.samples[0].raw_profile.starts_with(&[0x1f, 0x8b]),
            "gzip"
        );
        let pprof = read_pprof(&cpu.samples[0].raw_profile).unwrap();
        assert_eq!(pprof.time_nanos, batch.start_unix_ns());
        assert_eq!(pprof.duration_nanos, 15_000_000_000);
        let names: Vec<&str> = pprof.string_table.iter().map(String::as_str).collect();
        assert!(names.contains(&test_profile::SPIN_SHORT), "{names:?}");
        let exception = &push.series[1];
        assert_eq!(label(&exception.labels, "__name__"), Some("exception"));
        assert_eq!(label(&exception.labels, "service_name"), Some("billing"));

        let counters = metrics.sink_counters("pyroscope");
        assert_eq!(counters.shipped.get(), 1);
        assert_eq!(counters.failed.get(), 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_sink_that_never_answers_times_out_and_is_retried() {
        let receiver = Receiver::start(vec![crate::agent::test_support::HANG]).await;
        let client = crate::agent::http_client(Duration::from_millis(300)).unwrap();
        let uploader = PyroscopeUploader::new(
            PyroscopeConfig {
                url: SinkUrl::new(receiver.url()),
                auth: PyroscopeAuth::default(),
            },
            client,
        );
        let started = std::time::Instant::now();
        let error = uploader.upload(Arc::new(window(1))).await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(error, UploadError::Transport { .. }), "{error:?}");
        assert!(error.is_retryable());
        // The next attempt is answered.
        uploader.upload(Arc::new(window(1))).await.unwrap();
    }

    /// A server that answers 500 with a terabyte of error: the error
    /// carries the start of it and the upload does not read the rest.
    #[tokio::test(flavor = "current_thread")]
    async fn a_huge_error_answer_is_not_read() {
        let receiver = crate::agent::test_support::EndlessAnswer::start(500, false).await;
        let client = crate::agent::http_client(Duration::from_secs(20)).unwrap();
        let uploader = PyroscopeUploader::new(
            PyroscopeConfig {
                url: SinkUrl::new(receiver.url()),
                auth: PyroscopeAuth::default(),
            },
            client,
        );
        let started = std::time::Instant::now();
        let error = uploader.upload(Arc::new(window(1))).await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        let UploadError::Status { status, body, .. } = &error else {
            panic!("{error:?}");
        };
        assert_eq!(*status, 500);
        assert!(body.starts_with("xxxx") && body.len() <= 515, "{body}");
        assert!(error.is_retryable());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(receiver.sent() < 32 << 20, "{} bytes sent", receiver.sent());
    }

    /// A refused connection names the URL without its credentials.
    #[tokio::test(flavor = "current_thread")]
    async fn a_refused_connection_is_a_retryable_transport_error() {
        // Bind, then close: the port refuses connections.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let client = crate::agent::http_client(Duration::from_secs(2)).unwrap();
        let uploader = PyroscopeUploader::new(
            PyroscopeConfig {
                url: SinkUrl::new(format!("http://user:glc_abc@{addr}")),
                auth: PyroscopeAuth::default(),
            },
            client,
        );
        let error = uploader.upload(Arc::new(window(1))).await.unwrap_err();
        assert!(matches!(error, UploadError::Transport { .. }), "{error:?}");
        assert!(error.is_retryable());
        let text = crate::agent::metrics::ErrorChain(&error).to_string();
        assert!(!text.contains("glc_abc"), "{text}");
        assert!(
            text.contains(&format!("at http://[redacted]@{addr}{PUSH_PATH}")),
            "{text}"
        );
    }
}
