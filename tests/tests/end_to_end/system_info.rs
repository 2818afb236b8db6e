//! `clrbpf system-info` answers "will it work here?" from a real probe: as
//! root it loads and attaches a BPF program to a perf event and reads the
//! BTF; under a seccomp filter that denies `bpf` (the likeliest failure of
//! a container) and without capabilities it says "will not work", why, and
//! the fix, and exits 1. The filter comes from `tests/fakes/deny_syscall.c`
//! (prctl(PR_SET_SECCOMP) + exec): it stands in for a container runtime's
//! seccomp profile, since no container runtime runs here.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use clrbpf_integration_tests::{Env, TempDir};

/// `__NR_bpf` on x86_64.
const NR_BPF: &str = "321";
/// `__NR_perf_event_open` on x86_64.
const NR_PERF_EVENT_OPEN: &str = "298";

fn run(program: &Path, args: &[&str]) -> (Output, String) {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    eprintln!(
        "$ {} {args:?}\n{stdout}{}",
        program.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, stdout)
}

/// The value of the line that starts with `key`.
fn line<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(key).filter(|rest| rest.starts_with(' ')))
        .unwrap_or_else(|| panic!("no `{key}` line in:\n{stdout}"))
        .trim()
}

/// `deny_syscall`, built from its source into `dir`.
fn deny_syscall(dir: &TempDir) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fakes/deny_syscall.c");
    let binary = dir.join("deny_syscall");
    let status = Command::new("gcc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&binary)
        .arg(&source)
        .status()
        .expect("run gcc");
    assert!(status.success(), "gcc {}", source.display());
    binary
}

#[test]
fn as_root_it_will_work_and_says_what_it_tried() {
    let env = Env::privileged();
    let (output, stdout) = run(&env.clrbpf, &["system-info"]);
    assert!(output.status.success(), "{stdout}");
    let verdict = line(&stdout, "verdict");
    assert!(verdict.starts_with("will work"), "{verdict}");
    assert!(line(&stdout, "bpf program").starts_with("loads"));
    assert!(line(&stdout, "perf event").starts_with("opens"));
    assert!(line(&stdout, "attach").starts_with("attaches"));
    assert!(line(&stdout, "btf").starts_with("read"));
    let version = line(&stdout, "clrbpf");
    assert!(
        version.split('.').count() == 3 && version.chars().all(|c| c.is_ascii_digit() || c == '.'),
        "{version}"
    );
    // Where it runs: its own cgroup, as /proc/self/cgroup says.
    let own = std::fs::read_to_string("/proc/self/cgroup").expect("cgroup");
    let cgroup = line(&stdout, "cgroup");
    assert!(
        own.lines().any(|l| l.starts_with("0::")) == cgroup.starts_with("0::"),
        "{cgroup}"
    );
    line(&stdout, "container");
    assert!(line(&stdout, "pid namespace").starts_with("the host's"));
}

#[test]
fn a_seccomp_filter_that_denies_bpf_means_it_will_not_work() {
    let env = Env::privileged();
    let dir = TempDir::new("system-info-seccomp");
    let deny = deny_syscall(&dir);
    let clrbpf = env.clrbpf.to_str().expect("utf-8 path");
    let (output, stdout) = run(&deny, &[NR_BPF, clrbpf, "system-info"]);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let verdict = line(&stdout, "verdict");
    assert!(
        verdict.starts_with("will not work:")
            && verdict.contains("bpf")
            && verdict.contains("seccomp filter")
            && verdict.contains("fix:")
            && verdict.contains("seccompProfile"),
        "{verdict}"
    );
    assert!(
        line(&stdout, "bpf program").starts_with("FAILS"),
        "{stdout}"
    );
    // The perf event still opens: the blocked call is named, not all of them.
    assert!(line(&stdout, "perf event").starts_with("opens"), "{stdout}");
    assert!(line(&stdout, "attach").starts_with("not tried"), "{stdout}");

    let (output, stdout) = run(&deny, &[NR_PERF_EVENT_OPEN, clrbpf, "system-info"]);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let verdict = line(&stdout, "verdict");
    assert!(
        verdict.contains("perf_event_open") && verdict.contains("seccomp filter"),
        "{verdict}"
    );
}

#[test]
fn without_capabilities_it_will_not_work_and_names_them() {
    let env = Env::privileged();
    let (output, stdout) = run(
        Path::new("setpriv"),
        &[
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "--inh-caps",
            "-all",
            "--bounding-set",
            "-all",
            "--",
            env.clrbpf.to_str().expect("utf-8 path"),
            "system-info",
        ],
    );
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let verdict = line(&stdout, "verdict");
    assert!(
        verdict.starts_with("will not work:")
            && verdict.contains("CAP_BPF")
            && verdict.contains("sudo"),
        "{verdict}"
    );
}
