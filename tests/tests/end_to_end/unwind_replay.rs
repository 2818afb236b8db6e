//! Replays of live stacks through the same walk the kernel side runs (a
//! native program without frame pointers, .NET threads blocked in
//! `Monitor.Enter`, in glibc's `qsort` under a managed comparer, under
//! frameless ReadyToRun wrappers), and the unwind tables of the real .NET
//! runtimes' files (libcoreclr, ReadyToRun CoreLib). They need root
//! (ptrace), gcc and the runtimes and workloads `cargo xtask test` sets up;
//! the captures and the walk are in `clrbpf_integration_tests::replay`.

use std::{
    collections::{HashMap, HashSet},
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use clrbpf::unwind::{FileIdentity, UnwindTable, ready_to_run, table};
use clrbpf_common::unwind::{CfaRule, UnwindError, UnwindRow, walk};
use clrbpf_integration_tests::{
    Env, Launch, Runtime, TempDir, TestProcess,
    replay::{
        NamedFrame, capture_thread, check_row_index, frame_pointer_only, parse_proc_maps, replay,
        show, table_of,
    },
};

#[test]
fn libcoreclr_rows_and_synthesized_plt() {
    let env = Env::from_env();
    let path = env
        .dotnet8
        .parent()
        .expect("dotnet in a directory")
        .join("shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so");
    let table = table_of(path.to_str().expect("utf-8 path"));
    let s = table.stats();
    assert!(s.rows > 50_000, "{s:?}");
    // lld emits no FDE for .plt.
    assert_eq!(s.synthesized_plt_sections, 1, "{s:?}");
    assert!(s.plt_rows >= 1);
    assert!(s.unsupported_fraction(table.rows()) < 0.01, "{s:?}");
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let pid = self.0.id();
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_file(format!("/tmp/perf-{pid}.map"));
        let _ = std::fs::remove_file(format!("/tmp/jit-{pid}.dump"));
    }
}

/// The lines of the child's stdout, as they come.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn wait_line(rx: &mpsc::Receiver<String>, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => return line,
            Ok(_) => continue,
            Err(e) => panic!("no line starting with {prefix:?} from the child: {e}"),
        }
    }
}

/// Waits until thread `tid` sits in syscall `nr` (`/proc/.../syscall`).
fn wait_in_syscall(pid: u32, tid: u32, nr: u32) {
    let path = format!("/proc/{pid}/task/{tid}/syscall");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.split_whitespace().next() == Some(&nr.to_string()) {
            // Registers are stable once it is blocked in the kernel.
            return;
        }
        assert!(
            Instant::now() < deadline,
            "thread {tid} never entered syscall {nr}: {text}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// `profiler/src/unwind/testdata/chain.c` built without frame pointers.
fn build_chain_program(dir: &Path) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../profiler/src/unwind/testdata/build-chain.sh");
    let out = dir.join("chain");
    let status = Command::new("sh")
        .arg(&script)
        .arg(&out)
        .status()
        .expect("running build-chain.sh (is gcc installed?)");
    assert!(status.success(), "build-chain.sh failed: {status}");
    out
}

const SYS_PAUSE: u32 = 34;
const SYS_FUTEX: u32 = 202;

/// Runs chain.c in `mode` and replays a capture of it once it is blocked in
/// syscall `blocked_in`, or (for the spinning mode) once the leaf is `c`
/// itself: right after "ready" it may still be returning from `write`.
fn capture_chain(
    mode: &str,
    blocked_in: Option<u32>,
) -> (Vec<NamedFrame>, Option<UnwindError>, usize) {
    let dir = TempDir::new("chain");
    let program = build_chain_program(dir.path());
    let mut child = KillOnDrop(
        Command::new(&program)
            .arg(mode)
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting chain"),
    );
    let rx = lines_of(&mut child.0);
    wait_line(&rx, "ready");
    let pid = child.0.id();
    if let Some(nr) = blocked_in {
        wait_in_syscall(pid, pid, nr);
    }
    for _ in 0..100 {
        let captured = capture_thread(pid as i32, pid as i32).expect("ptrace capture");
        let (frames, err, _) = replay(&captured);
        if blocked_in.is_some() || frames.first().and_then(|f| f.symbol.as_deref()) == Some("c") {
            return (frames, err, frame_pointer_only(&captured));
        }
        thread::sleep(Duration::from_millis(20));
    }
    panic!("chain never reached its capture point");
}

fn names(frames: &[NamedFrame]) -> Vec<&str> {
    frames
        .iter()
        .map(|f| f.symbol.as_deref().unwrap_or("?"))
        .collect()
}

fn is_libc(frame: &NamedFrame) -> bool {
    frame.file.ends_with("/libc.so.6")
}

/// main's caller in glibc 2.34+ is `__libc_start_call_main`, a static
/// function stripped from Debian's libc (so unnamed here), then
/// `__libc_start_main` and the program's `_start`, whose CFI marks the
/// return address undefined: a clean end.
fn assert_chain_tail(frames: &[NamedFrame], err: Option<UnwindError>) {
    let text = show(frames);
    assert_eq!(err, None, "walk ended with an error:{text}");
    let n = frames.len();
    assert!(n >= 7, "{text}");
    assert_eq!(
        names(&frames[n - 7..n - 3]),
        ["c", "b", "a", "main"],
        "{text}"
    );
    assert!(is_libc(&frames[n - 3]), "{text}");
    assert_eq!(
        frames[n - 2].symbol.as_deref(),
        Some("__libc_start_main"),
        "{text}"
    );
    assert!(is_libc(&frames[n - 2]), "{text}");
    assert_eq!(frames[n - 1].symbol.as_deref(), Some("_start"), "{text}");
}

#[test]
fn replay_native_chain_blocked_in_libc() {
    let (frames, err, fp_only) = capture_chain("0", Some(SYS_PAUSE));
    eprintln!(
        "blocked in pause ({fp_only} frames by frame pointers):{}",
        show(&frames)
    );
    assert_eq!(frames.len(), 8, "{}", show(&frames));
    assert!(
        is_libc(&frames[0]) && frames[0].symbol.as_deref() == Some("pause"),
        "{}",
        show(&frames)
    );
    assert_chain_tail(&frames, err);
}

#[test]
fn replay_native_chain_spinning() {
    let (frames, err, fp_only) = capture_chain("1", None);
    eprintln!(
        "spinning in c ({fp_only} frames by frame pointers):{}",
        show(&frames)
    );
    assert_eq!(frames.len(), 7, "{}", show(&frames));
    assert_chain_tail(&frames, err);
}

#[test]
fn replay_native_chain_through_a_signal_frame() {
    let (frames, err, fp_only) = capture_chain("2", Some(SYS_PAUSE));
    let text = show(&frames);
    eprintln!("signal handler blocked in pause ({fp_only} frames by frame pointers):{text}");
    // pause <- on_signal <- __restore_rt <- kill <- c <- b <- a <- main <- ...
    assert_eq!(frames.len(), 11, "{text}");
    assert_eq!(frames[0].symbol.as_deref(), Some("pause"), "{text}");
    assert_eq!(frames[1].symbol.as_deref(), Some("on_signal"), "{text}");
    assert!(is_libc(&frames[2]), "__restore_rt: {text}");
    assert_eq!(frames[3].symbol.as_deref(), Some("kill"), "{text}");
    assert_chain_tail(&frames, err);
}

/// `start size name` lines of `/tmp/perf-PID.map`, for the methods named.
fn perf_map_ranges(pid: u32, name: &str) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/tmp/perf-{pid}.map")).expect("perf map");
    text.lines()
        .filter(|l| l.contains(name))
        .filter_map(|l| {
            let mut fields = l.splitn(3, ' ');
            let start = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
            let size = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
            Some((start, start + size))
        })
        .collect()
}

/// Workload `name` on `runtime` with `args`, perf maps on from the start
/// (.NET Core 3.1 reads only the `COMPlus_` spelling).
fn start_workload(env: &Env, runtime: Runtime, name: &str, args: &[&str]) -> TestProcess {
    TestProcess::launch(
        env,
        runtime,
        name,
        args,
        &Launch {
            perf_map: true,
            env: &[("COMPlus_PerfMapEnabled", "1")],
            ..Launch::default()
        },
    )
}

/// The first line of `app` starting with `prefix`, waited for up to 60 s.
fn wait_output(app: &TestProcess, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(line) = app.lines().into_iter().find(|l| l.starts_with(prefix)) {
            return line;
        }
        assert!(
            Instant::now() < deadline,
            "no line starting with {prefix:?} from the workload: {:?}",
            app.lines()
        );
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn replay_dotnet_thread_blocked_in_monitor_enter() {
    let env = Env::from_env();
    let app = start_workload(&env, Runtime::Net8, "MonitorWait", &[]);
    let pid = app.pid();
    let line = wait_output(&app, "TID waiter ");
    let tid: u32 = line["TID waiter ".len()..].trim().parse().expect("tid");
    wait_in_syscall(pid, tid, SYS_FUTEX);
    let captured = capture_thread(pid as i32, tid as i32).expect("ptrace capture");
    let (frames, err, tables) = replay(&captured);
    let fp_only = frame_pointer_only(&captured);
    let text = show(&frames);
    eprintln!("Monitor.Enter wait ({fp_only} frames by frame pointers, error {err:?}):{text}");

    let take_lock = perf_map_ranges(pid, "Waiter::TakeLock");
    let run = perf_map_ranges(pid, "Waiter::Run");
    assert!(
        !take_lock.is_empty() && !run.is_empty(),
        "methods missing from the perf map"
    );
    let within = |ranges: &[(u64, u64)], pc: u64| ranges.iter().any(|(s, e)| *s < pc && pc <= *e);

    // glibc's wait first, then libcoreclr, then the managed method that
    // takes the lock, then its caller.
    assert!(is_libc(&frames[0]), "leaf not in libc:{text}");
    let coreclr = frames
        .iter()
        .position(|f| f.file.ends_with("/libcoreclr.so"))
        .unwrap_or_else(|| panic!("no libcoreclr frame:{text}"));
    let managed = frames
        .iter()
        .position(|f| within(&take_lock, f.pc))
        .unwrap_or_else(|| panic!("no Waiter::TakeLock frame:{text}"));
    assert!(coreclr < managed, "{text}");
    assert!(frames[..coreclr].iter().all(is_libc), "{text}");
    assert!(
        within(&run, frames[managed + 1].pc),
        "Waiter::Run calls TakeLock:{text}"
    );
    assert!(
        tables
            .mapping_for(frames[managed].pc)
            .is_some_and(|m| m.table.is_none()),
        "JIT code unwinds by frame pointer"
    );
    // The walk goes on to the thread's start; whatever ends it is counted,
    // but not "no row" inside a file that has a table.
    assert_ne!(err, Some(UnwindError::NoTableRow), "{text}");
    assert!(
        fp_only < managed,
        "frame pointers alone reach the managed frame?"
    );
}

/// Every executable file a running .NET 8 process maps gets a table: the
/// ELF files (libc, libcoreclr, ...) from `.eh_frame`, the ReadyToRun
/// images from their unwind info, with at most 1% of rows the kernel side
/// cannot follow. Prints the build time and size of each (the figures the
/// README quotes).
#[test]
fn every_file_a_dotnet_process_maps_gets_a_table() {
    let env = Env::from_env();
    // Perf maps on add only the jitdump's marker mapping (`/tmp/jit-PID.dump`,
    // mapped executable so perf sees it), which is no code: skipped below.
    let app = start_workload(&env, Runtime::Net8, "MonitorWait", &[]);
    wait_output(&app, "TID waiter ");
    let pid = app.pid();
    let maps =
        parse_proc_maps(&std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps"));
    let mut paths: Vec<&str> = maps
        .iter()
        .filter(|m| m.executable && m.path.starts_with('/'))
        .filter(|m| !m.path.ends_with(" (deleted)") && !m.path.ends_with(".dump"))
        .map(|m| m.path.as_str())
        .collect();
    paths.sort();
    paths.dedup();
    let (mut total_rows, mut total_bytes, mut total_time) = (0, 0, Duration::ZERO);
    // Distinct rules (a row without its pc): the size of a deduplicated rule
    // table a packed kernel-side format would index.
    let mut rules = HashSet::new();
    let mut tabled = Vec::new();
    for path in &paths {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
        let started = Instant::now();
        let table =
            UnwindTable::from_elf_bytes(&data).unwrap_or_else(|e| panic!("table of {path}: {e}"));
        let took = started.elapsed();
        let unsupported = table.stats().unsupported_fraction(table.rows());
        eprintln!(
            "{path}: {} rows, {} KiB, built in {took:?}, unsupported {:.3}%",
            table.rows().len(),
            table.size_bytes() / 1024,
            100.0 * unsupported,
        );
        assert!(unsupported < 0.01, "{path}: {:?}", table.stats());
        rules.extend(table.rows().iter().map(|r| UnwindRow { pc: 0, ..*r }));
        total_rows += table.rows().len();
        total_bytes += table.size_bytes();
        total_time += took;
        tabled.push(*path);
    }
    eprintln!(
        "process total: {total_rows} rows, {} KiB, built in {total_time:?}; {} distinct rules",
        total_bytes / 1024,
        rules.len()
    );
    for file in [
        "/libc.so.6",
        "/libcoreclr.so",
        "/System.Private.CoreLib.dll",
    ] {
        assert!(
            tabled.iter().any(|p| p.ends_with(file)),
            "no table for {file} among {paths:?}"
        );
    }
    assert!(total_rows > 100_000, "{total_rows} rows");
}

/// A .NET thread inside glibc's qsort, called by P/Invoke, calling back
/// into a managed comparer: JIT frames (frame pointers) above and below
/// glibc frames (no frame pointers). The walk must cross both ways and
/// reach the managed caller of qsort.
#[test]
fn replay_dotnet_thread_in_qsort_with_a_managed_comparer() {
    // The workload of the `--dwarf-unwind` integration test.
    let env = Env::from_env();
    let app = start_workload(&env, Runtime::Net8, "Qsort", &["30"]);
    let pid = app.pid();
    // Let the comparer tier up and the loop settle.
    thread::sleep(Duration::from_secs(1));
    let sort_many = perf_map_ranges(pid, "Qsort::SortMany");
    assert!(!sort_many.is_empty(), "SortMany missing from the perf map");
    let within = |pc: u64| sort_many.iter().any(|(s, e)| *s < pc && pc <= *e);
    let (mut in_libc, mut reached) = (0, 0);
    let mut failures = Vec::new();
    for _ in 0..15 {
        let captured = capture_thread(pid as i32, pid as i32).expect("ptrace capture");
        let (frames, err, _) = replay(&captured);
        let text = show(&frames);
        // msort_with_tmp is static: Debian's libc names no symbol for it.
        if frames.iter().any(is_libc) {
            in_libc += 1;
            if frames.iter().any(|f| within(f.pc)) {
                reached += 1;
            } else if failures.len() < 3 {
                failures.push(format!("error {err:?}:{text}"));
            }
        }
        thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "{reached} of {in_libc} captures in libc reach SortMany{}",
        failures.join("\n")
    );
    assert!(in_libc >= 5, "only {in_libc} of 15 captures in qsort");
    // Known gap (issue 3): about one run in four, one capture stopped in
    // glibc ends with BadRead at its first step. One such capture is
    // tolerated and printed; two mean a regression.
    assert!(
        reached + 1 >= in_libc,
        "{reached} of {in_libc} captures in libc reach SortMany:\n{}",
        failures.join("\n")
    );
}

// ---- ReadyToRun images ----

/// `System.Private.CoreLib.dll` next to a `dotnet` host.
fn corelib_of(dotnet: &Path) -> PathBuf {
    let shared = dotnet
        .parent()
        .expect("dotnet in a directory")
        .join("shared/Microsoft.NETCore.App");
    let version = std::fs::read_dir(&shared)
        .unwrap_or_else(|e| panic!("{}: {e} (run cargo xtask setup)", shared.display()))
        .filter_map(Result::ok)
        .find(|e| e.path().join("System.Private.CoreLib.dll").is_file())
        .unwrap_or_else(|| panic!("no CoreLib under {}", shared.display()));
    version.path().join("System.Private.CoreLib.dll")
}

/// Checks a real CoreLib's table against its code: every function whose
/// first instruction is `push rbp` has "rbp saved at CFA - 16, CFA = rsp +
/// 16" right after it, every `push rax` wrapper "CFA = rsp + 16, rbp
/// untouched", and the table has the shape the kernel search needs.
fn check_corelib(dotnet: &Path) {
    let path = corelib_of(dotnet);
    let data = std::fs::read(&path).expect("CoreLib");
    let started = Instant::now();
    let table = UnwindTable::from_elf_bytes(&data).expect("R2R table");
    let s = table.stats();
    eprintln!(
        "{}: {} functions ({} without a frame register, {} chained), {} rows, {} KiB, built in {:?}",
        path.display(),
        s.runtime_functions,
        s.functions_without_frame_register,
        s.chained_functions,
        s.rows,
        table.size_bytes() / 1024,
        started.elapsed()
    );
    assert!(s.runtime_functions > 20_000, "{s:?}");
    assert!(s.functions_without_frame_register > 1000, "{s:?}");
    assert_eq!(s.parse_errors, 0, "{s:?}");
    assert_eq!(s.overlapping_fdes, 0, "{s:?}");
    assert_eq!(
        (s.unsupported_cfa_rows, s.unsupported_fp_rows),
        (0, 0),
        "{s:?}"
    );
    assert!(!s.truncated);
    let rows = table.rows();
    for pair in rows.windows(2) {
        assert!(pair[0].pc < pair[1].pc, "unsorted: {pair:?}");
        assert!(!pair[0].same_rule(&pair[1]), "unmerged: {pair:?}");
    }
    assert_eq!(
        rows.last().map(|r| r.cfa_rule),
        Some(CfaRule::FramePointer as u8)
    );
    check_row_index(&table);

    let pe = object::read::pe::PeFile64::parse(&*data).expect("PE");
    let image_base = object::read::pe::ImageNtHeaders::optional_header(pe.nt_headers())
        .image_base
        .get(object::LittleEndian);
    let (functions, _) = ready_to_run::runtime_function_list(&pe, &data).expect("functions");
    let sections = pe.section_table();
    let (mut push_rbp, mut push_rax) = (0, 0);
    for f in &functions {
        let Some(code) = sections.pe_data_at(&*data, f.begin) else {
            panic!("function at RVA {:#x} outside the file", f.begin);
        };
        let va = image_base + u64::from(f.begin);
        let entry = table.find_row(va).copied();
        let managed = |rule, offset| {
            UnwindRow::new(0, rule, offset)
                .with_cfa_param(clrbpf_common::unwind::CFA_PARAM_EPILOG_BY_CODE)
        };
        assert_eq!(
            entry.map(|r| UnwindRow { pc: 0, ..r }),
            Some(managed(CfaRule::SpOffset, 8)),
            "entry of {va:#x}"
        );
        let after = table
            .find_row(va + 1)
            .copied()
            .map(|r| UnwindRow { pc: 0, ..r });
        match code.first() {
            Some(0x55) => {
                push_rbp += 1;
                assert_eq!(
                    after,
                    Some(managed(CfaRule::SpOffset, 16).with_fp_at(-16)),
                    "after push rbp at {va:#x}"
                );
            }
            Some(0x50) => {
                push_rax += 1;
                assert_eq!(
                    after,
                    Some(managed(CfaRule::SpOffset, 16)),
                    "after push rax at {va:#x}"
                );
            }
            _ => {}
        }
    }
    eprintln!("{push_rbp} functions start with push rbp, {push_rax} with push rax");
    assert!(push_rbp > 10_000 && push_rax > 100, "{push_rbp} {push_rax}");
}

#[test]
fn ready_to_run_rows_of_net8_corelib() {
    check_corelib(&Env::from_env().dotnet8);
}

#[test]
fn ready_to_run_rows_of_netcore31_corelib() {
    check_corelib(&Env::from_env().dotnet31);
}

/// A ReadyToRun image is named by its CodeView records, read with its
/// headers alone: a table kept on disk is found without reading the image.
#[test]
fn ready_to_run_images_are_identified_from_their_headers() {
    let env = Env::from_env();
    for runtime in [Runtime::Net8, Runtime::NetCore31] {
        let path = corelib_of(env.dotnet(runtime));
        let whole = std::fs::read(&path).expect("CoreLib");
        let expected = UnwindTable::from_elf_bytes(&whole).expect("table");
        let Some(FileIdentity::BuildId(id)) = Some(expected.identity()) else {
            panic!("{}: {} is no build id", path.display(), expected.identity());
        };
        // The tag and the headers' hash, then the records: .NET 8's
        // CoreLib has a perf map record and a CodeView record, .NET Core
        // 3.1's a CodeView record.
        assert!(id.starts_with(b"PE:"), "{}", path.display());
        let records = if runtime == Runtime::Net8 { 2 } else { 1 };
        assert_eq!(id.len(), 3 + 8 + records * 20, "{}", path.display());
        let file = std::fs::File::open(&path).expect("open");
        assert_eq!(
            table::read_build_id(&file).as_ref(),
            Some(expected.identity()),
            "{}",
            path.display()
        );
        // Another image of the same runtime is another identity.
        let other = path.with_file_name("System.Runtime.dll");
        let other = UnwindTable::from_elf_bytes(&std::fs::read(&other).expect("System.Runtime"))
            .map(|t| t.identity().clone());
        assert_ne!(other.ok().as_ref(), Some(expected.identity()));
        // Cut anywhere, the image never panics the reader.
        for cut in (0..whole.len()).step_by(whole.len() / 31 + 1) {
            let _ = table::pe_build_id(&whole[..cut]);
        }
        let mut damaged = whole.clone();
        for b in damaged.iter_mut().take(4096).skip(0x80).step_by(7) {
            *b ^= 0x5a;
        }
        let _ = table::pe_build_id(&damaged);
    }
}

/// A ReadyToRun image is read as its headers and sections, not whole, and
/// gives the table the whole file gives.
#[test]
fn ready_to_run_images_are_read_by_section() {
    let env = Env::from_env();
    for runtime in [Runtime::Net8, Runtime::NetCore31] {
        let path = corelib_of(env.dotnet(runtime));
        let whole = std::fs::read(&path).expect("CoreLib");
        let file = std::fs::File::open(&path).expect("open");
        let read = table::read_elf_file(&file).expect("read by section");
        assert!(read.bytes_read() <= whole.len() as u64 + 4096);
        let expected = UnwindTable::from_elf_bytes(&whole).expect("table");
        let built = UnwindTable::from_elf_bytes(&read).expect("table");
        assert_eq!(built.identity(), expected.identity(), "{}", path.display());
        assert_eq!(built.rows(), expected.rows(), "{}", path.display());
        assert_eq!(built.segments(), expected.segments(), "{}", path.display());
    }
}

/// Hostile R2R images: truncations anywhere and corrupt bytes in the
/// runtime functions and unwind infos never panic.
#[test]
fn hostile_ready_to_run_images_never_panic() {
    let path = corelib_of(&Env::from_env().dotnet31);
    let data = std::fs::read(&path).expect("CoreLib");
    for cut in (0..data.len()).step_by(data.len() / 23) {
        let _ = UnwindTable::from_elf_bytes(&data[..cut]);
    }
    let pe = object::read::pe::PeFile64::parse(&*data).expect("PE");
    let (functions, _) = ready_to_run::runtime_function_list(&pe, &data).expect("functions");
    let sections = pe.section_table();
    let (first, _) = sections
        .pe_file_range_at(functions[0].unwind_info)
        .expect("unwind info in the file");
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..60 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut corrupt = data.clone();
        // Unwind infos follow each other after the first one.
        let at = first as usize + (seed as usize) % (1 << 20);
        if let Some(b) = corrupt.get_mut(at) {
            *b = (seed >> 32) as u8;
        }
        if let Ok(table) = UnwindTable::from_elf_bytes(&corrupt) {
            for pair in table.rows().windows(2) {
                assert!(pair[0].pc < pair[1].pc);
            }
        }
    }
}

/// Threads blocked in `ManualResetEventSlim.Wait(int)`,
/// `SemaphoreSlim.Wait(int)` and `Task.Wait(int)` (ReadyToRun code without
/// a frame), and one running a task inline under `Task.Wait()`: the walk with the
/// ReadyToRun tables reaches the user method that called the framework;
/// frame pointers alone skip it.
#[test]
fn replay_dotnet_threads_under_frameless_ready_to_run_wrappers() {
    replay_frameless_app(Runtime::Net8);
}

/// The same on .NET Core 3.1.
#[test]
fn replay_netcore31_threads_under_frameless_ready_to_run_wrappers() {
    replay_frameless_app(Runtime::NetCore31);
}

fn replay_frameless_app(runtime: Runtime) {
    let env = Env::from_env();
    let app = start_workload(&env, runtime, "Frameless", &["0", "60", "600000"]);
    let pid = app.pid();
    // Five threads announce themselves (the fifth, "often", is not replayed).
    let deadline = Instant::now() + Duration::from_secs(60);
    let tids: HashMap<String, u32> = loop {
        let tids: HashMap<String, u32> = app
            .lines()
            .iter()
            .filter_map(|line| {
                let mut fields = line.strip_prefix("TID ")?.split_whitespace();
                let (name, tid) = (fields.next()?, fields.next()?);
                Some((name.to_owned(), tid.parse().expect("tid")))
            })
            .collect();
        if tids.len() >= 5 {
            break tids;
        }
        assert!(Instant::now() < deadline, "threads: {:?}", app.lines());
        thread::sleep(Duration::from_millis(20));
    };
    for (thread, method) in [
        ("mres", "Frameless::WaitMres"),
        ("semaphore", "Frameless::WaitSemaphore"),
        ("task", "Frameless::WaitTask"),
        ("burn", "Frameless::BurnUnderTaskWait"),
    ] {
        let tid = tids[thread];
        // A thread that has just printed its TID line may still be blocked
        // on the console's lock (another thread writing), a futex too but
        // not yet the wait: capture again until it is in the wait, or fail
        // with the last stack.
        let mut attempt = 0;
        let (captured, frames, err, tables, text, ranges, at) = loop {
            attempt += 1;
            if thread == "burn" {
                thread::sleep(Duration::from_millis(200));
            } else {
                wait_in_syscall(pid, tid, SYS_FUTEX);
            }
            let captured = capture_thread(pid as i32, tid as i32).expect("ptrace capture");
            let (frames, err, tables) = replay(&captured);
            let text = show(&frames);
            let ranges = perf_map_ranges(pid, method);
            let at = frames
                .iter()
                .position(|f| ranges.iter().any(|(s, e)| *s < f.pc && f.pc <= *e));
            match at {
                Some(at) => break (captured, frames, err, tables, text, ranges, at),
                None if attempt < 10 => thread::sleep(Duration::from_millis(300)),
                None => {
                    assert!(!ranges.is_empty(), "{method} missing from the perf map");
                    panic!(
                        "{thread}: no {method} frame in {attempt} captures (error {err:?}):{text}"
                    );
                }
            }
        };
        let within = |pc: u64| ranges.iter().any(|(s, e)| *s < pc && pc <= *e);
        // Right below it: framework code from a ReadyToRun image's table.
        let callee = tables
            .mapping_for(frames[at - 1].pc)
            .unwrap_or_else(|| panic!("{thread}: callee unmapped:{text}"));
        assert!(
            callee.path.ends_with(".dll") && callee.table.is_some(),
            "{thread}: {method}'s callee is not ReadyToRun code:{text}"
        );
        // Frame pointers alone lose it.
        let mut out = [0u64; 128];
        let (n, _) = walk(
            captured.regs,
            |_| Ok(None::<UnwindRow>),
            &captured.memory,
            &mut out,
        );
        assert!(
            !out[..n].iter().any(|pc| within(*pc)),
            "{thread}: frame pointers alone reach {method}: the wrapper has a frame?"
        );
        eprintln!("{thread}: {method} is frame {at} (error {err:?}):{text}");
    }
}
