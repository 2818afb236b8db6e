//! `clrbpf record` end to end: real BPF programs sampling real .NET
//! processes, checked through the files a user would open. Run by
//! `cargo xtask test` (root, one test at a time: whole-host tests see the
//! others' processes).

use std::{fs, path::PathBuf, time::Duration};

use clrbpf_integration_tests::{
    Env, LabelValue, Runtime, TempDir, TestProcess, assert_some_stack_contains, assert_success,
    go_pprof_top, parse_folded, parse_value_in, pids, read_profile, record_pid, run_clrbpf,
    sample_types, samples, value_index,
};

/// Generous: the runs last seconds, but a loaded CI machine starts .NET slowly.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The files CoreCLR writes for `DOTNET_PerfMapEnabled`, which stay after the
/// process exits; removed when dropped so the tests leave /tmp clean.
struct PerfMapFiles {
    pid: u32,
}

impl PerfMapFiles {
    fn perf_map(&self) -> PathBuf {
        PathBuf::from(format!("/tmp/perf-{}.map", self.pid))
    }

    fn jitdump(&self) -> PathBuf {
        PathBuf::from(format!("/tmp/jit-{}.dump", self.pid))
    }
}

impl PerfMapFiles {
    /// For the workload whose `PID n` line clrbpf passed through, if any.
    fn of_output(stdout: &[u8]) -> Option<Self> {
        parse_value_in(&String::from_utf8_lossy(stdout), "PID").map(|pid| Self { pid })
    }
}

impl Drop for PerfMapFiles {
    fn drop(&mut self) {
        let _ = fs::remove_file(self.perf_map());
        let _ = fs::remove_file(self.jitdump());
    }
}

/// The `PID n` line a workload printed through clrbpf's stdout.
fn printed_pid(stdout: &[u8], key: &str) -> u32 {
    let text = String::from_utf8_lossy(stdout);
    parse_value_in(&text, key)
        .unwrap_or_else(|| panic!("the workload printed no `{key} n` line; stdout:\n{text}"))
}

fn with_command(mut args: Vec<String>, command: Vec<String>) -> Vec<String> {
    args.push("--".to_owned());
    args.extend(command);
    args
}

fn path_arg(path: &std::path::Path) -> String {
    path.to_string_lossy().into_owned()
}

#[test]
fn launch_mode_measures_the_cpu_split_of_two_methods() {
    let env = Env::privileged();
    let dir = TempDir::new("launch");
    let output_path = dir.join("p.pb.gz");
    let args = with_command(
        vec![
            "record".into(),
            "-F".into(),
            "499".into(),
            "-o".into(),
            path_arg(&output_path),
        ],
        env.workload_command(Runtime::Net8, "Ratio", &["6"]),
    );
    let output = run_clrbpf(&env, &args, dir.path(), TIMEOUT);
    let _files = PerfMapFiles::of_output(&output.stdout);
    assert_success(&output);
    let pid = printed_pid(&output.stdout, "PID");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let expected_ratio: f64 = parse_value_in(&stdout, "RATIO_A")
        .unwrap_or_else(|| panic!("Ratio printed no RATIO_A; stdout:\n{stdout}"));

    let profile = read_profile(&output_path);
    assert_eq!(
        sample_types(&profile),
        [
            "samples/count",
            "cpu/nanoseconds",
            "contentions/count",
            "delay/nanoseconds",
            "exceptions/count",
            "waits/count",
            "wait_delay/nanoseconds"
        ],
        "sample types (CLR events are on by default)"
    );
    assert_some_stack_contains(&profile, Some(pid), &["Ratio.HotA"]);
    assert_some_stack_contains(&profile, Some(pid), &["Ratio.HotB"]);

    let all = samples(&profile);
    let of_child: Vec<_> = all.iter().filter(|s| s.pid() == Some(pid)).collect();
    assert!(!of_child.is_empty(), "no sample has process.pid {pid}");
    for key in ["process.pid", "process.executable.name", "thread.id"] {
        let without = of_child.iter().filter(|s| s.label(key).is_none()).count();
        assert_eq!(
            without,
            0,
            "{without} of {} samples of pid {pid} lack the label {key}",
            of_child.len()
        );
    }
    // Every CPU sample names its thread. A CLR event's sample has no
    // thread.name (the runtime gives only the thread id): the runtime may
    // report a contention of its own while clrbpf's sessions start.
    let cpu_samples = value_index(&profile, "samples/count");
    let unnamed_cpu = of_child
        .iter()
        .filter(|s| s.values[cpu_samples] > 0 && s.label("thread.name").is_none())
        .count();
    assert_eq!(
        unnamed_cpu, 0,
        "{unnamed_cpu} CPU samples of pid {pid} lack the label thread.name"
    );
    assert!(
        of_child
            .iter()
            .all(|s| s.label("process.executable.name")
                == Some(&LabelValue::Str("dotnet".to_owned()))),
        "process.executable.name of pid {pid} is not `dotnet`"
    );

    let cpu = value_index(&profile, "cpu/nanoseconds");
    let count = value_index(&profile, "samples/count");
    let (mut cpu_a, mut cpu_b, mut samples_ab) = (0i64, 0i64, 0i64);
    for sample in &of_child {
        let in_a = sample.stack_contains(&["Ratio.HotA"]);
        let in_b = sample.stack_contains(&["Ratio.HotB"]);
        if in_a || in_b {
            // The hot loop runs on the main thread, whose tid is the pid.
            assert_eq!(
                sample.label_num("thread.id"),
                Some(i64::from(pid)),
                "a HotA/HotB sample is not on the main thread"
            );
            samples_ab += sample.values[count];
        }
        if in_a {
            cpu_a += sample.values[cpu];
        } else if in_b {
            cpu_b += sample.values[cpu];
        }
    }
    // ~6 s at 499 Hz on a busy 2-core machine: expect thousands; a few
    // hundred already bound the sampling error well below 5 points.
    assert!(
        samples_ab >= 300,
        "only {samples_ab} samples in HotA or HotB: too few to measure a ratio"
    );
    let measured = cpu_a as f64 / (cpu_a + cpu_b) as f64;
    assert!(
        (measured - expected_ratio).abs() <= 0.05,
        "HotA share {measured:.4} in the profile, {expected_ratio:.4} measured by the workload ({samples_ab} samples)"
    );

    let top = go_pprof_top(&output_path);
    assert!(
        top.contains("Ratio.HotA"),
        "go tool pprof -top does not list Ratio.HotA:\n{top}"
    );
}

/// Attach to a .NET 8 process started with no perf map: clrbpf turns the
/// perf map on over the diagnostic socket, the runtime replays the methods
/// compiled before the attach, and clrbpf turns it off and removes the files.
#[test]
fn attach_names_methods_compiled_before_the_attach_and_cleans_up() {
    let env = Env::privileged();
    let dir = TempDir::new("attach");
    let hot = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], false);
    let files = PerfMapFiles { pid: hot.pid() };
    assert!(
        !files.perf_map().exists(),
        "{} exists before the attach: the workload was started with a perf map",
        files.perf_map().display()
    );
    // Spin is long compiled (and tiered up) by now.
    std::thread::sleep(Duration::from_secs(2));
    let (_, output_path) = record_pid(&env, &dir, hot.pid(), &["-d", "4"], "p.pb.gz");
    let profile = read_profile(&output_path);
    assert_some_stack_contains(&profile, Some(hot.pid()), &["Hot.Spin"]);
    let other_pids: Vec<u32> = pids(&profile)
        .into_iter()
        .filter(|p| *p != hot.pid())
        .collect();
    assert!(
        other_pids.is_empty(),
        "-p {} profiled other processes too: {other_pids:?}",
        hot.pid()
    );
    for file in [files.perf_map(), files.jitdump()] {
        assert!(
            !file.exists(),
            "{} still exists after clrbpf detached (it enabled the perf map, so it must remove it)",
            file.display()
        );
    }
    go_pprof_top(&output_path);
}

#[test]
fn attach_with_keep_perf_maps_leaves_the_perf_map() {
    let env = Env::privileged();
    let dir = TempDir::new("keep-maps");
    let hot = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], false);
    let files = PerfMapFiles { pid: hot.pid() };
    std::thread::sleep(Duration::from_secs(2));
    let _ = record_pid(
        &env,
        &dir,
        hot.pid(),
        &["-d", "2", "--keep-perf-maps"],
        "p.pb.gz",
    );
    let perf_map = fs::read_to_string(files.perf_map()).unwrap_or_else(|e| {
        panic!(
            "--keep-perf-maps: cannot read {}: {e}",
            files.perf_map().display()
        )
    });
    assert!(
        perf_map.contains("Hot::Spin"),
        "{} does not name Hot::Spin",
        files.perf_map().display()
    );
}

/// Kills and reaps a helper process when the test ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn whole_host_contains_the_workload_under_its_pid() {
    let env = Env::privileged();
    let dir = TempDir::new("whole-host");
    let hot = TestProcess::start(&env, Runtime::Net8, "Hot", &["60"], true);
    let _files = PerfMapFiles { pid: hot.pid() };
    // A second busy process that clrbpf was not told about: on an idle
    // machine nothing else may run in 3 s.
    let spinner = KillOnDrop(
        std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("start sh"),
    );
    let output_path = dir.join("p.pb.gz");
    let output = run_clrbpf(
        &env,
        &["record", "-a", "-d", "3", "-o", &path_arg(&output_path)],
        dir.path(),
        TIMEOUT,
    );
    assert_success(&output);
    let profile = read_profile(&output_path);
    assert_some_stack_contains(&profile, Some(hot.pid()), &["Hot.Spin"]);
    let pids = pids(&profile);
    assert!(
        pids.contains(&spinner.0.id()),
        "the whole-host profile lacks the busy sh {}: it has only the processes {pids:?}",
        spinner.0.id()
    );
    go_pprof_top(&output_path);
}

/// `perf record -- cmd` semantics: the processes the command starts are
/// profiled too.
#[test]
fn launch_mode_follows_child_processes() {
    let env = Env::privileged();
    let dir = TempDir::new("children");
    let output_path = dir.join("p.pb.gz");
    let workload = env
        .workload_command(Runtime::Net8, "Hot", &["4"])
        .iter()
        .map(|word| format!("'{}'", word.replace('\'', r"'\''")))
        .collect::<Vec<_>>()
        .join(" ");
    // The trailing `true` keeps sh from exec'ing the workload in place, so
    // the workload is a child with a pid of its own.
    let script = format!("echo SHPID $$; {workload}; true");
    let output = run_clrbpf(
        &env,
        &[
            "record",
            "-o",
            &path_arg(&output_path),
            "--",
            "sh",
            "-c",
            &script,
        ],
        dir.path(),
        TIMEOUT,
    );
    let _files = PerfMapFiles::of_output(&output.stdout);
    assert_success(&output);
    let pid = printed_pid(&output.stdout, "PID");
    let sh_pid = printed_pid(&output.stdout, "SHPID");
    assert_ne!(pid, sh_pid, "the workload ran as the shell's own process");
    let profile = read_profile(&output_path);
    assert_some_stack_contains(&profile, Some(pid), &["Hot.Spin"]);
    go_pprof_top(&output_path);
}

/// Runs Hot for 3 s under `record` with `extra` arguments.
fn record_hot(env: &Env, dir: &TempDir, extra: &[&str]) {
    let mut args: Vec<String> = ["record"]
        .iter()
        .chain(extra)
        .map(|s| (*s).to_owned())
        .collect();
    args = with_command(args, env.workload_command(Runtime::Net8, "Hot", &["3"]));
    let output = run_clrbpf(env, &args, dir.path(), TIMEOUT);
    let _files = PerfMapFiles::of_output(&output.stdout);
    assert_success(&output);
}

fn assert_folded_names_hot_spin(text: &str) {
    let stacks = parse_folded(text);
    assert!(
        stacks
            .iter()
            .any(|(frames, _)| frames.iter().any(|f| f.contains("Hot.Spin"))),
        "no folded stack contains Hot.Spin:\n{text}"
    );
}

#[test]
fn folded_output_follows_the_file_extension() {
    let env = Env::privileged();
    let dir = TempDir::new("folded");
    let path = dir.join("x.folded");
    record_hot(&env, &dir, &["-o", &path_arg(&path)]);
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert_folded_names_hot_spin(&text);
}

#[test]
fn format_flag_overrides_the_file_extension() {
    let env = Env::privileged();
    let dir = TempDir::new("format-flag");
    let path = dir.join("stacks.txt");
    record_hot(
        &env,
        &dir,
        &["--format", "collapsed", "-o", &path_arg(&path)],
    );
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert_folded_names_hot_spin(&text);
}

#[test]
fn svg_output_is_a_flame_graph() {
    let env = Env::privileged();
    let dir = TempDir::new("svg");
    let path = dir.join("x.svg");
    record_hot(&env, &dir, &["--format", "svg", "-o", &path_arg(&path)]);
    let svg = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let start = svg.trim_start();
    assert!(
        start.starts_with("<?xml") || start.starts_with("<svg"),
        "{} does not start as an SVG: {:?}",
        path.display(),
        &start[..start.len().min(80)]
    );
    assert!(
        svg.trim_end().ends_with("</svg>"),
        "{} is cut short",
        path.display()
    );
    assert!(
        svg.contains("Hot.Spin"),
        "the flame graph does not name Hot.Spin"
    );
}

#[test]
fn a_pid_that_does_not_exist_is_a_clear_error() {
    let env = Env::privileged();
    let dir = TempDir::new("no-such-pid");
    let output = run_clrbpf(
        &env,
        &["record", "-p", "999999999", "-d", "1"],
        dir.path(),
        TIMEOUT,
    );
    assert!(!output.status.success(), "record -p 999999999 succeeded");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("999999999") && stderr.to_lowercase().contains("not"),
        "the error does not say that pid 999999999 does not exist:\n{stderr}"
    );
}

/// .NET Core 3.1 has no EnablePerfMap command; launch mode names its
/// methods through the environment variable clrbpf sets for the child.
#[test]
fn launch_mode_names_methods_on_dotnet_core_3_1() {
    let env = Env::privileged();
    let dir = TempDir::new("netcore31");
    let output_path = dir.join("p.pb.gz");
    let args = with_command(
        vec!["record".into(), "-o".into(), path_arg(&output_path)],
        env.workload_command(Runtime::NetCore31, "Hot", &["4"]),
    );
    let output = run_clrbpf(&env, &args, dir.path(), TIMEOUT);
    let _files = PerfMapFiles::of_output(&output.stdout);
    assert_success(&output);
    let pid = printed_pid(&output.stdout, "PID");
    let profile = read_profile(&output_path);
    assert_some_stack_contains(&profile, Some(pid), &["Hot.Spin"]);
    go_pprof_top(&output_path);
}
