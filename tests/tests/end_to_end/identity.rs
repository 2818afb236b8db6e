//! Who a process is, against a process that lies about it: a cgroup named
//! after another pod's container, outside the kubelet's hierarchy, as a
//! user's own systemd would make it on request. The real agent and
//! `record` on the real kernel, a real .NET 8 victim in a containerd-style
//! cgroup, the forger running as an unprivileged user.

use std::{collections::BTreeSet, fs, path::Path, thread, time::Duration};

use clrbpf_integration_tests::{
    ContainerTarget, Env, LabelValue, Runtime, TempDir,
    agent::{TestAgent, tail},
    read_profile, record_pid, samples,
};

/// The container id and pod uid labels of `pid`'s samples in `profile_paths`.
fn identity_labels(paths: &[std::path::PathBuf], pid: u32) -> (usize, BTreeSet<String>) {
    let (mut count, mut values) = (0, BTreeSet::new());
    for path in paths {
        for sample in samples(&read_profile(path)) {
            if sample.pid() != Some(pid) {
                continue;
            }
            count += 1;
            for key in ["container.id", "k8s.pod.uid", "k8s.pod.name"] {
                if let Some(LabelValue::Str(value)) = sample.label(key) {
                    values.insert(format!("{key}={value}"));
                }
            }
        }
    }
    (count, values)
}

fn files_in(dir: &Path) -> Vec<std::path::PathBuf> {
    fs::read_dir(dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default()
}

/// A process in `user.slice/.../cri-containerd-<victim id>.scope` is not
/// the victim's container: `--container-id <victim>` does not select it,
/// and its samples carry no container id or pod, while the victim's carry
/// both.
#[test]
fn a_cgroup_named_after_another_container_borrows_nothing() {
    let env = Env::privileged();
    let dir = TempDir::new("forged-cgroup");
    let out = dir.join("profiles");
    let victim = ContainerTarget::start(&env, Runtime::Net8, "Hot", &["30"], 1000);
    let forged_scope = Path::new("user.slice/user-65534.slice/user@65534.service/app.slice")
        .join(format!("cri-containerd-{}.scope", victim.container_id));
    let forger = ContainerTarget::start_in_cgroup(
        &env,
        Runtime::Net8,
        "Hot",
        &["30"],
        65534,
        &forged_scope,
        victim.container_id.clone(),
        String::new(),
    );
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--container-id".as_ref(),
            victim.container_id.as_ref(),
            "--output-dir".as_ref(),
            out.as_os_str(),
        ],
    )
    .wait_ready();
    thread::sleep(Duration::from_secs(12));
    let log = agent.stop();
    let windows = files_in(&out);
    let (victim_samples, victim_labels) = identity_labels(&windows, victim.pid());
    let (forger_shipped, _) = identity_labels(&windows, forger.pid());
    assert!(
        victim_samples > 0,
        "the victim's samples were not shipped ({} windows):\n{}",
        windows.len(),
        tail(&log)
    );
    assert!(
        victim_labels.contains(&format!("container.id={}", victim.container_id))
            && victim_labels.contains(&format!("k8s.pod.uid={}", victim.pod_uid)),
        "the victim's samples lack its container id and pod: {victim_labels:?}"
    );
    assert_eq!(
        forger_shipped,
        0,
        "--container-id {} selected the forger (pid {})",
        victim.container_id,
        forger.pid()
    );

    // Recorded on its own, the forger's samples name no container or pod.
    let (_, profile) = record_pid(&env, &dir, forger.pid(), &["-d", "3"], "forger.pb.gz");
    let (forger_samples, forger_labels) = identity_labels(&[profile], forger.pid());
    assert!(forger_samples > 0, "the forger was not sampled");
    assert!(
        forger_labels.is_empty(),
        "the forger's samples carry another container's identity: {forger_labels:?}"
    );
}
