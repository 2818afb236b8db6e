//! Native frames of a stripped library, named from its debug file or
//! honestly grouped (issue 35). A .NET 8 workload (`NativeHot`) calls a C
//! library of the test's own (`tests/fakes/nativehot.c`) through P/Invoke;
//! the library is built with `-g`, its debug info split off with
//! `objcopy --only-keep-debug` and the library stripped, as Microsoft ships
//! libcoreclr. One workload run, recorded three times with `record -p`:
//! 1. no debug file: the library's static functions are one
//!    `[libnativehot.so]` frame per run, and the pprof file keeps the
//!    library's build id and the addresses, which `eu-addr2line` (an
//!    independent reader) names from the debug file as the hot functions;
//! 2. `--debug-dir` in the build-id layout (`.build-id/xx/rest.debug`);
//! 3. `--debug-dir` in the symbol-store layout `dotnet-symbol` writes
//!    (`libnativehot.so.dbg/elf-buildid-sym-<id>/libnativehot.so.dbg`):
//!    the hot functions are named.
//!
//! Run by `cargo xtask test` (root, one test at a time).

use std::path::Path;

use clrbpf::symbolize::{debug_file, debug_lookup};
use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess,
    native_lib::{CALLER, ENTRY, INNER, LIBRARY, OUTER, build_split_library, place, run},
    read_profile, record_pid, samples, string,
};

/// The function `eu-addr2line` names at virtual offset `vaddr` of `dbg`.
fn addr2line(dbg: &Path, vaddr: u64) -> String {
    let out = run(
        "eu-addr2line",
        &[
            "-f".as_ref(),
            "-e".as_ref(),
            dbg.as_os_str(),
            format!("0x{vaddr:x}").as_ref(),
        ],
    );
    out.lines().next().unwrap_or("").trim().to_owned()
}

#[test]
fn a_stripped_library_is_grouped_without_its_debug_file_and_named_with_it() {
    let env = Env::privileged();
    let dir = TempDir::new("native-debug");
    let (lib, dbg, build_id) = build_split_library(dir.path());
    let by_build_id = dir.join("by-build-id");
    place(
        &dbg,
        &by_build_id,
        &debug_file::build_id_path(&build_id).expect("a build-id path"),
    );
    let store = dir.join("store");
    let [key, _] = debug_file::symbol_store_keys(LIBRARY, &build_id).expect("store keys");
    place(&dbg, &store, Path::new(&key));

    let lib_dir = dir.path().to_string_lossy().into_owned();
    let workload = TestProcess::launch(
        &env,
        Runtime::Net8,
        "NativeHot",
        &["60"],
        &Launch {
            env: &[("LD_LIBRARY_PATH", &lib_dir)],
            ..Launch::default()
        },
    );
    let pid = workload.pid();

    // 1. No debug file anywhere.
    let (_, path) = record_pid(&env, &dir, pid, &["-d", "3s"], "plain.pb.gz");
    let profile = read_profile(&path);
    let group = format!("[{LIBRARY}]");
    let ours: Vec<_> = samples(&profile)
        .into_iter()
        .filter(|s| s.pid() == Some(pid) && s.frames.iter().any(|f| f == &group))
        .collect();
    let weight = |s: &clrbpf_integration_tests::SampleView| s.values.first().copied().unwrap_or(0);
    let in_group: i64 = ours.iter().map(weight).sum();
    assert!(
        in_group >= 10,
        "samples in {group}: {in_group}, in {} stacks of {}",
        ours.len(),
        profile.sample.len()
    );
    for sample in &ours {
        assert!(
            !sample
                .frames
                .windows(2)
                .any(|w| w[0] == group && w[1] == group),
            "one {group} frame per run: {:?}",
            sample.frames
        );
        assert!(
            !sample.frames.iter().any(|f| f == INNER || f == OUTER),
            "nothing names the static functions without the debug file: {:?}",
            sample.frames
        );
    }
    assert!(
        ours.iter()
            .any(|s| s.stack_contains(&[&group, ENTRY, CALLER])),
        "the run sits under the exported entry and the managed caller: {:?}",
        ours.first().map(|s| &s.frames)
    );
    let mapping = profile
        .mapping
        .iter()
        .find(|m| string(&profile, m.filename).ends_with(LIBRARY))
        .expect("a mapping of the library");
    assert_eq!(string(&profile, mapping.build_id), build_id);
    assert!(
        !mapping.has_functions,
        "a mapping with placeholder frames does not claim functions, so a reader names them"
    );
    // The locations keep their addresses: the debug file names them.
    let group_function = profile
        .function
        .iter()
        .find(|f| string(&profile, f.name) == group)
        .expect("the group's function")
        .id;
    let file = std::fs::File::open(&lib).expect("open the library");
    let segments =
        debug_file::load_segments(&mut debug_lookup::FileAt(&file)).expect("program headers");
    let mut names = std::collections::BTreeSet::new();
    for location in profile
        .location
        .iter()
        .filter(|l| l.line.iter().any(|line| line.function_id == group_function))
    {
        let m = profile
            .mapping
            .iter()
            .find(|m| m.id == location.mapping_id)
            .expect("the location's mapping");
        assert_eq!(string(&profile, m.build_id), build_id);
        let offset = location.address - m.memory_start + m.file_offset;
        let vaddr = debug_file::virtual_offset(&segments, offset).expect("in a segment");
        names.insert(addr2line(&dbg, vaddr));
    }
    assert!(
        names.contains(INNER),
        "eu-addr2line names the grouped addresses: {names:?}"
    );
    assert!(
        names.iter().all(|n| n == INNER || n == OUTER),
        "every grouped address is a static function: {names:?}"
    );

    // 2 and 3. A --debug-dir in each layout.
    for (layout, debug_dir) in [("build-id", &by_build_id), ("symbol store", &store)] {
        let file = format!("{}.pb.gz", layout.replace(' ', "-"));
        let flags = [
            "-d",
            "3s",
            "--debug-dir",
            debug_dir.to_str().expect("utf-8"),
        ];
        let (_, path) = record_pid(&env, &dir, pid, &flags, &file);
        let profile = read_profile(&path);
        let ours: Vec<_> = samples(&profile)
            .into_iter()
            .filter(|s| s.pid() == Some(pid))
            .collect();
        let named: i64 = ours
            .iter()
            .filter(|s| s.stack_contains(&[INNER, OUTER, ENTRY, CALLER]))
            .map(weight)
            .sum();
        assert!(
            named >= 10,
            "{layout}: {named} samples named through the debug file"
        );
        assert!(
            !ours.iter().any(|s| s.frames.contains(&group)),
            "{layout}: no {group} frame left"
        );
    }
    drop(workload);
}

/// Whether a folded frame is a bare address: `0x7f...`, or a module and an
/// offset (`libcoreclr.so+0x1f2e0`) that the flame graph would show as is.
fn is_bare_address(frame: &str) -> bool {
    let frame = frame.trim();
    frame.starts_with("0x") || frame.contains("+0x")
}

/// The demo as `cargo xtask demo` runs it (launch mode, 99 Hz, the Demo
/// workload, no debug file for the runtime): no frame of its folded stacks
/// (the flame graph's rows) is a bare address; the runtime's frames no
/// symbol names are one `[libcoreclr.so]` frame per run, and the summary
/// names the runtime modules that had no debug file and how to get them.
#[test]
fn the_demo_shows_no_bare_address_and_says_which_modules_had_no_debug_file() {
    let env = Env::privileged();
    let dir = TempDir::new("demo-names");
    let folded = dir.join("demo.folded");
    let mut args = vec![
        "record".to_owned(),
        "-F".to_owned(),
        "99".to_owned(),
        "-o".to_owned(),
        folded.to_string_lossy().into_owned(),
        "--".to_owned(),
    ];
    args.extend(env.workload_command(Runtime::Net8, "Demo", &["4"]));
    let output = clrbpf_integration_tests::run_clrbpf(
        &env,
        &args,
        dir.path(),
        std::time::Duration::from_secs(60),
    );
    clrbpf_integration_tests::assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let text = std::fs::read_to_string(&folded).expect("the folded stacks");
    let stacks = clrbpf_integration_tests::parse_folded(&text);
    let total: u64 = stacks.iter().map(|(_, n)| n).sum();
    assert!(total >= 100, "only {total} samples of the demo:\n{stderr}");
    let bare: Vec<&String> = stacks
        .iter()
        .flat_map(|(frames, _)| frames)
        .filter(|f| is_bare_address(f))
        .collect();
    assert!(
        bare.is_empty(),
        "{} bare-address frames in the demo's stacks, first: {:?}",
        bare.len(),
        &bare[..bare.len().min(10)]
    );
    assert!(
        stacks
            .iter()
            .any(|(frames, _)| frames.iter().any(|f| f == "[libcoreclr.so]")),
        "no [libcoreclr.so] group in the demo's stacks"
    );
    let line = clrbpf_integration_tests::summary_line(&stderr, "clrbpf: no debug file for ");
    assert!(
        line.contains("libcoreclr.so (") && line.contains("dotnet-symbol"),
        "the summary does not name libcoreclr.so among the files without debug info: {line}"
    );
}

#[test]
fn bare_addresses_are_told_from_names() {
    assert!(is_bare_address("libcoreclr.so+0x1f2e0"));
    assert!(is_bare_address("0x7f0012345678"));
    assert!(!is_bare_address("[libcoreclr.so]"));
    assert!(!is_bare_address("Demo.Hash"));
}
