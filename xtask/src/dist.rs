//! `cargo xtask dist`: the release a user installs without a Rust
//! toolchain, in `target/dist/`:
//!
//! - `clrbpf-<version>-x86_64-linux.tar.gz`: one directory holding a static
//!   `clrbpf` (musl, the eBPF object embedded, no dynamic loader, so it runs
//!   on any x86_64 Linux whatever its libc), the licences, the README, the
//!   CHANGELOG and the Helm chart;
//! - `clrbpf-<version>-image.oci.tar`: the image of the Dockerfile, built
//!   from that same binary with buildah (daemonless), as an OCI archive
//!   that `skopeo copy` or `podman load` takes; tagged with the chart's
//!   default image and its appVersion, so the chart runs what is published;
//! - `SHA256SUMS` for both, in `sha256sum -c` format.
//!
//! The archive is reproducible: sorted names, owner root, every mtime the
//! last commit's, gzip without a timestamp.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, anyhow, bail};

use crate::{ENV_AYA_BUILD_SKIP, Repo, cmd, setup};

/// The static target: musl links libc into the binary.
pub const MUSL_TARGET: &str = "x86_64-unknown-linux-musl";

/// What the tarball's names say about the platform.
const PLATFORM: &str = "x86_64-linux";

/// The version of every workspace crate (they share it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The CA bundle the image carries for the HTTPS sinks: the image has no
/// package manager, and rustls reads the system's roots at this path.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The files of the repository the tarball carries next to the binary.
const DOCUMENTS: &[&str] = &["LICENSE-APACHE", "LICENSE-MIT", "README.md", "CHANGELOG.md"];

/// The paths of one `dist` run.
pub struct Dist {
    /// `target/dist`.
    pub dir: PathBuf,
    /// The tarball.
    pub tarball: PathBuf,
}

impl Dist {
    pub fn in_target(target: &Path) -> Self {
        let dir = target.join("dist");
        let tarball = dir.join(format!("{}.tar.gz", package_name()));
        Self { dir, tarball }
    }
}

/// `clrbpf-<version>-x86_64-linux`: the tarball's stem and its top directory.
pub fn package_name() -> String {
    format!("clrbpf-{VERSION}-{PLATFORM}")
}

/// Whether `dist` builds the image too.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Image {
    Build,
    Skip,
}

/// Builds the static binary, the tarball, the image (unless skipped) and
/// the checksums.
pub fn run(repo: &Repo, image: Image) -> anyhow::Result<Dist> {
    let dist = Dist::in_target(&repo.target);
    let chart = chart_image(&repo.root)?;
    musl_toolchain()?;
    let binary = build_static(repo)?;
    fs::create_dir_all(&dist.dir).with_context(|| format!("create {}", dist.dir.display()))?;
    write_tarball(repo, &binary, &dist)?;
    let mut sums = vec![dist.tarball.clone()];
    if image == Image::Build {
        let archive = build_image(repo, &binary, &dist, &chart)?;
        sums.push(archive);
    } else {
        // A stale archive would get a checksum it no longer matches.
        let _ = fs::remove_file(image_archive(&dist));
    }
    write_checksums(&dist, &sums)?;
    println!("dist: {}", dist.tarball.display());
    Ok(dist)
}

/// The Rust target (rustup) and the C compiler for it (Debian's
/// musl-tools: ring and the zlib of blazesym compile C).
fn musl_toolchain() -> anyhow::Result<()> {
    cmd::run(Command::new("rustup").args(["target", "add", MUSL_TARGET]))
        .context("install the musl target (rustup)")?;
    setup::debian_packages_of(&["musl-tools"])
}

/// `target/x86_64-unknown-linux-musl/release/clrbpf`, with the eBPF object,
/// checked to need no dynamic loader.
fn build_static(repo: &Repo) -> anyhow::Result<PathBuf> {
    cmd::run(
        repo.cargo()
            .args(["build", "--release", "--locked", "--package", "clrbpf"])
            .args(["--target", MUSL_TARGET])
            .env_remove(ENV_AYA_BUILD_SKIP),
    )
    .context("build the static clrbpf")?;
    let binary = repo.target.join(MUSL_TARGET).join("release").join("clrbpf");
    let bytes = fs::read(&binary).with_context(|| format!("read {}", binary.display()))?;
    if has_interpreter(&bytes).with_context(|| format!("read the ELF of {}", binary.display()))? {
        bail!(
            "{} asks for a dynamic loader (PT_INTERP): it would not run without that libc",
            binary.display()
        );
    }
    Ok(binary)
}

/// Whether a 64-bit little-endian ELF file has a `PT_INTERP` program
/// header, i.e. needs a dynamic loader to start.
pub fn has_interpreter(elf: &[u8]) -> anyhow::Result<bool> {
    const PT_INTERP: u32 = 3;
    if elf.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        bail!("not a 64-bit little-endian ELF file");
    }
    let read = |at: usize, len: usize| -> anyhow::Result<u64> {
        let field = elf
            .get(at..at + len)
            .ok_or_else(|| anyhow!("truncated at byte {at}"))?;
        Ok(field
            .iter()
            .rev()
            .fold(0u64, |value, &byte| value << 8 | u64::from(byte)))
    };
    let phoff = usize::try_from(read(0x20, 8)?)?;
    let entsize = usize::try_from(read(0x36, 2)?)?;
    let count = usize::try_from(read(0x38, 2)?)?;
    for index in 0..count {
        let header = phoff
            .checked_add(
                index
                    .checked_mul(entsize)
                    .ok_or_else(|| anyhow!("overflow"))?,
            )
            .ok_or_else(|| anyhow!("overflow"))?;
        if read(header, 4)? == u64::from(PT_INTERP) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The tarball: `clrbpf-<v>-x86_64-linux/{clrbpf, LICENSE-*, README.md,
/// CHANGELOG.md, chart/clrbpf/}`, staged in `target/dist/<name>/`.
fn write_tarball(repo: &Repo, binary: &Path, dist: &Dist) -> anyhow::Result<()> {
    let name = package_name();
    let stage = dist.dir.join(&name);
    if stage.exists() {
        fs::remove_dir_all(&stage).with_context(|| format!("remove {}", stage.display()))?;
    }
    fs::create_dir_all(stage.join("chart"))
        .with_context(|| format!("create {}", stage.display()))?;
    fs::copy(binary, stage.join("clrbpf")).context("stage the binary")?;
    for document in DOCUMENTS {
        fs::copy(repo.root.join(document), stage.join(document))
            .with_context(|| format!("stage {document}"))?;
    }
    cmd::run(
        Command::new("cp")
            .arg("-R")
            .arg(repo.root.join("deploy/helm/clrbpf"))
            .arg(stage.join("chart")),
    )?;
    let mtime = cmd::output(Command::new("git").current_dir(&repo.root).args([
        "log",
        "-1",
        "--format=%ct",
    ]))?;
    cmd::run(
        Command::new("tar")
            .current_dir(&dist.dir)
            .args(["--sort=name", "--owner=0", "--group=0", "--numeric-owner"])
            .arg(format!("--mtime=@{}", mtime.trim()))
            .args(["--use-compress-program=gzip -n -9", "-cf"])
            .arg(&dist.tarball)
            .arg(&name),
    )
    .context("write the tarball")
}

/// The chart's default image (`image.repository` in values.yaml) and tag
/// (its appVersion, which must be the crates' version).
pub struct ChartImage {
    pub repository: String,
    pub tag: String,
}

impl ChartImage {
    fn reference(&self) -> String {
        format!("{}:{}", self.repository, self.tag)
    }
}

fn chart_image(root: &Path) -> anyhow::Result<ChartImage> {
    let chart = root.join("deploy/helm/clrbpf");
    let values = fs::read_to_string(chart.join("values.yaml")).context("read values.yaml")?;
    let repository = values
        .split_once("\nimage:")
        .and_then(|(_, image)| {
            image
                .lines()
                .take_while(|line| line.is_empty() || line.starts_with(' '))
                .find_map(|line| line.trim().strip_prefix("repository:"))
        })
        .map(|value| value.trim().trim_matches('"').to_owned())
        .ok_or_else(|| anyhow!("values.yaml has no image.repository"))?;
    let meta = fs::read_to_string(chart.join("Chart.yaml")).context("read Chart.yaml")?;
    let tag = meta
        .lines()
        .find_map(|line| line.strip_prefix("appVersion:"))
        .map(|value| value.trim().trim_matches('"').to_owned())
        .ok_or_else(|| anyhow!("Chart.yaml has no appVersion"))?;
    if tag != VERSION {
        bail!(
            "Chart.yaml's appVersion {tag} is not the crates' version {VERSION}: the chart would run another image than this release"
        );
    }
    Ok(ChartImage { repository, tag })
}

fn image_archive(dist: &Dist) -> PathBuf {
    dist.dir.join(format!("clrbpf-{VERSION}-image.oci.tar"))
}

/// Builds the Dockerfile's image from `binary` with buildah (chroot
/// isolation, vfs storage under `target/dist/containers`, so neither a
/// daemon nor the host's image store is involved) and writes it as an OCI
/// archive.
fn build_image(
    repo: &Repo,
    binary: &Path,
    dist: &Dist,
    chart: &ChartImage,
) -> anyhow::Result<PathBuf> {
    setup::debian_packages_of(&["buildah"])?;
    let context = dist.dir.join("image-context");
    if context.exists() {
        fs::remove_dir_all(&context).with_context(|| format!("remove {}", context.display()))?;
    }
    fs::create_dir_all(context.join("tmp"))?;
    fs::set_permissions(context.join("tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::copy(binary, context.join("clrbpf")).context("stage the binary for the image")?;
    fs::copy(CA_BUNDLE, context.join("ca-certificates.crt"))
        .with_context(|| format!("copy {CA_BUNDLE} (Debian's ca-certificates)"))?;
    let storage = dist.dir.join("containers");
    let buildah = || {
        let mut command = Command::new("buildah");
        command
            .arg("--root")
            .arg(storage.join("storage"))
            .arg("--runroot")
            .arg(storage.join("run"))
            .args(["--storage-driver", "vfs"]);
        command
    };
    let reference = chart.reference();
    cmd::run(
        buildah()
            .args(["bud", "--isolation", "chroot", "--timestamp", "0"])
            .arg("--file")
            .arg(repo.root.join("Dockerfile"))
            .args(["--tag", &reference])
            .arg(&context),
    )
    .context("build the image")?;
    let archive = image_archive(dist);
    let _ = fs::remove_file(&archive);
    cmd::run(
        buildah()
            .args(["push", &reference])
            .arg(format!("oci-archive:{}:{reference}", archive.display())),
    )
    .context("write the image archive")?;
    println!("dist: image {reference} in {}", archive.display());
    Ok(archive)
}

/// `SHA256SUMS` next to the files, names relative to it.
fn write_checksums(dist: &Dist, files: &[PathBuf]) -> anyhow::Result<()> {
    let mut sha = Command::new("sha256sum");
    sha.current_dir(&dist.dir);
    for file in files {
        sha.arg(
            file.file_name()
                .ok_or_else(|| anyhow!("{} has no name", file.display()))?,
        );
    }
    let sums = cmd::output(&mut sha)?;
    fs::write(dist.dir.join("SHA256SUMS"), sums).context("write SHA256SUMS")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpreter_is_found_in_a_dynamic_binary_only() {
        let this = fs::read(std::env::current_exe().unwrap()).unwrap();
        // The test binary is a glibc build: it has a loader.
        assert!(has_interpreter(&this).unwrap());
        let mut fake = vec![0u8; 0x40 + 56];
        fake[..6].copy_from_slice(b"\x7fELF\x02\x01");
        fake[0x20] = 0x40; // e_phoff
        fake[0x36] = 56; // e_phentsize
        fake[0x38] = 1; // e_phnum
        fake[0x40] = 1; // PT_LOAD
        assert!(!has_interpreter(&fake).unwrap());
        fake[0x40] = 3;
        assert!(has_interpreter(&fake).unwrap());
        fake[0x38] = 2; // a header past the end
        fake[0x40] = 1;
        assert!(has_interpreter(&fake).is_err());
        assert!(has_interpreter(b"#!/bin/sh").is_err());
    }
}
