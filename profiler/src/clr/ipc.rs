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
//! 2. frames requests and parses responses strictly: the runtime is
//!    trusted no more than any other input from a target process, so every
//!    size is checked, a response is at most 65 535 bytes (its size field is
//!    a u16), and the whole exchange has a deadline;
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
    fmt, io,
    io::{Read, Write},
    os::{fd::AsFd, unix::net::UnixStream},
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use crate::process::{
    ProcError, ProcFs,
    dotnet::{DotnetEnvironment, version_major},
    identity::{FsIdentity, IdentityError},
    root::{EntryKind, TargetDir, TargetRoot, entry_kind, fd_path, fstat},
};

/// First 14 bytes of every message.
pub const IPC_MAGIC: [u8; 14] = *b"DOTNET_IPC_V1\0";
/// Size of the message header.
pub const HEADER_LEN: usize = 20;
/// The header's size field is a u16: no message is longer.
pub const MAX_MESSAGE_LEN: usize = u16::MAX as usize;
/// Default deadline for one command (connect, send, full response).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

const SOCKET_PREFIX: &str = "dotnet-diagnostic-";
const SOCKET_SUFFIX: &str = "-socket";
/// Command set and ids of the runtime's replies.
const SERVER_SET: u8 = 0xFF;
const SERVER_OK: u8 = 0x00;
const SERVER_ERROR: u8 = 0xFF;
/// Size of a reply that carries only an HRESULT.
const STATUS_RESPONSE_LEN: usize = HEADER_LEN + 4;

/// A command: set and id (code `set << 8 | id` in Microsoft's docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommandId {
    pub set: u8,
    pub id: u8,
}

impl CommandId {
    pub const STOP_TRACING: Self = Self::new(0x02, 0x01);
    pub const COLLECT_TRACING: Self = Self::new(0x02, 0x02);
    pub const COLLECT_TRACING_2: Self = Self::new(0x02, 0x03);
    pub const COLLECT_TRACING_3: Self = Self::new(0x02, 0x04);
    pub const COLLECT_TRACING_4: Self = Self::new(0x02, 0x05);
    pub const COLLECT_TRACING_5: Self = Self::new(0x02, 0x06);
    pub const PROCESS_INFO: Self = Self::new(0x04, 0x00);
    pub const RESUME_RUNTIME: Self = Self::new(0x04, 0x01);
    pub const PROCESS_ENVIRONMENT: Self = Self::new(0x04, 0x02);
    pub const SET_ENVIRONMENT_VARIABLE: Self = Self::new(0x04, 0x03);
    pub const PROCESS_INFO_2: Self = Self::new(0x04, 0x04);
    pub const ENABLE_PERF_MAP: Self = Self::new(0x04, 0x05);
    pub const DISABLE_PERF_MAP: Self = Self::new(0x04, 0x06);
    pub const APPLY_STARTUP_HOOK: Self = Self::new(0x04, 0x07);
    pub const PROCESS_INFO_3: Self = Self::new(0x04, 0x08);

    pub const fn new(set: u8, id: u8) -> Self {
        Self { set, id }
    }

    /// The protocol's name of the command, for messages.
    pub fn name(self) -> &'static str {
        match (self.set, self.id) {
            (0x02, 0x01) => "StopTracing",
            (0x02, 0x02) => "CollectTracing",
            (0x02, 0x03) => "CollectTracing2",
            (0x02, 0x04) => "CollectTracing3",
            (0x02, 0x05) => "CollectTracing4",
            (0x02, 0x06) => "CollectTracing5",
            (0x04, 0x00) => "ProcessInfo",
            (0x04, 0x01) => "ResumeRuntime",
            (0x04, 0x02) => "ProcessEnvironment",
            (0x04, 0x03) => "SetEnvironmentVariable",
            (0x04, 0x04) => "ProcessInfo2",
            (0x04, 0x05) => "EnablePerfMap",
            (0x04, 0x06) => "DisablePerfMap",
            (0x04, 0x07) => "ApplyStartupHook",
            (0x04, 0x08) => "ProcessInfo3",
            _ => "unknown command",
        }
    }
}

impl fmt::Display for CommandId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({:#04x}{:02x})", self.name(), self.set, self.id)
    }
}

/// The 20-byte message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHeader {
    /// Total message size, header included.
    pub size: u16,
    pub command: CommandId,
    pub reserved: u16,
}

impl IpcHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let Self {
            size,
            command,
            reserved,
        } = *self;
        let mut bytes = [0u8; HEADER_LEN];
        bytes[..14].copy_from_slice(&IPC_MAGIC);
        bytes[14..16].copy_from_slice(&size.to_le_bytes());
        bytes[16] = command.set;
        bytes[17] = command.id;
        bytes[18..20].copy_from_slice(&reserved.to_le_bytes());
        bytes
    }

    /// Parses a header; checks the magic and that `size` covers the header.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, ResponseError> {
        if bytes[..14] != IPC_MAGIC {
            return Err(ResponseError::BadMagic);
        }
        let size = u16::from_le_bytes([bytes[14], bytes[15]]);
        if usize::from(size) < HEADER_LEN {
            return Err(ResponseError::SizeBelowHeader { size });
        }
        Ok(Self {
            size,
            command: CommandId::new(bytes[16], bytes[17]),
            reserved: u16::from_le_bytes([bytes[18], bytes[19]]),
        })
    }

    /// Payload bytes that follow the header.
    pub fn payload_len(&self) -> usize {
        usize::from(self.size).saturating_sub(HEADER_LEN)
    }
}

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

/// Appends a protocol string: u32 count of UTF-16 units including the NUL,
/// the units, the NUL; an empty string is count 0 (what the runtime reads as
/// null). For the EventPipe requests to come.
pub fn encode_string(out: &mut Vec<u8>, value: &str) {
    if value.is_empty() {
        out.extend_from_slice(&0u32.to_le_bytes());
        return;
    }
    let units: Vec<u16> = value.encode_utf16().chain(std::iter::once(0)).collect();
    let count = u32::try_from(units.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&count.to_le_bytes());
    for unit in units {
        out.extend_from_slice(&unit.to_le_bytes());
    }
}

/// An error HRESULT the runtime returned, by its protocol name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum RuntimeError {
    #[error("BAD_ENCODING (0x80131384): the runtime could not parse the request")]
    BadEncoding,
    #[error("UNKNOWN_COMMAND (0x80131385): the runtime is too old for this command")]
    UnknownCommand,
    #[error("UNKNOWN_MAGIC (0x80131386): the runtime does not speak DOTNET_IPC_V1")]
    UnknownMagic,
    #[error(
        "NOTSUPPORTED (0x80131515): this runtime does not support the command (NativeAOT and Mono lack it)"
    )]
    NotSupported,
    #[error("FAIL (0x80004005): the command failed inside the runtime")]
    Fail,
    #[error("NOT_YET_AVAILABLE (0x8013135B): the runtime is still starting; retry later")]
    NotYetAvailable,
    #[error("RUNTIME_UNINITIALIZED (0x80131371): the runtime is not initialized yet; retry later")]
    RuntimeUninitialized,
    #[error("INVALIDARG (0x80070057): the runtime rejected an argument")]
    InvalidArg,
    #[error("HRESULT {0:#010x}")]
    Other(u32),
}

impl RuntimeError {
    pub const BAD_ENCODING: u32 = 0x8013_1384;
    pub const UNKNOWN_COMMAND: u32 = 0x8013_1385;
    pub const UNKNOWN_MAGIC: u32 = 0x8013_1386;
    pub const NOT_SUPPORTED: u32 = 0x8013_1515;
    pub const FAIL: u32 = 0x8000_4005;
    pub const NOT_YET_AVAILABLE: u32 = 0x8013_135B;
    pub const RUNTIME_UNINITIALIZED: u32 = 0x8013_1371;
    pub const INVALID_ARG: u32 = 0x8007_0057;

    /// Names an HRESULT.
    pub fn from_hresult(hresult: u32) -> Self {
        match hresult {
            Self::BAD_ENCODING => Self::BadEncoding,
            Self::UNKNOWN_COMMAND => Self::UnknownCommand,
            Self::UNKNOWN_MAGIC => Self::UnknownMagic,
            Self::NOT_SUPPORTED => Self::NotSupported,
            Self::FAIL => Self::Fail,
            Self::NOT_YET_AVAILABLE => Self::NotYetAvailable,
            Self::RUNTIME_UNINITIALIZED => Self::RuntimeUninitialized,
            Self::INVALID_ARG => Self::InvalidArg,
            other => Self::Other(other),
        }
    }

    /// The HRESULT value.
    pub fn hresult(self) -> u32 {
        match self {
            Self::BadEncoding => Self::BAD_ENCODING,
            Self::UnknownCommand => Self::UNKNOWN_COMMAND,
            Self::UnknownMagic => Self::UNKNOWN_MAGIC,
            Self::NotSupported => Self::NOT_SUPPORTED,
            Self::Fail => Self::FAIL,
            Self::NotYetAvailable => Self::NOT_YET_AVAILABLE,
            Self::RuntimeUninitialized => Self::RUNTIME_UNINITIALIZED,
            Self::InvalidArg => Self::INVALID_ARG,
            Self::Other(hresult) => hresult,
        }
    }
}

/// A response that breaks the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    #[error("response does not start with DOTNET_IPC_V1")]
    BadMagic,
    #[error("response declares {size} bytes, less than its 20-byte header")]
    SizeBelowHeader { size: u16 },
    #[error("response declares {size} bytes, more than the {max} expected")]
    TooLarge { size: usize, max: usize },
    #[error("the runtime closed the connection after {received} of {expected} bytes")]
    Closed { received: usize, expected: usize },
    #[error("response has command set {set:#04x} id {id:#04x}, neither OK nor error")]
    UnexpectedKind { set: u8, id: u8 },
    #[error("error response carries {len} payload bytes instead of a 4-byte HRESULT")]
    BadErrorPayload { len: usize },
    #[error("status response carries {len} payload bytes instead of a 4-byte HRESULT")]
    BadStatusPayload { len: usize },
    #[error("field {field} needs {needed} bytes at offset {offset}, the payload has {len}")]
    Truncated {
        field: &'static str,
        offset: usize,
        needed: u64,
        len: usize,
    },
    #[error("string field {field} is not NUL-terminated")]
    UnterminatedString { field: &'static str },
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

/// A raw reply: header and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcResponse {
    pub header: IpcHeader,
    pub payload: Vec<u8>,
}

/// What a reply means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerReply {
    /// OK, with the command's payload.
    Ok(Vec<u8>),
    /// Error, with the runtime's HRESULT.
    Error(RuntimeError),
}

impl IpcResponse {
    /// Classifies the reply as OK or error; anything else breaks the protocol.
    pub fn into_reply(self) -> Result<ServerReply, ResponseError> {
        let CommandId { set, id } = self.header.command;
        match (set, id) {
            (SERVER_SET, SERVER_OK) => Ok(ServerReply::Ok(self.payload)),
            (SERVER_SET, SERVER_ERROR) => {
                let hresult: [u8; 4] = self.payload.as_slice().try_into().map_err(|_| {
                    ResponseError::BadErrorPayload {
                        len: self.payload.len(),
                    }
                })?;
                Ok(ServerReply::Error(RuntimeError::from_hresult(
                    u32::from_le_bytes(hresult),
                )))
            }
            _ => Err(ResponseError::UnexpectedKind { set, id }),
        }
    }
}

/// Why reading a reply failed.
#[derive(Debug)]
enum ReadFailure {
    Io(io::Error),
    Response(ResponseError),
}

/// Reads one reply of at most `max_len` bytes (header included).
fn read_response(reader: &mut impl Read, max_len: usize) -> Result<IpcResponse, ReadFailure> {
    let mut header = [0u8; HEADER_LEN];
    read_full(reader, &mut header, 0, HEADER_LEN)?;
    let header = IpcHeader::decode(&header).map_err(ReadFailure::Response)?;
    let size = usize::from(header.size);
    if size > max_len {
        return Err(ReadFailure::Response(ResponseError::TooLarge {
            size,
            max: max_len,
        }));
    }
    let mut payload = vec![0u8; header.payload_len()];
    read_full(reader, &mut payload, HEADER_LEN, size)?;
    Ok(IpcResponse { header, payload })
}

/// `read_exact` that tells how far it got when the peer closes.
fn read_full(
    reader: &mut impl Read,
    buf: &mut [u8],
    already: usize,
    expected: usize,
) -> Result<(), ReadFailure> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(ReadFailure::Response(ResponseError::Closed {
                    received: already + filled,
                    expected,
                }));
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadFailure::Io(e)),
        }
    }
    Ok(())
}

/// Reads fields of a payload in order, checking each size.
struct PayloadReader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> PayloadReader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, offset: 0 }
    }

    fn take(&mut self, field: &'static str, needed: u64) -> Result<&'a [u8], ResponseError> {
        let remaining = self.bytes.len() - self.offset;
        let truncated = ResponseError::Truncated {
            field,
            offset: self.offset,
            needed,
            len: self.bytes.len(),
        };
        let needed = usize::try_from(needed).map_err(|_| truncated.clone())?;
        if needed > remaining {
            return Err(truncated);
        }
        let slice = &self.bytes[self.offset..self.offset + needed];
        self.offset += needed;
        Ok(slice)
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, ResponseError> {
        let bytes = self.take(field, 4)?;
        Ok(u32::from_le_bytes(bytes.try_into().expect("took 4 bytes")))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, ResponseError> {
        let bytes = self.take(field, 8)?;
        Ok(u64::from_le_bytes(bytes.try_into().expect("took 8 bytes")))
    }

    fn guid(&mut self, field: &'static str) -> Result<[u8; 16], ResponseError> {
        let bytes = self.take(field, 16)?;
        Ok(bytes.try_into().expect("took 16 bytes"))
    }

    /// A protocol string (u32 count of UTF-16 units with the NUL, then the
    /// units). Count 0 is null, read as "". Decoding is lossy and stops at
    /// the first NUL.
    fn string(&mut self, field: &'static str) -> Result<String, ResponseError> {
        let count = self.u32(field)?;
        if count == 0 {
            return Ok(String::new());
        }
        let bytes = self.take(field, u64::from(count) * 2)?;
        let units: Vec<u16> = bytes
            .chunks_exact(2)
            .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
            .collect();
        if units.last() != Some(&0) {
            return Err(ResponseError::UnterminatedString { field });
        }
        let end = units.iter().position(|&u| u == 0).unwrap_or(units.len());
        Ok(String::from_utf16_lossy(&units[..end]))
    }
}

/// The runtime's own view of the process (`ProcessInfo`/`ProcessInfo2`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeProcessInfo {
    /// Pid inside the process's namespace.
    pub pid: u64,
    /// Random per runtime instance.
    pub runtime_cookie: [u8; 16],
    pub command_line: String,
    /// `"Linux"`.
    pub os: String,
    /// `"x64"`, `"arm64"`, ...
    pub arch: String,
    /// `ProcessInfo2` (.NET 6+) only.
    pub managed_entrypoint_assembly: Option<String>,
    /// `ProcessInfo2` (.NET 6+) only: `"8.0.4+2d7eea25..."`.
    pub clr_product_version: Option<String>,
}

impl RuntimeProcessInfo {
    /// Major .NET version from `clr_product_version`.
    pub fn runtime_major(&self) -> Option<u32> {
        self.clr_product_version.as_deref().and_then(version_major)
    }
}

/// Parses a `ProcessInfo` (0x0400) payload: pid, cookie, command line, OS, arch.
pub fn parse_process_info(payload: &[u8]) -> Result<RuntimeProcessInfo, ResponseError> {
    let mut reader = PayloadReader::new(payload);
    parse_process_info_common(&mut reader)
}

/// Parses a `ProcessInfo2` (0x0404) payload: `ProcessInfo` + entry-point
/// assembly + CLR product version.
pub fn parse_process_info2(payload: &[u8]) -> Result<RuntimeProcessInfo, ResponseError> {
    let mut reader = PayloadReader::new(payload);
    let mut info = parse_process_info_common(&mut reader)?;
    info.managed_entrypoint_assembly = Some(reader.string("managedEntrypointAssemblyName")?);
    info.clr_product_version = Some(reader.string("clrProductVersion")?);
    Ok(info)
}

fn parse_process_info_common(
    reader: &mut PayloadReader<'_>,
) -> Result<RuntimeProcessInfo, ResponseError> {
    Ok(RuntimeProcessInfo {
        pid: reader.u64("processId")?,
        runtime_cookie: reader.guid("runtimeCookie")?,
        command_line: reader.string("commandLine")?,
        os: reader.string("OS")?,
        arch: reader.string("arch")?,
        managed_entrypoint_assembly: None,
        clr_product_version: None,
    })
}

/// Parses a reply that carries only an HRESULT (EnablePerfMap,
/// DisablePerfMap, ...): OK with 0, or an error.
pub fn parse_status(reply: ServerReply) -> Result<Result<(), RuntimeError>, ResponseError> {
    match reply {
        ServerReply::Error(error) => Ok(Err(error)),
        ServerReply::Ok(payload) => {
            let hresult: [u8; 4] = payload
                .as_slice()
                .try_into()
                .map_err(|_| ResponseError::BadStatusPayload { len: payload.len() })?;
            Ok(match u32::from_le_bytes(hresult) {
                0 => Ok(()),
                // Success codes (high bit clear) other than S_OK mean success too.
                code if code & 0x8000_0000 == 0 => Ok(()),
                code => Err(RuntimeError::from_hresult(code)),
            })
        }
    }
}

/// What to write when perf maps are turned on (`PerfMapType` in the runtime).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum PerfMapType {
    /// `perf-PID.map` and `jit-PID.dump` (which also gets ReadyToRun code).
    All = 1,
    /// `jit-PID.dump` only.
    JitDump = 2,
    /// `perf-PID.map` only.
    PerfMap = 3,
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

/// The u64 session id of a CollectTracing / StopTracing reply; `Err(Ok)` for
/// a malformed reply, `Err(Err)` for a refusal.
pub fn parse_session_id(reply: ServerReply) -> Result<u64, Result<ResponseError, RuntimeError>> {
    match reply {
        ServerReply::Error(error) => Err(Err(error)),
        ServerReply::Ok(payload) => {
            let id: [u8; 8] = payload.as_slice().try_into().map_err(|_| {
                Ok(ResponseError::Truncated {
                    field: "sessionId",
                    offset: 0,
                    needed: 8,
                    len: payload.len(),
                })
            })?;
            Ok(u64::from_le_bytes(id))
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
    use std::{
        fs,
        os::{fd::AsRawFd, unix::net::UnixListener},
        thread::JoinHandle,
    };

    fn header_bytes(size: u16, set: u8, id: u8) -> Vec<u8> {
        IpcHeader {
            size,
            command: CommandId::new(set, id),
            reserved: 0,
        }
        .encode()
        .to_vec()
    }

    fn ok_reply(payload: &[u8]) -> Vec<u8> {
        let size = u16::try_from(HEADER_LEN + payload.len()).expect("test payload fits");
        let mut bytes = header_bytes(size, 0xFF, 0x00);
        bytes.extend_from_slice(payload);
        bytes
    }

    fn error_reply(hresult: u32) -> Vec<u8> {
        let mut bytes = header_bytes(24, 0xFF, 0xFF);
        bytes.extend_from_slice(&hresult.to_le_bytes());
        bytes
    }

    fn utf16_string(out: &mut Vec<u8>, value: &str) {
        encode_string(out, value);
    }

    fn process_info_payload(version2: Option<(&str, &str)>) -> Vec<u8> {
        let mut payload = Vec::new();
        payload.extend_from_slice(&7u64.to_le_bytes());
        payload.extend_from_slice(&[0xAB; 16]);
        utf16_string(&mut payload, "/usr/bin/dotnet App.dll ünïcode");
        utf16_string(&mut payload, "Linux");
        utf16_string(&mut payload, "x64");
        if let Some((assembly, version)) = version2 {
            utf16_string(&mut payload, assembly);
            utf16_string(&mut payload, version);
        }
        payload
    }

    #[test]
    fn header_round_trip_and_errors() {
        let header = IpcHeader {
            size: 24,
            command: CommandId::ENABLE_PERF_MAP,
            reserved: 0,
        };
        let bytes = header.encode();
        assert_eq!(&bytes[..14], b"DOTNET_IPC_V1\0");
        assert_eq!(&bytes[14..], &[24, 0, 4, 5, 0, 0]);
        assert_eq!(IpcHeader::decode(&bytes), Ok(header));
        assert_eq!(header.payload_len(), 4);

        let mut bad = bytes;
        bad[3] = b'x';
        assert_eq!(IpcHeader::decode(&bad), Err(ResponseError::BadMagic));
        let mut small = bytes;
        small[14] = 19;
        assert_eq!(
            IpcHeader::decode(&small),
            Err(ResponseError::SizeBelowHeader { size: 19 })
        );
    }

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
    fn strings_encode_like_the_dotnet_client() {
        let mut out = Vec::new();
        encode_string(&mut out, "ab");
        assert_eq!(out, [3, 0, 0, 0, b'a', 0, b'b', 0, 0, 0]);
        out.clear();
        encode_string(&mut out, "");
        assert_eq!(out, [0, 0, 0, 0]);
    }

    #[test]
    fn hresults_have_names() {
        let named = [
            (0x8013_1384, RuntimeError::BadEncoding, "BAD_ENCODING"),
            (0x8013_1385, RuntimeError::UnknownCommand, "UNKNOWN_COMMAND"),
            (0x8013_1386, RuntimeError::UnknownMagic, "UNKNOWN_MAGIC"),
            (0x8013_1515, RuntimeError::NotSupported, "NOTSUPPORTED"),
            (0x8000_4005, RuntimeError::Fail, "FAIL"),
            (
                0x8013_135B,
                RuntimeError::NotYetAvailable,
                "NOT_YET_AVAILABLE",
            ),
            (
                0x8013_1371,
                RuntimeError::RuntimeUninitialized,
                "RUNTIME_UNINITIALIZED",
            ),
            (0x8007_0057, RuntimeError::InvalidArg, "INVALIDARG"),
        ];
        for (hresult, error, name) in named {
            assert_eq!(RuntimeError::from_hresult(hresult), error);
            assert_eq!(error.hresult(), hresult);
            assert!(error.to_string().starts_with(name), "{error}");
        }
        let other = RuntimeError::from_hresult(0x8000_FFFF);
        assert_eq!(other, RuntimeError::Other(0x8000_FFFF));
        assert_eq!(other.hresult(), 0x8000_FFFF);
        assert_eq!(other.to_string(), "HRESULT 0x8000ffff");
    }

    fn read(bytes: &[u8], max: usize) -> Result<IpcResponse, ResponseError> {
        read_response(&mut &bytes[..], max).map_err(|failure| match failure {
            ReadFailure::Response(e) => e,
            ReadFailure::Io(e) => panic!("unexpected i/o error {e}"),
        })
    }

    #[test]
    fn responses_are_read_strictly() {
        let reply = ok_reply(&[1, 2, 3]);
        let response = read(&reply, MAX_MESSAGE_LEN).expect("read");
        assert_eq!(response.payload, [1, 2, 3]);
        assert_eq!(response.into_reply(), Ok(ServerReply::Ok(vec![1, 2, 3])));

        // Every truncation of a valid reply says how far it got.
        for len in 0..reply.len() {
            let expected = if len < HEADER_LEN {
                HEADER_LEN
            } else {
                reply.len()
            };
            assert_eq!(
                read(&reply[..len], MAX_MESSAGE_LEN),
                Err(ResponseError::Closed {
                    received: len,
                    expected
                })
            );
        }
        assert_eq!(
            read(&reply, HEADER_LEN + 2),
            Err(ResponseError::TooLarge { size: 23, max: 22 })
        );
        // Trailing bytes after the declared size are not read.
        let mut longer = reply;
        longer.extend_from_slice(b"junk");
        assert_eq!(
            read(&longer, MAX_MESSAGE_LEN).expect("read").payload,
            [1, 2, 3]
        );
        // A size field of 65535 with nothing behind it.
        let huge = header_bytes(u16::MAX, 0xFF, 0);
        assert_eq!(
            read(&huge, MAX_MESSAGE_LEN),
            Err(ResponseError::Closed {
                received: 20,
                expected: 65535
            })
        );
    }

    #[test]
    fn replies_are_classified() {
        let error = read(&error_reply(0x8013_1385), MAX_MESSAGE_LEN).expect("read");
        assert_eq!(
            error.into_reply(),
            Ok(ServerReply::Error(RuntimeError::UnknownCommand))
        );
        for len in [0usize, 3, 5] {
            let mut bytes =
                header_bytes(u16::try_from(HEADER_LEN + len).expect("fits"), 0xFF, 0xFF);
            bytes.extend(std::iter::repeat_n(0u8, len));
            let response = read(&bytes, MAX_MESSAGE_LEN).expect("read");
            assert_eq!(
                response.into_reply(),
                Err(ResponseError::BadErrorPayload { len })
            );
        }
        for (set, id) in [(0x04, 0x00), (0xFF, 0x01), (0x00, 0x00)] {
            let response = read(&header_bytes(20, set, id), MAX_MESSAGE_LEN).expect("read");
            assert_eq!(
                response.into_reply(),
                Err(ResponseError::UnexpectedKind { set, id })
            );
        }
    }

    #[test]
    fn status_payloads() {
        assert_eq!(parse_status(ServerReply::Ok(vec![0, 0, 0, 0])), Ok(Ok(())));
        assert_eq!(parse_status(ServerReply::Ok(vec![1, 0, 0, 0])), Ok(Ok(())));
        assert_eq!(
            parse_status(ServerReply::Ok(0x8013_1515u32.to_le_bytes().to_vec())),
            Ok(Err(RuntimeError::NotSupported))
        );
        assert_eq!(
            parse_status(ServerReply::Error(RuntimeError::Fail)),
            Ok(Err(RuntimeError::Fail))
        );
        for payload in [vec![], vec![0; 3], vec![0; 5]] {
            let len = payload.len();
            assert_eq!(
                parse_status(ServerReply::Ok(payload)),
                Err(ResponseError::BadStatusPayload { len })
            );
        }
    }

    #[test]
    fn process_info_payloads() {
        let info = parse_process_info(&process_info_payload(None)).expect("parse");
        assert_eq!(info.pid, 7);
        assert_eq!(info.runtime_cookie, [0xAB; 16]);
        assert_eq!(info.command_line, "/usr/bin/dotnet App.dll ünïcode");
        assert_eq!((info.os.as_str(), info.arch.as_str()), ("Linux", "x64"));
        assert_eq!(info.clr_product_version, None);
        assert_eq!(info.runtime_major(), None);

        let payload = process_info_payload(Some(("App", "8.0.4+2d7eea25")));
        let info = parse_process_info2(&payload).expect("parse");
        assert_eq!(info.managed_entrypoint_assembly.as_deref(), Some("App"));
        assert_eq!(info.clr_product_version.as_deref(), Some("8.0.4+2d7eea25"));
        assert_eq!(info.runtime_major(), Some(8));
        // A ProcessInfo payload is too short for ProcessInfo2.
        assert!(matches!(
            parse_process_info2(&process_info_payload(None)),
            Err(ResponseError::Truncated {
                field: "managedEntrypointAssemblyName",
                ..
            })
        ));
        // Every prefix fails cleanly.
        for len in 0..payload.len() {
            assert!(
                parse_process_info2(&payload[..len]).is_err(),
                "prefix {len}"
            );
        }
    }

    #[test]
    fn hostile_process_info_payloads() {
        // A string count far past the payload.
        let mut payload = Vec::new();
        payload.extend_from_slice(&7u64.to_le_bytes());
        payload.extend_from_slice(&[0; 16]);
        payload.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            parse_process_info(&payload),
            Err(ResponseError::Truncated {
                field: "commandLine",
                offset: 28,
                needed: u64::from(u32::MAX) * 2,
                len: 28,
            })
        );
        // A string without its NUL.
        let mut payload = Vec::new();
        payload.extend_from_slice(&7u64.to_le_bytes());
        payload.extend_from_slice(&[0; 16]);
        payload.extend_from_slice(&2u32.to_le_bytes());
        payload.extend_from_slice(&[b'a', 0, b'b', 0]);
        assert_eq!(
            parse_process_info(&payload),
            Err(ResponseError::UnterminatedString {
                field: "commandLine"
            })
        );
        // Null strings, an interior NUL, and a lone surrogate.
        let mut payload = Vec::new();
        payload.extend_from_slice(&7u64.to_le_bytes());
        payload.extend_from_slice(&[0; 16]);
        payload.extend_from_slice(&0u32.to_le_bytes());
        payload.extend_from_slice(&4u32.to_le_bytes());
        payload.extend_from_slice(&[b'L', 0, 0, 0, b'X', 0, 0, 0]);
        payload.extend_from_slice(&2u32.to_le_bytes());
        payload.extend_from_slice(&[0x00, 0xD8, 0, 0]);
        let info = parse_process_info(&payload).expect("parse");
        assert_eq!(info.command_line, "");
        assert_eq!(info.os, "L");
        assert_eq!(info.arch, "\u{fffd}");
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
