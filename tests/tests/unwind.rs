//! In-kernel DWARF unwinding, end to end: `clrbpf record` of programs whose
//! native code has no frame pointers, checked in the pprof it writes.
//!
//! Needs root, a kernel with BPF, the release build of `clrbpf` (with its
//! eBPF object), Debian's `xz`, and for the .NET test the runtime that
//! `cargo xtask setup` unpacks plus `mcs`. Self-contained (the shared
//! harness in `tests/src` was being written at the same time).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
};

use clrbpf::{export::pprof::read_pprof, pprof_proto::Profile};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the workspace")
        .to_path_buf()
}

fn clrbpf_binary() -> PathBuf {
    let path = workspace().join("target/release/clrbpf");
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --release -p clrbpf` first",
        path.display()
    );
    path
}

fn require_root() {
    // SAFETY: no arguments, no side effects.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "these tests load BPF programs: run them as root"
    );
}

/// Runs `clrbpf record -o <out> -- command...` and reads the profile.
fn record(out: &Path, command: &[&str], env: &[(&str, &str)]) -> Profile {
    let output = Command::new(clrbpf_binary())
        .args(["record", "-o"])
        .arg(out)
        .arg("--")
        .args(command)
        .envs(env.iter().copied())
        .output()
        .expect("run clrbpf record");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "clrbpf record failed:\n{stderr}");
    eprintln!("{stderr}");
    let bytes = std::fs::read(out).expect("read the profile");
    read_pprof(&bytes).expect("a valid pprof")
}

/// Each sample's stack as (function name, mapping file), leaf first, with
/// its sample count (pprof samples are aggregated by stack and labels).
fn stacks(profile: &Profile) -> Vec<(Vec<(String, String)>, u64)> {
    let strings = &profile.string_table;
    let s = |i: i64| strings.get(i as usize).cloned().unwrap_or_default();
    let functions: HashMap<u64, String> =
        profile.function.iter().map(|f| (f.id, s(f.name))).collect();
    let mappings: HashMap<u64, String> = profile
        .mapping
        .iter()
        .map(|m| (m.id, s(m.filename)))
        .collect();
    let locations: HashMap<u64, Vec<(String, String)>> = profile
        .location
        .iter()
        .map(|l| {
            let file = mappings.get(&l.mapping_id).cloned().unwrap_or_default();
            let names = if l.line.is_empty() {
                vec![(format!("{:#x}", l.address), file)]
            } else {
                l.line
                    .iter()
                    .map(|line| {
                        (
                            functions
                                .get(&line.function_id)
                                .cloned()
                                .unwrap_or_default(),
                            file.clone(),
                        )
                    })
                    .collect()
            };
            (l.id, names)
        })
        .collect();
    profile
        .sample
        .iter()
        .map(|sample| {
            let stack = sample
                .location_id
                .iter()
                .flat_map(|id| locations.get(id).cloned().unwrap_or_default())
                .collect();
            let count = sample.value.first().copied().unwrap_or(0).max(0) as u64;
            (stack, count)
        })
        .collect()
}

fn user_frames(stack: &[(String, String)]) -> usize {
    stack
        .iter()
        .filter(|(_, file)| !file.starts_with("[kernel"))
        .count()
}

/// Issue 3's acceptance: Debian's xz has no frame pointers (neither has
/// liblzma), so a frame-pointer walk gives one or two frames; the unwind
/// tables give the whole stack down to `_start`.
#[test]
fn xz_without_frame_pointers_has_deep_stacks() {
    require_root();
    let dir = std::env::temp_dir().join(format!("clrbpf-unwind-xz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    // Incompressible pseudo-random input keeps xz in its match finder and
    // range coder: a few seconds of CPU at -9.
    let input = dir.join("input.bin");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..12 << 20)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    std::fs::write(&input, data).expect("write input");
    let out = dir.join("xz.pb.gz");
    let input_arg = input.to_str().expect("utf-8 temp path");
    let profile = record(&out, &["xz", "-9", "-T1", "-k", "-f", input_arg], &[]);
    let stacks = stacks(&profile);
    // Samples of the xz process only (the launcher's own are filtered out
    // by the kernel side).
    let count = |keep: &dyn Fn(&[(String, String)]) -> bool| -> u64 {
        stacks.iter().filter(|(s, _)| keep(s)).map(|(_, n)| n).sum()
    };
    let total = count(&|_| true);
    assert!(total >= 100, "only {total} samples");
    let deep = count(&|s| user_frames(s) >= 4);
    let share = deep as f64 / total as f64;
    eprintln!(
        "{deep} of {total} samples have 4+ user frames ({:.1}%)",
        share * 100.0
    );
    assert!(
        share >= 0.8,
        "only {deep} of {total} samples have 4 or more user frames"
    );
    // And the walks reach the program's entry.
    let to_main = count(&|s| s.iter().any(|(f, _)| f.contains("__libc_start_main")));
    assert!(
        to_main as f64 >= 0.8 * total as f64,
        "only {to_main} of {total} stacks reach __libc_start_main"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
