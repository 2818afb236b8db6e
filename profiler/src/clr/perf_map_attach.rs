//! Perf maps turned on in a running .NET 8+ process and off again: the
//! naming side of the diagnostic IPC ([`super::ipc`]) that a
//! [`super::instance::DotnetInstance`] uses to get managed symbols from a
//! process clrbpf did not start, and to clean up after itself (files
//! removed under [`perf_files`]'s rules). The ledger of a killed run
//! ([`super::perf_map_ledger`]) adopts what it left on.

use std::{io, path::Path, time::SystemTime};

use clrbpf_parse::version::version_major;

use super::ipc::{
    DiagnosticClient, DiagnosticPort, IpcError, PerfMapType, RuntimeError, proc_to_ipc,
};
use crate::{
    process::{
        ProcFs,
        dotnet::{DotnetEnvironment, DotnetRuntime},
        root::TargetRoot,
    },
    symbolize::perf_files::{self, PerfFileCleanup},
};

/// The first .NET with EnablePerfMap.
const PERF_MAP_MIN_MAJOR: u32 = 8;

/// Why [`PerfMapAttach::attach`] did not turn perf maps on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PerfMapUnsupported {
    #[error(
        "EnablePerfMap is not supported before .NET 8 (process runs {}): managed symbols need EventPipe rundown",
        .version.as_deref().unwrap_or("an older runtime")
    )]
    BeforeNet8 { version: Option<String> },
    #[error("the runtime refused EnablePerfMap")]
    Refused(#[source] RuntimeError),
}

/// The result of [`PerfMapAttach::attach`].
#[derive(Debug)]
pub enum PerfMapAttachOutcome {
    /// clrbpf turned perf maps on; call [`PerfMapAttach::finish`] when done.
    Enabled(Box<PerfMapAttach>),
    /// The process writes perf maps by itself (`DOTNET_PerfMapEnabled` /
    /// `COMPlus_PerfMapEnabled` is non-zero): read them, undo nothing.
    AlreadyEnabled { setting: u32 },
    /// No perf maps from this runtime.
    Unsupported(PerfMapUnsupported),
}

/// Perf maps that clrbpf turned on in a running .NET 8+ process, to be
/// turned off (and the files removed) when the recording ends.
#[derive(Debug)]
pub struct PerfMapAttach {
    client: DiagnosticClient,
    /// The target's root, opened while it runs: the files are removed
    /// through it even after the process exited (when `/proc/PID/root` is
    /// gone with it).
    root: Option<TargetRoot>,
    ns_pid: u32,
    perf_map_dirs: Vec<String>,
    runtime_version: Option<String>,
    /// When EnablePerfMap was sent: only files written since are ours.
    pub(super) enabled_at: SystemTime,
    finished: bool,
}

/// What [`PerfMapAttach::finish`] did.
#[derive(Debug)]
pub struct PerfMapCleanup {
    /// The result of DisablePerfMap (an error is normal if the process exited).
    pub disable: Result<(), IpcError>,
    /// The perf files removed, left alone, or that could not be removed.
    pub files: PerfFileCleanup,
}

impl PerfMapAttach {
    /// Turns perf maps (type All: perf map and jitdump, which also lists
    /// ReadyToRun code) on in host process `pid`, unless it writes them
    /// already or its runtime is older than .NET 8.
    pub fn attach(port: &DiagnosticPort) -> Result<PerfMapAttachOutcome, IpcError> {
        let (procfs, pid) = (port.procfs(), port.pid());
        let environment = DotnetEnvironment::read(procfs, pid).map_err(proc_to_ipc)?;
        if let Some(setting) = environment.perf_map_enabled.filter(|&v| v != 0) {
            return Ok(PerfMapAttachOutcome::AlreadyEnabled { setting });
        }
        let client = port.client()?;
        let mapped_version = procfs
            .maps(pid)
            .ok()
            .and_then(|maps| DotnetRuntime::detect(&maps))
            .and_then(|runtime| runtime.version);
        let runtime_version = match client.process_info() {
            Ok(info) => info.clr_product_version.or(mapped_version),
            // Before .NET 5: no ProcessInfo at all.
            Err(IpcError::Refused {
                error: RuntimeError::UnknownCommand,
                ..
            }) => {
                return Ok(PerfMapAttachOutcome::Unsupported(
                    PerfMapUnsupported::BeforeNet8 {
                        version: mapped_version,
                    },
                ));
            }
            Err(e) => return Err(e),
        };
        if runtime_version
            .as_deref()
            .and_then(version_major)
            .is_some_and(|major| major < PERF_MAP_MIN_MAJOR)
        {
            return Ok(PerfMapAttachOutcome::Unsupported(
                PerfMapUnsupported::BeforeNet8 {
                    version: runtime_version,
                },
            ));
        }
        // Opened before the request: the process may exit as soon as its
        // runtime starts writing, and its files are removed through it.
        // Best effort: without it, removal goes through /proc/PID/root,
        // which works while the process lives.
        let root = TargetRoot::open(procfs, pid).ok();
        let enabled_at = SystemTime::now();
        match client.enable_perf_map(PerfMapType::All) {
            Ok(()) => {}
            Err(IpcError::Refused {
                error: RuntimeError::UnknownCommand,
                ..
            }) => {
                return Ok(PerfMapAttachOutcome::Unsupported(
                    PerfMapUnsupported::BeforeNet8 {
                        version: runtime_version,
                    },
                ));
            }
            Err(IpcError::Refused { error, .. }) => {
                return Ok(PerfMapAttachOutcome::Unsupported(
                    PerfMapUnsupported::Refused(error),
                ));
            }
            // The request went out and no answer came back (the process
            // exited while its runtime replayed its methods, or the runtime
            // is slow): the perf maps may be on and their files written.
            // Kept as on, they are turned off and removed with the others.
            Err(
                e @ (IpcError::Timeout { .. } | IpcError::Io { .. } | IpcError::Response { .. }),
            ) => {
                tracing::debug!(pid, error = %e, "no answer to EnablePerfMap: treated as on");
            }
            Err(e) => return Err(e),
        }
        Ok(PerfMapAttachOutcome::Enabled(Box::new(Self::taken_over(
            root,
            client,
            &environment,
            runtime_version,
            enabled_at,
        ))))
    }

    /// Takes over the perf maps an earlier clrbpf turned on in host process
    /// `pid` at `enabled_at` and could not turn off (it was killed; see
    /// [`super::perf_map_ledger`]): [`Self::finish`] then does what that
    /// run's end would have. `None` when the process writes perf maps by
    /// itself (`DOTNET_PerfMapEnabled`): not ours to turn off.
    pub fn adopt(
        procfs: &ProcFs,
        pid: u32,
        enabled_at: SystemTime,
    ) -> Result<Option<Self>, IpcError> {
        let environment = DotnetEnvironment::read(procfs, pid).map_err(proc_to_ipc)?;
        if environment.perf_map_enabled.is_some_and(|v| v != 0) {
            return Ok(None);
        }
        let client = DiagnosticPort::new(procfs, pid).client()?;
        Ok(Some(Self::taken_over(
            TargetRoot::open(procfs, pid).ok(),
            client,
            &environment,
            None,
            enabled_at,
        )))
    }

    fn taken_over(
        root: Option<TargetRoot>,
        client: DiagnosticClient,
        environment: &DotnetEnvironment,
        runtime_version: Option<String>,
        enabled_at: SystemTime,
    ) -> Self {
        Self {
            ns_pid: client.socket().ns_pid,
            root,
            client,
            perf_map_dirs: environment.perf_map_dirs(),
            runtime_version,
            enabled_at,
            finished: false,
        }
    }

    /// Turns perf maps off and on again: the runtime creates its files anew
    /// and replays every method compiled so far into them. For when the
    /// files were removed under a running recording: another recorder
    /// attached to the same process (a second clrbpf) ends by turning the
    /// runtime's perf maps off and removing the files, which are the same
    /// files (the runtime keeps one perf map state per process, not one
    /// per client). Enabling alone is not enough: a runtime still enabled
    /// goes on writing to the removed files.
    ///
    /// `enabled_at` stays the first request's: every file the runtime wrote
    /// since is this recording's doing, and is removed at its end. (Moving
    /// it forward left behind the files of a process that died while its
    /// runtime was still creating them: they looked older than the request.)
    pub fn reenable(&mut self) -> Result<(), IpcError> {
        // An error here is normal: the other recorder may have turned them
        // off already.
        let _ = self.client.disable_perf_map();
        self.client.enable_perf_map(PerfMapType::All)
    }

    /// The client used to enable the maps.
    pub fn client(&self) -> &DiagnosticClient {
        &self.client
    }

    /// The pid in the file names (`perf-<ns_pid>.map`).
    pub fn ns_pid(&self) -> u32 {
        self.ns_pid
    }

    /// Directories, as the target sees them, where the files may be.
    pub fn perf_map_dirs(&self) -> &[String] {
        &self.perf_map_dirs
    }

    /// The runtime version, if known (`"8.0.4+..."` from ProcessInfo2, or
    /// `"8.0.4"` from the mappings).
    pub fn runtime_version(&self) -> Option<&str> {
        self.runtime_version.as_deref()
    }

    /// The file names the runtime writes for this process.
    pub fn file_names(&self) -> [String; 3] {
        perf_files::perf_file_names(self.ns_pid)
    }

    /// Turns perf maps off and, unless `keep_files`, removes
    /// `perf-<nspid>.map`, `perfinfo-<nspid>.map` and `jit-<nspid>.dump`
    /// under the rules of [`perf_files`]: the target's own regular files,
    /// written since the request, unlinked as the target's user through a
    /// directory fd inside its root. Removal is tried even if the process
    /// already exited (its container's files stay reachable while another
    /// process lives in it).
    pub fn finish(mut self, keep_files: bool) -> PerfMapCleanup {
        self.finished = true;
        let disable = self.client.disable_perf_map();
        let mut cleanup = PerfMapCleanup {
            disable,
            files: PerfFileCleanup::default(),
        };
        if keep_files {
            return cleanup;
        }
        let opened = match self.root.take() {
            Some(root) => Ok(root),
            None => TargetRoot::open(self.client.procfs(), self.client.pid()),
        };
        let root_path = self.client.procfs().pid_path(self.client.pid(), "root");
        let root = match opened {
            Ok(root) => root,
            Err(e) => {
                cleanup.files.failed.push((root_path, io::Error::other(e)));
                return cleanup;
            }
        };
        let dirs: Vec<&Path> = self.perf_map_dirs.iter().map(Path::new).collect();
        match perf_files::remove_perf_files(
            &root,
            &dirs,
            self.ns_pid,
            self.client.owner(),
            self.enabled_at,
        ) {
            Ok(files) => cleanup.files = files,
            Err(e) => cleanup.files.failed.push((root_path, io::Error::other(e))),
        }
        cleanup
    }
}

impl Drop for PerfMapAttach {
    /// A recording that ends without [`PerfMapAttach::finish`] (a panic, an
    /// early return) must not leave the target writing perf maps forever:
    /// turn them off, keep the files.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Err(error) = self.client.disable_perf_map() {
            tracing::warn!(
                pid = self.client.pid(),
                error = %error,
                "could not turn off the perf maps clrbpf enabled"
            );
        }
    }
}
