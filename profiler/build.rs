//! Builds the two things `clrbpf` embeds: the eBPF object (through aya-build,
//! with the nightly toolchain and bpf-linker) and the pprof protobuf types
//! (through protox + prost-build, so no `protoc` binary is needed).

use std::{env, fs, path::PathBuf};

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

const EBPF_OBJECT: &str = "clrbpf";

fn main() -> anyhow::Result<()> {
    build_protos()?;
    build_ebpf()
}

fn build_protos() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=proto/profile.proto");
    let descriptors = protox::compile(["proto/profile.proto"], ["proto"])
        .context("compile proto/profile.proto")?;
    prost_build::Config::new()
        .compile_fds(descriptors)
        .context("generate pprof types")?;
    // Pyroscope's push API (the agent's Pyroscope sink).
    println!("cargo:rerun-if-changed=proto/pyroscope");
    let descriptors = protox::compile(
        ["push/v1/push.proto", "types/v1/types.proto"],
        ["proto/pyroscope"],
    )
    .context("compile the Pyroscope push protos")?;
    prost_build::Config::new()
        .compile_fds(descriptors)
        .context("generate Pyroscope push types")?;
    Ok(())
}

fn build_ebpf() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or_else(|| anyhow!("OUT_DIR not set"))?);
    let skip = env::var("AYA_BUILD_SKIP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    if skip {
        // `include_bytes_aligned!` needs a file even when the eBPF build is
        // skipped (cargo check, clippy, doc); an empty object becomes a clear
        // error at load time.
        println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
        fs::write(out_dir.join(EBPF_OBJECT), []).context("write empty eBPF placeholder")?;
        return Ok(());
    }
    let manifest_dir = PathBuf::from(
        env::var_os("CARGO_MANIFEST_DIR").ok_or_else(|| anyhow!("CARGO_MANIFEST_DIR not set"))?,
    );
    let ebpf_dir = manifest_dir
        .parent()
        .ok_or_else(|| anyhow!("profiler/ has no parent"))?
        .join("profiler-ebpf");
    let ebpf_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow!("non UTF-8 path {}", ebpf_dir.display()))?;
    println!("cargo:rerun-if-changed=../profiler-common/src");
    aya_build::build_ebpf(
        [Package {
            name: "clrbpf-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        Toolchain::default(),
    )
    .context("build the eBPF object (needs `cargo xtask setup`: nightly rust-src and bpf-linker)")
}
