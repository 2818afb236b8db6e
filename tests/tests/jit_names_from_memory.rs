//! JIT-compiled frames named from the runtime's memory: a .NET 8 process
//! started with `DOTNET_EnableDiagnostics=0` has no diagnostic socket, so
//! no perf map can be asked for and no events come; `record -p` must still
//! name its managed frames, by walking the runtime's code range map and
//! reading the method's metadata from its assembly file, and write nothing
//! into the target. Run by `cargo xtask test` (root, one test at a time).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use clrbpf::{
    clr::memory::names::JitMemoryNames,
    process::{MappingTable, ProcFs},
    symbolize::method_name::parse_method_name,
};
use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess, parse_value, read_profile, record_pid, samples,
    value_index,
};

/// A frame nothing named in memory no file backs (JIT code and stubs):
/// native code shows as `file+0x...` instead.
const UNNAMED_ANONYMOUS: &str = "[unknown]";

/// A frame the memory path named: a method of the workload, a stub or a
/// dynamic method.
fn named_jit(frame: &str) -> bool {
    frame.starts_with("Ratio.")
        || frame.starts_with("[stub: ")
        || frame.starts_with("dynamicClass.")
        || frame.starts_with("[dynamic method]")
}

#[test]
fn record_names_jit_frames_without_the_diagnostic_socket() {
    let env = Env::privileged();
    let dir = TempDir::new("jit-memory");
    let ratio = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Ratio",
        &["12"],
        &Launch {
            env: &[("DOTNET_EnableDiagnostics", "0")],
            ..Launch::default()
        },
    );
    let pid = ratio.pid();
    let socket_prefix = format!("dotnet-diagnostic-{pid}-");
    let has_socket = std::fs::read_dir("/tmp")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with(&socket_prefix));
    assert!(
        !has_socket,
        "pid {pid} has a diagnostic socket: the test needs none"
    );
    assert_jit_frames_named(&env, &dir, ratio, Path::new("/tmp"), "p.pb.gz");
}

/// The same app in a mount namespace whose `/tmp` is a read-only tmpfs (a
/// container with a read-only root and nothing mounted there): it can
/// write neither its socket nor a perf map, and says nothing; its JIT
/// frames are named all the same.
#[test]
fn record_names_jit_frames_of_a_process_with_a_read_only_tmp() {
    let env = Env::privileged();
    let dir = TempDir::new("jit-memory-read-only-tmp");
    let script = "mount -t tmpfs -o ro tmpfs /tmp && exec \"$0\" \"$@\"";
    let argv: Vec<std::ffi::OsString> = ["unshare", "--mount", "--propagation", "private"]
        .into_iter()
        .chain(["sh", "-c", script])
        .map(Into::into)
        .chain([
            env.dotnet(Runtime::Net8).as_os_str().to_owned(),
            env.workload(Runtime::Net8, "Ratio").into_os_string(),
            "12".into(),
        ])
        .collect();
    let ratio = TestProcess::start_as_user("Ratio", &argv, 0);
    let root_tmp = PathBuf::from(format!("/proc/{}/root/tmp", ratio.pid()));
    assert_jit_frames_named(&env, &dir, ratio, &root_tmp, "read-only-tmp.pb.gz");
}

/// Records the running Ratio app `ratio` with `record -p` and checks that
/// at least 95% of its main thread's JIT CPU is named, that the HotA/HotB
/// split is within 5 points of the app's own timing, and that no perf map
/// or jitdump appeared in `tmp` (its `/tmp`, from the host).
fn assert_jit_frames_named(env: &Env, dir: &TempDir, ratio: TestProcess, tmp: &Path, file: &str) {
    let pid = ratio.pid();
    // HotA and HotB are compiled and tiered up by now.
    std::thread::sleep(Duration::from_secs(2));
    let (_, output_path) = record_pid(env, dir, pid, &["-F", "499", "-d", "5"], file);
    for name in [format!("perf-{pid}.map"), format!("jit-{pid}.dump")] {
        let path = tmp.join(&name);
        assert!(
            !path.exists(),
            "{} exists: the memory path must write nothing into the target",
            path.display()
        );
    }
    let (_, lines) = ratio.wait(Duration::from_secs(60));
    let expected_ratio: f64 = parse_value(&lines, "RATIO_A")
        .unwrap_or_else(|| panic!("Ratio printed no RATIO_A: {lines:?}"));

    let profile = read_profile(&output_path);
    let cpu = value_index(&profile, "cpu/nanoseconds");
    let (mut managed, mut named, mut cpu_a, mut cpu_b) = (0i64, 0i64, 0i64, 0i64);
    let mut unnamed_examples = Vec::new();
    // The hot loop runs on the main thread, whose tid is the pid: its
    // samples whose leaf is JIT code (named by the memory path, or an
    // address in anonymous memory nothing named) are the managed ones;
    // ReadyToRun framework code is named from its files, not here.
    for sample in samples(&profile) {
        if sample.pid() != Some(pid) || sample.label_num("thread.id") != Some(i64::from(pid)) {
            continue;
        }
        let Some(leaf) = sample.frames.first() else {
            continue;
        };
        let weight = sample.values[cpu];
        if named_jit(leaf) {
            managed += weight;
            named += weight;
        } else if leaf == UNNAMED_ANONYMOUS {
            managed += weight;
            unnamed_examples.push(leaf.clone());
        }
        if sample.stack_contains(&["Ratio.HotA"]) {
            cpu_a += weight;
        } else if sample.stack_contains(&["Ratio.HotB"]) {
            cpu_b += weight;
        }
    }
    assert!(managed > 0, "no managed samples of pid {pid}");
    let named_share = named as f64 / managed as f64;
    unnamed_examples.truncate(5);
    assert!(
        named_share >= 0.95,
        "only {:.1}% of pid {pid}'s managed CPU is named (unnamed leaves: {unnamed_examples:?})",
        named_share * 100.0
    );
    assert!(
        cpu_a + cpu_b > 0,
        "no sample of pid {pid} holds Ratio.HotA or Ratio.HotB"
    );
    let measured = cpu_a as f64 / (cpu_a + cpu_b) as f64;
    eprintln!(
        "pid {pid}: {:.1}% of managed CPU named; HotA share {measured:.4}, workload says {expected_ratio:.4}",
        named_share * 100.0
    );
    assert!(
        (measured - expected_ratio).abs() <= 0.05,
        "HotA share {measured:.4} in the profile, {expected_ratio:.4} measured by the workload"
    );
}

/// `Namespace.Type.Method` of a perf map name, generic arguments removed
/// (metadata names generic types by their arity alone: ``List`1``); `None`
/// for stubs, which have no such shape.
fn perf_map_short_name(full: &str) -> Option<String> {
    // `...(args)[OptimizedTier1]`: drop the tier.
    let full = match full.rfind(")[") {
        Some(at) if full.ends_with(']') => &full[..=at],
        _ => full,
    };
    let name = parse_method_name(full)?.short();
    let mut out = String::with_capacity(name.len());
    let mut depth = 0usize;
    for c in name.chars() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    Some(out)
}

/// Every JIT-compiled method of a warm .NET 8 process that writes a perf
/// map is looked up in its memory too: the two name the same method for
/// at least 99% of them (the perf map is the runtime's own account).
#[test]
fn memory_names_agree_with_the_perf_map() {
    let env = Env::privileged();
    let app = TestProcess::start(&env, Runtime::Net8, "Demo", &["8"], true);
    let pid = app.pid();
    std::thread::sleep(Duration::from_secs(3));
    let perf_map = PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let _cleanup = RemoveOnDrop(vec![
        perf_map.clone(),
        PathBuf::from(format!("/tmp/jit-{pid}.dump")),
    ]);
    let text = std::fs::read_to_string(&perf_map)
        .unwrap_or_else(|e| panic!("{}: {e}", perf_map.display()));
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mappings = MappingTable::parse(maps.as_bytes()).expect("maps parse");
    let names = JitMemoryNames::attach(&ProcFs::default(), pid, &mappings)
        .unwrap_or_else(|e| panic!("memory path for pid {pid}: {e}"));
    let (mut compared, mut agreed, mut dynamic, mut dynamic_agreed) = (0, 0, 0, 0);
    let mut disagreements = Vec::new();
    let mut dynamic_examples = Vec::new();
    for line in text.lines() {
        let mut fields = line.splitn(3, ' ');
        let (Some(start), Some(size), Some(full)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (Ok(start), Ok(size)) = (
            u64::from_str_radix(start.trim_start_matches("0x"), 16),
            u64::from_str_radix(size.trim_start_matches("0x"), 16),
        ) else {
            continue;
        };
        let Some(expected) = perf_map_short_name(full) else {
            continue;
        };
        let pc = start + size / 2;
        let got = names.code_name(pc).map(|n| n.name.to_string());
        // LCG methods and IL stubs: the runtime keeps their name in the
        // DynamicMethodDesc, and the memory path says it as the perf map does.
        if expected.starts_with("dynamicClass.") {
            dynamic += 1;
            if got.as_deref() == Some(expected.as_str()) {
                dynamic_agreed += 1;
            } else if dynamic_examples.len() < 5 {
                dynamic_examples.push(format!("{start:#x} perf map {expected} memory {got:?}"));
            }
            continue;
        }
        compared += 1;
        if got.as_deref() == Some(expected.as_str()) {
            agreed += 1;
        } else if disagreements.len() < 10 {
            disagreements.push(format!("{start:#x} perf map {expected} memory {got:?}"));
        }
    }
    eprintln!(
        "pid {pid}: {agreed} of {compared} JIT methods named alike; {dynamic_agreed} of {dynamic} dynamic methods"
    );
    assert!(
        compared >= 10,
        "only {compared} JIT methods in {}",
        perf_map.display()
    );
    assert!(
        agreed * 100 >= compared * 99,
        "memory and perf map agree on {agreed} of {compared} methods: {disagreements:#?}"
    );
    assert!(
        dynamic_agreed * 100 >= dynamic * 99,
        "memory and perf map agree on {dynamic_agreed} of {dynamic} dynamic methods: {dynamic_examples:#?}"
    );
}

/// Code with no metadata behind it (an LCG method, a reflection invoke
/// stub, a P/Invoke IL stub: tests/workloads/Dynamic.cs) is named from
/// the name its DynamicMethodDesc keeps, as the perf map names it:
/// `dynamicClass.SquareLcg`, `dynamicClass.IL_STUB_PInvoke`.
#[test]
fn memory_names_dynamic_methods_as_the_perf_map_does() {
    let env = Env::privileged();
    let app = TestProcess::start(&env, Runtime::Net8, "Dynamic", &["8"], true);
    let pid = app.pid();
    std::thread::sleep(Duration::from_secs(2));
    let perf_map = PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let _cleanup = RemoveOnDrop(vec![
        perf_map.clone(),
        PathBuf::from(format!("/tmp/jit-{pid}.dump")),
    ]);
    let text = std::fs::read_to_string(&perf_map)
        .unwrap_or_else(|e| panic!("{}: {e}", perf_map.display()));
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mappings = MappingTable::parse(maps.as_bytes()).expect("maps parse");
    let names = JitMemoryNames::attach(&ProcFs::default(), pid, &mappings)
        .unwrap_or_else(|e| panic!("memory path for pid {pid}: {e}"));
    let mut seen = Vec::new();
    let mut disagreements = Vec::new();
    for line in text.lines() {
        let mut fields = line.splitn(3, ' ');
        let (Some(start), Some(size), Some(full)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (Ok(start), Ok(size)) = (
            u64::from_str_radix(start.trim_start_matches("0x"), 16),
            u64::from_str_radix(size.trim_start_matches("0x"), 16),
        ) else {
            continue;
        };
        let Some(expected) = perf_map_short_name(full).filter(|n| n.starts_with("dynamicClass."))
        else {
            continue;
        };
        let got = names
            .code_name(start + size / 2)
            .map(|n| n.name.to_string());
        if got.as_deref() != Some(expected.as_str()) {
            disagreements.push(format!("{start:#x} perf map {expected} memory {got:?}"));
        }
        seen.push(expected);
    }
    eprintln!("pid {pid}: dynamic methods in the perf map: {seen:?}");
    for wanted in [
        "dynamicClass.SquareLcg",
        "dynamicClass.IL_STUB_PInvoke",
        "dynamicClass.InvokeStub_Dynamic.Twice",
    ] {
        assert!(
            seen.iter().any(|n| n == wanted),
            "{wanted} is not in {}: {seen:?}",
            perf_map.display()
        );
    }
    assert!(
        disagreements.is_empty(),
        "memory and perf map name {} of {} dynamic methods differently: {disagreements:#?}",
        disagreements.len(),
        seen.len()
    );
}

/// Removes the perf files a workload started with a perf map leaves.
struct RemoveOnDrop(Vec<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}
