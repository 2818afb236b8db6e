//! Where a native file's debug file may be, and how to tell it is the
//! right one: pure parsing of the bytes and names involved, no I/O (the
//! lookup itself is [`super::debug_lookup`]).
//!
//! - the ELF section headers, enough to find one section by name
//!   ([`find_section`]), over a bounded reader;
//! - `.gnu_debuglink` (a file name, padding to 4 bytes, a CRC32:
//!   [`parse_debuglink`]) and the GNU build-id note
//!   ([`parse_build_id_note`]);
//! - the paths gdb and `dotnet-symbol` use: [`debuglink_candidates`],
//!   [`build_id_path`] (`.build-id/xx/rest.debug`), [`symbol_store_keys`]
//!   (`libcoreclr.so.dbg/elf-buildid-sym-<id>/libcoreclr.so.dbg`, the key
//!   Microsoft's symbol server protocol and `dotnet-symbol` use), and the
//!   debuginfod path [`debuginfod_path`].
//!
//! Every input comes from a target's files: names are plain file names
//! (no `/`, no `..`), lengths are capped, nothing wraps.

use std::path::{Component, Path, PathBuf};

/// Longest `.gnu_debuglink` file name believed (a file name, as
/// `NAME_MAX`).
pub const MAX_DEBUGLINK_NAME: usize = 255;
/// Most section headers read from one file.
pub const MAX_SECTIONS: u64 = 4096;
/// Largest section-name table read.
pub const MAX_SECTION_NAMES_BYTES: u64 = 256 * 1024;
/// Largest section [`find_section`] returns (a debuglink or a build-id
/// note is tens of bytes).
pub const MAX_SMALL_SECTION_BYTES: u64 = 4096;
/// Longest build id believed, in bytes (GNU ld writes 20; some tools 16
/// or 8).
pub const MAX_BUILD_ID_BYTES: usize = 64;
/// Directory of the distributions' debug files.
pub const USR_LIB_DEBUG: &str = "/usr/lib/debug";

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DebugFileError {
    #[error("not a 64-bit little-endian ELF file")]
    NotElf64,
    #[error("ELF section headers out of bounds ({count} of {entry_size} bytes)")]
    SectionHeaders { count: u64, entry_size: u64 },
    #[error("ELF section {index} lies outside the file or over its bound")]
    Section { index: u64 },
    #[error("short read of the ELF file at {offset}")]
    ShortRead { offset: u64 },
    #[error(".gnu_debuglink is malformed")]
    Debuglink,
    #[error("build-id note is malformed")]
    BuildIdNote,
}

/// Reads `len` bytes at `offset` of a file, or `None` past its end.
pub trait ReadAt {
    fn read_at(&mut self, offset: u64, len: usize) -> Option<Vec<u8>>;
}

impl ReadAt for &[u8] {
    fn read_at(&mut self, offset: u64, len: usize) -> Option<Vec<u8>> {
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(len)?;
        self.get(start..end).map(<[u8]>::to_vec)
    }
}

fn u16_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 2)
        .map_or(0, |s| u64::from(u16::from_le_bytes([s[0], s[1]])))
}

fn u32_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 4).map_or(0, |s| {
        u64::from(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    })
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |s| {
        u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]])
    })
}

fn read(reader: &mut impl ReadAt, offset: u64, len: u64) -> Result<Vec<u8>, DebugFileError> {
    let len = usize::try_from(len).map_err(|_| DebugFileError::ShortRead { offset })?;
    reader
        .read_at(offset, len)
        .ok_or(DebugFileError::ShortRead { offset })
}

/// The bytes of the section named `name` of a 64-bit little-endian ELF
/// file (`None`: no such section, or one without bytes in the file, as in
/// a debug file's `SHT_NOBITS` copies). Reads the header, at most
/// [`MAX_SECTIONS`] section headers, the name table (at most
/// [`MAX_SECTION_NAMES_BYTES`]) and the section (at most
/// [`MAX_SMALL_SECTION_BYTES`]).
pub fn find_section(
    reader: &mut impl ReadAt,
    name: &[u8],
) -> Result<Option<Vec<u8>>, DebugFileError> {
    const SHT_NOBITS: u64 = 8;
    let header = read(reader, 0, 64).map_err(|_| DebugFileError::NotElf64)?;
    // Magic, ELFCLASS64, ELFDATA2LSB.
    if header.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return Err(DebugFileError::NotElf64);
    }
    let shoff = u64_at(&header, 0x28);
    let entry_size = u16_at(&header, 0x3a);
    let count = u16_at(&header, 0x3c);
    let names_index = u16_at(&header, 0x3e);
    if count == 0 || shoff == 0 {
        return Ok(None);
    }
    if count > MAX_SECTIONS || entry_size < 64 || names_index >= count {
        return Err(DebugFileError::SectionHeaders { count, entry_size });
    }
    let table = read(reader, shoff, count * entry_size)?;
    let section = |index: u64| {
        let at = usize::try_from(index * entry_size).unwrap_or(usize::MAX);
        (
            u32_at(&table, at),        // sh_name
            u32_at(&table, at + 4),    // sh_type
            u64_at(&table, at + 0x18), // sh_offset
            u64_at(&table, at + 0x20), // sh_size
        )
    };
    let (_, _, names_offset, names_size) = section(names_index);
    if names_size > MAX_SECTION_NAMES_BYTES {
        return Err(DebugFileError::Section { index: names_index });
    }
    let names = read(reader, names_offset, names_size)?;
    for index in 0..count {
        let (name_at, kind, offset, size) = section(index);
        let Some(found) = usize::try_from(name_at).ok().and_then(|at| names.get(at..)) else {
            continue;
        };
        let end = found.iter().position(|&b| b == 0).unwrap_or(found.len());
        if &found[..end] != name {
            continue;
        }
        if kind == SHT_NOBITS {
            return Ok(None);
        }
        if size > MAX_SMALL_SECTION_BYTES {
            return Err(DebugFileError::Section { index });
        }
        return read(reader, offset, size).map(Some);
    }
    Ok(None)
}

/// Most program headers read from one file.
pub const MAX_PROGRAM_HEADERS: u64 = 256;

/// A `PT_LOAD` segment: file bytes `offset..offset + file_size` are at
/// `vaddr` in the file's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSegment {
    pub offset: u64,
    pub vaddr: u64,
    pub file_size: u64,
}

/// The `PT_LOAD` segments of a 64-bit little-endian ELF file (at most
/// [`MAX_PROGRAM_HEADERS`] headers read).
pub fn load_segments(reader: &mut impl ReadAt) -> Result<Vec<LoadSegment>, DebugFileError> {
    const PT_LOAD: u64 = 1;
    let header = read(reader, 0, 64).map_err(|_| DebugFileError::NotElf64)?;
    if header.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return Err(DebugFileError::NotElf64);
    }
    let phoff = u64_at(&header, 0x20);
    let entry_size = u16_at(&header, 0x36);
    let count = u16_at(&header, 0x38);
    if count > MAX_PROGRAM_HEADERS || (count > 0 && entry_size < 56) {
        return Err(DebugFileError::SectionHeaders { count, entry_size });
    }
    let table = read(reader, phoff, count * entry_size)?;
    Ok((0..count)
        .filter_map(|index| {
            let at = usize::try_from(index * entry_size).ok()?;
            (u32_at(&table, at) == PT_LOAD).then(|| LoadSegment {
                offset: u64_at(&table, at + 8),
                vaddr: u64_at(&table, at + 0x10),
                file_size: u64_at(&table, at + 0x20),
            })
        })
        .collect())
}

/// The virtual offset (the address in the file's own address space, as
/// its debug file has it) of file offset `offset`, through the segment
/// holding it.
pub fn virtual_offset(segments: &[LoadSegment], offset: u64) -> Option<u64> {
    segments.iter().find_map(|s| {
        let into = offset.checked_sub(s.offset)?;
        (into < s.file_size).then(|| s.vaddr.checked_add(into))?
    })
}

/// What `.gnu_debuglink` says: the debug file's name and its CRC32.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebugLink {
    pub name: String,
    pub crc: u32,
}

/// A plain file name: no directory, not `.` or `..`, not empty, at most
/// [`MAX_DEBUGLINK_NAME`] bytes.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_DEBUGLINK_NAME
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
}

/// Parses a `.gnu_debuglink` section: a NUL-terminated file name, zero
/// padding to a multiple of 4, a little-endian CRC32.
pub fn parse_debuglink(section: &[u8]) -> Result<DebugLink, DebugFileError> {
    let end = section
        .iter()
        .position(|&b| b == 0)
        .ok_or(DebugFileError::Debuglink)?;
    let name = std::str::from_utf8(&section[..end]).map_err(|_| DebugFileError::Debuglink)?;
    if !is_plain_file_name(name) {
        return Err(DebugFileError::Debuglink);
    }
    let crc_at = (end + 1).next_multiple_of(4);
    let crc = section
        .get(crc_at..crc_at + 4)
        .ok_or(DebugFileError::Debuglink)?;
    Ok(DebugLink {
        name: name.to_owned(),
        crc: u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]),
    })
}

/// The build id in a `.note.gnu.build-id` section (one `NT_GNU_BUILD_ID`
/// note named `GNU`), as lower-case hex.
pub fn parse_build_id_note(section: &[u8]) -> Result<String, DebugFileError> {
    const NT_GNU_BUILD_ID: u64 = 3;
    let name_size = u32_at(section, 0);
    let desc_size = u32_at(section, 4);
    if section.len() < 12 || u32_at(section, 8) != NT_GNU_BUILD_ID || name_size != 4 {
        return Err(DebugFileError::BuildIdNote);
    }
    if section.get(12..16) != Some(b"GNU\0".as_slice()) {
        return Err(DebugFileError::BuildIdNote);
    }
    let desc_size = usize::try_from(desc_size).map_err(|_| DebugFileError::BuildIdNote)?;
    if !(2..=MAX_BUILD_ID_BYTES).contains(&desc_size) {
        return Err(DebugFileError::BuildIdNote);
    }
    let id = section
        .get(16..16 + desc_size)
        .ok_or(DebugFileError::BuildIdNote)?;
    Ok(id.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `id` is a build id as clrbpf writes it: lower-case hex, an
/// even number of digits, at least 2 bytes and at most
/// [`MAX_BUILD_ID_BYTES`].
pub fn is_build_id(id: &str) -> bool {
    id.len() >= 4
        && id.len() <= 2 * MAX_BUILD_ID_BYTES
        && id.len().is_multiple_of(2)
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `.build-id/xx/rest.debug` for build id `id`, relative to a debug
/// directory (`/usr/lib/debug` or a `--debug-dir`).
pub fn build_id_path(id: &str) -> Option<PathBuf> {
    if !is_build_id(id) {
        return None;
    }
    let (head, rest) = id.split_at(2);
    Some(PathBuf::from(format!(".build-id/{head}/{rest}.debug")))
}

/// Where gdb looks for the debug file `link` of the file at `path` (an
/// absolute path as the process sees it): beside it, in `.debug/` beside
/// it, and under [`USR_LIB_DEBUG`] at the file's directory. `None` when the
/// path is not absolute or climbs (`..`): a target's paths are its own to
/// choose.
pub fn debuglink_candidates(path: &str, link: &str) -> Option<[PathBuf; 3]> {
    let path = Path::new(path);
    if !is_plain_file_name(link)
        || !path.is_absolute()
        || path
            .components()
            .any(|c| !matches!(c, Component::RootDir | Component::Normal(_)))
    {
        return None;
    }
    let dir = path.parent()?;
    let relative = dir.strip_prefix("/").ok()?;
    Some([
        dir.join(link),
        dir.join(".debug").join(link),
        Path::new(USR_LIB_DEBUG).join(relative).join(link),
    ])
}

/// The symbol-store keys (relative paths) of the debug file of `file_name`
/// with build id `id`, most specific first:
/// `<file>.dbg/elf-buildid-sym-<id>/<file>.dbg` (what `dotnet-symbol`
/// writes and Microsoft's server serves for the runtime) and the generic
/// `_.debug/elf-buildid-sym-<id>/_.debug`.
pub fn symbol_store_keys(file_name: &str, id: &str) -> Option<[String; 2]> {
    if !is_build_id(id) || !is_plain_file_name(file_name) || file_name.len() > 200 {
        return None;
    }
    let dbg = format!("{file_name}.dbg");
    Some([
        format!("{dbg}/elf-buildid-sym-{id}/{dbg}"),
        format!("_.debug/elf-buildid-sym-{id}/_.debug"),
    ])
}

/// The debuginfod path of build id `id`'s debug file, after a server's
/// base URL.
pub fn debuginfod_path(id: &str) -> Option<String> {
    is_build_id(id).then(|| format!("buildid/{id}/debuginfo"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debuglink_sections_parse_and_hostile_names_do_not() {
        let mut section = b"libx.so.dbg\0".to_vec();
        section.extend_from_slice(&0xdead_beef_u32.to_le_bytes());
        assert_eq!(
            parse_debuglink(&section),
            Ok(DebugLink {
                name: "libx.so.dbg".into(),
                crc: 0xdead_beef
            })
        );
        // Padding to 4: a 2-byte name and its NUL take 3, the CRC is at 4.
        let padded = [b'a', b'b', 0, 0, 1, 0, 0, 0];
        assert_eq!(parse_debuglink(&padded).map(|l| l.crc), Ok(1));
        for bad in [
            &b"../../etc/shadow\0\0\0\0\0\0\0\0"[..],
            b"a/b\0\0\0\0\0",
            b"..\0\0\0\0\0\0",
            b"\0\0\0\0\0\0\0\0",
            b"no-nul",
            b"short\0\0\0\x01",
        ] {
            assert_eq!(
                parse_debuglink(bad),
                Err(DebugFileError::Debuglink),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn build_id_notes_parse() {
        let mut note = Vec::new();
        note.extend_from_slice(&4u32.to_le_bytes());
        note.extend_from_slice(&4u32.to_le_bytes());
        note.extend_from_slice(&3u32.to_le_bytes());
        note.extend_from_slice(b"GNU\0");
        note.extend_from_slice(&[0xab, 0xcd, 0x01, 0x23]);
        assert_eq!(parse_build_id_note(&note).as_deref(), Ok("abcd0123"));
        note[4] = 200;
        assert!(
            parse_build_id_note(&note).is_err(),
            "longer than the section"
        );
        assert!(parse_build_id_note(&[]).is_err());
    }

    #[test]
    fn paths_follow_gdb_and_the_symbol_store() {
        assert_eq!(
            build_id_path("abcdef0123").as_deref(),
            Some(Path::new(".build-id/ab/cdef0123.debug"))
        );
        assert_eq!(build_id_path("../x"), None);
        assert_eq!(build_id_path("ABCD"), None, "upper case is never written");
        let [beside, dot_debug, usr] =
            debuglink_candidates("/opt/app/libx.so", "libx.so.dbg").expect("candidates");
        assert_eq!(beside, Path::new("/opt/app/libx.so.dbg"));
        assert_eq!(dot_debug, Path::new("/opt/app/.debug/libx.so.dbg"));
        assert_eq!(usr, Path::new("/usr/lib/debug/opt/app/libx.so.dbg"));
        assert_eq!(debuglink_candidates("/opt/../etc/libx.so", "x"), None);
        assert_eq!(debuglink_candidates("relative/libx.so", "x"), None);
        assert_eq!(
            symbol_store_keys("libcoreclr.so", "ab12").expect("keys"),
            [
                "libcoreclr.so.dbg/elf-buildid-sym-ab12/libcoreclr.so.dbg".to_owned(),
                "_.debug/elf-buildid-sym-ab12/_.debug".to_owned()
            ]
        );
        assert_eq!(symbol_store_keys("a/b", "ab12"), None);
        assert_eq!(
            debuginfod_path("ab12").as_deref(),
            Some("buildid/ab12/debuginfo")
        );
    }

    #[test]
    fn sections_are_found_in_this_test_binary() {
        let exe = std::fs::read("/proc/self/exe").expect("read own binary");
        let note = find_section(&mut exe.as_slice(), b".note.gnu.build-id")
            .expect("parse")
            .expect("a build-id note");
        let id = parse_build_id_note(&note).expect("a build id");
        assert!(is_build_id(&id), "{id}");
        assert_eq!(find_section(&mut exe.as_slice(), b".no-such"), Ok(None));
        let segments = load_segments(&mut exe.as_slice()).expect("program headers");
        let first = segments.first().expect("a PT_LOAD segment");
        assert_eq!(virtual_offset(&segments, first.offset), Some(first.vaddr));
        assert_eq!(virtual_offset(&segments, u64::MAX), None);
        assert_eq!(
            find_section(&mut &b"\x7fELF\x01\x01"[..], b"x"),
            Err(DebugFileError::NotElf64)
        );
    }
}
