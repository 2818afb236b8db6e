//! What the kernel side needs from the host, checked before anything is
//! loaded so a missing piece gives one line that names the fix instead of a
//! syscall error deep in the loader. Also backs `clrbpf system-info`.

use std::{
    fs,
    io::{self, Write},
    path::Path,
};

const TRACEFS: &str = "/sys/kernel/tracing";
const BPFFS: &str = "/sys/fs/bpf";
const BTF_VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// Linux capability numbers (include/uapi/linux/capability.h).
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

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
fn effective_capabilities() -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| parse_cap_eff(&s))
        .unwrap_or(0)
}

fn parse_cap_eff(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line["CapEff:".len()..].trim(), 16).ok()
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
    let mut warnings = Vec::new();
    if !Path::new(TRACEFS).join("events").is_dir() {
        mount("tracefs", TRACEFS).map_err(|source| SystemError::Tracefs { source })?;
        tracing::info!("mounted tracefs at {TRACEFS}");
    }
    if !is_mount_point_of(BPFFS, "bpf") {
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

/// `clrbpf system-info`: the kernel features clrbpf uses, one per line.
pub fn print_system_info(mut w: impl Write) -> io::Result<()> {
    let read = |p: &str| {
        fs::read_to_string(p)
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "unavailable".into())
    };
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let caps = effective_capabilities();
    let missing = missing_capabilities(caps);
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
    writeln!(
        w,
        "bpf syscall            {}",
        yes_no(Path::new("/proc/sys/kernel/bpf_stats_enabled").exists())
    )?;
    writeln!(
        w,
        "btf (vmlinux)          {}",
        yes_no(Path::new(BTF_VMLINUX).exists())
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
    Ok(())
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
