//! `cargo xtask fuzz`: runs every cargo-fuzz target of `fuzz/` for a short
//! while, one after the other, the parsers of what a target process
//! controls (perf maps, jitdump, nettrace, event payloads, IPC replies,
//! assembly files, runtime memory, JIT code). A smoke run, not a campaign:
//! it installs cargo-fuzz when missing, seeds each corpus from real files
//! the first time (small framework assemblies, the workloads, captured
//! streams and perf maps), and stops at the first crash, leak of time or
//! memory with the input libFuzzer saved under `fuzz/artifacts/<target>/`.
//!
//! `cargo xtask test` runs the targets of `clrbpf-parse`
//! ([`PARSER_TARGETS`], [`TEST_SECONDS`] each): they build without the
//! profiler crate, in about a minute. The targets over parsers still in
//! the profiler ([`PROFILER_TARGETS`]) build the whole crate with
//! sanitizers (many minutes), so only `cargo xtask fuzz` runs them.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::{Repo, cmd, setup};

/// The targets of `fuzz/Cargo.toml` that depend on `clrbpf-parse` alone.
pub const PARSER_TARGETS: &[&str] = &[
    "ipc_reply",
    "clr_event_payload",
    "native_format",
    "clr_metadata",
    "perf_map",
    "jitdump",
    "nettrace",
];
/// The targets that need its feature `profiler` (the whole clrbpf crate).
pub const PROFILER_TARGETS: &[&str] = &[
    "debug_file",
    "ready_to_run_names",
    "ready_to_run",
    "clr_memory",
    "runtime_image",
    "jit_prologue",
];
/// Seconds each of [`PARSER_TARGETS`] runs in `cargo xtask test`.
pub const TEST_SECONDS: u32 = 5;

/// The largest seed file copied into a corpus: big inputs slow every run.
const MAX_SEED_BYTES: u64 = 64 * 1024;
/// Framework assemblies used as seeds when present (ReadyToRun code,
/// metadata, method entry points): small ones, of both runtimes.
const FRAMEWORK_SEEDS: &[&str] = &[
    "System.Diagnostics.StackTrace.dll",
    "System.Reflection.TypeExtensions.dll",
    "System.Web.HttpUtility.dll",
    "System.Runtime.dll",
];

/// Runs `targets` (all when empty) `seconds` each.
pub fn run(repo: &Repo, targets: &[String], seconds: u32) -> anyhow::Result<()> {
    let known = || PARSER_TARGETS.iter().chain(PROFILER_TARGETS);
    let unknown: Vec<&String> = targets
        .iter()
        .filter(|t| !known().any(|k| k == t))
        .collect();
    if !unknown.is_empty() {
        bail!("unknown fuzz targets {unknown:?}; known: {PARSER_TARGETS:?} {PROFILER_TARGETS:?}");
    }
    let targets: Vec<&str> = if targets.is_empty() {
        known().copied().collect()
    } else {
        targets.iter().map(String::as_str).collect()
    };
    run_targets(repo, &targets, seconds)
}

/// The step of `cargo xtask test`: every target of `clrbpf-parse`,
/// [`TEST_SECONDS`] each.
pub fn test(repo: &Repo) -> anyhow::Result<()> {
    run_targets(repo, PARSER_TARGETS, TEST_SECONDS)
}

fn run_targets(repo: &Repo, targets: &[&str], seconds: u32) -> anyhow::Result<()> {
    // The same features for the build and every run, so no run rebuilds.
    let features: &[&str] = if targets.iter().any(|t| PROFILER_TARGETS.contains(t)) {
        &["--features", "profiler"]
    } else {
        &[]
    };
    cargo_fuzz(repo)?;
    let fuzz_dir = repo.root.join("fuzz");
    for target in targets {
        let corpus = fuzz_dir.join("corpus").join(target);
        fs::create_dir_all(&corpus).with_context(|| format!("create {}", corpus.display()))?;
        seed(repo, target, &corpus)?;
    }
    // `cargo` through rustup (not the toolchain's own binary xtask runs
    // with), so `+nightly` picks the toolchain cargo-fuzz needs.
    cmd::run(
        Command::new("cargo")
            .current_dir(&fuzz_dir)
            .args(["+nightly", "fuzz", "build"])
            .args(features)
            .env(crate::ENV_AYA_BUILD_SKIP, "1"),
    )
    .context("build the fuzz targets")?;
    for target in targets {
        println!("fuzz: {target}, {seconds} s");
        cmd::run(
            Command::new("cargo")
                .current_dir(&fuzz_dir)
                .args(["+nightly", "fuzz", "run"])
                .args(features)
                .args([target, "--"])
                .arg(format!("-max_total_time={seconds}"))
                // A hostile input must not make a parser slow or greedy:
                // one input taking 10 s, or one allocation of 512 MiB, is
                // a finding (libFuzzer's RSS limit stays at 2 GiB).
                .args(["-timeout=10", "-malloc_limit_mb=512"])
                .env(crate::ENV_AYA_BUILD_SKIP, "1"),
        )
        .with_context(|| {
            format!("fuzz target {target} found a problem: see fuzz/artifacts/{target}/")
        })?;
    }
    println!(
        "fuzz: {} targets ran {seconds} s each, nothing found",
        targets.len()
    );
    Ok(())
}

/// Installs cargo-fuzz when `cargo +nightly fuzz` is missing.
fn cargo_fuzz(repo: &Repo) -> anyhow::Result<()> {
    let present = cmd::probe(Command::new("cargo").args(["+nightly", "fuzz", "--version"]));
    if present.is_none() {
        cmd::run(repo.cargo().args(["install", "cargo-fuzz", "--locked"]))
            .context("install cargo-fuzz")?;
    }
    Ok(())
}

/// Copies real inputs of `target`'s kind into an empty `corpus`.
fn seed(repo: &Repo, target: &str, corpus: &Path) -> anyhow::Result<()> {
    let empty = fs::read_dir(corpus)
        .with_context(|| format!("read {}", corpus.display()))?
        .next()
        .is_none();
    if !empty {
        return Ok(());
    }
    let parse = repo.root.join("profiler-parse/src");
    let testdata = parse.join("nettrace/testdata");
    let mut seeds: Vec<(PathBuf, &[u8])> = Vec::new();
    match target {
        "clr_metadata" | "ready_to_run_names" | "ready_to_run" => {
            seeds.push((parse.join("clr_metadata/testdata/Names.dll"), b""));
            for name in ["Ratio.dll", "Demo.dll"] {
                seeds.push((repo.workloads_bin().join("net8").join(name), b""));
            }
            for dir in framework_dirs(repo) {
                seeds.extend(FRAMEWORK_SEEDS.iter().map(|f| (dir.join(f), &b""[..])));
            }
        }
        // The chunk targets take two bytes of seed first.
        "perf_map" => {
            for map in ["net8.perf.map", "netcore31.perf.map"] {
                seeds.push((testdata.join(map), b"\x07\x00"));
            }
        }
        // One byte of chunk seed, then the (uncompressed) stream.
        "nettrace" => {
            for capture in ["net8.nettrace.gz", "netcore31.counters.nettrace.gz"] {
                seeds.push((testdata.join(capture), b"\x02"));
            }
        }
        _ => {}
    }
    for (i, (path, prefix)) in seeds.iter().enumerate() {
        let Ok(mut bytes) = read_seed(path) else {
            continue;
        };
        bytes.splice(0..0, prefix.iter().copied());
        let name = format!("seed-{i}-{}", file_name(path));
        fs::write(corpus.join(&name), &bytes).with_context(|| format!("write seed {name}"))?;
    }
    if target == "ipc_reply" {
        for (i, reply) in ipc_replies().iter().enumerate() {
            let name = format!("seed-reply-{i}");
            fs::write(corpus.join(&name), reply).with_context(|| format!("write seed {name}"))?;
        }
    }
    Ok(())
}

/// Replies as a .NET 8 runtime writes them, each after the one byte of
/// read bound `ipc_reply` takes first: ProcessInfo2, an error HRESULT, a
/// session id, a status.
fn ipc_replies() -> Vec<Vec<u8>> {
    let reply = |id: u8, payload: &[u8]| {
        let size = u16::try_from(20 + payload.len()).expect("a small payload");
        let mut bytes = vec![0xFF];
        bytes.extend_from_slice(b"DOTNET_IPC_V1\0");
        bytes.extend_from_slice(&size.to_le_bytes());
        bytes.extend_from_slice(&[0xFF, id, 0, 0]);
        bytes.extend_from_slice(payload);
        bytes
    };
    let mut info = Vec::new();
    info.extend_from_slice(&4242u64.to_le_bytes());
    info.extend_from_slice(&[0xAB; 16]);
    for text in ["dotnet App.dll", "Linux", "x64", "App", "8.0.4+2d7eea25"] {
        let units: Vec<u16> = text.encode_utf16().chain([0]).collect();
        info.extend_from_slice(&(units.len() as u32).to_le_bytes());
        info.extend(units.iter().flat_map(|u| u.to_le_bytes()));
    }
    vec![
        reply(0x00, &info),
        reply(0xFF, &0x8013_1385u32.to_le_bytes()),
        reply(0x00, &0x7f00_1234_5678u64.to_le_bytes()),
        reply(0x00, &0u32.to_le_bytes()),
    ]
}

/// The shared framework directories of the runtimes `cargo xtask setup`
/// unpacks.
fn framework_dirs(repo: &Repo) -> Vec<PathBuf> {
    let runtimes = repo.runtimes_dir();
    [&setup::NET8, &setup::NETCORE31]
        .into_iter()
        .filter_map(|wheel| {
            let shared = wheel
                .host_in(&runtimes)
                .parent()?
                .join("shared/Microsoft.NETCore.App");
            let version = fs::read_dir(&shared).ok()?.flatten().next()?;
            Some(version.path())
        })
        .collect()
}

/// A seed's bytes, gunzipped when it ends in `.gz`, at most
/// [`MAX_SEED_BYTES`].
fn read_seed(path: &Path) -> anyhow::Result<Vec<u8>> {
    let mut bytes = if path.extension().is_some_and(|e| e == "gz") {
        let out = Command::new("gzip")
            .arg("-dc")
            .arg(path)
            .output()
            .with_context(|| format!("gunzip {}", path.display()))?;
        if !out.status.success() {
            bail!("gunzip {} failed ({})", path.display(), out.status);
        }
        out.stdout
    } else {
        fs::read(path).with_context(|| format!("read {}", path.display()))?
    };
    bytes.truncate(MAX_SEED_BYTES as usize);
    Ok(bytes)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lists here and the `[[bin]]` targets of fuzz/Cargo.toml are the
    /// same sets, so a new target is not left out of the smoke run, and
    /// exactly the targets of [`PROFILER_TARGETS`] need the profiler.
    #[test]
    fn every_fuzz_target_is_run() {
        let manifest = include_str!("../../fuzz/Cargo.toml");
        let mut parsers = Vec::new();
        let mut profiler = Vec::new();
        for bin in manifest.split("[[bin]]").skip(1) {
            let name = bin
                .lines()
                .find_map(|l| l.strip_prefix("name = \"")?.strip_suffix('"'))
                .expect("a named target");
            if bin.contains("required-features = [\"profiler\"]") {
                profiler.push(name);
            } else {
                parsers.push(name);
            }
        }
        for (declared, listed) in [(parsers, PARSER_TARGETS), (profiler, PROFILER_TARGETS)] {
            let mut declared = declared;
            declared.sort_unstable();
            let mut listed = listed.to_vec();
            listed.sort_unstable();
            assert_eq!(declared, listed);
        }
    }
}
