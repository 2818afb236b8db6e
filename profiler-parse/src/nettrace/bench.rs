//! Throughput measurement of the event intake path (parse, then decode),
//! called by `cargo xtask bench` through the `bench` example (feature
//! `bench`, not in the shipped binary); no timing is asserted anywhere.

use std::time::{Duration, Instant};

use super::{
    NettraceError, NettraceParser, ParsedItem,
    error::BlockKind,
    framing::{Frame, Phase, Step, TAG_NULL_REFERENCE, next_frame, write_block_object},
};
use crate::events::ClrEventDecoder;

/// Socket-sized chunks, as the IPC client reads them.
const CHUNK_BYTES: usize = 64 * 1024;

/// Parse `bytes` in 64 KiB chunks; returns the number of events delivered
/// and the time taken. Stops at the first hard error.
pub fn bench_nettrace_parse(bytes: &[u8]) -> (u64, Duration) {
    let start = Instant::now();
    let mut parser = NettraceParser::new();
    let mut events = 0u64;
    for chunk in bytes.chunks(CHUNK_BYTES) {
        let fed = parser.feed(chunk, &mut |item| {
            if let ParsedItem::Event(record) = item {
                events += 1;
                std::hint::black_box(record.payload);
            }
        });
        if fed.is_err() {
            break;
        }
    }
    (events, start.elapsed())
}

/// Like [`bench_nettrace_parse`], and decode every event into a
/// [`crate::events::ClrEvent`] as a session would.
pub fn bench_clr_event_intake(bytes: &[u8]) -> (u64, Duration) {
    let start = Instant::now();
    let mut parser = NettraceParser::new();
    let mut decoder = ClrEventDecoder::new();
    let mut events = 0u64;
    for chunk in bytes.chunks(CHUNK_BYTES) {
        let fed = parser.feed(chunk, &mut |item| {
            if let ParsedItem::Event(record) = item {
                events += 1;
                std::hint::black_box(decoder.decode(&record));
            }
        });
        if fed.is_err() {
            break;
        }
    }
    (events, start.elapsed())
}

/// A stream holding the blocks of `stream` `copies` times over (same
/// preamble and trace header, blocks re-framed so their padding stays
/// right), to benchmark on a few MB made from a small real capture.
pub fn replicate_nettrace(stream: &[u8], copies: usize) -> Result<Vec<u8>, NettraceError> {
    let mut phase = Phase::Preamble;
    let mut offset = 0usize;
    let mut head_len = 0usize;
    let mut blocks: Vec<(BlockKind, &[u8])> = Vec::new();
    while phase != Phase::Ended {
        let rest = stream.get(offset..).unwrap_or_default();
        let (len, frame) = match next_frame(rest, offset as u64, phase, usize::MAX >> 1)? {
            Step::Complete { len, frame } => (len, frame),
            Step::NeedBytes(_) => {
                return Err(NettraceError::Truncated {
                    offset: offset as u64,
                    pending_bytes: rest.len(),
                });
            }
        };
        match frame {
            Frame::Preamble => phase = Phase::TraceObject,
            Frame::Trace(_) => {
                phase = Phase::Objects;
                head_len = offset + len;
            }
            Frame::Block {
                kind,
                body_start,
                body_len,
            } => blocks.push((kind, &rest[body_start..body_start + body_len])),
            Frame::EndOfStream => phase = Phase::Ended,
        }
        offset += len;
    }
    let mut out = stream[..head_len].to_vec();
    for _ in 0..copies {
        for &(kind, body) in &blocks {
            write_block_object(&mut out, kind, body);
        }
    }
    out.push(TAG_NULL_REFERENCE);
    Ok(out)
}
