use which::which;

/// Rebuild the eBPF object when bpf-linker changes: a new linker can emit a
/// different object from the same source.
fn main() {
    let bpf_linker =
        which("bpf-linker").expect("bpf-linker not found in PATH: run `cargo xtask setup`");
    println!(
        "cargo:rerun-if-changed={}",
        bpf_linker.to_str().expect("bpf-linker path is UTF-8")
    );
}
