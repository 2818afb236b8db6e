//! `/proc/PID/maps`: the address space of a process, for symbolization
//! (which file and offset an instruction pointer falls in), for the unwinder
//! (which ranges are anonymous JIT code) and for .NET detection.
//!
//! The file is the kernel's, but its paths are chosen by the process (file
//! names, `[anon:...]` names set with `prctl`), so every line is bounded in
//! length, the line count is bounded, and a line that does not parse is
//! counted and skipped while the rest of the table is kept.

use std::io::{self, BufRead};

/// Lines longer than this are skipped: a path is at most `PATH_MAX` (4096)
/// bytes, which the kernel may escape (`\n` -> `\012`), plus ~75 bytes of fields.
const MAX_LINE_BYTES: usize = 4 * 4096 + 128;
/// At most this many lines are read. `vm.max_map_count` defaults to 65530;
/// some hosts raise it a few times.
const MAX_LINES: usize = 1 << 20;

/// Access permissions of a mapping (`rwxp` / `rwxs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Perms {
    pub read: bool,
    pub write: bool,
    pub execute: bool,
    /// Private (copy-on-write, `p`) rather than shared (`s`).
    pub private: bool,
}

impl Perms {
    /// Parses the 4-character permission field.
    fn parse(field: &str) -> Option<Self> {
        let &[r, w, x, p] = field.as_bytes() else {
            return None;
        };
        let flag = |byte: u8, set: u8| match byte {
            b'-' => Some(false),
            b if b == set => Some(true),
            _ => None,
        };
        Some(Self {
            read: flag(r, b'r')?,
            write: flag(w, b'w')?,
            execute: flag(x, b'x')?,
            private: match p {
                b'p' => true,
                b's' => false,
                _ => return None,
            },
        })
    }
}

/// One line of `/proc/PID/maps`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Mapping {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    pub perms: Perms,
    /// File offset of `start`.
    pub offset: u64,
    pub dev_major: u32,
    pub dev_minor: u32,
    pub inode: u64,
    /// As the kernel prints it, in the process's mount namespace: a file
    /// path (maybe ending in ` (deleted)`), a pseudo path (`[vdso]`,
    /// `[heap]`, `[anon:name]`, `/memfd:name (deleted)`), or `None` for
    /// plain anonymous memory.
    pub path: Option<String>,
}

impl Mapping {
    /// Executable code (`x` permission).
    pub fn is_executable(&self) -> bool {
        self.perms.execute
    }

    /// Memory not backed by a file on disk: no path, a named anonymous
    /// region (`[anon:...]`, `[anon_shmem:...]`), heap or stack, shared
    /// anonymous memory (`/dev/zero`, `//anon`, `/SYSV...`), or a memfd.
    /// .NET 7+ maps its JIT code through a memfd (`/memfd:doublemapper`) to
    /// keep W^X, so executable anonymous memory is where managed code lives.
    pub fn is_anonymous(&self) -> bool {
        let Some(path) = self.path.as_deref() else {
            return true;
        };
        path.starts_with("[anon:")
            || path.starts_with("[anon_shmem:")
            || path == "[heap]"
            || path.starts_with("[stack")
            || path.starts_with("//anon")
            || path.starts_with("/memfd:")
            || path.starts_with("/dev/zero")
            || path.starts_with("/SYSV")
    }

    /// A kernel-provided pseudo mapping: `[vdso]`, `[vvar]`, `[vsyscall]`, `[uprobes]`.
    pub fn is_special(&self) -> bool {
        self.path.as_deref().is_some_and(|p| p.starts_with('[')) && !self.is_anonymous()
    }

    /// The file was deleted or replaced after it was mapped.
    pub fn is_deleted(&self) -> bool {
        self.path
            .as_deref()
            .is_some_and(|p| p.ends_with(" (deleted)"))
    }

    /// The path of the backing file (in the process's mount namespace,
    /// without ` (deleted)`), or `None` for anonymous and pseudo mappings.
    pub fn file_path(&self) -> Option<&str> {
        if self.is_anonymous() || self.is_special() {
            return None;
        }
        let path = self.path.as_deref()?;
        Some(path.strip_suffix(" (deleted)").unwrap_or(path))
    }

    /// Whether `addr` lies in `[start, end)`.
    pub fn contains(&self, addr: u64) -> bool {
        self.start <= addr && addr < self.end
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// An empty range (never produced by the parser).
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Why one maps line was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MapsLineError {
    #[error("maps line has fewer than 5 fields")]
    MissingField,
    #[error("maps line has a bad address range")]
    BadRange,
    #[error("maps line has bad permissions")]
    BadPerms,
    #[error("maps line has a bad offset")]
    BadOffset,
    #[error("maps line has a bad device")]
    BadDevice,
    #[error("maps line has a bad inode")]
    BadInode,
}

/// Parses one line of `/proc/PID/maps`:
/// `start-end perms offset major:minor inode [path]`. The path is the rest
/// of the line after the inode and its padding, spaces included.
pub fn parse_maps_line(line: &str) -> Result<Mapping, MapsLineError> {
    let line = line.strip_suffix('\n').unwrap_or(line);
    let mut rest = line;
    let mut next_field = || -> Option<&str> {
        let trimmed = rest.trim_start_matches(' ');
        let end = trimmed.find(' ').unwrap_or(trimmed.len());
        let (field, after) = trimmed.split_at(end);
        rest = after;
        (!field.is_empty()).then_some(field)
    };
    let range = next_field().ok_or(MapsLineError::MissingField)?;
    let perms = next_field().ok_or(MapsLineError::MissingField)?;
    let offset = next_field().ok_or(MapsLineError::MissingField)?;
    let device = next_field().ok_or(MapsLineError::MissingField)?;
    let inode = next_field().ok_or(MapsLineError::MissingField)?;

    let (start, end) = range.split_once('-').ok_or(MapsLineError::BadRange)?;
    let start = parse_hex_u64(start).ok_or(MapsLineError::BadRange)?;
    let end = parse_hex_u64(end).ok_or(MapsLineError::BadRange)?;
    if end <= start {
        return Err(MapsLineError::BadRange);
    }
    let perms = Perms::parse(perms).ok_or(MapsLineError::BadPerms)?;
    let offset = parse_hex_u64(offset).ok_or(MapsLineError::BadOffset)?;
    let (major, minor) = device.split_once(':').ok_or(MapsLineError::BadDevice)?;
    let dev_major = parse_hex_u32(major).ok_or(MapsLineError::BadDevice)?;
    let dev_minor = parse_hex_u32(minor).ok_or(MapsLineError::BadDevice)?;
    if inode.is_empty() || !inode.bytes().all(|b| b.is_ascii_digit()) {
        return Err(MapsLineError::BadInode);
    }
    let inode = inode.parse().map_err(|_| MapsLineError::BadInode)?;
    let path = rest.trim_start_matches(' ');
    Ok(Mapping {
        start,
        end,
        perms,
        offset,
        dev_major,
        dev_minor,
        inode,
        path: (!path.is_empty()).then(|| path.to_string()),
    })
}

fn parse_hex_u64(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

fn parse_hex_u32(s: &str) -> Option<u32> {
    if s.is_empty() || s.len() > 8 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

/// Counts of what [`MappingTable::parse`] skipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapsParseStats {
    /// Lines that parsed.
    pub lines: u64,
    /// Lines that did not parse (including invalid UTF-8 outside the path).
    pub malformed: u64,
    /// Lines longer than the bound.
    pub overlong: u64,
    /// Mappings dropped because they overlap the previous one.
    pub overlapping: u64,
    /// The line-count bound was hit; later lines were not read.
    pub truncated: bool,
}

/// The mappings of one process, sorted by start address, non-overlapping,
/// with lookup by address.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MappingTable {
    mappings: Vec<Mapping>,
    stats: MapsParseStats,
}

impl MappingTable {
    /// Reads a maps file. Only I/O errors fail; bad lines are counted in
    /// [`MappingTable::stats`] and skipped.
    pub fn parse(mut reader: impl BufRead) -> io::Result<Self> {
        let mut stats = MapsParseStats::default();
        let mut mappings = Vec::new();
        let mut line = Vec::with_capacity(256);
        for _ in 0..MAX_LINES {
            line.clear();
            match read_bounded_line(&mut reader, &mut line)? {
                LineRead::Eof => {
                    return Ok(Self::from_parsed(mappings, stats));
                }
                LineRead::Overlong => stats.overlong += 1,
                LineRead::Line => {
                    if line.is_empty() {
                        continue;
                    }
                    // Paths may be any bytes; fields must be ASCII.
                    let text = String::from_utf8_lossy(&line);
                    match parse_maps_line(&text) {
                        Ok(mapping) => {
                            stats.lines += 1;
                            mappings.push(mapping);
                        }
                        Err(_) => stats.malformed += 1,
                    }
                }
            }
        }
        // Bound reached: keep what we have, say there was more.
        line.clear();
        stats.truncated = !matches!(read_bounded_line(&mut reader, &mut line)?, LineRead::Eof);
        Ok(Self::from_parsed(mappings, stats))
    }

    /// A table from mappings in any order; overlapping ones after the first
    /// are dropped and counted.
    pub fn from_mappings(mappings: Vec<Mapping>) -> Self {
        Self::from_parsed(mappings, MapsParseStats::default())
    }

    fn from_parsed(mut mappings: Vec<Mapping>, mut stats: MapsParseStats) -> Self {
        // The kernel writes them sorted; a fake or racy file may not.
        mappings.sort_by_key(|m| (m.start, m.end));
        let before = mappings.len();
        let mut last_end = 0u64;
        mappings.retain(|m| {
            let keep = m.start >= last_end;
            if keep {
                last_end = m.end;
            }
            keep
        });
        stats.overlapping += (before - mappings.len()) as u64;
        Self { mappings, stats }
    }

    /// The mapping containing `addr` (binary search).
    pub fn find(&self, addr: u64) -> Option<&Mapping> {
        // First mapping whose end is past addr; it holds addr if it starts at or before it.
        let index = self.mappings.partition_point(|m| m.end <= addr);
        self.mappings.get(index).filter(|m| m.contains(addr))
    }

    /// All mappings, sorted by start.
    pub fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }

    /// Iterates the mappings in address order.
    pub fn iter(&self) -> std::slice::Iter<'_, Mapping> {
        self.mappings.iter()
    }

    /// What the parser skipped.
    pub fn stats(&self) -> MapsParseStats {
        self.stats
    }

    pub fn len(&self) -> usize {
        self.mappings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mappings.is_empty()
    }
}

impl<'a> IntoIterator for &'a MappingTable {
    type Item = &'a Mapping;
    type IntoIter = std::slice::Iter<'a, Mapping>;

    fn into_iter(self) -> Self::IntoIter {
        self.mappings.iter()
    }
}

enum LineRead {
    Line,
    Overlong,
    Eof,
}

/// Reads one line into `line` (without the newline), holding at most
/// [`MAX_LINE_BYTES`]; a longer line is consumed and reported as overlong.
fn read_bounded_line(reader: &mut impl BufRead, line: &mut Vec<u8>) -> io::Result<LineRead> {
    let mut overlong = false;
    let mut read_any = false;
    loop {
        let available = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(match (read_any, overlong) {
                (false, _) => LineRead::Eof,
                (true, true) => LineRead::Overlong,
                (true, false) => LineRead::Line,
            });
        }
        read_any = true;
        let (chunk, found_newline) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (&available[..i], true),
            None => (available, false),
        };
        if !overlong {
            if line.len() + chunk.len() > MAX_LINE_BYTES {
                overlong = true;
                line.clear();
            } else {
                line.extend_from_slice(chunk);
            }
        }
        let consumed = chunk.len() + usize::from(found_newline);
        reader.consume(consumed);
        if found_newline {
            return Ok(if overlong {
                LineRead::Overlong
            } else {
                LineRead::Line
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c8a00000-55d0c8a08000 r--p 00000000 fe:00 1234                       /usr/share/dotnet/dotnet
55d0c8a08000-55d0c8a10000 r-xp 00008000 fe:00 1234                       /usr/share/dotnet/dotnet
55d0ca000000-55d0ca200000 rw-p 00000000 00:00 0                          [heap]
7f3684b50000-7f3684c50000 r-xp 00000000 00:01 4096                       /memfd:doublemapper (deleted)
7f3684c50000-7f3684c60000 rwxp 00000000 00:00 0 
7f3684c60000-7f3684c70000 rw-p 00000000 00:00 0                          [anon:dotnet-gc]
7f208e800000-7f208e8c7000 r--p 00000000 fe:00 5465371                    /usr/share/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so
7f208e8c7000-7f208eb00000 r-xp 000c7000 fe:00 5465371                    /opt/My App/lib (deleted)
7ffd1a3f0000-7ffd1a411000 rw-p 00000000 00:00 0                          [stack]
7ffd1a5e4000-7ffd1a5e6000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
";

    #[test]
    fn parses_a_real_looking_file() {
        let table = MappingTable::parse(MAPS.as_bytes()).expect("parse");
        assert_eq!(table.len(), 11);
        assert_eq!(table.stats().malformed, 0);
        let exe = table.find(0x55d0c8a08123).expect("exe text");
        assert_eq!(exe.path.as_deref(), Some("/usr/share/dotnet/dotnet"));
        assert!(exe.is_executable() && !exe.is_anonymous() && exe.perms.private);
        assert_eq!(
            (exe.offset, exe.dev_major, exe.dev_minor, exe.inode),
            (0x8000, 0xfe, 0, 1234)
        );

        let jit = table.find(0x7f3684b50000).expect("jit");
        assert!(jit.is_anonymous() && jit.is_executable() && jit.is_deleted());
        assert_eq!(jit.file_path(), None);

        let plain = table.find(0x7f3684c50000).expect("anon");
        assert_eq!(plain.path, None);
        assert!(plain.is_anonymous());
        assert!(plain.perms.write && plain.perms.execute);

        assert!(
            table
                .find(0x7f3684c60000)
                .expect("named anon")
                .is_anonymous()
        );
        assert!(table.find(0x55d0ca000000).expect("heap").is_anonymous());
        assert!(table.find(0x7ffd1a3f0000).expect("stack").is_anonymous());

        let deleted = table.find(0x7f208e8c7000).expect("deleted");
        assert_eq!(deleted.path.as_deref(), Some("/opt/My App/lib (deleted)"));
        assert_eq!(deleted.file_path(), Some("/opt/My App/lib"));

        let vdso = table.find(0x7ffd1a5e4000).expect("vdso");
        assert!(vdso.is_special() && !vdso.is_anonymous());
        assert_eq!(vdso.file_path(), None);
        assert!(table.find(0xffffffffff600fff).is_some());
    }

    #[test]
    fn lookup_edges() {
        let table = MappingTable::parse(MAPS.as_bytes()).expect("parse");
        assert!(table.find(0).is_none());
        // End is exclusive; the next mapping starts later.
        assert!(table.find(0x55d0c8a10000).is_none());
        assert_eq!(
            table.find(0x55d0c8a07fff).map(|m| m.start),
            Some(0x55d0c8a00000)
        );
        assert_eq!(
            table.find(0x55d0c8a08000).map(|m| m.start),
            Some(0x55d0c8a08000)
        );
        assert!(table.find(u64::MAX).is_none());
        assert!(MappingTable::default().find(1).is_none());
    }

    #[test]
    fn malformed_lines_are_counted_and_skipped() {
        let input = "\
garbage
1000-2000 r-xp 00000000 00:00 0 /ok
2000-1000 r-xp 00000000 00:00 0 /backwards
3000-4000 rwzp 00000000 00:00 0 /badperm
3000-4000 r-xp zz 00:00 0 /badoff
3000-4000 r-xp 0 0000 0 /baddev
3000-4000 r-xp 0 00:00 -1 /badinode
3000-4000 r-xp 0 00:00
10000000000000000-10000000000000001 r-xp 0 00:00 0
5000-6000 r--s 00000000 08:01 77 /shared
";
        let table = MappingTable::parse(input.as_bytes()).expect("parse");
        assert_eq!(table.len(), 2);
        assert_eq!(table.stats().malformed, 8);
        assert_eq!(table.stats().lines, 2);
        assert!(!table.find(0x5000).expect("shared").perms.private);
    }

    #[test]
    fn line_errors() {
        assert_eq!(parse_maps_line(""), Err(MapsLineError::MissingField));
        assert_eq!(
            parse_maps_line("1-2 r-xp 0 0:0"),
            Err(MapsLineError::MissingField)
        );
        assert_eq!(
            parse_maps_line("12 r-xp 0 0:0 0"),
            Err(MapsLineError::BadRange)
        );
        assert_eq!(
            parse_maps_line("1-2 r-x 0 0:0 0"),
            Err(MapsLineError::BadPerms)
        );
        assert_eq!(
            parse_maps_line("1-2 r-xp +0 0:0 0"),
            Err(MapsLineError::BadOffset)
        );
        assert_eq!(
            parse_maps_line("1-2 r-xp 0 0:g 0"),
            Err(MapsLineError::BadDevice)
        );
        assert_eq!(
            parse_maps_line("1-2 r-xp 0 0:0 1x"),
            Err(MapsLineError::BadInode)
        );
        let ok = parse_maps_line("1-2 ---p 0 0:0 0   /a b  \n").expect("parse");
        assert_eq!(ok.path.as_deref(), Some("/a b  "));
    }

    #[test]
    fn overlong_lines_are_skipped_not_fatal() {
        let long_path = "x".repeat(MAX_LINE_BYTES + 10);
        let input = format!(
            "1000-2000 r-xp 0 00:00 0 /{long_path}\n3000-4000 r-xp 0 00:00 0 /after\n5000-6000 r-xp 0 00:00 0 /{long_path}"
        );
        // A tiny buffer makes the reader see each line in many pieces.
        let reader = io::BufReader::with_capacity(7, input.as_bytes());
        let table = MappingTable::parse(reader).expect("parse");
        assert_eq!(table.stats().overlong, 2);
        assert_eq!(table.len(), 1);
        assert_eq!(
            table.find(0x3000).and_then(|m| m.path.as_deref()),
            Some("/after")
        );
    }

    #[test]
    fn last_line_without_newline_and_invalid_utf8_path() {
        let mut input = b"1000-2000 r-xp 0 00:00 0 /a\n3000-4000 r-xp 0 00:00 0 /\xff".to_vec();
        input.extend_from_slice(b"\n\n");
        let table = MappingTable::parse(input.as_slice()).expect("parse");
        assert_eq!(table.len(), 2);
        assert_eq!(
            table.find(0x3000).and_then(|m| m.path.as_deref()),
            Some("/\u{fffd}")
        );
    }

    #[test]
    fn unsorted_and_overlapping_input() {
        let input = "3000-4000 r-xp 0 00:00 0 /b\n1000-2000 r-xp 0 00:00 0 /a\n1800-2800 r-xp 0 00:00 0 /overlap\n";
        let table = MappingTable::parse(input.as_bytes()).expect("parse");
        assert_eq!(table.len(), 2);
        assert_eq!(table.stats().overlapping, 1);
        assert_eq!(
            table.find(0x1900).and_then(|m| m.path.as_deref()),
            Some("/a")
        );
        assert_eq!(
            table.find(0x3000).and_then(|m| m.path.as_deref()),
            Some("/b")
        );
        assert!(table.find(0x2900).is_none());
    }
}
