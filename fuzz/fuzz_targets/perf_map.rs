//! Perf map parser: never panics, and reading a file in arbitrary chunks
//! gives exactly what reading it whole gives.
#![no_main]

use clrbpf_parse::perf_map::{PerfMapLimits, PerfMapParser};
use libfuzzer_sys::fuzz_target;

#[path = "chunks.rs"]
mod chunks;

fn parse(limits: PerfMapLimits, chunks: &[&[u8]]) -> (PerfMapParser, Vec<(u64, u64, String)>) {
    let mut parser = PerfMapParser::new(limits);
    let mut entries = Vec::new();
    for chunk in chunks {
        parser.feed(chunk, |entry| {
            assert!(entry.size > 0);
            assert!(entry.start.checked_add(entry.size).is_some());
            assert!(!entry.name.is_empty());
            entries.push((entry.start, entry.size, entry.name.into_owned()));
        });
    }
    (parser, entries)
}

fuzz_target!(|input: &[u8]| {
    let (seed, chunks) = chunks::split(input);
    // Small bounds so the long-line and cap paths are reached.
    let limits = PerfMapLimits {
        max_line_len: 8 + usize::from(seed % 96),
        max_entries: u64::from(seed >> 10),
    };
    let whole: Vec<u8> = chunks.concat();
    let (one_shot, expected) = parse(limits, &[&whole]);
    let (chunked, entries) = parse(limits, &chunks);
    assert_eq!(entries, expected);
    assert_eq!(chunked.counts(), one_shot.counts());
    assert_eq!(chunked.offset(), whole.len() as u64);
    assert_eq!(chunked.pending_len(), one_shot.pending_len());
    assert!(chunked.pending_len() <= limits.max_line_len);
    let counts = chunked.counts();
    assert!(counts.entries <= limits.max_entries);
    assert_eq!(
        counts.lines,
        counts.entries
            + counts.malformed_lines
            + counts.long_lines
            + counts.entries_over_cap
            + counts.empty_ranges
    );
});
