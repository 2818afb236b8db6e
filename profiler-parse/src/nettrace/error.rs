//! What can go wrong in a nettrace stream. Hard errors end the stream (the
//! framing is lost); soft errors spoil one record or the rest of one block
//! and are counted in [`super::NettraceStats`] while parsing goes on.

use thiserror::Error;

use super::reader::ReadError;

/// The FastSerialization objects a NetTrace V4/V5 stream carries after its
/// `Trace` object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockKind {
    Event,
    Metadata,
    Stack,
    SequencePoint,
}

impl BlockKind {
    /// The FastSerialization type name the runtime writes for this block.
    pub fn type_name(self) -> &'static str {
        match self {
            Self::Event => "EventBlock",
            Self::Metadata => "MetadataBlock",
            Self::Stack => "StackBlock",
            Self::SequencePoint => "SPBlock",
        }
    }

    pub(crate) fn from_type_name(name: &[u8]) -> Option<Self> {
        [
            Self::Event,
            Self::Metadata,
            Self::Stack,
            Self::SequencePoint,
        ]
        .into_iter()
        .find(|kind| kind.type_name().as_bytes() == name)
    }
}

/// An error in a nettrace stream. Offsets are absolute stream offsets (the
/// first byte of the `Nettrace` magic is 0).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum NettraceError {
    #[error("nettrace stream: bad magic {found:02x?}, expected \"Nettrace\"")]
    BadMagic { found: [u8; 8] },
    #[error(
        "nettrace stream: format version {major} is not supported (only V4/V5 as the runtime writes them)"
    )]
    UnsupportedFormat { major: u32 },
    #[error("nettrace stream: bad FastSerialization signature at offset {offset}")]
    BadSerializationSignature { offset: u64 },
    #[error("nettrace stream: expected {expected} tag at offset {offset}, found 0x{found:02x}")]
    UnexpectedTag {
        offset: u64,
        expected: &'static str,
        found: u8,
    },
    #[error("nettrace stream: object type name of {len} bytes at offset {offset} (at most {max})")]
    BadTypeName { offset: u64, len: i32, max: usize },
    #[error("nettrace stream: unknown object type {name:?} at offset {offset}")]
    UnknownObject { offset: u64, name: String },
    #[error("nettrace stream: first object at offset {offset} is {name:?}, expected \"Trace\"")]
    MissingTraceObject { offset: u64, name: String },
    #[error(
        "nettrace stream: object {name:?} at offset {offset} has version {version}, needs a reader of version {min_reader_version}"
    )]
    UnsupportedObjectVersion {
        offset: u64,
        name: String,
        version: i32,
        min_reader_version: i32,
    },
    #[error("nettrace stream: trace header at offset {offset}: {reason}")]
    BadTraceHeader { offset: u64, reason: &'static str },
    #[error("nettrace {kind:?} block at offset {offset}: size {size} is outside 0..={max}")]
    BlockSize {
        offset: u64,
        kind: BlockKind,
        size: i64,
        max: usize,
    },
    #[error("nettrace stream: more than {max} metadata records")]
    TooManyMetadata { max: usize },
    #[error(
        "nettrace stream's metadata is over its {max_bytes}-byte bound (or the memory budget's share for event streams): record dropped"
    )]
    MetadataOverBudget { max_bytes: usize },
    #[error(
        "nettrace stream ended at offset {offset} inside an object ({pending_bytes} bytes of it received)"
    )]
    Truncated { offset: u64, pending_bytes: usize },
    #[error("nettrace stream ended at offset {offset} before the end-of-stream tag")]
    MissingEndOfStream { offset: u64 },
    // Soft errors: counted, parsing goes on.
    #[error("nettrace {kind:?} block at offset {offset}: {source}")]
    CorruptBlock {
        offset: u64,
        kind: BlockKind,
        #[source]
        source: ReadError,
    },
    #[error("nettrace {kind:?} block at offset {offset}: {reason}")]
    InvalidBlock {
        offset: u64,
        kind: BlockKind,
        reason: &'static str,
    },
    #[error("nettrace metadata record at offset {offset}: {source}")]
    CorruptMetadata {
        offset: u64,
        #[source]
        source: ReadError,
    },
}
