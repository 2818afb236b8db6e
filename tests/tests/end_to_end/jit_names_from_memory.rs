//! JIT-compiled frames named from the runtime's memory: a .NET 8 process
//! started with `DOTNET_EnableDiagnostics=0` has no diagnostic socket, so
//! no perf map can be asked for and no events come; `record -p` must still
//! name its managed frames, by walking the runtime's code range map and
//! reading the method's metadata from its assembly file, and write nothing
//! into the target. The same holds for `record -a` and the agent, and for
//! a process whose `/tmp` is read-only. On a warm app that does write a
//! perf map, the memory path must name what the perf map names, per
//! method and per CPU sample. Run by `cargo xtask test` (root, one test at
//! a time).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use clrbpf::{
    clr::memory::names::JitMemoryNames,
    pprof_proto::Profile,
    process::{MappingTable, ProcFs},
    symbolize::{
        method_name::parse_method_name,
        ready_to_run::{AssemblyCache, ReadyToRunNames},
    },
};
use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess, agent::TestAgent, assert_success, parse_value,
    read_profile, record_pid, run_clrbpf, samples, string, value_index,
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

/// The Ratio app for `seconds`, started with `DOTNET_EnableDiagnostics=0`
/// (checked: it has no diagnostic socket).
fn start_ratio_without_socket(env: &Env, seconds: &str) -> TestProcess {
    let ratio = TestProcess::launch(
        env,
        Runtime::Net8,
        "Ratio",
        &[seconds],
        &Launch {
            env: &[("DOTNET_EnableDiagnostics", "0")],
            ..Launch::default()
        },
    );
    let pid = ratio.pid();
    // Named by pid and start time: a process killed before it removed
    // its socket leaves one under a pid reused since.
    let start = ProcFs::default()
        .start_time_ticks(pid)
        .expect("the workload's start time");
    let has_socket = Path::new(&format!("/tmp/dotnet-diagnostic-{pid}-{start}-socket")).exists();
    assert!(
        !has_socket,
        "pid {pid} has a diagnostic socket: the test needs none"
    );
    ratio
}

/// The Ratio app for `seconds` in a mount namespace whose `/tmp` is a
/// read-only tmpfs (a container with a read-only root and nothing mounted
/// there): it can write neither its socket nor a perf map, and says
/// nothing.
fn start_ratio_in_read_only_tmp(env: &Env, seconds: &str) -> TestProcess {
    let script = "mount -t tmpfs -o ro tmpfs /tmp && exec \"$0\" \"$@\"";
    let argv: Vec<std::ffi::OsString> = ["unshare", "--mount", "--propagation", "private"]
        .into_iter()
        .chain(["sh", "-c", script])
        .map(Into::into)
        .chain([
            env.dotnet(Runtime::Net8).as_os_str().to_owned(),
            env.workload(Runtime::Net8, "Ratio").into_os_string(),
            seconds.into(),
        ])
        .collect();
    TestProcess::start_as_user("Ratio", &argv, 0)
}

/// Its `/tmp`, seen from the host.
fn tmp_of(process: &TestProcess) -> PathBuf {
    PathBuf::from(format!("/proc/{}/root/tmp", process.pid()))
}

#[test]
fn record_names_jit_frames_without_the_diagnostic_socket() {
    let env = Env::privileged();
    let dir = TempDir::new("jit-memory");
    let ratio = start_ratio_without_socket(&env, "12");
    assert_jit_frames_named(&env, &dir, ratio, Path::new("/tmp"), "p.pb.gz");
}

/// The same app with a read-only `/tmp`: its JIT frames are named all the
/// same.
#[test]
fn record_names_jit_frames_of_a_process_with_a_read_only_tmp() {
    let env = Env::privileged();
    let dir = TempDir::new("jit-memory-read-only-tmp");
    let ratio = start_ratio_in_read_only_tmp(&env, "12");
    let root_tmp = tmp_of(&ratio);
    assert_jit_frames_named(&env, &dir, ratio, &root_tmp, "read-only-tmp.pb.gz");
}

/// Asserts that `tmp` (a process's `/tmp`, from the host) holds no perf
/// map or jitdump of `pid`.
fn assert_no_perf_files(tmp: &Path, pid: u32) {
    for name in [format!("perf-{pid}.map"), format!("jit-{pid}.dump")] {
        let path = tmp.join(&name);
        assert!(
            !path.exists(),
            "{} exists: the memory path must write nothing into the target",
            path.display()
        );
    }
}

/// Records the running Ratio app `ratio` with `record -p` and checks
/// [`assert_ratio_named`] and that no perf map or jitdump appeared in
/// `tmp` (its `/tmp`, from the host).
fn assert_jit_frames_named(env: &Env, dir: &TempDir, ratio: TestProcess, tmp: &Path, file: &str) {
    let pid = ratio.pid();
    // HotA and HotB are compiled and tiered up by now.
    std::thread::sleep(Duration::from_secs(2));
    let (_, output_path) = record_pid(env, dir, pid, &["-F", "499", "-d", "5"], file);
    assert_no_perf_files(tmp, pid);
    let expected_ratio = ratio_a(ratio);
    let shares = RatioShares::of(&[read_profile(&output_path)], pid);
    shares.assert_named("record -p", pid, expected_ratio);
}

/// Waits for the Ratio app to end and returns the HotA share it measured.
fn ratio_a(ratio: TestProcess) -> f64 {
    let (_, lines) = ratio.wait(Duration::from_secs(60));
    parse_value(&lines, "RATIO_A").unwrap_or_else(|| panic!("Ratio printed no RATIO_A: {lines:?}"))
}

/// The CPU of a Ratio app's main thread in some profiles: its managed
/// part, how much of it is named, and how it splits between HotA and
/// HotB; the names of its JIT leaves with their CPU.
#[derive(Default)]
struct RatioShares {
    managed: i64,
    named: i64,
    cpu_a: i64,
    cpu_b: i64,
    /// Samples with HotA or HotB: how far the split can be trusted.
    hot_samples: i64,
    leaves: HashMap<String, i64>,
}

impl RatioShares {
    fn of(profiles: &[Profile], pid: u32) -> Self {
        let mut shares = Self::default();
        for profile in profiles {
            let cpu = value_index(profile, "cpu/nanoseconds");
            let count = value_index(profile, "samples/count");
            // The hot loop runs on the main thread, whose tid is the pid:
            // its samples whose leaf is JIT code (named by the memory path,
            // or an address in anonymous memory nothing named) are the
            // managed ones; ReadyToRun framework code is named from its
            // files, not here.
            for sample in samples(profile) {
                if sample.pid() != Some(pid)
                    || sample.label_num("thread.id") != Some(i64::from(pid))
                {
                    continue;
                }
                let Some(leaf) = sample.frames.first() else {
                    continue;
                };
                let weight = sample.values[cpu];
                if named_jit(leaf) {
                    shares.managed += weight;
                    shares.named += weight;
                    *shares.leaves.entry(leaf.clone()).or_default() += weight;
                } else if leaf == UNNAMED_ANONYMOUS {
                    shares.managed += weight;
                }
                if sample.stack_contains(&["Ratio.HotA"]) {
                    shares.cpu_a += weight;
                } else if sample.stack_contains(&["Ratio.HotB"]) {
                    shares.cpu_b += weight;
                } else {
                    continue;
                }
                shares.hot_samples += sample.values[count];
            }
        }
        shares
    }

    /// The JIT leaves that hold at least 2% of the named CPU, sorted.
    fn heavy_leaves(&self) -> Vec<&str> {
        let mut heavy: Vec<&str> = self
            .leaves
            .iter()
            .filter(|&(_, &weight)| weight * 50 >= self.named)
            .map(|(name, _)| name.as_str())
            .collect();
        heavy.sort_unstable();
        heavy
    }

    /// At least 95% of the managed CPU is named, and the HotA/HotB split
    /// is within 5 points of `expected_ratio`, the app's own timing.
    fn assert_named(&self, what: &str, pid: u32, expected_ratio: f64) {
        assert!(self.managed > 0, "{what}: no managed samples of pid {pid}");
        let named_share = self.named as f64 / self.managed as f64;
        assert!(
            named_share >= 0.95,
            "{what}: only {:.1}% of pid {pid}'s managed CPU is named",
            named_share * 100.0
        );
        assert!(
            self.cpu_a + self.cpu_b > 0,
            "{what}: no sample of pid {pid} holds Ratio.HotA or Ratio.HotB"
        );
        let measured = self.cpu_a as f64 / (self.cpu_a + self.cpu_b) as f64;
        eprintln!(
            "{what}: pid {pid}: {:.1}% of managed CPU named; HotA share {measured:.4} ({} samples), workload says {expected_ratio:.4}",
            named_share * 100.0,
            self.hot_samples
        );
        assert!(
            (measured - expected_ratio).abs() <= 0.05,
            "{what}: HotA share {measured:.4} in the profile ({} samples), {expected_ratio:.4} measured by the workload",
            self.hot_samples
        );
    }
}

/// Both hardened set-ups at once, seen by a whole-host `record -a` and by
/// the agent (directory sink) at the same time: each names at least 95%
/// of each app's managed CPU, splits it between HotA and HotB within 5
/// points of the app's own timing, and the agent's windows carry the same
/// names as the recording; nothing is written into either app.
#[test]
fn record_a_and_the_agent_name_jit_frames_of_hardened_processes() {
    let env = Env::privileged();
    let dir = TempDir::new("jit-memory-host");
    let no_socket = start_ratio_without_socket(&env, "30");
    let read_only = start_ratio_in_read_only_tmp(&env, "30");
    let windows = dir.join("windows");
    let agent = TestAgent::start(
        &env,
        &dir,
        &[
            // Enough samples for a 5-point bound on a loaded host.
            "-F".as_ref(),
            "499".as_ref(),
            "--upload-interval".as_ref(),
            "5s".as_ref(),
            "--output-dir".as_ref(),
            windows.as_os_str(),
        ],
    )
    .wait_ready();
    // HotA and HotB are compiled and tiered up by now.
    std::thread::sleep(Duration::from_secs(2));
    let record_path = dir.join("host.pb.gz");
    let output = run_clrbpf(
        &env,
        &[
            "record".as_ref(),
            "-a".as_ref(),
            "-F".as_ref(),
            "999".as_ref(),
            "-d".as_ref(),
            "8".as_ref(),
            "-o".as_ref(),
            record_path.as_os_str(),
        ],
        dir.path(),
        Duration::from_secs(120),
    );
    assert_success(&output);
    agent.stop();
    assert_no_perf_files(Path::new("/tmp"), no_socket.pid());
    assert_no_perf_files(&tmp_of(&read_only), read_only.pid());

    let recorded = read_profile(&record_path);
    let mut window_files: Vec<PathBuf> = std::fs::read_dir(&windows)
        .expect("the agent's output directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().contains(".process_cpu."))
        .collect();
    window_files.sort();
    let uploaded: Vec<Profile> = window_files.iter().map(|p| read_profile(p)).collect();
    for (what, app) in [("no socket", no_socket), ("read-only /tmp", read_only)] {
        let pid = app.pid();
        let expected_ratio = ratio_a(app);
        let host = RatioShares::of(std::slice::from_ref(&recorded), pid);
        host.assert_named(&format!("{what}, record -a"), pid, expected_ratio);
        let agent = RatioShares::of(&uploaded, pid);
        agent.assert_named(&format!("{what}, agent"), pid, expected_ratio);
        assert_eq!(
            agent.heavy_leaves(),
            host.heavy_leaves(),
            "{what}: pid {pid}'s heaviest JIT frames are named otherwise by the agent than by record -a"
        );
    }
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

/// A .NET 8 app that writes a perf map, `warm_s` seconds after its start:
/// its perf map's text and its memory path attached. Its perf files go
/// when it is dropped.
struct WarmApp {
    pid: u32,
    perf_map: PathBuf,
    text: String,
    names: JitMemoryNames,
    _cleanup: RemoveOnDrop,
    _app: TestProcess,
}

impl WarmApp {
    /// The perf map's lines: start, size, the runtime's full name.
    fn entries(&self) -> impl Iterator<Item = (u64, u64, &str)> {
        self.text.lines().filter_map(|line| {
            let mut fields = line.splitn(3, ' ');
            let (start, size, full) = (fields.next()?, fields.next()?, fields.next()?);
            let start = u64::from_str_radix(start.trim_start_matches("0x"), 16).ok()?;
            let size = u64::from_str_radix(size.trim_start_matches("0x"), 16).ok()?;
            Some((start, size, full))
        })
    }

    fn start(env: &Env, workload: &str, warm_s: u64) -> Self {
        let app = TestProcess::start(env, Runtime::Net8, workload, &["8"], true);
        let pid = app.pid();
        std::thread::sleep(Duration::from_secs(warm_s));
        let perf_map = PathBuf::from(format!("/tmp/perf-{pid}.map"));
        let cleanup = RemoveOnDrop(vec![
            perf_map.clone(),
            PathBuf::from(format!("/tmp/jit-{pid}.dump")),
        ]);
        let text = std::fs::read_to_string(&perf_map)
            .unwrap_or_else(|e| panic!("{}: {e}", perf_map.display()));
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
        let mappings = MappingTable::parse(maps.as_bytes()).expect("maps parse");
        let names = JitMemoryNames::attach(&ProcFs::default(), pid, &mappings)
            .unwrap_or_else(|e| panic!("memory path for pid {pid}: {e}"));
        Self {
            pid,
            perf_map,
            text,
            names,
            _cleanup: cleanup,
            _app: app,
        }
    }
}

/// Every JIT-compiled method of a warm .NET 8 process that writes a perf
/// map is looked up in its memory too: the two name the same method for
/// at least 99% of them (the perf map is the runtime's own account).
#[test]
fn memory_names_agree_with_the_perf_map() {
    let env = Env::privileged();
    let warm = WarmApp::start(&env, "Demo", 3);
    let (pid, perf_map, names) = (warm.pid, &warm.perf_map, &warm.names);
    let (mut compared, mut agreed, mut dynamic, mut dynamic_agreed) = (0, 0, 0, 0);
    let mut disagreements = Vec::new();
    let mut dynamic_examples = Vec::new();
    for (start, size, full) in warm.entries() {
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
    let warm = WarmApp::start(&env, "Dynamic", 2);
    let (pid, perf_map, names) = (warm.pid, &warm.perf_map, &warm.names);
    let mut seen = Vec::new();
    let mut disagreements = Vec::new();
    for (start, size, full) in warm.entries() {
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

/// How one frame the perf map named compares with the memory path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FrameAgreement {
    /// The same `Namespace.Type.Method`, or both say stub, or both say
    /// dynamic method.
    Same,
    /// Another name, or none.
    Differs,
}

/// The memory path of a running process as the .NET instance asks it:
/// ReadyToRun images first, then the runtime's memory.
struct MemoryPath {
    images: ReadyToRunNames,
    jit: JitMemoryNames,
}

impl MemoryPath {
    fn attach(pid: u32) -> Self {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
        let mappings = MappingTable::parse(maps.as_bytes()).expect("maps parse");
        let mut images = ReadyToRunNames::new(pid, AssemblyCache::new(64 << 20));
        images.sync_mappings(&mappings);
        let jit = JitMemoryNames::attach(&ProcFs::default(), pid, &mappings)
            .unwrap_or_else(|e| panic!("memory path for pid {pid}: {e}"));
        Self { images, jit }
    }

    /// The memory path's name of the code at `lookup`.
    fn name(&self, lookup: u64) -> Option<String> {
        match self.images.frame(lookup, lookup) {
            Some(frame) => Some(frame.name.to_string()),
            None => self.jit.code_name(lookup).map(|n| n.name.to_string()),
        }
    }

    /// Compares the perf map's name `perf_map` (the function's system
    /// name, the runtime's own string) of the code at `lookup`.
    fn compare(&self, lookup: u64, perf_map: &str) -> (FrameAgreement, Option<String>) {
        let got = self.name(lookup);
        let same = match (perf_map_short_name(perf_map), got.as_deref()) {
            (Some(expected), Some(got)) if expected.starts_with("dynamicClass.") => {
                got.starts_with("[dynamic method]")
            }
            (Some(expected), Some(got)) => expected == got,
            // A stub in the perf map (`stub<1> ...`, no method shape).
            (None, Some(got)) => got.starts_with("[stub: "),
            (_, None) => false,
        };
        let agreement = if same {
            FrameAgreement::Same
        } else {
            FrameAgreement::Differs
        };
        (agreement, got)
    }
}

/// A warm .NET 8 app recorded with perf maps only: every managed frame of
/// every sample (as the perf map named it) is looked up with the memory
/// path while the app still runs. The two must name the same method for
/// at least 99% of the app's samples with a managed frame, weighted by CPU;
/// a sample agrees when all of its perf-map frames do, and a frame the
/// perf map names but memory does not is a disagreement.
#[test]
fn memory_names_agree_with_the_perf_map_per_sample() {
    let env = Env::privileged();
    let dir = TempDir::new("jit-memory-samples");
    let app = TestProcess::start(&env, Runtime::Net8, "Demo", &["20"], false);
    let pid = app.pid();
    let _cleanup = RemoveOnDrop(vec![
        PathBuf::from(format!("/tmp/perf-{pid}.map")),
        PathBuf::from(format!("/tmp/jit-{pid}.dump")),
    ]);
    // Tiered up by now.
    std::thread::sleep(Duration::from_secs(3));
    let (_, output_path) = record_pid(
        &env,
        &dir,
        pid,
        &[
            "-F",
            "499",
            "-d",
            "5",
            "--managed-names",
            "perf-map",
            "--no-clr-events",
        ],
        "perf-map.pb.gz",
    );
    let memory = MemoryPath::attach(pid);
    let profile = read_profile(&output_path);
    let (mut total, mut agreed, mut frames, mut frames_agreed) = (0i64, 0i64, 0u64, 0u64);
    let mut disagreements = std::collections::BTreeMap::<String, i64>::new();
    for sample in perf_map_frames_of(&profile, pid) {
        let mut all_same = true;
        for (lookup, perf_map) in &sample.frames {
            let (agreement, got) = memory.compare(*lookup, perf_map);
            frames += 1;
            if agreement == FrameAgreement::Same {
                frames_agreed += 1;
            } else {
                all_same = false;
                *disagreements
                    .entry(format!("{perf_map} / memory {got:?}"))
                    .or_default() += sample.weight;
            }
        }
        total += sample.weight;
        if all_same {
            agreed += sample.weight;
        }
    }
    drop(app);
    let share = agreed as f64 / total.max(1) as f64;
    let mut worst: Vec<_> = disagreements.into_iter().collect();
    worst.sort_by_key(|(_, weight)| -weight);
    worst.truncate(10);
    eprintln!(
        "pid {pid}: {:.2}% of managed CPU samples named alike ({frames_agreed} of {frames} frames; {} looked up in images, {} in JIT memory); most CPU disagreeing: {worst:#?}",
        share * 100.0,
        memory.images.named(),
        memory
            .jit
            .counts
            .named
            .load(std::sync::atomic::Ordering::Relaxed),
    );
    assert!(total > 0, "no managed sample of pid {pid}");
    assert!(
        share >= 0.99,
        "memory and perf map agree on {:.2}% of pid {pid}'s managed CPU: {worst:#?}",
        share * 100.0
    );
}

/// A sample's frames the perf map named: the address to look up (the
/// leaf's own, a caller's return address minus one) and the perf map's
/// name of it; and the sample's CPU.
struct PerfMapSample {
    frames: Vec<(u64, String)>,
    weight: i64,
}

/// The samples of process `pid` with at least one frame named by the perf
/// map path (whose frames sit in the `[jit]` mapping).
fn perf_map_frames_of(profile: &Profile, pid: u32) -> Vec<PerfMapSample> {
    let cpu = value_index(profile, "cpu/nanoseconds");
    let locations: HashMap<u64, _> = profile.location.iter().map(|l| (l.id, l)).collect();
    let functions: HashMap<u64, _> = profile.function.iter().map(|f| (f.id, f)).collect();
    let jit_mappings: Vec<u64> = profile
        .mapping
        .iter()
        .filter(|m| string(profile, m.filename) == "[jit]")
        .map(|m| m.id)
        .collect();
    let views = samples(profile);
    let mut out = Vec::new();
    for (sample, view) in profile.sample.iter().zip(&views) {
        if view.pid() != Some(pid) {
            continue;
        }
        let mut frames = Vec::new();
        for (depth, id) in sample.location_id.iter().enumerate() {
            let location = locations[id];
            if !jit_mappings.contains(&location.mapping_id) {
                continue;
            }
            let Some(function) = location.line.first().map(|l| functions[&l.function_id]) else {
                continue;
            };
            let name = match string(profile, function.system_name) {
                "" => string(profile, function.name),
                system => system,
            };
            let lookup = if depth == 0 {
                location.address
            } else {
                location.address - 1
            };
            frames.push((lookup, name.to_owned()));
        }
        if !frames.is_empty() {
            out.push(PerfMapSample {
                frames,
                weight: view.values[cpu],
            });
        }
    }
    out
}
