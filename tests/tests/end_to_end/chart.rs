//! The Helm chart's first install, run on this host the way a kubelet runs
//! its container: no Kubernetes here, so the test renders the default chart
//! with Helm's own engine (`deploy/helm/test_chart.py`'s render, in the
//! chart venv of `$CLRBPF_TEST_PYTHON`) and reproduces the container:
//!
//! - its args and literal env (the downward-API `NODE_NAME` gets a fixed
//!   value; the image's binary is `$CLRBPF_BIN`), the working directory `/`;
//! - its capability list as the bounding set (`setpriv`), as root;
//! - a read-only root filesystem: a private mount namespace where every
//!   mount but `/proc` and `/dev` is remounted read-only, a tmpfs (mode 0777,
//!   as the kubelet makes an emptyDir) at each emptyDir mountPath, the
//!   hostPath mounts at their paths (read-only, as the chart mounts them);
//! - its own network namespace (a pod's), so the chart's `0.0.0.0` port
//!   collides with nothing on the host.
//!
//! The pod must then run and answer `/readyz` with 200, as the kubelet's
//! readiness probe asks.

use std::{
    collections::BTreeMap,
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{Env, bounding_set};
use serde_json::Value;

/// How long after the start `/readyz` must answer 200 (the probe's
/// initialDelaySeconds is 5 s; failureThreshold 3 at 10 s periods).
const READY_AFTER: Duration = Duration::from_secs(20);

/// The downward-API values of this stand-in pod.
const NODE_NAME: &str = "chart-test-node";

/// The container of the default chart's DaemonSet, and its pod's volumes.
struct RenderedContainer {
    args: Vec<String>,
    env: Vec<(String, String)>,
    capabilities: Vec<String>,
    /// emptyDir mount paths and their size limits (Kubernetes quantities).
    empty_dirs: Vec<(PathBuf, Option<String>)>,
    /// hostPath mounts: (host path, mount path, read-only).
    host_paths: Vec<(PathBuf, PathBuf, bool)>,
    port: u16,
}

/// Renders the chart with its default values and takes its DaemonSet's
/// container apart.
fn render_default_chart() -> RenderedContainer {
    let python = std::env::var_os("CLRBPF_TEST_PYTHON").expect(
        "CLRBPF_TEST_PYTHON is not set: run the integration tests through `cargo xtask test`, which installs the chart venv (helm-python-sdk)",
    );
    let helm_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm");
    let script = r#"
import json, sys
sys.path.insert(0, sys.argv[1])
import test_chart
text, _notes, _token = test_chart.render({})
(daemonset,) = [o for o in test_chart.objects(text) if o["kind"] == "DaemonSet"]
print(json.dumps(daemonset["spec"]["template"]["spec"]))
"#;
    let output = Command::new(python)
        .args(["-c", script])
        .arg(&helm_dir)
        .output()
        .expect("run the chart venv's python");
    assert!(
        output.status.success(),
        "rendering the chart failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let pod: Value = serde_json::from_slice(&output.stdout).expect("the render's JSON");
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1, "one container");
    let container = &containers[0];
    let strings = |value: &Value| -> Vec<String> {
        value
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .map(|item| item.as_str().expect("a string").to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let env = container["env"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|var| {
            let name = var["name"].as_str().expect("env name").to_owned();
            let value = if let Some(value) = var["value"].as_str() {
                value.to_owned()
            } else if var["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName" {
                NODE_NAME.to_owned()
            } else {
                panic!("env {name}: the test knows literal values and spec.nodeName: {var}")
            };
            (name, value)
        })
        .collect();
    let volumes: BTreeMap<&str, &Value> = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| (v["name"].as_str().expect("volume name"), v))
        .collect();
    let mut empty_dirs = Vec::new();
    let mut host_paths = Vec::new();
    for mount in container["volumeMounts"].as_array().expect("volumeMounts") {
        let name = mount["name"].as_str().expect("mount name");
        let path = PathBuf::from(mount["mountPath"].as_str().expect("mountPath"));
        let volume = volumes[name];
        if let Some(empty_dir) = volume.get("emptyDir") {
            let limit = empty_dir["sizeLimit"].as_str().map(str::to_owned);
            empty_dirs.push((path, limit));
        } else if let Some(host) = volume["hostPath"]["path"].as_str() {
            let read_only = mount["readOnly"].as_bool().unwrap_or(false);
            host_paths.push((PathBuf::from(host), path, read_only));
        } else {
            panic!("volume {name}: the test knows emptyDir and hostPath: {volume}");
        }
    }
    let port = container["ports"][0]["containerPort"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .expect("the metrics port");
    RenderedContainer {
        args: strings(&container["args"]),
        env,
        capabilities: strings(&container["securityContext"]["capabilities"]["add"]),
        empty_dirs,
        host_paths,
        port,
    }
}

/// A tmpfs `size=` option from a Kubernetes quantity (`256Mi`).
fn tmpfs_size(quantity: &str) -> String {
    let (number, unit) = quantity.split_at(
        quantity
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(quantity.len()),
    );
    let suffix = match unit {
        "" => "",
        "Ki" => "k",
        "Mi" => "m",
        "Gi" => "g",
        other => panic!("size limit unit {other} unknown to the test"),
    };
    format!("{number}{suffix}")
}

/// The shell script that builds the container's filesystem view inside
/// `unshare -m -n`, checks the root is read-only, and execs the agent.
fn container_script(env: &Env, container: &RenderedContainer) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut script = String::from(
        "set -eu\n\
         mount --make-rprivate /\n\
         # Every mount read-only but /proc and /dev (a container's own).\n\
         findmnt -rn -o TARGET,OPTIONS | while read -r target options; do\n\
           case $target in /proc|/proc/*|/dev|/dev/*) continue;; esac\n\
           case ,$options, in *,ro,*) continue;; esac\n\
           mount -o remount,bind,ro \"$target\"\n\
         done\n",
    );
    for (path, limit) in &container.empty_dirs {
        let size = limit
            .as_deref()
            .map(|l| format!(",size={}", tmpfs_size(l)))
            .unwrap_or_default();
        script.push_str(&format!(
            "mount -t tmpfs -o mode=0777{size} emptydir {}\n",
            quote(&path.to_string_lossy())
        ));
    }
    for (host, path, read_only) in &container.host_paths {
        // At its own path, a host mount is this host's directory, made
        // read-only with the rest above.
        assert!(
            *read_only,
            "{path:?}: a read-write host mount is not simulated"
        );
        if host != path && host.exists() {
            script.push_str(&format!(
                "mount --rbind {0} {1}\nmount -o remount,bind,ro {1}\n",
                quote(&host.to_string_lossy()),
                quote(&path.to_string_lossy())
            ));
        }
    }
    script.push_str(
        "if touch /.clrbpf-chart-test 2>/dev/null; then echo 'the root is writable' >&2; rm -f /.clrbpf-chart-test; exit 90; fi\n\
         ip link set lo up\n",
    );
    script.push_str("exec env -i PATH=/usr/bin:/bin");
    for (name, value) in &container.env {
        script.push_str(&format!(" {}", quote(&format!("{name}={value}"))));
    }
    script.push_str(&format!(
        " setpriv --bounding-set {} -- {}",
        bounding_set(&container.capabilities),
        quote(&env.clrbpf.to_string_lossy())
    ));
    for arg in &container.args {
        script.push_str(&format!(" {}", quote(arg)));
    }
    script.push('\n');
    script
}

/// The status code of `GET path` on 127.0.0.1:`port` in the network
/// namespace of process `pid` (a thread of its own enters it).
fn http_status_in_netns(pid: u32, port: u16, path: &str) -> Result<u16, String> {
    let netns = fs::File::open(format!("/proc/{pid}/ns/net")).map_err(|e| e.to_string())?;
    let path = path.to_owned();
    thread::spawn(move || {
        // SAFETY: setns on this thread only, with a namespace fd we own.
        if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(format!("setns: {}", std::io::Error::last_os_error()));
        }
        let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let mut reply = String::new();
        stream
            .read_to_string(&mut reply)
            .map_err(|e| e.to_string())?;
        reply
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| format!("not an HTTP reply: {reply:?}"))
    })
    .join()
    .map_err(|_| "the probe thread panicked".to_owned())?
}

/// Directories made for mount points that this host lacks (emptyDir paths
/// such as /var/lib/clrbpf), removed again when dropped if still empty.
struct MountPoints(Vec<PathBuf>);

impl MountPoints {
    fn create(paths: impl IntoIterator<Item = PathBuf>) -> Self {
        let mut created = Vec::new();
        for path in paths {
            let mut missing: Vec<PathBuf> = path
                .ancestors()
                .take_while(|p| !p.exists())
                .map(Path::to_path_buf)
                .collect();
            fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {path:?}: {e}"));
            missing.reverse();
            created.extend(missing);
        }
        Self(created)
    }
}

impl Drop for MountPoints {
    fn drop(&mut self) {
        for path in self.0.iter().rev() {
            let _ = fs::remove_dir(path);
        }
    }
}

/// A first `helm install` with default values gives a running, ready pod:
/// the default sink writes into the pod's own emptyDir (a read-only root
/// filesystem made the old default, /var/lib/clrbpf/profiles, fail with
/// exit 2 on every node).
#[test]
fn the_default_chart_runs_ready_on_a_read_only_root() {
    let env = Env::privileged();
    let container = render_default_chart();
    let _mount_points = MountPoints::create(container.empty_dirs.iter().map(|(p, _)| p.clone()));
    let script = container_script(&env, &container);
    eprintln!("container script:\n{script}");
    let mut agent = Command::new("unshare")
        .args(["-m", "-n", "--", "sh", "-c", &script])
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the chart's container");
    let started = Instant::now();
    let mut exited = None;
    while started.elapsed() < READY_AFTER {
        if let Some(status) = agent.try_wait().expect("wait") {
            exited = Some(status);
            break;
        }
        thread::sleep(Duration::from_millis(200));
    }
    let ready = match exited {
        Some(_) => None,
        None => Some(http_status_in_netns(agent.id(), container.port, "/readyz")),
    };
    if exited.is_none() {
        // SAFETY: kill has no memory preconditions; the pid is our child
        // (unshare, sh and setpriv exec'd clrbpf in it).
        unsafe { libc::kill(agent.id() as libc::pid_t, libc::SIGTERM) };
    }
    let status = agent.wait().expect("wait for the agent");
    let mut stderr = String::new();
    if let Some(mut pipe) = agent.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    let Some(ready) = ready else {
        panic!("the chart's container exited within {READY_AFTER:?} ({status}):\n{stderr}");
    };
    assert_eq!(
        ready,
        Ok(200),
        "/readyz after {READY_AFTER:?}; agent log:\n{stderr}"
    );
    assert!(status.success(), "exit after SIGTERM: {status}\n{stderr}");
}
