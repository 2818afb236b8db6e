//! What the memory walk ([`super`]) needs from the `libcoreclr.so` file
//! itself: the addresses of `g_dacTable` (the table of the runtime's
//! globals the debugger uses) and of `DotNetRuntimeContractDescriptor`
//! (.NET 9+), both exported dynamic symbols, the program headers that turn
//! them into addresses in the process, and the version the runtime was
//! built as (its `@(#)Version` string) for self-contained apps whose path
//! tells none.
//!
//! The file comes from the target's root, is read lazily (only the ELF
//! headers, dynamic symbols and `.rodata` are touched) and is hostile like
//! any other input.

use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol, ReadRef};

/// `.rodata` longer than this is not scanned for the version.
const MAX_RODATA: u64 = 32 * 1024 * 1024;
const VERSION_MARKER: &[u8] = b"@(#)Version ";

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
    #[error("libcoreclr.so is not a readable ELF file: {0}")]
    Elf(#[from] object::Error),
    #[error("libcoreclr.so exports no g_dacTable (.NET Core 3.x and .NET 5 do not)")]
    NoDacTable,
}

impl RuntimeImage {
    pub fn parse<'data, R: ReadRef<'data>>(data: R) -> Result<Self, RuntimeImageError> {
        let file = object::File::parse(data)?;
        let mut dac_table = None;
        let mut contract_descriptor = None;
        for symbol in file.dynamic_symbols() {
            match symbol.name_bytes() {
                Ok(b"g_dacTable") => dac_table = Some(symbol.address()),
                Ok(b"DotNetRuntimeContractDescriptor") => {
                    contract_descriptor = Some(symbol.address());
                }
                _ => {}
            }
        }
        let dac_table = dac_table
            .filter(|&a| a != 0)
            .ok_or(RuntimeImageError::NoDacTable)?;
        let segments = file
            .segments()
            .map(|s| {
                let (offset, size) = s.file_range();
                (offset, s.address(), size)
            })
            .collect();
        let file_version = file
            .section_by_name(".rodata")
            .filter(|s| s.size() <= MAX_RODATA)
            .and_then(|s| s.data().ok())
            .and_then(version_string);
        Ok(Self {
            dac_table,
            contract_descriptor: contract_descriptor.filter(|&a| a != 0),
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

/// `8.0.424.16909` from `...@(#)Version 8.0.424.16909 @Commit: ...`.
fn version_string(rodata: &[u8]) -> Option<String> {
    let at = rodata
        .windows(VERSION_MARKER.len())
        .position(|w| w == VERSION_MARKER)?;
    let rest = &rodata[at + VERSION_MARKER.len()..];
    let end = rest
        .iter()
        .take(64)
        .position(|&b| !(b.is_ascii_digit() || b == b'.'))
        .unwrap_or(rest.len().min(64));
    (end > 0).then(|| String::from_utf8_lossy(&rest[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

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
