//! `clrbpf record` under exactly the Helm chart's capability list (from
//! deploy/helm/clrbpf/values.yaml), as a root process whose bounding set is
//! that list, as in a container that drops ALL and adds them. The target
//! runs the way a Kubernetes pod's container does: .NET 8 as uid 1000, in
//! its own PID and mount namespaces with a private /tmp, in a cgroup named
//! as containerd names it under the systemd driver. `clrbpf agent`, as the
//! chart runs it, is tested the same way.

use std::{
    fs,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use clrbpf_integration_tests::{
    ContainerTarget, Env, LabelValue, Runtime, TempDir, assert_success, bounding_set,
    chart_capabilities, read_profile, run_clrbpf_with_capabilities, samples, value_index,
};

const TIMEOUT: Duration = Duration::from_secs(120);

#[test]
fn chart_capabilities_profile_a_non_root_container() {
    let env = Env::privileged();
    let capabilities = chart_capabilities();
    // Contention: 4 threads taking one lock 5000 times each, holding it 1 ms
    // (futex and nanosleep system calls: kernel frames on- and off-CPU).
    let target = ContainerTarget::start(
        &env,
        Runtime::Net8,
        "Contention",
        &["0", "4", "1", "5000"],
        1000,
    );
    let dir = TempDir::new("least-privilege");
    let profile_path = dir.join("profile.pb.gz");
    let output = run_clrbpf_with_capabilities(
        &env,
        &capabilities,
        &[
            "record".to_owned(),
            "-p".to_owned(),
            target.pid().to_string(),
            "-d".to_owned(),
            "4".to_owned(),
            "--off-cpu".to_owned(),
            "-o".to_owned(),
            profile_path.to_string_lossy().into_owned(),
        ],
        dir.path(),
        TIMEOUT,
    );
    assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("missing CAP_"),
        "the chart's capability set should lack nothing clrbpf names:\n{stderr}"
    );
    assert!(
        !stderr.contains("could not raise clrbpf's scheduling priority"),
        "CAP_SYS_NICE is in the chart's set:\n{stderr}"
    );
    let profile = read_profile(&profile_path);
    let all = samples(&profile);
    let of_target: Vec<_> = all
        .iter()
        .filter(|s| s.pid() == Some(target.pid()))
        .collect();
    assert!(
        of_target.len() >= 5,
        "too few samples of the target ({} of {})",
        of_target.len(),
        all.len()
    );

    // container.id (and the pod uid, from the same cgroup path) on every
    // sample of the target.
    for sample in &of_target {
        assert_eq!(
            sample.label("container.id"),
            Some(&LabelValue::Str(target.container_id.clone())),
            "sample without the container id: {:?}",
            sample.labels
        );
        assert_eq!(
            sample.label("k8s.pod.uid"),
            Some(&LabelValue::Str(target.pod_uid.clone())),
            "sample without the pod uid: {:?}",
            sample.labels
        );
    }

    // Kernel frames, named (kallsyms readable under the set), and few
    // unnamed kernel addresses.
    let frames: Vec<&String> = of_target.iter().flat_map(|s| s.frames.iter()).collect();
    let named_kernel = frames
        .iter()
        .filter(|f| f.starts_with("do_syscall_64") || f.starts_with("entry_SYSCALL_64"))
        .count();
    let unnamed_kernel = frames.iter().filter(|f| f.starts_with("0xffff")).count();
    assert!(
        named_kernel > 0,
        "no named kernel frame in the target's stacks"
    );
    assert!(
        unnamed_kernel * 20 <= frames.len(),
        "{unnamed_kernel} of {} frames are unnamed kernel addresses",
        frames.len()
    );

    // The app's 0600 diagnostic socket is reached and its perf files are
    // removed as the app's user (setfsuid/setfsgid under CAP_SETUID/SETGID):
    // managed frames named, CLR contention events, perf files gone from the
    // container's private /tmp, and few `[unknown]` user frames (without the
    // socket: 15.5%, all JIT code left unnamed without a perf map).
    assert!(
        of_target
            .iter()
            .any(|s| s.stack_contains(&["Contention.WaitForGate"])),
        "no named managed frame (Contention.WaitForGate) in the target's stacks"
    );
    let contentions = value_index(&profile, "contentions/count");
    let counted: i64 = of_target.iter().map(|s| s.values[contentions]).sum();
    assert!(counted > 0, "no CLR contention event collected");
    let unknown = frames.iter().filter(|f| f.as_str() == "[unknown]").count();
    assert!(
        unknown * 20 <= frames.len(),
        "{unknown} of {} frames are [unknown]",
        frames.len()
    );
    for file in ["perf-1.map", "jit-1.dump"] {
        let path = format!("/proc/{}/root/tmp/{file}", target.pid());
        assert!(
            !std::path::Path::new(&path).exists(),
            "{path} is left behind after recording"
        );
    }
}

/// `clrbpf agent` as the chart runs it: the same capability set, the same
/// non-root container. Its windows name the app's managed frames, hold its
/// CLR contention events and kernel frames, carry the container id, and the
/// perf files are gone from the container's /tmp after SIGTERM. Off-CPU is on
/// so that kernel frames are certain: the target's CPU time is small, and at
/// 19 Hz its few CPU samples fell in user code in one CI run.
#[test]
fn chart_capabilities_run_the_agent_on_a_non_root_container() {
    let env = Env::privileged();
    let set = bounding_set(&chart_capabilities());
    let target = ContainerTarget::start(
        &env,
        Runtime::Net8,
        "Contention",
        &["0", "4", "1", "20000"],
        1000,
    );
    let dir = TempDir::new("least-privilege-agent");
    let windows = dir.join("windows");
    let port = 20000 + (std::process::id() % 1000) as u16;
    let mut agent = Command::new("setpriv")
        .args(["--bounding-set", &set, "--"])
        .arg(&env.clrbpf)
        .args([
            "agent",
            "--off-cpu",
            "--upload-interval",
            "5s",
            "--output-dir",
        ])
        .arg(&windows)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the agent under the chart's capabilities");
    thread::sleep(Duration::from_secs(12));
    // SAFETY: kill has no memory preconditions; setpriv exec'd clrbpf in
    // our child's pid.
    unsafe { libc::kill(agent.id() as libc::pid_t, libc::SIGTERM) };
    let status = agent.wait().expect("wait for the agent");
    let mut stderr = String::new();
    if let Some(mut pipe) = agent.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
    }
    assert!(status.success(), "agent exit {status}:\n{stderr}");
    assert!(
        !stderr.contains("missing CAP_"),
        "the chart's capability set should lack nothing clrbpf names:\n{stderr}"
    );

    let mut of_target = Vec::new();
    let mut contentions = 0;
    for entry in fs::read_dir(&windows).expect("the agent's windows") {
        let path = entry.expect("an entry").path();
        let profile = read_profile(&path);
        let lock = profile
            .sample_type
            .iter()
            .position(|t| clrbpf_integration_tests::string(&profile, t.r#type) == "contentions");
        for sample in samples(&profile) {
            if sample.pid() != Some(target.pid()) {
                continue;
            }
            assert_eq!(
                sample.label("container.id"),
                Some(&LabelValue::Str(target.container_id.clone())),
                "{path:?}: a sample without the container id: {:?}",
                sample.labels
            );
            if let Some(at) = lock {
                contentions += sample.values[at];
            }
            of_target.push(sample);
        }
    }
    assert!(
        of_target.len() >= 5,
        "too few samples of the target in the windows: {}",
        of_target.len()
    );
    assert!(
        of_target
            .iter()
            .any(|s| s.stack_contains(&["Contention.WaitForGate"])),
        "no named managed frame (Contention.WaitForGate)"
    );
    assert!(
        of_target
            .iter()
            .flat_map(|s| s.frames.iter())
            .any(|f| f.starts_with("do_syscall_64") || f.starts_with("entry_SYSCALL_64")),
        "no named kernel frame"
    );
    assert!(contentions > 0, "no CLR contention event in the windows");
    for file in ["perf-1.map", "jit-1.dump"] {
        let path = format!("/proc/{}/root/tmp/{file}", target.pid());
        assert!(
            !std::path::Path::new(&path).exists(),
            "{path} is left behind after the agent stopped"
        );
    }
}
