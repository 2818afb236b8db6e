//! Incremental parser of the `perf-PID.map` text a .NET runtime appends to
//! while it JIT-compiles (one source of managed symbols, next to the
//! jitdump; the profiler's `symbolize::managed` feeds it the file's new bytes and indexes
//! what it yields).
//!
//! Format, one entry per line, as CoreCLR prints it with
//! `"%p %x %s\n"`: `<hex address, with or without 0x> <hex size> <name>`,
//! e.g. `0x7f3684c12170 9a int64 [Hot] Hot::Spin(int64)[QuickJitted]`. The
//! name is the rest of the line and may contain spaces.
//!
//! The file is read while it is written, so only complete lines are parsed:
//! a trailing partial line waits for the next feed. The text comes from the
//! target process, so it is hostile: lines are bounded (a longer one is
//! skipped up to its newline and counted), entries are capped, malformed
//! lines are counted, and nothing panics.

use std::borrow::Cow;

/// Bounds applied while parsing one perf map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerfMapLimits {
    /// Longest line accepted, newline excluded. Real lines are a few hundred
    /// bytes; generic signatures can reach a few KiB.
    pub max_line_len: usize,
    /// Entries yielded at most; later ones are counted and dropped.
    pub max_entries: u64,
}

impl Default for PerfMapLimits {
    fn default() -> Self {
        Self {
            max_line_len: 64 * 1024,
            max_entries: 1_000_000,
        }
    }
}

/// One parsed line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerfMapEntry<'a> {
    pub start: u64,
    /// Never zero, and `start + size` does not overflow.
    pub size: u64,
    /// The name as written, invalid UTF-8 replaced.
    pub name: Cow<'a, str>,
}

/// What the parser saw, cumulative over the life of the parser (a reset
/// keeps them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerfMapCounts {
    /// Complete lines seen (including bad ones).
    pub lines: u64,
    /// Entries yielded.
    pub entries: u64,
    /// Lines that are not `<hex> <hex> <name>` or whose range overflows.
    pub malformed_lines: u64,
    /// Lines longer than [`PerfMapLimits::max_line_len`], skipped.
    pub long_lines: u64,
    /// Well-formed lines dropped because [`PerfMapLimits::max_entries`] was reached.
    pub entries_over_cap: u64,
    /// Well-formed lines with size 0: they cover no address.
    pub empty_ranges: u64,
}

/// The parser state for one perf map file.
#[derive(Clone, Debug)]
pub struct PerfMapParser {
    limits: PerfMapLimits,
    /// Bytes fed so far: the file offset to read from next.
    offset: u64,
    /// The incomplete last line, waiting for its newline.
    partial: Vec<u8>,
    /// Inside a line that already exceeded the bound: drop bytes up to the
    /// next newline.
    skipping_long_line: bool,
    counts: PerfMapCounts,
}

impl PerfMapParser {
    pub fn new(limits: PerfMapLimits) -> Self {
        Self {
            limits,
            offset: 0,
            partial: Vec::new(),
            skipping_long_line: false,
            counts: PerfMapCounts::default(),
        }
    }

    /// Bytes consumed so far (complete lines and the pending partial one):
    /// where the next read of the file starts.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn counts(&self) -> PerfMapCounts {
        self.counts
    }

    /// Bytes of an incomplete last line waiting for more data.
    pub fn pending_len(&self) -> usize {
        self.partial.len()
    }

    /// Starts over at offset 0 (the file was replaced or truncated). The
    /// counts are kept, so the entry cap holds across restarts.
    pub fn reset(&mut self) {
        self.offset = 0;
        self.partial.clear();
        self.skipping_long_line = false;
    }

    /// Parses the complete lines in `bytes` (the file's bytes from
    /// [`Self::offset`] on) and calls `on_entry` for each entry.
    pub fn feed(&mut self, bytes: &[u8], mut on_entry: impl FnMut(PerfMapEntry<'_>)) {
        self.offset = self.offset.saturating_add(bytes.len() as u64);
        let mut rest = bytes;
        while let Some(newline) = find_newline(rest) {
            let (piece, after) = rest.split_at(newline);
            rest = &after[1..];
            if self.skipping_long_line {
                // The long line was counted when it crossed the bound.
                self.skipping_long_line = false;
                continue;
            }
            self.counts.lines += 1;
            if self.partial.len() + piece.len() > self.limits.max_line_len {
                self.counts.long_lines += 1;
                self.partial.clear();
                continue;
            }
            if self.partial.is_empty() {
                self.parse_line(piece, &mut on_entry);
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(piece);
                self.parse_line(&line, &mut on_entry);
                line.clear();
                // Keep the allocation for the next partial line.
                self.partial = line;
            }
        }
        if rest.is_empty() || self.skipping_long_line {
            return;
        }
        if self.partial.len() + rest.len() > self.limits.max_line_len {
            // Counted now, as a line: it may never be completed.
            self.counts.lines += 1;
            self.counts.long_lines += 1;
            self.partial.clear();
            self.skipping_long_line = true;
        } else {
            self.partial.extend_from_slice(rest);
        }
    }

    fn parse_line(&mut self, line: &[u8], on_entry: &mut impl FnMut(PerfMapEntry<'_>)) {
        let Some((start, size, name)) = split_line(line) else {
            self.counts.malformed_lines += 1;
            return;
        };
        if size == 0 {
            self.counts.empty_ranges += 1;
            return;
        }
        if self.counts.entries >= self.limits.max_entries {
            self.counts.entries_over_cap += 1;
            return;
        }
        self.counts.entries += 1;
        on_entry(PerfMapEntry {
            start,
            size,
            name: match std::str::from_utf8(name) {
                Ok(name) => Cow::Borrowed(name),
                Err(_) => String::from_utf8_lossy(name),
            },
        });
    }
}

/// The index of the first `\n`. Compares 16 bytes per step without an
/// early exit inside the step, which the compiler vectorizes; a plain
/// `position` goes byte by byte (std's memchr is not public and this saves
/// a dependency).
fn find_newline(bytes: &[u8]) -> Option<usize> {
    const STEP: usize = 16;
    let mut chunks = bytes.chunks_exact(STEP);
    let mut base = 0;
    for chunk in &mut chunks {
        if chunk.iter().fold(false, |found, &b| found | (b == b'\n')) {
            return chunk.iter().position(|&b| b == b'\n').map(|i| base + i);
        }
        base += STEP;
    }
    chunks
        .remainder()
        .iter()
        .position(|&b| b == b'\n')
        .map(|i| base + i)
}

/// Splits one line (without its newline) into address, size and name.
/// `None` for anything else, including a range that overflows.
fn split_line(line: &[u8]) -> Option<(u64, u64, &[u8])> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let (address, rest) = split_field(line)?;
    let (size, name) = split_field(rest)?;
    let start = parse_hex(address)?;
    let size = parse_hex(size)?;
    start.checked_add(size)?;
    if name.is_empty() {
        return None;
    }
    Some((start, size, name))
}

/// The field before the first run of blanks, and what follows the run.
fn split_field(text: &[u8]) -> Option<(&[u8], &[u8])> {
    let is_blank = |b: &u8| *b == b' ' || *b == b'\t';
    let end = text.iter().position(is_blank)?;
    let (field, rest) = text.split_at(end);
    let skip = rest.iter().position(|b| !is_blank(b)).unwrap_or(rest.len());
    Some((field, &rest[skip..]))
}

/// A hex number of 1 to 16 digits with an optional `0x`/`0X` prefix.
fn parse_hex(text: &[u8]) -> Option<u64> {
    let digits = text
        .strip_prefix(b"0x")
        .or_else(|| text.strip_prefix(b"0X"))
        .unwrap_or(text);
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    let mut value = 0u64;
    for &b in digits {
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => return None,
        };
        value = (value << 4) | u64::from(digit);
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines from a real .NET 8.0.4 `perf-PID.map`.
    const REAL_LINES: &str = "\
0x7f5c2d980000 d8 stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>
0x7f5c2da40020 54 void [System.Private.CoreLib] System.Runtime.CompilerServices.CastHelpers::StelemRef(class System.Array,native int,object)[OptimizedTier1]
0x7f5c2da42250 9a int64 [App] Hot::Spin(int64)[QuickJitted]
0x7f5c2da42300 3e int64 [App] Hot::Spin(int64)[OptimizedTier1OSR]
0x7f5c2da42460 244 !!1 [System.Linq] System.Linq.Enumerable::Su(class [System.Runtime]System.Collections.Generic.IEnumerable`1<!!0>)[QuickJitted]
";

    fn parse_all(parser: &mut PerfMapParser, bytes: &[u8]) -> Vec<(u64, u64, String)> {
        let mut out = Vec::new();
        parser.feed(bytes, |e| out.push((e.start, e.size, e.name.into_owned())));
        out
    }

    fn parser() -> PerfMapParser {
        PerfMapParser::new(PerfMapLimits::default())
    }

    #[test]
    fn parses_real_lines() {
        let mut p = parser();
        let entries = parse_all(&mut p, REAL_LINES.as_bytes());
        assert_eq!(entries.len(), 5);
        assert_eq!(
            entries[0],
            (
                0x7f5c2d980000,
                0xd8,
                "stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>".into()
            )
        );
        assert_eq!(
            entries[2],
            (
                0x7f5c2da42250,
                0x9a,
                "int64 [App] Hot::Spin(int64)[QuickJitted]".into()
            )
        );
        assert!(entries[4].2.contains("IEnumerable`1<!!0>)[QuickJitted]"));
        assert_eq!(p.offset(), REAL_LINES.len() as u64);
        assert_eq!(
            p.counts(),
            PerfMapCounts {
                lines: 5,
                entries: 5,
                ..Default::default()
            }
        );
    }

    #[test]
    fn partial_lines_wait_for_the_rest_byte_by_byte() {
        let mut whole = parser();
        let expected = parse_all(&mut whole, REAL_LINES.as_bytes());
        let mut p = parser();
        let mut got = Vec::new();
        for b in REAL_LINES.as_bytes() {
            got.extend(parse_all(&mut p, std::slice::from_ref(b)));
        }
        assert_eq!(got, expected);
        assert_eq!(p.counts(), whole.counts());
    }

    #[test]
    fn a_trailing_partial_line_is_kept_for_the_next_feed() {
        let mut p = parser();
        assert_eq!(
            parse_all(&mut p, b"0x10 4 f()\n0x20 8 g("),
            vec![(0x10, 4, "f()".into())]
        );
        assert_eq!(p.pending_len(), 9);
        assert_eq!(p.offset(), 20);
        assert_eq!(
            parse_all(&mut p, b"int32)[QuickJitted]\n"),
            vec![(0x20, 8, "g(int32)[QuickJitted]".into())]
        );
        assert_eq!(p.pending_len(), 0);
    }

    #[test]
    fn accepts_addresses_without_prefix_crlf_and_extra_blanks() {
        let mut p = parser();
        let got = parse_all(&mut p, b"7f00 10 a b\r\n0X7F10\t0x20  c\n");
        assert_eq!(
            got,
            vec![(0x7f00, 0x10, "a b".into()), (0x7f10, 0x20, "c".into())]
        );
    }

    #[test]
    fn malformed_lines_are_counted_and_skipped() {
        let mut p = parser();
        let text = b"\n0x10\n0x10 4\n0x10 4 \nzz 4 f\n0x10 q f\n0x 4 f\n\
0x10000000000000000 1 f\nffffffffffffffff 2 f\n0x10 4 ok\n";
        let got = parse_all(&mut p, text);
        assert_eq!(got, vec![(0x10, 4, "ok".into())]);
        let counts = p.counts();
        assert_eq!(counts.malformed_lines, 9);
        assert_eq!(counts.lines, 10);
    }

    #[test]
    fn zero_sized_entries_are_counted_not_yielded() {
        let mut p = parser();
        assert!(parse_all(&mut p, b"0x10 0 f\n").is_empty());
        assert_eq!(p.counts().empty_ranges, 1);
        assert_eq!(p.counts().malformed_lines, 0);
    }

    #[test]
    fn long_lines_are_skipped_whole_even_across_feeds() {
        let limits = PerfMapLimits {
            max_line_len: 16,
            max_entries: 100,
        };
        let mut p = PerfMapParser::new(limits);
        // Exactly at the bound is accepted.
        let at_bound = b"0x10 4 abcdefghi\n";
        assert_eq!(at_bound.len(), 17);
        assert_eq!(parse_all(&mut p, at_bound).len(), 1);
        // Longer, in one piece.
        assert!(parse_all(&mut p, b"0x10 4 abcdefghij\n").is_empty());
        assert_eq!(p.counts().long_lines, 1);
        // Longer, arriving in pieces: the tail of the long line must not be
        // parsed as a line of its own.
        assert!(parse_all(&mut p, b"0x10 4 abcd").is_empty());
        assert!(parse_all(&mut p, b"efghijkl").is_empty());
        assert_eq!(p.pending_len(), 0, "the long line is not buffered");
        assert!(parse_all(&mut p, b"0x20 4 tail").is_empty());
        let got = parse_all(&mut p, b"\n0x30 4 next\n");
        assert_eq!(got, vec![(0x30, 4, "next".into())]);
        let counts = p.counts();
        assert_eq!(counts.long_lines, 2);
        assert_eq!(counts.malformed_lines, 0);
        assert_eq!(counts.entries, 2);
    }

    #[test]
    fn entry_cap_is_counted_and_survives_reset() {
        let limits = PerfMapLimits {
            max_line_len: 100,
            max_entries: 2,
        };
        let mut p = PerfMapParser::new(limits);
        let got = parse_all(&mut p, b"1 1 a\n2 1 b\n3 1 c\n4 1 d\n");
        assert_eq!(got.len(), 2);
        assert_eq!(p.counts().entries_over_cap, 2);
        p.reset();
        assert_eq!(p.offset(), 0);
        assert!(parse_all(&mut p, b"1 1 a\n").is_empty());
        assert_eq!(p.counts().entries_over_cap, 3);
    }

    #[test]
    fn invalid_utf8_is_replaced_not_rejected() {
        let mut p = parser();
        let got = parse_all(&mut p, b"0x10 4 f\xff()\n");
        assert_eq!(got, vec![(0x10, 4, "f\u{fffd}()".into())]);
    }

    #[test]
    fn find_newline_at_every_position() {
        for len in 0..40 {
            let mut bytes = vec![b'x'; len];
            assert_eq!(find_newline(&bytes), None);
            for at in 0..len {
                bytes[at] = b'\n';
                assert_eq!(find_newline(&bytes), Some(at), "len {len} at {at}");
                if at + 3 < len {
                    bytes[at + 3] = b'\n';
                    assert_eq!(find_newline(&bytes), Some(at));
                    bytes[at + 3] = b'x';
                }
                bytes[at] = b'x';
            }
        }
    }

    #[test]
    fn hex_parser_bounds() {
        assert_eq!(parse_hex(b"ffffffffffffffff"), Some(u64::MAX));
        assert_eq!(parse_hex(b"0x0000000000000001"), Some(1));
        assert_eq!(parse_hex(b"1ffffffffffffffff"), None);
        assert_eq!(parse_hex(b""), None);
        assert_eq!(parse_hex(b"0x"), None);
        assert_eq!(parse_hex(b"-1"), None);
        assert_eq!(parse_hex(b"+1"), None);
    }
}
