//! In-kernel DWARF unwinding (`record --dwarf-unwind`), end to end: profiles
//! of programs whose native code has no frame pointers, checked in the pprof
//! `clrbpf record` writes. Run by `cargo xtask test` (root); the xz test
//! needs Debian's `xz`.

use std::{collections::HashMap, time::Duration};

use clrbpf::pprof_proto::Profile;
use clrbpf_integration_tests::{
    Env, Runtime, TempDir, assert_some_stack_contains, assert_success, parse_value_in,
    read_profile, run_clrbpf, samples,
};

/// Generous: the runs last seconds, but a loaded CI machine starts .NET slowly.
const TIMEOUT: Duration = Duration::from_secs(120);

/// One frame of a sample: function name (or address) and mapping file.
#[derive(Clone, Debug)]
struct FrameView {
    name: String,
    file: String,
}

/// A sample's stack, leaf first, with its sample count.
struct StackView {
    frames: Vec<FrameView>,
    count: u64,
}

impl StackView {
    fn user_frames(&self) -> usize {
        self.frames
            .iter()
            .filter(|f| !f.file.starts_with("[kernel"))
            .count()
    }

    /// Whether the needles occur, by substring of the function name, in
    /// this order from the leaf towards the root.
    fn contains(&self, needles: &[&str]) -> bool {
        let mut frames = self.frames.iter();
        needles
            .iter()
            .all(|needle| frames.any(|f| f.name.contains(needle)))
    }
}

/// Every sample's stack with the mapping of each frame (the shared
/// harness keeps only names; the kernel/user split needs the mapping).
fn stacks(profile: &Profile) -> Vec<StackView> {
    let strings = &profile.string_table;
    let s = |i: i64| {
        usize::try_from(i)
            .ok()
            .and_then(|i| strings.get(i))
            .cloned()
            .unwrap_or_default()
    };
    let functions: HashMap<u64, String> =
        profile.function.iter().map(|f| (f.id, s(f.name))).collect();
    let mappings: HashMap<u64, String> = profile
        .mapping
        .iter()
        .map(|m| (m.id, s(m.filename)))
        .collect();
    let locations: HashMap<u64, Vec<FrameView>> = profile
        .location
        .iter()
        .map(|l| {
            let file = mappings.get(&l.mapping_id).cloned().unwrap_or_default();
            let frames = if l.line.is_empty() {
                vec![FrameView {
                    name: format!("{:#x}", l.address),
                    file,
                }]
            } else {
                l.line
                    .iter()
                    .map(|line| FrameView {
                        name: functions
                            .get(&line.function_id)
                            .cloned()
                            .unwrap_or_default(),
                        file: file.clone(),
                    })
                    .collect()
            };
            (l.id, frames)
        })
        .collect();
    profile
        .sample
        .iter()
        .map(|sample| StackView {
            frames: sample
                .location_id
                .iter()
                .flat_map(|id| locations.get(id).cloned().unwrap_or_default())
                .collect(),
            count: sample.value.first().copied().unwrap_or(0).max(0) as u64,
        })
        .collect()
}

fn total(stacks: &[StackView], keep: impl Fn(&StackView) -> bool) -> u64 {
    stacks.iter().filter(|s| keep(s)).map(|s| s.count).sum()
}

/// `clrbpf record --dwarf-unwind [extra...] -o DIR/name -- command...`,
/// checked; the profile, clrbpf's stdout (the command's output) and its
/// stderr (the summary).
fn record_with_dwarf(
    env: &Env,
    dir: &TempDir,
    name: &str,
    extra: &[&str],
    command: &[String],
) -> (Profile, String, String) {
    let out = dir.join(name);
    // -v: the unwind-table lines are clrbpf's own figures.
    let mut args = vec![
        "record".to_owned(),
        "-v".to_owned(),
        "--dwarf-unwind".to_owned(),
    ];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args.extend([
        "-o".to_owned(),
        out.to_string_lossy().into_owned(),
        "--".to_owned(),
    ]);
    args.extend(command.iter().cloned());
    let output = run_clrbpf(env, &args, dir.path(), TIMEOUT);
    assert_success(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("clrbpf: unwind tables"),
        "the summary has no unwind line:\n{stderr}"
    );
    (
        read_profile(&out),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr.into_owned(),
    )
}

/// `xz -9` compressing `mib` MiB of incompressible pseudo-random input:
/// seconds of CPU in its match finder and range coder.
fn xz_command(dir: &TempDir, mib: usize) -> Vec<String> {
    let input = dir.join("input.bin");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..mib << 20)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    std::fs::write(&input, data).expect("write input");
    ["xz", "-9", "-T1", "-k", "-f"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain([input.to_string_lossy().into_owned()])
        .collect()
}

/// Most of xz's samples have whole stacks: 4+ user frames, down to
/// `__libc_start_main`.
fn assert_xz_stacks_whole(profile: &Profile) {
    let stacks = stacks(profile);
    let all = total(&stacks, |_| true);
    assert!(all >= 100, "only {all} samples");
    let deep = total(&stacks, |s| s.user_frames() >= 4);
    let share = deep as f64 / all as f64;
    eprintln!(
        "{deep} of {all} samples have 4+ user frames ({:.1}%)",
        share * 100.0
    );
    assert!(
        share >= 0.8,
        "only {deep} of {all} samples have 4 or more user frames"
    );
    // And the walks reach the program's entry.
    let to_main = total(&stacks, |s| s.contains(&["__libc_start_main"]));
    assert!(
        to_main as f64 >= 0.8 * all as f64,
        "only {to_main} of {all} stacks reach __libc_start_main"
    );
}

/// Issue 3's acceptance: Debian's xz has no frame pointers (neither has
/// liblzma), so a frame-pointer walk gives one or two frames; the unwind
/// tables give the whole stack down to `_start`.
#[test]
fn xz_without_frame_pointers_has_deep_stacks() {
    let env = Env::privileged();
    let dir = TempDir::new("unwind-xz");
    let command = xz_command(&dir, 12);
    let (profile, _, _) = record_with_dwarf(&env, &dir, "xz.pb.gz", &[], &command);
    assert_xz_stacks_whole(&profile);
}

/// The tables kept between runs (`--cache-dir`): the first run builds and
/// writes xz's, libc's and liblzma's, the second reads them all and
/// unwinds as well; the directory is clrbpf's alone.
#[test]
fn tables_kept_between_runs_unwind_the_same() {
    let env = Env::privileged();
    let dir = TempDir::new("unwind-cache");
    let cache = dir.join("cache");
    let cache_arg = cache.to_string_lossy().into_owned();
    let command = xz_command(&dir, 8);
    let kept = |stderr: &str| -> (u64, u64) {
        let line = stderr
            .lines()
            .find(|l| l.contains("unwind tables kept between runs"))
            .unwrap_or_else(|| panic!("no cache line in the summary:\n{stderr}"));
        let count = |what: &str| {
            line.split(", ")
                .flat_map(|part| part.rsplit(": ").next())
                .find_map(|part| part.strip_suffix(what)?.trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {what:?} in {line:?}"))
        };
        (count(" read"), count(" built and written"))
    };
    let (first, _, stderr) = record_with_dwarf(
        &env,
        &dir,
        "first.pb.gz",
        &["--cache-dir", &cache_arg],
        &command,
    );
    let (read, written) = kept(&stderr);
    assert_eq!(read, 0, "a new cache has nothing to read:\n{stderr}");
    assert!(written >= 3, "xz, liblzma and libc at least:\n{stderr}");
    assert_xz_stacks_whole(&first);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&cache)
            .expect("the cache directory")
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o700, "the cache is root's alone");

    let (second, _, stderr) = record_with_dwarf(
        &env,
        &dir,
        "second.pb.gz",
        &["--cache-dir", &cache_arg],
        &command,
    );
    let (read, rebuilt) = kept(&stderr);
    assert_eq!(rebuilt, 0, "every table came from the cache:\n{stderr}");
    assert!(read >= written, "{read} read, {written} written before");
    assert_xz_stacks_whole(&second);
}

/// The case frame pointers cannot cross: managed code calls glibc's qsort
/// (no frame pointers) through P/Invoke, and qsort calls back into a
/// managed comparer. A sample in the comparer must walk up through the
/// reverse P/Invoke stub (JIT, frame pointers), glibc's merge sort (unwind
/// tables), the P/Invoke stub and on to the managed caller of qsort.
#[test]
fn dotnet_stack_crosses_glibc_qsort_to_the_managed_caller() {
    let env = Env::privileged();
    let dir = TempDir::new("unwind-qsort");
    let command = env.workload_command(Runtime::Net8, "Qsort", &["10"]);
    let (profile, stdout, _) =
        record_with_dwarf(&env, &dir, "qsort.pb.gz", &["-F", "199"], &command);
    let pid: u32 = parse_value_in(&stdout, "PID")
        .unwrap_or_else(|| panic!("Qsort printed no PID line; stdout:\n{stdout}"));
    let _ = std::fs::remove_file(format!("/tmp/perf-{pid}.map"));
    let _ = std::fs::remove_file(format!("/tmp/jit-{pid}.dump"));
    // Leaf to root: the comparer, glibc's sort, qsort, the managed caller.
    let through_qsort = [
        "Qsort.CompareInts",
        "msort_with_tmp",
        "qsort",
        "Qsort.SortMany",
    ];
    assert_some_stack_contains(&profile, Some(pid), &through_qsort);
    // Until the tables of a new process are built (1-2 s here, more on a
    // loaded machine) its on-CPU samples carry stack copies, unwound once
    // the tables exist; after that they are walked with them. All but a
    // few (samples in a prologue) reach SortMany: 100% of a 10 s run here
    // (75-80% when those first stacks were walked by frame pointers).
    let all = samples(&profile);
    let in_sort: Vec<_> = all
        .iter()
        .filter(|s| s.pid() == Some(pid) && s.stack_contains(&["msort_with_tmp"]))
        .collect();
    let weight = |s: &&clrbpf_integration_tests::SampleView| s.values.first().copied().unwrap_or(0);
    let sorted: i64 = in_sort.iter().map(weight).sum();
    let reached: i64 = in_sort
        .iter()
        .filter(|s| s.stack_contains(&["msort_with_tmp", "qsort", "Qsort.SortMany"]))
        .map(weight)
        .sum();
    let share = reached as f64 / sorted.max(1) as f64;
    eprintln!(
        "{reached} of {sorted} samples in glibc's sort reach Qsort.SortMany ({:.1}%)",
        share * 100.0
    );
    assert!(sorted >= 200, "only {sorted} samples in glibc's sort");
    assert!(
        share >= 0.9,
        "only {reached} of {sorted} samples in glibc's sort reach Qsort.SortMany"
    );
}
