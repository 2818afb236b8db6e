//! Jitdump parser: never panics, never buffers more than a record's fixed
//! fields and bounded name, and reading a file in arbitrary chunks gives
//! exactly what reading it whole gives.
#![no_main]

use clrbpf_parse::jitdump::{JitDumpLimits, JitDumpParser};
use libfuzzer_sys::fuzz_target;

#[path = "chunks.rs"]
mod chunks;

/// A valid file header, prepended when the seed says so: random bytes
/// almost never start with the magic, and the records are what matter.
const HEADER: [u8; 40] = [
    0x44, 0x54, 0x69, 0x4a, 1, 0, 0, 0, 40, 0, 0, 0, 62, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];

type Load = (u64, u64, u64, u64, String);

fn parse(limits: JitDumpLimits, chunks: &[&[u8]]) -> (JitDumpParser, Vec<Load>) {
    let mut parser = JitDumpParser::new(limits);
    let mut loads = Vec::new();
    for chunk in chunks {
        parser.feed(chunk, |load| {
            assert!(load.code_size > 0);
            assert!(load.code_addr.checked_add(load.code_size).is_some());
            assert!(load.name.len() <= 3 * limits.max_name_len);
            loads.push((
                load.timestamp_ns,
                load.code_addr,
                load.code_size,
                load.code_index,
                load.name.into_owned(),
            ));
        });
    }
    (parser, loads)
}

fuzz_target!(|input: &[u8]| {
    let (seed, chunks) = chunks::split(input);
    let limits = JitDumpLimits {
        max_record_size: 16 + u32::from(seed % 512),
        max_name_len: usize::from((seed >> 9) % 48),
        max_code_loads: u64::from(seed >> 14) * 4,
    };
    let mut chunks = chunks;
    if seed & 0x100 != 0 {
        chunks.insert(0, &HEADER);
    }
    let whole: Vec<u8> = chunks.concat();
    let (one_shot, expected) = parse(limits, &[&whole]);
    let (chunked, loads) = parse(limits, &chunks);
    assert_eq!(loads, expected);
    assert_eq!(chunked.counts(), one_shot.counts());
    assert_eq!(chunked.error(), one_shot.error());
    assert_eq!(chunked.header(), one_shot.header());
    assert_eq!(chunked.offset(), one_shot.offset());
    assert_eq!(chunked.pending_len(), one_shot.pending_len());
    assert!(chunked.offset() <= whole.len() as u64);
    if chunked.error().is_none() {
        assert_eq!(chunked.offset(), whole.len() as u64);
    }
    // Fixed fields (56 bytes) plus the bounded name and its NUL.
    assert!(chunked.pending_len() <= 56 + limits.max_name_len + 1);
    assert!(chunked.counts().code_loads <= limits.max_code_loads);
});
