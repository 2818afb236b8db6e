//! Managed frames under ReadyToRun methods without a frame pointer (issue
//! 13): `ManualResetEventSlim.Wait(int)`, `SemaphoreSlim.Wait(int)` and
//! `Task.Wait(int)` are precompiled without an rbp frame, so a
//! frame-pointer walk of a thread blocked in them skips the user method that
//! called them; so does `Task.Wait()` for a thread that runs the task it
//! waits for inline (CPU samples). With the ReadyToRun unwind tables the
//! kernel walker keeps the user method. `ManualResetEventSlim.Wait()`,
//! called often enough to be re-jitted at tier 1, is JIT-compiled code
//! without a frame: the rows made from its prologue keep its caller; so do
//! those of an OSR method, made with its tier-0 code's. A process without
//! its diagnostic socket gets the same rows from the methods found in the
//! runtime's memory, whose extents are the perf map's. Real `sched_switch` programs and real .NET processes; run by
//! `cargo xtask test` (root, one test at a time).

use std::collections::HashMap;
use std::time::Duration;

use clrbpf::{
    clr::{memory::names::JitMemoryNames, name_sources},
    process::{MappingTable, ProcFs},
};
use clrbpf_integration_tests::{
    Env, Launch, Runtime, SampleView, TempDir, TestProcess, assert_success, read_profile,
    record_pid, run_clrbpf, samples, value_index,
};

const TIMEOUT: Duration = Duration::from_secs(120);
/// The kernel walker uses frame pointers for a process until its tables are
/// built (about 1.5 s, more on a loaded machine): the threads start after
/// this delay.
const START_DELAY_S: &str = "6";

/// The thread ids the workload printed (`TID name tid`): .NET Core 3.1
/// does not name native threads, so the `thread.name` label cannot tell
/// them apart.
fn thread_ids(stdout: &[u8]) -> HashMap<String, i64> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|line| {
            let mut fields = line.strip_prefix("TID ")?.split_whitespace();
            Some((fields.next()?.to_owned(), fields.next()?.parse().ok()?))
        })
        .collect()
}

/// What [`share_on`] found.
struct Share {
    total: i64,
    share: f64,
    without: String,
}

/// How much of `samples`' `value` has `on` in its stack (callers after
/// callees, as `stack_contains` reads them), and the first three samples
/// without `caller`, for a failure message.
fn share_on(samples: &[&SampleView], value: usize, on: &[&str], caller: &str) -> Share {
    let total: i64 = samples.iter().map(|s| s.values[value]).sum();
    let with: i64 = samples
        .iter()
        .filter(|s| s.stack_contains(on))
        .map(|s| s.values[value])
        .sum();
    let without = samples
        .iter()
        .filter(|s| !s.stack_contains(&[caller]))
        .take(3)
        .map(|s| format!("  {} {}", s.values[value], s.frames.join(" <- ")))
        .collect::<Vec<_>>()
        .join("\n");
    Share {
        total,
        share: with as f64 / total.max(1) as f64,
        without,
    }
}

/// Checks that thread `often`'s ManualResetEventSlim waits in the profile
/// at `path` (at least 200 ms of them) keep their frameless caller,
/// Frameless.WaitMresOften, on at least 95% of their off-CPU time.
fn often_waits_keep_their_caller(path: &std::path::Path, often: i64, label: &str) {
    let profile = read_profile(path);
    let off_cpu = value_index(&profile, "off_cpu/nanoseconds");
    let all = samples(&profile);
    let waits: Vec<&SampleView> = all
        .iter()
        .filter(|s| {
            s.values[off_cpu] > 0
                && s.label_num("thread.id") == Some(often)
                && s.stack_contains(&["System.Threading.ManualResetEventSlim"])
        })
        .collect();
    let Share {
        total,
        share,
        without: heaviest,
    } = share_on(
        &waits,
        off_cpu,
        &["Frameless.WaitMresOften"],
        "Frameless.WaitMresOften",
    );
    eprintln!(
        "{label} often: {:.1}% of {:.1} ms off-CPU on Frameless.WaitMresOften",
        share * 100.0,
        total as f64 / 1e6
    );
    assert!(
        total > 200_000_000,
        "only {:.1} ms off-CPU in ManualResetEventSlim waits",
        total as f64 / 1e6
    );
    assert!(
        share >= 0.95,
        "Frameless.WaitMresOften is on {:.1}% of its {:.1} ms of waits; without it:\n{heaviest}",
        share * 100.0,
        total as f64 / 1e6
    );
}

/// Records the Frameless workload on `runtime` and checks that each waiting
/// thread's off-CPU time, and the spinning thread's CPU time, is on its
/// user method.
fn user_method_holds_the_waits(runtime: Runtime, label: &str) {
    let env = Env::privileged();
    let dir = TempDir::new(label);
    let output_path = dir.join("frameless.pb.gz");
    let mut command: Vec<String> = ["record", "--off-cpu", "--dwarf-unwind", "--no-clr-events"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    command.push("-o".to_owned());
    command.push(output_path.to_string_lossy().into_owned());
    command.push("--".to_owned());
    command.extend(env.workload_command(runtime, "Frameless", &[START_DELAY_S, "4", "300"]));
    let output = run_clrbpf(&env, &command, dir.path(), TIMEOUT);
    assert_success(&output);

    let profile = read_profile(&output_path);
    let off_cpu = value_index(&profile, "off_cpu/nanoseconds");
    let all = samples(&profile);
    let tids = thread_ids(&output.stdout);
    assert_eq!(
        tids.len(),
        5,
        "the workload printed {tids:?}; stdout:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    // The first three block in 300 ms waits for the whole run; "often"
    // blocks about 2 ms at a time after spinning, so its blocked total
    // depends on how busy the machine is (0.96 s in one run).
    for (thread, method, min_ms) in [
        ("mres", "Frameless.WaitMres", 1000),
        ("semaphore", "Frameless.WaitSemaphore", 1000),
        ("task", "Frameless.WaitTask", 1000),
        ("often", "Frameless.WaitMresOften", 300),
    ] {
        // The thread's off-CPU time in the framework's code (not the page
        // faults of its start; a walk before the process's tables were
        // built stops in glibc and is not counted either): a named
        // framework method (`System.*`: .NET 8 names ReadyToRun code in its
        // jitdump, and clrbpf names .NET Core 3.1's from the image files)
        // or an unnamed one (`System.Private.CoreLib.dll+0x...`). Any
        // framework frame, not only `System.Threading.`: since 3.1's
        // CoreLib frames are named, its waits entered through other
        // namespaces would otherwise drop out of the total.
        let waits: Vec<&SampleView> = all
            .iter()
            .filter(|s| {
                s.values[off_cpu] > 0
                    && s.label_num("thread.id") == tids.get(thread).copied()
                    && s.stack_contains(&["System."])
            })
            .collect();
        let Share { total, share, .. } = share_on(&waits, off_cpu, &[method], method);
        let heaviest = {
            let mut heavy = waits.clone();
            heavy.sort_by_key(|s| std::cmp::Reverse(s.values[off_cpu]));
            heavy
                .iter()
                .take(3)
                .map(|s| format!("  {} {}", s.values[off_cpu], s.frames.join(" <- ")))
                .collect::<Vec<_>>()
                .join("\n")
        };
        eprintln!(
            "{label} {thread}: {:.1}% of {:.1} ms off-CPU on {method}",
            share * 100.0,
            total as f64 / 1e6
        );
        assert!(
            total > min_ms * 1_000_000,
            "{thread}: only {:.1} ms off-CPU in its waits; heaviest:\n{heaviest}",
            total as f64 / 1e6
        );
        assert!(
            share >= 0.95,
            "{thread}: {method} is on {:.1}% of its {:.1} ms of waits; heaviest:\n{heaviest}",
            share * 100.0,
            total as f64 / 1e6
        );
    }

    // The CPU-bound thread: its task runs inline under Task.Wait(), a
    // frameless wrapper; the user method that waits is on its samples.
    let cpu = value_index(&profile, "cpu/nanoseconds");
    let spinning: Vec<&SampleView> = all
        .iter()
        .filter(|s| s.values[cpu] > 0 && s.stack_contains(&["Frameless.Spin"]))
        .collect();
    let Share {
        total,
        share,
        without: heaviest,
    } = share_on(
        &spinning,
        cpu,
        &["Frameless.Spin", "Frameless.BurnUnderTaskWait"],
        "Frameless.BurnUnderTaskWait",
    );
    eprintln!(
        "{label} burn: {:.1}% of {:.1} ms of CPU on Frameless.BurnUnderTaskWait",
        share * 100.0,
        total as f64 / 1e6
    );
    assert!(
        total > 500_000_000,
        "only {:.1} ms of CPU in Frameless.Spin",
        total as f64 / 1e6
    );
    assert!(
        share >= 0.95,
        "Frameless.BurnUnderTaskWait is on {:.1}% of the CPU under Task.Wait(); without it:\n{heaviest}",
        share * 100.0
    );
}

#[test]
fn net8_user_method_stays_on_stacks_blocked_in_frameless_framework_waits() {
    user_method_holds_the_waits(Runtime::Net8, "frameless-net8");
}

#[test]
fn netcore31_user_method_stays_on_stacks_blocked_in_frameless_framework_waits() {
    user_method_holds_the_waits(Runtime::NetCore31, "frameless-netcore31");
}

/// An OSR method runs on the frame of its tier-0 code, which the frame
/// pointer does not describe: the rows made from both prologues keep the
/// method's caller. .NET 8 only (.NET Core 3.1 has no OSR).
#[test]
fn net8_osr_method_keeps_its_caller() {
    let env = Env::privileged();
    let dir = TempDir::new("osr-net8");
    let output_path = dir.join("osr.pb.gz");
    // -v: the JIT prologue line is one of clrbpf's own figures.
    let mut command: Vec<String> = ["record", "-v", "--no-clr-events", "-o"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    command.push(output_path.to_string_lossy().into_owned());
    command.push("--".to_owned());
    command.extend(env.workload_command(Runtime::Net8, "Osr", &[START_DELAY_S, "4"]));
    let output = run_clrbpf(&env, &command, dir.path(), TIMEOUT);
    assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("OSR methods") && !stderr.contains("(0 OSR methods"),
        "no OSR method was given rows:\n{stderr}"
    );

    let tids = thread_ids(&output.stdout);
    let osr = *tids
        .get("osr")
        .unwrap_or_else(|| panic!("no osr thread in {tids:?}"));
    let profile = read_profile(&output_path);
    let cpu = value_index(&profile, "cpu/nanoseconds");
    let all = samples(&profile);
    let in_loop: Vec<&SampleView> = all
        .iter()
        .filter(|s| s.label_num("thread.id") == Some(osr) && s.stack_contains(&["Osr.Loop"]))
        .collect();
    let Share {
        total,
        share,
        without: heaviest,
    } = share_on(&in_loop, cpu, &["Osr.Loop", "Osr.Caller"], "Osr.Caller");
    eprintln!(
        "osr-net8: Osr.Caller on {:.1}% of {:.1} ms of CPU in Osr.Loop",
        share * 100.0,
        total as f64 / 1e6
    );
    assert!(
        total > 2_000_000_000,
        "only {:.1} ms of CPU in Osr.Loop",
        total as f64 / 1e6
    );
    assert!(
        share >= 0.95,
        "Osr.Caller is on {:.1}% of the CPU in Osr.Loop; without it:\n{heaviest}",
        share * 100.0
    );
}

/// A process started with `DOTNET_EnableDiagnostics=0` has no perf map: its
/// JIT-compiled methods are found in the runtime's memory (code heaps,
/// nibble maps, code headers), and the tier-1 `ManualResetEventSlim.Wait()`
/// without a frame gets rows from its prologue all the same, so
/// `record -p` keeps `Frameless.WaitMresOften` on the "often" thread's
/// off-CPU stacks. Before the memory path gave the unwinder methods, a
/// frame-pointer walk skipped it on nearly all of them.
#[test]
fn net8_jit_wrapper_keeps_its_caller_without_the_diagnostic_socket() {
    let env = Env::privileged();
    let dir = TempDir::new("frameless-no-socket");
    let app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Frameless",
        &["3", "9", "300"],
        &Launch {
            env: &[("DOTNET_EnableDiagnostics", "0")],
            ..Launch::default()
        },
    );
    let pid = app.pid();
    // Wait() is re-jitted at tier 1 during the start delay.
    std::thread::sleep(Duration::from_secs(3));
    let (output, output_path) = record_pid(
        &env,
        &dir,
        pid,
        &[
            "-v",
            "--off-cpu",
            "--dwarf-unwind",
            "--no-clr-events",
            "-d",
            "5",
        ],
        "no-socket.pb.gz",
    );
    let (_, lines) = app.wait(TIMEOUT);
    let tids = thread_ids(lines.join("\n").as_bytes());
    let often = *tids
        .get("often")
        .unwrap_or_else(|| panic!("no often thread in {lines:?}"));

    often_waits_keep_their_caller(&output_path, often, "frameless-no-socket");
    // The rows came from methods the memory path found.
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("without an rbp frame given rows")
            && !stderr.contains("decoded, 0 without an rbp frame"),
        "no JIT method was given rows:\n{stderr}"
    );
}

/// The JIT methods the memory path finds for the unwinder are the perf
/// map's: same start and same size (the perf map is the runtime's own list
/// of the code it compiled), on a process started with perf maps on.
#[test]
fn net8_memory_method_extents_agree_with_the_perf_map() {
    let env = Env::privileged();
    let app = TestProcess::start(&env, Runtime::Net8, "Frameless", &["1", "4", "300"], true);
    let pid = app.pid();
    let perf_map = std::path::PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let _remove = RemoveOnDrop(vec![
        perf_map.clone(),
        format!("/tmp/jit-{pid}.dump").into(),
    ]);
    std::thread::sleep(Duration::from_secs(3));
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mappings = MappingTable::parse(maps.as_bytes()).expect("maps parse");
    let mut jit = JitMemoryNames::attach(&ProcFs::default(), pid, &mappings)
        .unwrap_or_else(|e| panic!("memory path for pid {pid}: {e}"));
    let scan_began = std::time::Instant::now();
    let methods = name_sources::JitMemoryNames::take_new_code(&mut jit);
    let first_scan = scan_began.elapsed();
    // The next scan reads the nibble map again but no header it read.
    std::thread::sleep(Duration::from_millis(1100));
    let scan_began = std::time::Instant::now();
    let later = name_sources::JitMemoryNames::take_new_code(&mut jit);
    let next_scan = scan_began.elapsed();
    // Read after the scan: every method it found is listed by now.
    let listed: HashMap<u64, u64> = std::fs::read_to_string(&perf_map)
        .expect("the runtime's perf map")
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let hex = |field: &str| u64::from_str_radix(field.trim_start_matches("0x"), 16).ok();
            let start = hex(fields.next()?)?;
            let size = hex(fields.next()?)?;
            Some((start, size))
        })
        .collect();
    let same = methods
        .iter()
        .filter(|m| listed.get(&m.start) == Some(&(m.end - m.start)))
        .count();
    let differing: Vec<String> = methods
        .iter()
        .filter(|m| listed.get(&m.start) != Some(&(m.end - m.start)))
        .take(5)
        .map(|m| {
            format!(
                "{:#x} size {:#x} vs {:?}",
                m.start,
                m.end - m.start,
                listed.get(&m.start)
            )
        })
        .collect();
    eprintln!(
        "memory extents: {same} of {} methods as in the perf map ({} entries); differing: {differing:?}; scans {first_scan:?} then {next_scan:?} ({} new)",
        methods.len(),
        listed.len(),
        later.len()
    );
    assert!(
        methods.len() >= 20,
        "only {} JIT methods found in memory",
        methods.len()
    );
    assert!(
        same * 100 >= methods.len() * 95,
        "{same} of {} methods have the perf map's extent; differing: {differing:?}",
        methods.len()
    );
}

/// Removes the perf files a workload started with a perf map leaves.
struct RemoveOnDrop(Vec<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A log line without its colour codes.
fn without_colours(line: &str) -> String {
    let mut out = String::new();
    let mut in_escape = false;
    for c in line.chars() {
        match (in_escape, c) {
            (false, '\u{1b}') => in_escape = true,
            (true, 'm') => in_escape = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

/// Seconds since midnight UTC of a log line's RFC 3339 timestamp (its
/// first field).
fn log_line_second(line: &str) -> Option<f64> {
    let stamp = line.split_whitespace().next()?;
    let time = stamp.split_once('T')?.1.trim_end_matches('Z');
    let mut parts = time.split(':');
    let hours: f64 = parts.next()?.parse().ok()?;
    let minutes: f64 = parts.next()?.parse().ok()?;
    let seconds: f64 = parts.next()?.parse().ok()?;
    Some(hours * 3600.0 + minutes * 60.0 + seconds)
}

/// Seconds since midnight UTC now.
fn now_second() -> f64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970");
    since_epoch.as_secs_f64() % 86_400.0
}

/// Code the runtime compiles after the process idled is unwound in time,
/// and the idle spell costs no reads: `record -p` attaches to a Frameless
/// app that first idles for 10 s (its jitdump, once read, is watched and
/// not written), then re-jits `ManualResetEventSlim.Wait()` at tier 1
/// (JIT code without a frame) and waits in it a few hundred times a second.
/// The jitdump's write wakes the check, so the method's rows are in the
/// kernel before the waits and `Frameless.WaitMresOften` stays on them.
/// While the app idled, its jitdump was not read (it was read once a
/// second before inotify told the check when it grew).
#[test]
fn net8_code_compiled_after_an_idle_spell_is_unwound_and_the_spell_costs_no_reads() {
    const IDLE_S: f64 = 10.0;
    let env = Env::privileged();
    let dir = TempDir::new("frameless-after-idle");
    let app = TestProcess::launch(
        &env,
        Runtime::Net8,
        "Frameless",
        &["3", "4", "300", "10"],
        &Launch::default(),
    );
    let ready_at = now_second();
    let pid = app.pid();
    let (output, output_path) = record_pid(
        &env,
        &dir,
        pid,
        &[
            "-v",
            "--off-cpu",
            "--dwarf-unwind",
            "--no-clr-events",
            "--log-level",
            "warn,clrbpf::clr::instance=debug",
            "-d",
            "16",
        ],
        "after-idle.pb.gz",
    );
    let (_, lines) = app.wait(TIMEOUT);
    let tids = thread_ids(lines.join("\n").as_bytes());
    let often = *tids
        .get("often")
        .unwrap_or_else(|| panic!("no often thread in {lines:?}"));

    // The reads of its files while it idled that found nothing new: from
    // 4 s after READY (the perf map attach and its first reads are done)
    // to 1 s before the warm-up. (A read that found bytes was asked for:
    // another profiler on the host may make the runtime write.)
    let stderr = String::from_utf8_lossy(&output.stderr);
    let reads: Vec<(f64, bool)> = stderr
        .lines()
        .map(without_colours)
        .filter(|l| l.contains("read perf map and jitdump") && l.contains(&format!("pid={pid}")))
        .filter_map(|l| {
            let found_nothing = l
                .split_once("jitdump: FileRefresh {")
                .is_some_and(|(_, jitdump)| jitdump.contains("bytes_read: 0,"));
            let at = (log_line_second(&l)? - ready_at).rem_euclid(86_400.0);
            Some((at, found_nothing))
        })
        .collect();
    assert!(
        !reads.is_empty(),
        "no read of pid {pid}'s files logged:\n{stderr}"
    );
    let idle_reads: Vec<&(f64, bool)> = reads
        .iter()
        .filter(|(t, _)| (4.0..IDLE_S - 1.0).contains(t))
        .collect();
    let for_nothing = idle_reads.iter().filter(|(_, nothing)| *nothing).count();
    eprintln!(
        "frameless-after-idle: {} reads in all, {} while idle, {for_nothing} of them for nothing (s after READY, found nothing: {reads:.1?})",
        reads.len(),
        idle_reads.len(),
    );
    assert!(
        for_nothing <= 1,
        "pid {pid}'s jitdump was read {for_nothing} times in 5 s while nothing was written to it: {reads:.1?}"
    );

    often_waits_keep_their_caller(&output_path, often, "frameless-after-idle");
}
