use super::*;

const ID: &str = "3f9a1b2c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8";
const UID: &str = "7c6e5b1a-4f3d-4b2a-9e8d-1c2b3a4d5e6f";

fn uid_() -> String {
    UID.replace('-', "_")
}

/// The identity seen from the host's cgroup namespace.
fn host(cgroup: &str) -> CgroupIdentity {
    identity_from_cgroup(cgroup, "0::/init.scope\n")
}

/// `/proc/PID/cgroup` of a container process as each runtime and cgroup
/// driver writes it, on cgroup v1 (one line per hierarchy, the unified
/// `0::` line last on hybrid hosts) and v2 (one `0::` line).
#[test]
fn cgroup_lines_of_each_runtime_and_driver() {
    let (id, uid, uid_) = (ID, UID, uid_());
    let pod = Some(uid);
    let cases: Vec<(&str, String, Option<&str>)> = vec![
        (
            "containerd, systemd driver, cgroup v2",
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{id}.scope\n"
            ),
            pod,
        ),
        (
            "containerd, systemd driver, cgroup v1 (hybrid)",
            format!(
                "12:pids:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{id}.scope\n\
                 4:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{id}.scope\n\
                 1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{id}.scope\n\
                 0::/\n"
            ),
            pod,
        ),
        (
            "containerd, systemd driver, cgroup v1 name=systemd in slice:prefix:name form",
            format!(
                "1:name=systemd:/system.slice/containerd.service/kubepods-besteffort-pod{uid_}.slice:cri-containerd:{id}\n"
            ),
            pod,
        ),
        (
            "containerd, cgroupfs driver, cgroup v1",
            format!(
                "11:cpu,cpuacct:/kubepods/burstable/pod{uid}/{id}\n\
                 10:memory:/kubepods/burstable/pod{uid}/{id}\n\
                 1:name=systemd:/kubepods/burstable/pod{uid}/{id}\n"
            ),
            pod,
        ),
        (
            "containerd, cgroupfs driver, cgroup v2, guaranteed QoS",
            format!("0::/kubepods/pod{uid}/{id}\n"),
            pod,
        ),
        (
            "CRI-O, systemd driver, cgroup v2, guaranteed QoS",
            format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/crio-{id}.scope\n"),
            pod,
        ),
        (
            "CRI-O, systemd driver, cgroup v2, crun's container sub-cgroup",
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/crio-{id}.scope/container\n"
            ),
            pod,
        ),
        (
            "CRI-O, cgroupfs driver, cgroup v1",
            format!("7:memory:/kubepods/burstable/pod{uid}/crio-{id}\n"),
            pod,
        ),
        (
            "Docker (cri-dockerd), systemd driver, cgroup v1",
            format!(
                "5:cpuset:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/docker-{id}.scope\n"
            ),
            pod,
        ),
        (
            "Docker (cri-dockerd), cgroupfs driver, cgroup v1",
            format!("9:devices:/kubepods/besteffort/pod{uid}/{id}\n"),
            pod,
        ),
        (
            "Docker, cgroupfs driver, cgroup v1",
            format!("13:pids:/docker/{id}\n12:memory:/docker/{id}\n0::/\n"),
            None,
        ),
        (
            "Docker, systemd driver, cgroup v2",
            format!("0::/system.slice/docker-{id}.scope\n"),
            None,
        ),
        (
            "containerd without Kubernetes (nerdctl), cgroupfs driver",
            format!("0::/default/{id}\n"),
            None,
        ),
        (
            "Podman, systemd driver, cgroup v2",
            format!("0::/machine.slice/libpod-{id}.scope/container\n"),
            None,
        ),
        (
            "upper-case hex",
            format!("0::/docker/{}\n", id.to_uppercase()),
            None,
        ),
    ];
    for (what, cgroup, pod_uid) in cases {
        let found = host(&cgroup);
        assert_eq!(
            found.container_id.as_deref(),
            Some(id),
            "container id, {what}"
        );
        assert_eq!(found.pod_uid.as_deref(), pod_uid, "pod uid, {what}");
    }
    // The pause container and a pod-level process share the pod cgroup but
    // hold no container id there.
    let pod_only = host(&format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice\n"
    ));
    assert_eq!(pod_only.container_id, None);
    assert_eq!(pod_only.pod_uid.as_deref(), Some(uid));
}

/// Paths that hold no trustworthy identity, forged ones first: every name a
/// runtime uses, placed where an unprivileged user (its own systemd) or a
/// rootless runtime can create cgroups.
#[test]
fn forged_and_foreign_paths_give_nothing() {
    let (id, uid, uid_) = (ID, UID, uid_());
    let user = "/user.slice/user-1000.slice/user@1000.service";
    let cases = [
        format!("0::{user}/app.slice/cri-containerd-{id}.scope"),
        format!("0::{user}/app.slice/crio-{id}.scope"),
        format!("0::{user}/app.slice/docker-{id}.scope"),
        format!(
            "0::{user}/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{id}.scope"
        ),
        format!("0::{user}/kubepods/burstable/pod{uid}/{id}"),
        format!("0::{user}/user.slice/libpod-{id}.scope/container"),
        format!("0::/user.slice/user-1000.slice/pod{uid}.scope"),
        format!(
            "1:name=systemd:{user}/app.slice/cri-containerd-{id}.scope\n0::{user}/app.slice/x.scope"
        ),
        // The right names at the wrong level, or in the wrong order.
        format!("0::/kubepods.slice/cri-containerd-{id}.scope"),
        format!("0::/kubepods/{id}"),
        format!("0::/kubepods.slice/kubepods-burstable.slice/cri-containerd-{id}.scope"),
        format!(
            "0::/kubepods.slice/kubepods-guaranteed.slice/kubepods-guaranteed-pod{uid_}.slice/cri-containerd-{id}.scope"
        ),
        format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/runc-{id}.scope"),
        format!("0::/docker/x/{id}"),
        format!("0::/system.slice/libpod-{id}.scope"),
        format!("0::/kubepods.slice/../user.slice/cri-containerd-{id}.scope"),
        // Climbing out of a namespace we are not in.
        format!("0::/../kubepods.slice/kubepods-pod{uid_}.slice/crio-{id}.scope"),
        // Not ids.
        format!("0::/kubepods.slice/crio-conmon-{id}.scope"),
        format!("0::/docker/{}", &id[1..]),
        format!("0::/docker/{}g", &id[1..]),
        "0::/kubepods/burstable/podnot-a-uid\n".into(),
        "0::/kubepods.slice/kubepods-burstable.slice\n".into(),
        "0::/".into(),
        "0::/user.slice/user-1000.slice/session-2.scope".into(),
        "4:memory:/process_api/3d4286958354c35125257c0d1832140b".into(),
        "garbage without colons".into(),
        String::new(),
    ];
    for case in cases {
        assert_eq!(host(&case), CgroupIdentity::default(), "{case}");
    }
}

/// Seen from a pod of its own on cgroup v2 (the agent's cgroup namespace is
/// its container's cgroup, four levels down), other pods' paths climb to
/// the shared ancestor; a user's slice climbs to the root and must match
/// from there.
#[test]
fn paths_relative_to_our_cgroup_namespace() {
    let (id, uid, uid_) = (ID, UID, uid_());
    let init = "0::/../../../../init.scope\n";
    let other_pod = format!(
        "0::/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{id}.scope\n"
    );
    let found = identity_from_cgroup(&other_pod, init);
    assert_eq!(found.container_id.as_deref(), Some(ID));
    assert_eq!(found.pod_uid.as_deref(), Some(uid));
    let same_pod = format!("0::/../cri-containerd-{id}.scope\n");
    let found = identity_from_cgroup(&same_pod, init);
    assert_eq!(found.container_id.as_deref(), Some(ID));
    assert_eq!(found.pod_uid, None);
    let absolute =
        format!("0::/../../../../kubepods.slice/kubepods-pod{uid_}.slice/crio-{id}.scope\n");
    assert_eq!(
        identity_from_cgroup(&absolute, init)
            .container_id
            .as_deref(),
        Some(ID)
    );
    for forged in [
        format!(
            "0::/../../../../user.slice/user-1000.slice/user@1000.service/app.slice/cri-containerd-{id}.scope\n"
        ),
        format!("0::/../../../../../kubepods.slice/kubepods-pod{uid_}.slice/crio-{id}.scope\n"),
        // Two levels up is a pod slice: a QoS slice there is the wrong level.
        format!(
            "0::/../../kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{id}.scope\n"
        ),
    ] {
        assert_eq!(
            identity_from_cgroup(&forged, init),
            CgroupIdentity::default(),
            "{forged}"
        );
    }
    // Without pid 1's cgroup (no hostPID), only absolute paths count.
    assert_eq!(
        identity_from_cgroup(&other_pod, ""),
        CgroupIdentity::default()
    );
}
