//! A NetTrace V4 writer for tests: builds the streams the runtime would
//! write (header compression included) so the parser can be tested on
//! exact, small and deliberately broken inputs.

use super::{
    error::BlockKind,
    framing::{
        MAGIC, SERIALIZATION_SIGNATURE, TAG_BEGIN_PRIVATE_OBJECT, TAG_END_OBJECT,
        TAG_NULL_REFERENCE, write_block_object,
    },
};

pub(crate) fn utf16z(text: &str) -> Vec<u8> {
    text.encode_utf16()
        .chain([0])
        .flat_map(u16::to_le_bytes)
        .collect()
}

fn varuint(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// A stream under construction.
pub(crate) struct StreamWriter {
    pub(crate) out: Vec<u8>,
}

impl StreamWriter {
    /// Preamble and a Trace object as a 64-bit Linux runtime writes it.
    pub(crate) fn new() -> Self {
        Self::with_pointer_size(8)
    }

    pub(crate) fn with_pointer_size(pointer_size: u32) -> Self {
        let mut out = Vec::new();
        out.extend(MAGIC);
        out.extend((SERIALIZATION_SIGNATURE.len() as i32).to_le_bytes());
        out.extend(SERIALIZATION_SIGNATURE);
        out.extend([
            TAG_BEGIN_PRIVATE_OBJECT,
            TAG_BEGIN_PRIVATE_OBJECT,
            TAG_NULL_REFERENCE,
        ]);
        out.extend(4i32.to_le_bytes());
        out.extend(4i32.to_le_bytes());
        out.extend(5i32.to_le_bytes());
        out.extend(b"Trace");
        out.push(TAG_END_OBJECT);
        for field in [2026u16, 11, 2, 17, 10, 30, 15, 250] {
            out.extend(field.to_le_bytes());
        }
        out.extend(1_000_000i64.to_le_bytes()); // SyncTimeQPC
        out.extend(1_000_000_000i64.to_le_bytes()); // QPCFrequency
        out.extend(pointer_size.to_le_bytes());
        out.extend(4242u32.to_le_bytes()); // ProcessId
        out.extend(2u32.to_le_bytes()); // NumberOfProcessors
        out.extend(1_000_000u32.to_le_bytes()); // ExpectedCPUSamplingRate
        out.push(TAG_END_OBJECT);
        Self { out }
    }

    pub(crate) fn block(&mut self, kind: BlockKind, body: &[u8]) -> &mut Self {
        write_block_object(&mut self.out, kind, body);
        self
    }

    pub(crate) fn end(&mut self) -> Vec<u8> {
        self.out.push(TAG_NULL_REFERENCE);
        std::mem::take(&mut self.out)
    }
}

/// One event blob's header fields (the writer compresses them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct BlobSpec {
    pub(crate) metadata_id: u32,
    pub(crate) sequence: u32,
    pub(crate) capture_thread_id: u64,
    pub(crate) processor: u32,
    pub(crate) thread_id: u64,
    pub(crate) stack_id: u32,
    pub(crate) timestamp: i64,
    pub(crate) activity_id: [u8; 16],
    pub(crate) is_sorted: bool,
}

/// The body of an EventBlock or MetadataBlock with header compression.
pub(crate) struct BlobBlockWriter {
    body: Vec<u8>,
    previous: BlobSpec,
    previous_payload_size: u32,
}

impl BlobBlockWriter {
    pub(crate) fn new() -> Self {
        let mut body = Vec::new();
        body.extend(20u16.to_le_bytes()); // HeaderSize
        body.extend(1u16.to_le_bytes()); // Flags: compressed
        body.extend(0i64.to_le_bytes());
        body.extend(i64::MAX.to_le_bytes());
        Self {
            body,
            previous: BlobSpec::default(),
            previous_payload_size: 0,
        }
    }

    pub(crate) fn blob(&mut self, spec: BlobSpec, payload: &[u8]) -> &mut Self {
        let previous = self.previous;
        let mut flags = 0u8;
        let mut fields = Vec::new();
        if spec.metadata_id != previous.metadata_id {
            flags |= 0x01;
            varuint(&mut fields, u64::from(spec.metadata_id));
        }
        let expected = if spec.metadata_id != 0 {
            previous.sequence.wrapping_add(1)
        } else {
            previous.sequence
        };
        if spec.sequence != expected
            || spec.capture_thread_id != previous.capture_thread_id
            || spec.processor != previous.processor
        {
            flags |= 0x02;
            varuint(&mut fields, u64::from(spec.sequence.wrapping_sub(expected)));
            varuint(&mut fields, spec.capture_thread_id);
            varuint(&mut fields, u64::from(spec.processor));
        }
        if spec.thread_id != previous.thread_id {
            flags |= 0x04;
            varuint(&mut fields, spec.thread_id);
        }
        if spec.stack_id != previous.stack_id {
            flags |= 0x08;
            varuint(&mut fields, u64::from(spec.stack_id));
        }
        varuint(
            &mut fields,
            spec.timestamp.wrapping_sub(previous.timestamp) as u64,
        );
        if spec.activity_id != previous.activity_id {
            flags |= 0x10;
            fields.extend(spec.activity_id);
        }
        if spec.is_sorted {
            flags |= 0x40;
        }
        if payload.len() as u32 != self.previous_payload_size {
            flags |= 0x80;
            varuint(&mut fields, payload.len() as u64);
        }
        self.body.push(flags);
        self.body.extend(fields);
        self.body.extend(payload);
        self.previous = spec;
        self.previous_payload_size = payload.len() as u32;
        self
    }

    pub(crate) fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.body)
    }
}

/// The payload of a metadata record as the runtime writes it for its own
/// events: empty name, no fields.
pub(crate) fn metadata_payload(
    metadata_id: u32,
    provider: &str,
    event_id: u32,
    name: &str,
    version: u32,
) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(metadata_id.to_le_bytes());
    out.extend(utf16z(provider));
    out.extend(event_id.to_le_bytes());
    out.extend(utf16z(name));
    out.extend(0x4000u64.to_le_bytes()); // Keywords
    out.extend(version.to_le_bytes());
    out.extend(4u32.to_le_bytes()); // Level
    out.extend(0u32.to_le_bytes()); // FieldCount
    out
}

/// A MetadataBlock body defining `(id, provider, event id, version)` records.
pub(crate) fn metadata_block(records: &[(u32, &str, u32, u32)]) -> Vec<u8> {
    let mut block = BlobBlockWriter::new();
    for &(id, provider, event_id, version) in records {
        block.blob(
            BlobSpec::default(),
            &metadata_payload(id, provider, event_id, "", version),
        );
    }
    block.finish()
}

pub(crate) fn stack_block(first_id: u32, stacks: &[&[u64]]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(first_id.to_le_bytes());
    out.extend((stacks.len() as u32).to_le_bytes());
    for stack in stacks {
        out.extend(((stack.len() * 8) as u32).to_le_bytes());
        for ip in *stack {
            out.extend(ip.to_le_bytes());
        }
    }
    out
}

pub(crate) fn sequence_point_block(timestamp: i64, threads: &[(u64, u32)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(timestamp.to_le_bytes());
    out.extend((threads.len() as u32).to_le_bytes());
    for &(thread, sequence) in threads {
        out.extend(thread.to_le_bytes());
        out.extend(sequence.to_le_bytes());
    }
    out
}
