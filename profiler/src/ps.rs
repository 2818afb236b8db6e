//! `clrbpf ps`: the .NET processes of the host, with what the profiler can
//! do with each (runtime version, whether managed symbols are already
//! written, whether the diagnostic socket is there, which container).
//!
//! Which processes run .NET, and what their runtime offers, is the .NET
//! loader's to say, through the runtime seam
//! ([`crate::runtime::RuntimeLoader::describe`]); this module lists the
//! processes and prints the table.

use std::{
    io::{self, Write},
    path::PathBuf,
};

use crate::process::{ProcFs, list_pids};
use crate::{clr::instance::DotnetLoader, runtime::RuntimeLoader};

/// Container ids are shown shortened, like `docker ps` does.
const SHORT_CONTAINER_ID: usize = 12;

/// One line of `clrbpf ps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DotnetProcessRow {
    pub pid: u32,
    /// `"8.0.4"`; `None` if neither the mappings nor the runtime told.
    pub runtime_version: Option<String>,
    pub command_line: String,
    pub container_id: Option<String>,
    /// The process writes `perf-<nspid>.map` already: its environment turns
    /// it on (`DOTNET_PerfMapEnabled`/`COMPlus_PerfMapEnabled` non-zero) or
    /// the file exists in its temp directory.
    pub perf_map_enabled: bool,
    /// Host path of the diagnostic socket, if one was found (a socket, in
    /// the target's root, named for its namespace pid).
    pub diagnostic_socket: Option<PathBuf>,
}

/// The .NET processes under `procfs`, by pid. Processes that vanish or
/// cannot be read are left out.
pub fn dotnet_processes(procfs: &ProcFs) -> Vec<DotnetProcessRow> {
    let loader = DotnetLoader::for_listing();
    list_pids(procfs)
        .into_iter()
        .filter_map(|pid| dotnet_process(procfs, &loader, pid))
        .collect()
}

fn dotnet_process(
    procfs: &ProcFs,
    loader: &impl RuntimeLoader,
    pid: u32,
) -> Option<DotnetProcessRow> {
    let maps = procfs.maps(pid).ok()?;
    // Kernel threads have no mappings.
    if maps.is_empty() {
        return None;
    }
    let info = procfs.process_info(pid).ok()?;
    let runtime = loader.describe(procfs, &info, &maps)?;
    Some(DotnetProcessRow {
        pid,
        runtime_version: runtime.version,
        command_line: info.command_line(),
        container_id: info.container_id,
        perf_map_enabled: runtime.names_written,
        diagnostic_socket: runtime.control_socket,
    })
}

/// Writes `rows` as an aligned table with a header, like `ps`; the command
/// line is the last column and is not cut.
pub fn print_ps_table(rows: &[DotnetProcessRow], mut w: impl Write) -> io::Result<()> {
    const HEADER: [&str; 6] = ["PID", "RUNTIME", "PERFMAP", "IPC", "CONTAINER", "COMMAND"];
    let cells: Vec<[String; 6]> = rows
        .iter()
        .map(|row| {
            let DotnetProcessRow {
                pid,
                runtime_version,
                command_line,
                container_id,
                perf_map_enabled,
                diagnostic_socket,
            } = row;
            [
                pid.to_string(),
                runtime_version.clone().unwrap_or_else(|| "?".into()),
                yes_no(*perf_map_enabled).into(),
                yes_no(diagnostic_socket.is_some()).into(),
                container_id
                    .as_deref()
                    .map(|id| id.chars().take(SHORT_CONTAINER_ID).collect())
                    .unwrap_or_else(|| "-".into()),
                // A command line is the process's choice: no control characters on a terminal.
                command_line
                    .chars()
                    .map(|c| if c.is_control() { '?' } else { c })
                    .collect(),
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

fn yes_no(value: bool) -> &'static str {
    if value { "yes" } else { "no" }
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
                    runtime_version: Some("8.0.4".into()),
                    command_line: "dotnet app.dll".into(),
                    container_id: Some(ID.into()),
                    perf_map_enabled: true,
                    diagnostic_socket: None,
                },
                DotnetProcessRow {
                    pid: 30,
                    // The fake socket does not answer ProcessInfo.
                    runtime_version: None,
                    command_line: "/app/myservice --flag\u{1b}[31m".into(),
                    container_id: None,
                    perf_map_enabled: true,
                    diagnostic_socket: Some(socket_path),
                },
            ]
        );

        let mut out = Vec::new();
        print_ps_table(&rows, &mut out).expect("print");
        let table = String::from_utf8(out).expect("utf8");
        let expected = format!(
            "PID  RUNTIME  PERFMAP  IPC  CONTAINER     COMMAND\n 10  8.0.4    yes      no   {}  dotnet app.dll\n 30  ?        yes      yes  -             /app/myservice --flag?[31m\n",
            &ID[..12]
        );
        assert_eq!(table, expected);
    }

    #[test]
    fn empty_table_has_a_header() {
        let mut out = Vec::new();
        print_ps_table(&[], &mut out).expect("print");
        assert_eq!(out, b"PID  RUNTIME  PERFMAP  IPC  CONTAINER  COMMAND\n");
    }
}
