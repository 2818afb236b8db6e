//! Incremental parser of the `jit-PID.dump` file CoreCLR writes next to its
//! perf map (the better source of managed symbols: it also holds ReadyToRun
//! code and stamps every method with the CLOCK_MONOTONIC time it was
//! compiled; the profiler's `symbolize::managed` feeds it the file's new bytes).
//!
//! Layout (perf's jitdump as CoreCLR writes it, little-endian on x86-64 and
//! arm64): a 40-byte file header (`u32 magic 0x4A695444, u32 version,
//! u32 total_size, u32 elf_mach, u32 pad, u32 pid, u64 timestamp,
//! u64 flags`), then records, each `u32 id, u32 total_size, u64 timestamp`
//! followed by `total_size - 16` bytes. CoreCLR only writes
//! `JIT_CODE_LOAD` (id 0): `u32 pid, u32 tid, u64 vma, u64 code_addr,
//! u64 code_size, u64 code_index`, a NUL-terminated name, then the code
//! bytes. Other ids are skipped by their size.
//!
//! The file is read while it is written: a record cut at the end of the data
//! waits for more. Only the fixed fields and the name of a code load are
//! buffered; its code bytes are skipped without being stored. Every size is
//! checked: a record smaller than its header, larger than
//! [`JitDumpLimits::max_record_size`], or a bad file header stops the
//! parser at that record (the error is kept, what was parsed stays). A
//! record that is framed correctly but inconsistent inside (name not
//! terminated, sizes that do not add up) is counted and skipped.

use std::borrow::Cow;

/// `JITHEADER_MAGIC` ("JiTD" read as a little-endian u32).
pub const JITDUMP_MAGIC: u32 = 0x4A69_5444;
/// `JITDUMP_FLAGS_ARCH_TIMESTAMP`: timestamps are TSC ticks, not
/// CLOCK_MONOTONIC. CoreCLR never sets it.
pub const JITDUMP_FLAG_ARCH_TIMESTAMP: u64 = 1;
/// Record id of `JIT_CODE_LOAD`.
pub const JIT_CODE_LOAD: u32 = 0;

const FILE_HEADER_SIZE: usize = 40;
/// perf allows a larger header (newer versions append fields); a few KiB is
/// far beyond any real one.
const MAX_FILE_HEADER_SIZE: u32 = 4096;
const RECORD_HEADER_SIZE: usize = 16;
/// Record header plus the fixed fields of a code load.
const CODE_LOAD_FIXED_SIZE: usize = RECORD_HEADER_SIZE + 40;

/// Bounds applied while parsing one jitdump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JitDumpLimits {
    /// Largest record accepted; a larger one stops the parser. Methods'
    /// code is KiBs; 16 MiB leaves room for generated giants.
    pub max_record_size: u32,
    /// Longest method name; a longer one skips its record (counted).
    pub max_name_len: usize,
    /// Code loads yielded at most; later ones are counted and dropped.
    pub max_code_loads: u64,
}

impl Default for JitDumpLimits {
    fn default() -> Self {
        Self {
            max_record_size: 16 * 1024 * 1024,
            max_name_len: 64 * 1024,
            max_code_loads: 1_000_000,
        }
    }
}

/// The file header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JitDumpHeader {
    pub version: u32,
    pub elf_mach: u32,
    /// The writer's pid in its own PID namespace.
    pub pid: u32,
    /// CLOCK_MONOTONIC ns at file creation (unless the arch-timestamp flag).
    pub timestamp_ns: u64,
    pub flags: u64,
}

impl JitDumpHeader {
    /// Whether record timestamps are CLOCK_MONOTONIC nanoseconds, the clock
    /// samples are stamped with.
    pub fn has_monotonic_timestamps(&self) -> bool {
        self.flags & JITDUMP_FLAG_ARCH_TIMESTAMP == 0
    }
}

/// One `JIT_CODE_LOAD` record, without its code bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JitCodeLoad<'a> {
    /// When the code became valid: CLOCK_MONOTONIC ns when
    /// `monotonic_time` (always, for CoreCLR), else the writer's TSC.
    pub timestamp_ns: u64,
    /// The file header's [`JitDumpHeader::has_monotonic_timestamps`].
    pub monotonic_time: bool,
    pub pid: u32,
    pub tid: u32,
    pub vma: u64,
    pub code_addr: u64,
    /// Never zero, and `code_addr + code_size` does not overflow.
    pub code_size: u64,
    pub code_index: u64,
    /// Invalid UTF-8 replaced.
    pub name: Cow<'a, str>,
}

/// Why the parser stopped. Records before the failing one were yielded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JitDumpError {
    #[error(
        "jitdump magic {found:#010x} is byte-swapped: the file was written with the other endianness"
    )]
    WrongEndianness { found: u32 },
    #[error("jitdump magic {found:#010x} is not {JITDUMP_MAGIC:#010x}")]
    BadMagic { found: u32 },
    #[error(
        "jitdump file header size {size} is outside {FILE_HEADER_SIZE}..={MAX_FILE_HEADER_SIZE}"
    )]
    BadHeaderSize { size: u32 },
    #[error("jitdump record at offset {offset} has size {size}, smaller than its 16-byte header")]
    RecordTooSmall { offset: u64, size: u32 },
    #[error("jitdump record at offset {offset} has size {size}, above the {max}-byte bound")]
    RecordTooLarge { offset: u64, size: u32, max: u32 },
}

/// What the parser saw, cumulative over the life of the parser.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JitDumpCounts {
    /// Complete record headers read (any id).
    pub records: u64,
    /// Code loads yielded.
    pub code_loads: u64,
    /// Records of ids other than `JIT_CODE_LOAD`, skipped by size.
    pub unknown_records: u64,
    /// Code loads skipped: too small for their fields, name not terminated
    /// inside the record, or sizes that do not add up to the record size.
    pub bad_code_loads: u64,
    /// Code loads skipped because the name exceeds [`JitDumpLimits::max_name_len`].
    pub long_names: u64,
    /// Code loads with code size 0: they cover no address.
    pub empty_ranges: u64,
    /// Code loads dropped because [`JitDumpLimits::max_code_loads`] was reached.
    pub code_loads_over_cap: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Collecting the 40-byte file header in `buf`.
    FileHeader,
    /// Collecting a record header in `buf`.
    RecordHeader,
    /// Collecting a code load's fixed fields and name in `buf`.
    CodeLoad {
        total_size: u32,
        timestamp_ns: u64,
    },
    /// Dropping the rest of a record (code bytes, unknown record, extra
    /// file header bytes).
    Skip {
        remaining: u64,
    },
    Stopped(JitDumpError),
}

/// The parser state for one jitdump file.
#[derive(Clone, Debug)]
pub struct JitDumpParser {
    limits: JitDumpLimits,
    state: State,
    /// Bytes fed so far: the file offset to read from next.
    offset: u64,
    /// File offset of the record being parsed (for error messages).
    record_offset: u64,
    /// The prefix of the header or record being collected.
    buf: Vec<u8>,
    header: Option<JitDumpHeader>,
    counts: JitDumpCounts,
}

impl JitDumpParser {
    pub fn new(limits: JitDumpLimits) -> Self {
        Self {
            limits,
            state: State::FileHeader,
            offset: 0,
            record_offset: 0,
            buf: Vec::new(),
            header: None,
            counts: JitDumpCounts::default(),
        }
    }

    /// Bytes consumed so far: where the next read of the file starts.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn counts(&self) -> JitDumpCounts {
        self.counts
    }

    /// The file header, once its 40 bytes were fed and valid.
    pub fn header(&self) -> Option<&JitDumpHeader> {
        self.header.as_ref()
    }

    /// Why the parser stopped, if it did. Further feeds are ignored.
    pub fn error(&self) -> Option<&JitDumpError> {
        match &self.state {
            State::Stopped(error) => Some(error),
            _ => None,
        }
    }

    /// Bytes of a header or record prefix waiting for more data.
    pub fn pending_len(&self) -> usize {
        self.buf.len()
    }

    /// Starts over at offset 0 (the file was replaced or truncated),
    /// clearing a stop. The counts are kept, so the cap holds across restarts.
    pub fn reset(&mut self) {
        self.state = State::FileHeader;
        self.offset = 0;
        self.record_offset = 0;
        self.buf.clear();
        self.header = None;
    }

    /// Parses `bytes` (the file's bytes from [`Self::offset`] on) and calls
    /// `on_load` for each complete code load.
    pub fn feed(&mut self, bytes: &[u8], mut on_load: impl FnMut(JitCodeLoad<'_>)) {
        let mut input = bytes;
        while !input.is_empty() {
            let before = input.len();
            match self.state.clone() {
                State::Stopped(_) => return,
                State::FileHeader => {
                    if self.fill(&mut input, FILE_HEADER_SIZE) {
                        self.parse_file_header();
                    }
                }
                State::RecordHeader => {
                    if self.fill(&mut input, RECORD_HEADER_SIZE) {
                        self.parse_record_header();
                    }
                }
                State::CodeLoad {
                    total_size,
                    timestamp_ns,
                } => self.collect_code_load(&mut input, total_size, timestamp_ns, &mut on_load),
                State::Skip { remaining } => {
                    let n = usize::try_from(remaining)
                        .unwrap_or(usize::MAX)
                        .min(input.len());
                    input = &input[n..];
                    self.offset += n as u64;
                    let remaining = remaining - n as u64;
                    self.state = if remaining == 0 {
                        self.begin_record()
                    } else {
                        State::Skip { remaining }
                    };
                }
            }
            debug_assert!(
                input.len() < before || matches!(self.state, State::Stopped(_)),
                "every step consumes input or stops"
            );
        }
    }

    /// Moves bytes from `input` to `buf` until it holds `want` bytes.
    /// Returns whether it does.
    fn fill(&mut self, input: &mut &[u8], want: usize) -> bool {
        let n = want.saturating_sub(self.buf.len()).min(input.len());
        self.buf.extend_from_slice(&input[..n]);
        *input = &input[n..];
        self.offset += n as u64;
        self.buf.len() >= want
    }

    fn begin_record(&mut self) -> State {
        self.buf.clear();
        self.record_offset = self.offset;
        State::RecordHeader
    }

    fn parse_file_header(&mut self) {
        let magic = u32_at(&self.buf, 0);
        if magic != JITDUMP_MAGIC {
            self.state = State::Stopped(if magic.swap_bytes() == JITDUMP_MAGIC {
                JitDumpError::WrongEndianness { found: magic }
            } else {
                JitDumpError::BadMagic { found: magic }
            });
            return;
        }
        let total_size = u32_at(&self.buf, 8);
        if !(FILE_HEADER_SIZE as u32..=MAX_FILE_HEADER_SIZE).contains(&total_size) {
            self.state = State::Stopped(JitDumpError::BadHeaderSize { size: total_size });
            return;
        }
        self.header = Some(JitDumpHeader {
            version: u32_at(&self.buf, 4),
            elf_mach: u32_at(&self.buf, 12),
            pid: u32_at(&self.buf, 20),
            timestamp_ns: u64_at(&self.buf, 24),
            flags: u64_at(&self.buf, 32),
        });
        let extra = u64::from(total_size) - FILE_HEADER_SIZE as u64;
        self.state = if extra == 0 {
            self.begin_record()
        } else {
            self.buf.clear();
            State::Skip { remaining: extra }
        };
    }

    fn parse_record_header(&mut self) {
        let id = u32_at(&self.buf, 0);
        let total_size = u32_at(&self.buf, 4);
        let timestamp_ns = u64_at(&self.buf, 8);
        if (total_size as usize) < RECORD_HEADER_SIZE {
            self.state = State::Stopped(JitDumpError::RecordTooSmall {
                offset: self.record_offset,
                size: total_size,
            });
            return;
        }
        if total_size > self.limits.max_record_size {
            self.state = State::Stopped(JitDumpError::RecordTooLarge {
                offset: self.record_offset,
                size: total_size,
                max: self.limits.max_record_size,
            });
            return;
        }
        self.counts.records += 1;
        if id != JIT_CODE_LOAD {
            self.counts.unknown_records += 1;
            self.skip_rest_of_record(total_size);
        } else if (total_size as usize) < CODE_LOAD_FIXED_SIZE + 1 {
            // No room for the fixed fields and a NUL.
            self.counts.bad_code_loads += 1;
            self.skip_rest_of_record(total_size);
        } else {
            self.state = State::CodeLoad {
                total_size,
                timestamp_ns,
            };
        }
    }

    /// Skips what is left of the current record after the `buf.len()`
    /// bytes already collected.
    fn skip_rest_of_record(&mut self, total_size: u32) {
        let remaining = u64::from(total_size).saturating_sub(self.buf.len() as u64);
        self.buf.clear();
        self.state = if remaining == 0 {
            self.begin_record()
        } else {
            State::Skip { remaining }
        };
    }

    fn collect_code_load(
        &mut self,
        input: &mut &[u8],
        total_size: u32,
        timestamp_ns: u64,
        on_load: &mut impl FnMut(JitCodeLoad<'_>),
    ) {
        if !self.fill(input, CODE_LOAD_FIXED_SIZE) {
            return;
        }
        // Collect the name up to its NUL, never past the record nor past
        // the name bound (+1 for the NUL).
        let limit = (total_size as usize).min(CODE_LOAD_FIXED_SIZE + self.limits.max_name_len + 1);
        let room = limit.saturating_sub(self.buf.len()).min(input.len());
        let (take, terminated) = match input[..room].iter().position(|&b| b == 0) {
            Some(nul) => (nul + 1, true),
            None => (room, false),
        };
        self.buf.extend_from_slice(&input[..take]);
        *input = &input[take..];
        self.offset += take as u64;
        if !terminated {
            if self.buf.len() < limit {
                return; // wait for more of the name
            }
            if limit == total_size as usize {
                self.counts.bad_code_loads += 1;
            } else {
                self.counts.long_names += 1;
            }
            self.skip_rest_of_record(total_size);
            return;
        }
        let name_len = self.buf.len() - CODE_LOAD_FIXED_SIZE - 1;
        let code_addr = u64_at(&self.buf, 32);
        let code_size = u64_at(&self.buf, 40);
        let expected_size = (CODE_LOAD_FIXED_SIZE + name_len + 1) as u64;
        if expected_size.checked_add(code_size) != Some(u64::from(total_size))
            || code_addr.checked_add(code_size).is_none()
        {
            self.counts.bad_code_loads += 1;
        } else if code_size == 0 {
            self.counts.empty_ranges += 1;
        } else if self.counts.code_loads >= self.limits.max_code_loads {
            self.counts.code_loads_over_cap += 1;
        } else {
            self.counts.code_loads += 1;
            let fields = &self.buf[RECORD_HEADER_SIZE..];
            on_load(JitCodeLoad {
                timestamp_ns,
                monotonic_time: self
                    .header
                    .is_none_or(|header| header.has_monotonic_timestamps()),
                pid: u32_at(fields, 0),
                tid: u32_at(fields, 4),
                vma: u64_at(fields, 8),
                code_addr,
                code_size,
                code_index: u64_at(fields, 32),
                name: String::from_utf8_lossy(
                    &self.buf[CODE_LOAD_FIXED_SIZE..CODE_LOAD_FIXED_SIZE + name_len],
                ),
            });
        }
        self.skip_rest_of_record(total_size);
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let field: [u8; 4] = bytes[at..at + 4]
        .try_into()
        .expect("callers collected the field's bytes");
    u32::from_le_bytes(field)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let field: [u8; 8] = bytes[at..at + 8]
        .try_into()
        .expect("callers collected the field's bytes");
    u64::from_le_bytes(field)
}

/// Test helpers that write jitdump bytes.
#[cfg(test)]
pub mod write {
    use super::*;

    /// A 40-byte CoreCLR file header.
    pub fn file_header(pid: u32, timestamp_ns: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(FILE_HEADER_SIZE);
        out.extend_from_slice(&JITDUMP_MAGIC.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&(FILE_HEADER_SIZE as u32).to_le_bytes());
        out.extend_from_slice(&62u32.to_le_bytes()); // EM_X86_64
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&pid.to_le_bytes());
        out.extend_from_slice(&timestamp_ns.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
        out
    }

    /// A `JIT_CODE_LOAD` record as CoreCLR writes it, with `code_size`
    /// filler code bytes.
    pub fn code_load(
        timestamp_ns: u64,
        addr: u64,
        code_size: u64,
        index: u64,
        name: &str,
    ) -> Vec<u8> {
        let total = CODE_LOAD_FIXED_SIZE + name.len() + 1 + code_size as usize;
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&JIT_CODE_LOAD.to_le_bytes());
        out.extend_from_slice(&(total as u32).to_le_bytes());
        out.extend_from_slice(&timestamp_ns.to_le_bytes());
        out.extend_from_slice(&7u32.to_le_bytes()); // pid
        out.extend_from_slice(&8u32.to_le_bytes()); // tid
        out.extend_from_slice(&addr.to_le_bytes()); // vma
        out.extend_from_slice(&addr.to_le_bytes()); // code_addr
        out.extend_from_slice(&code_size.to_le_bytes());
        out.extend_from_slice(&index.to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.resize(total, 0xcc);
        out
    }

    /// A record of another id with `payload` bytes after its header.
    pub fn other_record(id: u32, timestamp_ns: u64, payload: usize) -> Vec<u8> {
        let total = RECORD_HEADER_SIZE + payload;
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&(total as u32).to_le_bytes());
        out.extend_from_slice(&timestamp_ns.to_le_bytes());
        out.resize(total, 0xab);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::write::*;
    use super::*;

    #[derive(Debug, PartialEq, Eq)]
    struct Load {
        ts: u64,
        addr: u64,
        size: u64,
        index: u64,
        name: String,
    }

    fn feed(parser: &mut JitDumpParser, bytes: &[u8]) -> Vec<Load> {
        let mut out = Vec::new();
        parser.feed(bytes, |l| {
            out.push(Load {
                ts: l.timestamp_ns,
                addr: l.code_addr,
                size: l.code_size,
                index: l.code_index,
                name: l.name.into_owned(),
            })
        });
        out
    }

    fn parser() -> JitDumpParser {
        JitDumpParser::new(JitDumpLimits::default())
    }

    /// Names and sizes from a real .NET 8.0.4 jitdump: a stub, a JIT'd
    /// method and a ReadyToRun one.
    fn real_file() -> Vec<u8> {
        let mut file = file_header(14362, 507_136_834_002);
        file.extend(code_load(
            507_141_255_167,
            0x7f5c2d980000,
            0xd8,
            1,
            "stub<1> AllocateTemporaryEntryPoints<PRECODE_STUB>",
        ));
        file.extend(code_load(
            507_170_788_225,
            0x7f5c2da42250,
            0x9a,
            1397,
            "int64 [App] Hot::Spin(int64)[QuickJitted]",
        ));
        file.extend(code_load(
            507_152_878_413,
            0x7f5c2cdc8880,
            0xb1,
            635,
            "void [System.Private.CoreLib] System.AppContext::Setup(char**,char**,int32)[PreJIT]",
        ));
        file
    }

    #[test]
    fn parses_a_whole_file() {
        let file = real_file();
        let mut p = parser();
        let loads = feed(&mut p, &file);
        assert_eq!(loads.len(), 3);
        assert_eq!(
            loads[1],
            Load {
                ts: 507_170_788_225,
                addr: 0x7f5c2da42250,
                size: 0x9a,
                index: 1397,
                name: "int64 [App] Hot::Spin(int64)[QuickJitted]".into(),
            }
        );
        let header = p.header().expect("header");
        assert_eq!(header.pid, 14362);
        assert_eq!(header.timestamp_ns, 507_136_834_002);
        assert!(header.has_monotonic_timestamps());
        assert_eq!(p.offset(), file.len() as u64);
        assert_eq!(p.error(), None);
        assert_eq!(p.counts().code_loads, 3);
        assert_eq!(p.counts().records, 3);
        assert_eq!(p.pending_len(), 0);
    }

    #[test]
    fn every_split_point_gives_the_same_result() {
        let file = real_file();
        let whole = feed(&mut parser(), &file);
        for split in 0..=file.len() {
            let mut p = parser();
            let mut loads = feed(&mut p, &file[..split]);
            loads.extend(feed(&mut p, &file[split..]));
            assert_eq!(loads, whole, "split at {split}");
            assert_eq!(p.offset(), file.len() as u64);
        }
        // And byte by byte.
        let mut p = parser();
        let mut loads = Vec::new();
        for b in &file {
            loads.extend(feed(&mut p, std::slice::from_ref(b)));
        }
        assert_eq!(loads, whole);
    }

    #[test]
    fn a_record_cut_at_the_end_waits_and_does_not_buffer_code() {
        let mut file = file_header(1, 0);
        let record = code_load(5, 0x1000, 100_000, 1, "big()");
        file.extend_from_slice(&record[..CODE_LOAD_FIXED_SIZE + 3]);
        let mut p = parser();
        assert!(feed(&mut p, &file).is_empty());
        assert_eq!(p.pending_len(), CODE_LOAD_FIXED_SIZE + 3);
        // The name completes: the load is yielded before its code arrives,
        // and the code is skipped, not stored.
        let rest = &record[CODE_LOAD_FIXED_SIZE + 3..];
        let loads = feed(&mut p, &rest[..10]);
        assert_eq!(loads.len(), 1);
        assert_eq!(loads[0].name, "big()");
        assert_eq!(p.pending_len(), 0);
        assert!(feed(&mut p, &rest[10..]).is_empty());
        let next = code_load(6, 0x2000, 4, 2, "next()");
        assert_eq!(feed(&mut p, &next).len(), 1);
    }

    #[test]
    fn unknown_records_are_skipped_by_size() {
        let mut file = file_header(1, 0);
        file.extend(other_record(3, 1, 0)); // JIT_CODE_CLOSE: header only
        file.extend(other_record(2, 2, 1000)); // debug info
        file.extend(code_load(3, 0x1000, 4, 1, "f()"));
        let mut p = parser();
        let loads = feed(&mut p, &file);
        assert_eq!(loads.len(), 1);
        assert_eq!(p.counts().unknown_records, 2);
        assert_eq!(p.counts().records, 3);
    }

    #[test]
    fn larger_file_header_is_skipped() {
        let mut file = file_header(1, 0);
        file[8..12].copy_from_slice(&48u32.to_le_bytes());
        file.extend_from_slice(&[0xee; 8]);
        file.extend(code_load(3, 0x1000, 4, 1, "f()"));
        assert_eq!(feed(&mut parser(), &file).len(), 1);
    }

    #[test]
    fn bad_headers_stop_the_parser() {
        let mut swapped = file_header(1, 0);
        swapped[..4].copy_from_slice(&JITDUMP_MAGIC.to_be_bytes());
        let mut p = parser();
        assert!(feed(&mut p, &swapped).is_empty());
        assert!(matches!(
            p.error(),
            Some(JitDumpError::WrongEndianness { .. })
        ));
        assert!(p.error().expect("error").to_string().contains("endianness"));

        let mut bad = file_header(1, 0);
        bad[0] = b'X';
        let mut p = parser();
        feed(&mut p, &bad);
        assert!(matches!(p.error(), Some(JitDumpError::BadMagic { .. })));

        for size in [0u32, 39, 4097, u32::MAX] {
            let mut bad = file_header(1, 0);
            bad[8..12].copy_from_slice(&size.to_le_bytes());
            let mut p = parser();
            feed(&mut p, &bad);
            assert_eq!(p.error(), Some(&JitDumpError::BadHeaderSize { size }));
        }
    }

    #[test]
    fn hostile_record_sizes_stop_and_keep_what_was_parsed() {
        let good = code_load(3, 0x1000, 4, 1, "f()");
        for (size, small) in [
            (0u32, true),
            (15, true),
            (16 * 1024 * 1024 + 1, false),
            (u32::MAX, false),
        ] {
            let mut file = file_header(1, 0);
            file.extend_from_slice(&good);
            let bad_offset = file.len() as u64;
            let mut bad = code_load(4, 0x2000, 4, 2, "g()");
            bad[4..8].copy_from_slice(&size.to_le_bytes());
            file.extend(bad);
            file.extend_from_slice(&code_load(5, 0x3000, 4, 3, "h()"));
            let mut p = parser();
            let loads = feed(&mut p, &file);
            assert_eq!(loads.len(), 1, "size {size}");
            assert_eq!(loads[0].name, "f()");
            let expected = if small {
                JitDumpError::RecordTooSmall {
                    offset: bad_offset,
                    size,
                }
            } else {
                JitDumpError::RecordTooLarge {
                    offset: bad_offset,
                    size,
                    max: 16 * 1024 * 1024,
                }
            };
            assert_eq!(p.error(), Some(&expected));
            // Stopped: more data is ignored, a reset starts over.
            assert!(feed(&mut p, &good).is_empty());
            p.reset();
            assert_eq!(p.error(), None);
            assert_eq!(feed(&mut p, &file[..bad_offset as usize]).len(), 1);
        }
    }

    #[test]
    fn inconsistent_code_loads_are_counted_and_skipped() {
        let mut file = file_header(1, 0);
        // Record too small to hold the fields.
        let mut tiny = other_record(JIT_CODE_LOAD, 1, 20);
        tiny[0..4].copy_from_slice(&JIT_CODE_LOAD.to_le_bytes());
        file.extend(tiny);
        // Name without NUL inside the record.
        let mut unterminated = code_load(2, 0x1000, 0, 1, "abc");
        let last = unterminated.len() - 1;
        unterminated[last] = b'd';
        file.extend(unterminated);
        // Code size larger than the record says.
        let mut lying = code_load(3, 0x1000, 4, 1, "f()");
        lying[40..48].copy_from_slice(&1000u64.to_le_bytes());
        file.extend(lying);
        // Range that wraps around the address space.
        file.extend(code_load(4, u64::MAX - 1, 4, 1, "wrap()"));
        // Zero-sized code.
        file.extend(code_load(5, 0x1000, 0, 1, "empty()"));
        file.extend(code_load(6, 0x2000, 4, 2, "ok()"));
        let mut p = parser();
        let loads = feed(&mut p, &file);
        assert_eq!(loads.len(), 1);
        assert_eq!(loads[0].name, "ok()");
        let counts = p.counts();
        assert_eq!(counts.bad_code_loads, 4);
        assert_eq!(counts.empty_ranges, 1);
        assert_eq!(p.error(), None);
    }

    #[test]
    fn long_names_are_skipped_without_buffering_them() {
        let limits = JitDumpLimits {
            max_name_len: 8,
            ..Default::default()
        };
        let mut file = file_header(1, 0);
        file.extend(code_load(1, 0x1000, 4, 1, "12345678"));
        file.extend(code_load(2, 0x2000, 4, 2, "123456789"));
        file.extend(code_load(3, 0x3000, 4, 3, "ok"));
        let mut p = JitDumpParser::new(limits);
        let loads = feed(&mut p, &file);
        let names: Vec<_> = loads.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["12345678", "ok"]);
        assert_eq!(p.counts().long_names, 1);
    }

    #[test]
    fn cap_on_code_loads_is_counted() {
        let limits = JitDumpLimits {
            max_code_loads: 1,
            ..Default::default()
        };
        let mut file = file_header(1, 0);
        file.extend(code_load(1, 0x1000, 4, 1, "a"));
        file.extend(code_load(2, 0x2000, 4, 2, "b"));
        let mut p = JitDumpParser::new(limits);
        assert_eq!(feed(&mut p, &file).len(), 1);
        assert_eq!(p.counts().code_loads_over_cap, 1);
    }

    #[test]
    fn truncated_file_header_waits() {
        let file = real_file();
        let mut p = parser();
        assert!(feed(&mut p, &file[..39]).is_empty());
        assert!(p.header().is_none());
        assert_eq!(p.error(), None);
        assert_eq!(feed(&mut p, &file[39..]).len(), 3);
    }
}
