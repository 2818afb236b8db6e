//! `clrbpf ps`: the .NET processes of the host, with what the profiler will
//! do with each: the runtime version, the user it runs as, the service name
//! the agent would give it, its pod and container, and where the names of
//! its managed frames will come from.
//!
//! Which processes run .NET, and what their runtime offers, is the .NET
//! loader's to say, through the runtime seam
//! ([`crate::runtime::RuntimeLoader::describe`]); this module lists the
//! processes and prints the table or the JSON.

use std::{
    io::{self, Write},
    path::PathBuf,
};

use crate::process::{ProcError, ProcFs, ProcessInfo, list_pids};
use crate::{clr::instance::DotnetLoader, runtime::RuntimeLoader};

/// Container ids are shown shortened, like `docker ps` does.
const SHORT_CONTAINER_ID: usize = 12;
/// Of /etc/passwd, at most this much is read to name users.
const PASSWD_MAX_BYTES: u64 = 1 << 20;
/// Shown for a process whose service the Kubernetes API would name.
pub const POD_WORKLOAD: &str = "(its pod's workload)";

/// Where the names of a process's managed frames will come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameSource {
    /// The runtime writes perf map files already (DOTNET_PerfMapEnabled).
    PerfMap,
    /// clrbpf asks the runtime through its diagnostic socket (to write perf
    /// maps on .NET 8+, to list its methods on older ones).
    Socket,
    /// Neither: clrbpf reads them from the runtime's memory.
    Memory,
}

impl NameSource {
    /// The word `ps` shows.
    pub fn word(self) -> &'static str {
        match self {
            Self::PerfMap => "perf map",
            Self::Socket => "socket",
            Self::Memory => "memory",
        }
    }
}

/// One line of `clrbpf ps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DotnetProcessRow {
    pub pid: u32,
    /// Effective uid.
    pub uid: u32,
    /// `"8.0.4"`; `None` if neither the mappings nor the runtime told.
    pub runtime_version: Option<String>,
    pub command_line: String,
    /// The service name the agent would give it: from its environment
    /// (`OTEL_SERVICE_NAME`, ...), else [`POD_WORKLOAD`] in a pod, else the
    /// entry assembly or executable.
    pub service: String,
    pub container_id: Option<String>,
    /// The pod uid, from its cgroup.
    pub pod_uid: Option<String>,
    /// The process writes `perf-<nspid>.map` already: its environment turns
    /// it on (`DOTNET_PerfMapEnabled`/`COMPlus_PerfMapEnabled` non-zero) or
    /// the file exists in its temp directory.
    pub perf_map_enabled: bool,
    /// Host path of the diagnostic socket, if one was found (a socket, in
    /// the target's root, named for its namespace pid).
    pub diagnostic_socket: Option<PathBuf>,
}

impl DotnetProcessRow {
    pub fn names(&self) -> NameSource {
        if self.perf_map_enabled {
            NameSource::PerfMap
        } else if self.diagnostic_socket.is_some() {
            NameSource::Socket
        } else {
            NameSource::Memory
        }
    }
}

/// What `ps` found: the rows, and how many processes it could not look
/// into (other users' processes, for a user who is not root).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DotnetListing {
    pub rows: Vec<DotnetProcessRow>,
    pub hidden: usize,
}

impl DotnetListing {
    /// The note for a listing that is not complete.
    pub fn hidden_note(&self) -> Option<String> {
        (self.hidden > 0).then(|| {
            format!(
                "{} processes of other users could not be read and are not listed, .NET or not: run `sudo clrbpf ps` to see them all",
                self.hidden
            )
        })
    }
}

/// The .NET processes under `procfs`, by pid. Processes that vanish or
/// cannot be read are left out.
pub fn dotnet_processes(procfs: &ProcFs) -> Vec<DotnetProcessRow> {
    list_dotnet_processes(procfs).rows
}

/// [`dotnet_processes`], with the count of processes that could not be read.
pub fn list_dotnet_processes(procfs: &ProcFs) -> DotnetListing {
    let loader = DotnetLoader::for_listing();
    let mut listing = DotnetListing::default();
    for pid in list_pids(procfs) {
        match dotnet_process(procfs, &loader, pid) {
            Ok(Some(row)) => listing.rows.push(row),
            Ok(None) => {}
            Err(ProcError::PermissionDenied { .. }) => listing.hidden += 1,
            Err(_) => {}
        }
    }
    listing
}

fn dotnet_process(
    procfs: &ProcFs,
    loader: &impl RuntimeLoader,
    pid: u32,
) -> Result<Option<DotnetProcessRow>, ProcError> {
    let maps = procfs.maps(pid)?;
    // Kernel threads have no mappings.
    if maps.is_empty() {
        return Ok(None);
    }
    let info = procfs.process_info(pid)?;
    let Some(runtime) = loader.describe(procfs, &info, &maps) else {
        return Ok(None);
    };
    let service = service_of(procfs, &info);
    Ok(Some(DotnetProcessRow {
        pid,
        uid: info.uid,
        runtime_version: runtime.version,
        command_line: info.command_line(),
        service,
        container_id: info.container_id,
        pod_uid: info.pod_uid,
        perf_map_enabled: runtime.names_written,
        diagnostic_socket: runtime.control_socket,
    }))
}

/// As the agent names it ([`crate::agent::config::service_name`]), but
/// without the Kubernetes API: a pod's workload is shown as such.
fn service_of(procfs: &ProcFs, info: &ProcessInfo) -> String {
    let environ = procfs.environ(info.pid).unwrap_or_default();
    let entry_assembly = (info.exe_name == "dotnet")
        .then(|| crate::agent::ship::entry_assembly(&info.cmdline))
        .flatten();
    let program = entry_assembly.as_deref().unwrap_or(&info.exe_name);
    let workload = info.pod_uid.as_ref().map(|_| POD_WORKLOAD);
    crate::agent::config::service_name(&environ, workload, program)
}

/// User names by uid, from the host's /etc/passwd (a process in a container
/// may have a uid it does not list: then the number is shown).
pub struct UserNames {
    passwd: String,
}

impl UserNames {
    pub fn from_host() -> Self {
        use std::io::Read as _;
        let mut passwd = String::new();
        if let Ok(file) = std::fs::File::open("/etc/passwd") {
            let _ = file.take(PASSWD_MAX_BYTES).read_to_string(&mut passwd);
        }
        Self { passwd }
    }

    pub fn from_passwd(passwd: &str) -> Self {
        Self {
            passwd: passwd.to_owned(),
        }
    }

    pub fn name(&self, uid: u32) -> String {
        let uid_text = uid.to_string();
        self.passwd
            .lines()
            .find_map(|line| {
                let mut fields = line.split(':');
                let name = fields.next()?;
                (fields.nth(1)? == uid_text && !name.is_empty()).then(|| name.to_owned())
            })
            .unwrap_or(uid_text)
    }
}

/// A value the process chose, made safe for a terminal.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// Writes `rows` as an aligned table with a header, like `ps`; the command
/// line is the last column and is not cut.
pub fn print_ps_table(
    rows: &[DotnetProcessRow],
    users: &UserNames,
    mut w: impl Write,
) -> io::Result<()> {
    const HEADER: [&str; 8] = [
        "PID",
        "USER",
        "RUNTIME",
        "SERVICE",
        "NAMES FROM",
        "POD",
        "CONTAINER",
        "COMMAND",
    ];
    let short = |id: &Option<String>, n: usize| {
        id.as_deref()
            .map(|id| id.chars().take(n).collect())
            .unwrap_or_else(|| "-".into())
    };
    let cells: Vec<[String; 8]> = rows
        .iter()
        .map(|row| {
            [
                row.pid.to_string(),
                users.name(row.uid),
                row.runtime_version.clone().unwrap_or_else(|| "?".into()),
                printable(&row.service),
                row.names().word().to_owned(),
                short(&row.pod_uid, 8),
                short(&row.container_id, SHORT_CONTAINER_ID),
                printable(&row.command_line),
            ]
        })
        .collect();
    let mut widths = HEADER.map(str::len);
    for row in &cells {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header = HEADER.map(String::from);
    for row in std::iter::once(&header).chain(&cells) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i == 0 {
                // Numbers right-aligned, like ps.
                line.push_str(&format!("{cell:>width$}", width = widths[0]));
            } else if i == row.len() - 1 {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}", width = widths[i]));
            }
            if i != row.len() - 1 {
                line.push_str("  ");
            }
        }
        writeln!(w, "{}", line.trim_end())?;
    }
    Ok(())
}

/// `clrbpf ps --json`: one JSON document, `{"processes": [...],
/// "hidden_processes": N, "note": ...}`, values as read (JSON escapes them).
pub fn print_ps_json(
    listing: &DotnetListing,
    users: &UserNames,
    mut w: impl Write,
) -> io::Result<()> {
    let processes: Vec<serde_json::Value> = listing
        .rows
        .iter()
        .map(|row| {
            serde_json::json!({
                "pid": row.pid,
                "uid": row.uid,
                "user": users.name(row.uid),
                "runtime_version": row.runtime_version,
                "service": row.service,
                "names_from": row.names().word(),
                "perf_map_enabled": row.perf_map_enabled,
                "diagnostic_socket": row.diagnostic_socket.as_ref().map(|p| p.display().to_string()),
                "pod_uid": row.pod_uid,
                "container_id": row.container_id,
                "command_line": row.command_line,
            })
        })
        .collect();
    let document = serde_json::json!({
        "processes": processes,
        "hidden_processes": listing.hidden,
        "note": listing.hidden_note(),
    });
    serde_json::to_writer_pretty(&mut w, &document).map_err(io::Error::other)?;
    writeln!(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::tests::fake_process;
    use std::{fs, os::unix::net::UnixListener};

    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn status(pid: u32, ns_pid: u32) -> String {
        format!("Name:\tdotnet\nPPid:\t1\nUid:\t0\t0\t0\t0\nNSpid:\t{pid}\t{ns_pid}\n")
    }

    fn stat(pid: u32, start: u64) -> String {
        format!("{pid} (dotnet) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0\n")
    }

    #[test]
    fn finds_dotnet_processes_and_their_state() {
        let dir = tempfile::tempdir().expect("tempdir");
        let proc_dir = dir.path().join("proc");
        let coreclr = "1000-2000 r-xp 0 fe:00 1 /usr/share/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so\n";
        // 10: framework-dependent .NET in a container, perf map env set, no socket.
        let procfs = fake_process(
            &proc_dir,
            10,
            &[
                ("maps", coreclr.as_bytes()),
                ("status", status(10, 1).as_bytes()),
                ("stat", stat(10, 500).as_bytes()),
                ("cmdline", b"dotnet\0app.dll\0"),
                ("environ", b"DOTNET_PerfMapEnabled=1\0"),
                ("cgroup", format!("0::/docker/{ID}\n").as_bytes()),
            ],
        );
        fs::create_dir_all(proc_dir.join("10/root/tmp")).expect("mkdir");
        // 20: a host process that is not .NET.
        fake_process(
            &proc_dir,
            20,
            &[
                ("maps", b"1000-2000 r-xp 0 fe:00 1 /usr/bin/bash\n"),
                ("status", status(20, 20).as_bytes()),
                ("stat", stat(20, 600).as_bytes()),
                ("cmdline", b"bash\0"),
            ],
        );
        // 30: single-file app: no runtime mapping, but its own socket and a perf map in TMPDIR.
        fake_process(
            &proc_dir,
            30,
            &[
                ("maps", b"1000-2000 r-xp 0 fe:00 1 /app/myservice\n"),
                ("status", status(30, 30).as_bytes()),
                ("stat", stat(30, 700).as_bytes()),
                ("cmdline", b"/app/myservice\0--flag\x1b[31m\0"),
                ("environ", b"TMPDIR=/var/tmp\0"),
            ],
        );
        fs::create_dir_all(proc_dir.join("30/root/var/tmp")).expect("mkdir");
        fs::write(proc_dir.join("30/root/var/tmp/perf-30.map"), "").expect("write");
        let socket_path = proc_dir.join("30/root/var/tmp/dotnet-diagnostic-30-700-socket");
        let _listener = UnixListener::bind(&socket_path).expect("bind");
        // 40: not .NET, but a stale socket with its pid and another start time.
        fake_process(
            &proc_dir,
            40,
            &[
                ("maps", b"1000-2000 r-xp 0 fe:00 1 /usr/bin/sleep\n"),
                ("status", status(40, 30).as_bytes()),
                ("stat", stat(40, 999).as_bytes()),
                ("environ", b"TMPDIR=/var/tmp\0"),
            ],
        );
        // Same root as 30 (like two processes of one container).
        std::os::unix::fs::symlink(proc_dir.join("30/root"), proc_dir.join("40/root"))
            .expect("symlink");
        // 50: kernel thread (empty maps).
        fake_process(
            &proc_dir,
            50,
            &[("maps", b""), ("status", status(50, 50).as_bytes())],
        );

        let rows = dotnet_processes(&procfs);
        assert_eq!(
            rows,
            vec![
                DotnetProcessRow {
                    pid: 10,
                    uid: 0,
                    runtime_version: Some("8.0.4".into()),
                    command_line: "dotnet app.dll".into(),
                    service: "app".into(),
                    container_id: Some(ID.into()),
                    pod_uid: None,
                    perf_map_enabled: true,
                    diagnostic_socket: None,
                },
                DotnetProcessRow {
                    pid: 30,
                    uid: 0,
                    // The fake socket does not answer ProcessInfo.
                    runtime_version: None,
                    command_line: "/app/myservice --flag\u{1b}[31m".into(),
                    // The fake's comm is `dotnet`, and no `.dll` follows it.
                    service: "dotnet".into(),
                    container_id: None,
                    pod_uid: None,
                    perf_map_enabled: true,
                    diagnostic_socket: Some(socket_path),
                },
            ]
        );

        let users = UserNames::from_passwd("root:x:0:0:root:/root:/bin/sh\n");
        let mut out = Vec::new();
        print_ps_table(&rows, &users, &mut out).expect("print");
        let table = String::from_utf8(out).expect("utf8");
        let expected = format!(
            "PID  USER  RUNTIME  SERVICE  NAMES FROM  POD  CONTAINER     COMMAND\n 10  root  8.0.4    app      perf map    -    {}  dotnet app.dll\n 30  root  ?        dotnet   perf map    -    -             /app/myservice --flag?[31m\n",
            &ID[..12]
        );
        assert_eq!(table, expected);
        let mut out = Vec::new();
        let listing = DotnetListing { rows, hidden: 3 };
        print_ps_json(&listing, &users, &mut out).expect("json");
        let json: serde_json::Value = serde_json::from_slice(&out).expect("parses");
        assert_eq!(json["processes"][0]["names_from"], "perf map");
        assert_eq!(
            json["processes"][1]["command_line"],
            "/app/myservice --flag\u{1b}[31m"
        );
        assert_eq!(json["hidden_processes"], 3);
        assert!(json["note"].as_str().is_some_and(|n| n.contains("sudo")));
    }

    #[test]
    fn names_come_from_perf_maps_then_the_socket_then_memory() {
        let mut row = DotnetProcessRow {
            pid: 1,
            uid: 1000,
            runtime_version: None,
            command_line: String::new(),
            service: String::new(),
            container_id: None,
            pod_uid: None,
            perf_map_enabled: false,
            diagnostic_socket: None,
        };
        assert_eq!(row.names(), NameSource::Memory);
        row.diagnostic_socket = Some("/tmp/s".into());
        assert_eq!(row.names(), NameSource::Socket);
        row.perf_map_enabled = true;
        assert_eq!(row.names(), NameSource::PerfMap);
        let users =
            UserNames::from_passwd("root:x:0:0::/:/bin/sh\nbroken\napp:x:1000:1000::/:/bin/sh\n");
        assert_eq!(users.name(1000), "app");
        assert_eq!(users.name(4242), "4242");
    }

    #[test]
    fn empty_table_has_a_header() {
        let mut out = Vec::new();
        print_ps_table(&[], &UserNames::from_passwd(""), &mut out).expect("print");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            "PID  USER  RUNTIME  SERVICE  NAMES FROM  POD  CONTAINER  COMMAND\n"
        );
        assert_eq!(DotnetListing::default().hidden_note(), None);
    }
}
