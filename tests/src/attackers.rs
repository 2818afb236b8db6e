//! The hostile tenants of issue 33 as the tests start them: unprivileged
//! processes ([`NOBODY`]) built to hurt a root profiler, shared by the
//! tests that run one of them against `record` and the one that runs them
//! all at once beside the agent.
//!
//! - [`build_crafted_code_heap`]: frames costly to name from memory
//!   (`fakes/crafted_code_heap.c`);
//! - [`memory_hog`]: a huge maps file, a sparse PE (`fakes/memory_hog.py`);
//! - [`hostile_files`]: a sparse `libcoreclr.so`, a swapped directory
//!   (`fakes/hostile_files.py`);
//! - [`event_attacker`]: crafted CLR events from a stand-in .NET 9 runtime
//!   (`fakes/fake_dotnet9.py`).

use std::{
    ffi::OsString,
    fs,
    os::unix::fs::{PermissionsExt as _, chown},
    path::{Path, PathBuf},
    process::Command,
};

use crate::{TempDir, TestProcess};

/// `nobody`: a user with no rights on anything of the apps' or clrbpf's.
pub const NOBODY: u32 = 65534;

/// The crafted allocation events: each claims u64::MAX bytes.
pub const ALLOCATION_EVENTS: i128 = 2;

/// Waits of the scenario that have a Start and a Stop (the Stop alone
/// stands for none).
pub const PAIRED_WAITS: i128 = 5;

/// The crafted exception types, each thrown once.
pub const EXCEPTION_TYPES: [&str; 2] = ["Evil.AException", "Evil.BException"];

/// The scenario: two ContentionStops of 2^63 ns on two threads,
/// [`ALLOCATION_EVENTS`] allocation ticks of u64::MAX bytes on two others,
/// the crafted waits ([`hostile_waits`]) and exceptions against a counter
/// of u64::MAX a second.
fn hostile_scenario(dir: &TempDir) -> PathBuf {
    let path = dir.join("contention.json");
    let stack = r#"["void [Evil] Evil.Program::Spin()[Optimized]"]"#;
    let mut events: Vec<String> = [(21, 1_000_000), (22, 2_000_000)]
        .iter()
        .map(|(tid, at)| {
            format!(
                r#"{{"tid": {tid}, "at_ns": {at}, "kind": "contention_stop", "duration_ns": 9223372036854775808, "stack": {stack}}}"#
            )
        })
        .collect();
    events.extend([(23, 1_500_000), (24, 2_500_000)].iter().map(|(tid, at)| {
        format!(
            r#"{{"tid": {tid}, "at_ns": {at}, "kind": "allocation", "amount": {}, "object_size": 24, "type": "Evil.Blob", "stack": {stack}}}"#,
            u64::MAX
        )
    }));
    events.extend(hostile_waits(stack));
    events.extend(EXCEPTION_TYPES.iter().zip([41, 42]).map(|(ty, tid)| {
        format!(
            r#"{{"tid": {tid}, "at_ns": 1200000, "kind": "exception", "type": "{ty}", "message": "once", "stack": {stack}}}"#
        )
    }));
    fs::write(
        &path,
        format!(
            r#"{{"end": "stop", "counters": {{"exception-count": {}.0}}, "events": [{}]}}"#,
            u64::MAX,
            events.join(", ")
        ),
    )
    .expect("write the scenario");
    path
}

/// WaitHandleWait events: a wait of 2^63 ns (tid 31: its Start at the
/// lowest timestamp, its Stop at the highest; timestamps are signed 64-bit
/// ticks), one that began at timestamp 0, before the machine booted (32),
/// one whose Stop is stamped 146 years on (35, then a wait of the present
/// on 36 that must not wait for that window), a Stop with no Start (33),
/// and a Stop stamped before its Start (34). `at_ns` orders them in the
/// stream; `at_abs_ns` is a timestamp of the attacker's choosing.
fn hostile_waits(stack: &str) -> Vec<String> {
    let wait = |tid: u32, at: u64, kind: &str, abs: Option<u64>| {
        let abs = abs
            .map(|t| format!(r#", "at_abs_ns": {t}"#))
            .unwrap_or_default();
        format!(r#"{{"tid": {tid}, "at_ns": {at}, "kind": "{kind}"{abs}, "stack": {stack}}}"#)
    };
    vec![
        wait(31, 1_000_000, "start", Some(1 << 63)),
        wait(31, 2_000_000, "stop", Some((1 << 63) - 1)),
        wait(32, 1_100_000, "start", Some(0)),
        wait(32, 3_000_000, "stop", None),
        wait(33, 4_000_000, "stop", None),
        wait(34, 5_000_000, "start", None),
        wait(34, 5_500_000, "stop", Some(1)),
        wait(35, 6_000_000, "start", None),
        wait(35, 6_500_000, "stop", Some(1 << 62)),
        wait(36, 7_000_000, "start", None),
        wait(36, 7_500_000, "stop", None),
    ]
}

/// The event attacker: the stand-in .NET 9 runtime
/// (`fakes/fake_dotnet9.py`) sending [`hostile_scenario`], run as
/// [`NOBODY`] with its files in a directory of its own below `dir`,
/// living 120 s.
pub fn event_attacker(dir: &TempDir) -> TestProcess {
    let scenario = hostile_scenario(dir);
    let own = dir.join("attacker");
    fs::create_dir_all(&own).expect("create the attacker's directory");
    // SAFETY: chown has no memory preconditions; the path is a C string.
    let path = std::ffi::CString::new(own.as_os_str().as_encoded_bytes()).expect("no NUL");
    assert_eq!(unsafe { libc::chown(path.as_ptr(), NOBODY, NOBODY) }, 0);
    for p in [dir.path(), scenario.as_path()] {
        let mode = if p.is_dir() { 0o755 } else { 0o644 };
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fakes")
        .join("fake_dotnet9.py");
    let argv: Vec<OsString> = vec![
        "/usr/bin/python3".into(),
        script.into_os_string(),
        scenario.into_os_string(),
        "120".into(),
        own.into_os_string(),
    ];
    TestProcess::start_as_user("hostile .NET (contention)", &argv, NOBODY)
}

/// Builds the crafted code heap (`fakes/crafted_code_heap.c`, with gcc)
/// into `dir`: its binary and its framework directory.
pub fn build_crafted_code_heap(dir: &Path) -> (PathBuf, PathBuf) {
    let framework = dir.join("shared/Microsoft.NETCore.App/7.0.99");
    fs::create_dir_all(&framework).expect("create the framework directory");
    let library = dir.join("libcoreclr.c");
    fs::write(
        &library,
        "#include <stdint.h>\nuint64_t g_dacTable[64];\n\
         const char version[] __attribute__((used)) = \"@(#)Version 7.0.99.1 @Commit: crafted\";\n",
    )
    .expect("write the library's source");
    fs::write(framework.join("System.Private.CoreLib.dll"), [0u8; 8192]).expect("write CoreLib");
    let gcc = |args: &[&OsString]| {
        let status = Command::new("gcc")
            .args(args)
            .status()
            .expect("run gcc (is it installed?)");
        assert!(status.success(), "gcc {args:?} failed");
    };
    let os = |p: &Path| p.as_os_str().to_owned();
    gcc(&[
        &"-shared".into(),
        &"-fPIC".into(),
        &"-o".into(),
        &os(&framework.join("libcoreclr.so")),
        &os(&library),
    ]);
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fakes/crafted_code_heap.c");
    let binary = dir.join("crafted_code_heap");
    gcc(&[
        &"-O1".into(),
        &"-pthread".into(),
        &"-o".into(),
        &os(&binary),
        &os(&source),
        &"-ldl".into(),
    ]);
    (binary, framework)
}

/// The crafted code heap built by [`build_crafted_code_heap`], as
/// [`NOBODY`], living 300 s.
pub fn start_crafted_code_heap(binary: &Path, framework: &Path) -> TestProcess {
    let argv: Vec<OsString> = vec![binary.into(), "300".into(), framework.into(), "list".into()];
    TestProcess::start_as_user("crafted code heap", &argv, NOBODY)
}

/// `fakes/memory_hog.py ATTACK SIZE` as `user`, living `seconds`.
pub fn memory_hog(attack: &str, size: u32, seconds: u32, user: u32) -> TestProcess {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fakes")
        .join("memory_hog.py");
    TestProcess::start_as_user(
        &format!("memory hog ({attack})"),
        &[
            "/usr/bin/python3".into(),
            script.into_os_string(),
            attack.into(),
            size.to_string().into(),
            seconds.to_string().into(),
        ],
        user,
    )
}

/// `fakes/hostile_files.py ARGS...` as [`NOBODY`].
pub fn hostile_files(args: &[OsString]) -> TestProcess {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fakes")
        .join("hostile_files.py");
    let mut argv: Vec<OsString> = vec!["/usr/bin/python3".into(), script.into_os_string()];
    argv.extend(args.iter().cloned());
    TestProcess::start_as_user("hostile files", &argv, NOBODY)
}

/// A directory [`NOBODY`] owns, below the test's own.
pub fn attacker_dir(dir: &TempDir, name: &str) -> PathBuf {
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = dir.join(name);
    fs::create_dir_all(&path).expect("mkdir");
    chown(&path, Some(NOBODY), Some(NOBODY)).expect("chown");
    path
}
