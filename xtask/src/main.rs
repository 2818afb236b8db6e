//! clrbpf's developer tasks, run as `cargo xtask <task>`: everything a
//! newcomer needs, from installing the toolchain pieces to the privileged
//! end-to-end tests. Each task runs the setup it depends on first, so
//! `cargo xtask demo` and `cargo xtask test` work on a fresh machine.

mod bench;
mod bench_alloc;
mod bench_alloc_storm;
mod bench_churn;
mod bench_first;
mod bench_names;
mod bench_naming;
mod bench_new_process;
mod bench_node;
mod bench_offcpu;
mod bench_saturated;
mod bench_stack_copy;
mod bench_steady;
mod chart;
mod cmd;
mod dist;
mod fuzz;
mod limits;
mod setup;
mod workloads;

use std::{
    env,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context as _, anyhow};
use clap::{Parser, Subcommand};

/// Environment variables the integration tests read (`tests/src/lib.rs`
/// names the same ones).
const ENV_BIN: &str = "CLRBPF_BIN";
const ENV_DOTNET8: &str = "CLRBPF_DOTNET8";
const ENV_DOTNET31: &str = "CLRBPF_DOTNET31";
const ENV_WORKLOADS: &str = "CLRBPF_WORKLOADS";
/// A python with the test tools' packages (prometheus-client).
const ENV_TEST_PYTHON: &str = "CLRBPF_TEST_PYTHON";

/// Skips the eBPF object in builds that do not run it (clippy, unit tests):
/// the release build the integration tests use builds it once.
const ENV_AYA_BUILD_SKIP: &str = "AYA_BUILD_SKIP";

#[derive(Parser)]
#[command(about = "clrbpf developer tasks", disable_help_subcommand = true)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the other tasks need: nightly rust-src, bpf-linker,
    /// Debian packages (mono-mcs, golang-go, linux-perf, bpfcc-tools,
    /// bpftool), the .NET 8 and .NET Core 3.1 runtimes, tracefs. Idempotent.
    Setup {
        /// Where the .NET runtimes are unpacked [default: target/runtimes]
        #[arg(long, value_name = "DIR")]
        runtimes_dir: Option<PathBuf>,
    },
    /// Build target/release/clrbpf (with its eBPF object).
    Build,
    /// Test the Helm chart (deploy/helm/clrbpf): helm lint --strict, golden
    /// renders, Kubernetes 1.28-1.34 schemas, security invariants.
    ChartTest {
        /// Rewrite the golden renders in deploy/helm/golden/ (review the diff)
        #[arg(long)]
        update: bool,
    },
    /// Build the release in target/dist/: a static clrbpf (musl, eBPF
    /// object embedded), clrbpf-<version>-x86_64-linux.tar.gz, the image of
    /// the Dockerfile as an OCI archive (buildah), SHA256SUMS.
    Dist {
        /// Only the binary, the tarball and its checksum
        #[arg(long)]
        no_image: bool,
    },
    /// Compile tests/workloads/*.cs into tests/workloads/bin/{net8,netcore31}/.
    Workloads,
    /// Run every check CI runs: fmt, clippy, unit tests, privileged
    /// integration tests (needs root).
    Test,
    /// Profile a bundled .NET workload; writes profile.pb.gz and
    /// flamegraph.svg and prints the top functions (needs root).
    Demo,
    /// Measure the budgets of docs/performance.md (throughput loss next to perf, BPF
    /// time per sample, CPU and memory of clrbpf, perf map load time) and
    /// print one table (needs root).
    Bench,
    /// Run each cargo-fuzz target of fuzz/ briefly (nightly; installs
    /// cargo-fuzz, seeds the corpora from real files). `test` runs those of
    /// clrbpf-parse for 10 s each.
    Fuzz {
        /// Seconds per target
        #[arg(long, default_value_t = 30)]
        seconds: u32,
        /// Targets to run [default: all]
        targets: Vec<String>,
    },
    /// List production functions over 120 lines and files over 1,200
    /// lines in profiler/src and profiler-parse/src (test code excluded);
    /// fails when there is one.
    Limits,
}

/// Where things are in the repository.
struct Repo {
    root: PathBuf,
    target: PathBuf,
}

impl Repo {
    fn locate() -> anyhow::Result<Self> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .ok_or_else(|| anyhow!("xtask/ has no parent directory"))?
            .to_path_buf();
        let target = match env::var_os("CARGO_TARGET_DIR") {
            Some(dir) => root.join(dir),
            None => root.join("target"),
        };
        Ok(Self { root, target })
    }

    fn runtimes_dir(&self) -> PathBuf {
        self.target.join("runtimes")
    }

    fn clrbpf_bin(&self) -> PathBuf {
        self.target.join("release").join("clrbpf")
    }

    fn workloads_src(&self) -> PathBuf {
        self.root.join("tests").join("workloads")
    }

    fn workloads_bin(&self) -> PathBuf {
        self.workloads_src().join("bin")
    }

    /// `cargo`, run from the repository root.
    fn cargo(&self) -> Command {
        // The cargo that runs xtask, so the toolchain stays the same.
        let mut cargo = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        cargo.current_dir(&self.root);
        cargo
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = Repo::locate().and_then(|repo| match cli.task {
        Task::Setup { runtimes_dir } => {
            let dir = match runtimes_dir {
                Some(dir) => std::path::absolute(&dir)
                    .with_context(|| format!("resolve {}", dir.display()))?,
                None => repo.runtimes_dir(),
            };
            setup::run(&dir)?;
            chart::tools(&repo).map(drop)
        }
        Task::Build => build(&repo),
        Task::ChartTest { update } => chart::test(&repo, update),
        Task::Dist { no_image } => {
            setup::run(&repo.runtimes_dir())?;
            let image = if no_image {
                dist::Image::Skip
            } else {
                dist::Image::Build
            };
            dist::run(&repo, image).map(drop)
        }
        Task::Workloads => workloads(&repo),
        Task::Test => test(&repo),
        Task::Demo => demo(&repo),
        Task::Bench => bench(&repo),
        Task::Fuzz { seconds, targets } => fuzz::run(&repo, &targets, seconds),
        Task::Limits => limits(&repo),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn build(repo: &Repo) -> anyhow::Result<()> {
    setup::run(&repo.runtimes_dir())?;
    build_release(repo)
}

/// The release binary, with the real eBPF object even when the caller's
/// shell exports AYA_BUILD_SKIP for quick checks.
fn build_release(repo: &Repo) -> anyhow::Result<()> {
    cmd::run(
        repo.cargo()
            .args(["build", "--release", "--package", "clrbpf"])
            .env_remove(ENV_AYA_BUILD_SKIP),
    )
    .context("build target/release/clrbpf")?;
    println!("build: {}", repo.clrbpf_bin().display());
    Ok(())
}

/// `cargo xtask limits`: the production code's function and file sizes.
fn limits(repo: &Repo) -> anyhow::Result<()> {
    ["profiler/src", "profiler-parse/src"]
        .iter()
        .try_for_each(|src| limits::check(&repo.root.join(src)))
}

fn workloads(repo: &Repo) -> anyhow::Result<()> {
    setup::run(&repo.runtimes_dir())?;
    workloads::build(&repo.workloads_src())
}

fn test(repo: &Repo) -> anyhow::Result<()> {
    setup::run(&repo.runtimes_dir())?;
    // Cheapest check first.
    step("format", repo.cargo().args(["fmt", "--all", "--check"]))?;
    println!("test: step limits");
    limits(repo)?;
    println!("test: step chart");
    chart::test(repo, false)?;
    build_release(repo)?;
    workloads::build(&repo.workloads_src())?;
    // Linting it needs nightly and build-std:
    // cargo +nightly clippy -p clrbpf-ebpf --target bpfel-unknown-none -Z build-std=core
    println!(
        "test: clippy skips clrbpf-ebpf: it only builds for bpfel-unknown-none (the release build above compiles it)"
    );
    step(
        "clippy",
        repo.cargo()
            .args(["clippy", "--workspace", "--exclude", "clrbpf-ebpf"])
            .args(["--all-targets", "--", "-D", "warnings"])
            .env(ENV_AYA_BUILD_SKIP, "1"),
    )?;
    step(
        "unit tests",
        repo.cargo().arg("test").env(ENV_AYA_BUILD_SKIP, "1"),
    )?;
    println!("test: step fuzz (the parsers of clrbpf-parse)");
    fuzz::test(repo)?;
    // The library's own tests that need root (a tmpfs mount, another
    // user's files, priorities) or `go tool pprof`: marked #[ignore] so a
    // plain `cargo test` runs anywhere. Tests against real .NET runtimes
    // live in tests/ (the integration tests below).
    step(
        "privileged unit tests",
        repo.cargo()
            // The same packages as `cargo test` above (only clrbpf has
            // ignored tests), so their features, and the build, are shared.
            .args(["test", "--lib", "--"])
            .args(["--ignored", "--test-threads=1"])
            .env(ENV_AYA_BUILD_SKIP, "1"),
    )?;
    let dotnet8 = setup::NET8.host_in(&repo.runtimes_dir());
    let dotnet31 = setup::NETCORE31.host_in(&repo.runtimes_dir());
    let python = chart::tools(repo)?;
    step(
        "integration tests",
        repo.cargo()
            .args(["test", "--package", "clrbpf-integration-tests", "--release"])
            .args(["--", "--test-threads=1"])
            .env_remove(ENV_AYA_BUILD_SKIP)
            .env(ENV_TEST_PYTHON, python)
            .env(ENV_BIN, repo.clrbpf_bin())
            .env(ENV_DOTNET8, dotnet8)
            .env(ENV_DOTNET31, dotnet31)
            .env(ENV_WORKLOADS, repo.workloads_bin()),
    )?;
    println!("test: every step passed");
    Ok(())
}

fn step(name: &str, cmd: &mut Command) -> anyhow::Result<()> {
    println!("test: step {name}");
    cmd::run(cmd).with_context(|| format!("test step `{name}` failed"))
}

fn demo(repo: &Repo) -> anyhow::Result<()> {
    setup::run(&repo.runtimes_dir())?;
    build_release(repo)?;
    workloads::build(&repo.workloads_src())?;
    let dotnet8 = setup::NET8.host_in(&repo.runtimes_dir());
    let demo_dll = repo.workloads_bin().join("net8").join("Demo.dll");
    for output in ["profile.pb.gz", "flamegraph.svg"] {
        cmd::run(
            Command::new(repo.clrbpf_bin())
                .current_dir(&repo.root)
                .args(["record", "-F", "99", "-o", output, "--"])
                .arg(&dotnet8)
                .arg(&demo_dll)
                .arg("10"),
        )
        .context("profile the demo workload (clrbpf needs root)")?;
    }
    cmd::run(Command::new("go").current_dir(&repo.root).args([
        "tool",
        "pprof",
        "-top",
        "-nodecount=15",
        "profile.pb.gz",
    ]))?;
    println!(
        "demo: wrote {} and {}; explore with `go tool pprof -http=: profile.pb.gz`",
        repo.root.join("profile.pb.gz").display(),
        repo.root.join("flamegraph.svg").display()
    );
    Ok(())
}

fn bench(repo: &Repo) -> anyhow::Result<()> {
    setup::run(&repo.runtimes_dir())?;
    build_release(repo)?;
    workloads::build(&repo.workloads_src())?;
    // The micro-benchmarks: a dev-only example, so their code stays out of
    // the shipped binary. It loads no BPF: no eBPF object needed.
    cmd::run(
        repo.cargo()
            .args(["build", "--release", "--package", "clrbpf"])
            .args(["--features", "bench", "--example", "bench"])
            .env(ENV_AYA_BUILD_SKIP, "1"),
    )
    .context("build the bench example")?;
    let dotnet8 = setup::NET8.host_in(&repo.runtimes_dir());
    let scratch = bench::scratch_dir(&repo.target);
    bench::run(&bench::BenchInputs {
        repo_root: &repo.root,
        clrbpf: &repo.clrbpf_bin(),
        micro_benches: &repo.target.join("release/examples/bench"),
        dotnet8: &dotnet8,
        workloads: &repo.workloads_bin(),
        scratch: &scratch,
    })
}
