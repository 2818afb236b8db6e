//! Helpers for the privileged end-to-end tests: the last stage of the data
//! flow seen from outside. The tests run the real `clrbpf` binary against
//! real .NET workloads (`tests/workloads/*.cs`) on the real kernel, then read
//! the files it writes the way a user's tools would (prost for pprof,
//! `go tool pprof`, plain text for folded stacks and SVG).
//!
//! `cargo xtask test` builds everything and passes the paths in environment
//! variables; the helpers panic with a message saying so when they are
//! missing, and [`must_have_privileges`] panics when the machine cannot run
//! BPF: a privileged test never skips silently.

pub mod agent;
pub mod attackers;
pub mod file_watch;
pub mod http;
pub mod native_lib;

use std::{
    collections::BTreeSet,
    env,
    ffi::{OsStr, OsString},
    fs,
    io::{BufRead as _, BufReader, Read as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use clrbpf::pprof_proto::Profile;
use prost::Message as _;

pub mod replay;

/// Path of the `clrbpf` binary under test (`target/release/clrbpf`).
pub const ENV_BIN: &str = "CLRBPF_BIN";
/// The .NET 8 `dotnet` host.
pub const ENV_DOTNET8: &str = "CLRBPF_DOTNET8";
/// The .NET Core 3.1 `dotnet` host.
pub const ENV_DOTNET31: &str = "CLRBPF_DOTNET31";
/// `tests/workloads/bin`, holding `net8/<Name>.dll` and `netcore31/<Name>.dll`.
pub const ENV_WORKLOADS: &str = "CLRBPF_WORKLOADS";

/// The environment variable that makes CoreCLR write `/tmp/perf-PID.map`.
pub const ENV_PERF_MAP: &str = "DOTNET_PerfMapEnabled";

/// How long a workload may take to print `READY` (runtime start-up and JIT
/// on a loaded 2-core CI machine).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A .NET runtime the workloads run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    Net8,
    NetCore31,
}

impl Runtime {
    fn bin_dir(self) -> &'static str {
        match self {
            Self::Net8 => "net8",
            Self::NetCore31 => "netcore31",
        }
    }
}

/// Paths of everything under test, from the environment `cargo xtask test` sets.
#[derive(Clone, Debug)]
pub struct Env {
    pub clrbpf: PathBuf,
    pub dotnet8: PathBuf,
    pub dotnet31: PathBuf,
    pub workloads: PathBuf,
}

impl Env {
    /// Reads the paths; panics naming `cargo xtask test` when one is missing.
    pub fn from_env() -> Self {
        let env = Self {
            clrbpf: path_from_env(ENV_BIN),
            dotnet8: path_from_env(ENV_DOTNET8),
            dotnet31: path_from_env(ENV_DOTNET31),
            workloads: path_from_env(ENV_WORKLOADS),
        };
        let Self {
            clrbpf,
            dotnet8,
            dotnet31,
            workloads,
        } = &env;
        for path in [clrbpf, dotnet8, dotnet31, workloads] {
            assert!(
                path.exists(),
                "{} does not exist; run the integration tests through `cargo xtask test`, which builds it",
                path.display()
            );
        }
        env
    }

    /// [`must_have_privileges`], then [`Self::from_env`]: the start of every
    /// privileged test.
    pub fn privileged() -> Self {
        must_have_privileges();
        Self::from_env()
    }

    /// The `dotnet` host of `runtime`.
    pub fn dotnet(&self, runtime: Runtime) -> &Path {
        match runtime {
            Runtime::Net8 => &self.dotnet8,
            Runtime::NetCore31 => &self.dotnet31,
        }
    }

    /// The compiled workload `name` (`"Hot"`) for `runtime`; panics when absent.
    pub fn workload(&self, runtime: Runtime, name: &str) -> PathBuf {
        let dll = self
            .workloads
            .join(runtime.bin_dir())
            .join(format!("{name}.dll"));
        assert!(
            dll.is_file(),
            "workload {} is missing; `cargo xtask workloads` (run by `cargo xtask test`) builds tests/workloads/{name}.cs",
            dll.display()
        );
        dll
    }

    /// `[dotnet, Name.dll, args...]`, the command line of a workload, for
    /// `clrbpf record -- ...` or `sh -c`.
    pub fn workload_command(&self, runtime: Runtime, name: &str, args: &[&str]) -> Vec<String> {
        let mut command = vec![
            lossy(self.dotnet(runtime).as_os_str()),
            lossy(self.workload(runtime, name).as_os_str()),
        ];
        command.extend(args.iter().map(|a| (*a).to_owned()));
        command
    }
}

fn path_from_env(name: &str) -> PathBuf {
    match env::var_os(name) {
        Some(value) if !value.is_empty() => PathBuf::from(value),
        _ => panic!(
            "{name} is not set: the privileged integration tests run through `cargo xtask test`, which builds clrbpf, the .NET runtimes and the workloads and sets {ENV_BIN}, {ENV_DOTNET8}, {ENV_DOTNET31} and {ENV_WORKLOADS}"
        ),
    }
}

fn lossy(s: &OsStr) -> String {
    s.to_string_lossy().into_owned()
}

/// Panics, with the reason and the fix, unless this process can do what
/// `clrbpf record` does: be root, open a system-wide `cpu-clock` perf event
/// and create a BPF map. These tests must fail loudly, never skip.
pub fn must_have_privileges() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "the integration tests need root (euid is {euid}): run `cargo xtask test` as root"
    );
    if let Err(e) = open_cpu_clock_event() {
        panic!(
            "perf_event_open(cpu-clock, all processes, cpu 0) failed: {e}; the kernel must allow system-wide perf events (CONFIG_PERF_EVENTS, CAP_PERFMON or root, kernel.perf_event_paranoid)"
        );
    }
    if let Err(e) = create_bpf_map() {
        panic!(
            "bpf(BPF_MAP_CREATE) failed: {e}; the kernel must support BPF (CONFIG_BPF_SYSCALL) and this process needs CAP_BPF or root"
        );
    }
    assert!(
        Path::new("/sys/kernel/btf/vmlinux").exists(),
        "/sys/kernel/btf/vmlinux is missing: clrbpf needs a kernel with BTF (CONFIG_DEBUG_INFO_BTF)"
    );
}

/// `struct perf_event_attr` up to `PERF_ATTR_SIZE_VER0`, the prefix every
/// kernel accepts.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttrVer0 {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    bp_addr: u64,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_CPU_CLOCK: u64 = 0;
const PERF_ATTR_FLAG_DISABLED: u64 = 1;

fn open_cpu_clock_event() -> std::io::Result<()> {
    let attr = PerfEventAttrVer0 {
        kind: PERF_TYPE_SOFTWARE,
        size: size_of::<PerfEventAttrVer0>() as u32,
        config: PERF_COUNT_SW_CPU_CLOCK,
        flags: PERF_ATTR_FLAG_DISABLED,
        ..Default::default()
    };
    let (all_processes, cpu0, no_group, no_flags) = (-1, 0, -1, 0);
    // SAFETY: `attr` is a valid perf_event_attr of the size it declares and
    // outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &raw const attr,
            all_processes,
            cpu0,
            no_group,
            no_flags,
        )
    };
    close_fd(fd)
}

/// The `BPF_MAP_CREATE` prefix of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BpfMapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_TYPE_ARRAY: u32 = 2;

fn create_bpf_map() -> std::io::Result<()> {
    let attr = BpfMapCreateAttr {
        map_type: BPF_MAP_TYPE_ARRAY,
        key_size: 4,
        value_size: 8,
        max_entries: 1,
        ..Default::default()
    };
    // SAFETY: `attr` is a valid bpf_attr prefix of the size passed and
    // outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_CREATE,
            &raw const attr,
            size_of::<BpfMapCreateAttr>(),
        )
    };
    close_fd(fd)
}

fn close_fd(fd: libc::c_long) -> std::io::Result<()> {
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the fd was just returned to us and is closed once.
    unsafe { libc::close(fd as libc::c_int) };
    Ok(())
}

/// How [`TestProcess::launch`] starts a workload.
#[derive(Clone, Debug, Default)]
pub struct Launch<'a> {
    /// `DOTNET_PerfMapEnabled=1` from the start.
    pub perf_map: bool,
    /// Run as this uid (and the gid of the same number), no other groups.
    pub user: Option<u32>,
    /// Extra environment variables.
    pub env: &'a [(&'a str, &'a str)],
    /// Run in new user and pid namespaces, with this pid inside.
    pub pid_in_namespace: Option<u32>,
}

/// The host pid of the process whose innermost pid is `ns_pid` in a pid
/// namespace below ours.
pub fn host_pid_of_ns_pid(ns_pid: u32) -> Option<u32> {
    fs::read_dir("/proc").ok()?.find_map(|entry| {
        let host: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        let status = fs::read_to_string(format!("/proc/{host}/status")).ok()?;
        let pids: Vec<u32> = status
            .lines()
            .find_map(|line| line.strip_prefix("NSpid:"))?
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        (pids.len() > 1 && pids.last() == Some(&ns_pid)).then_some(host)
    })
}

/// A running workload, killed when dropped. Its stdout is collected so a
/// test can read the workload's own measurements.
pub struct TestProcess {
    child: Child,
    pid: u32,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<thread::JoinHandle<()>>,
}

impl TestProcess {
    /// Starts workload `name` on `runtime` with `args` and waits until it
    /// prints `READY`. With `perf_map`, the runtime writes
    /// `/tmp/perf-PID.map` from the start; without, the variable is removed
    /// from the environment so only an attaching profiler can turn it on.
    pub fn start(env: &Env, runtime: Runtime, name: &str, args: &[&str], perf_map: bool) -> Self {
        Self::launch(
            env,
            runtime,
            name,
            args,
            &Launch {
                perf_map,
                ..Launch::default()
            },
        )
    }

    /// [`Self::start`] with the user, environment and pid namespace of
    /// `launch`.
    pub fn launch(env: &Env, runtime: Runtime, name: &str, args: &[&str], launch: &Launch) -> Self {
        let mut argv: Vec<OsString> = Vec::new();
        if let Some(uid) = launch.user {
            argv.extend(
                [
                    "setpriv",
                    "--reuid",
                    &uid.to_string(),
                    "--regid",
                    &uid.to_string(),
                ]
                .map(OsString::from),
            );
            argv.extend(["--clear-groups", "--"].map(OsString::from));
        }
        if let Some(ns_pid) = launch.pid_in_namespace {
            // A user namespace (so a non-root user may make the others) and
            // a pid namespace whose next pid is `ns_pid`, as a container
            // runtime or `unshare` gives any user.
            let script = format!(
                "echo {} > /proc/sys/kernel/ns_last_pid; \"$0\" \"$@\" & wait",
                ns_pid - 1
            );
            argv.extend(
                [
                    "unshare",
                    "--user",
                    "--map-root-user",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--mount-proc",
                    "sh",
                    "-c",
                    &script,
                ]
                .map(OsString::from),
            );
        }
        argv.push(env.dotnet(runtime).as_os_str().to_owned());
        argv.push(env.workload(runtime, name).into_os_string());
        argv.extend(args.iter().map(OsString::from));
        Self::start_argv(name, &argv, launch)
    }

    /// A process that looks like .NET to a profiler but misbehaves
    /// (`tests/fakes/fake_dotnet.py`): `mode` is `silent` (never accepts on
    /// its diagnostic socket), `mute` (accepts, never answers) or `junk`
    /// (answers with random bytes). Runs as `user`, lives `seconds`.
    pub fn fake_dotnet(mode: &str, seconds: u32, user: u32) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fakes")
            .join("fake_dotnet.py");
        let argv: Vec<OsString> = [
            OsString::from("setpriv"),
            "--reuid".into(),
            user.to_string().into(),
            "--regid".into(),
            user.to_string().into(),
            "--clear-groups".into(),
            "--".into(),
            // The system's: a pyenv shim under /root is not the user's to run.
            "/usr/bin/python3".into(),
            script.into_os_string(),
            mode.into(),
            seconds.to_string().into(),
        ]
        .into();
        Self::start_argv(&format!("fake .NET ({mode})"), &argv, &Launch::default())
    }

    /// A stand-in for a .NET 9 runtime (`tests/fakes/fake_dotnet9.py`: no
    /// .NET 9 runtime can be installed here) that serves the diagnostic
    /// protocol and sends the wait-handle events of the JSON `scenario`
    /// file. Runs as root with the extra `env`, lives `seconds`, keeps its
    /// files in `dir`.
    pub fn fake_dotnet9(
        scenario: &Path,
        seconds: u32,
        env: &[(&str, &str)],
        dir: &TempDir,
    ) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fakes")
            .join("fake_dotnet9.py");
        let argv: Vec<OsString> = [
            OsString::from("/usr/bin/python3"),
            script.into_os_string(),
            scenario.as_os_str().to_owned(),
            seconds.to_string().into(),
            dir.path().as_os_str().to_owned(),
        ]
        .into();
        Self::start_argv(
            "fake .NET 9",
            &argv,
            &Launch {
                env,
                ..Launch::default()
            },
        )
    }

    /// `argv` run as `user` (uid and gid, no groups), a process that
    /// prints `PID` and `READY` like the workloads.
    pub fn start_as_user(name: &str, argv: &[OsString], user: u32) -> Self {
        let mut full: Vec<OsString> = [
            "setpriv",
            "--reuid",
            &user.to_string(),
            "--regid",
            &user.to_string(),
            "--clear-groups",
            "--",
        ]
        .into_iter()
        .map(OsString::from)
        .collect();
        full.extend(argv.iter().cloned());
        Self::start_argv(name, &full, &Launch::default())
    }

    /// Starts `argv`, waits for `READY` and checks the printed `PID`.
    fn start_argv(name: &str, argv: &[OsString], launch: &Launch) -> Self {
        let mut command = Command::new(&argv[0]);
        command
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for variable in [ENV_PERF_MAP, "COMPlus_PerfMapEnabled"] {
            command.env_remove(variable);
        }
        if launch.perf_map {
            command.env(ENV_PERF_MAP, "1");
        }
        for (key, value) in launch.env {
            command.env(key, value);
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start workload {name}: {e}"));
        let stdout = child.stdout.take().expect("stdout is piped");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = mpsc::channel();
        let reader = {
            let lines = Arc::clone(&lines);
            thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if line == "READY" {
                        let _ = ready_tx.send(());
                    }
                    lines.lock().expect("reader never panics").push(line);
                }
            })
        };
        let mut process = Self {
            pid: child.id(),
            child,
            lines,
            reader: Some(reader),
        };
        if ready_rx.recv_timeout(READY_TIMEOUT).is_err() {
            let status = process.child.try_wait().ok().flatten();
            panic!(
                "workload {name} did not print READY within {READY_TIMEOUT:?} (exit status {status:?}); stdout so far: {:?}",
                process.lines()
            );
        }
        let printed = parse_value::<u32>(&process.lines(), "PID");
        match launch.pid_in_namespace {
            None => assert_eq!(
                printed,
                Some(process.pid),
                "workload {name} printed another PID than the process started"
            ),
            Some(ns_pid) => {
                assert_eq!(
                    printed,
                    Some(ns_pid),
                    "workload {name} did not get pid {ns_pid} in its namespace"
                );
                process.pid = host_pid_of_ns_pid(ns_pid).unwrap_or_else(|| {
                    panic!("no host process has pid {ns_pid} in a child pid namespace")
                });
            }
        }
        process
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The stdout lines so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().expect("reader never panics").clone()
    }

    /// Waits for the workload to exit by itself (it was started with a
    /// duration) and returns its status and every line it printed.
    pub fn wait(mut self, timeout: Duration) -> (ExitStatus, Vec<String>) {
        let status = wait_with_timeout(&mut self.child, timeout)
            .unwrap_or_else(|| panic!("workload {} still runs after {timeout:?}", self.pid));
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        (status, self.lines())
    }
}

impl Drop for TestProcess {
    fn drop(&mut self) {
        // `setpriv` execs the workload; `unshare --kill-child` takes the
        // pid namespace, and the workload in it, down with it.
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A runtime killed leaves its diagnostic socket and debugger pipes
        // in `/tmp` (thousands after a day of test runs).
        let prefixes = [
            format!("dotnet-diagnostic-{}-", self.pid),
            format!("clr-debug-pipe-{}-", self.pid),
        ];
        for entry in fs::read_dir("/tmp").into_iter().flatten().flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if prefixes.iter().any(|p| name.starts_with(p.as_str())) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

fn wait_with_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The value after `KEY ` on the first line that starts with it, parsed:
/// how the workloads print their measurements (`RATIO_A 0.7512`).
pub fn parse_value<T: std::str::FromStr>(lines: &[String], key: &str) -> Option<T> {
    lines.iter().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(' ')?;
        rest.trim().parse().ok()
    })
}

/// The exception types the Exceptions workload throws, as it prints them
/// (`THROWN_<type> N`).
pub const EXCEPTIONS_WORKLOAD_TYPES: [&str; 3] = [
    "System.InvalidOperationException",
    "System.ArgumentException",
    "System.TimeoutException",
];

/// All the exceptions the Exceptions workload says it threw.
pub fn exceptions_thrown(lines: &[String]) -> i64 {
    EXCEPTIONS_WORKLOAD_TYPES
        .iter()
        .map(|ty| {
            parse_value::<i64>(lines, &format!("THROWN_{ty}"))
                .unwrap_or_else(|| panic!("no THROWN_{ty} in {lines:?}"))
        })
        .sum()
}

/// What the runtime's exception counter may say of an Exceptions workload:
/// at least what it threw, at most that and the first-chance exceptions of
/// other types the process saw (`THROWN_OTHER`, printed at its exit): the
/// runtime throws some of its own, which its counter counts and a profile
/// upscaled to the counter holds even when none of them was sampled.
pub fn exceptions_counted(lines: &[String]) -> std::ops::RangeInclusive<i64> {
    let thrown = exceptions_thrown(lines);
    let others: i64 = parse_value(lines, "THROWN_OTHER")
        .unwrap_or_else(|| panic!("no THROWN_OTHER in {lines:?}"));
    thrown..=thrown + others
}

/// [`parse_value`] over a block of text such as a captured stdout.
pub fn parse_value_in<T: std::str::FromStr>(text: &str, key: &str) -> Option<T> {
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    parse_value(&lines, key)
}

/// Runs `clrbpf args...` in `cwd`, capturing stdout and stderr. Kills it
/// (SIGINT, then SIGKILL) and panics with what it printed when it runs
/// longer than `timeout`. Both streams are echoed so a failing test shows them.
pub fn run_clrbpf<S: AsRef<OsStr>>(env: &Env, args: &[S], cwd: &Path, timeout: Duration) -> Output {
    run_clrbpf_under(env, &[], args, cwd, timeout)
}

/// [`run_clrbpf`] as a root process whose capability bounding set is
/// exactly `capabilities` (Kubernetes spelling, `SYS_PTRACE`): what a
/// container that drops ALL and adds those gets (`setpriv --bounding-set`).
pub fn run_clrbpf_with_capabilities<S: AsRef<OsStr>>(
    env: &Env,
    capabilities: &[String],
    args: &[S],
    cwd: &Path,
    timeout: Duration,
) -> Output {
    let prefix = [
        "setpriv".to_owned(),
        "--bounding-set".to_owned(),
        bounding_set(capabilities),
        "--".to_owned(),
    ];
    run_clrbpf_under(env, &prefix, args, cwd, timeout)
}

/// `setpriv --bounding-set`'s argument for exactly `capabilities`
/// (Kubernetes spelling): `-all,+bpf,+perfmon,...`.
pub fn bounding_set(capabilities: &[String]) -> String {
    let mut set = "-all".to_owned();
    for capability in capabilities {
        set.push_str(",+");
        set.push_str(&capability.to_ascii_lowercase());
    }
    set
}

fn run_clrbpf_under<S: AsRef<OsStr>>(
    env: &Env,
    prefix: &[String],
    args: &[S],
    cwd: &Path,
    timeout: Duration,
) -> Output {
    let mut command = match prefix.split_first() {
        Some((program, rest)) => {
            let mut command = Command::new(program);
            command.args(rest).arg(&env.clrbpf);
            command
        }
        None => Command::new(&env.clrbpf),
    };
    command
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let shown = format!(
        "{}{} {}",
        prefix.iter().map(|p| format!("{p} ")).collect::<String>(),
        env.clrbpf.display(),
        args.iter()
            .map(|a| lossy(a.as_ref()))
            .collect::<Vec<_>>()
            .join(" ")
    );
    eprintln!("$ {shown}");
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("start `{shown}`: {e}"));
    let stdout = drain(child.stdout.take().expect("stdout is piped"));
    let stderr = drain(child.stderr.take().expect("stderr is piped"));
    let status = match wait_with_timeout(&mut child, timeout) {
        Some(status) => status,
        None => {
            let pid = child.id() as libc::pid_t;
            // SAFETY: kill has no memory preconditions; the pid is our child,
            // not yet reaped.
            unsafe { libc::kill(pid, libc::SIGINT) };
            let status = wait_with_timeout(&mut child, Duration::from_secs(10));
            if status.is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
            let stdout = stdout.join().unwrap_or_default();
            let stderr = stderr.join().unwrap_or_default();
            panic!(
                "`{shown}` ran longer than {timeout:?}; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&stdout),
                String::from_utf8_lossy(&stderr)
            );
        }
    };
    let output = Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    };
    eprintln!(
        "clrbpf exited with {}; stdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn drain(mut stream: impl std::io::Read + Send + 'static) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stream.read_to_end(&mut bytes);
        bytes
    })
}

/// Panics with clrbpf's stderr unless it exited 0.
pub fn assert_success(output: &Output) {
    assert!(
        output.status.success(),
        "clrbpf failed ({}); stderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A shell spinning on a CPU, killed when dropped: something for a
/// whole-host recording to sample, since an idle host can give a few
/// seconds of `record -a` no sample at all.
pub struct BusyShell {
    child: Child,
}

impl BusyShell {
    pub fn start() -> Self {
        let child = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .expect("start a busy shell");
        Self { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for BusyShell {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A scratch directory, removed when dropped, unless the test is failing:
/// then it is kept and its path printed, so the files can be inspected.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(label: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = env::temp_dir().join(format!(
            "clrbpf-it-{}-{}-{label}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("keeping {} for inspection", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Reads a gzip-compressed pprof file.
pub fn read_profile(path: &Path) -> Profile {
    let file = fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut bytes)
        .unwrap_or_else(|e| panic!("gunzip {}: {e}", path.display()));
    Profile::decode(bytes.as_slice())
        .unwrap_or_else(|e| panic!("decode {} as pprof: {e}", path.display()))
}

/// A label value as pprof stores it: a string or a number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LabelValue {
    Str(String),
    Num(i64),
}

/// A pprof sample with its ids resolved, for assertions.
#[derive(Clone, Debug)]
pub struct SampleView {
    pub labels: Vec<(String, LabelValue)>,
    /// Function names, leaf first; an inlined chain contributes each of its
    /// functions, innermost first, as pprof orders `Location.line`.
    pub frames: Vec<String>,
    pub values: Vec<i64>,
}

impl SampleView {
    pub fn label(&self, key: &str) -> Option<&LabelValue> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// A label read as a number, whether it was stored as one or as a
    /// decimal string.
    pub fn label_num(&self, key: &str) -> Option<i64> {
        match self.label(key)? {
            LabelValue::Num(n) => Some(*n),
            LabelValue::Str(s) => s.parse().ok(),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.label_num("process.pid")
            .and_then(|p| u32::try_from(p).ok())
    }

    /// Whether the needles occur, by substring, in this order from the leaf
    /// towards the root (not necessarily adjacent).
    pub fn stack_contains(&self, needles: &[&str]) -> bool {
        let mut frames = self.frames.iter();
        needles
            .iter()
            .all(|needle| frames.any(|frame| frame.contains(needle)))
    }
}

/// The string at `index` of the profile's string table; panics when out of range.
pub fn string(profile: &Profile, index: i64) -> &str {
    usize::try_from(index)
        .ok()
        .and_then(|i| profile.string_table.get(i))
        .unwrap_or_else(|| {
            panic!(
                "string index {index} outside the table of {}",
                profile.string_table.len()
            )
        })
}

/// Every sample, ids resolved. Panics on a dangling location or function id:
/// that is a broken profile.
pub fn samples(profile: &Profile) -> Vec<SampleView> {
    let locations: std::collections::HashMap<u64, _> =
        profile.location.iter().map(|l| (l.id, l)).collect();
    let functions: std::collections::HashMap<u64, _> =
        profile.function.iter().map(|f| (f.id, f)).collect();
    profile
        .sample
        .iter()
        .map(|sample| {
            let mut frames = Vec::new();
            for id in &sample.location_id {
                let location = locations
                    .get(id)
                    .unwrap_or_else(|| panic!("sample refers to missing location {id}"));
                for line in &location.line {
                    let function = functions.get(&line.function_id).unwrap_or_else(|| {
                        panic!(
                            "location {id} refers to missing function {}",
                            line.function_id
                        )
                    });
                    frames.push(string(profile, function.name).to_owned());
                }
            }
            let labels = sample
                .label
                .iter()
                .map(|label| {
                    let key = string(profile, label.key).to_owned();
                    let value = if label.str != 0 {
                        LabelValue::Str(string(profile, label.str).to_owned())
                    } else {
                        LabelValue::Num(label.num)
                    };
                    (key, value)
                })
                .collect();
            SampleView {
                labels,
                frames,
                values: sample.value.clone(),
            }
        })
        .collect()
}

/// The sample types as `type/unit` strings (`cpu/nanoseconds`).
pub fn sample_types(profile: &Profile) -> Vec<String> {
    profile
        .sample_type
        .iter()
        .map(|t| format!("{}/{}", string(profile, t.r#type), string(profile, t.unit)))
        .collect()
}

/// The index of sample type `type_unit` (`"cpu/nanoseconds"`) in each
/// sample's values; panics when the profile has no such type.
pub fn value_index(profile: &Profile, type_unit: &str) -> usize {
    let types = sample_types(profile);
    types
        .iter()
        .position(|t| t == type_unit)
        .unwrap_or_else(|| panic!("no sample type {type_unit} in {types:?}"))
}

/// The distinct `process.pid` labels of the profile.
pub fn pids(profile: &Profile) -> BTreeSet<u32> {
    samples(profile)
        .iter()
        .filter_map(SampleView::pid)
        .collect()
}

/// Panics unless some sample (of process `pid`, when given) has a stack
/// containing `needles` (substrings of function names, leaf to root order).
/// The message lists the heaviest stacks of that process to show what the
/// profile held instead.
pub fn assert_some_stack_contains(profile: &Profile, pid: Option<u32>, needles: &[&str]) {
    let all = samples(profile);
    let of_pid: Vec<&SampleView> = all
        .iter()
        .filter(|s| pid.is_none_or(|pid| s.pid() == Some(pid)))
        .collect();
    if of_pid.iter().any(|s| s.stack_contains(needles)) {
        return;
    }
    let mut heaviest = of_pid.clone();
    heaviest.sort_by_key(|s| std::cmp::Reverse(s.values.first().copied().unwrap_or(0)));
    let shown: Vec<String> = heaviest
        .iter()
        .take(10)
        .map(|s| format!("  {:?} {}", s.values, s.frames.join(" <- ")))
        .collect();
    panic!(
        "no stack of {} contains {needles:?}; {} of {} samples are from it, the heaviest:\n{}",
        pid.map_or_else(|| "any process".to_owned(), |p| format!("pid {p}")),
        of_pid.len(),
        all.len(),
        shown.join("\n")
    );
}

/// `go tool pprof -top FILE`: the reference reader must accept the file.
/// Returns its report.
pub fn go_pprof_top(path: &Path) -> String {
    go_pprof(path, "-top")
}

/// `go tool pprof REPORT FILE` (`-top`, `-traces`, ...), which must succeed;
/// returns its report.
pub fn go_pprof(path: &Path, report: &str) -> String {
    let output = Command::new("go")
        .args(["tool", "pprof", report])
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("start `go tool pprof` (apt-get install golang-go): {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "`go tool pprof {report} {}` failed ({}):\n{}\n{}",
        path.display(),
        output.status,
        stdout,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// `clrbpf record -p PID FLAGS -o DIR/FILE`, which must succeed; returns
/// its output and the profile's path.
pub fn record_pid(
    env: &Env,
    dir: &TempDir,
    pid: u32,
    flags: &[&str],
    file: &str,
) -> (Output, PathBuf) {
    let output_path = dir.join(file);
    let mut args = vec!["record".to_owned(), "-p".to_owned(), pid.to_string()];
    args.extend(flags.iter().map(|f| (*f).to_owned()));
    args.push("-o".to_owned());
    args.push(output_path.to_string_lossy().into_owned());
    let output = run_clrbpf(env, &args, dir.path(), RECORD_TIMEOUT);
    assert_success(&output);
    (output, output_path)
}

/// [`record_pid`] on a thread of its own, for a test that also watches the
/// process: the joined thread gives clrbpf's stderr and `kept`, where the
/// profile file `file` (one of the recording's outputs) was copied.
pub fn record_pid_in_background(
    pid: u32,
    flags: &'static [&'static str],
    file: &'static str,
    kept: PathBuf,
) -> thread::JoinHandle<(String, PathBuf)> {
    let env = Env::privileged();
    thread::spawn(move || {
        let dir = TempDir::new("record-p");
        let (output, _) = record_pid(&env, &dir, pid, flags, "p.pb.gz");
        fs::copy(dir.join(file), &kept).expect("keep the profile");
        (String::from_utf8_lossy(&output.stderr).into_owned(), kept)
    })
}

/// Starts `clrbpf record -v -a` with `args` (and `-o out`), its stderr in
/// `log`, and returns once it says sampling started: processes a test
/// starts after that are new to the recording, not known at its start
/// (those are indexed before sampling, another path).
pub fn start_whole_host_recording(env: &Env, args: &[&str], out: &Path, log: &Path) -> Child {
    let mut clrbpf = Command::new(&env.clrbpf)
        .args(["record", "-v", "-a"])
        // The driver's debug line says when sampling started.
        .args(["--log-level", "warn,clrbpf::pipeline::driver=debug"])
        .args(args)
        .arg("-o")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(log).expect("create the log"))
        .spawn()
        .expect("start clrbpf");
    let waiting = Instant::now();
    while !fs::read_to_string(log)
        .unwrap_or_default()
        .contains("sampling started")
    {
        assert!(
            waiting.elapsed() < Duration::from_secs(60),
            "clrbpf did not start sampling:\n{}",
            fs::read_to_string(log).unwrap_or_default()
        );
        assert!(
            clrbpf.try_wait().expect("clrbpf's status").is_none(),
            "clrbpf ended before sampling:\n{}",
            fs::read_to_string(log).unwrap_or_default()
        );
        thread::sleep(Duration::from_millis(50));
    }
    clrbpf
}

/// Whether a `clrbpf: warning:` line of `stderr` names `pid`: as `pid N:`
/// or in the list of a warning several processes share (`pids N, M and 3
/// more: ...`, which names the first five).
pub fn warned_about(stderr: &str, pid: u32) -> bool {
    stderr.lines().any(|line| {
        let Some(rest) = line.strip_prefix("clrbpf: warning: ") else {
            return false;
        };
        let Some((pids, _)) = rest.split_once(':') else {
            return false;
        };
        (pids.starts_with("pid ") || pids.starts_with("pids "))
            && pids
                .split(|c: char| !c.is_ascii_digit())
                .any(|word| word == pid.to_string())
    })
}

/// `(samples, lost)` from the first line of clrbpf's summary
/// (`clrbpf: recorded 5.0 s (duration), N samples from P processes, L lost, ...`).
pub fn summary_samples_and_lost(stderr: &str) -> (u64, u64) {
    let line = summary_line(stderr, "clrbpf: recorded ");
    (
        number_before(line, " samples from"),
        number_before(line, " lost"),
    )
}

/// The line of clrbpf's summary that starts with `prefix`.
pub fn summary_line<'a>(stderr: &'a str, prefix: &str) -> &'a str {
    stderr
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{stderr}"))
}

/// The number written just before `word` in a summary line (`1,234 samples`
/// and `(56 unwound` both read).
pub fn number_before(line: &str, word: &str) -> u64 {
    let at = line
        .find(word)
        .unwrap_or_else(|| panic!("no `{word}` in {line:?}"));
    line[..at]
        .split_whitespace()
        .last()
        .and_then(|n| n.trim_start_matches('(').trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("no number before `{word}` in {line:?}"))
}

/// How long one `clrbpf record` of a test may take.
const RECORD_TIMEOUT: Duration = Duration::from_secs(120);

/// Checks that `text` is well-formed folded stacks (`a;b;c 12` per line,
/// as inferno and Brendan Gregg's flamegraph.pl read them) and returns the
/// lines as (frames root first, count). Frame names may contain spaces (C++
/// and CLR signatures do), so the count is what follows the last space.
pub fn parse_folded(text: &str) -> Vec<(Vec<String>, u64)> {
    assert!(!text.trim().is_empty(), "the folded-stacks file is empty");
    text.lines()
        .enumerate()
        .map(|(n, line)| {
            let (stack, count) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("folded line {} has no count: {line:?}", n + 1));
            let count: u64 = count
                .parse()
                .unwrap_or_else(|_| panic!("folded line {} ends in no count: {line:?}", n + 1));
            assert!(count > 0, "folded line {} has count 0: {line:?}", n + 1);
            let frames: Vec<String> = stack.split(';').map(str::to_owned).collect();
            assert!(
                !stack.is_empty() && frames.iter().all(|f| !f.is_empty()),
                "folded line {} has an empty frame: {line:?}",
                n + 1
            );
            (frames, count)
        })
        .collect()
}

/// The capability list of the Helm chart (`securityContext.capabilities.add`
/// in deploy/helm/clrbpf/values.yaml), Kubernetes spelling.
pub fn chart_capabilities() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/clrbpf/values.yaml");
    let values =
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let listed: Vec<String> = values
        .lines()
        .skip_while(|l| l.trim() != "add:")
        .skip(1)
        .map_while(|l| l.trim().strip_prefix("- "))
        .map(|item| item.split('#').next().unwrap_or("").trim().to_owned())
        .collect();
    assert!(
        listed.len() >= 3,
        "no capability list under `add:` in {}",
        path.display()
    );
    listed
}

/// A .NET workload started the way a container runtime starts a container
/// of a Kubernetes pod: its own PID and mount namespaces with a private
/// /tmp (tmpfs), running as a non-root user, in a cgroup named as
/// containerd names it under the kubelet's systemd driver
/// (`kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`,
/// on the cgroup2 hierarchy: `/sys/fs/cgroup/unified` on hybrid hosts).
/// Killed, and its cgroups removed, when dropped.
pub struct ContainerTarget {
    child: Child,
    host_pid: u32,
    scope: PathBuf,
    /// How many of the scope's parents the test made (removed when empty).
    parents: usize,
    lines: Arc<Mutex<Vec<String>>>,
    /// The 64-hex container id in the cgroup path.
    pub container_id: String,
    /// The pod uid in the cgroup path (dashes).
    pub pod_uid: String,
}

impl ContainerTarget {
    /// Starts workload `name` with `args` as `uid`:`uid` and waits for its
    /// `READY` line. Without `DOTNET_PerfMapEnabled`: only an attaching
    /// profiler can name its JIT frames.
    pub fn start(env: &Env, runtime: Runtime, name: &str, args: &[&str], uid: u32) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let seed = format!("{:08x}{:08x}", std::process::id(), n);
        let container_id = format!("{seed}{}", "c0ffee".repeat(8))
            .chars()
            .take(64)
            .collect::<String>();
        let pod_uid = format!("{}-4b2a-4e8d-9c1b-{}", &seed[..8], &seed[4..16]);
        let pod_slice = format!("kubepods-burstable-pod{}.slice", pod_uid.replace('-', "_"));
        let scope = Path::new("kubepods.slice/kubepods-burstable.slice")
            .join(pod_slice)
            .join(format!("cri-containerd-{container_id}.scope"));
        Self::start_in_cgroup(env, runtime, name, args, uid, &scope, container_id, pod_uid)
    }

    /// Starts workload `name` as [`Self::start`] does, in the cgroup at
    /// `scope` (relative to the cgroup2 root), whatever its path says:
    /// how a forger places itself. `container_id` and `pod_uid` are what
    /// the path names, for the test to compare with.
    #[expect(clippy::too_many_arguments, reason = "a test harness constructor")]
    pub fn start_in_cgroup(
        env: &Env,
        runtime: Runtime,
        name: &str,
        args: &[&str],
        uid: u32,
        scope: &Path,
        container_id: String,
        pod_uid: String,
    ) -> Self {
        let parents = scope.components().count().saturating_sub(1);
        let scope = cgroup2_root().join(scope);
        fs::create_dir_all(&scope)
            .unwrap_or_else(|e| panic!("create cgroup {}: {e}", scope.display()));
        let dotnet = env.dotnet(runtime);
        let dll = env.workload(runtime, name);
        // As root in the new namespaces: join the cgroup (0 = this process),
        // mount a private /tmp, then drop to the app's user and exec.
        let script = format!(
            "echo 0 > '{}/cgroup.procs' && mount -t tmpfs -o mode=1777 tmpfs /tmp && exec setpriv --reuid {uid} --regid {uid} --clear-groups -- env -u {ENV_PERF_MAP} HOME=/tmp \"$@\"",
            scope.display()
        );
        let mut command = Command::new("unshare");
        command
            .args([
                "--pid",
                "--fork",
                "--mount",
                "--mount-proc",
                "--propagation",
                "private",
            ])
            .args(["sh", "-c", &script, "sh"])
            .arg(dotnet)
            .arg(&dll)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start {name} in its own namespaces (unshare): {e}"));
        let stdout = child.stdout.take().expect("stdout is piped");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = mpsc::channel();
        {
            let lines = Arc::clone(&lines);
            thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if line == "READY" {
                        let _ = ready_tx.send(());
                    }
                    lines.lock().expect("reader never panics").push(line);
                }
            });
        }
        let mut target = Self {
            child,
            host_pid: 0,
            scope,
            parents,
            lines,
            container_id,
            pod_uid,
        };
        if ready_rx.recv_timeout(READY_TIMEOUT).is_err() {
            panic!(
                "workload {name} in its container did not print READY within {READY_TIMEOUT:?}; stdout so far: {:?}",
                target.lines.lock().expect("reader never panics")
            );
        }
        let procs = fs::read_to_string(target.scope.join("cgroup.procs")).unwrap_or_default();
        let pids: Vec<u32> = procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        assert_eq!(
            pids.len(),
            1,
            "the container cgroup should hold the workload alone: {pids:?}"
        );
        target.host_pid = pids[0];
        let status =
            fs::read_to_string(format!("/proc/{}/status", target.host_pid)).unwrap_or_default();
        assert!(
            status
                .lines()
                .any(|l| l.starts_with("Uid:")
                    && l.split_whitespace().nth(2) == Some(&uid.to_string())),
            "the workload should run as uid {uid}:\n{status}"
        );
        assert!(
            status
                .lines()
                .any(|l| l.starts_with("NSpid:") && l.split_whitespace().count() == 3),
            "the workload should run in its own PID namespace:\n{status}"
        );
        target
    }

    /// The workload's pid on the host.
    pub fn pid(&self) -> u32 {
        self.host_pid
    }
}

impl Drop for ContainerTarget {
    fn drop(&mut self) {
        if self.host_pid != 0 {
            // SAFETY: kill has no memory preconditions. The workload is the
            // init of its PID namespace: killing it ends the namespace.
            unsafe { libc::kill(self.host_pid as libc::pid_t, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The scope, then its now-empty parents up to the top one (another
        // test's pod may still be there: rmdir fails on non-empty dirs).
        let deadline = Instant::now() + Duration::from_secs(5);
        while fs::remove_dir(&self.scope).is_err() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(50));
        }
        let mut dir = self.scope.parent();
        for _ in 0..self.parents {
            let Some(d) = dir else { break };
            if fs::remove_dir(d).is_err() {
                break;
            }
            dir = d.parent();
        }
    }
}

/// Where the cgroup2 hierarchy is mounted: `/sys/fs/cgroup/unified` on a
/// hybrid host, `/sys/fs/cgroup` on a cgroup2-only one.
fn cgroup2_root() -> PathBuf {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let cgroup2: Vec<&str> = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, kind) = (f.next(), f.next()?, f.next()?);
            (kind == "cgroup2").then_some(at)
        })
        .collect();
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .find(|p| cgroup2.contains(p))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no cgroup2 hierarchy mounted (mounts: {cgroup2:?})"))
}

/// One HTTP/1.1 request read by a loopback receiver that stands in for a
/// backend (no Pyroscope or collector server can run here).
pub struct HttpRequest {
    /// The request line and headers, lower-cased.
    pub head: String,
    pub path: String,
    pub body: Vec<u8>,
}

impl HttpRequest {
    /// Reads a request whose body has a Content-Length; `None` when the
    /// client goes away first.
    pub fn read(stream: &mut std::net::TcpStream) -> Option<Self> {
        use std::io::Read as _;
        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
        let mut data = Vec::new();
        let mut buf = [0u8; 65536];
        let head_end = loop {
            if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => return None,
                Ok(n) => data.extend_from_slice(&buf[..n]),
            }
        };
        let head = String::from_utf8_lossy(&data[..head_end]).to_ascii_lowercase();
        let mut request = Self {
            path: head
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_owned(),
            head,
            body: Vec::new(),
        };
        let length: usize = request
            .header("content-length:")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while data.len() < head_end + length {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => return None,
                Ok(n) => data.extend_from_slice(&buf[..n]),
            }
        }
        request.body = data[head_end..head_end + length].to_vec();
        Some(request)
    }

    /// A header's value; `name` is lower-case and ends with `:`.
    pub fn header(&self, name: &str) -> Option<String> {
        self.head
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
    }

    pub fn is_gzip(&self) -> bool {
        self.header("content-encoding:")
            .is_some_and(|v| v == "gzip")
    }
}

/// What a measured run of clrbpf gave.
pub struct Measured {
    pub status: ExitStatus,
    pub stderr: String,
    /// The clrbpf process's peak RSS (`VmHWM`), in bytes.
    pub peak_rss: u64,
    pub took: Duration,
}

/// Runs `clrbpf args...` and measures its peak RSS (`VmHWM`, read every
/// 10 ms while it runs: `wait4`'s `ru_maxrss` would count the RSS of this
/// test process, which the child had between its fork and its exec);
/// kills it and panics after `timeout`.
pub fn run_measured(env: &Env, args: &[OsString], timeout: Duration) -> Measured {
    eprintln!("$ {} {}", env.clrbpf.display(), shown(args));
    let started = Instant::now();
    let mut child = Command::new(&env.clrbpf)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start clrbpf");
    let mut pipe = child.stderr.take().expect("stderr is piped");
    let reader = thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    });
    let mut peak_rss = 0;
    let status = loop {
        // Read before the exit is looked for: the last read sees the
        // process as it ended (a zombie has no VmHWM).
        peak_rss = agent::status_bytes(child.id(), "VmHWM:")
            .unwrap_or(0)
            .max(peak_rss);
        if let Some(status) = child.try_wait().expect("wait for clrbpf") {
            break status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("clrbpf ran longer than {timeout:?}");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let took = started.elapsed();
    let stderr = reader.join().unwrap_or_default();
    eprintln!("{stderr}");
    eprintln!(
        "clrbpf exited with {status} after {took:?}, peak RSS {} MiB",
        peak_rss >> 20
    );
    Measured {
        status,
        stderr,
        peak_rss,
        took,
    }
}

fn shown(args: &[OsString]) -> String {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use clrbpf::pprof_proto::{Function, Label, Line, Location, Sample, ValueType};

    use super::*;

    fn tiny_profile() -> Profile {
        let strings = [
            "",
            "samples",
            "count",
            "cpu",
            "nanoseconds",
            "Hot.Spin",
            "Hot.Main",
            "process.pid",
            "thread.name",
            "main",
        ];
        Profile {
            string_table: strings.iter().map(|s| (*s).to_owned()).collect(),
            sample_type: vec![
                ValueType { r#type: 1, unit: 2 },
                ValueType { r#type: 3, unit: 4 },
            ],
            function: vec![
                Function {
                    id: 1,
                    name: 5,
                    ..Default::default()
                },
                Function {
                    id: 2,
                    name: 6,
                    ..Default::default()
                },
            ],
            location: vec![
                Location {
                    id: 1,
                    line: vec![Line {
                        function_id: 1,
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                Location {
                    id: 2,
                    line: vec![Line {
                        function_id: 2,
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ],
            sample: vec![Sample {
                location_id: vec![1, 2],
                value: vec![3, 30_000_000],
                label: vec![
                    Label {
                        key: 7,
                        num: 42,
                        ..Default::default()
                    },
                    Label {
                        key: 8,
                        str: 9,
                        ..Default::default()
                    },
                ],
            }],
            ..Default::default()
        }
    }

    #[test]
    fn samples_resolve_frames_leaf_first_and_labels() {
        let profile = tiny_profile();
        let samples = samples(&profile);
        assert_eq!(samples.len(), 1);
        assert_eq!(samples[0].frames, ["Hot.Spin", "Hot.Main"]);
        assert_eq!(samples[0].pid(), Some(42));
        assert_eq!(
            samples[0].label("thread.name"),
            Some(&LabelValue::Str("main".to_owned()))
        );
        assert_eq!(sample_types(&profile), ["samples/count", "cpu/nanoseconds"]);
        assert_eq!(value_index(&profile, "cpu/nanoseconds"), 1);
    }

    #[test]
    fn stack_contains_wants_the_needles_in_leaf_to_root_order() {
        let profile = tiny_profile();
        let sample = &samples(&profile)[0];
        assert!(sample.stack_contains(&["Hot.Spin", "Hot.Main"]));
        assert!(!sample.stack_contains(&["Hot.Main", "Hot.Spin"]));
        assert!(!sample.stack_contains(&["Cold"]));
        assert_some_stack_contains(&profile, Some(42), &["Hot.Spin"]);
        assert_some_stack_contains(&profile, None, &["Hot.Main"]);
    }

    #[test]
    #[should_panic(expected = "no stack of pid 7 contains")]
    fn assert_some_stack_contains_checks_the_pid() {
        assert_some_stack_contains(&tiny_profile(), Some(7), &["Hot.Spin"]);
    }

    #[test]
    #[should_panic(expected = "missing function")]
    fn a_dangling_function_id_is_a_broken_profile() {
        let mut profile = tiny_profile();
        profile.function.pop();
        samples(&profile);
    }

    #[test]
    fn parse_value_reads_workload_measurements() {
        let lines = ["PID 12", "READY", "RATIO_A 0.7512", "RATIO_AB 3"].map(String::from);
        assert_eq!(parse_value::<u32>(&lines, "PID"), Some(12));
        assert_eq!(parse_value::<f64>(&lines, "RATIO_A"), Some(0.7512));
        assert_eq!(parse_value::<u32>(&lines, "MISSING"), None);
        assert_eq!(
            parse_value_in::<u32>("x\nRATIO_AB 3\n", "RATIO_AB"),
            Some(3)
        );
    }

    #[test]
    fn parse_folded_accepts_spaces_inside_frames() {
        let parsed = parse_folded("main;Foo::Bar(value class X) 3\nmain 1\n");
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].0, ["main", "Foo::Bar(value class X)"]);
        assert_eq!(parsed[0].1, 3);
    }

    #[test]
    #[should_panic(expected = "ends in no count")]
    fn parse_folded_rejects_a_line_without_count() {
        parse_folded("main;foo bar\n");
    }

    #[test]
    #[should_panic(expected = "empty frame")]
    fn parse_folded_rejects_empty_frames() {
        parse_folded("main;;foo 2\n");
    }
}
