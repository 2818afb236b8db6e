//! What `clrbpf ps` shows of a process's .NET runtime, through the runtime
//! seam ([`crate::runtime::RuntimeLoader::describe`]): its version, whether
//! it writes perf maps already, and its diagnostic socket.
//!
//! A process is .NET when its mappings show CoreCLR ([`DotnetRuntime`]), or,
//! for single-file apps that link the runtime into their executable, when
//! a diagnostic socket carrying its pid *and start time* sits in its temp
//! directory. The version comes from the mappings, else from the runtime
//! itself over IPC (`ProcessInfo2`, short timeout).

use std::{ffi::OsStr, time::Duration};

use super::ipc::{DiagnosticClient, find_diagnostic_socket};
use crate::{
    process::{
        MappingTable, ProcFs, ProcessInfo,
        dotnet::{DotnetEnvironment, DotnetRuntime},
        root::{EntryKind, TargetRoot},
    },
    runtime::RuntimeSummary,
};

/// How long `ps` waits for a runtime to tell its version.
const VERSION_QUERY_TIMEOUT: Duration = Duration::from_millis(500);

/// See the module doc; `None` when the process runs no .NET.
pub(super) fn describe(
    procfs: &ProcFs,
    info: &ProcessInfo,
    mappings: &MappingTable,
) -> Option<RuntimeSummary> {
    let pid = info.pid;
    let runtime = DotnetRuntime::detect(mappings);
    let environment = DotnetEnvironment::read(procfs, pid).unwrap_or_default();
    let root = TargetRoot::open(procfs, pid).ok();
    let socket = find_diagnostic_socket(procfs, pid).ok();
    // Without a runtime mapping only a socket made by this very process
    // (its start time is in the name) says it is .NET.
    let socket_is_exact = socket
        .as_ref()
        .is_some_and(|s| s.disambiguation_key == info.start_time_ticks);
    if runtime.is_none() && !socket_is_exact {
        return None;
    }
    let mut version = runtime.and_then(|r| r.version);
    if version.is_none()
        && let Some(socket) = &socket
    {
        version = DiagnosticClient::new(procfs, pid, socket.clone())
            .and_then(|client| client.with_timeout(VERSION_QUERY_TIMEOUT).process_info())
            .ok()
            .and_then(|i| i.clr_product_version)
            .map(|v| strip_build_metadata(&v).to_string());
    }
    let names_written = environment.perf_map_enabled()
        || root.as_ref().is_some_and(|root| {
            perf_map_file_exists(root, &environment.perf_map_dirs(), info.ns_pid)
        });
    Some(RuntimeSummary {
        version,
        names_written,
        control_socket: socket.map(|s| s.host_path),
    })
}

fn perf_map_file_exists(root: &TargetRoot, dirs: &[String], ns_pid: u32) -> bool {
    let name = format!("perf-{ns_pid}.map");
    dirs.iter().any(|dir| {
        root.open_dir(dir)
            .and_then(|dir| dir.stat(OsStr::new(&name)))
            .is_ok_and(|stat| stat.kind == EntryKind::File)
    })
}

/// `"8.0.4+2d7eea25..."` -> `"8.0.4"`.
fn strip_build_metadata(version: &str) -> &str {
    version.split('+').next().unwrap_or(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_metadata_is_stripped() {
        assert_eq!(strip_build_metadata("8.0.4+abc"), "8.0.4");
        assert_eq!(strip_build_metadata("8.0.4"), "8.0.4");
    }
}
