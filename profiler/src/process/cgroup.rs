//! A process's container id and Kubernetes pod uid, from its
//! `/proc/PID/cgroup`: part of the [`super::ProcessInfo`] the labels
//! (`container.id`, the pod's metadata) and the agent's selection
//! (`--container-id`, `--k8s-namespace`) are built on.
//!
//! Any process can name a cgroup after another container: a user's systemd
//! creates `cri-containerd-<victim id>.scope` under its own
//! `user@UID.service` on request, and ids are world-readable in
//! `/proc/*/cgroup`. So an id counts only where a container runtime puts it
//! and nobody but root can write: a known layout, matched component by
//! component from the root of the hierarchy (anchored), never a name
//! found anywhere in the path. The layouts:
//!
//! 1. Kubernetes, systemd driver: `/kubepods.slice[/kubepods-<qos>.slice]/
//!    kubepods[-<qos>]-pod<uid with _>.slice/<runtime>-<id>.scope`, the
//!    runtime `cri-containerd`, `crio` or `docker`.
//! 2. Kubernetes, cgroupfs driver: `/kubepods[/<qos>]/pod<uid>/<id>` (or
//!    `crio-<id>`).
//! 3. containerd's cgroup v1 `name=systemd` form:
//!    `/system.slice/containerd.service/kubepods-<qos>-pod<uid>.slice:cri-containerd:<id>`.
//! 4. Outside Kubernetes (container id, no pod): `/docker/<id>`,
//!    `/system.slice/docker-<id>.scope`, `/machine.slice/libpod-<id>.scope`
//!    (Podman), `/default/<id>` (nerdctl). All at the root, which only root
//!    writes; rootless containers, under a user's own slice, get no id.
//!
//! Components below the container's cgroup (crun's `container`, a delegated
//! subtree) stay the container's: only the container can make them.
//!
//! When clrbpf runs in a cgroup namespace of its own (a pod on cgroup v2),
//! the kernel shows other processes' paths relative to that namespace's
//! root, as `/../../kubepods-besteffort.slice/...`. The number of `..` in
//! pid 1's path (the host's init, with `hostPID`) is the namespace root's
//! depth `d`; a path that climbs `k <= d` levels continues at level
//! `d - k` of the layout, inside ancestors it shares with clrbpf's own
//! cgroup (under `kubepods`, which only root writes). A path that climbs
//! higher than `d` is not trusted.

/// Container ids are 64 lower-case hex digits for every runtime we know.
const CONTAINER_ID_LEN: usize = 64;
/// Kubernetes QoS classes with a cgroup level of their own (guaranteed pods
/// sit directly under `kubepods`).
const QOS_CLASSES: [&str; 2] = ["burstable", "besteffort"];
/// Runtimes of the systemd driver's `<runtime>-<id>.scope` container cgroups.
const SCOPE_RUNTIMES: [&str; 3] = ["cri-containerd", "crio", "docker"];

/// What a cgroup path says about the process inside it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupIdentity {
    /// 64 lower-case hex digits.
    pub container_id: Option<String>,
    /// The pod uid, lower case with dashes.
    pub pod_uid: Option<String>,
}

/// The identity in a `/proc/PID/cgroup` file, read from the namespace whose
/// pid 1 has `init_cgroup` (its own cgroup file; empty when unknown, then
/// only absolute paths count). The first line (hierarchy) that names a
/// container wins; else the first that names a pod.
pub fn identity_from_cgroup(cgroup: &str, init_cgroup: &str) -> CgroupIdentity {
    let mut pod_only = None;
    for line in cgroup.lines() {
        let Some((hierarchy, path)) = split_line(line) else {
            continue;
        };
        let depth = namespace_depth(init_cgroup, hierarchy);
        let found = identity_in_path(path, depth);
        if found.container_id.is_some() {
            return found;
        }
        if pod_only.is_none() && found.pod_uid.is_some() {
            pod_only = Some(found);
        }
    }
    pod_only.unwrap_or_default()
}

/// `hierarchy-id:controllers:path` -> (`hierarchy-id:controllers`, path);
/// the path may itself hold ':'.
fn split_line(line: &str) -> Option<(&str, &str)> {
    let mut parts = line.splitn(3, ':');
    let id = parts.next()?;
    let controllers = parts.next()?;
    let path = parts.next()?;
    Some((&line[..id.len() + 1 + controllers.len()], path))
}

/// How many `..` lead pid 1's path in `hierarchy`: the depth of our cgroup
/// namespace's root in that hierarchy (0 without a namespace).
fn namespace_depth(init_cgroup: &str, hierarchy: &str) -> usize {
    init_cgroup
        .lines()
        .filter_map(split_line)
        .find(|(h, _)| *h == hierarchy)
        .map_or(0, |(_, path)| {
            path.split('/')
                .filter(|c| !c.is_empty())
                .take_while(|c| *c == "..")
                .count()
        })
}

/// One step of a layout: what the component at that level must be.
#[derive(Clone, Copy)]
enum Step {
    Literal(&'static str),
    /// `burstable` or `besteffort` (cgroupfs driver).
    QosDir,
    /// `kubepods-<qos>.slice` (systemd driver).
    QosSlice,
    /// `pod<uid>` (cgroupfs driver).
    PodDir,
    /// `kubepods[-<qos>]-pod<uid with _>.slice` (systemd driver).
    PodSlice,
    /// `<id>` or `crio-<id>` (cgroupfs driver).
    BareId,
    /// `<prefix>-<id>.scope` for one of the prefixes.
    Scope(&'static [&'static str]),
    /// `kubepods-<qos>-pod<uid>.slice:cri-containerd:<id>` (v1 name=systemd).
    SliceColonId,
}

use Step::*;

/// Every layout, from the root of the hierarchy.
const LAYOUTS: [&[Step]; 9] = [
    &[
        Literal("kubepods.slice"),
        QosSlice,
        PodSlice,
        Scope(&SCOPE_RUNTIMES),
    ],
    &[Literal("kubepods.slice"), PodSlice, Scope(&SCOPE_RUNTIMES)],
    &[Literal("kubepods"), QosDir, PodDir, BareId],
    &[Literal("kubepods"), PodDir, BareId],
    &[
        Literal("system.slice"),
        Literal("containerd.service"),
        SliceColonId,
    ],
    &[Literal("docker"), BareId],
    &[Literal("system.slice"), Scope(&["docker"])],
    &[Literal("machine.slice"), Scope(&["libpod"])],
    &[Literal("default"), BareId],
];

/// What one component gave.
enum Found {
    Nothing,
    Pod(String),
    Container(String),
    Both { pod: String, container: String },
}

/// The identity in one hierarchy's path, `depth` being our namespace
/// root's depth there.
fn identity_in_path(path: &str, depth: usize) -> CgroupIdentity {
    let components: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let climbed = components.iter().take_while(|c| **c == "..").count();
    let Some(level) = depth.checked_sub(climbed) else {
        return CgroupIdentity::default();
    };
    let rest = &components[climbed..];
    if rest.contains(&"..") {
        return CgroupIdentity::default();
    }
    LAYOUTS
        .iter()
        .filter_map(|layout| match_layout(layout.get(level..)?, rest))
        .find(|found| found.container_id.is_some() || found.pod_uid.is_some())
        .unwrap_or_default()
}

/// Matches `components` against `steps`, in order; components past the
/// last step are allowed only below a container.
fn match_layout(steps: &[Step], components: &[&str]) -> Option<CgroupIdentity> {
    let mut identity = CgroupIdentity::default();
    for (index, component) in components.iter().enumerate() {
        let Some(step) = steps.get(index) else {
            return identity.container_id.is_some().then_some(identity);
        };
        match match_step(*step, component)? {
            Found::Nothing => {}
            Found::Pod(uid) => identity.pod_uid = Some(uid),
            Found::Container(id) => identity.container_id = Some(id),
            Found::Both { pod, container } => {
                identity.pod_uid = Some(pod);
                identity.container_id = Some(container);
            }
        }
    }
    Some(identity)
}

fn match_step(step: Step, component: &str) -> Option<Found> {
    match step {
        Literal(name) => (component == name).then_some(Found::Nothing),
        QosDir => QOS_CLASSES.contains(&component).then_some(Found::Nothing),
        QosSlice => {
            let qos = component
                .strip_prefix("kubepods-")?
                .strip_suffix(".slice")?;
            QOS_CLASSES.contains(&qos).then_some(Found::Nothing)
        }
        PodDir => pod_uid(component.strip_prefix("pod")?).map(Found::Pod),
        PodSlice => pod_slice_uid(component).map(Found::Pod),
        BareId => {
            container_id(component.strip_prefix("crio-").unwrap_or(component)).map(Found::Container)
        }
        Scope(prefixes) => {
            let (prefix, id) = component.strip_suffix(".scope")?.rsplit_once('-')?;
            prefixes.contains(&prefix).then_some(())?;
            container_id(id).map(Found::Container)
        }
        SliceColonId => {
            let (slice, id) = component.split_once(":cri-containerd:")?;
            Some(Found::Both {
                pod: pod_slice_uid(slice)?,
                container: container_id(id)?,
            })
        }
    }
}

/// `kubepods[-<qos>]-pod<uid with _>.slice` -> the uid.
fn pod_slice_uid(component: &str) -> Option<String> {
    let name = component
        .strip_prefix("kubepods-")?
        .strip_suffix(".slice")?;
    let uid = match name.split_once("-pod") {
        Some((qos, uid)) if QOS_CLASSES.contains(&qos) => uid,
        Some(_) => return None,
        None => name.strip_prefix("pod")?,
    };
    pod_uid(&uid.replace('_', "-"))
}

/// A pod uid: a UUID, `8-4-4-4-12` hex digits.
fn pod_uid(text: &str) -> Option<String> {
    let groups: Vec<usize> = text.split('-').map(str::len).collect();
    let is_uuid =
        groups == [8, 4, 4, 4, 12] && text.bytes().all(|b| b == b'-' || b.is_ascii_hexdigit());
    is_uuid.then(|| text.to_ascii_lowercase())
}

/// A container id: exactly 64 hex digits.
fn container_id(text: &str) -> Option<String> {
    (text.len() == CONTAINER_ID_LEN && text.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| text.to_ascii_lowercase())
}

#[cfg(test)]
mod tests;
