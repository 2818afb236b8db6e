//! "Will it work here?": `clrbpf system-info` tries what profiling needs
//! instead of looking for files. It loads a two-instruction BPF program of
//! the perf_event type (the kind that samples stacks), opens a `cpu-clock`
//! perf event on one CPU, attaches the one to the other, and reads the
//! kernel's BTF. A seccomp filter, an LSM or lockdown that blocks a syscall
//! shows up here as the error it gives, which the sysctl files cannot tell.
//! Nothing stays loaded: the file descriptors close when the probe returns.

use std::{
    fs, io,
    os::fd::{FromRawFd as _, OwnedFd},
};

use super::system::{effective_capabilities, has_capability};

const BPF_PROG_LOAD: libc::c_long = 5;
#[doc(alias = "BPF_PROG_TYPE_PERF_EVENT")]
const PROG_TYPE_PERF_EVENT: u32 = 7;
const PERF_TYPE_SOFTWARE: u32 = 1;
#[doc(alias = "PERF_COUNT_SW_CPU_CLOCK")]
const SW_CPU_CLOCK: u64 = 0;
/// `_IOW('$', 8, __u32)`.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
const CAP_BPF: u32 = 39;
const CAP_PERFMON: u32 = 38;
const CAP_SYS_ADMIN: u32 = 21;

/// Why a step failed, in the user's words, and what to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    pub reason: String,
    pub fix: String,
}

/// The outcome of the probe, step by step.
#[derive(Debug)]
pub struct Probe {
    /// The trivial program loaded.
    pub bpf: Result<(), Blocked>,
    pub perf_event: Result<(), Blocked>,
    /// Attaching the program to the event; `None` when either failed.
    pub attach: Option<Result<(), Blocked>>,
    /// The size of the kernel's BTF, read and parsed.
    pub btf: Result<u64, String>,
}

impl Probe {
    /// Runs every step; each failure is explained against what this
    /// process is (its capabilities, seccomp mode, the kernel's settings).
    pub fn run() -> Self {
        let context = Context::of_this_process();
        let bpf = load_trivial_program();
        let perf_event = open_cpu_clock();
        let attach = match (&bpf, &perf_event) {
            (Ok(program), Ok(event)) => {
                Some(attach(program, event).map_err(|e| context.explain(Step::Attach, &e)))
            }
            _ => None,
        };
        Self {
            bpf: bpf.map(drop).map_err(|e| context.explain(Step::Bpf, &e)),
            perf_event: perf_event
                .map(drop)
                .map_err(|e| context.explain(Step::PerfEvent, &e)),
            attach,
            btf: read_btf(),
        }
    }

    /// The first step that failed, if any: what makes profiling impossible.
    pub fn blocker(&self) -> Option<&Blocked> {
        [&self.bpf, &self.perf_event]
            .into_iter()
            .chain(self.attach.as_ref())
            .find_map(|step| step.as_ref().err())
    }
}

/// `bpf(BPF_PROG_LOAD)` of `r0 = 0; exit` as a perf_event program.
fn load_trivial_program() -> io::Result<OwnedFd> {
    // struct bpf_insn: code, dst/src registers, offset, immediate.
    let instructions: [u64; 2] = [
        u64::from_le_bytes([0xb7, 0, 0, 0, 0, 0, 0, 0]), // mov64 r0, 0
        u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0]), // exit
    ];
    let license = c"GPL";
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license,
    // then zeros (no log, no name, no flags).
    let mut attr = [0u64; 16];
    attr[0] = u64::from(PROG_TYPE_PERF_EVENT) | (2u64 << 32);
    attr[1] = instructions.as_ptr() as u64;
    attr[2] = license.as_ptr() as u64;
    // SAFETY: attr is a valid, zero-padded bpf_attr for BPF_PROG_LOAD whose
    // pointers outlive the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            attr.as_ptr(),
            size_of_val(&attr),
        )
    };
    owned_fd(fd)
}

/// `perf_event_open` of a disabled `cpu-clock` event on CPU 0, all
/// processes: what clrbpf opens on every CPU.
fn open_cpu_clock() -> io::Result<OwnedFd> {
    // struct perf_event_attr, PERF_ATTR_SIZE_VER0 (64 bytes): type, size,
    // config, sample_period, sample_type, read_format, flags (bit 0:
    // disabled), wakeup_events + bp_type, bp_addr.
    let mut attr = [0u64; 8];
    attr[0] = u64::from(PERF_TYPE_SOFTWARE) | (64u64 << 32);
    attr[1] = SW_CPU_CLOCK;
    attr[2] = 10_000_000;
    attr[5] = 1;
    // SAFETY: attr is a valid perf_event_attr of the size it states.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            attr.as_ptr(),
            -1 as libc::pid_t,
            0 as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    owned_fd(fd)
}

fn attach(program: &OwnedFd, event: &OwnedFd) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: both are open descriptors of the kinds the ioctl expects.
    let rc = unsafe {
        libc::ioctl(
            event.as_raw_fd(),
            PERF_EVENT_IOC_SET_BPF,
            program.as_raw_fd(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn owned_fd(rc: libc::c_long) -> io::Result<OwnedFd> {
    match libc::c_int::try_from(rc) {
        // SAFETY: a non-negative return of these syscalls is a new fd we own.
        Ok(fd) if fd >= 0 => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
        _ => Err(io::Error::last_os_error()),
    }
}

fn read_btf() -> Result<u64, String> {
    const BTF_VMLINUX: &str = "/sys/kernel/btf/vmlinux";
    let size = fs::metadata(BTF_VMLINUX)
        .map_err(|e| format!("{BTF_VMLINUX}: {e}"))?
        .len();
    aya::Btf::from_sys_fs().map_err(|e| format!("{BTF_VMLINUX}: {e}"))?;
    Ok(size)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Bpf,
    PerfEvent,
    Attach,
}

/// What decides why a syscall is refused.
#[derive(Clone, Debug, Default)]
struct Context {
    capabilities: u64,
    /// `Seccomp:` of /proc/self/status: 0 none, 1 strict, 2 filter.
    seccomp: u32,
    /// The active mode of /sys/kernel/security/lockdown, if not `none`.
    lockdown: Option<String>,
    /// The AppArmor profile this process runs under, if confined.
    apparmor: Option<String>,
    perf_event_paranoid: Option<i32>,
}

impl Context {
    fn of_this_process() -> Self {
        let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
        let read = |path: &str| fs::read_to_string(path).ok();
        Self {
            capabilities: effective_capabilities(),
            seccomp: status_field(&status, "Seccomp:").unwrap_or(0),
            lockdown: read("/sys/kernel/security/lockdown").and_then(|s| active_lockdown(&s)),
            apparmor: read("/proc/self/attr/apparmor/current")
                .or_else(|| read("/proc/self/attr/current"))
                .and_then(|s| confining_profile(&s)),
            perf_event_paranoid: read("/proc/sys/kernel/perf_event_paranoid")
                .and_then(|s| s.trim().parse().ok()),
        }
    }

    fn has(&self, capability: u32) -> bool {
        has_capability(self.capabilities, capability)
    }

    /// Why `step` failed with `error`, and the fix, most specific first: a
    /// seccomp filter is the likeliest in a container, then a missing
    /// capability, then lockdown and AppArmor.
    fn explain(&self, step: Step, error: &io::Error) -> Blocked {
        let call = match step {
            Step::Bpf => "loading a BPF program (bpf BPF_PROG_LOAD)",
            Step::PerfEvent => "opening a cpu-clock perf event (perf_event_open)",
            Step::Attach => "attaching a BPF program to a perf event (PERF_EVENT_IOC_SET_BPF)",
        };
        let refused = matches!(
            error.raw_os_error(),
            Some(libc::EPERM | libc::EACCES | libc::ENOSYS)
        );
        let capability = match step {
            Step::Bpf => (!self.has(CAP_BPF) && !self.has(CAP_SYS_ADMIN)).then_some("CAP_BPF"),
            Step::PerfEvent | Step::Attach => {
                (!self.has(CAP_PERFMON) && !self.has(CAP_SYS_ADMIN)).then_some("CAP_PERFMON")
            }
        };
        let (cause, fix) = if refused && self.seccomp == 2 {
            (
                "a seccomp filter denies it (Seccomp: 2 in /proc/self/status)".to_owned(),
                "run clrbpf without the filter: in Kubernetes securityContext.seccompProfile.type: Unconfined (the chart sets it), with Docker or Podman --security-opt seccomp=unconfined".to_owned(),
            )
        } else if refused && let Some(capability) = capability {
            (
                format!("this process lacks {capability}"),
                "run clrbpf as root (sudo), or add CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE (the chart's securityContext does)".to_owned(),
            )
        } else if refused && let Some(mode) = &self.lockdown {
            (
                format!("the kernel is locked down ({mode})"),
                "boot with lockdown=none or integrity, or without Secure Boot's lockdown"
                    .to_owned(),
            )
        } else if refused && let Some(profile) = &self.apparmor {
            (
                format!("AppArmor profile `{profile}` confines this process"),
                "run clrbpf unconfined: in Kubernetes securityContext.appArmorProfile.type: Unconfined".to_owned(),
            )
        } else if step == Step::PerfEvent && refused {
            (
                format!(
                    "kernel.perf_event_paranoid is {}",
                    self.perf_event_paranoid
                        .map_or_else(|| "unknown".to_owned(), |p| p.to_string())
                ),
                "run clrbpf as root, or with CAP_PERFMON".to_owned(),
            )
        } else if error.raw_os_error() == Some(libc::ENOSYS) {
            (
                "the kernel has no such syscall".to_owned(),
                "use a kernel built with CONFIG_BPF_SYSCALL and CONFIG_PERF_EVENTS".to_owned(),
            )
        } else {
            (
                "the kernel refused it".to_owned(),
                "see docs/security.md for what clrbpf needs".to_owned(),
            )
        };
        Blocked {
            reason: format!("{call} fails ({error}): {cause}"),
            fix,
        }
    }
}

fn status_field(status: &str, key: &str) -> Option<u32> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].trim().parse().ok()
}

/// `none [integrity] confidentiality` -> `integrity`; `None` for `none`.
fn active_lockdown(text: &str) -> Option<String> {
    let start = text.find('[')?;
    let end = start + text[start..].find(']')?;
    let mode = &text[start + 1..end];
    (mode != "none").then(|| mode.to_owned())
}

/// `docker-default (enforce)` -> `docker-default`; `None` when unconfined.
fn confining_profile(text: &str) -> Option<String> {
    let text = text.trim().trim_end_matches('\0');
    let name = text.split(" (").next().unwrap_or(text).trim();
    let enforced = !text.ends_with("(complain)") && !text.ends_with("(unconfined)");
    (!name.is_empty() && name != "unconfined" && enforced).then(|| name.to_owned())
}

/// Where this process runs, as it sees it: the container (from its cgroup
/// and the files runtimes leave), its cgroup, and whether its pid namespace
/// is the host's (a child one sees only its own processes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// `Kubernetes`, `Docker`, `Podman`, or `None` when nothing says so.
    pub runtime: Option<&'static str>,
    pub identity: crate::process::cgroup::CgroupIdentity,
    /// The cgroup2 line of /proc/self/cgroup, else the first line.
    pub cgroup: String,
    /// `NSpid:` has more than one entry.
    pub own_pid_namespace: bool,
}

impl Placement {
    pub fn of_this_process() -> Self {
        let cgroup = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
        let exists = |path: &str| std::path::Path::new(path).exists();
        let runtime = if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            Some("Kubernetes")
        } else if exists("/.dockerenv") {
            Some("Docker")
        } else if exists("/run/.containerenv") {
            Some("Podman")
        } else {
            None
        };
        Self::from_files(runtime, &cgroup, &status)
    }

    fn from_files(runtime: Option<&'static str>, cgroup: &str, status: &str) -> Self {
        let line = cgroup
            .lines()
            .find(|line| line.starts_with("0::"))
            .or_else(|| cgroup.lines().next())
            .unwrap_or("unknown");
        let own_pid_namespace = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .is_some_and(|pids| pids.split_whitespace().count() > 1);
        Self {
            runtime,
            identity: crate::process::cgroup::identity_from_cgroup(cgroup, ""),
            cgroup: line.chars().take(200).collect(),
            own_pid_namespace,
        }
    }

    /// `Kubernetes, container 0123456789ab, pod 1b2c...`, or `none seen`.
    pub fn container(&self) -> String {
        let mut parts: Vec<String> = self.runtime.iter().map(|r| (*r).to_owned()).collect();
        if let Some(id) = &self.identity.container_id {
            parts.push(format!("container {}", &id[..id.len().min(12)]));
        }
        if let Some(pod) = &self.identity.pod_uid {
            parts.push(format!("pod {pod}"));
        }
        if parts.is_empty() {
            "none seen (not in a container, or one that hides it)".to_owned()
        } else {
            parts.join(", ")
        }
    }

    /// A limit worth the verdict, if the pid namespace is not the host's.
    pub fn pid_namespace_limit(&self) -> Option<String> {
        self.own_pid_namespace.then(|| {
            "runs in a pid namespace of its own: it sees only the processes of its container (fix: hostPID: true, as the chart sets, or --pid=host)".to_owned()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eperm() -> io::Error {
        io::Error::from_raw_os_error(libc::EPERM)
    }

    #[test]
    fn seccomp_is_named_before_capabilities() {
        let context = Context {
            seccomp: 2,
            ..Context::default()
        };
        let blocked = context.explain(Step::Bpf, &eperm());
        assert!(blocked.reason.contains("seccomp filter"), "{blocked:?}");
        assert!(blocked.fix.contains("Unconfined"), "{blocked:?}");
    }

    #[test]
    fn a_missing_capability_then_lockdown_then_apparmor() {
        let blocked = Context::default().explain(Step::PerfEvent, &eperm());
        assert!(blocked.reason.contains("CAP_PERFMON"), "{blocked:?}");
        let root = Context {
            capabilities: u64::MAX,
            lockdown: Some("confidentiality".into()),
            apparmor: Some("docker-default".into()),
            ..Context::default()
        };
        assert!(
            root.explain(Step::Bpf, &eperm())
                .reason
                .contains("locked down")
        );
        let root = Context {
            lockdown: None,
            ..root
        };
        let blocked = root.explain(Step::Attach, &eperm());
        assert!(blocked.reason.contains("docker-default"), "{blocked:?}");
    }

    #[test]
    fn lockdown_and_apparmor_files_are_read() {
        assert_eq!(active_lockdown("[none] integrity confidentiality\n"), None);
        assert_eq!(
            active_lockdown("none [integrity] confidentiality\n").as_deref(),
            Some("integrity")
        );
        assert_eq!(active_lockdown("garbage ["), None);
        assert_eq!(confining_profile("unconfined\n"), None);
        assert_eq!(
            confining_profile("docker-default (enforce)\n").as_deref(),
            Some("docker-default")
        );
        assert_eq!(confining_profile("x (complain)"), None);
    }

    #[test]
    fn placement_reads_the_cgroup_and_the_pid_namespace() {
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let cgroup = format!("1:cpu:/\n0::/system.slice/docker-{id}.scope\n");
        let placement = Placement::from_files(None, &cgroup, "NSpid:\t4711\t1\n");
        assert_eq!(placement.container(), "container 0123456789ab");
        assert!(placement.cgroup.starts_with("0::/system.slice/docker-"));
        assert!(placement.pid_namespace_limit().is_some());
        let host = Placement::from_files(None, "0::/\n", "NSpid:\t4711\n");
        assert!(host.container().starts_with("none seen"));
        assert_eq!(host.pid_namespace_limit(), None);
    }

    /// As root here: every step works.
    #[test]
    #[ignore = "needs root: loads a BPF program"]
    fn the_probe_works_as_root() {
        let probe = Probe::run();
        assert_eq!(probe.blocker(), None, "{probe:?}");
        assert!(probe.btf.is_ok(), "{probe:?}");
    }
}
