//! The diagnostic IPC wire format, as a .NET runtime speaks it on its
//! diagnostic socket: message headers, the commands, the runtime's replies
//! and the payloads clrbpf reads from them (`ProcessInfo`/`ProcessInfo2`,
//! status HRESULTs, session ids). The profiler's `clr::ipc` finds the
//! socket and runs the exchanges; everything a reply says is decoded here.
//!
//! One command per connection: a 20-byte header (`DOTNET_IPC_V1\0`, u16
//! total size, command set, command id, reserved) and a payload; the reply
//! is a header with set `0xFF` and id `0x00` (OK + payload) or `0xFF`
//! (error + HRESULT). The runtime is trusted no more than any other input
//! from a target process: every size is checked, a reply is at most
//! 65 535 bytes (its size field is a u16), strings are bounded by the
//! payload and decoded lossily.
//!
//! Protocol reference: dotnet/diagnostics `documentation/design-docs/ipc-protocol.md`.

use std::{fmt, io, io::Read};

use crate::version::version_major;

/// First 14 bytes of every message.
pub const IPC_MAGIC: [u8; 14] = *b"DOTNET_IPC_V1\0";
/// Size of the message header.
pub const HEADER_LEN: usize = 20;
/// The header's size field is a u16: no message is longer.
pub const MAX_MESSAGE_LEN: usize = u16::MAX as usize;
/// Command set and ids of the runtime's replies.
const SERVER_SET: u8 = 0xFF;
const SERVER_OK: u8 = 0x00;
const SERVER_ERROR: u8 = 0xFF;
/// Size of a reply that carries only an HRESULT.
pub const STATUS_RESPONSE_LEN: usize = HEADER_LEN + 4;

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
pub enum ReadFailure {
    Io(io::Error),
    Response(ResponseError),
}

/// Reads one reply of at most `max_len` bytes (header included).
pub fn read_response(reader: &mut impl Read, max_len: usize) -> Result<IpcResponse, ReadFailure> {
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

/// Replies as a runtime writes them, for fake runtimes in tests.
#[cfg(any(test, feature = "fakes"))]
pub mod fakes {
    use super::*;

    pub fn header_bytes(size: u16, set: u8, id: u8) -> Vec<u8> {
        IpcHeader {
            size,
            command: CommandId::new(set, id),
            reserved: 0,
        }
        .encode()
        .to_vec()
    }

    pub fn ok_reply(payload: &[u8]) -> Vec<u8> {
        let size = u16::try_from(HEADER_LEN + payload.len()).expect("test payload fits");
        let mut bytes = header_bytes(size, 0xFF, 0x00);
        bytes.extend_from_slice(payload);
        bytes
    }

    pub fn error_reply(hresult: u32) -> Vec<u8> {
        let mut bytes = header_bytes(24, 0xFF, 0xFF);
        bytes.extend_from_slice(&hresult.to_le_bytes());
        bytes
    }

    pub fn utf16_string(out: &mut Vec<u8>, value: &str) {
        encode_string(out, value);
    }

    pub fn process_info_payload(version2: Option<(&str, &str)>) -> Vec<u8> {
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
}

#[cfg(test)]
mod tests {
    use super::fakes::*;
    use super::*;

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
}
