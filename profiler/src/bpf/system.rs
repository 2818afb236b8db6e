//! What the kernel side needs from the host, checked before anything is
//! loaded so a missing piece gives one line that names the fix instead of a
//! syscall error deep in the loader. Also backs `clrbpf system-info`.

use std::{
    fs,
    io::{self, Write},
    path::Path,
};

use super::probe::{Blocked, Placement, Probe};

const TRACEFS: &str = "/sys/kernel/tracing";
const BPFFS: &str = "/sys/fs/bpf";
const BTF_VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// Linux capability numbers (include/uapi/linux/capability.h).
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// One capability of the least-privilege set: what it enables, and so what
/// is lost without it.
pub struct Capability {
    /// Name as Kubernetes spells it (`securityContext.capabilities.add`).
    pub name: &'static str,
    pub bit: u32,
    /// Without it clrbpf cannot run at all (CAP_SYS_ADMIN stands in for
    /// BPF and PERFMON on kernels before 5.8).
    pub required: bool,
    /// What is lost without it.
    pub without: &'static str,
    /// Needed only on kernels older than this (major, minor): since 5.11
    /// BPF memory is charged to the memory cgroup, not RLIMIT_MEMLOCK.
    pub needed_before: Option<(u32, u32)>,
}

/// Exactly the capabilities the Helm chart adds
/// (deploy/helm/clrbpf/values.yaml `securityContext.capabilities.add`, in
/// that order; a unit test keeps the two equal).
pub const CHART_CAPABILITIES: [Capability; 11] = [
    Capability {
        name: "BPF",
        bit: CAP_BPF,
        required: true,
        without: "no eBPF programs or maps: nothing is sampled",
        needed_before: None,
    },
    Capability {
        name: "PERFMON",
        bit: CAP_PERFMON,
        required: true,
        without: "no system-wide perf events: nothing is sampled",
        needed_before: None,
    },
    Capability {
        name: "SYS_PTRACE",
        bit: CAP_SYS_PTRACE,
        required: true,
        without: "other users' processes are unreadable (/proc/PID/maps, root, environ): no symbols, no .NET attach",
        needed_before: None,
    },
    Capability {
        name: "SYS_RESOURCE",
        bit: 24,
        required: false,
        without: "RLIMIT_MEMLOCK cannot be raised: BPF maps fail to load on kernels before 5.11",
        needed_before: Some((5, 11)),
    },
    Capability {
        name: "DAC_READ_SEARCH",
        bit: 2,
        required: false,
        without: "binaries and perf maps in containers that root may not read by file mode stay unnamed",
        needed_before: None,
    },
    Capability {
        name: "CHECKPOINT_RESTORE",
        bit: 40,
        required: false,
        without: "/proc/PID/map_files is closed: no DWARF unwind tables for native code (frame pointers only), symbols through /proc/PID/root only",
        needed_before: None,
    },
    Capability {
        name: "IPC_LOCK",
        bit: 14,
        required: false,
        without: "ring buffers count against RLIMIT_MEMLOCK on kernels before 5.11",
        needed_before: Some((5, 11)),
    },
    Capability {
        name: "SYSLOG",
        bit: 34,
        required: false,
        without: "with kernel.kptr_restrict=1, /proc/kallsyms shows zero addresses: kernel frames unnamed",
        needed_before: None,
    },
    Capability {
        name: "SETUID",
        bit: 7,
        required: false,
        without: "no setfsuid: .NET apps running as another user cannot be attached (diagnostic socket mode 0600) nor their perf files removed",
        needed_before: None,
    },
    Capability {
        name: "SETGID",
        bit: 6,
        required: false,
        without: "no setfsgid: as SETUID, for the app's group",
        needed_before: None,
    },
    Capability {
        name: "SYS_NICE",
        bit: 23,
        required: false,
        without: "clrbpf cannot raise its own priority: on a saturated node its ring readers may fall behind and lose samples",
        needed_before: None,
    },
];

/// The chart's capabilities this process lacks and this kernel needs
/// (CAP_SYS_ADMIN stands in for BPF, PERFMON and CHECKPOINT_RESTORE, as on
/// kernels before 5.8/5.9).
fn missing_chart_capabilities(caps: u64, kernel: Option<(u32, u32)>) -> Vec<&'static Capability> {
    let has = |bit: u32| caps & (1u64 << bit) != 0;
    CHART_CAPABILITIES
        .iter()
        .filter(|c| match (c.needed_before, kernel) {
            (Some(before), Some(kernel)) => kernel < before,
            _ => true,
        })
        .filter(|c| {
            let covered_by_admin =
                matches!(c.name, "BPF" | "PERFMON" | "CHECKPOINT_RESTORE") && has(CAP_SYS_ADMIN);
            !has(c.bit) && !covered_by_admin
        })
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum SystemError {
    #[error(
        "clrbpf needs root (or CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE); missing {missing}: run it with sudo, or as a privileged container"
    )]
    MissingCapabilities { missing: String },
    #[error(
        "tracefs is not mounted at {TRACEFS} and mounting it failed ({source}): run `mount -t tracefs tracefs {TRACEFS}`"
    )]
    Tracefs {
        #[source]
        source: io::Error,
    },
    #[error(
        "the kernel has no BPF support (/proc/sys/kernel/bpf_stats_enabled is missing): use a kernel built with CONFIG_BPF_SYSCALL"
    )]
    NoBpf,
}

/// Effective capabilities of this process, from /proc/self/status.
pub(super) fn effective_capabilities() -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| parse_cap_eff(&s))
        .unwrap_or(0)
}

fn parse_cap_eff(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line["CapEff:".len()..].trim(), 16).ok()
}

pub(super) fn has_capability(caps: u64, bit: u32) -> bool {
    caps & (1u64 << bit) != 0
}

fn missing_capabilities(caps: u64) -> Vec<&'static str> {
    let has = |bit: u32| caps & (1u64 << bit) != 0;
    let mut missing = Vec::new();
    // CAP_SYS_ADMIN covers BPF and perf on kernels before 5.8.
    if !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if !has(CAP_PERFMON) && !has(CAP_SYS_ADMIN) {
        missing.push("CAP_PERFMON");
    }
    if !has(CAP_SYS_PTRACE) {
        missing.push("CAP_SYS_PTRACE");
    }
    missing
}

fn is_mount_point_of(path: &str, fstype: &str) -> bool {
    fs::read_to_string("/proc/self/mounts").is_ok_and(|mounts| {
        mounts.lines().any(|line| {
            let mut fields = line.split_whitespace();
            let (_, mount_point, kind) = (fields.next(), fields.next(), fields.next());
            mount_point == Some(path) && kind == Some(fstype)
        })
    })
}

fn mount(fstype: &str, target: &str) -> io::Result<()> {
    let c = |s: &str| std::ffi::CString::new(s).map_err(io::Error::other);
    let (source, target_c, kind) = (c(fstype)?, c(target)?, c(fstype)?);
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target_c.as_ptr(),
            kind.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Checks privileges and mounts tracefs and bpffs where missing. Returns
/// warnings worth showing (things that degrade, not stop, profiling).
pub fn prepare() -> Result<Vec<String>, SystemError> {
    let missing = missing_capabilities(effective_capabilities());
    if !missing.is_empty() {
        return Err(SystemError::MissingCapabilities {
            missing: missing.join(", "),
        });
    }
    if !Path::new("/proc/sys/kernel/bpf_stats_enabled").exists() {
        return Err(SystemError::NoBpf);
    }
    let mut warnings: Vec<String> =
        missing_chart_capabilities(effective_capabilities(), kernel_version())
            .into_iter()
            .map(|c| format!("missing CAP_{}: {}", c.name, c.without))
            .collect();
    if let Some(warning) = kallsyms_warning() {
        warnings.push(warning);
    }
    if !Path::new(TRACEFS).join("events").is_dir() {
        mount("tracefs", TRACEFS).map_err(|source| SystemError::Tracefs { source })?;
        tracing::info!("mounted tracefs at {TRACEFS}");
    }
    // Nothing is pinned, so bpffs is a convenience for bpftool only: without
    // CAP_SYS_ADMIN (a least-privilege container) it is not worth a warning.
    let may_mount = effective_capabilities() & (1u64 << CAP_SYS_ADMIN) != 0;
    if !is_mount_point_of(BPFFS, "bpf") && may_mount {
        match mount("bpf", BPFFS) {
            Ok(()) => tracing::info!("mounted bpffs at {BPFFS}"),
            Err(e) => warnings.push(format!(
                "bpffs is not mounted at {BPFFS} ({e}): run `mount -t bpf bpf {BPFFS}`"
            )),
        }
    }
    if !Path::new(BTF_VMLINUX).exists() {
        warnings.push(format!(
            "{BTF_VMLINUX} is missing (kernel without CONFIG_DEBUG_INFO_BTF): on-CPU sampling works, later features need BTF"
        ));
    }
    // Kernels since 5.11 account BPF memory to the memory cgroup; the limit
    // only matters on older ones, and raising it needs CAP_SYS_RESOURCE.
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        tracing::debug!(
            "setrlimit(RLIMIT_MEMLOCK) failed: {}",
            io::Error::last_os_error()
        );
    }
    Ok(warnings)
}

/// (major, minor) of the running kernel.
fn kernel_version() -> Option<(u32, u32)> {
    parse_kernel_version(&fs::read_to_string("/proc/sys/kernel/osrelease").ok()?)
}

fn parse_kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Kernel frames are named from /proc/kallsyms, whose addresses read as
/// zero under `kernel.kptr_restrict` unless the opener has CAP_SYSLOG
/// (kptr_restrict=1) or at all (2). Checked once, on the first line.
fn kallsyms_warning() -> Option<String> {
    use std::io::BufRead as _;
    let file = fs::File::open("/proc/kallsyms").ok()?;
    let mut first = String::new();
    io::BufReader::new(file).read_line(&mut first).ok()?;
    kallsyms_hides_addresses(&first).then(|| {
        let restrict = fs::read_to_string("/proc/sys/kernel/kptr_restrict").unwrap_or_default();
        format!(
            "/proc/kallsyms shows zero addresses (kernel.kptr_restrict={}): kernel frames stay unnamed; {}",
            restrict.trim(),
            if restrict.trim() == "2" {
                "set kernel.kptr_restrict to 1 and give clrbpf CAP_SYSLOG"
            } else {
                "clrbpf needs CAP_SYSLOG"
            }
        )
    })
}

fn kallsyms_hides_addresses(first_line: &str) -> bool {
    first_line
        .split_whitespace()
        .next()
        .is_some_and(|addr| !addr.is_empty() && addr.bytes().all(|b| b == b'0'))
}

/// `clrbpf system-info`: whether profiling will work here, from a real
/// probe ([`Probe`]), with the reason and the fix when it will not; then the
/// version, where clrbpf runs, and the kernel features it uses, one per
/// line. Returns whether it will work.
pub fn print_system_info(mut w: impl Write) -> io::Result<bool> {
    let read = |p: &str| {
        fs::read_to_string(p)
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "unavailable".into())
    };
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let caps = effective_capabilities();
    let missing = missing_capabilities(caps);
    let probe = Probe::run();
    let placement = Placement::of_this_process();
    let limits = limits(caps, &probe, &placement);
    writeln!(w, "verdict                {}", verdict(&probe, &limits))?;
    writeln!(w, "clrbpf                 {}", env!("CARGO_PKG_VERSION"))?;
    print_probe(&mut w, &probe)?;
    for limit in &limits {
        writeln!(w, "limit                  {limit}")?;
    }
    writeln!(w, "container              {}", placement.container())?;
    writeln!(w, "cgroup                 {}", placement.cgroup)?;
    writeln!(
        w,
        "pid namespace          {}",
        if placement.own_pid_namespace {
            "its own: only this container's processes are visible"
        } else {
            "the host's: every process is visible"
        }
    )?;
    writeln!(
        w,
        "kernel                 {}",
        read("/proc/sys/kernel/osrelease")
    )?;
    writeln!(
        w,
        "online cpus            {}",
        read("/sys/devices/system/cpu/online")
    )?;
    writeln!(
        w,
        "capabilities           {}",
        if missing.is_empty() {
            "ok".to_owned()
        } else {
            format!("missing {}", missing.join(", "))
        }
    )?;
    let missing_chart = missing_chart_capabilities(caps, kernel_version());
    for c in &CHART_CAPABILITIES {
        let present = caps & (1u64 << c.bit) != 0;
        let state = if missing_chart.iter().any(|m| m.name == c.name) {
            format!("MISSING: {}", c.without)
        } else if present {
            "present".to_owned()
        } else {
            "absent (not needed: this kernel or CAP_SYS_ADMIN covers it)".to_owned()
        };
        writeln!(w, "  CAP_{:<21}{state}", c.name)?;
    }
    writeln!(
        w,
        "chart capability set   {} (deploy/helm/clrbpf values.yaml; privileged: true also works)",
        CHART_CAPABILITIES.map(|c| c.name).join(", ")
    )?;
    writeln!(
        w,
        "kptr_restrict          {}",
        read("/proc/sys/kernel/kptr_restrict")
    )?;
    writeln!(
        w,
        "kernel symbols         {}",
        kallsyms_warning().unwrap_or_else(|| "named (/proc/kallsyms addresses visible)".into())
    )?;
    writeln!(
        w,
        "tracefs                {}",
        yes_no(Path::new(TRACEFS).join("events").is_dir())
    )?;
    writeln!(
        w,
        "bpffs                  {}",
        yes_no(is_mount_point_of(BPFFS, "bpf"))
    )?;
    writeln!(
        w,
        "perf_event_paranoid    {}",
        read("/proc/sys/kernel/perf_event_paranoid")
    )?;
    writeln!(
        w,
        "perf_event_max_stack   {}",
        read("/proc/sys/kernel/perf_event_max_stack")
    )?;
    writeln!(
        w,
        "bpf_stats_enabled      {}",
        read("/proc/sys/kernel/bpf_stats_enabled")
    )?;
    writeln!(
        w,
        "kprobes                {}",
        yes_no(Path::new("/sys/kernel/tracing/kprobe_events").exists())
    )?;
    writeln!(
        w,
        "user_events            {}",
        yes_no(Path::new("/sys/kernel/tracing/user_events_data").exists())
    )?;
    Ok(probe.blocker().is_none())
}

/// `will work`, `will work, with limits (see limit lines)`, or `will not
/// work: REASON; fix: FIX`.
fn verdict(probe: &Probe, limits: &[String]) -> String {
    match probe.blocker() {
        Some(Blocked { reason, fix }) => format!("will not work: {reason}; fix: {fix}"),
        None if limits.is_empty() => "will work".to_owned(),
        None => format!(
            "will work, with {} limit{} (the `limit` lines)",
            limits.len(),
            if limits.len() == 1 { "" } else { "s" }
        ),
    }
}

/// What degrades profiling without stopping it.
fn limits(caps: u64, probe: &Probe, placement: &Placement) -> Vec<String> {
    let mut limits: Vec<String> = missing_chart_capabilities(caps, kernel_version())
        .into_iter()
        .filter(|c| !c.required)
        .map(|c| format!("no CAP_{}: {}", c.name, c.without))
        .collect();
    limits.extend(kallsyms_warning());
    if let Err(e) = &probe.btf {
        limits.push(format!(
            "no BTF ({e}): on-CPU sampling works, later features need CONFIG_DEBUG_INFO_BTF"
        ));
    }
    limits.extend(placement.pid_namespace_limit());
    limits
}

fn print_probe(w: &mut impl Write, probe: &Probe) -> io::Result<()> {
    let outcome = |step: &Result<(), Blocked>, done: &str| match step {
        Ok(()) => done.to_owned(),
        Err(Blocked { reason, .. }) => format!("FAILS: {reason}"),
    };
    writeln!(
        w,
        "bpf program            {}",
        outcome(&probe.bpf, "loads (a perf_event program, then unloaded)")
    )?;
    writeln!(
        w,
        "perf event             {}",
        outcome(&probe.perf_event, "opens (cpu-clock, all processes, CPU 0)")
    )?;
    let attach = match &probe.attach {
        Some(step) => outcome(step, "attaches (the program to the perf event)"),
        None => "not tried (the steps above failed)".to_owned(),
    };
    writeln!(w, "attach                 {attach}")?;
    let btf = match &probe.btf {
        Ok(size) => format!("read ({BTF_VMLINUX}, {} KiB)", size / 1024),
        Err(e) => format!("unreadable: {e}"),
    };
    writeln!(w, "btf                    {btf}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_eff_is_parsed() {
        let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001fffeffffff\n";
        assert_eq!(parse_cap_eff(status), Some(0x0000_01ff_feff_ffff));
        assert_eq!(parse_cap_eff("Name:\tx\n"), None);
    }

    /// The chart's values.yaml adds exactly CHART_CAPABILITIES, in order.
    #[test]
    fn chart_adds_exactly_the_capabilities_system_info_names() {
        let values = include_str!("../../../deploy/helm/clrbpf/values.yaml");
        let mut lines = values.lines().skip_while(|l| l.trim() != "add:").skip(1);
        let mut listed = Vec::new();
        for line in lines.by_ref() {
            let Some(item) = line.trim().strip_prefix("- ") else {
                break;
            };
            listed.push(item.split('#').next().unwrap_or("").trim().to_owned());
        }
        let ours: Vec<String> = CHART_CAPABILITIES
            .iter()
            .map(|c| c.name.to_owned())
            .collect();
        assert_eq!(listed, ours);
    }

    #[test]
    fn zero_kallsyms_addresses_are_noticed() {
        assert!(kallsyms_hides_addresses(
            "0000000000000000 A fixed_percpu_data\n"
        ));
        assert!(!kallsyms_hides_addresses("ffffffff81000000 T _stext\n"));
        assert!(!kallsyms_hides_addresses(""));
    }

    #[test]
    fn missing_chart_capabilities_name_what_they_disable() {
        let all: u64 = CHART_CAPABILITIES.iter().map(|c| 1u64 << c.bit).sum();
        let new_kernel = Some((6, 18));
        assert!(missing_chart_capabilities(all, new_kernel).is_empty());
        let without_syslog = all & !(1u64 << 34);
        let missing = missing_chart_capabilities(without_syslog, new_kernel);
        assert_eq!(missing.len(), 1);
        assert_eq!(missing[0].name, "SYSLOG");
        assert!(missing[0].without.contains("kernel frames"));
        // CAP_SYS_ADMIN stands in for BPF, PERFMON and CHECKPOINT_RESTORE.
        let admin = (1u64 << CAP_SYS_ADMIN) | (1 << CAP_SYS_PTRACE);
        let names: Vec<_> = missing_chart_capabilities(admin, new_kernel)
            .iter()
            .map(|c| c.name)
            .collect();
        assert!(!names.contains(&"BPF") && !names.contains(&"CHECKPOINT_RESTORE"));
        assert!(names.contains(&"SYSLOG"));
        // RLIMIT_MEMLOCK matters before 5.11 only.
        assert!(!names.contains(&"SYS_RESOURCE") && !names.contains(&"IPC_LOCK"));
        let old: Vec<_> = missing_chart_capabilities(admin, Some((5, 10)))
            .iter()
            .map(|c| c.name)
            .collect();
        assert!(old.contains(&"SYS_RESOURCE") && old.contains(&"IPC_LOCK"));
        assert_eq!(parse_kernel_version("6.18.44-fc-v782\n"), Some((6, 18)));
        assert_eq!(parse_kernel_version("5.4.0"), Some((5, 4)));
        assert_eq!(parse_kernel_version("garbage"), None);
    }

    #[test]
    fn missing_capabilities_are_named() {
        assert!(missing_capabilities(0x0000_01ff_feff_ffff).is_empty());
        assert_eq!(
            missing_capabilities(0),
            vec!["CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE"]
        );
        let bpf_perfmon_ptrace = (1 << CAP_BPF) | (1 << CAP_PERFMON) | (1 << CAP_SYS_PTRACE);
        assert!(missing_capabilities(bpf_perfmon_ptrace).is_empty());
    }
}
