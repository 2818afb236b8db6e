//! Splits a fuzz input into chunk sizes, so the parsers' incremental path
//! (a header, line or record cut between reads) is exercised.

/// The first two bytes choose a seed; the rest is the data, cut into
/// pseudo-random chunks of 0 to 63 bytes.
pub fn split(input: &[u8]) -> (u16, Vec<&[u8]>) {
    let (seed, data) = match input {
        [a, b, rest @ ..] => (u16::from_le_bytes([*a, *b]), rest),
        _ => (0, input),
    };
    let mut state = u32::from(seed) | 1;
    let mut chunks = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let len = (state as usize % 64).min(rest.len());
        let (chunk, after) = rest.split_at(len);
        chunks.push(chunk);
        rest = after;
    }
    (seed, chunks)
}
