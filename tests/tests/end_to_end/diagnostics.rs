//! The diagnostic IPC client against real .NET 8 and .NET Core 3.1
//! processes, through the library's API (no BPF): EnablePerfMap and its
//! replay, the perf-map attach and its clean-up, ProcessInfo through a
//! socket path longer than `sun_path`, real EventPipe sessions and their
//! clock, and `clrbpf ps`'s rows. Each test starts the `Hot` workload
//! without `DOTNET_PerfMapEnabled` and touches only that process and its own
//! files in `/tmp`.

use std::{
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use clrbpf::{
    clr::{
        ipc::{DiagnosticClient, DiagnosticPort, PerfMapType, RuntimeError},
        perf_map_attach::{PerfMapAttach, PerfMapAttachOutcome, PerfMapUnsupported},
        session::{ClrEventKinds, ClrSession, method_rundown},
    },
    process::ProcFs,
    ps::{UserNames, dotnet_processes, print_ps_table},
    symbolize::perf_files::perf_file_names,
};
use clrbpf_integration_tests::{Env, Launch, Runtime, TempDir, TestProcess};

/// Long enough for any test here; the process is killed on drop.
const HOT_SECONDS: &str = "300";

/// `Hot` on `runtime` with `launch`, once `Hot.Spin` has been compiled (it
/// is called thousands of times a second from `READY` on).
fn start_hot(env: &Env, runtime: Runtime, launch: &Launch) -> TestProcess {
    let app = TestProcess::launch(env, runtime, "Hot", &[HOT_SECONDS], launch);
    thread::sleep(Duration::from_millis(300));
    app
}

/// The runtime creates its socket early in startup, before Main; wait for
/// it anyway, a loaded machine can be slow.
fn client_of(pid: u32) -> DiagnosticClient {
    let procfs = ProcFs::default();
    let mut last = None;
    for _ in 0..200 {
        match DiagnosticClient::discover(&procfs, pid) {
            Ok(client) => return client,
            Err(e) => last = Some(e),
        }
        thread::sleep(Duration::from_millis(50));
    }
    panic!("no diagnostic socket for {pid}: {last:?}");
}

fn is_running(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Waits up to 20 s until `path` contains `needle`: the runtime writes the
/// replay on its own schedule, and a loaded 2-core machine can be slow to
/// get to it.
fn wait_for_content(path: &Path, needle: &str) -> String {
    let mut content = String::new();
    for _ in 0..400 {
        content = std::fs::read_to_string(path).unwrap_or_default();
        if content.contains(needle) {
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    content
}

fn remove_stale(pid: u32) {
    for name in perf_file_names(pid) {
        let _ = std::fs::remove_file(Path::new("/tmp").join(name));
    }
}

#[test]
fn net8_enable_perf_map_replays_compiled_methods() {
    let env = Env::from_env();
    let app = start_hot(&env, Runtime::Net8, &Launch::default());
    let pid = app.pid();
    remove_stale(pid);
    let perf_map = PathBuf::from(format!("/tmp/perf-{pid}.map"));
    assert!(!perf_map.exists(), "perf map before enabling");
    let client = client_of(pid);
    client
        .enable_perf_map(PerfMapType::All)
        .expect("EnablePerfMap");
    // Hot.Spin was compiled before the attach: the replay lists it.
    let content = wait_for_content(&perf_map, "Hot::Spin");
    assert!(
        content.contains("Hot::Spin"),
        "perf map without Hot::Spin:\n{content}"
    );
    assert!(Path::new(&format!("/tmp/jit-{pid}.dump")).exists());
    client.disable_perf_map().expect("DisablePerfMap");
    remove_stale(pid);
}

#[test]
fn net8_perf_map_attach_and_cleanup() {
    let env = Env::from_env();
    let app = start_hot(&env, Runtime::Net8, &Launch::default());
    let pid = app.pid();
    remove_stale(pid);
    let _ = client_of(pid);
    let outcome =
        PerfMapAttach::attach(&DiagnosticPort::new(&ProcFs::default(), pid)).expect("attach");
    let PerfMapAttachOutcome::Enabled(attach) = outcome else {
        panic!("expected perf maps enabled, got {outcome:?}");
    };
    assert!(
        attach
            .runtime_version()
            .is_some_and(|v| v.starts_with("8.0.")),
        "{:?}",
        attach.runtime_version()
    );
    let perf_map = PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let content = wait_for_content(&perf_map, "Hot::Spin");
    assert!(
        content.contains("Hot::Spin"),
        "perf map without Hot::Spin:\n{content}"
    );
    let cleanup = attach.finish(false);
    assert!(cleanup.disable.is_ok(), "{:?}", cleanup.disable);
    assert!(cleanup.files.failed.is_empty(), "{:?}", cleanup.files);
    assert!(!perf_map.exists(), "perf map left behind");
    assert!(!Path::new(&format!("/tmp/jit-{pid}.dump")).exists());
    assert!(
        cleanup
            .files
            .removed
            .iter()
            .any(|p| p.ends_with(format!("perf-{pid}.map"))),
        "{:?}",
        cleanup.files
    );
    assert!(is_running(pid), "the target died");
}

#[test]
fn net8_perf_map_attach_respects_the_environment() {
    let env = Env::from_env();
    let launch = Launch {
        env: &[("DOTNET_PerfMapEnabled", "3")],
        ..Launch::default()
    };
    let app = start_hot(&env, Runtime::Net8, &launch);
    let _ = client_of(app.pid());
    let outcome =
        PerfMapAttach::attach(&DiagnosticPort::new(&ProcFs::default(), app.pid())).expect("attach");
    assert!(
        matches!(outcome, PerfMapAttachOutcome::AlreadyEnabled { setting: 3 }),
        "{outcome:?}"
    );
    remove_stale(app.pid());
}

#[test]
fn net8_process_info_through_a_long_tmpdir() {
    let env = Env::from_env();
    // The runtime binds its socket here, so this path must stay under 108
    // bytes; /proc/PID/root in front pushes ours over.
    let base = TempDir::new("long-tmpdir");
    let budget = 107usize.saturating_sub(base.path().as_os_str().len() + 48);
    let tmpdir = base.join(&"t".repeat(budget.max(1)));
    std::fs::create_dir(&tmpdir).expect("mkdir");
    let tmpdir_str = tmpdir.to_str().expect("utf-8 temp dir");
    let launch = Launch {
        env: &[("TMPDIR", tmpdir_str)],
        ..Launch::default()
    };
    let app = start_hot(&env, Runtime::Net8, &launch);
    let client = client_of(app.pid());
    assert!(
        client
            .socket_path()
            .starts_with(format!("/proc/{}/root", app.pid())),
        "{}",
        client.socket_path().display()
    );
    assert!(
        client.socket_path().as_os_str().len() > 108,
        "path {} is short enough for sun_path: the test proves nothing",
        client.socket_path().display()
    );
    let info = client.process_info().expect("ProcessInfo2");
    assert_eq!(info.pid, u64::from(app.pid()));
    assert!(
        info.command_line.contains("Hot.dll"),
        "{}",
        info.command_line
    );
    assert_eq!(info.os, "Linux");
    assert!(!info.arch.is_empty());
    assert_eq!(info.managed_entrypoint_assembly.as_deref(), Some("Hot"));
    assert_eq!(
        info.runtime_major(),
        Some(8),
        "{:?}",
        info.clr_product_version
    );
}

/// A real session: the runtime's event clock is CLOCK_MONOTONIC (the clock
/// of BPF samples), on .NET 8 and 3.1, and the rundown lists the method
/// compiled before it.
#[test]
fn real_sessions_use_the_monotonic_clock_and_rundown_lists_methods() {
    let env = Env::from_env();
    for runtime in [Runtime::Net8, Runtime::NetCore31] {
        let app = start_hot(&env, runtime, &Launch::default());
        let _ = client_of(app.pid());
        let procfs = ProcFs::default();
        let session = ClrSession::start(
            &DiagnosticClient::discover(&procfs, app.pid()).expect("discover"),
            ClrEventKinds::ALL,
            None,
        )
        .expect("start");
        let (methods, error) = method_rundown(
            &DiagnosticClient::discover(&procfs, app.pid()).expect("discover"),
            Duration::from_secs(10),
        )
        .expect("rundown");
        assert!(error.is_none(), "{runtime:?}: {error:?}");
        assert!(
            methods
                .iter()
                .any(|m| m.display_name().contains("Hot::Spin")),
            "{runtime:?}: rundown without Hot::Spin ({} methods)",
            methods.len()
        );
        thread::sleep(Duration::from_millis(300));
        let (end, stop_error) = session.stop(Instant::now() + Duration::from_secs(5), &mut |_| {});
        assert!(stop_error.is_none(), "{runtime:?}: {stop_error:?}");
        assert!(end.error.is_none(), "{runtime:?}: {:?}", end.error);
        let skew = end.clock_skew_ns.expect("a trace header");
        assert!(
            skew.abs() < 2_000_000_000,
            "{runtime:?}: event clock {skew} ns away from CLOCK_MONOTONIC"
        );
        assert!(is_running(app.pid()), "{runtime:?}: the target died");
    }
}

#[test]
fn netcore31_has_no_process_info_and_no_perf_map_command() {
    let env = Env::from_env();
    let app = start_hot(&env, Runtime::NetCore31, &Launch::default());
    let client = client_of(app.pid());
    let err = client.process_info().expect_err("3.1 has no ProcessInfo");
    assert_eq!(
        err.runtime_error(),
        Some(RuntimeError::UnknownCommand),
        "{err:?}"
    );
    let outcome =
        PerfMapAttach::attach(&DiagnosticPort::new(&ProcFs::default(), app.pid())).expect("attach");
    let PerfMapAttachOutcome::Unsupported(PerfMapUnsupported::BeforeNet8 { version }) = outcome
    else {
        panic!("expected unsupported, got {outcome:?}");
    };
    assert!(
        version.as_deref().is_some_and(|v| v.starts_with("3.1.")),
        "{version:?}"
    );
    assert!(is_running(app.pid()), "the target died");
}

#[test]
fn ps_lists_net8_and_netcore31_processes() {
    let env = Env::from_env();
    let net8 = start_hot(&env, Runtime::Net8, &Launch::default());
    let net31 = start_hot(
        &env,
        Runtime::NetCore31,
        &Launch {
            perf_map: true,
            ..Launch::default()
        },
    );
    let _ = (client_of(net8.pid()), client_of(net31.pid()));
    // Another profiler on this host (a whole-host recording) may turn perf
    // maps on in any .NET 8 process: the row says what the file says.
    let net8_map = PathBuf::from(format!("/tmp/perf-{}.map", net8.pid()));
    let map_before = net8_map.exists();
    let rows = dotnet_processes(&ProcFs::default());
    let map_after = net8_map.exists();
    let row = |pid: u32| {
        rows.iter()
            .find(|r| r.pid == pid)
            .unwrap_or_else(|| panic!("pid {pid} missing from {rows:#?}"))
    };
    let row8 = row(net8.pid());
    assert_eq!(row8.runtime_version.as_deref(), Some("8.0.4"));
    assert!(
        row8.perf_map_enabled || !map_before,
        "{row8:?}: its perf map exists"
    );
    assert!(
        !row8.perf_map_enabled || map_after,
        "{row8:?}: no perf map, DOTNET_PerfMapEnabled unset"
    );
    assert!(row8.diagnostic_socket.is_some());
    assert!(
        row8.command_line.contains("Hot.dll"),
        "{}",
        row8.command_line
    );
    let row31 = row(net31.pid());
    assert!(
        row31
            .runtime_version
            .as_deref()
            .is_some_and(|v| v.starts_with("3.1.")),
        "{row31:?}"
    );
    assert!(row31.perf_map_enabled);
    let mut table = Vec::new();
    print_ps_table(&rows, &UserNames::from_host(), &mut table).expect("print");
    let table = String::from_utf8(table).expect("utf-8");
    assert!(
        table
            .lines()
            .any(|l| l.trim_start().starts_with(&net8.pid().to_string())),
        "{table}"
    );
    remove_stale(net8.pid());
    remove_stale(net31.pid());
}
