//! The C library of the native debug-file tests (`fakes/nativehot.c`,
//! called by the `NativeHot` workload): built with `-g`, its debug info
//! split off and the library stripped, as Microsoft ships libcoreclr.

use std::path::{Path, PathBuf};
use std::process::Command;

use clrbpf::symbolize::debug_lookup;

/// The library as the workload loads it (through `LD_LIBRARY_PATH`).
pub const LIBRARY: &str = "libnativehot.so";
/// Its static (unexported) hot functions, leaf first.
pub const INNER: &str = "nativehot_mix_inner";
pub const OUTER: &str = "nativehot_mix_outer";
/// Exported, so named from the stripped library's dynamic symbols.
pub const ENTRY: &str = "nativehot_spin";
/// The managed method calling it.
pub const CALLER: &str = "NativeHot.CallNative";

/// Runs `program`, which must succeed; returns its stdout.
pub fn run(program: &str, args: &[&std::ffi::OsStr]) -> String {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program} (is it installed?): {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Builds the library into `dir`, splits its debug info off and strips
/// it: (library, debug file, build id).
pub fn build_split_library(dir: &Path) -> (PathBuf, PathBuf, String) {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fakes/nativehot.c");
    let lib = dir.join(LIBRARY);
    let dbg = dir.join(format!("{LIBRARY}.dbg"));
    run(
        "gcc",
        &[
            "-g".as_ref(),
            "-O1".as_ref(),
            "-fno-omit-frame-pointer".as_ref(),
            "-fno-optimize-sibling-calls".as_ref(),
            "-shared".as_ref(),
            "-fPIC".as_ref(),
            "-Wl,--build-id".as_ref(),
            "-o".as_ref(),
            lib.as_os_str(),
            source.as_os_str(),
        ],
    );
    run(
        "objcopy",
        &[
            "--only-keep-debug".as_ref(),
            lib.as_os_str(),
            dbg.as_os_str(),
        ],
    );
    run("strip", &["--strip-unneeded".as_ref(), lib.as_os_str()]);
    let build_id = std::fs::File::open(&lib)
        .ok()
        .and_then(|f| debug_lookup::build_id_of(&f))
        .expect("the library has a build id");
    (lib, dbg, build_id)
}

/// Copies `dbg` to `root/relative`.
pub fn place(dbg: &Path, root: &Path, relative: &Path) {
    let at = root.join(relative);
    std::fs::create_dir_all(at.parent().expect("a parent")).expect("create the layout");
    std::fs::copy(dbg, &at).expect("copy the debug file");
}
