//! What the memory walk ([`super`]) needs from the `libcoreclr.so` file
//! itself: the addresses of `g_dacTable` (the table of the runtime's
//! globals the debugger uses) and of `DotNetRuntimeContractDescriptor`
//! (.NET 9+), both exported dynamic symbols, the program headers that turn
//! them into addresses in the process, and the version the runtime was
//! built as (its `@(#)Version` string) for self-contained apps whose path
//! tells none.
//!
//! The file is the one mapped ([`crate::process::mapped_file`]) and
//! hostile like any other input: a `libcoreclr.so` can claim a 4 GiB
//! `.dynsym` in a 12 KiB sparse file. So it is read through [`ReadAt`]
//! with bounded reads only, never parsed whole: the ELF header, at most
//! [`MAX_PROGRAM_HEADERS`] program and [`MAX_SECTIONS`] section headers,
//! the section names, `.dynsym` and its string table (each refused over
//! [`MAX_DYNSYM`] / [`MAX_STRINGS`]; the real ones are 8 KiB and 4 KiB),
//! and `.rodata` in [`CHUNK`]-sized pieces up to [`MAX_RODATA`]. A range
//! beyond the file's end or over a hole (`SEEK_HOLE`: a sparse file) is
//! refused with [`RuntimeImageError`] and counted ([`refused_images`]).
//! At most [`MAX_STRINGS`] plus one [`CHUNK`] are held at once.

use std::{
    fs::File,
    io,
    os::{fd::AsRawFd, unix::fs::FileExt},
    sync::atomic::{AtomicU64, Ordering},
};

/// `.rodata` longer than this is scanned this far for the version.
const MAX_RODATA: u64 = 32 * 1024 * 1024;
/// The dynamic symbol table is refused over this (the real one is 8 KiB).
pub const MAX_DYNSYM: u64 = 4 * 1024 * 1024;
/// A string table (dynamic or section names) is refused over this.
pub const MAX_STRINGS: u64 = 4 * 1024 * 1024;
/// Program headers read (a real library has about ten).
pub const MAX_PROGRAM_HEADERS: u64 = 64;
/// Section headers read (the real `libcoreclr.so` has about forty).
pub const MAX_SECTIONS: u64 = 1024;
/// Bytes read at once from `.dynsym` and `.rodata`.
pub const CHUNK: usize = 256 * 1024;
const VERSION_MARKER: &[u8] = b"@(#)Version ";

const PT_LOAD: u32 = 1;
const SHT_DYNSYM: u32 = 11;
const EHDR_SIZE: usize = 64;
const PHDR_SIZE: u64 = 56;
const SHDR_SIZE: u64 = 64;
const SYM_SIZE: u64 = 24;

static REFUSED: AtomicU64 = AtomicU64::new(0);

/// `libcoreclr.so` files refused as hostile (a table over its cap, a range
/// past the file's end or over a hole), since start.
pub fn refused_images() -> u64 {
    REFUSED.load(Ordering::Relaxed)
}

/// Where a runtime's globals are, from its `libcoreclr.so`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeImage {
    /// Link-time address of `g_dacTable`.
    pub dac_table: u64,
    /// Link-time address of `DotNetRuntimeContractDescriptor` (9+).
    pub contract_descriptor: Option<u64>,
    /// `(file offset, virtual address, file size)` of each `PT_LOAD`.
    pub segments: Vec<(u64, u64, u64)>,
    /// The file version (`8.0.424.16909`; .NET Core 3.x says `4.700...`).
    pub file_version: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeImageError {
    #[error("libcoreclr.so is not a 64-bit little-endian ELF file")]
    NotElf,
    #[error("libcoreclr.so's {what} ({size} bytes at {offset}) is past the end of the file")]
    PastEnd {
        what: &'static str,
        offset: u64,
        size: u64,
    },
    #[error("libcoreclr.so's {what} claims {size} bytes, over the cap of {cap} (refused)")]
    TooLarge {
        what: &'static str,
        size: u64,
        cap: u64,
    },
    #[error("libcoreclr.so's {what} is over a hole of a sparse file (refused)")]
    Sparse { what: &'static str },
    #[error("libcoreclr.so has no dynamic symbol table")]
    NoDynsym,
    #[error("cannot read libcoreclr.so: {0}")]
    Io(#[from] io::Error),
    #[error("libcoreclr.so exports no g_dacTable (.NET Core 3.x and .NET 5 do not)")]
    NoDacTable,
}

impl RuntimeImageError {
    /// Whether the file is refused as built to cost us (counted), rather
    /// than only unreadable.
    fn is_hostile(&self) -> bool {
        matches!(
            self,
            Self::PastEnd { .. } | Self::TooLarge { .. } | Self::Sparse { .. }
        )
    }
}

/// Bounded positioned reads of a target's file.
pub trait ReadAt {
    /// The file's size.
    fn size(&self) -> io::Result<u64>;
    /// Fills `buf` from `offset`.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Whether `offset..offset + len` (inside the file) has a hole.
    fn has_hole(&self, offset: u64, len: u64) -> bool;
}

impl ReadAt for File {
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }

    fn has_hole(&self, offset: u64, len: u64) -> bool {
        let Ok(at) = libc::off_t::try_from(offset) else {
            return true;
        };
        // SAFETY: lseek on an fd we own; only its offset changes, which
        // positioned reads do not use.
        let hole = unsafe { libc::lseek(self.as_raw_fd(), at, libc::SEEK_HOLE) };
        // -1: no SEEK_HOLE here (or an error): holes cannot be told.
        u64::try_from(hole).is_ok_and(|hole| hole < offset.saturating_add(len))
    }
}

impl ReadAt for [u8] {
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let end = start
            .checked_add(buf.len())
            .filter(|&end| end <= self.len())
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(&self[start..end]);
        Ok(())
    }

    fn has_hole(&self, _: u64, _: u64) -> bool {
        false
    }
}

/// A [`ReadAt`] whose every read is checked against the file's size, a
/// cap, and its holes.
struct Bounded<'a, R: ReadAt + ?Sized> {
    file: &'a R,
    size: u64,
}

impl<R: ReadAt + ?Sized> Bounded<'_, R> {
    /// `size` bytes at `offset`, if within the file, `cap` and no hole.
    fn read(
        &self,
        what: &'static str,
        offset: u64,
        size: u64,
        cap: u64,
    ) -> Result<Vec<u8>, RuntimeImageError> {
        if size > cap {
            return Err(RuntimeImageError::TooLarge { what, size, cap });
        }
        self.check(what, offset, size)?;
        let mut buf = vec![0; usize::try_from(size).map_err(|_| RuntimeImageError::NotElf)?];
        self.file.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    }

    fn check(&self, what: &'static str, offset: u64, size: u64) -> Result<(), RuntimeImageError> {
        if offset.checked_add(size).is_none_or(|end| end > self.size) {
            return Err(RuntimeImageError::PastEnd { what, offset, size });
        }
        if size > 0 && self.file.has_hole(offset, size) {
            return Err(RuntimeImageError::Sparse { what });
        }
        Ok(())
    }
}

/// One section header: what the reader needs of it.
#[derive(Clone, Copy, Debug)]
struct Section {
    name: u32,
    kind: u32,
    offset: u64,
    size: u64,
    link: u32,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl RuntimeImage {
    /// Reads the image from bytes in memory (tests, fuzzing).
    pub fn parse(data: &[u8]) -> Result<Self, RuntimeImageError> {
        Self::read(data)
    }

    /// Reads the image from `file` with bounded reads; see the module doc.
    /// A hostile file is refused and counted ([`refused_images`]).
    pub fn read<R: ReadAt + ?Sized>(file: &R) -> Result<Self, RuntimeImageError> {
        let result = Self::read_bounded(&Bounded {
            file,
            size: file.size()?,
        });
        if result.as_ref().is_err_and(RuntimeImageError::is_hostile) {
            REFUSED.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn read_bounded<R: ReadAt + ?Sized>(file: &Bounded<'_, R>) -> Result<Self, RuntimeImageError> {
        let header = file
            .read("ELF header", 0, EHDR_SIZE as u64, EHDR_SIZE as u64)
            .map_err(|_| RuntimeImageError::NotElf)?;
        // 64-bit (class 2), little-endian (data 1).
        if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 {
            return Err(RuntimeImageError::NotElf);
        }
        let segments = read_segments(file, &header)?;
        let sections = read_sections(file, &header)?;
        let (dac_table, contract_descriptor) = read_exports(file, &sections)?;
        let file_version = read_version(file, &header, &sections)?;
        Ok(Self {
            dac_table: dac_table.ok_or(RuntimeImageError::NoDacTable)?,
            contract_descriptor,
            segments,
            file_version,
        })
    }

    /// The load bias of the image in a process, from one of its mappings:
    /// the mapping at `start` maps file offset `offset`.
    pub fn load_bias(&self, start: u64, offset: u64) -> Option<u64> {
        let &(seg_offset, seg_vaddr, _) = self
            .segments
            .iter()
            .find(|&&(o, _, size)| o <= offset && offset < o.saturating_add(size.max(1)))?;
        let vaddr = seg_vaddr.checked_add(offset - seg_offset)?;
        start.checked_sub(vaddr)
    }

    /// The major .NET version the file version stands for (`8.0.424` -> 8;
    /// .NET Core 3.x's `4.700` -> 3).
    pub fn major(&self) -> Option<u32> {
        let version = self.file_version.as_deref()?;
        let major: u32 = version.split('.').next()?.parse().ok()?;
        Some(if major == 4 { 3 } else { major })
    }
}

/// An ELF header table (program or section headers) given by the ELF
/// header's `(offset, entry size, count)`: entries of `size` bytes, at most
/// `max` of them.
fn read_header_table<R: ReadAt + ?Sized>(
    file: &Bounded<'_, R>,
    what: &'static str,
    (offset, entry, count): (u64, u16, u16),
    size: u64,
    max: u64,
) -> Result<Vec<u8>, RuntimeImageError> {
    let count = u64::from(count);
    if u64::from(entry) != size {
        return Err(RuntimeImageError::NotElf);
    }
    if count > max {
        return Err(RuntimeImageError::TooLarge {
            what,
            size: count * size,
            cap: max * size,
        });
    }
    file.read(what, offset, count * size, u64::MAX)
}

/// `(file offset, virtual address, file size)` of each `PT_LOAD`.
fn read_segments<R: ReadAt + ?Sized>(
    file: &Bounded<'_, R>,
    header: &[u8],
) -> Result<Vec<(u64, u64, u64)>, RuntimeImageError> {
    let (offset, entry, count) = (u64_at(header, 32), u16_at(header, 54), u16_at(header, 56));
    let table = read_header_table(
        file,
        "program header table",
        (offset, entry, count),
        PHDR_SIZE,
        MAX_PROGRAM_HEADERS,
    )?;
    Ok(table
        .chunks_exact(PHDR_SIZE as usize)
        .filter(|p| u32_at(p, 0) == PT_LOAD)
        .map(|p| (u64_at(p, 8), u64_at(p, 16), u64_at(p, 32)))
        .collect())
}

fn read_sections<R: ReadAt + ?Sized>(
    file: &Bounded<'_, R>,
    header: &[u8],
) -> Result<Vec<Section>, RuntimeImageError> {
    let (offset, entry, count) = (u64_at(header, 40), u16_at(header, 58), u16_at(header, 60));
    if count == 0 {
        return Err(RuntimeImageError::NoDynsym);
    }
    let table = read_header_table(
        file,
        "section header table",
        (offset, entry, count),
        SHDR_SIZE,
        MAX_SECTIONS,
    )?;
    Ok(table
        .chunks_exact(SHDR_SIZE as usize)
        .map(|h| Section {
            name: u32_at(h, 0),
            kind: u32_at(h, 4),
            offset: u64_at(h, 24),
            size: u64_at(h, 32),
            link: u32_at(h, 40),
        })
        .collect())
}

/// The addresses of `g_dacTable` and `DotNetRuntimeContractDescriptor`
/// (0 is none), from `.dynsym` read [`CHUNK`] by [`CHUNK`].
fn read_exports<R: ReadAt + ?Sized>(
    file: &Bounded<'_, R>,
    sections: &[Section],
) -> Result<(Option<u64>, Option<u64>), RuntimeImageError> {
    let dynsym = sections
        .iter()
        .find(|s| s.kind == SHT_DYNSYM)
        .ok_or(RuntimeImageError::NoDynsym)?;
    let strings = usize::try_from(dynsym.link)
        .ok()
        .and_then(|i| sections.get(i))
        .ok_or(RuntimeImageError::NoDynsym)?;
    if dynsym.size > MAX_DYNSYM {
        return Err(RuntimeImageError::TooLarge {
            what: ".dynsym",
            size: dynsym.size,
            cap: MAX_DYNSYM,
        });
    }
    file.check(".dynsym", dynsym.offset, dynsym.size)?;
    let strings = file.read(".dynstr", strings.offset, strings.size, MAX_STRINGS)?;
    let name_is = |at: u32, wanted: &[u8]| {
        let at = at as usize;
        strings
            .get(at..at.saturating_add(wanted.len() + 1))
            .is_some_and(|n| n[..wanted.len()] == *wanted && n[wanted.len()] == 0)
    };
    let (mut dac_table, mut descriptor) = (None, None);
    let chunk = (CHUNK as u64 / SYM_SIZE) * SYM_SIZE;
    let mut at = 0;
    while at + SYM_SIZE <= dynsym.size {
        let len = chunk.min((dynsym.size - at) / SYM_SIZE * SYM_SIZE);
        let symbols = file.read(".dynsym", dynsym.offset + at, len, MAX_DYNSYM)?;
        for sym in symbols.chunks_exact(SYM_SIZE as usize) {
            let (name, value) = (u32_at(sym, 0), u64_at(sym, 8));
            if value == 0 {
                continue;
            }
            if name_is(name, b"g_dacTable") {
                dac_table = Some(value);
            } else if name_is(name, b"DotNetRuntimeContractDescriptor") {
                descriptor = Some(value);
            }
        }
        at += len;
    }
    Ok((dac_table, descriptor))
}

/// The version string in `.rodata`, scanned [`CHUNK`] by [`CHUNK`] (each
/// piece overlapping the last by a version's length) up to [`MAX_RODATA`].
fn read_version<R: ReadAt + ?Sized>(
    file: &Bounded<'_, R>,
    header: &[u8],
    sections: &[Section],
) -> Result<Option<String>, RuntimeImageError> {
    let names = usize::from(u16_at(header, 62));
    let Some(names) = sections.get(names) else {
        return Ok(None);
    };
    let names = file.read("section names", names.offset, names.size, MAX_STRINGS)?;
    let rodata = sections.iter().find(|s| {
        let at = s.name as usize;
        names
            .get(at..at.saturating_add(8))
            .is_some_and(|n| n == b".rodata\0")
    });
    let Some(rodata) = rodata else {
        return Ok(None);
    };
    let size = rodata.size.min(MAX_RODATA);
    let overlap = (VERSION_MARKER.len() + 64) as u64;
    let mut at = 0;
    while at < size {
        let len = (CHUNK as u64).min(size - at);
        let piece = file.read(".rodata", rodata.offset + at, len, CHUNK as u64)?;
        let last = at + len >= size;
        // A marker in the overlap is found whole by the next piece.
        if let Some((found, version)) = find_version(&piece)
            && (last || (found as u64) < len - overlap)
        {
            return Ok(Some(version));
        }
        if last {
            break;
        }
        at += len.saturating_sub(overlap).max(1);
    }
    Ok(None)
}

/// Where the version marker is in `rodata`, and the version after it:
/// `8.0.424.16909` from `...@(#)Version 8.0.424.16909 @Commit: ...`.
fn find_version(rodata: &[u8]) -> Option<(usize, String)> {
    let at = rodata
        .windows(VERSION_MARKER.len())
        .position(|w| w == VERSION_MARKER)?;
    let rest = &rodata[at + VERSION_MARKER.len()..];
    let end = rest
        .iter()
        .take(64)
        .position(|&b| !(b.is_ascii_digit() || b == b'.'))
        .unwrap_or(rest.len().min(64));
    (end > 0).then(|| (at, String::from_utf8_lossy(&rest[..end]).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version_string(rodata: &[u8]) -> Option<String> {
        find_version(rodata).map(|(_, version)| version)
    }

    /// A minimal `libcoreclr.so`: ELF header, one `PT_LOAD`, sections
    /// null, `.dynsym`, `.dynstr`, `.shstrtab`, `.rodata` (at `rodata_at`),
    /// with `.dynsym`'s size as given (its real one is two symbols).
    fn elf(dynsym_size: Option<u64>, rodata_at: usize) -> Vec<u8> {
        let dynstr = b"\0g_dacTable\0DotNetRuntimeContractDescriptor\0";
        let shstrtab = b"\0.dynsym\0.dynstr\0.shstrtab\0.rodata\0";
        let mut rodata = vec![0u8; rodata_at];
        rodata.extend_from_slice(b"@(#)Version 8.0.424.16909 @Commit: x\0");
        let mut syms = vec![0u8; 24 * 3];
        syms[24..28].copy_from_slice(&1u32.to_le_bytes());
        syms[32..40].copy_from_slice(&0x6aecc8u64.to_le_bytes());
        syms[48..52].copy_from_slice(&12u32.to_le_bytes());
        syms[56..64].copy_from_slice(&0x6b0000u64.to_le_bytes());
        let phoff = 64u64;
        let dynsym_off = phoff + 56;
        let dynstr_off = dynsym_off + syms.len() as u64;
        let shstr_off = dynstr_off + dynstr.len() as u64;
        let rodata_off = shstr_off + shstrtab.len() as u64;
        let shoff = rodata_off + rodata.len() as u64;
        let mut f = vec![0u8; 64];
        f[..6].copy_from_slice(b"\x7fELF\x02\x01");
        f[32..40].copy_from_slice(&phoff.to_le_bytes());
        f[40..48].copy_from_slice(&shoff.to_le_bytes());
        f[54..56].copy_from_slice(&56u16.to_le_bytes());
        f[56..58].copy_from_slice(&1u16.to_le_bytes());
        f[58..60].copy_from_slice(&64u16.to_le_bytes());
        f[60..62].copy_from_slice(&5u16.to_le_bytes());
        f[62..64].copy_from_slice(&3u16.to_le_bytes());
        let mut ph = vec![0u8; 56];
        ph[..4].copy_from_slice(&1u32.to_le_bytes());
        ph[32..40].copy_from_slice(&shoff.to_le_bytes());
        f.extend_from_slice(&ph);
        f.extend_from_slice(&syms);
        f.extend_from_slice(dynstr);
        f.extend_from_slice(shstrtab);
        f.extend_from_slice(&rodata);
        let section = |name: u32, kind: u32, off: u64, size: u64, link: u32| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[4..8].copy_from_slice(&kind.to_le_bytes());
            h[24..32].copy_from_slice(&off.to_le_bytes());
            h[32..40].copy_from_slice(&size.to_le_bytes());
            h[40..44].copy_from_slice(&link.to_le_bytes());
            h
        };
        f.extend(section(0, 0, 0, 0, 0));
        let dynsym_size = dynsym_size.unwrap_or(syms.len() as u64);
        f.extend(section(1, SHT_DYNSYM, dynsym_off, dynsym_size, 2));
        f.extend(section(9, 3, dynstr_off, dynstr.len() as u64, 0));
        f.extend(section(17, 3, shstr_off, shstrtab.len() as u64, 0));
        f.extend(section(27, 1, rodata_off, rodata.len() as u64, 0));
        f
    }

    #[test]
    fn exports_segments_and_version_are_read() {
        let image = RuntimeImage::parse(&elf(None, 10)).expect("an image");
        assert_eq!(image.dac_table, 0x6aecc8);
        assert_eq!(image.contract_descriptor, Some(0x6b0000));
        assert_eq!(image.segments.len(), 1);
        assert_eq!(image.file_version.as_deref(), Some("8.0.424.16909"));
        // The marker across two pieces of .rodata.
        let image = RuntimeImage::parse(&elf(None, CHUNK - 20)).expect("an image");
        assert_eq!(image.file_version.as_deref(), Some("8.0.424.16909"));
    }

    #[test]
    fn a_huge_or_outlying_dynsym_is_refused() {
        let before = refused_images();
        assert!(matches!(
            RuntimeImage::parse(&elf(Some(4 << 30), 10)),
            Err(RuntimeImageError::TooLarge {
                what: ".dynsym",
                ..
            })
        ));
        assert!(matches!(
            RuntimeImage::parse(&elf(Some(MAX_DYNSYM), 10)),
            Err(RuntimeImageError::PastEnd {
                what: ".dynsym",
                ..
            })
        ));
        assert!(refused_images() >= before + 2);
    }

    #[test]
    fn a_sparse_file_is_refused_unread() {
        // A .dynsym within the caps whose bytes are a hole: the real file
        // is the headers, the rest never written.
        let image = elf(Some(MAX_DYNSYM), 10);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("libcoreclr.so");
        let file = File::create(&path).expect("create");
        file.set_len(1 << 40).expect("1 TiB apparent size");
        FileExt::write_all_at(&file, &image, 0).expect("write");
        let file = File::open(&path).expect("open");
        match RuntimeImage::read(&file) {
            Err(RuntimeImageError::Sparse { .. }) => {}
            // Filesystems without SEEK_HOLE: the symbols are read and
            // are zeros.
            Err(RuntimeImageError::NoDacTable) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn version_string_is_found() {
        let rodata = b"\0\0abc@(#)Version 8.0.424.16909 @Commit: 2d7e\0";
        assert_eq!(version_string(rodata).as_deref(), Some("8.0.424.16909"));
        assert_eq!(version_string(b"@(#)Version @Commit"), None);
        assert_eq!(version_string(b"nothing"), None);
    }

    #[test]
    fn major_from_file_version() {
        let mut image = RuntimeImage {
            dac_table: 0x6aecc8,
            contract_descriptor: None,
            segments: vec![(0, 0, 0x1000), (0x1000, 0x2000, 0x5000)],
            file_version: Some("4.700.22.11601".into()),
        };
        assert_eq!(image.major(), Some(3));
        image.file_version = Some("8.0.424.16909".into());
        assert_eq!(image.major(), Some(8));
        assert_eq!(image.load_bias(0x7f00_0000_0000, 0), Some(0x7f00_0000_0000));
        assert_eq!(
            image.load_bias(0x7f00_0000_3000, 0x2000),
            Some(0x7f00_0000_0000)
        );
        assert_eq!(image.load_bias(0x1000, 0x9000_0000), None);
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(RuntimeImage::parse(&b"\x7fELF garbage"[..]).is_err());
        assert!(RuntimeImage::parse(&[][..]).is_err());
    }
}
