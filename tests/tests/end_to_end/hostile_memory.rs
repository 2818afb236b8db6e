//! What a target can make the memory path hold (issue 33, defects 5 and
//! 6), against the release binary with the real BPF programs, beside a
//! real .NET 8 app. The attacker (`tests/fakes/crafted_names.c`, built
//! with gcc here) runs as an unprivileged user (uid 65534) and poses as
//! .NET 8 with no diagnostic socket, so its frames are named from its
//! memory: a `libcoreclr.so` under a shared framework path whose
//! `g_dacTable` leads to a well-formed code heap, every lookup in it a
//! success whose result is cached.
//!
//! - `images`: 16 methods of 16 modules, each in a sparse image that
//!   claims 64 MiB of metadata (nothing on disk), and a thread whose
//!   frames alternate between two executable images of 20 MiB of
//!   metadata, over an image's share of the assembly cache (defect 6).
//!   Before the pools (36468c6), `record -a` held every image's metadata:
//!   1,062 MiB peak RSS.
//! - `names`: 65,536 dynamic methods with names of 511 bytes that are not
//!   UTF-8 (1.5 KiB once made UTF-8), the frames rewritten every
//!   millisecond: 551 MiB before.
//!
//! Each test runs `record -a -d 10` (or the agent) beside one attacker and
//! the app: it ends within 15 s of the start of sampling, peaks under
//! 300 MiB, counts what it refused, and the app loses no sample and is
//! named as ever.

use std::{
    ffi::OsString,
    fs,
    os::unix::fs::{PermissionsExt as _, chown},
    path::{Path, PathBuf},
    process::{Child, Command},
    thread,
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{
    Env, Runtime, TempDir, TestProcess,
    agent::{TestAgent, status_bytes},
    file_watch::FileWatch,
    http, number_before, read_profile, samples, start_whole_host_recording, summary_line,
    summary_samples_and_lost, value_index,
};

/// `nobody`: the attacker.
const ATTACKER: u32 = 65534;
const MIB: u64 = 1 << 20;
/// Images the `images` attack names methods from, and the two it thrashes.
const IMAGES: u64 = 16;
const THRASH_IMAGES: [&str; 2] = ["ThrashA.dll", "ThrashB.dll"];

/// The attacker, built once per test into a directory of its own.
struct Attacker {
    binary: PathBuf,
    framework: PathBuf,
    /// Owned by [`ATTACKER`]: where it writes its images.
    work: PathBuf,
}

impl Attacker {
    fn build(env: &Env, dir: &TempDir) -> Self {
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
        let framework = dir.join("shared/Microsoft.NETCore.App/8.0.99");
        fs::create_dir_all(&framework).expect("create the framework directory");
        let library = dir.join("libcoreclr.c");
        fs::write(
            &library,
            "#include <stdint.h>\nuint64_t g_dacTable[64];\n\
             const char version[] __attribute__((used)) = \"@(#)Version 8.0.99.1 @Commit: crafted\";\n",
        )
        .expect("write the library's source");
        fs::write(framework.join("System.Private.CoreLib.dll"), [0u8; 8192]).expect("CoreLib");
        let gcc = |args: &[&std::ffi::OsStr]| {
            let status = Command::new("gcc")
                .args(args)
                .status()
                .expect("run gcc (is it installed?)");
            assert!(status.success(), "gcc {args:?} failed");
        };
        let runtime = framework.join("libcoreclr.so");
        gcc(&[
            "-shared".as_ref(),
            "-fPIC".as_ref(),
            "-o".as_ref(),
            runtime.as_os_str(),
            library.as_os_str(),
        ]);
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fakes/crafted_names.c");
        let binary = dir.join("crafted_names");
        gcc(&[
            "-O1".as_ref(),
            "-pthread".as_ref(),
            "-o".as_ref(),
            binary.as_os_str(),
            source.as_os_str(),
            "-ldl".as_ref(),
        ]);
        let work = dir.join("work");
        fs::create_dir_all(&work).expect("mkdir");
        // Any IL assembly: its metadata is the images' first bytes.
        fs::copy(env.workload(Runtime::Net8, "Hot"), work.join("Source.dll")).expect("copy");
        chown(&work, Some(ATTACKER), Some(ATTACKER)).expect("chown");
        Self {
            binary,
            framework,
            work,
        }
    }

    fn start(&self, attack: &str) -> TestProcess {
        let mut argv: Vec<OsString> = vec![
            self.binary.clone().into(),
            "120".into(),
            self.framework.clone().into(),
            attack.into(),
        ];
        if attack == "images" {
            argv.push(self.work.join("Source.dll").into());
            argv.push(self.work.clone().into());
        }
        TestProcess::start_as_user(&format!("crafted names ({attack})"), &argv, ATTACKER)
    }
}

/// A real .NET 8 app, warm: its samples are mostly its hot method.
fn start_app(env: &Env) -> TestProcess {
    let app = TestProcess::start(env, Runtime::Net8, "Hot", &["120"], false);
    thread::sleep(Duration::from_secs(2));
    app
}

/// What one run beside an attacker gave.
struct Run {
    stderr: String,
    /// Peak anonymous RSS: what the budget governs (the binary's own
    /// file pages, 130 MiB with its debug info, are not the target's).
    peak_rss: u64,
    /// Peak RSS with file pages (`VmHWM`), for the figures.
    peak_hwm: u64,
    took: Duration,
}

/// `record -a -d 10` from the start of sampling to its end, at most 15 s
/// (killed and failed past 30), measuring its peak RSS.
fn record_beside(dir: &TempDir, env: &Env, out: &Path) -> Run {
    let log = dir.join("record.log");
    let mut clrbpf = start_whole_host_recording(env, &["-d", "10"], out, &log);
    let sampling = Instant::now();
    let (peak_rss, peak_hwm) =
        watch_until_exit(&mut clrbpf, sampling + Duration::from_secs(30), &log);
    let took = sampling.elapsed();
    let stderr = fs::read_to_string(&log).expect("read clrbpf's log");
    assert!(
        clrbpf.wait().expect("clrbpf's status").success(),
        "{stderr}"
    );
    eprintln!(
        "record -a -d 10 took {took:?} from the start of sampling, peak anonymous RSS {} MiB, VmHWM {} MiB",
        peak_rss / MIB,
        peak_hwm / MIB
    );
    assert!(
        took < Duration::from_secs(15),
        "record -a -d 10 took {took:?} beside the attacker:\n{stderr}"
    );
    Run {
        stderr,
        peak_rss,
        peak_hwm,
        took,
    }
}

/// Polls `child`'s peak anonymous RSS and its `VmHWM` until it exits;
/// kills it and panics past `deadline`.
fn watch_until_exit(child: &mut Child, deadline: Instant, log: &Path) -> (u64, u64) {
    let (mut anon, mut hwm) = (0, 0);
    loop {
        anon = status_bytes(child.id(), "RssAnon:").unwrap_or(0).max(anon);
        hwm = status_bytes(child.id(), "VmHWM:").unwrap_or(0).max(hwm);
        if child.try_wait().expect("clrbpf's status").is_some() {
            return (anon, hwm);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "clrbpf still ran at its deadline:\n{}",
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// The app lost no sample, and its samples are named as without the
/// attacker: mostly its hot method, none after the attacker's code.
fn assert_app_named(out: &Path, app: &TestProcess, stderr: &str) {
    let (_, lost) = summary_samples_and_lost(stderr);
    assert_eq!(lost, 0, "samples lost beside the attacker:\n{stderr}");
    let profile = read_profile(out);
    let count = value_index(&profile, "samples/count");
    let mine: Vec<_> = samples(&profile)
        .into_iter()
        .filter(|s| s.pid() == Some(app.pid()) && s.values[count] > 0)
        .collect();
    let total: i64 = mine.iter().map(|s| s.values[count]).sum();
    let hot: i64 = mine
        .iter()
        .filter(|s| s.stack_contains(&["Hot.Spin"]))
        .map(|s| s.values[count])
        .sum();
    let share = hot as f64 / total.max(1) as f64;
    eprintln!("the app: {total} CPU samples, {share:.2} in Hot.Spin");
    // The host is shared (2 cores, the attacker spins on two): the app's
    // count says little; the share of its hot method, named by its perf
    // map, is what naming beside the attacker could spoil.
    assert!(
        total > 20 && share > 0.8,
        "the app beside the attacker: {total} CPU samples, {share:.2} of them in Hot.Spin:\n{stderr}"
    );
    assert!(
        !mine
            .iter()
            .any(|s| s.stack_contains(&["dynamicClass.M"]) || s.stack_contains(&["Thrash"])),
        "the app's frames carry the attacker's names"
    );
}

/// The numbers of the summary's line of what went over the memory budget.
fn dropped(stderr: &str, what: &str) -> u64 {
    number_before(
        summary_line(stderr, "clrbpf: over the 256 MiB memory budget, dropped: "),
        what,
    )
}

/// Defect 5 (sparse images) and 6 (two images over their share alternating
/// in one stack): every image is refused before its metadata is read, once,
/// and the two thrashed images are opened a few times in all (the old cache
/// re-read one at every frame of the other).
#[test]
fn sparse_and_thrashed_images_are_refused_once_each() {
    let env = Env::privileged();
    let dir = TempDir::new("hostile-memory-images");
    let attacker = Attacker::build(&env, &dir);
    let app = start_app(&env);
    let images = attacker.start("images");
    let opens = FileWatch::new(&attacker.work, libc::IN_OPEN);
    let out = dir.join("out.pb.gz");
    let run = record_beside(&dir, &env, &out);
    let opened = opens.take();
    let stderr = &run.stderr;
    eprintln!(
        "images: {} MiB anonymous peak ({} MiB VmHWM), opens {opened:?}, {:?}",
        run.peak_rss / MIB,
        run.peak_hwm / MIB,
        run.took
    );
    assert!(
        run.peak_rss < 300 * MIB,
        "peaked at {} MiB beside 16 images of 64 MiB of metadata:\n{stderr}",
        run.peak_rss / MIB
    );
    let refused = dropped(stderr, " images refused");
    assert!(
        refused >= IMAGES + 2,
        "{refused} images refused, not the attacker's {IMAGES} and 2:\n{stderr}"
    );
    // Each file a few times: the unwinder, the ReadyToRun path and the
    // memory path open it once each, and other profilers on the host may
    // too. Thrashed, one is opened at every frame of the other.
    for name in THRASH_IMAGES {
        let n = opened.get(name).copied().unwrap_or(0);
        assert!(
            (1..=20).contains(&n),
            "{name} opened {n} times in 10 s (opens: {opened:?}):\n{stderr}"
        );
    }
    let profile = read_profile(&out);
    let count = value_index(&profile, "samples/count");
    let thrashed: i64 = samples(&profile)
        .into_iter()
        .filter(|s| s.pid() == Some(images.pid()) && s.stack_contains(&["ThrashA.dll"]))
        .map(|s| s.values[count])
        .sum();
    assert!(thrashed > 20, "{thrashed} samples of the thrashing thread");
    assert_app_named(&out, &app, stderr);
    eprintln!("images: {refused} images refused");
}

/// Defect 5 (long dynamic-method names): what the names cost stays within
/// the budget, and what was not looked up or not cached is counted.
#[test]
fn long_dynamic_method_names_stay_within_the_budget() {
    let env = Env::privileged();
    let dir = TempDir::new("hostile-memory-names");
    let attacker = Attacker::build(&env, &dir);
    let app = start_app(&env);
    let names = attacker.start("names");
    let out = dir.join("out.pb.gz");
    let run = record_beside(&dir, &env, &out);
    let stderr = &run.stderr;
    eprintln!(
        "names: {} MiB anonymous peak ({} MiB VmHWM), {:?}",
        run.peak_rss / MIB,
        run.peak_hwm / MIB,
        run.took
    );
    assert!(
        run.peak_rss < 300 * MIB,
        "peaked at {} MiB beside 65,536 long dynamic method names:\n{stderr}",
        run.peak_rss / MIB
    );
    let line = summary_line(stderr, "clrbpf: naming from runtime memory over budget");
    let over_budget = number_before(line, " over a process");
    let not_cached = stderr
        .lines()
        .find(|l| l.starts_with("clrbpf: over the 256 MiB memory budget"))
        .map_or(0, |_| dropped(stderr, " memory-path names not cached"));
    assert!(
        over_budget + not_cached > 1000,
        "the attacker's lookups were neither refused nor left uncached: {line}"
    );
    // Its names are there, cut at 512 bytes.
    let profile = read_profile(&out);
    let longest = samples(&profile)
        .into_iter()
        .filter(|s| s.pid() == Some(names.pid()))
        .flat_map(|s| s.frames)
        .filter(|f| f.starts_with("dynamicClass.M"))
        .map(|f| f.len())
        .max();
    assert!(
        longest.is_some_and(|n| n <= 512 + "dynamicClass.".len()),
        "the attacker's names: longest {longest:?}"
    );
    assert_app_named(&out, &app, stderr);
    eprintln!("names: {over_budget} lookups over budget, {not_cached} not cached");
}

/// The agent beside both attackers: its `/metrics` count the refused
/// images and lookups, and its RSS stays within the budget plus 64 MiB.
#[test]
fn the_agent_counts_what_the_memory_path_refused() {
    let env = Env::privileged();
    let dir = TempDir::new("hostile-memory-agent");
    let attacker = Attacker::build(&env, &dir);
    let _images = attacker.start("images");
    let _names = attacker.start("names");
    let windows = dir.join("windows");
    let agent = TestAgent::start_with_windows(&env, &dir, &windows, &[]).wait_ready();
    let started = Instant::now();
    let mut peak = 0;
    while started.elapsed() < Duration::from_secs(16) {
        peak = status_bytes(agent.pid(), "RssAnon:").unwrap_or(0).max(peak);
        thread::sleep(Duration::from_millis(50));
    }
    let page = agent.metrics();
    let hwm = status_bytes(agent.pid(), "VmHWM:").unwrap_or(0);
    let log = agent.stop();
    eprintln!(
        "agent peak anonymous RSS {} MiB (VmHWM {} MiB)",
        peak / MIB,
        hwm / MIB
    );
    assert!(
        peak < (256 + 64) * MIB,
        "the agent peaked at {} MiB:\n{log}",
        peak / MIB
    );
    let metric = |series: &str| {
        http::metric(&page, series, "").unwrap_or_else(|| panic!("no {series}:\n{page}"))
    };
    let images = metric("clrbpf_agent_memory_budget_dropped_total{what=\"images\"}");
    assert!(images >= (IMAGES + 2) as f64, "{images} images refused");
    let refused = metric("clrbpf_agent_memory_naming_refused_total{why=\"over_budget\"}")
        + metric("clrbpf_agent_memory_budget_dropped_total{what=\"memory_names\"}");
    // Names are looked up at each window's cut (every 5 s): two or three
    // cuts, each over the attacker's budget for the window.
    assert!(
        refused > 0.0,
        "{refused} lookups refused or names not cached:\n{page}"
    );
    eprintln!("agent: {images} images refused, {refused} lookups refused or names not cached");
}
