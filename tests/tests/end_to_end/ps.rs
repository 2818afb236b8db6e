//! `clrbpf ps` against real .NET 8 and .NET Core 3.1 processes, through the
//! binary: the user, the service name the agent would use, where frame
//! names will come from (perf map, socket, memory), `--json`, and, run as a
//! user who is not root, only that user's processes with a note on what it
//! could not see (exit 0). No BPF is loaded.

use std::{
    process::{Command, Output, Stdio},
    thread,
    time::Duration,
};

use clrbpf_integration_tests::{Env, Launch, Runtime, TestProcess};
use serde_json::Value;

/// A user who is not root, with a name in /etc/passwd.
const USER: u32 = 1000;

fn ps(env: &Env, user: Option<u32>, args: &[&str]) -> Output {
    let mut command = match user {
        Some(uid) => {
            let mut command = Command::new("setpriv");
            let uid = uid.to_string();
            command
                .args(["--reuid", &uid, "--regid", &uid, "--clear-groups"])
                .args(["--inh-caps", "-all", "--bounding-set", "-all", "--"])
                .arg(&env.clrbpf);
            command
        }
        None => Command::new(&env.clrbpf),
    };
    let output = command
        .arg("ps")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run clrbpf ps");
    eprintln!(
        "$ clrbpf ps {args:?} (uid {user:?})\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn json(output: &Output) -> Value {
    assert!(output.status.success(), "{:?}", output.status);
    serde_json::from_slice(&output.stdout).expect("ps --json is one JSON document")
}

fn row(listing: &Value, pid: u32) -> Option<&Value> {
    listing["processes"]
        .as_array()
        .expect("processes")
        .iter()
        .find(|row| row["pid"] == pid)
}

/// The runtime creates its socket early in startup; a loaded machine can
/// be slow to get there.
fn wait_for_socket(env: &Env, pid: u32) {
    for _ in 0..100 {
        let listing = json(&ps(env, None, &["--json"]));
        if row(&listing, pid).is_some_and(|r| r["diagnostic_socket"].is_string()) {
            return;
        }
        thread::sleep(Duration::from_millis(100));
    }
    panic!("no diagnostic socket for {pid}");
}

#[test]
fn ps_shows_user_service_and_name_source_as_root_and_as_a_user() {
    let env = Env::privileged();
    // .NET 8 as a user, named by OTEL_SERVICE_NAME, names through its socket.
    let net8 = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["120"],
        &Launch {
            user: Some(USER),
            env: &[("OTEL_SERVICE_NAME", "shop-api")],
            ..Launch::default()
        },
    );
    // .NET Core 3.1 as root, writing perf maps already.
    let net31 = TestProcess::start(&env, Runtime::NetCore31, "Hot", &["120"], true);
    // .NET 8 as root without a diagnostic socket: names from memory.
    let hidden = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Hot",
        &["120"],
        &Launch {
            env: &[("DOTNET_EnableDiagnostics", "0")],
            ..Launch::default()
        },
    );
    wait_for_socket(&env, net8.pid());

    let listing = json(&ps(&env, None, &["--json"]));
    let hidden_from_root = listing["hidden_processes"].as_u64().expect("a count");
    let r8 = row(&listing, net8.pid()).expect("the .NET 8 process");
    assert_eq!(r8["uid"], USER);
    assert_eq!(r8["user"], "cloudsdk", "the name of uid 1000 here");
    assert_eq!(r8["service"], "shop-api");
    assert_eq!(r8["names_from"], "socket");
    assert_eq!(r8["runtime_version"], "8.0.4");
    let r31 = row(&listing, net31.pid()).expect("the .NET Core 3.1 process");
    assert_eq!(r31["user"], "root");
    assert_eq!(r31["service"], "Hot", "the entry assembly");
    assert_eq!(r31["names_from"], "perf map");
    assert!(
        r31["runtime_version"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "{r31}"
    );
    let r_hidden = row(&listing, hidden.pid()).expect("the process without a socket");
    assert_eq!(r_hidden["names_from"], "memory");

    let table = ps(&env, None, &[]);
    let text = String::from_utf8_lossy(&table.stdout);
    let header = text.lines().next().expect("a header");
    for column in ["USER", "SERVICE", "NAMES FROM", "POD", "CONTAINER"] {
        assert!(header.contains(column), "{header}");
    }
    assert!(!header.contains("IPC"), "{header}");
    let line8 = text
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{} ", net8.pid())))
        .expect("the .NET 8 line");
    assert!(line8.contains("cloudsdk") && line8.contains("shop-api") && line8.contains("socket"));

    // As the user: its own process, none of root's, and a note that says so.
    let output = ps(&env, Some(USER), &["--json"]);
    let as_user = json(&output);
    assert!(row(&as_user, net8.pid()).is_some(), "its own process");
    assert!(row(&as_user, net31.pid()).is_none() && row(&as_user, hidden.pid()).is_none());
    assert!(
        as_user["hidden_processes"]
            .as_u64()
            .is_some_and(|n| n >= hidden_from_root + 2),
        "{as_user}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("could not be read") && stderr.contains("sudo clrbpf ps"),
        "{stderr}"
    );
    let output = ps(&env, Some(USER), &[]);
    assert!(output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("sudo clrbpf ps"));

    let pid31 = net31.pid();
    drop(net31);
    for name in [
        format!("perf-{pid31}.map"),
        format!("perf-{pid31}.info"),
        format!("jit-{pid31}.dump"),
    ] {
        let _ = std::fs::remove_file(std::path::Path::new("/tmp").join(name));
    }
}
