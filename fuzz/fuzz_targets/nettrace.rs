//! Fuzz the nettrace parser and the CLR event decoders: arbitrary bytes fed
//! in arbitrary chunk splits, as a hostile target process could send them
//! over its diagnostic socket. The first input byte seeds the chunk sizes;
//! the rest is the stream (seed the corpus with a byte + a real capture).

#![no_main]

use clrbpf_parse::{
    events::ClrEventDecoder,
    nettrace::{NettraceLimits, NettraceParser, ParsedItem},
};
use libfuzzer_sys::fuzz_target;

/// Bytes of framing an object adds around its body; the parser never
/// buffers more than one object.
const FRAMING: usize = 128;

fuzz_target!(|data: &[u8]| {
    let Some((&seed, stream)) = data.split_first() else {
        return;
    };
    let limits = NettraceLimits {
        max_block_bytes: 1 << 20,
        ..NettraceLimits::default()
    };
    let mut parser = NettraceParser::with_limits(limits);
    let mut decoder = ClrEventDecoder::new();
    // xorshift: chunk sizes from 1 byte to 4 KiB, reproducible per input.
    let mut state = u64::from(seed) << 32 | stream.len() as u64 | 1;
    let mut rest = stream;
    let mut failed = false;
    while !rest.is_empty() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let size = match seed % 4 {
            0 => rest.len(),
            1 => 1,
            _ => (state % 4096) as usize + 1,
        }
        .min(rest.len());
        let (chunk, tail) = rest.split_at(size);
        rest = tail;
        let mut delivered_after_error = false;
        let result = parser.feed(chunk, &mut |item| {
            delivered_after_error |= failed;
            if let ParsedItem::Event(event) = item {
                let _ = decoder.decode(&event);
            }
        });
        assert!(!delivered_after_error, "an item after a hard error");
        assert!(parser.buffered_bytes() <= limits.max_block_bytes + FRAMING);
        if result.is_err() {
            assert!(parser.error().is_some());
            failed = true;
        }
    }
    let finished = parser.finish();
    assert_eq!(finished.is_ok(), parser.is_finished() && !failed);
    let stats = parser.stats();
    assert!(stats.bytes <= stream.len() as u64);
});
