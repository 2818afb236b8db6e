//! The outer layer of a NetTrace V4/V5 stream: the `Nettrace` magic, the
//! FastSerialization signature, the `Trace` object, then one object per
//! block until the NullReference tag. [`next_frame`] looks at the bytes
//! received so far and either names the next complete frame or says how many
//! bytes it needs, so the parser can buffer exactly one frame at a time.

use super::{
    TraceHeader, TraceSyncTime,
    error::{BlockKind, NettraceError},
    reader::ByteReader,
};

pub(crate) const MAGIC: &[u8; 8] = b"Nettrace";
pub(crate) const SERIALIZATION_SIGNATURE: &[u8; 20] = b"!FastSerialization.1";
pub(crate) const TAG_NULL_REFERENCE: u8 = 1;
pub(crate) const TAG_BEGIN_PRIVATE_OBJECT: u8 = 5;
pub(crate) const TAG_END_OBJECT: u8 = 6;
/// The runtime's type names are at most 13 bytes (`MetadataBlock`).
const MAX_TYPE_NAME: usize = 64;
/// Bytes of the Trace object's fields (SYSTEMTIME, two i64, four i32).
pub(crate) const TRACE_BODY_LEN: usize = 48;
/// The highest reader version of each object this parser implements.
const TRACE_READER_VERSION: i32 = 4;
const BLOCK_READER_VERSION: i32 = 2;

/// Where the parser stands in the stream grammar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Preamble,
    TraceObject,
    Objects,
    Ended,
}

/// One complete piece of the stream.
#[derive(Debug)]
pub(crate) enum Frame {
    Preamble,
    Trace(TraceHeader),
    /// A block object; its body is `frame[body_start..body_start + body_len]`.
    Block {
        kind: BlockKind,
        body_start: usize,
        body_len: usize,
    },
    EndOfStream,
}

#[derive(Debug)]
pub(crate) enum Step {
    /// The frame is not complete: at least this many bytes (counted from
    /// the frame's first byte) are needed to go on.
    NeedBytes(usize),
    Complete {
        len: usize,
        frame: Frame,
    },
}

/// Parse the frame at the start of `data`; `offset` is the absolute stream
/// offset of `data[0]` (block bodies are aligned on absolute offsets).
pub(crate) fn next_frame(
    data: &[u8],
    offset: u64,
    phase: Phase,
    max_block_bytes: usize,
) -> Result<Step, NettraceError> {
    let mut frame = FrameReader {
        data,
        offset,
        pos: 0,
    };
    let result = match phase {
        Phase::Preamble => frame.preamble(),
        Phase::TraceObject => frame.trace_object(),
        Phase::Objects => frame.block_object(max_block_bytes),
        Phase::Ended => Ok(Err(0)),
    }?;
    Ok(match result {
        Ok(frame) => frame,
        Err(needed) => Step::NeedBytes(needed),
    })
}

/// `Ok(Err(n))` inside a [`FrameReader`] method means "need `n` bytes".
type Partial<T> = Result<Result<T, usize>, NettraceError>;

macro_rules! need {
    ($frame:expr, $len:expr) => {
        if let Err(needed) = $frame.need($len) {
            return Ok(Err(needed));
        }
    };
}

struct FrameReader<'a> {
    data: &'a [u8],
    offset: u64,
    pos: usize,
}

impl FrameReader<'_> {
    fn need(&self, len: usize) -> Result<(), usize> {
        let end = self.pos.saturating_add(len);
        if end > self.data.len() {
            Err(end)
        } else {
            Ok(())
        }
    }

    fn abs(&self) -> u64 {
        self.offset + self.pos as u64
    }

    /// Callers have checked `need(len)`.
    fn take(&mut self, len: usize) -> &[u8] {
        let start = self.pos;
        self.pos += len;
        &self.data[start..self.pos]
    }

    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }

    fn i32(&mut self) -> i32 {
        let bytes = self.take(4);
        i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }

    fn expect_tag(&mut self, tag: u8, expected: &'static str) -> Result<(), NettraceError> {
        let offset = self.abs();
        let found = self.u8();
        if found == tag {
            Ok(())
        } else {
            Err(NettraceError::UnexpectedTag {
                offset,
                expected,
                found,
            })
        }
    }

    fn preamble(&mut self) -> Partial<Step> {
        need!(self, MAGIC.len() + 4);
        let magic = self.take(MAGIC.len());
        if magic != MAGIC {
            let mut found = [0u8; 8];
            found.copy_from_slice(magic);
            return Err(NettraceError::BadMagic { found });
        }
        let signature_offset = self.abs();
        let signature_len = self.i32();
        if signature_len == 0 {
            // V6 writes `u32 reserved = 0 | u32 major | u32 minor` here.
            need!(self, 4);
            let major = self.i32() as u32;
            return Err(NettraceError::UnsupportedFormat { major });
        }
        if signature_len != SERIALIZATION_SIGNATURE.len() as i32 {
            return Err(NettraceError::BadSerializationSignature {
                offset: signature_offset,
            });
        }
        need!(self, SERIALIZATION_SIGNATURE.len());
        if self.take(SERIALIZATION_SIGNATURE.len()) != SERIALIZATION_SIGNATURE {
            return Err(NettraceError::BadSerializationSignature {
                offset: signature_offset,
            });
        }
        Ok(Ok(Step::Complete {
            len: self.pos,
            frame: Frame::Preamble,
        }))
    }

    /// `BeginPrivateObject` (already consumed by the caller), then the type:
    /// `BeginPrivateObject | NullReference | i32 version | i32 minReaderVersion
    /// | i32 nameLen | name | EndObject`.
    fn object_type(&mut self) -> Partial<(String, i32, i32, u64)> {
        let type_offset = self.abs();
        need!(self, 2 + 12);
        self.expect_tag(TAG_BEGIN_PRIVATE_OBJECT, "BeginPrivateObject (type)")?;
        self.expect_tag(TAG_NULL_REFERENCE, "NullReference (type of type)")?;
        let version = self.i32();
        let min_reader_version = self.i32();
        let name_offset = self.abs();
        let name_len = self.i32();
        if !(1..=MAX_TYPE_NAME as i32).contains(&name_len) {
            return Err(NettraceError::BadTypeName {
                offset: name_offset,
                len: name_len,
                max: MAX_TYPE_NAME,
            });
        }
        need!(self, name_len as usize + 1);
        let name = String::from_utf8_lossy(self.take(name_len as usize)).into_owned();
        self.expect_tag(TAG_END_OBJECT, "EndObject (type)")?;
        Ok(Ok((name, version, min_reader_version, type_offset)))
    }

    fn trace_object(&mut self) -> Partial<Step> {
        need!(self, 1);
        self.expect_tag(TAG_BEGIN_PRIVATE_OBJECT, "BeginPrivateObject (Trace)")?;
        let (name, version, min_reader_version, type_offset) = match self.object_type()? {
            Ok(parts) => parts,
            Err(needed) => return Ok(Err(needed)),
        };
        if name != "Trace" {
            return Err(NettraceError::MissingTraceObject {
                offset: type_offset,
                name,
            });
        }
        check_object_version(
            name,
            version,
            min_reader_version,
            type_offset,
            TRACE_READER_VERSION,
        )?;
        need!(self, TRACE_BODY_LEN + 1);
        let body_offset = self.abs();
        let header = parse_trace_body(self.take(TRACE_BODY_LEN), body_offset)?;
        self.expect_tag(TAG_END_OBJECT, "EndObject (Trace)")?;
        Ok(Ok(Step::Complete {
            len: self.pos,
            frame: Frame::Trace(header),
        }))
    }

    /// `BeginPrivateObject | type | i32 BlockSize | zero padding to an
    /// absolute 4-byte boundary | BlockSize bytes | EndObject`, or the
    /// NullReference tag that ends the stream.
    fn block_object(&mut self, max_block_bytes: usize) -> Partial<Step> {
        need!(self, 1);
        if self.data[0] == TAG_NULL_REFERENCE {
            return Ok(Ok(Step::Complete {
                len: 1,
                frame: Frame::EndOfStream,
            }));
        }
        self.expect_tag(
            TAG_BEGIN_PRIVATE_OBJECT,
            "BeginPrivateObject or NullReference",
        )?;
        let (name, version, min_reader_version, type_offset) = match self.object_type()? {
            Ok(parts) => parts,
            Err(needed) => return Ok(Err(needed)),
        };
        let Some(kind) = BlockKind::from_type_name(name.as_bytes()) else {
            return Err(NettraceError::UnknownObject {
                offset: type_offset,
                name,
            });
        };
        check_object_version(
            name,
            version,
            min_reader_version,
            type_offset,
            BLOCK_READER_VERSION,
        )?;
        need!(self, 4);
        let size_offset = self.abs();
        let size = self.i32();
        if size < 0 || size as usize > max_block_bytes {
            return Err(NettraceError::BlockSize {
                offset: size_offset,
                kind,
                size: i64::from(size),
                max: max_block_bytes,
            });
        }
        let padding = ((4 - (self.abs() & 3)) & 3) as usize;
        need!(self, padding + size as usize + 1);
        self.take(padding);
        let body_start = self.pos;
        self.take(size as usize);
        self.expect_tag(TAG_END_OBJECT, "EndObject (block)")?;
        Ok(Ok(Step::Complete {
            len: self.pos,
            frame: Frame::Block {
                kind,
                body_start,
                body_len: size as usize,
            },
        }))
    }
}

fn parse_trace_body(body: &[u8], offset: u64) -> Result<TraceHeader, NettraceError> {
    let bad = |reason| NettraceError::BadTraceHeader { offset, reason };
    let mut reader = ByteReader::new(body);
    // The body is exactly TRACE_BODY_LEN bytes, so these reads cannot fail;
    // map a failure anyway rather than panic.
    let mut read = || -> Result<TraceHeader, super::reader::ReadError> {
        let mut time = [0u16; 8];
        for field in &mut time {
            *field = reader.u16("SyncTimeUTC")?;
        }
        let [
            year,
            month,
            day_of_week,
            day,
            hour,
            minute,
            second,
            millisecond,
        ] = time;
        Ok(TraceHeader {
            sync_time_utc: TraceSyncTime {
                year,
                month,
                day_of_week,
                day,
                hour,
                minute,
                second,
                millisecond,
            },
            sync_time_qpc: reader.i64("SyncTimeQPC")?,
            qpc_frequency: reader.i64("QPCFrequency")?,
            pointer_size: reader.u32("PointerSize")?,
            process_id: reader.u32("ProcessId")?,
            number_of_processors: reader.u32("NumberOfProcessors")?,
            expected_cpu_sampling_rate: reader.u32("ExpectedCPUSamplingRate")?,
        })
    };
    let header = read().map_err(|_| bad("shorter than 48 bytes"))?;
    if header.pointer_size != 4 && header.pointer_size != 8 {
        return Err(bad("pointer size is neither 4 nor 8"));
    }
    if header.qpc_frequency <= 0 {
        return Err(bad("QPC frequency is not positive"));
    }
    Ok(header)
}

/// Append a block object (type header, size, padding to the absolute 4-byte
/// boundary, body, EndObject) at the end of `out`, whose length is the
/// absolute stream offset. Used to re-frame blocks (benchmarks, tests).
#[cfg(any(test, feature = "bench"))]
pub(crate) fn write_block_object(out: &mut Vec<u8>, kind: BlockKind, body: &[u8]) {
    let name = kind.type_name().as_bytes();
    out.extend([
        TAG_BEGIN_PRIVATE_OBJECT,
        TAG_BEGIN_PRIVATE_OBJECT,
        TAG_NULL_REFERENCE,
    ]);
    out.extend(BLOCK_READER_VERSION.to_le_bytes());
    out.extend(BLOCK_READER_VERSION.to_le_bytes());
    out.extend((name.len() as i32).to_le_bytes());
    out.extend(name);
    out.push(TAG_END_OBJECT);
    out.extend((body.len() as i32).to_le_bytes());
    let padding = (4 - (out.len() & 3)) & 3;
    out.extend(std::iter::repeat_n(0u8, padding));
    out.extend(body);
    out.push(TAG_END_OBJECT);
}

/// An object this reader understands: written at `reader_version` or later,
/// and not demanding a newer reader.
fn check_object_version(
    name: String,
    version: i32,
    min_reader_version: i32,
    offset: u64,
    reader_version: i32,
) -> Result<(), NettraceError> {
    if min_reader_version > reader_version || version < reader_version {
        return Err(NettraceError::UnsupportedObjectVersion {
            offset,
            name,
            version,
            min_reader_version,
        });
    }
    Ok(())
}
