//! The diagnostic IPC client: how clrbpf talks to a running .NET runtime
//! without restarting or configuring it.
//!
//! Every CoreCLR (3.0+) listens on a Unix socket,
//! `$TMPDIR/dotnet-diagnostic-<nspid>-<starttime>-socket`, and answers one
//! command per connection: a 20-byte header (`DOTNET_IPC_V1\0`, u16 total
//! size, command set, command id, reserved) and a payload; the reply is a
//! header with set `0xFF` and id `0x00` (OK + payload) or `0xFF` (error +
//! HRESULT). This module:
//!
//! 1. finds the socket as Microsoft's client does (TMPDIR from the
//!    target's environment, its namespace pid, the newest matching socket),
//!    through `/proc/PID/root` without following symlinks out of the
//!    target's root ([`crate::process::root`]), and connects through
//!    `/proc/self/fd/N` so the 108-byte `sun_path` limit never applies;
//! 2. frames requests, and reads responses strictly with the wire codec
//!    of `clrbpf_parse::ipc` (the runtime is trusted no more than any other
//!    input from a target process, so every size is checked and a response
//!    is at most 65 535 bytes); the whole exchange has a deadline;
//! 3. offers the commands the profiler needs now: `ProcessInfo`/`ProcessInfo2`,
//!    `EnablePerfMap`/`DisablePerfMap` (.NET 8+, used by
//!    [`super::perf_map_attach`]) and the EventPipe ones
//!    ([`super::session`]), all through one [`DiagnosticPort`] per process.
//!
//! Synchronous I/O on purpose (one short exchange per command): call it
//! from `tokio::task::spawn_blocking`.
//!
//! Protocol reference: dotnet/diagnostics `documentation/design-docs/ipc-protocol.md`.

use std::{
    ffi::{OsStr, OsString},
    io,
    io::{Read, Write},
    os::{fd::AsFd, unix::net::UnixStream},
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use clrbpf_parse::ipc::{
    HEADER_LEN, IpcHeader, MAX_MESSAGE_LEN, ReadFailure, STATUS_RESPONSE_LEN, ServerReply,
    parse_process_info, parse_process_info2, parse_session_id, parse_status, read_response,
};
// The wire types the client's API and errors carry.
pub use clrbpf_parse::ipc::{
    CommandId, PerfMapType, ResponseError, RuntimeError, RuntimeProcessInfo, encode_string,
};

use crate::process::{
    ProcError, ProcFs,
    dotnet::DotnetEnvironment,
    identity::{FsIdentity, IdentityError},
    root::{EntryKind, TargetDir, TargetRoot, entry_kind, fd_path, fstat},
};

/// Default deadline for one command (connect, send, full response).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

const SOCKET_PREFIX: &str = "dotnet-diagnostic-";
const SOCKET_SUFFIX: &str = "-socket";

/// Header + payload of a request; fails if it does not fit the u16 size field.
pub fn encode_request(command: CommandId, payload: &[u8]) -> Result<Vec<u8>, IpcError> {
    let size = HEADER_LEN
        .checked_add(payload.len())
        .and_then(|n| u16::try_from(n).ok())
        .ok_or(IpcError::RequestTooLarge {
            command,
            len: payload.len().saturating_add(HEADER_LEN),
        })?;
    let header = IpcHeader {
        size,
        command,
        reserved: 0,
    };
    let mut message = Vec::with_capacity(usize::from(size));
    message.extend_from_slice(&header.encode());
    message.extend_from_slice(payload);
    Ok(message)
}

/// Errors talking to a runtime. Each says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error(
        "no diagnostic socket for process {pid} in {dir}: the process may have DOTNET_EnableDiagnostics=0, or is not .NET"
    )]
    SocketNotFound { pid: u32, dir: PathBuf },
    #[error(
        "it runs with DOTNET_EnableDiagnostics=0, so its runtime opened no diagnostic socket (restart it without that setting for CLR events and runtime metrics)"
    )]
    DiagnosticsDisabled { pid: u32 },
    #[error(
        "permission denied on {path}: run clrbpf as root or as the process's user (in a container: hostPID and CAP_SYS_PTRACE to reach /proc/PID/root)"
    )]
    PermissionDenied {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the process model of the target")]
    Proc(#[from] ProcError),
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not a socket: refusing to connect")]
    NotASocket { path: PathBuf },
    #[error(
        "{path} is owned by uid {owner}, not by the process's uid {expected}: refusing to connect for it"
    )]
    NotOwned {
        path: PathBuf,
        owner: u32,
        expected: u32,
    },
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error("cannot connect to {path}: the runtime may have exited or stopped listening")]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "process {pid} did not answer {command} within {timeout:?}: the runtime may be suspended, stopped in a debugger or overloaded"
    )]
    Timeout {
        pid: u32,
        command: CommandId,
        timeout: Duration,
    },
    #[error("i/o error during {command} with process {pid}")]
    Io {
        pid: u32,
        command: CommandId,
        #[source]
        source: io::Error,
    },
    #[error("process {pid} sent a malformed reply to {command}")]
    Response {
        pid: u32,
        command: CommandId,
        #[source]
        source: ResponseError,
    },
    #[error("process {pid} refused {command}")]
    Refused {
        pid: u32,
        command: CommandId,
        #[source]
        error: RuntimeError,
    },
    #[error("request {command} is {len} bytes, more than the 65535 the protocol allows")]
    RequestTooLarge { command: CommandId, len: usize },
}

impl IpcError {
    /// The runtime's error, if it refused the command.
    pub fn runtime_error(&self) -> Option<RuntimeError> {
        match self {
            Self::Refused { error, .. } => Some(*error),
            _ => None,
        }
    }
}

/// A diagnostic socket found for a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiagnosticSocket {
    /// Host path, for messages (`/proc/PID/root/tmp/dotnet-diagnostic-7-1234-socket`).
    pub host_path: PathBuf,
    /// Its directory as the target sees it (`/tmp`).
    pub dir_in_root: String,
    /// Its file name.
    pub name: OsString,
    /// The pid in the name (the namespace pid).
    pub ns_pid: u32,
    /// The second number in the name: the runtime's start time in clock ticks.
    pub disambiguation_key: u64,
    pub modified: SystemTime,
}

/// One `dotnet-diagnostic-<pid>-<key>-socket` entry of a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketCandidate {
    pub name: OsString,
    pub ns_pid: u32,
    pub disambiguation_key: u64,
    pub modified: SystemTime,
}

/// Parses `dotnet-diagnostic-<pid>-<key>-socket` into `(pid, key)`.
pub fn parse_socket_name(name: &OsStr) -> Option<(u32, u64)> {
    let name = name.to_str()?;
    let middle = name
        .strip_prefix(SOCKET_PREFIX)?
        .strip_suffix(SOCKET_SUFFIX)?;
    let (pid, key) = middle.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(key) {
        return None;
    }
    Some((pid.parse().ok()?, key.parse().ok()?))
}

/// The diagnostic sockets of process `ns_pid` in a directory: matching
/// names that are sockets themselves (not symlinks). Only its own names
/// are looked at: a `/tmp` shared by many .NET processes (and the stale
/// sockets of crashed ones) would cost a `stat` each, for every process.
pub fn diagnostic_sockets_in(dir: &TargetDir, ns_pid: u32) -> io::Result<Vec<SocketCandidate>> {
    let mut sockets = Vec::new();
    for name in dir.entries()? {
        let Some((pid, disambiguation_key)) = parse_socket_name(&name) else {
            continue;
        };
        if pid != ns_pid {
            continue;
        }
        // Gone since the listing, or not a socket: skip.
        let Ok(stat) = dir.stat(&name) else {
            continue;
        };
        if stat.kind == EntryKind::Socket {
            sockets.push(SocketCandidate {
                name,
                ns_pid,
                disambiguation_key,
                modified: stat.modified,
            });
        }
    }
    Ok(sockets)
}

/// Picks the socket of process `ns_pid`: the one whose key is the
/// process's start time if there is one (stale sockets of an earlier
/// process with the same pid stay behind when a runtime crashes), else the
/// newest, as Microsoft's client does.
pub fn choose_socket(
    candidates: &[SocketCandidate],
    ns_pid: u32,
    start_time_ticks: Option<u64>,
) -> Option<&SocketCandidate> {
    let mine = candidates.iter().filter(|c| c.ns_pid == ns_pid);
    if let Some(start) = start_time_ticks
        && let Some(exact) = mine.clone().find(|c| c.disambiguation_key == start)
    {
        return Some(exact);
    }
    mine.max_by_key(|c| (c.modified, c.disambiguation_key))
}

/// Finds the diagnostic socket of host process `pid` (see the module doc).
pub fn find_diagnostic_socket(procfs: &ProcFs, pid: u32) -> Result<DiagnosticSocket, IpcError> {
    let ns_pid = procfs.ns_pid(pid).map_err(proc_to_ipc)?;
    let environment = DotnetEnvironment::read(procfs, pid).map_err(proc_to_ipc)?;
    let start_time = procfs.start_time_ticks(pid).ok();
    let root = TargetRoot::open(procfs, pid).map_err(proc_to_ipc)?;
    let dir_path = root.display_path(&environment.tmpdir);
    let not_found = || {
        if environment.diagnostics_disabled {
            IpcError::DiagnosticsDisabled { pid }
        } else {
            IpcError::SocketNotFound {
                pid,
                dir: dir_path.clone(),
            }
        }
    };
    let dir = match root.open_dir(&environment.tmpdir) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(not_found()),
        Err(e) => return Err(open_error(dir_path, e)),
    };
    let candidates = diagnostic_sockets_in(&dir, ns_pid)
        .map_err(|e| open_error(dir.display_path().to_path_buf(), e))?;
    let chosen = choose_socket(&candidates, ns_pid, start_time).ok_or_else(not_found)?;
    Ok(DiagnosticSocket {
        host_path: dir.display_child(&chosen.name),
        dir_in_root: environment.tmpdir.clone(),
        name: chosen.name.clone(),
        ns_pid,
        disambiguation_key: chosen.disambiguation_key,
        modified: chosen.modified,
    })
}

pub(super) fn proc_to_ipc(error: ProcError) -> IpcError {
    match error {
        ProcError::PermissionDenied { path, source } => IpcError::PermissionDenied { path, source },
        other => IpcError::Proc(other),
    }
}

fn open_error(path: PathBuf, source: io::Error) -> IpcError {
    if source.kind() == io::ErrorKind::PermissionDenied {
        IpcError::PermissionDenied { path, source }
    } else {
        IpcError::Open { path, source }
    }
}

/// The diagnostic socket of one process, found once, the first time a
/// command needs it, for everything that talks to its runtime: the perf
/// map attach, the EventPipe sessions, the rundown. Clones share what was
/// found (threads take their own). A socket not there yet (the runtime
/// creates it early in its startup) is looked for again at the next call.
#[derive(Debug, Clone)]
pub struct DiagnosticPort {
    procfs: ProcFs,
    pid: u32,
    found: std::sync::Arc<std::sync::Mutex<Option<DiagnosticClient>>>,
}

impl DiagnosticPort {
    /// The port of host process `pid`; nothing is looked for yet.
    pub fn new(procfs: &ProcFs, pid: u32) -> Self {
        Self {
            procfs: procfs.clone(),
            pid,
            found: Default::default(),
        }
    }

    /// The host pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The process's `/proc`.
    pub fn procfs(&self) -> &ProcFs {
        &self.procfs
    }

    /// A client for the socket, found the first time (see the module doc).
    pub fn client(&self) -> Result<DiagnosticClient, IpcError> {
        // Held while the socket is looked for: a second thread asking at
        // the same time waits for the first one's answer.
        let mut found = self
            .found
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(client) = found.as_ref() {
            return Ok(client.clone());
        }
        let client = DiagnosticClient::discover(&self.procfs, self.pid)?;
        *found = Some(client.clone());
        Ok(client)
    }
}

/// A client for the diagnostic socket of one process. Every command opens
/// its own connection, as the runtime expects.
///
/// The EventPipe work adds `collect_tracing(...)`, which sends a
/// CollectTracing request with [`DiagnosticClient::exchange`] and returns
/// the nettrace stream that follows the reply on the same connection, and
/// `stop_tracing(session_id)`, which sends StopTracing on a new connection.
#[derive(Debug, Clone)]
pub struct DiagnosticClient {
    procfs: ProcFs,
    pid: u32,
    socket: DiagnosticSocket,
    /// The target's filesystem identity: the socket must be its own, and
    /// connections are made as that user (see [`crate::process::identity`]).
    owner: FsIdentity,
    timeout: Duration,
}

impl DiagnosticClient {
    /// Finds the socket of host process `pid` and makes a client for it.
    /// The profiler's runtimes ask their [`DiagnosticPort`], which calls
    /// this once.
    pub fn discover(procfs: &ProcFs, pid: u32) -> Result<Self, IpcError> {
        let socket = find_diagnostic_socket(procfs, pid)?;
        Self::new(procfs, pid, socket)
    }

    /// A client for a socket found earlier.
    pub fn new(procfs: &ProcFs, pid: u32, socket: DiagnosticSocket) -> Result<Self, IpcError> {
        let owner = FsIdentity::of_process(procfs, pid).map_err(proc_to_ipc)?;
        Ok(Self {
            procfs: procfs.clone(),
            pid,
            socket,
            owner,
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// Sets the deadline of each command (default 5 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The host pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The process's `/proc`.
    pub fn procfs(&self) -> &ProcFs {
        &self.procfs
    }

    /// The socket's host path (for messages; connections re-resolve it
    /// safely inside the target's root).
    pub fn socket_path(&self) -> &Path {
        &self.socket.host_path
    }

    /// The socket.
    pub fn socket(&self) -> &DiagnosticSocket {
        &self.socket
    }

    /// The target's filesystem identity.
    pub fn owner(&self) -> &FsIdentity {
        &self.owner
    }

    /// Opens a connection. The socket is re-resolved inside the target's
    /// root each time, opened `O_PATH | O_NOFOLLOW`, checked to be a socket
    /// owned by the target's user and connected through `/proc/self/fd/N`
    /// as that user: no symlink is followed, no path length limit applies,
    /// and the kernel allows the connection only if the target itself could
    /// make it (a socket of another user that the target names by its
    /// TMPDIR or its namespace pid stays out of reach).
    pub fn connect(&self) -> Result<UnixStream, IpcError> {
        let root = TargetRoot::open(&self.procfs, self.pid).map_err(proc_to_ipc)?;
        let dir = root.open_dir(&self.socket.dir_in_root).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                self.socket_gone()
            } else {
                open_error(root.display_path(&self.socket.dir_in_root), e)
            }
        })?;
        let handle = dir.open_path(&self.socket.name).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                self.socket_gone()
            } else {
                open_error(self.socket.host_path.clone(), e)
            }
        })?;
        let stat =
            fstat(handle.as_fd()).map_err(|e| open_error(self.socket.host_path.clone(), e))?;
        if entry_kind(stat.st_mode) != EntryKind::Socket {
            return Err(IpcError::NotASocket {
                path: self.socket.host_path.clone(),
            });
        }
        if stat.st_uid != self.owner.uid {
            return Err(IpcError::NotOwned {
                path: self.socket.host_path.clone(),
                owner: stat.st_uid,
                expected: self.owner.uid,
            });
        }
        let socket_path = fd_path(handle.as_fd());
        let connected = self.owner.run(|| UnixStream::connect(&socket_path))?;
        let stream = connected.map_err(|source| {
            if source.kind() == io::ErrorKind::PermissionDenied {
                IpcError::PermissionDenied {
                    path: self.socket.host_path.clone(),
                    source,
                }
            } else {
                IpcError::Connect {
                    path: self.socket.host_path.clone(),
                    source,
                }
            }
        })?;
        Ok(stream)
    }

    fn socket_gone(&self) -> IpcError {
        IpcError::SocketNotFound {
            pid: self.pid,
            dir: self
                .socket
                .host_path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
        }
    }

    /// Sends one command and reads the reply (at most `max_response_len`
    /// bytes, header included) within the client's deadline. Returns the
    /// connection too: after a CollectTracing reply the event stream
    /// follows on it (its read/write timeouts are still those of the
    /// command's deadline; reset them before streaming).
    pub fn exchange(
        &self,
        command: CommandId,
        payload: &[u8],
        max_response_len: usize,
    ) -> Result<(UnixStream, ServerReply), IpcError> {
        let request = encode_request(command, payload)?;
        let mut stream = self.connect()?;
        let deadline = Instant::now() + self.timeout;
        let io_error = |source: io::Error| self.io_error(command, source);
        set_deadline(&stream, deadline).map_err(io_error)?;
        stream.write_all(&request).map_err(io_error)?;
        let response = {
            let mut reader = DeadlineReader {
                stream: &stream,
                deadline,
            };
            read_response(&mut reader, max_response_len.min(MAX_MESSAGE_LEN))
        };
        let response = response.map_err(|failure| match failure {
            ReadFailure::Io(source) => self.io_error(command, source),
            ReadFailure::Response(source) => IpcError::Response {
                pid: self.pid,
                command,
                source,
            },
        })?;
        let reply = response.into_reply().map_err(|source| IpcError::Response {
            pid: self.pid,
            command,
            source,
        })?;
        Ok((stream, reply))
    }

    fn io_error(&self, command: CommandId, source: io::Error) -> IpcError {
        match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => IpcError::Timeout {
                pid: self.pid,
                command,
                timeout: self.timeout,
            },
            _ => IpcError::Io {
                pid: self.pid,
                command,
                source,
            },
        }
    }

    fn refused(&self, command: CommandId, error: RuntimeError) -> IpcError {
        IpcError::Refused {
            pid: self.pid,
            command,
            error,
        }
    }

    /// Sends a command whose reply carries only an HRESULT.
    fn status_command(&self, command: CommandId, payload: &[u8]) -> Result<(), IpcError> {
        let (_stream, reply) = self.exchange(command, payload, STATUS_RESPONSE_LEN)?;
        parse_status(reply)
            .map_err(|source| IpcError::Response {
                pid: self.pid,
                command,
                source,
            })?
            .map_err(|error| self.refused(command, error))
    }

    /// The runtime's view of the process: `ProcessInfo2` (.NET 6+), or
    /// `ProcessInfo` (.NET 5) when the runtime does not know the former;
    /// then `clr_product_version` is `None`. Runtimes before .NET 5 know
    /// neither and give `Refused` with [`RuntimeError::UnknownCommand`].
    pub fn process_info(&self) -> Result<RuntimeProcessInfo, IpcError> {
        match self.payload_command(CommandId::PROCESS_INFO_2, parse_process_info2) {
            Err(IpcError::Refused {
                error: RuntimeError::UnknownCommand,
                ..
            }) => self.payload_command(CommandId::PROCESS_INFO, parse_process_info),
            other => other,
        }
    }

    fn payload_command<T>(
        &self,
        command: CommandId,
        parse: fn(&[u8]) -> Result<T, ResponseError>,
    ) -> Result<T, IpcError> {
        match self.exchange(command, &[], MAX_MESSAGE_LEN)? {
            (_, ServerReply::Error(error)) => Err(self.refused(command, error)),
            (_, ServerReply::Ok(payload)) => parse(&payload).map_err(|source| IpcError::Response {
                pid: self.pid,
                command,
                source,
            }),
        }
    }

    /// Turns on perf map / jitdump writing (.NET 8+). The runtime also
    /// writes every method compiled so far; stubs made earlier are not
    /// replayed.
    pub fn enable_perf_map(&self, kind: PerfMapType) -> Result<(), IpcError> {
        self.status_command(CommandId::ENABLE_PERF_MAP, &(kind as u32).to_le_bytes())
    }

    /// Turns perf map / jitdump writing off (.NET 8+). The files stay.
    pub fn disable_perf_map(&self) -> Result<(), IpcError> {
        self.status_command(CommandId::DISABLE_PERF_MAP, &[])
    }

    /// Starts an EventPipe session with CollectTracing2 (`payload` from
    /// [`crate::clr::session::collect_tracing2_payload`]). Returns the
    /// connection, on which the nettrace stream follows (its timeouts are
    /// cleared), and the session id for [`Self::stop_tracing`].
    pub fn collect_tracing(&self, payload: &[u8]) -> Result<(UnixStream, u64), IpcError> {
        self.collect_tracing_with(CommandId::COLLECT_TRACING_2, payload)
    }

    /// [`Self::collect_tracing`] with another CollectTracing `command`
    /// (CollectTracing3's payload:
    /// [`crate::clr::session::collect_tracing3_payload`]).
    pub fn collect_tracing_with(
        &self,
        command: CommandId,
        payload: &[u8],
    ) -> Result<(UnixStream, u64), IpcError> {
        let (stream, reply) = self.exchange(command, payload, HEADER_LEN + 8)?;
        let session_id = parse_session_id(reply).map_err(|e| self.reply_error(command, e))?;
        stream
            .set_read_timeout(None)
            .and_then(|()| stream.set_write_timeout(None))
            .map_err(|source| self.io_error(command, source))?;
        Ok((stream, session_id))
    }

    /// Stops session `session_id` (StopTracing, on a new connection). The
    /// runtime then flushes (and runs rundown, if asked) and ends the stream.
    pub fn stop_tracing(&self, session_id: u64) -> Result<(), IpcError> {
        let command = CommandId::STOP_TRACING;
        let (_stream, reply) = self.exchange(command, &session_id.to_le_bytes(), HEADER_LEN + 8)?;
        parse_session_id(reply)
            .map(|_| ())
            .map_err(|e| self.reply_error(command, e))
    }

    fn reply_error(
        &self,
        command: CommandId,
        error: Result<ResponseError, RuntimeError>,
    ) -> IpcError {
        match error {
            Ok(source) => IpcError::Response {
                pid: self.pid,
                command,
                source,
            },
            Err(error) => self.refused(command, error),
        }
    }
}

/// Sets the socket timeouts to the time left before `deadline`.
fn set_deadline(stream: &UnixStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::from(io::ErrorKind::TimedOut));
    }
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))
}

/// Reads from a socket with one deadline for the whole reply, so a runtime
/// that drips a byte at a time cannot hold us for long.
struct DeadlineReader<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        set_deadline(self.stream, self.deadline)?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clr::perf_map_attach::{PerfMapAttach, PerfMapAttachOutcome, PerfMapUnsupported};
    use crate::process::tests::fake_process;
    use clrbpf_parse::ipc::fakes::{error_reply, ok_reply, process_info_payload};
    use std::{
        fs,
        os::{fd::AsRawFd, unix::net::UnixListener},
        thread::JoinHandle,
    };

    #[test]
    fn requests_match_the_bytes_other_clients_send() {
        // one-collect's EnablePerfMap(PERFMAP) and DisablePerfMap.
        let enable =
            encode_request(CommandId::ENABLE_PERF_MAP, &3u32.to_le_bytes()).expect("encode");
        assert_eq!(
            enable,
            b"DOTNET_IPC_V1\0\x18\x00\x04\x05\x00\x00\x03\x00\x00\x00"
        );
        let disable = encode_request(CommandId::DISABLE_PERF_MAP, &[]).expect("encode");
        assert_eq!(disable, b"DOTNET_IPC_V1\0\x14\x00\x04\x06\x00\x00");
        let too_big = vec![0u8; MAX_MESSAGE_LEN - HEADER_LEN + 1];
        assert!(matches!(
            encode_request(CommandId::COLLECT_TRACING_2, &too_big),
            Err(IpcError::RequestTooLarge { len: 65536, .. })
        ));
        assert!(encode_request(CommandId::COLLECT_TRACING_2, &too_big[1..]).is_ok());
    }

    #[test]
    fn socket_names() {
        let parse = |s: &str| parse_socket_name(OsStr::new(s));
        assert_eq!(parse("dotnet-diagnostic-7-12345-socket"), Some((7, 12345)));
        assert_eq!(parse("dotnet-diagnostic-7-12345-socket.bak"), None);
        assert_eq!(parse("dotnet-diagnostic-dsrouter-7-1-socket"), None);
        assert_eq!(parse("dotnet-diagnostic-7--socket"), None);
        assert_eq!(parse("dotnet-diagnostic--1-socket"), None);
        assert_eq!(parse("dotnet-diagnostic-7-1-2-socket"), None);
        assert_eq!(parse("dotnet-diagnostic-99999999999-1-socket"), None);
        assert_eq!(parse("dotnet-diagnostic-+7-1-socket"), None);
    }

    #[test]
    fn socket_choice_prefers_the_start_time_then_the_newest() {
        let at = |secs| SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        let candidate = |pid, key, secs| SocketCandidate {
            name: format!("dotnet-diagnostic-{pid}-{key}-socket").into(),
            ns_pid: pid,
            disambiguation_key: key,
            modified: at(secs),
        };
        let candidates = [
            candidate(7, 100, 50),
            candidate(7, 200, 60),
            candidate(8, 300, 99),
        ];
        let key = |c: Option<&SocketCandidate>| c.map(|c| c.disambiguation_key);
        assert_eq!(key(choose_socket(&candidates, 7, Some(100))), Some(100));
        assert_eq!(key(choose_socket(&candidates, 7, Some(999))), Some(200));
        assert_eq!(key(choose_socket(&candidates, 7, None)), Some(200));
        assert_eq!(key(choose_socket(&candidates, 8, None)), Some(300));
        assert_eq!(key(choose_socket(&candidates, 9, None)), None);
    }

    #[test]
    fn only_the_process_s_own_sockets_are_listed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _mine =
            UnixListener::bind(dir.path().join("dotnet-diagnostic-7-100-socket")).expect("bind");
        let _other =
            UnixListener::bind(dir.path().join("dotnet-diagnostic-8-300-socket")).expect("bind");
        // A regular file with a socket's name is not a socket.
        fs::write(dir.path().join("dotnet-diagnostic-7-200-socket"), b"").expect("write");
        let target = TargetDir::open_own(dir.path()).expect("open");
        let names = |ns_pid| -> Vec<u64> {
            diagnostic_sockets_in(&target, ns_pid)
                .expect("list")
                .iter()
                .map(|c| c.disambiguation_key)
                .collect()
        };
        assert_eq!(names(7), [100]);
        assert_eq!(names(8), [300]);
        assert!(names(9).is_empty());
    }

    /// The `status` of a fake target run by the user running the tests (who
    /// owns the sockets they bind).
    fn fake_status() -> String {
        let me = FsIdentity::current();
        format!(
            "Name:\tdotnet\nPPid:\t1\nUid:\t{0}\t{0}\t{0}\t{0}\nGid:\t{1}\t{1}\t{1}\t{1}\nGroups:\t\nNSpid:\t5\t7\n",
            me.uid, me.gid
        )
    }

    /// A fake `/proc/5` whose process has namespace pid 7, started at tick
    /// 100, with `TMPDIR=<tmpdir>`; returns the procfs and the host path of
    /// the temp directory inside its root.
    fn fake_target(dir: &Path, tmpdir: &str, environ: &str) -> (ProcFs, PathBuf) {
        let environ = format!("TMPDIR={tmpdir}\0{environ}");
        let procfs = fake_process(
            dir,
            5,
            &[
                ("status", fake_status().as_bytes()),
                (
                    "stat",
                    b"5 (dotnet) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n",
                ),
                ("environ", environ.as_bytes()),
            ],
        );
        let tmp = dir.join("5/root").join(tmpdir.trim_start_matches('/'));
        fs::create_dir_all(&tmp).expect("mkdir");
        (procfs, tmp)
    }

    /// Binds a listener in `dir` through `/proc/self/fd`, so the path may be
    /// longer than `sun_path`.
    fn bind_in(dir: &Path, name: &str) -> UnixListener {
        let handle = fs::File::open(dir).expect("open dir");
        UnixListener::bind(format!("/proc/self/fd/{}/{name}", handle.as_raw_fd())).expect("bind")
    }

    /// Serves one connection per reply: records the request, sends the reply.
    fn serve(
        listener: UnixListener,
        replies: Vec<Vec<u8>>,
    ) -> JoinHandle<Vec<(CommandId, Vec<u8>)>> {
        std::thread::spawn(move || {
            let mut requests = Vec::new();
            for reply in replies {
                let (mut stream, _) = listener.accept().expect("accept");
                let mut header = [0u8; HEADER_LEN];
                stream.read_exact(&mut header).expect("read header");
                let header = IpcHeader::decode(&header).expect("client header");
                let mut payload = vec![0; header.payload_len()];
                stream.read_exact(&mut payload).expect("read payload");
                requests.push((header.command, payload));
                stream.write_all(&reply).expect("reply");
            }
            requests
        })
    }

    #[test]
    fn discovery_and_commands_over_a_long_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let long_tmp = format!("/{}/{}", "d".repeat(60), "e".repeat(60));
        let (procfs, tmp) = fake_target(dir.path(), &long_tmp, "");
        // Decoys: another pid, a stale socket, a symlink, a plain file.
        let _other = bind_in(&tmp, "dotnet-diagnostic-8-100-socket");
        let _stale = bind_in(&tmp, "dotnet-diagnostic-7-50-socket");
        let outside = bind_in(dir.path(), "outside");
        std::os::unix::fs::symlink(
            dir.path().join("outside"),
            tmp.join("dotnet-diagnostic-7-99-socket"),
        )
        .expect("symlink");
        fs::write(tmp.join("dotnet-diagnostic-7-98-socket"), "").expect("write");
        let listener = bind_in(&tmp, "dotnet-diagnostic-7-100-socket");

        let client = DiagnosticClient::discover(&procfs, 5).expect("discover");
        assert_eq!(client.pid(), 5);
        assert_eq!(client.socket().ns_pid, 7);
        assert_eq!(client.socket().disambiguation_key, 100);
        assert_eq!(client.socket().dir_in_root, long_tmp);
        assert!(client.socket_path().as_os_str().len() > 108);
        assert!(
            client
                .socket_path()
                .ends_with("dotnet-diagnostic-7-100-socket")
        );

        let server = serve(
            listener,
            vec![
                error_reply(RuntimeError::UNKNOWN_COMMAND),
                ok_reply(&process_info_payload(None)),
                ok_reply(&0u32.to_le_bytes()),
                error_reply(RuntimeError::NOT_SUPPORTED),
                ok_reply(&[0, 0]),
            ],
        );
        let info = client.process_info().expect("process info");
        assert_eq!((info.pid, info.clr_product_version), (7, None));
        client.enable_perf_map(PerfMapType::All).expect("enable");
        let err = client.disable_perf_map().expect_err("refused");
        assert_eq!(err.runtime_error(), Some(RuntimeError::NotSupported));
        assert!(matches!(
            client.disable_perf_map(),
            Err(IpcError::Response {
                source: ResponseError::BadStatusPayload { len: 2 },
                ..
            })
        ));
        let requests = server.join().expect("server");
        let commands: Vec<CommandId> = requests.iter().map(|(c, _)| *c).collect();
        assert_eq!(
            commands,
            [
                CommandId::PROCESS_INFO_2,
                CommandId::PROCESS_INFO,
                CommandId::ENABLE_PERF_MAP,
                CommandId::DISABLE_PERF_MAP,
                CommandId::DISABLE_PERF_MAP,
            ]
        );
        assert_eq!(requests[2].1, 1u32.to_le_bytes());
        // Nothing ever connected through the symlink.
        outside.set_nonblocking(true).expect("nonblocking");
        assert!(outside.accept().is_err());
    }

    #[test]
    fn a_silent_runtime_times_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        let _listener = bind_in(&tmp, "dotnet-diagnostic-7-100-socket");
        let client = DiagnosticClient::discover(&procfs, 5)
            .expect("discover")
            .with_timeout(Duration::from_millis(50));
        let err = client.process_info().expect_err("no answer");
        assert!(matches!(err, IpcError::Timeout { pid: 5, .. }), "{err:?}");
        assert!(
            err.to_string().contains("did not answer ProcessInfo2"),
            "{err}"
        );
    }

    #[test]
    fn missing_socket_errors_say_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, _tmp) = fake_target(dir.path(), "/tmp", "");
        let err = DiagnosticClient::discover(&procfs, 5).expect_err("no socket");
        assert!(
            matches!(err, IpcError::SocketNotFound { pid: 5, .. }),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("DOTNET_EnableDiagnostics=0"),
            "{err}"
        );

        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, _tmp) = fake_target(dir.path(), "/tmp", "DOTNET_EnableDiagnostics=0\0");
        let err = DiagnosticClient::discover(&procfs, 5).expect_err("disabled");
        assert!(
            matches!(err, IpcError::DiagnosticsDisabled { pid: 5 }),
            "{err:?}"
        );

        // A TMPDIR that does not exist inside the root.
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        fs::remove_dir(&tmp).expect("rmdir");
        assert!(matches!(
            DiagnosticClient::discover(&procfs, 5),
            Err(IpcError::SocketNotFound { .. })
        ));

        // The socket vanished after discovery.
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        let listener = bind_in(&tmp, "dotnet-diagnostic-7-100-socket");
        let client = DiagnosticClient::discover(&procfs, 5).expect("discover");
        drop(listener);
        fs::remove_file(tmp.join("dotnet-diagnostic-7-100-socket")).expect("rm");
        assert!(matches!(
            client.connect(),
            Err(IpcError::SocketNotFound { .. })
        ));
        // ...and was replaced by a symlink to a live socket elsewhere.
        let _outside = bind_in(dir.path(), "outside");
        std::os::unix::fs::symlink(
            dir.path().join("outside"),
            tmp.join("dotnet-diagnostic-7-100-socket"),
        )
        .expect("symlink");
        assert!(matches!(client.connect(), Err(IpcError::NotASocket { .. })));
    }

    #[test]
    fn attach_outcomes() {
        // Perf maps already on by environment: no IPC at all.
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, _tmp) = fake_target(dir.path(), "/tmp", "COMPlus_PerfMapEnabled=3\0");
        assert!(matches!(
            PerfMapAttach::attach(&DiagnosticPort::new(&procfs, 5)),
            Ok(PerfMapAttachOutcome::AlreadyEnabled { setting: 3 })
        ));

        // .NET 6 by ProcessInfo2: not supported, EnablePerfMap never sent.
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        let server = serve(
            bind_in(&tmp, "dotnet-diagnostic-7-100-socket"),
            vec![ok_reply(&process_info_payload(Some(("App", "6.0.1"))))],
        );
        let outcome = PerfMapAttach::attach(&DiagnosticPort::new(&procfs, 5)).expect("attach");
        let PerfMapAttachOutcome::Unsupported(reason) = outcome else {
            panic!("expected unsupported, got {outcome:?}");
        };
        assert_eq!(
            reason,
            PerfMapUnsupported::BeforeNet8 {
                version: Some("6.0.1".into())
            }
        );
        assert!(
            reason.to_string().contains("not supported before .NET 8"),
            "{reason}"
        );
        assert_eq!(server.join().expect("server").len(), 1);

        // Before .NET 5: no ProcessInfo of either kind.
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        let _server = serve(
            bind_in(&tmp, "dotnet-diagnostic-7-100-socket"),
            vec![
                error_reply(RuntimeError::UNKNOWN_COMMAND),
                error_reply(RuntimeError::UNKNOWN_COMMAND),
            ],
        );
        assert!(matches!(
            PerfMapAttach::attach(&DiagnosticPort::new(&procfs, 5)),
            Ok(PerfMapAttachOutcome::Unsupported(
                PerfMapUnsupported::BeforeNet8 { version: None }
            ))
        ));

        // .NET 8: enabled; finish disables and removes only regular files.
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/var/tmp", "");
        let slash_tmp = dir.path().join("5/root/tmp");
        fs::create_dir_all(&slash_tmp).expect("mkdir");
        let server = serve(
            bind_in(&tmp, "dotnet-diagnostic-7-100-socket"),
            vec![
                ok_reply(&process_info_payload(Some(("App", "8.0.4+abc")))),
                ok_reply(&0u32.to_le_bytes()),
                ok_reply(&0u32.to_le_bytes()),
            ],
        );
        let outcome = PerfMapAttach::attach(&DiagnosticPort::new(&procfs, 5)).expect("attach");
        let PerfMapAttachOutcome::Enabled(attach) = outcome else {
            panic!("expected enabled, got {outcome:?}");
        };
        assert_eq!(attach.runtime_version(), Some("8.0.4+abc"));
        assert_eq!(attach.ns_pid(), 7);
        assert_eq!(attach.perf_map_dirs(), ["/tmp", "/var/tmp"]);
        fs::write(slash_tmp.join("perf-7.map"), "1 2 x\n").expect("write");
        fs::write(slash_tmp.join("perfinfo-7.map"), "").expect("write");
        fs::write(slash_tmp.join("perf-5.map"), "").expect("write");
        fs::write(dir.path().join("precious"), "keep").expect("write");
        std::os::unix::fs::symlink(dir.path().join("precious"), tmp.join("jit-7.dump"))
            .expect("symlink");
        let cleanup = attach.finish(false);
        assert!(cleanup.disable.is_ok(), "{:?}", cleanup.disable);
        assert_eq!(
            cleanup.files.removed,
            [
                dir.path().join("5/root/tmp/perf-7.map"),
                dir.path().join("5/root/tmp/perfinfo-7.map")
            ]
        );
        assert!(cleanup.files.failed.is_empty(), "{:?}", cleanup.files);
        assert_eq!(cleanup.files.left_alone.len(), 1, "{:?}", cleanup.files);
        assert!(slash_tmp.join("perf-5.map").exists());
        assert_eq!(
            fs::read_to_string(dir.path().join("precious")).expect("read"),
            "keep"
        );
        let commands: Vec<CommandId> = server
            .join()
            .expect("server")
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        assert_eq!(
            commands,
            [
                CommandId::PROCESS_INFO_2,
                CommandId::ENABLE_PERF_MAP,
                CommandId::DISABLE_PERF_MAP
            ]
        );
    }

    fn nettrace_fixture(name: &str) -> Vec<u8> {
        use std::io::Read as _;
        let path = format!(
            "{}/../profiler-parse/src/nettrace/testdata/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        let file = fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let mut bytes = Vec::new();
        flate2::read::GzDecoder::new(file)
            .read_to_end(&mut bytes)
            .expect("gunzip fixture");
        bytes
    }

    /// A session against a fake runtime replaying a real capture: the
    /// CollectTracing2 request, the stream on the same connection, the
    /// StopTracing on a second one, and every contention and exception of
    /// the capture delivered once.
    #[test]
    fn a_session_streams_a_real_capture_and_stops() {
        use crate::clr::session::{ClrEventKinds, ClrSession, collect_tracing2_payload};
        use clrbpf_parse::{
            events::{ClrEvent, ClrEventDecoder},
            nettrace::{NettraceParser, ParsedItem},
        };
        let capture = nettrace_fixture("net8.nettrace.gz");
        let mut expected = (0u64, 0u64);
        let mut decoder = ClrEventDecoder::new();
        NettraceParser::new()
            .feed(&capture, &mut |item| {
                if let ParsedItem::Event(record) = item {
                    match decoder.decode(&record) {
                        Some(ClrEvent::ContentionStop(_)) => expected.0 += 1,
                        Some(ClrEvent::ExceptionThrown(_)) => expected.1 += 1,
                        _ => {}
                    }
                }
            })
            .expect("fixture parses");
        assert!(expected.0 > 0 && expected.1 > 0, "{expected:?}");

        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        let mut first = ok_reply(&0x5e55_u64.to_le_bytes());
        first.extend_from_slice(&capture);
        let server = serve(
            bind_in(&tmp, "dotnet-diagnostic-7-100-socket"),
            vec![first, ok_reply(&0x5e55_u64.to_le_bytes())],
        );
        let session = ClrSession::start(
            &DiagnosticClient::discover(&procfs, 5).expect("discover"),
            ClrEventKinds::ALL,
            Some(8),
        )
        .expect("start");
        let mut seen = (0u64, 0u64);
        let (end, stop_error) = session.stop(
            Instant::now() + Duration::from_secs(10),
            &mut |event| match event.event {
                ClrEvent::ContentionStop(_) => seen.0 += 1,
                ClrEvent::ExceptionThrown(_) => {
                    assert!(!event.stack.is_empty(), "exception without its stack");
                    assert!(event.time_ns > 0);
                    seen.1 += 1;
                }
                _ => {}
            },
        );
        assert!(stop_error.is_none(), "{stop_error:?}");
        assert!(end.error.is_none(), "{:?}", end.error);
        assert_eq!(seen, expected);
        let requests = server.join().expect("server");
        assert_eq!(requests[0].0, CommandId::COLLECT_TRACING_2);
        assert_eq!(
            requests[0].1,
            collect_tracing2_payload(
                crate::clr::session::SESSION_BUFFER_MB,
                false,
                &[crate::clr::session::ProviderConfig {
                    name: clrbpf_parse::events::RUNTIME_PROVIDER.to_owned(),
                    keywords: ClrEventKinds::ALL.keywords(Some(8)),
                    level: 5,
                    filter: String::new(),
                }]
            )
        );
        assert_eq!(
            requests[1],
            (CommandId::STOP_TRACING, 0x5e55_u64.to_le_bytes().to_vec())
        );
    }

    #[test]
    fn a_refused_session_is_an_error_and_a_cut_stream_keeps_its_events() {
        use crate::clr::session::{ClrEventKinds, ClrSession};
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        let capture = nettrace_fixture("netcore31.nettrace.gz");
        let mut cut = ok_reply(&1u64.to_le_bytes());
        cut.extend_from_slice(&capture[..capture.len() / 2]);
        let server = serve(
            bind_in(&tmp, "dotnet-diagnostic-7-100-socket"),
            vec![error_reply(RuntimeError::UNKNOWN_COMMAND), cut],
        );
        let err = ClrSession::start(
            &DiagnosticClient::discover(&procfs, 5).expect("discover"),
            ClrEventKinds::ALL,
            Some(3),
        )
        .expect_err("refused");
        assert_eq!(err.runtime_error(), Some(RuntimeError::UnknownCommand));
        // The target "exits" half way through its stream.
        let mut session = ClrSession::start(
            &DiagnosticClient::discover(&procfs, 5).expect("discover"),
            ClrEventKinds::ALL,
            Some(3),
        )
        .expect("start");
        let mut events = 0;
        for _ in 0..200 {
            events += session.drain(&mut |_| {});
            if session.has_ended() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(session.has_ended(), "a closed stream ends the session");
        assert!(events > 0, "the events before the cut are kept");
        server.join().expect("server");
    }

    #[test]
    fn dropping_an_attach_turns_perf_maps_off() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        let server = serve(
            bind_in(&tmp, "dotnet-diagnostic-7-100-socket"),
            vec![
                ok_reply(&process_info_payload(Some(("App", "9.0.0")))),
                ok_reply(&0u32.to_le_bytes()),
                ok_reply(&0u32.to_le_bytes()),
            ],
        );
        let outcome = PerfMapAttach::attach(&DiagnosticPort::new(&procfs, 5)).expect("attach");
        assert!(matches!(outcome, PerfMapAttachOutcome::Enabled(_)));
        drop(outcome);
        let requests = server.join().expect("server");
        assert_eq!(
            requests.last().map(|(c, _)| *c),
            Some(CommandId::DISABLE_PERF_MAP)
        );
    }

    #[test]
    fn reenabling_turns_perf_maps_off_then_on_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (procfs, tmp) = fake_target(dir.path(), "/tmp", "");
        let server = serve(
            bind_in(&tmp, "dotnet-diagnostic-7-100-socket"),
            vec![
                ok_reply(&process_info_payload(Some(("App", "8.0.4")))),
                ok_reply(&0u32.to_le_bytes()),
                // The other recorder turned them off already: refused.
                error_reply(0x8013_1384),
                ok_reply(&0u32.to_le_bytes()),
                ok_reply(&0u32.to_le_bytes()),
            ],
        );
        let outcome = PerfMapAttach::attach(&DiagnosticPort::new(&procfs, 5)).expect("attach");
        let PerfMapAttachOutcome::Enabled(mut attach) = outcome else {
            panic!("expected enabled, got {outcome:?}");
        };
        let first = attach.enabled_at;
        attach
            .reenable()
            .expect("re-enabled despite the refused disable");
        assert_eq!(
            attach.enabled_at, first,
            "files written since the first request stay this recording's to remove"
        );
        drop(attach);
        let commands: Vec<CommandId> = server
            .join()
            .expect("server")
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        assert_eq!(
            commands[1..],
            [
                CommandId::ENABLE_PERF_MAP,
                CommandId::DISABLE_PERF_MAP,
                CommandId::ENABLE_PERF_MAP,
                CommandId::DISABLE_PERF_MAP,
            ]
        );
    }
}
