//! Parser tests: exact decoding of synthetic streams (header compression,
//! stacks, sequence points), every chunking of a stream, hostile and
//! truncated input, and two real captures (`testdata/`, see its README).

use std::io::Read as _;

use super::{
    bench::{bench_clr_event_intake, bench_nettrace_parse, replicate_nettrace},
    writer::{
        BlobBlockWriter, BlobSpec, StreamWriter, metadata_block, sequence_point_block, stack_block,
    },
    *,
};
use crate::events::{
    ClrEvent, ClrEventDecoder, ClrEventKind, MethodEventKind, RUNDOWN_PROVIDER, RUNTIME_PROVIDER,
    RundownMarker, assembly_simple_name, method_display_name_in_assembly,
};

/// What a callback saw, owned, for comparisons.
#[derive(Clone, Debug, PartialEq)]
enum Seen {
    Trace(TraceHeader),
    Metadata(EventMetadata),
    Event(OwnedEventRecord),
    Stacks(StackBlockInfo),
    SequencePoint(SequencePoint),
    End,
}

fn record(item: ParsedItem<'_>) -> Seen {
    match item {
        ParsedItem::Trace(header) => Seen::Trace(*header),
        ParsedItem::Metadata(meta) => Seen::Metadata(meta.clone()),
        ParsedItem::Event(event) => Seen::Event(event.to_owned_record()),
        ParsedItem::Stacks(info) => Seen::Stacks(info),
        ParsedItem::SequencePoint(point) => Seen::SequencePoint(point),
        ParsedItem::EndOfStream => Seen::End,
    }
}

/// Feed `bytes` in the given chunk sizes (cycled); return the items, the
/// feed result and the parser.
fn parse_chunked(
    bytes: &[u8],
    chunk_sizes: &[usize],
) -> (Vec<Seen>, Result<(), NettraceError>, NettraceParser) {
    let mut parser = NettraceParser::new();
    let mut seen = Vec::new();
    let mut rest = bytes;
    let mut sizes = chunk_sizes.iter().cycle();
    let mut result = Ok(());
    while !rest.is_empty() {
        let size = (*sizes.next().expect("cycle")).clamp(1, rest.len());
        let (chunk, tail) = rest.split_at(size);
        rest = tail;
        result = parser.feed(chunk, &mut |item| seen.push(record(item)));
        if result.is_err() {
            break;
        }
    }
    (seen, result, parser)
}

fn parse_all(bytes: &[u8]) -> (Vec<Seen>, Result<(), NettraceError>, NettraceParser) {
    parse_chunked(bytes, &[bytes.len().max(1)])
}

fn events(seen: &[Seen]) -> Vec<&OwnedEventRecord> {
    seen.iter()
        .filter_map(|item| match item {
            Seen::Event(event) => Some(event),
            _ => None,
        })
        .collect()
}

const THREAD_A: u64 = 0x1234;
const THREAD_B: u64 = 0x9_8765_4321;

/// A stream with two metadata records, two stacks, three events exercising
/// every header-compression field, a sequence point and an event after it.
fn sample_stream() -> Vec<u8> {
    let mut stream = StreamWriter::new();
    stream.block(
        BlockKind::Metadata,
        &metadata_block(&[(1, RUNTIME_PROVIDER, 81, 2), (2, RUNDOWN_PROVIDER, 144, 1)]),
    );
    stream.block(
        BlockKind::Stack,
        &stack_block(1, &[&[0x7f00_0000_1000, 0x7f00_0000_2000], &[]]),
    );
    let mut block = BlobBlockWriter::new();
    let first = BlobSpec {
        metadata_id: 1,
        sequence: 1,
        capture_thread_id: THREAD_A,
        processor: 1,
        thread_id: THREAD_A,
        stack_id: 1,
        timestamp: 5_000_000_000,
        activity_id: [0; 16],
        is_sorted: true,
    };
    block.blob(first, &[1, 2, 3]);
    // Same header except the sequence number (delta 0) and timestamp.
    block.blob(
        BlobSpec {
            sequence: 2,
            timestamp: 5_000_000_100,
            is_sorted: false,
            ..first
        },
        &[4, 5, 6],
    );
    // Every field changes.
    block.blob(
        BlobSpec {
            metadata_id: 2,
            sequence: 7,
            capture_thread_id: THREAD_B,
            processor: 0,
            thread_id: THREAD_A,
            stack_id: 2,
            timestamp: 5_000_000_050,
            activity_id: [9; 16],
            is_sorted: false,
        },
        &[],
    );
    stream.block(BlockKind::Event, &block.finish());
    stream.block(
        BlockKind::SequencePoint,
        &sequence_point_block(5_000_001_000, &[(THREAD_A, 2), (THREAD_B, 7)]),
    );
    let mut block = BlobBlockWriter::new();
    block.blob(
        BlobSpec {
            metadata_id: 1,
            sequence: 3,
            capture_thread_id: THREAD_A,
            thread_id: THREAD_A,
            stack_id: 1, // not in the cache any more: the SP cleared it
            timestamp: 5_000_002_000,
            ..BlobSpec::default()
        },
        &[7; 27],
    );
    stream.block(BlockKind::Event, &block.finish());
    stream.end()
}

#[test]
fn sample_stream_decodes_exactly() {
    let bytes = sample_stream();
    let (seen, result, mut parser) = parse_all(&bytes);
    result.unwrap();
    parser.finish().unwrap();
    assert!(parser.is_finished());

    let Seen::Trace(header) = &seen[0] else {
        panic!("first item is {:?}", seen[0]);
    };
    assert_eq!(header.pointer_size, 8);
    assert_eq!(header.process_id, 4242);
    assert_eq!(header.qpc_frequency, 1_000_000_000);
    assert_eq!(parser.trace_header(), Some(header));

    let Seen::Metadata(meta) = &seen[1] else {
        panic!("second item is {:?}", seen[1]);
    };
    assert_eq!(
        (
            meta.metadata_id,
            &*meta.provider,
            meta.event_id,
            meta.version,
            &*meta.event_name
        ),
        (1, RUNTIME_PROVIDER, 81, 2, "")
    );
    assert_eq!(parser.metadata(2).map(|meta| meta.event_id), Some(144));
    assert_eq!(
        seen[3],
        Seen::Stacks(StackBlockInfo {
            first_id: 1,
            count: 2
        })
    );

    let events = events(&seen);
    assert_eq!(events.len(), 4);
    let e = events[0];
    assert_eq!(
        (
            e.metadata_id,
            e.event_id,
            e.version,
            e.sequence,
            e.thread_id,
            e.capture_thread_id,
            e.processor
        ),
        (1, 81, 2, 1, THREAD_A, THREAD_A, 1)
    );
    assert_eq!((e.timestamp, e.is_sorted), (5_000_000_000, true));
    assert_eq!(
        e.stack.as_deref(),
        Some(&[0x7f00_0000_1000, 0x7f00_0000_2000][..])
    );
    assert_eq!(e.payload, [1, 2, 3]);

    let e = events[1];
    assert_eq!(
        (e.sequence, e.timestamp, e.is_sorted),
        (2, 5_000_000_100, false)
    );
    assert_eq!(e.payload, [4, 5, 6]);
    assert_eq!(e.stack.as_deref().map(<[u64]>::len), Some(2));

    let e = events[2];
    assert_eq!(
        (
            &*e.provider,
            e.event_id,
            e.version,
            e.sequence,
            e.capture_thread_id,
            e.processor
        ),
        (RUNDOWN_PROVIDER, 144, 1, 7, THREAD_B, 0)
    );
    assert_eq!((e.timestamp, e.activity_id), (5_000_000_050, [9; 16]));
    assert_eq!(
        e.stack.as_deref(),
        Some(&[][..]),
        "an empty stack is still a stack"
    );
    assert!(e.payload.is_empty());

    let e = events[3];
    assert_eq!(
        (e.sequence, e.stack.as_deref(), e.payload.len()),
        (3, None, 27)
    );

    assert!(seen.contains(&Seen::SequencePoint(SequencePoint {
        timestamp: 5_000_001_000,
        thread_count: 2,
    })));
    assert_eq!(seen.last(), Some(&Seen::End));
    let stats = *parser.stats();
    assert_eq!(stats.bytes, bytes.len() as u64);
    assert_eq!(
        (
            stats.events,
            stats.metadata,
            stats.stacks,
            stats.event_blocks,
            stats.sequence_points
        ),
        (4, 2, 2, 2, 1)
    );
    // THREAD_B started at 7: 6 events were lost before it; the event after
    // the sequence point referred to a stack id the SP invalidated.
    assert_eq!((stats.lost_events, stats.missing_stacks), (6, 1));
    assert_eq!((stats.corrupt_blocks, stats.corrupt_metadata), (0, 0));
}

#[test]
fn every_chunking_gives_the_same_items() {
    let bytes = sample_stream();
    let (expected, result, parser) = parse_all(&bytes);
    result.unwrap();
    let expected_stats = *parser.stats();
    for sizes in [&[1][..], &[2], &[3], &[7, 1, 13], &[64], &[100, 1, 1, 250]] {
        let (seen, result, parser) = parse_chunked(&bytes, sizes);
        result.unwrap();
        assert_eq!(seen, expected, "chunk sizes {sizes:?}");
        assert_eq!(*parser.stats(), expected_stats, "chunk sizes {sizes:?}");
        assert_eq!(parser.buffered_bytes(), 0);
    }
    // Every split of the stream into two chunks.
    for split in 0..bytes.len() {
        let mut parser = NettraceParser::new();
        let mut seen = Vec::new();
        parser
            .feed(&bytes[..split], &mut |item| seen.push(record(item)))
            .unwrap();
        parser
            .feed(&bytes[split..], &mut |item| seen.push(record(item)))
            .unwrap();
        assert_eq!(seen, expected, "split at {split}");
    }
}

#[test]
fn every_prefix_keeps_what_was_complete_and_reports_truncation() {
    let bytes = sample_stream();
    let (full, _, _) = parse_all(&bytes);
    for len in 0..bytes.len() {
        let (seen, result, mut parser) = parse_all(&bytes[..len]);
        result.unwrap();
        assert_eq!(seen[..], full[..seen.len()], "prefix of {len} bytes");
        let error = parser.finish().unwrap_err();
        assert!(
            matches!(
                error,
                NettraceError::Truncated { .. } | NettraceError::MissingEndOfStream { .. }
            ),
            "prefix of {len} bytes: {error}"
        );
        // A stopped parser stays stopped.
        assert_eq!(
            parser.feed(&bytes[len..], &mut |_| panic!("item after error")),
            Err(error)
        );
    }
}

#[test]
fn buffering_is_bounded_by_one_object() {
    let mut stream = StreamWriter::new();
    stream.block(
        BlockKind::Metadata,
        &metadata_block(&[(1, RUNTIME_PROVIDER, 80, 1)]),
    );
    let mut block = BlobBlockWriter::new();
    for sequence in 1..=2000 {
        block.blob(
            BlobSpec {
                metadata_id: 1,
                sequence,
                capture_thread_id: 1,
                thread_id: 1,
                timestamp: i64::from(sequence),
                ..BlobSpec::default()
            },
            &[0xab; 40],
        );
    }
    let body = block.finish();
    stream.block(BlockKind::Event, &body);
    let bytes = stream.end();
    let mut parser = NettraceParser::new();
    let mut max_buffered = 0;
    let mut count = 0;
    for byte in bytes.chunks(1) {
        parser
            .feed(byte, &mut |item| {
                count += u32::from(matches!(item, ParsedItem::Event(_)))
            })
            .unwrap();
        max_buffered = max_buffered.max(parser.buffered_bytes());
    }
    assert_eq!(count, 2000);
    assert!(
        max_buffered >= body.len(),
        "the block had to be buffered whole"
    );
    assert!(
        max_buffered <= body.len() + 64,
        "buffered {max_buffered} for a {} byte block",
        body.len()
    );
}

#[test]
fn block_larger_than_the_limit_is_a_hard_error_before_buffering_it() {
    let mut stream = StreamWriter::new();
    stream.block(BlockKind::Stack, &stack_block(1, &[&[1; 100]]));
    let bytes = stream.end();
    let limits = NettraceLimits {
        max_block_bytes: 512,
        ..NettraceLimits::default()
    };
    let mut parser = NettraceParser::with_limits(limits);
    let mut items = 0;
    // Feed only up to the block's size field: the error comes before the
    // body is buffered.
    let header_end = bytes.len() - (8 + 4 + 800) - 1;
    let error = parser
        .feed(&bytes[..header_end], &mut |_| items += 1)
        .unwrap_err();
    assert!(
        matches!(
            error,
            NettraceError::BlockSize {
                kind: BlockKind::Stack,
                size: 812,
                max: 512,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(items, 1, "the trace header was delivered");
    assert_eq!(parser.error(), Some(&error));
    assert_eq!(parser.buffered_bytes(), 0);
}

#[test]
fn hard_errors_name_what_broke() {
    let good = sample_stream();
    let mut bad_magic = good.clone();
    bad_magic[0] = b'N' + 1;
    let mut v6 = b"Nettrace".to_vec();
    v6.extend([0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0]);
    let mut bad_signature = good.clone();
    bad_signature[12] = b'?';
    let mut bad_pointer_size = good;
    // Preamble 32 bytes, Trace object tag and type 21; PointerSize is at
    // +32 of the body.
    bad_pointer_size[32 + 21 + 32] = 3;
    let mut unknown_object = StreamWriter::new().out;
    unknown_object.extend([5, 5, 1, 2, 0, 0, 0, 2, 0, 0, 0, 7, 0, 0, 0]);
    unknown_object.extend(b"Mystery");
    unknown_object.extend([6, 0, 0, 0, 0, 6]);
    let mut bad_tag = StreamWriter::new().out;
    bad_tag.push(0x42);
    let mut new_block_version = StreamWriter::new().out;
    new_block_version.extend([5, 5, 1, 3, 0, 0, 0, 3, 0, 0, 0, 7, 0, 0, 0]);
    new_block_version.extend(b"SPBlock");
    new_block_version.push(6);

    type Check = fn(&NettraceError) -> bool;
    let cases: [(&str, Vec<u8>, Check); 7] = [
        ("magic", bad_magic, |e| {
            matches!(e, NettraceError::BadMagic { .. })
        }),
        ("v6", v6, |e| {
            matches!(e, NettraceError::UnsupportedFormat { major: 6 })
        }),
        ("signature", bad_signature, |e| {
            matches!(e, NettraceError::BadSerializationSignature { offset: 8 })
        }),
        ("pointer size", bad_pointer_size, |e| {
            matches!(e, NettraceError::BadTraceHeader { offset: 53, .. })
        }),
        (
            "unknown object",
            unknown_object,
            |e| matches!(e, NettraceError::UnknownObject { name, .. } if name == "Mystery"),
        ),
        ("tag", bad_tag, |e| {
            matches!(
                e,
                NettraceError::UnexpectedTag {
                    found: 0x42,
                    offset: 102,
                    ..
                }
            )
        }),
        ("version", new_block_version, |e| {
            matches!(
                e,
                NettraceError::UnsupportedObjectVersion {
                    version: 3,
                    min_reader_version: 3,
                    ..
                }
            )
        }),
    ];
    for (name, bytes, expected) in cases {
        let (_, result, parser) = parse_all(&bytes);
        let error = result.expect_err(name);
        assert!(expected(&error), "{name}: {error:?}");
        assert!(!error.to_string().is_empty());
        assert_eq!(parser.error(), Some(&error), "{name}");
    }
}

#[test]
fn malformed_records_spoil_only_their_block() {
    let mut stream = StreamWriter::new();
    // One good and one broken metadata record (unterminated provider name).
    let mut block = BlobBlockWriter::new();
    block.blob(
        BlobSpec::default(),
        &writer::metadata_payload(1, RUNTIME_PROVIDER, 80, "", 1),
    );
    block.blob(BlobSpec::default(), &[2, 0, 0, 0, b'x', 0, b'y']);
    block.blob(
        BlobSpec::default(),
        &writer::metadata_payload(0, "P", 1, "", 0),
    );
    stream.block(BlockKind::Metadata, &block.finish());
    // An event block whose second event claims more payload than the block has.
    let event = BlobSpec {
        metadata_id: 1,
        sequence: 1,
        capture_thread_id: 1,
        thread_id: 1,
        timestamp: 10,
        ..BlobSpec::default()
    };
    let mut block = BlobBlockWriter::new();
    block.blob(event, &[1; 4]);
    let mut body = block.finish();
    body.extend([0x81, 0x02, 0x05, 0xff, 0x7f]); // metadata 2, ts +5, 16383 bytes
    stream.block(BlockKind::Event, &body);
    // An event referring to metadata that was never defined, then a good one.
    let mut block = BlobBlockWriter::new();
    block.blob(
        BlobSpec {
            metadata_id: 9,
            ..event
        },
        &[],
    );
    block.blob(
        BlobSpec {
            sequence: 3,
            ..event
        },
        &[5; 4],
    );
    stream.block(BlockKind::Event, &block.finish());
    // A stack block with a size that is not a whole number of pointers.
    stream.block(
        BlockKind::Stack,
        &[1, 0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0, 1, 2, 3],
    );
    let bytes = stream.end();

    let (seen, result, parser) = parse_all(&bytes);
    result.unwrap();
    assert_eq!(seen.last(), Some(&Seen::End));
    let payloads: Vec<_> = events(&seen).iter().map(|e| e.payload.clone()).collect();
    assert_eq!(payloads, [vec![1; 4], vec![5; 4]]);
    let stats = parser.stats();
    assert_eq!(stats.corrupt_metadata, 2);
    assert_eq!(stats.corrupt_blocks, 2);
    assert_eq!(stats.events_without_metadata, 1);
    assert!(
        matches!(
            parser.last_soft_error(),
            Some(NettraceError::InvalidBlock {
                kind: BlockKind::Stack,
                ..
            })
        ),
        "{:?}",
        parser.last_soft_error()
    );
}

#[test]
fn sequence_gaps_count_lost_events() {
    let mut stream = StreamWriter::new();
    stream.block(
        BlockKind::Metadata,
        &metadata_block(&[(1, RUNTIME_PROVIDER, 80, 1)]),
    );
    let mut block = BlobBlockWriter::new();
    for sequence in [1, 2, 5, 6, 1, 2] {
        // 5 after 2: two lost; 1 after 6: a new thread with a reused id.
        block.blob(
            BlobSpec {
                metadata_id: 1,
                sequence,
                capture_thread_id: 7,
                thread_id: 7,
                ..BlobSpec::default()
            },
            &[],
        );
    }
    stream.block(BlockKind::Event, &block.finish());
    // The SP says thread 7 tried to write up to 10 (8 lost), thread 8
    // (never seen) 3 (3 lost), thread 7 again at the same number: nothing.
    stream.block(
        BlockKind::SequencePoint,
        &sequence_point_block(100, &[(7, 10), (8, 3)]),
    );
    stream.block(
        BlockKind::SequencePoint,
        &sequence_point_block(200, &[(7, 10)]),
    );
    let (_, result, parser) = parse_all(&stream.end());
    result.unwrap();
    assert_eq!(parser.stats().lost_events, 2 + 8 + 3);
}

#[test]
fn uncompressed_blobs_and_32_bit_stacks_decode() {
    let mut stream = StreamWriter::with_pointer_size(4);
    stream.block(
        BlockKind::Metadata,
        &metadata_block(&[(3, RUNTIME_PROVIDER, 91, 1)]),
    );
    let mut stack = Vec::new();
    stack.extend(5u32.to_le_bytes());
    stack.extend(1u32.to_le_bytes());
    stack.extend(8u32.to_le_bytes());
    stack.extend(0x1000u32.to_le_bytes());
    stack.extend(0x2000u32.to_le_bytes());
    stream.block(BlockKind::Stack, &stack);
    let mut body = Vec::new();
    body.extend(20u16.to_le_bytes());
    body.extend(0u16.to_le_bytes()); // not compressed
    body.extend([0; 16]);
    for (sequence, payload) in [(1u32, &[1u8, 2, 3][..]), (2, &[4, 5, 6, 7, 8][..])] {
        let size = 76 + payload.len() as u32;
        body.extend(size.to_le_bytes());
        body.extend((3u32 | 0x8000_0000).to_le_bytes());
        body.extend(sequence.to_le_bytes());
        body.extend(11u64.to_le_bytes()); // thread
        body.extend(12u64.to_le_bytes()); // capture thread
        body.extend(1u32.to_le_bytes()); // processor
        body.extend(5u32.to_le_bytes()); // stack
        body.extend((1000 * i64::from(sequence)).to_le_bytes());
        body.extend([0xaa; 16]);
        body.extend([0xbb; 16]);
        body.extend((payload.len() as u32).to_le_bytes());
        body.extend(payload);
        body.resize(body.len().next_multiple_of(4), 0);
    }
    stream.block(BlockKind::Event, &body);
    let (seen, result, parser) = parse_all(&stream.end());
    result.unwrap();
    let events = events(&seen);
    assert_eq!(events.len(), 2, "{:?}", parser.last_soft_error());
    assert_eq!(
        (
            events[0].thread_id,
            events[0].capture_thread_id,
            events[0].sequence,
            events[0].timestamp
        ),
        (11, 12, 1, 1000)
    );
    assert!(events[0].is_sorted);
    assert_eq!(events[0].related_activity_id, [0xbb; 16]);
    assert_eq!(events[0].stack.as_deref(), Some(&[0x1000, 0x2000][..]));
    assert_eq!(events[1].payload, [4, 5, 6, 7, 8]);
    assert_eq!(parser.stats().lost_events, 0);
}

#[test]
fn bytes_after_the_end_are_counted_and_ignored() {
    let mut bytes = sample_stream();
    bytes.extend([0xde, 0xad]);
    let (_, result, mut parser) = parse_chunked(&bytes, &[5]);
    result.unwrap();
    parser.finish().unwrap();
    assert_eq!(parser.stats().trailing_bytes, 2);
}

#[test]
fn single_byte_corruptions_never_panic() {
    let bytes = sample_stream();
    for index in 0..bytes.len() {
        for value in [0x00, 0x01, 0x05, 0x06, 0x7f, 0x80, 0xff] {
            let mut corrupt = bytes.clone();
            corrupt[index] = value;
            for sizes in [&[corrupt.len()][..], &[3]] {
                let (_, _, mut parser) = parse_chunked(&corrupt, sizes);
                let _ = parser.finish();
            }
        }
    }
}

#[test]
fn trace_header_converts_timestamps() {
    let header = TraceHeader {
        sync_time_utc: TraceSyncTime {
            year: 2026,
            month: 11,
            day_of_week: 2,
            day: 17,
            hour: 10,
            minute: 30,
            second: 15,
            millisecond: 250,
        },
        sync_time_qpc: 1_000_000,
        qpc_frequency: 1_000_000_000,
        pointer_size: 8,
        process_id: 1,
        number_of_processors: 1,
        expected_cpu_sampling_rate: 0,
    };
    // 2026-11-17T10:30:15.250Z
    let sync_unix_ns = 1_794_911_415_250_000_000;
    assert_eq!(header.sync_time_utc.unix_ns(), Some(sync_unix_ns));
    assert_eq!(header.ticks_to_ns(5_000), Some(5_000));
    assert_eq!(header.ticks_to_ns(-1), None);
    assert_eq!(header.ticks_to_unix_ns(1_000_500), Some(sync_unix_ns + 500));
    let slow = TraceHeader {
        qpc_frequency: 10_000_000,
        ..header
    };
    assert_eq!(slow.ticks_to_ns(3), Some(300));
    let bad_date = TraceSyncTime {
        month: 13,
        ..header.sync_time_utc
    };
    assert_eq!(bad_date.unix_ns(), None);
}

// Real captures: a C# workload (testdata/App.cs) with three threads
// contending on one lock and one thread throwing three exception types,
// traced with CollectTracing2 (Contention|Exception|Jit|Loader, verbose,
// rundown on) and stopped after two seconds.

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/src/nettrace/testdata/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let file = std::fs::File::open(&path).unwrap_or_else(|error| panic!("{path}: {error}"));
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut bytes)
        .unwrap_or_else(|error| panic!("{path}: {error}"));
    bytes
}

/// Everything a fixture yields, decoded.
struct Decoded {
    events: Vec<(OwnedEventRecord, Option<ClrEvent>)>,
    parser: NettraceParser,
    decoder: ClrEventDecoder,
}

fn decode_fixture(name: &str, chunk: usize) -> Decoded {
    let bytes = fixture(name);
    let mut parser = NettraceParser::new();
    let mut decoder = ClrEventDecoder::new();
    let mut events = Vec::new();
    for piece in bytes.chunks(chunk) {
        parser
            .feed(piece, &mut |item| {
                if let ParsedItem::Event(event) = item {
                    events.push((event.to_owned_record(), decoder.decode(&event)));
                }
            })
            .unwrap();
    }
    parser.finish().unwrap();
    Decoded {
        events,
        parser,
        decoder,
    }
}

impl Decoded {
    fn clr(&self) -> impl Iterator<Item = (&OwnedEventRecord, &ClrEvent)> {
        self.events
            .iter()
            .filter_map(|(record, event)| Some((record, event.as_ref()?)))
    }

    fn exceptions(&self) -> Vec<(String, String)> {
        self.clr()
            .filter_map(|(_, event)| match event {
                ClrEvent::ExceptionThrown(e) => Some((e.type_name.clone(), e.message.clone())),
                _ => None,
            })
            .collect()
    }

    fn method(&self, kind: MethodEventKind, name: &str) -> Vec<&crate::events::MethodLoad> {
        self.clr()
            .filter_map(|(_, event)| match event {
                ClrEvent::Method(m)
                    if m.kind == kind && m.namespace == "Demo.Worker" && m.name == name =>
                {
                    Some(m)
                }
                _ => None,
            })
            .collect()
    }

    /// Checks common to both runtimes; returns the contention stop count.
    fn check_common(&self) {
        let stats = self.parser.stats();
        assert_eq!(
            (
                stats.lost_events,
                stats.corrupt_blocks,
                stats.corrupt_metadata,
                stats.missing_stacks
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(
            self.decoder.stats().total_malformed(),
            0,
            "{:?}",
            self.decoder.last_error()
        );

        // Exceptions: the three types in the order the workload throws
        // them, with their messages.
        let exceptions = self.exceptions();
        assert!(exceptions.len() >= 9, "{exceptions:?}");
        for (type_name, message) in &exceptions {
            let number = |prefix: &str| {
                message
                    .strip_prefix(prefix)
                    .map(|n| n.parse::<u32>().expect("number"))
            };
            match type_name.as_str() {
                "System.InvalidOperationException" => {
                    assert_eq!(number("bad state ").map(|n| n % 3), Some(0))
                }
                "Demo.TooHotException" => assert_eq!(number("too hot ").map(|n| n % 3), Some(1)),
                "System.ArgumentException" => assert_eq!(message, "bad arg"),
                other => panic!("unexpected exception {other}: {message}"),
            }
        }
        for expected in [
            "System.InvalidOperationException",
            "Demo.TooHotException",
            "System.ArgumentException",
        ] {
            assert!(
                exceptions.iter().any(|(t, _)| t == expected),
                "{expected} missing"
            );
        }

        // The rundown names the workload's methods; the managed stacks of
        // contention and exception events point into them.
        let contend = self.method(MethodEventKind::RundownEnd, "Contend");
        let thrower = self.method(MethodEventKind::RundownEnd, "Thrower");
        assert_eq!((contend.len(), thrower.len()), (1, 1));
        assert!(!self.method(MethodEventKind::RundownEnd, "Spin").is_empty());
        let (contend, thrower) = (contend[0].code_range(), thrower[0].code_range());
        let mut starts = 0u32;
        let mut stops = 0u32;
        let mut waited_ns = 0.0;
        for (record, event) in self.clr() {
            let leaf = record
                .stack
                .as_ref()
                .and_then(|stack| stack.first().copied());
            match event {
                ClrEvent::ContentionStart(start) => {
                    starts += 1;
                    assert_eq!(start.flags, 0, "a managed lock");
                    assert!(contend.contains(&leaf.expect("stack")), "leaf {leaf:x?}");
                }
                ClrEvent::ContentionStop(stop) => {
                    stops += 1;
                    let duration = stop.duration_ns.expect("V1 has the duration");
                    // The holder keeps the lock ~20 ms plus a busy loop.
                    assert!((1e5..5e9).contains(&duration), "{duration}");
                    waited_ns += duration;
                }
                ClrEvent::ExceptionThrown(_) => assert!(thrower.contains(&leaf.expect("stack"))),
                _ => {}
            }
        }
        assert!(
            starts >= 20 && stops >= 20,
            "{starts} starts, {stops} stops"
        );
        assert!(
            starts.abs_diff(stops) <= 3,
            "{starts} starts, {stops} stops"
        );
        assert!(waited_ns > 1e8, "{waited_ns}");

        // The rundown ends with its marker after all method events.
        let last = self.clr().last().map(|(_, event)| event.clone());
        assert_eq!(last, Some(ClrEvent::Rundown(RundownMarker::EndComplete)));
        let rundown_methods = self.decoder.stats().decoded(ClrEventKind::Method);
        assert!(rundown_methods > 100, "{rundown_methods}");
        assert!(self.decoder.stats().decoded(ClrEventKind::Module) >= 5);
        assert!(
            self.decoder.stats().ignored > 0,
            "catch/finally events are not decoded"
        );
    }

    /// Method names equal the runtime's perf map names for the same code
    /// address (captured from the same process), tier suffix included,
    /// except for signatures the documented differences cover.
    fn check_names_against_perf_map(&self, perf_map: &str) -> usize {
        let map = std::fs::read_to_string(format!(
            "{}/src/nettrace/testdata/{perf_map}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .expect("perf map excerpt");
        let names: std::collections::HashMap<u64, &str> = map
            .lines()
            .map(|line| {
                let mut fields = line.splitn(3, ' ');
                let address = fields.next().expect("address").trim_start_matches("0x");
                fields.next();
                (
                    u64::from_str_radix(address, 16).expect("hex address"),
                    fields.next().expect("name"),
                )
            })
            .collect();
        let modules: std::collections::HashMap<u64, String> = self
            .clr()
            .filter_map(|(_, event)| match event {
                ClrEvent::Module(module) => Some((module.module_id, module.il_path.clone())),
                _ => None,
            })
            .collect();
        let mut matched = 0;
        for (_, event) in self.clr() {
            let ClrEvent::Method(method) = event else {
                continue;
            };
            let Some(&expected) = names.get(&method.start) else {
                continue;
            };
            let assembly = assembly_simple_name(&modules[&method.module_id]);
            let ours = format!(
                "{}[{}]",
                method_display_name_in_assembly(
                    assembly,
                    &method.namespace,
                    &method.name,
                    &method.signature
                ),
                method.tier().perf_map_name()
            );
            // Known differences: unnamed types (`pMT: 0x...`) and types of
            // other assemblies (`class [System.Runtime]X` in the perf map).
            if method.signature.contains("pMT: ") || expected.contains("class [") {
                assert_ne!(ours, expected);
                continue;
            }
            assert_eq!(ours, expected);
            matched += 1;
        }
        matched
    }
}

#[test]
fn net8_capture_decodes() {
    let decoded = decode_fixture("net8.nettrace.gz", 4096);
    decoded.check_common();
    let header = decoded.parser.trace_header().expect("header");
    assert_eq!(
        (header.pointer_size, header.qpc_frequency),
        (8, 1_000_000_000)
    );

    // .NET 8: ContentionStart V2 names the lock and its owner, which is one
    // of the other contending threads.
    let threads: std::collections::HashSet<u64> =
        decoded.events.iter().map(|(r, _)| r.thread_id).collect();
    let mut owners = 0;
    for (record, event) in decoded.clr() {
        if let ClrEvent::ContentionStart(start) = event {
            assert_eq!(record.version, 2);
            assert!(start.lock_id.is_some_and(|id| id != 0));
            // No owner when the lock was between holders.
            if let Some(owner) = start.lock_owner_thread_id {
                assert!(
                    threads.contains(&owner) && owner != record.thread_id,
                    "owner {owner}"
                );
                owners += 1;
            }
        }
    }
    assert!(owners > 0);
    assert!(
        decoded
            .decoder
            .stats()
            .decoded(ClrEventKind::ContentionLockCreated)
            >= 1
    );
    // MethodLoadVerbose while attached: methods compiled during the session.
    let loads = decoded
        .clr()
        .filter(|(_, event)| matches!(event, ClrEvent::Method(m) if m.kind == MethodEventKind::Load && m.is_jitted()))
        .count();
    assert!(loads > 0);
    assert!(decoded.check_names_against_perf_map("net8.perf.map") >= 40);
}

#[test]
fn netcore31_capture_decodes() {
    let decoded = decode_fixture("netcore31.nettrace.gz", 1000);
    decoded.check_common();
    for (record, event) in decoded.clr() {
        if let ClrEvent::ContentionStart(start) = event {
            // 3.1 has ContentionStart V1: no lock identity, no owner.
            assert_eq!(record.version, 1);
            assert_eq!(start.lock_owner_thread_id, None);
        }
    }
    assert!(decoded.check_names_against_perf_map("netcore31.perf.map") >= 20);
}

#[test]
fn fixture_parses_the_same_in_any_chunking() {
    let bytes = fixture("netcore31.nettrace.gz");
    let (expected, result, parser) = parse_all(&bytes);
    result.unwrap();
    for sizes in [&[1][..], &[4093, 7], &[65536]] {
        let (seen, result, other) = parse_chunked(&bytes, sizes);
        result.unwrap();
        assert_eq!(seen.len(), expected.len());
        assert!(seen == expected, "chunk sizes {sizes:?}");
        assert_eq!(other.stats(), parser.stats());
    }
}

#[test]
fn replicated_fixture_parses_to_n_times_the_events() {
    let bytes = fixture("netcore31.nettrace.gz");
    let (single, _) = bench_nettrace_parse(&bytes);
    let replicated = replicate_nettrace(&bytes, 3).unwrap();
    let (events, _) = bench_nettrace_parse(&replicated);
    assert_eq!(events, 3 * single);
    let (decoded, _) = bench_clr_event_intake(&replicated);
    assert_eq!(decoded, events);
    assert!(replicate_nettrace(&bytes[..bytes.len() - 1], 2).is_err());
}

/// A metadata record with `fields` Int32 fields of long names, as a
/// hostile writer makes them (about 400 bytes of UTF-16 a field).
fn long_metadata_payload(metadata_id: u32, fields: u32) -> Vec<u8> {
    use super::writer::utf16z;
    let mut out = Vec::new();
    out.extend(metadata_id.to_le_bytes());
    out.extend(utf16z("Flood"));
    out.extend(1u32.to_le_bytes());
    out.extend(utf16z("FloodEvent"));
    out.extend(0u64.to_le_bytes());
    out.extend(0u32.to_le_bytes());
    out.extend(4u32.to_le_bytes());
    out.extend(fields.to_le_bytes());
    for field in 0..fields {
        out.extend(9u32.to_le_bytes());
        out.extend(utf16z(&format!("{field:03}{}", "n".repeat(197))));
    }
    out
}

#[test]
fn metadata_bytes_are_bounded_and_counted() {
    let mut block = BlobBlockWriter::new();
    for id in 1..=40 {
        block.blob(BlobSpec::default(), &long_metadata_payload(id, 256));
    }
    let mut stream = StreamWriter::new();
    stream.block(BlockKind::Metadata, &block.finish());
    let bytes = stream.end();
    let limits = NettraceLimits {
        max_metadata_bytes: 1 << 20,
        ..NettraceLimits::default()
    };
    let mut parser = NettraceParser::with_limits(limits);
    let mut kept = 0;
    parser
        .feed(&bytes, &mut |item| {
            if let ParsedItem::Metadata(m) = item {
                assert_eq!(m.fields.len(), 256);
                kept += 1;
            }
        })
        .expect("a valid stream");
    parser.finish().expect("ended");
    // A record holds 256 names of 200 bytes and their descriptions: about
    // 60 KiB, so a MiB holds 15 or 16 of them.
    assert!((10..20).contains(&kept), "{kept} records kept");
    assert_eq!(parser.stats().metadata, kept);
    assert_eq!(parser.stats().corrupt_metadata, 40 - kept);
    assert!(matches!(
        parser.last_soft_error(),
        Some(NettraceError::MetadataOverBudget { .. })
    ));
}

#[test]
fn replacing_a_metadata_record_gives_its_bytes_back() {
    let mut block = BlobBlockWriter::new();
    // One id redefined many times: never more than one record held.
    for _ in 0..40 {
        block.blob(BlobSpec::default(), &long_metadata_payload(7, 256));
    }
    let mut stream = StreamWriter::new();
    stream.block(BlockKind::Metadata, &block.finish());
    let limits = NettraceLimits {
        max_metadata_bytes: 1 << 20,
        ..NettraceLimits::default()
    };
    let mut parser = NettraceParser::with_limits(limits);
    parser.feed(&stream.end(), &mut |_| {}).expect("valid");
    assert_eq!(parser.stats().metadata, 40);
    assert_eq!(parser.stats().corrupt_metadata, 0);
}
