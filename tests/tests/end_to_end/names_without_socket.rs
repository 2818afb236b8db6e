//! Managed frames named without the diagnostic socket (issue 23, items 1
//! and 4): a .NET 8 app started with `DOTNET_EnableDiagnostics=0` opens no
//! socket, so no perf map can be asked for; `record -p` names its
//! framework (ReadyToRun) frames from the mapped images alone, and the
//! summary says which source named them. `--managed-names perf-map` (the
//! behaviour before images were read) names none of them.

use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess, go_pprof, read_profile, record_pid, samples, string,
};

/// Seconds recorded.
const SECONDS: &str = "4";

/// The Demo workload (CSV parsing, sorting and dictionaries: much of its
/// time in System.Private.CoreLib) with no diagnostic socket. Without
/// tiered compilation: with it, the runtime compiles the framework's hot
/// methods again with the JIT after their first 30 calls, and those are
/// JIT frames (named from the runtime's memory, not from the images).
fn start_demo_without_socket(env: &Env) -> TestProcess {
    let app = TestProcess::launch(
        env,
        Runtime::Net8,
        "Demo",
        &["120"],
        &Launch {
            env: &[
                ("DOTNET_EnableDiagnostics", "0"),
                ("DOTNET_TieredCompilation", "0"),
            ],
            ..Launch::default()
        },
    );
    // Nothing to connect to: the premise of the test.
    let sockets: Vec<_> = std::fs::read_dir("/tmp")
        .expect("read /tmp")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with(&format!("dotnet-diagnostic-{}-", app.pid())))
        .collect();
    assert!(sockets.is_empty(), "the app opened {sockets:?}");
    app
}

/// Managed frames of `pid`'s CPU samples named after CoreLib's types, and
/// all its samples.
fn framework_frames(path: &std::path::Path, pid: u32) -> (usize, usize) {
    let profile = read_profile(path);
    let corelib: Vec<String> = profile
        .function
        .iter()
        .filter(|f| string(&profile, f.filename) == "System.Private.CoreLib")
        .map(|f| string(&profile, f.name).to_owned())
        .collect();
    let ours: Vec<_> = samples(&profile)
        .into_iter()
        .filter(|s| s.pid() == Some(pid))
        .collect();
    let named = ours
        .iter()
        .filter(|s| s.frames.iter().any(|f| corelib.contains(f)))
        .count();
    (named, ours.len())
}

/// Records `pid` for a few seconds and checks its framework frames are
/// named from the images, as the summary says.
fn assert_framework_frames_named(env: &Env, dir: &TempDir, pid: u32, file: &str) {
    let (output, path) = record_pid(env, dir, pid, &["-d", SECONDS], file);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let (named, all) = framework_frames(&path, pid);
    assert!(all > 50, "only {all} samples of pid {pid}:\n{stderr}");
    assert!(
        named * 10 >= all,
        "{named} of {all} samples have a CoreLib frame named:\n{stderr}"
    );
    // Names as perf maps spell them, readable by go tool pprof.
    let top = go_pprof(&path, "-top");
    assert!(
        top.lines().any(|l| l.contains(" System.")),
        "no System.* function in -top:\n{top}"
    );
    // The summary says who named them.
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&format!("clrbpf: pid {pid}: managed frames named: ")))
        .unwrap_or_else(|| panic!("no name source line for pid {pid}:\n{stderr}"));
    let by_images: u64 = line
        .split(", ")
        .find_map(|part| part.strip_suffix(" by ReadyToRun images"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no ReadyToRun count in {line:?}"));
    assert!(by_images > 0, "{line}");
    assert!(line.contains(": 0 by perf map"), "{line}");
}

#[test]
fn record_p_names_ready_to_run_frames_of_a_process_without_its_socket() {
    let env = Env::privileged();
    let dir = TempDir::new("names-without-socket");
    let app = start_demo_without_socket(&env);
    let pid = app.pid();
    assert_framework_frames_named(&env, &dir, pid, "auto.pb.gz");

    // Without the images (as before), none of them has a name.
    let (output, path) = record_pid(
        &env,
        &dir,
        pid,
        &["-d", "2", "--managed-names", "perf-map"],
        "perf-map.pb.gz",
    );
    let (named, all) = framework_frames(&path, pid);
    assert!(all > 20, "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(named, 0, "named without images or perf maps");
}

/// A process whose `/tmp` is a read-only tmpfs (as in a container with a
/// read-only root and nothing mounted there) can write neither its socket
/// nor a perf map, and says nothing: its framework frames are named all
/// the same.
#[test]
fn record_p_names_ready_to_run_frames_of_a_process_with_a_read_only_tmp() {
    let env = Env::privileged();
    let dir = TempDir::new("names-read-only-tmp");
    let script = "mount -t tmpfs -o ro tmpfs /tmp && exec \"$0\" \"$@\"";
    let argv: Vec<std::ffi::OsString> = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "env",
        "DOTNET_TieredCompilation=0",
    ]
    .into_iter()
    .map(Into::into)
    .chain([
        env.dotnet(Runtime::Net8).as_os_str().to_owned(),
        env.workload(Runtime::Net8, "Demo").into_os_string(),
        "120".into(),
    ])
    .collect();
    let app = TestProcess::start_as_user("Demo", &argv, 0);
    let root_tmp = format!("/proc/{}/root/tmp", app.pid());
    let entries = std::fs::read_dir(&root_tmp)
        .unwrap_or_else(|e| panic!("{root_tmp}: {e}"))
        .count();
    assert_eq!(entries, 0, "the app wrote into its read-only /tmp");
    assert_framework_frames_named(&env, &dir, app.pid(), "read-only-tmp.pb.gz");
}

/// The short form of a runtime name with its type arguments removed
/// (`System.Collections.Generic.List`1.Add`): what metadata can say.
fn without_type_arguments(full: &str) -> Option<String> {
    let name = clrbpf::symbolize::method_name::parse_method_name(full)?;
    let mut depth = 0usize;
    let type_name: String = name
        .type_name
        .chars()
        .filter(|&c| match c {
            '[' => {
                depth += 1;
                false
            }
            ']' => {
                depth = depth.saturating_sub(1);
                false
            }
            _ => depth == 0,
        })
        .collect();
    Some(format!("{type_name}.{}", name.method))
}

/// The names read from the images alone agree with the runtime's own: a
/// .NET 8 app writing its jitdump (every ReadyToRun method it runs, as
/// `[PreJIT]`) is named from its mappings and images at the start, middle
/// and end of each such method.
#[test]
fn ready_to_run_names_agree_with_the_runtimes_jitdump() {
    use clrbpf::symbolize::{
        managed::split_tier,
        ready_to_run::{AssemblyCache, ReadyToRunNames},
    };
    use clrbpf_parse::jitdump::{JitDumpLimits, JitDumpParser};
    let env = Env::privileged();
    let app = TestProcess::start(&env, Runtime::Net8, "Demo", &["60"], true);
    let pid = app.pid();
    // The workers have run through their batches a few times.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let maps = std::fs::File::open(format!("/proc/{pid}/maps")).expect("maps");
    let maps = clrbpf::process::MappingTable::parse(std::io::BufReader::new(maps)).expect("maps");
    let mut names = ReadyToRunNames::new(pid, AssemblyCache::new(256 << 20));
    names.sync_mappings(&maps);
    let jitdump = format!("/tmp/jit-{pid}.dump");
    let bytes = std::fs::read(&jitdump).expect("the jitdump");

    let (mut pcs, mut same, mut truncated_by_runtime, mut other) = (0, 0, 0, Vec::new());
    JitDumpParser::new(JitDumpLimits::default()).feed(&bytes, |load| {
        let (full, tier) = split_tier(&load.name);
        let Some(expected) = without_type_arguments(full).filter(|_| tier == Some("PreJIT")) else {
            return;
        };
        let end = load.code_addr + load.code_size - 1;
        for pc in [load.code_addr, load.code_addr + load.code_size / 2, end] {
            pcs += 1;
            let got = names.frame(pc, pc).map(|f| f.name.to_string());
            match got {
                Some(got) if got == expected => same += 1,
                // The runtime's jitdump writer drops the last character of
                // some names (`EventSource::ValidateSetting(` for
                // ValidateSettings, seen on 8.0.4): ours is right.
                Some(got) if got.len() == expected.len() + 1 && got.starts_with(&expected) => {
                    truncated_by_runtime += 1;
                }
                got => other.push((expected.clone(), got)),
            }
        }
    });
    drop(app);
    for file in [
        jitdump,
        format!("/tmp/perf-{pid}.map"),
        format!("/tmp/perfinfo-{pid}.map"),
    ] {
        let _ = std::fs::remove_file(file);
    }
    assert!(pcs > 1000, "only {pcs} ReadyToRun PCs in the jitdump");
    let agree = same + truncated_by_runtime;
    assert!(
        agree * 1000 >= pcs * 999,
        "{agree} of {pcs} PCs named as the runtime names them ({truncated_by_runtime} truncated by it); first others: {:?}",
        &other[..other.len().min(20)]
    );
}

/// The summary of `record -p` over a .NET 8 and a .NET Core 3.1 process
/// without their sockets says, once per process, what is named and why
/// not: the .NET 8 one is named from its images and memory, with no perf
/// map warning; the 3.1 one (whose runtime exports no `g_dacTable`) gets
/// one line saying its JIT frames are not named and how to name them.
#[test]
fn summary_says_once_why_jit_frames_of_a_net_core_3_1_process_are_unnamed() {
    let env = Env::privileged();
    let dir = TempDir::new("names-without-socket-summary");
    let no_socket = Launch {
        env: &[
            ("DOTNET_EnableDiagnostics", "0"),
            ("COMPlus_EnableDiagnostics", "0"),
        ],
        ..Launch::default()
    };
    let net8 = TestProcess::launch(&env, Runtime::Net8, "Ratio", &["20"], &no_socket);
    let net31 = TestProcess::launch(&env, Runtime::NetCore31, "Ratio", &["20"], &no_socket);
    let (pid8, pid31) = (net8.pid(), net31.pid());
    let other = pid31.to_string();
    let (output, _) = record_pid(&env, &dir, pid8, &["-d", "3", "-p", &other], "both.pb.gz");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("could not turn on perf maps"),
        "a perf map warning for processes named without perf maps:\n{stderr}"
    );
    let memory: u64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix(&format!("clrbpf: pid {pid8}: managed frames named: ")))
        .and_then(|l| {
            l.split(", ")
                .last()?
                .strip_suffix(" by runtime memory")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no runtime memory count for pid {pid8}:\n{stderr}"));
    assert!(memory > 0, "pid {pid8}'s JIT frames unnamed:\n{stderr}");
    let about = |pid: u32| -> Vec<&str> {
        stderr
            .lines()
            .filter(|l| l.starts_with("clrbpf: warning: ") && l.contains(&pid.to_string()))
            .collect()
    };
    let unnamed: Vec<&str> = about(pid31)
        .into_iter()
        .filter(|l| l.contains("JIT-compiled frames"))
        .collect();
    assert_eq!(unnamed.len(), 1, "{stderr}");
    for needed in [
        "g_dacTable",
        "DOTNET_PerfMapEnabled=1",
        "ReadyToRun frames are named",
    ] {
        assert!(
            unnamed[0].contains(needed),
            "{needed} not in {}",
            unnamed[0]
        );
    }
    assert!(
        about(pid8)
            .iter()
            .all(|l| !l.contains("JIT-compiled frames")),
        "{stderr}"
    );
    // Each warning names its process once.
    for pid in [pid8, pid31] {
        for line in about(pid) {
            assert_eq!(line.matches(&pid.to_string()).count(), 1, "{line}");
        }
    }
}
