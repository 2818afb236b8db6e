//! `/proc/PID/maps`: the address space of a process, for symbolization
//! (which file and offset an instruction pointer falls in), for the unwinder
//! (which ranges are anonymous JIT code) and for .NET detection.
//!
//! The file is the kernel's, but its lines are the process's to multiply
//! (a page mapped 60,000 times is a 60,000-line file) and its paths are
//! chosen by the process (file names of up to 4 KiB, `[anon:...]` names set
//! with `prctl`). So every line is bounded in length, the bytes read of the
//! file are bounded ([`MapsLimits`]), paths are interned (one allocation per
//! distinct path), the mappings and path bytes kept per process are
//! bounded, and the tables of all processes share one pool of the memory
//! budget ([`crate::memory_budget::Pool::Mappings`]). What does not fit is
//! dropped and counted; a line that does not parse is counted and skipped
//! while the rest of the table is kept.

use std::{
    collections::HashSet,
    io::{self, BufRead},
    sync::Arc,
};

use crate::memory_budget::{self, Charge, Pool};

/// Lines longer than this are skipped: a path is at most `PATH_MAX` (4096)
/// bytes, which the kernel may escape (`\n` -> `\012`), plus ~75 bytes of fields.
const MAX_LINE_BYTES: usize = 4 * 4096 + 128;
/// Bounds on what one maps file may make its reader hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapsLimits {
    /// Bytes of the file read at most. A real process's file is well under
    /// a MiB (`vm.max_map_count` defaults to 65530 lines of ~100 bytes);
    /// the kernel takes tens of ms to write each 16 MiB of it.
    pub max_read_bytes: u64,
    /// Mappings kept at most.
    pub max_mappings: usize,
    /// Bytes of distinct paths kept at most.
    pub max_path_bytes: usize,
}

impl Default for MapsLimits {
    fn default() -> Self {
        Self {
            max_read_bytes: 16 << 20,
            max_mappings: 1 << 16,
            max_path_bytes: 1 << 20,
        }
    }
}

/// Heap bytes an interned path costs besides its text (the `Arc`'s counts
/// and the interner's slot).
const PATH_OVERHEAD_BYTES: usize = 32;

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
    /// plain anonymous memory. Interned: every mapping of one file in a
    /// table shares the allocation.
    pub path: Option<Arc<str>>,
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
    #[cfg(test)]
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
    let (mut mapping, path) = parse_line_parts(line)?;
    mapping.path = (!path.is_empty()).then(|| Arc::from(path));
    Ok(mapping)
}

/// A line's mapping without its path, and the path (empty for none).
fn parse_line_parts(line: &str) -> Result<(Mapping, &str), MapsLineError> {
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
    let mapping = Mapping {
        start,
        end,
        perms,
        offset,
        dev_major,
        dev_minor,
        inode,
        path: None,
    };
    Ok((mapping, path))
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
    /// Mappings that parsed but were not kept: past [`MapsLimits`] or the
    /// memory budget's pool of mapping tables.
    pub dropped: u64,
    /// The file was read only up to [`MapsLimits::max_read_bytes`]; later
    /// lines were not read.
    pub truncated: bool,
}

impl MapsParseStats {
    /// Something was left out for the memory budget.
    pub fn over_budget(&self) -> bool {
        self.truncated || self.dropped > 0
    }
}

/// The mappings of one process, sorted by start address, non-overlapping,
/// with lookup by address. Its bytes are charged to the memory budget's
/// pool of mapping tables while it lives.
#[derive(Debug, Clone)]
pub struct MappingTable {
    mappings: Vec<Mapping>,
    stats: MapsParseStats,
    charge: Charge,
}

impl Default for MappingTable {
    fn default() -> Self {
        Self {
            mappings: Vec::new(),
            stats: MapsParseStats::default(),
            charge: Charge::new(Pool::Mappings),
        }
    }
}

impl PartialEq for MappingTable {
    fn eq(&self, other: &Self) -> bool {
        self.mappings == other.mappings && self.stats == other.stats
    }
}

impl Eq for MappingTable {}

/// The distinct paths of one table being read, and what they may cost.
struct PathInterner {
    paths: HashSet<Arc<str>>,
    bytes: usize,
    max_bytes: usize,
}

impl PathInterner {
    /// The interned `path`, or `None` when a new one does not fit the
    /// table's bound or the pool (charged to `charge`).
    fn intern(&mut self, path: &str, charge: &mut Charge) -> Option<Arc<str>> {
        if let Some(known) = self.paths.get(path) {
            return Some(Arc::clone(known));
        }
        let cost = path.len() + PATH_OVERHEAD_BYTES;
        if self.bytes + cost > self.max_bytes || !charge.try_add(cost as u64) {
            return None;
        }
        self.bytes += cost;
        let path: Arc<str> = Arc::from(path);
        self.paths.insert(Arc::clone(&path));
        Some(path)
    }
}

impl MappingTable {
    /// Reads a maps file within the default [`MapsLimits`]. Only I/O
    /// errors fail; bad lines are counted in [`MappingTable::stats`] and
    /// skipped.
    pub fn parse(reader: impl BufRead) -> io::Result<Self> {
        Self::parse_with(reader, MapsLimits::default())
    }

    /// [`MappingTable::parse`] within `limits`.
    pub fn parse_with(mut reader: impl BufRead, limits: MapsLimits) -> io::Result<Self> {
        let mut stats = MapsParseStats::default();
        let mut charge = Charge::new(Pool::Mappings);
        let mut mappings = Vec::new();
        let mut paths = PathInterner {
            paths: HashSet::new(),
            bytes: 0,
            max_bytes: limits.max_path_bytes,
        };
        let mut line = Vec::with_capacity(256);
        let mut read_bytes = 0u64;
        loop {
            if read_bytes >= limits.max_read_bytes {
                // Bound reached: keep what we have, say there was more.
                line.clear();
                stats.truncated = !matches!(
                    read_bounded_line(&mut reader, &mut line, &mut 0)?,
                    LineRead::Eof
                );
                break;
            }
            line.clear();
            match read_bounded_line(&mut reader, &mut line, &mut read_bytes)? {
                LineRead::Eof => break,
                LineRead::Overlong => stats.overlong += 1,
                LineRead::Line => {
                    if line.is_empty() {
                        continue;
                    }
                    // Paths may be any bytes; fields must be ASCII.
                    let text = String::from_utf8_lossy(&line);
                    let Ok((mut mapping, path)) = parse_line_parts(&text) else {
                        stats.malformed += 1;
                        continue;
                    };
                    stats.lines += 1;
                    let fits = mappings.len() < limits.max_mappings
                        && charge.try_add(size_of::<Mapping>() as u64);
                    if !fits {
                        stats.dropped += 1;
                        continue;
                    }
                    if !path.is_empty() {
                        let Some(path) = paths.intern(path, &mut charge) else {
                            charge.release(size_of::<Mapping>() as u64);
                            stats.dropped += 1;
                            continue;
                        };
                        mapping.path = Some(path);
                    }
                    mappings.push(mapping);
                }
            }
        }
        mappings.shrink_to_fit();
        let drops = memory_budget::drops();
        memory_budget::Drops::count(&drops.mappings, stats.dropped);
        memory_budget::Drops::count(&drops.maps_files_truncated, u64::from(stats.truncated));
        Ok(Self::from_parsed(mappings, stats, charge))
    }

    fn from_parsed(mut mappings: Vec<Mapping>, mut stats: MapsParseStats, charge: Charge) -> Self {
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
        Self {
            mappings,
            stats,
            charge,
        }
    }

    /// Bytes charged to the memory budget for this table.
    pub fn memory_bytes(&self) -> u64 {
        self.charge.bytes()
    }

    /// Gives the table's bytes back to the pool while a newer table is
    /// read, so the two are not charged at once; returns them for
    /// [`Self::recharge`] if the table is kept after all.
    pub fn uncharge(&mut self) -> u64 {
        let bytes = self.charge.bytes();
        self.charge.release(bytes);
        bytes
    }

    /// Charges again what [`Self::uncharge`] gave back.
    pub fn recharge(&mut self, bytes: u64) {
        self.charge.add_admitted(bytes);
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
/// Adds the bytes consumed to `read_bytes`.
fn read_bounded_line(
    reader: &mut impl BufRead,
    line: &mut Vec<u8>,
    read_bytes: &mut u64,
) -> io::Result<LineRead> {
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
        *read_bytes += consumed as u64;
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

    /// One 2 KiB path mapped many times, as a hostile process can.
    fn repeated_maps(lines: usize, path: &str) -> String {
        (0..lines)
            .map(|i| {
                let start = 0x1000_0000 + i as u64 * 0x2000;
                format!(
                    "{start:x}-{:x} r--p 00000000 fe:00 7 {path}\n",
                    start + 0x1000
                )
            })
            .collect()
    }

    #[test]
    fn paths_are_interned() {
        let path = format!("/{}", "d/".repeat(1024));
        let table = MappingTable::parse(repeated_maps(1000, &path).as_bytes()).expect("parse");
        assert_eq!(table.len(), 1000);
        let first = table.mappings()[0].path.clone().expect("path");
        assert!(
            table
                .iter()
                .all(|m| m.path.as_ref().is_some_and(|p| Arc::ptr_eq(p, &first))),
            "one allocation for every mapping of the file"
        );
        // 1000 mappings and one path, not 1000 copies of it (2 MiB).
        assert!(
            table.memory_bytes() < 1000 * 80 + 4096,
            "{}",
            table.memory_bytes()
        );
    }

    #[test]
    fn mapping_count_and_path_bytes_are_capped_and_counted() {
        let limits = MapsLimits {
            max_mappings: 10,
            ..MapsLimits::default()
        };
        let table = MappingTable::parse_with(repeated_maps(25, "/lib/x.so").as_bytes(), limits)
            .expect("parse");
        assert_eq!(table.len(), 10);
        assert_eq!(table.stats().dropped, 15);
        assert!(table.stats().over_budget());

        // Distinct long paths: only as many as the path bound holds.
        let input: String = (0..20)
            .map(|i| {
                format!(
                    "{:x}-{:x} r-xp 0 fe:00 {i} /{i}{}\n",
                    0x1000 * (i + 1),
                    0x1000 * (i + 1) + 0x800,
                    "p".repeat(1000)
                )
            })
            .collect();
        let limits = MapsLimits {
            max_path_bytes: 5 * 1100,
            ..MapsLimits::default()
        };
        let table = MappingTable::parse_with(input.as_bytes(), limits).expect("parse");
        assert_eq!(table.len(), 5);
        assert_eq!(table.stats().dropped, 15);
    }

    #[test]
    fn bytes_read_are_capped_at_a_line_boundary() {
        let input = repeated_maps(100, "/lib/x.so");
        let line_len = input.find('\n').expect("a line") as u64 + 1;
        let limits = MapsLimits {
            max_read_bytes: line_len * 10 + 3,
            ..MapsLimits::default()
        };
        let table = MappingTable::parse_with(input.as_bytes(), limits).expect("parse");
        // The line that crossed the bound is read whole, then reading stops.
        assert_eq!(table.len(), 11);
        assert!(table.stats().truncated);
        assert!(table.iter().all(|m| m.path.as_deref() == Some("/lib/x.so")));
        let whole = MappingTable::parse_with(
            input.as_bytes(),
            MapsLimits {
                max_read_bytes: line_len * 100,
                ..MapsLimits::default()
            },
        )
        .expect("parse");
        assert_eq!((whole.len(), whole.stats().truncated), (100, false));
    }

    #[test]
    fn tables_give_their_bytes_back() {
        let input = repeated_maps(500, "/lib/y.so");
        let table = MappingTable::parse(input.as_bytes()).expect("parse");
        let charged = table.memory_bytes();
        assert!(charged >= 500 * size_of::<Mapping>() as u64);
        let mut copy = table.clone();
        assert_eq!(copy.memory_bytes(), charged);
        drop(table);
        assert_eq!(copy.memory_bytes(), charged);
        let given_back = copy.uncharge();
        assert_eq!((given_back, copy.memory_bytes()), (charged, 0));
        copy.recharge(given_back);
        assert_eq!(copy.memory_bytes(), charged);
    }
}
