//! From `clrbpf agent`'s options to running sinks: [`AgentConfig`] (the
//! checked configuration: secrets read from their files, the default
//! directory sink chosen), [`build_sinks`] (one [`DeliveryQueue`] per
//! backend behind one [`FanOut`]), and the two rules every window needs:
//! [`window_start`] (windows aligned to the wall clock) and
//! [`service_name`] (which service a process belongs to).

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use super::{
    SinkUrl, WindowUploader,
    directory::{DirectoryConfig, DirectoryUploader},
    metrics::AgentMetrics,
    otlp::{OtlpConfig, OtlpUploader},
    pyroscope::{PyroscopeAuth, PyroscopeConfig, PyroscopeUploader, Secret},
    queue::{DeliveryQueue, FanOut, RetryPolicy},
};
use crate::{
    cli::AgentArgs,
    pipeline::driver::{SamplingConfig, SamplingOptionError},
    process::Environ,
    profile::{Label, LabelValue, label_keys},
};

/// Where profiles go when no sink is named.
pub const DEFAULT_OUTPUT_DIR: &str = "/var/lib/clrbpf/profiles";
/// Timeout of one upload request.
pub const UPLOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest secret file read.
const MAX_SECRET_FILE_BYTES: u64 = 64 * 1024;

/// A configuration the agent refuses to start with; the message names the
/// option.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{option}: cannot read `{path}`")]
    SecretFile {
        option: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{option}: `{path}` is empty or larger than 64 KiB")]
    BadSecretFile { option: &'static str, path: PathBuf },
    #[error("{option}: must not be empty")]
    Empty { option: &'static str },
    #[error("--label: {reason}")]
    Labels { reason: String },
    #[error(transparent)]
    Sampling(#[from] SamplingOptionError),
    #[error("--output-dir: the directory cannot be used (fix it, or pick another)")]
    OutputDir(#[source] crate::process::root::PrivateDirError),
    #[error("cannot build the HTTP client")]
    HttpClient(#[source] reqwest::Error),
    #[error(
        "--enable-pull needs --http-token-file FILE (a bearer token, mode 0600): without one, whoever \
         reaches {listen}, every local user on a loopback address included, would get the profiles \
         of every selected process"
    )]
    UnprotectedPull { listen: SocketAddr },
}

/// The shortest `--container-id` prefix that selects a container, as
/// `docker` takes it: shorter ones are refused when the flag is parsed.
pub const CONTAINER_ID_PREFIX_MIN: usize = 12;

/// Whether `--container-id wanted` names the container `id` (64 hex
/// digits, from an anchored cgroup path): the whole id, or a prefix of at
/// least [`CONTAINER_ID_PREFIX_MIN`] digits.
fn container_id_matches(wanted: &str, id: &str) -> bool {
    wanted.len() >= CONTAINER_ID_PREFIX_MIN && id.starts_with(wanted)
}

/// Which processes the agent profiles. Empty lists: every process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessSelection {
    pub executables: Vec<String>,
    pub container_ids: Vec<String>,
    pub k8s_namespaces: Vec<String>,
}

impl ProcessSelection {
    pub fn is_everything(&self) -> bool {
        self.executables.is_empty()
            && self.container_ids.is_empty()
            && self.k8s_namespaces.is_empty()
    }

    /// Whether a process with this executable name, container id and
    /// namespace is selected (any one list matching is enough).
    pub fn selects(
        &self,
        executable: &str,
        container_id: Option<&str>,
        k8s_namespace: Option<&str>,
    ) -> bool {
        self.is_everything()
            || self.executables.iter().any(|name| name == executable)
            || container_id.is_some_and(|id| {
                self.container_ids
                    .iter()
                    .any(|wanted| container_id_matches(wanted, id))
            })
            || k8s_namespace.is_some_and(|ns| self.k8s_namespaces.iter().any(|wanted| wanted == ns))
    }

    /// Whether the process of a sample with these labels is selected: the
    /// same rule as [`Self::selects`], from the labels the pipeline puts on
    /// every sample (a sample without an executable name matches no
    /// executable).
    pub fn selects_labels(&self, labels: &[Label]) -> bool {
        if self.is_everything() {
            return true;
        }
        let text = |key: &str| {
            labels.iter().find_map(|label| match &label.value {
                LabelValue::Str(value) if &*label.key == key => Some(&**value),
                _ => None,
            })
        };
        self.selects(
            text(label_keys::PROCESS_EXECUTABLE_NAME).unwrap_or("unknown"),
            text(label_keys::CONTAINER_ID),
            text(label_keys::K8S_NAMESPACE_NAME),
        )
    }
}

/// `/debug/pprof/profile` (`--enable-pull`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullConfig {
    /// `--max-pull-seconds`.
    pub max_seconds: u64,
    /// The bearer token every request needs (`--http-token-file`): always
    /// there from the command line, loopback included, since every local
    /// user reaches a loopback port.
    pub token: Option<Secret>,
}

/// The checked configuration of `clrbpf agent`.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentConfig {
    pub frequency_hz: u64,
    pub upload_interval: Duration,
    /// Exception events with stacks per second and process (`None`: all).
    pub exceptions_per_second: Option<u32>,
    /// The `System.Runtime` EventCounters interval, in seconds.
    pub runtime_counters_interval_sec: u32,
    /// What is collected besides CPU samples, and how stacks are walked.
    pub sampling: SamplingConfig,
    pub selection: ProcessSelection,
    /// Series shipped per window at most (the rest as one overflow
    /// service, [`super::batch::OVERFLOW_SERVICE`]).
    pub max_services: usize,
    /// `--label`: on every series shipped, after the agent's own.
    pub static_labels: Vec<(String, String)>,
    pub pyroscope: Option<PyroscopeConfig>,
    pub otlp: Option<OtlpConfig>,
    pub directory: Option<DirectoryConfig>,
    pub grace_period: Duration,
    pub listen: SocketAddr,
    /// `None`: `/debug/pprof/profile` is not served.
    pub pull: Option<PullConfig>,
}

impl AgentConfig {
    /// Checks the options and reads the secret files. `host_name` is the
    /// node's name for OTLP's `host.name`.
    pub fn from_args(args: AgentArgs, host_name: Option<String>) -> Result<Self, ConfigError> {
        let AgentArgs {
            frequency,
            upload_interval,
            exceptions_per_second,
            runtime_counters_interval,
            sampling,
            executables,
            container_ids,
            k8s_namespaces,
            max_services,
            labels,
            pyroscope_url,
            pyroscope_basic_auth_user,
            pyroscope_basic_auth_password,
            pyroscope_basic_auth_password_file,
            pyroscope_bearer_token,
            pyroscope_bearer_token_file,
            pyroscope_tenant_id,
            otlp_url,
            output_dir,
            retention,
            retention_size,
            grace_period,
            listen,
            enable_pull,
            http_token_file,
            max_pull_seconds,
        } = args;
        check_static_labels(&labels)?;
        let pull = match (enable_pull, http_token_file) {
            (false, _) => None,
            (true, Some(path)) => Some(PullConfig {
                max_seconds: max_pull_seconds,
                token: Some(read_secret(&path, "--http-token-file")?),
            }),
            (true, None) => return Err(ConfigError::UnprotectedPull { listen }),
        };
        let sampling = SamplingConfig::from_args(sampling)?;
        let pyroscope = match pyroscope_url {
            None => None,
            Some(url) => {
                let password = match (
                    pyroscope_basic_auth_password,
                    pyroscope_basic_auth_password_file,
                ) {
                    (_, Some(path)) => {
                        Some(read_secret(&path, "--pyroscope-basic-auth-password-file")?)
                    }
                    (Some(password), None) => Some(Secret::new(password)),
                    (None, None) => None,
                };
                let basic = match pyroscope_basic_auth_user {
                    Some(user) if user.is_empty() => {
                        return Err(ConfigError::Empty {
                            option: "--pyroscope-basic-auth-user",
                        });
                    }
                    Some(user) => Some((user, password.unwrap_or_else(|| Secret::new("")))),
                    None => None,
                };
                let bearer_token = match (pyroscope_bearer_token, pyroscope_bearer_token_file) {
                    (_, Some(path)) => Some(read_secret(&path, "--pyroscope-bearer-token-file")?),
                    (Some(token), None) if token.is_empty() => {
                        return Err(ConfigError::Empty {
                            option: "--pyroscope-bearer-token",
                        });
                    }
                    (Some(token), None) => Some(Secret::new(token)),
                    (None, None) => None,
                };
                Some(PyroscopeConfig {
                    url: SinkUrl::new(url),
                    auth: PyroscopeAuth {
                        basic,
                        bearer_token,
                        tenant_id: pyroscope_tenant_id.filter(|tenant| !tenant.is_empty()),
                    },
                })
            }
        };
        let otlp = otlp_url.map(|url| OtlpConfig {
            url: SinkUrl::new(url),
            host_name,
        });
        let output_dir = output_dir.or_else(|| {
            (pyroscope.is_none() && otlp.is_none()).then(|| PathBuf::from(DEFAULT_OUTPUT_DIR))
        });
        let directory = output_dir.map(|dir| DirectoryConfig {
            dir,
            max_age: retention,
            max_total_bytes: retention_size,
        });
        Ok(Self {
            frequency_hz: frequency,
            upload_interval,
            exceptions_per_second: (exceptions_per_second > 0).then_some(exceptions_per_second),
            runtime_counters_interval_sec: u32::try_from(runtime_counters_interval.as_secs())
                .unwrap_or(u32::MAX),
            sampling,
            selection: ProcessSelection {
                executables,
                container_ids,
                k8s_namespaces,
            },
            max_services: usize::try_from(max_services).unwrap_or(usize::MAX),
            static_labels: labels,
            pyroscope,
            otlp,
            directory,
            grace_period,
            listen,
            pull,
        })
    }
}

/// A secret from a file (Kubernetes secret volumes end it with a newline:
/// trailing whitespace is dropped). Never follows the path into anything
/// but a regular file.
fn read_secret(path: &Path, option: &'static str) -> Result<Secret, ConfigError> {
    use std::io::Read as _;
    let read_error = |source| ConfigError::SecretFile {
        option,
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let metadata = file.metadata().map_err(read_error)?;
    if !metadata.is_file() || metadata.len() > MAX_SECRET_FILE_BYTES {
        return Err(ConfigError::BadSecretFile {
            option,
            path: path.to_owned(),
        });
    }
    let mut text = String::new();
    file.take(MAX_SECRET_FILE_BYTES)
        .read_to_string(&mut text)
        .map_err(read_error)?;
    let secret = text.trim_end();
    if secret.is_empty() {
        return Err(ConfigError::BadSecretFile {
            option,
            path: path.to_owned(),
        });
    }
    Ok(Secret::new(secret))
}

/// Starts one delivery queue per configured sink (on the current tokio
/// runtime) behind one [`FanOut`], which [`super::ship::ServiceSinks`] hands
/// every window. Creates the output directory.
pub fn build_sinks(
    config: &AgentConfig,
    metrics: &AgentMetrics,
    policy: RetryPolicy,
) -> Result<FanOut, ConfigError> {
    let mut uploaders: Vec<Arc<dyn WindowUploader>> = Vec::new();
    if config.pyroscope.is_some() || config.otlp.is_some() {
        let client = super::http_client(UPLOAD_TIMEOUT).map_err(ConfigError::HttpClient)?;
        if let Some(pyroscope) = &config.pyroscope {
            uploaders.push(Arc::new(PyroscopeUploader::new(
                pyroscope.clone(),
                client.clone(),
            )));
        }
        if let Some(otlp) = &config.otlp {
            uploaders.push(Arc::new(OtlpUploader::new(otlp.clone(), client)));
        }
    }
    if let Some(directory) = &config.directory {
        let uploader = DirectoryUploader::new(directory.clone()).map_err(ConfigError::OutputDir)?;
        uploaders.push(Arc::new(uploader));
    }
    Ok(FanOut::new(
        uploaders
            .into_iter()
            .map(|uploader| {
                let counters = metrics.sink_counters(uploader.name());
                DeliveryQueue::spawn(uploader, policy, counters)
            })
            .collect(),
    ))
}

/// Static labels shipped at most: each is on every series.
const MAX_STATIC_LABELS: usize = 16;

fn check_static_labels(labels: &[(String, String)]) -> Result<(), ConfigError> {
    if labels.len() > MAX_STATIC_LABELS {
        return Err(ConfigError::Labels {
            reason: format!("{} given, at most {MAX_STATIC_LABELS}", labels.len()),
        });
    }
    for (i, (key, _)) in labels.iter().enumerate() {
        if labels[..i].iter().any(|(earlier, _)| earlier == key) {
            return Err(ConfigError::Labels {
                reason: format!("`{key}` is given twice: keep one"),
            });
        }
    }
    Ok(())
}

/// The start of the window `now` falls in: windows are aligned to
/// multiples of `interval` since the Unix epoch, so every agent of a fleet
/// cuts at the same moments.
pub fn window_start(now: SystemTime, interval: Duration) -> SystemTime {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let interval_ns = interval.as_nanos().max(1);
    let aligned = since.as_nanos() - since.as_nanos() % interval_ns;
    UNIX_EPOCH + Duration::from_nanos(u64::try_from(aligned).unwrap_or(u64::MAX))
}

/// The service a process belongs to, in the issue's order:
/// `OTEL_SERVICE_NAME`, `service.name` in `OTEL_RESOURCE_ATTRIBUTES`,
/// `DD_SERVICE`, the Kubernetes workload, then the executable (or entry
/// assembly) name.
pub fn service_name(environ: &Environ, k8s_workload: Option<&str>, executable: &str) -> String {
    let non_empty =
        |value: Option<String>| value.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
    non_empty(environ.var("OTEL_SERVICE_NAME"))
        .or_else(|| {
            environ
                .var("OTEL_RESOURCE_ATTRIBUTES")
                .and_then(|attributes| resource_attribute(&attributes, "service.name"))
        })
        .or_else(|| non_empty(environ.var("DD_SERVICE")))
        .or_else(|| k8s_workload.filter(|w| !w.is_empty()).map(str::to_owned))
        .unwrap_or_else(|| executable.to_owned())
}

/// A key of `OTEL_RESOURCE_ATTRIBUTES` (`k1=v1,k2=v2`, values
/// percent-encoded as the OpenTelemetry SDKs read them).
fn resource_attribute(attributes: &str, key: &str) -> Option<String> {
    attributes.split(',').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        (name.trim() == key)
            .then(|| percent_decode(value.trim()))
            .filter(|value| !value.is_empty())
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok());
        match decoded {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    fn config(args: &[&str]) -> Result<AgentConfig, ConfigError> {
        let cli = Cli::try_parse_from(["clrbpf", "agent"].iter().chain(args)).expect("parses");
        let Command::Agent(args) = cli.command else {
            panic!("not agent")
        };
        AgentConfig::from_args(*args, Some("node-1".into()))
    }

    /// The container args of each committed render of the Helm chart
    /// (`deploy/helm/golden/*.yaml`, checked against the chart by `cargo
    /// xtask test`) are a valid agent command line: a chart that passes a
    /// flag the agent does not know would crash-loop on every node.
    #[test]
    fn the_charts_args_are_an_agent_command_line() {
        let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/golden");
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "s3cr3t\n").unwrap();
        let mut renders = 0;
        for entry in std::fs::read_dir(&golden).expect("the chart's golden renders") {
            let path = entry.expect("an entry").path();
            if path.extension().is_none_or(|e| e != "yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a render");
            let mut lines = text.lines().skip_while(|l| l.trim() != "args:").skip(1);
            let mut args: Vec<String> = lines
                .by_ref()
                .map_while(|l| l.trim().strip_prefix("- "))
                .map(|a| a.trim_matches('"').to_owned())
                .collect();
            // The token file is the chart's Secret, mounted in the pod:
            // a file of this test stands in for it.
            if let Some(at) = args.iter().position(|a| a == "--http-token-file") {
                args[at + 1] = token.to_string_lossy().into_owned();
            }
            assert_eq!(args.first().map(String::as_str), Some("agent"), "{path:?}");
            let cli = Cli::try_parse_from(std::iter::once("clrbpf".to_owned()).chain(args.clone()))
                .unwrap_or_else(|e| panic!("{path:?}: {args:?} does not parse: {e}"));
            let Command::Agent(agent) = cli.command else {
                panic!("{path:?}: not the agent")
            };
            AgentConfig::from_args(*agent, Some("node-1".into()))
                .unwrap_or_else(|e| panic!("{path:?}: {args:?} is refused: {e}"));
            renders += 1;
        }
        assert!(renders >= 4, "only {renders} renders in {golden:?}");
    }

    #[test]
    fn the_directory_is_the_default_sink() {
        let config = config(&[]).unwrap();
        assert!(config.pyroscope.is_none() && config.otlp.is_none());
        assert_eq!(
            config.directory.unwrap().dir,
            PathBuf::from(DEFAULT_OUTPUT_DIR)
        );
        let config = config_or_panic(&["--otlp-url", "http://c:4318"]);
        assert!(config.directory.is_none());
        assert_eq!(config.otlp.unwrap().host_name.as_deref(), Some("node-1"));
    }

    fn config_or_panic(args: &[&str]) -> AgentConfig {
        config(args).unwrap()
    }

    #[test]
    fn secrets_come_from_files_and_stay_out_of_debug_output() {
        let dir = tempfile::tempdir().unwrap();
        let password = dir.path().join("password");
        std::fs::write(&password, "hunter2\n").unwrap();
        let path = password.to_str().unwrap();
        let parsed = config_or_panic(&[
            "--pyroscope-url",
            "http://p:4040",
            "--pyroscope-basic-auth-user",
            "me",
            "--pyroscope-basic-auth-password-file",
            path,
        ]);
        let pyroscope = parsed.pyroscope.clone().unwrap();
        let (user, secret) = pyroscope.auth.basic.unwrap();
        assert_eq!((user.as_str(), secret.expose()), ("me", "hunter2"));
        assert!(!format!("{parsed:?}").contains("hunter2"));

        let missing = dir.path().join("missing");
        let error = config(&[
            "--pyroscope-url",
            "http://p:4040",
            "--pyroscope-bearer-token-file",
            missing.to_str().unwrap(),
        ])
        .unwrap_err();
        assert!(
            error.to_string().contains("--pyroscope-bearer-token-file"),
            "{error}"
        );
        std::fs::write(&password, "\n").unwrap();
        let error = config(&[
            "--pyroscope-url",
            "http://p:4040",
            "--pyroscope-bearer-token-file",
            path,
        ])
        .unwrap_err();
        assert!(
            matches!(error, ConfigError::BadSecretFile { .. }),
            "{error}"
        );
        // A token in a URL's userinfo is as secret as a token file's.
        let parsed = config_or_panic(&[
            "--pyroscope-url",
            "https://12345:glc_abc@profiles.grafana.net",
            "--otlp-url",
            "http://glc_def@collector:4318",
        ]);
        let shown = format!("{parsed:?}");
        assert!(!shown.contains("glc_"), "{shown}");
        assert!(shown.contains("[redacted]@profiles.grafana.net"), "{shown}");
        assert_eq!(
            parsed.pyroscope.unwrap().url.expose(),
            "https://12345:glc_abc@profiles.grafana.net"
        );
        let error = config(&["--clr-events", "locks"]).unwrap_err();
        assert!(error.to_string().starts_with("--clr-events"), "{error}");
    }

    #[test]
    fn the_pull_endpoint_is_off_or_protected() {
        assert_eq!(config_or_panic(&[]).pull, None, "off by default");
        // Loopback too: every local user reaches a loopback port.
        for listen in ["127.0.0.1:7071", "[::1]:7071", "0.0.0.0:7071"] {
            let error = config(&["--enable-pull", "--listen", listen]).unwrap_err();
            let message = error.to_string();
            assert!(
                message.contains("--enable-pull") && message.contains("--http-token-file"),
                "{message}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "s3cr3t\n").unwrap();
        let pull = config_or_panic(&[
            "--enable-pull",
            "--listen",
            "0.0.0.0:7071",
            "--http-token-file",
            token.to_str().unwrap(),
        ])
        .pull
        .expect("on");
        assert_eq!(pull.max_seconds, 60);
        assert_eq!(pull.token.expect("a token").expose(), "s3cr3t");
        std::fs::write(&token, "").unwrap();
        let error = config(&[
            "--enable-pull",
            "--http-token-file",
            token.to_str().unwrap(),
        ])
        .unwrap_err();
        assert!(error.to_string().contains("--http-token-file"), "{error}");
    }

    #[test]
    fn samples_are_selected_by_their_labels() {
        let labels = |exe: &str, ns: Option<&str>| {
            let mut labels = vec![
                Label::num(label_keys::PROCESS_PID, 7),
                Label::str(label_keys::PROCESS_EXECUTABLE_NAME, exe),
            ];
            labels.extend(ns.map(|ns| Label::str(label_keys::K8S_NAMESPACE_NAME, ns)));
            labels
        };
        assert!(ProcessSelection::default().selects_labels(&[]));
        let selection = ProcessSelection {
            executables: vec!["dotnet".into()],
            k8s_namespaces: vec!["shop".into()],
            ..Default::default()
        };
        assert!(selection.selects_labels(&labels("dotnet", None)));
        assert!(selection.selects_labels(&labels("java", Some("shop"))));
        assert!(!selection.selects_labels(&labels("java", Some("billing"))));
        assert!(!selection.selects_labels(&[]));
    }

    #[test]
    fn windows_align_to_the_wall_clock() {
        let at =
            |secs: u64, ms: u64| UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(ms);
        let interval = Duration::from_secs(15);
        assert_eq!(
            window_start(at(1_795_000_007, 500), interval),
            at(1_795_000_005, 0)
        );
        assert_eq!(
            window_start(at(1_795_000_005, 0), interval),
            at(1_795_000_005, 0)
        );
        assert_eq!(window_start(at(59, 999), Duration::from_secs(60)), at(0, 0));
    }

    #[test]
    fn service_names_follow_the_issue_order() {
        let env = |text: &str| Environ::from_bytes(text.replace(';', "\0"));
        assert_eq!(
            service_name(
                &env("OTEL_SERVICE_NAME=cart;OTEL_RESOURCE_ATTRIBUTES=service.name=x;DD_SERVICE=y"),
                Some("deploy"),
                "dotnet"
            ),
            "cart"
        );
        assert_eq!(
            service_name(
                &env(
                    "OTEL_RESOURCE_ATTRIBUTES=deployment.environment=prod,service.name=my%20cart;DD_SERVICE=y"
                ),
                None,
                "dotnet"
            ),
            "my cart"
        );
        assert_eq!(
            service_name(&env("OTEL_SERVICE_NAME= ;DD_SERVICE=dd"), None, "dotnet"),
            "dd"
        );
        assert_eq!(
            service_name(&env(""), Some("checkout"), "dotnet"),
            "checkout"
        );
        assert_eq!(service_name(&env(""), None, "Shop.Api"), "Shop.Api");
    }

    #[test]
    fn selection_matches_any_list() {
        let everything = ProcessSelection::default();
        assert!(everything.selects("x", None, None));
        let selection = ProcessSelection {
            executables: vec!["dotnet".into()],
            container_ids: vec!["0123456789ab".into()],
            k8s_namespaces: vec!["shop".into()],
        };
        assert!(selection.selects("dotnet", None, None));
        assert!(selection.selects("java", Some("0123456789abcdef"), None));
        assert!(selection.selects("java", None, Some("shop")));
        assert!(!selection.selects("java", Some("ffff"), Some("kube-system")));
    }

    #[test]
    fn a_container_id_matches_whole_or_by_a_prefix_of_twelve() {
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert!(container_id_matches(id, id));
        assert!(container_id_matches(&id[..12], id));
        assert!(!container_id_matches(&id[..11], id));
        assert!(!container_id_matches("", id));
        assert!(!container_id_matches("123456789abc", id));
        let short = ProcessSelection {
            container_ids: vec!["0123".into()],
            ..ProcessSelection::default()
        };
        assert!(!short.selects("dotnet", Some(id), None));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn sinks_are_built_for_each_configured_backend() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("profiles");
        let config = config_or_panic(&[
            "--pyroscope-url",
            "http://127.0.0.1:9",
            "--output-dir",
            out.to_str().unwrap(),
        ]);
        let metrics = AgentMetrics::new();
        let fan_out = build_sinks(&config, &metrics, RetryPolicy::default()).unwrap();
        let names: Vec<&str> = fan_out.queues().iter().map(DeliveryQueue::name).collect();
        assert_eq!(names, ["pyroscope", "directory"]);
        assert!(out.is_dir());
    }
}
