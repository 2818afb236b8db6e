//! One ELF file's (or ReadyToRun image's) unwind table, its identity, and
//! the cache that shares
//! tables between processes: what the kernel-side unwind maps are filled
//! from. A file mapped by a hundred processes is parsed once; the cache keeps
//! the most recently used tables within a byte budget.

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::sync::Arc;

use clrbpf_common::unwind::{
    CfaRule, ROW_INDEX_MAX_SHIFT, ROW_INDEX_MIN_SHIFT, ROW_INDEX_WORDS_PER_ROW, RowIndex,
    UnwindRow, find_row_index_indexed, row_index_word,
};
use lru::LruCache;
use object::{Object, ObjectSegment};
use twox_hash::XxHash3_64;

use super::UnwindTableError;
use super::disk_cache::{DiskCacheStats, DiskTableCache};
use super::eh_frame::{UnwindRowStats, build_rows};
use super::ready_to_run;

/// Largest ELF file [`UnwindTable::from_file`] reads.
pub const MAX_ELF_FILE_BYTES: u64 = 1 << 30;

/// Longest GNU build id kept; a longer note is treated as absent.
const MAX_BUILD_ID_BYTES: usize = 64;

/// What makes two files the same for unwinding: the GNU build id when the
/// file has one (every distribution binary does), for a PE image its
/// headers and debug records ([`pe_build_id`]), else a hash of what
/// [`read_elf_file`] read of it: every byte its table is built from (the
/// rest hashes as zeros). A hash of a few pages is not enough: two builds
/// of one library can share their first and last 4 KiB and differ in
/// between.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum FileIdentity {
    /// The `.note.gnu.build-id` descriptor.
    BuildId(Box<[u8]>),
    /// XXH3-64 of the bytes read ([`FileBytes`]).
    ContentHash(u64),
}

impl FileIdentity {
    /// The identity of a parsed ELF file whose bytes are `data`.
    pub fn of_elf(elf: &object::File<'_>, data: &[u8]) -> Self {
        let build_id = if elf.format() == object::BinaryFormat::Pe {
            pe_build_id(data)
        } else {
            match elf.build_id() {
                Ok(Some(id)) if !id.is_empty() && id.len() <= MAX_BUILD_ID_BYTES => Some(id.into()),
                _ => None,
            }
        };
        match build_id {
            Some(id) => Self::BuildId(id),
            None => Self::ContentHash(XxHash3_64::oneshot(data)),
        }
    }

    /// The identity of the ELF file whose bytes are `data`.
    pub fn of_elf_bytes(data: &[u8]) -> Result<Self, UnwindTableError> {
        let elf = object::File::parse(data).map_err(|source| UnwindTableError::Parse { source })?;
        Ok(Self::of_elf(&elf, data))
    }

    /// A 64-bit key for kernel-side maps: XXH3-64 of the build id, or the
    /// content hash.
    pub fn key(&self) -> u64 {
        match self {
            Self::BuildId(id) => XxHash3_64::oneshot(id),
            Self::ContentHash(hash) => *hash,
        }
    }
}

impl std::fmt::Display for FileIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BuildId(id) => {
                f.write_str("build-id:")?;
                id.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
            Self::ContentHash(hash) => write!(f, "xxh3:{hash:016x}"),
        }
    }
}

/// A `PT_LOAD` segment: where file bytes land in the file's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSegment {
    pub file_offset: u64,
    pub file_size: u64,
    pub vaddr: u64,
}

/// The unwind rows of one ELF file, sorted by ELF virtual address.
#[derive(Debug)]
pub struct UnwindTable {
    identity: FileIdentity,
    rows: Box<[UnwindRow]>,
    /// The coarse index over `rows` ([`build_row_index`]), packed in row
    /// slots as the kernel's row array holds it after the rows.
    index: RowIndex,
    index_slots: Box<[UnwindRow]>,
    segments: Box<[LoadSegment]>,
    stats: UnwindRowStats,
}

impl UnwindTable {
    /// Builds the table of the ELF file (or ReadyToRun PE image) whose
    /// bytes are `data`.
    pub fn from_elf_bytes(data: &[u8]) -> Result<Self, UnwindTableError> {
        let elf = object::File::parse(data).map_err(|source| UnwindTableError::Parse { source })?;
        let identity = FileIdentity::of_elf(&elf, data);
        Self::from_object(&elf, data, identity)
    }

    /// Builds the table of a parsed file whose bytes are `data` and whose
    /// identity is known: `.eh_frame` rows and `PT_LOAD` segments for ELF,
    /// ReadyToRun rows and sections for PE.
    pub fn from_object(
        file: &object::File<'_>,
        data: &[u8],
        identity: FileIdentity,
    ) -> Result<Self, UnwindTableError> {
        let (rows, stats, segments) = if file.format() == object::BinaryFormat::Pe {
            let pe = object::read::pe::PeFile64::parse(data)
                .map_err(|source| UnwindTableError::Parse { source })?;
            let (rows, stats) = ready_to_run::build_rows(&pe, data)?;
            let segments = ready_to_run::section_segments(&pe)
                .into_iter()
                .map(|(file_offset, file_size, vaddr)| LoadSegment {
                    file_offset,
                    file_size,
                    vaddr,
                })
                .collect();
            (rows, stats, segments)
        } else {
            let (rows, stats) = build_rows(file)?;
            let segments = file
                .segments()
                .map(|s| {
                    let (file_offset, file_size) = s.file_range();
                    LoadSegment {
                        file_offset,
                        file_size,
                        vaddr: s.address(),
                    }
                })
                .collect();
            (rows, stats, segments)
        };
        let (index, words) = build_row_index(&rows);
        Ok(Self {
            identity,
            rows: rows.into_boxed_slice(),
            index,
            index_slots: pack_index_words(&words),
            segments,
            stats,
        })
    }

    /// Builds the table of an opened ELF file (the caller opened it, through
    /// `/proc/PID/root` for a target's file, without following symlinks out
    /// of that root).
    pub fn from_file(file: &File) -> Result<Self, UnwindTableError> {
        Self::from_elf_bytes(&read_elf_file(file)?)
    }

    /// A table from its parts as [`super::disk_cache`] kept them; `None`
    /// unless they hang together (sorted rows within the bound, index
    /// slots as many as the index's words need).
    pub fn from_parts(
        identity: FileIdentity,
        rows: Box<[UnwindRow]>,
        index: RowIndex,
        index_slots: Box<[UnwindRow]>,
        segments: Box<[LoadSegment]>,
    ) -> Option<Self> {
        let slots_needed = index.len.div_ceil(ROW_INDEX_WORDS_PER_ROW) as usize;
        if rows.len() > clrbpf_common::unwind::MAX_TABLE_ROWS
            || index_slots.len() != slots_needed
            || !rows.is_sorted_by_key(|r| r.pc)
        {
            return None;
        }
        let stats = UnwindRowStats {
            rows: rows.len(),
            ..UnwindRowStats::default()
        };
        Some(Self {
            identity,
            rows,
            index,
            index_slots,
            segments,
            stats,
        })
    }

    pub fn identity(&self) -> &FileIdentity {
        &self.identity
    }

    #[cfg(test)]
    pub(crate) fn set_identity(&mut self, identity: FileIdentity) {
        self.identity = identity;
    }

    /// Sorted rows, ending with a `NoInfo` row (ELF) or a `FramePointer`
    /// row (ReadyToRun), or empty.
    pub fn rows(&self) -> &[UnwindRow] {
        &self.rows
    }

    /// The shape of the table's row index.
    pub fn row_index(&self) -> RowIndex {
        self.index
    }

    /// The row index's words packed into row slots: what follows the rows
    /// in the kernel's row array.
    pub fn index_slots(&self) -> &[UnwindRow] {
        &self.index_slots
    }

    pub fn stats(&self) -> &UnwindRowStats {
        &self.stats
    }

    pub fn segments(&self) -> &[LoadSegment] {
        &self.segments
    }

    /// The row for an ELF virtual address, if one covers it: the kernel's
    /// lookup (row index, then a search among the rows it names), over the
    /// same packed words.
    pub fn find_row(&self, vaddr: u64) -> Option<&UnwindRow> {
        let row_count = u32::try_from(self.rows.len()).ok()?;
        let at = find_row_index_indexed(
            &self.index,
            row_count,
            |w| {
                self.index_slots
                    .get((w / ROW_INDEX_WORDS_PER_ROW) as usize)
                    .map(|slot| row_index_word(slot, w))
            },
            |i| self.rows.get(i as usize).map(|r| r.pc),
            vaddr,
        )?;
        self.rows
            .get(at as usize)
            .filter(|r| r.cfa_rule != CfaRule::NoInfo as u8)
    }

    /// Bytes of memory the table holds (rows and segments), what the cache
    /// budget counts.
    pub fn size_bytes(&self) -> usize {
        let Self {
            identity,
            rows,
            index: _,
            index_slots,
            segments,
            stats: _,
        } = self;
        let identity_bytes = match identity {
            FileIdentity::BuildId(id) => id.len(),
            FileIdentity::ContentHash(_) => 0,
        };
        size_of::<Self>()
            + identity_bytes
            + size_of_val::<[UnwindRow]>(rows)
            + size_of_val::<[UnwindRow]>(index_slots)
            + size_of_val::<[LoadSegment]>(segments)
    }

    /// The load bias of a mapping of this file at `map_start` from file
    /// offset `map_offset` (as in `/proc/PID/maps`): a pc in the mapping is
    /// at ELF virtual address `pc - bias` (wrapping). `None` when no
    /// `PT_LOAD` segment holds that offset.
    pub fn load_bias(&self, map_start: u64, map_offset: u64) -> Option<u64> {
        load_bias(&self.segments, map_start, map_offset)
    }
}

/// [`UnwindTable::load_bias`] over a file's `PT_LOAD` segments, for callers
/// that keep the segments but not the rows.
pub fn load_bias(segments: &[LoadSegment], map_start: u64, map_offset: u64) -> Option<u64> {
    // Mappings start at page-aligned offsets, segments need not: match the
    // segment's page-aligned start. p_vaddr and p_offset are equal modulo
    // the page size, so the bias is the same either way. Two segments can
    // share a file page (lld packs them: libcoreclr's read-only segment
    // ends at 0x1a801c, its code starts at 0x1a8020 at another vaddr page),
    // so of the segments covering the offset, the one starting last is the
    // one the kernel mapped there: the first would shift every pc.
    let segment = segments
        .iter()
        .filter(|s| {
            let aligned = s.file_offset & !0xfff;
            aligned <= map_offset && map_offset < s.file_offset.saturating_add(s.file_size.max(1))
        })
        .max_by_key(|s| s.file_offset)?;
    Some(
        map_start
            .wrapping_sub(map_offset)
            .wrapping_add(segment.file_offset)
            .wrapping_sub(segment.vaddr),
    )
}

/// Rows per bucket the row index aims at, on average: the words cost 1 byte
/// per row (4% of the rows' size), and a lookup then searches a few
/// neighbouring rows (two or three cache lines).
const ROWS_PER_BUCKET: usize = 4;

/// The coarse row index of sorted `rows` (see [`RowIndex`]) and its words:
/// the smallest bucket size, from 16 bytes of code, that keeps the words
/// within one per [`ROWS_PER_BUCKET`] rows. No index (length 0: the kernel
/// binary-searches the table) for an empty table or one whose addresses
/// spread too far for 16 MiB buckets.
pub fn build_row_index(rows: &[UnwindRow]) -> (RowIndex, Vec<u32>) {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
        return (RowIndex::default(), Vec::new());
    };
    if u32::try_from(rows.len()).is_err() {
        return (RowIndex::default(), Vec::new());
    }
    let budget = rows.len().div_ceil(ROWS_PER_BUCKET) as u64;
    let span = last.pc.saturating_sub(first.pc);
    let Some(shift) = (ROW_INDEX_MIN_SHIFT..=ROW_INDEX_MAX_SHIFT).find(|s| (span >> s) < budget)
    else {
        return (RowIndex::default(), Vec::new());
    };
    let len = (span >> shift) + 1;
    let mut words = Vec::with_capacity(len as usize);
    let mut row = 0usize;
    for bucket in 0..len {
        let start = first.pc + (bucket << shift);
        while rows.get(row + 1).is_some_and(|r| r.pc <= start) {
            row += 1;
        }
        words.push(row as u32);
    }
    let index = RowIndex {
        base: first.pc,
        len: len as u32,
        shift,
    };
    (index, words)
}

/// Appends `row` to sorted rows, merged into the last one when it unwinds
/// the same way (or replacing it when it starts at the same pc).
pub(crate) fn push_merged(rows: &mut Vec<UnwindRow>, row: UnwindRow) {
    match rows.last_mut() {
        Some(last) if last.same_rule(&row) => {}
        Some(last) if last.pc == row.pc => *last = row,
        _ => rows.push(row),
    }
}

/// Row-index words packed [`ROW_INDEX_WORDS_PER_ROW`] to a row slot, the
/// last slot padded with zeros.
pub fn pack_index_words(words: &[u32]) -> Box<[UnwindRow]> {
    words
        .chunks(ROW_INDEX_WORDS_PER_ROW as usize)
        .map(|chunk| {
            let mut w = [0u32; ROW_INDEX_WORDS_PER_ROW as usize];
            w[..chunk.len()].copy_from_slice(chunk);
            UnwindRow::from_index_words(w)
        })
        .collect()
}

/// The bytes of a file that unwinding reads, at their file offsets, in
/// an anonymous mapping the size of the file: the parts not read stay
/// zero pages that take no memory. An ELF file needs only its headers,
/// notes and a few sections (`.eh_frame`, `.debug_frame`, the PLTs), a
/// small part of a large library: reading `librustc_driver.so` (a quarter
/// of a GiB) whole to index one compiler process raised clrbpf's RSS by as
/// much. The bytes read are bounded too ([`FileBytes::read_limit`], the
/// memory budget's share for one file): a process can map a sparse file of
/// a GiB that costs it nothing on disk.
pub struct FileBytes {
    map: Option<std::ptr::NonNull<u8>>,
    len: usize,
    /// Bytes read into it so far (overlapping reads count twice).
    read: u64,
    read_limit: u64,
}

// SAFETY: the mapping is owned, private and only read through `&self`.
unsafe impl Send for FileBytes {}
unsafe impl Sync for FileBytes {}

impl FileBytes {
    /// A zero-filled anonymous mapping of `len` bytes.
    fn zeroed(len: usize, read_limit: u64) -> std::io::Result<Self> {
        if len == 0 {
            return Ok(Self {
                map: None,
                len,
                read: 0,
                read_limit,
            });
        }
        // SAFETY: a fresh private anonymous mapping; no file, no aliasing.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            map: std::ptr::NonNull::new(ptr.cast()),
            len,
            read: 0,
            read_limit,
        })
    }

    /// Bytes read into it so far.
    pub fn bytes_read(&self) -> u64 {
        self.read
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self.map {
            // SAFETY: `len` bytes mapped read-write, owned by `self`.
            Some(ptr) => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), self.len) },
            None => &mut [],
        }
    }

    /// Reads `file`'s bytes `[offset, offset + len)`, clipped to the file's
    /// size, into place; refuses to read past the read limit.
    fn fill(&mut self, file: &File, offset: u64, len: u64) -> Result<(), UnwindTableError> {
        let size = self.len as u64;
        let start = offset.min(size);
        let end = offset.saturating_add(len).min(size);
        if start >= end {
            return Ok(());
        }
        let read = self.read + (end - start);
        if read > self.read_limit {
            return Err(UnwindTableError::OverBudget {
                limit: self.read_limit,
            });
        }
        self.read = read;
        let range = start as usize..end as usize;
        file.read_exact_at(&mut self.bytes_mut()[range], start)
            .map_err(|source| UnwindTableError::Read { source })
    }
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self.map {
            // SAFETY: `len` bytes mapped, owned by `self`.
            Some(ptr) => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), self.len) },
            None => &[],
        }
    }
}

impl Drop for FileBytes {
    fn drop(&mut self) {
        if let Some(ptr) = self.map {
            // SAFETY: the mapping made in `zeroed`, unmapped once.
            unsafe { libc::munmap(ptr.as_ptr().cast(), self.len) };
        }
    }
}

/// ELF sections whose contents unwind tables are built from (besides the
/// notes, for the build id).
const UNWIND_SECTIONS: [&[u8]; 5] = [
    b".eh_frame",
    b".debug_frame",
    b".plt",
    b".plt.sec",
    b".plt.got",
];

/// Reads what unwinding needs of an ELF file or PE image (a ReadyToRun
/// `.dll`), refusing more than [`MAX_ELF_FILE_BYTES`] and, before reading
/// the rest, a file without either magic. Executable mappings are not all
/// ELF or PE: .NET 8 maps its JIT code from a memfd (`/memfd:doublemapper`)
/// sized in gigabytes, which reading whole cost a gigabyte of memory and a
/// second of CPU per process. A 64-bit little-endian ELF file is read
/// sparsely ([`FileBytes`]), a PE image its headers then its sections, and
/// only if the headers parse (a sparse GiB file starting with `MZ` costs a
/// page); another ELF file whole. Whatever is read stays within the memory
/// budget's share for one file ([`crate::memory_budget::MemoryBudget::file_read_bytes`]).
pub fn read_elf_file(file: &File) -> Result<FileBytes, UnwindTableError> {
    read_elf_file_within(file, crate::memory_budget::current().file_read_bytes())
}

/// [`read_elf_file`], reading at most `read_limit` bytes.
pub fn read_elf_file_within(file: &File, read_limit: u64) -> Result<FileBytes, UnwindTableError> {
    let (magic, mut data) = start_reading(file, read_limit)?;
    if magic == *b"\x7fELF" {
        if !read_elf_parts(file, &mut data, true)? {
            data.fill(file, 0, data.len() as u64)?;
        }
    } else {
        read_pe_sections(file, &mut data)?;
    }
    Ok(data)
}

/// The magic of an ELF or PE file and an unread [`FileBytes`] of its size.
fn start_reading(file: &File, read_limit: u64) -> Result<([u8; 4], FileBytes), UnwindTableError> {
    let mut magic = [0u8; 4];
    file.read_exact_at(&mut magic, 0)
        .map_err(|source| UnwindTableError::Read { source })?;
    if magic != *b"\x7fELF" && magic[..2] != *b"MZ" {
        return Err(UnwindTableError::NotElf);
    }
    let size = file
        .metadata()
        .map_err(|source| UnwindTableError::Read { source })?
        .len();
    if size > MAX_ELF_FILE_BYTES {
        return Err(UnwindTableError::TooLarge {
            limit: MAX_ELF_FILE_BYTES,
        });
    }
    let data = FileBytes::zeroed(size as usize, read_limit)
        .map_err(|source| UnwindTableError::Read { source })?;
    Ok((magic, data))
}

/// Reads a 64-bit PE image's headers and, if they parse, the raw data of
/// its sections (where its ReadyToRun header, runtime functions and unwind
/// records are), into `data`.
fn read_pe_sections(file: &File, data: &mut FileBytes) -> Result<(), UnwindTableError> {
    data.fill(file, 0, u64::from(PE_HEADER_BYTES))?;
    let sections: Vec<(u64, u64)> = {
        let pe = object::read::pe::PeFile64::parse(&**data)
            .map_err(|source| UnwindTableError::Parse { source })?;
        pe.section_table()
            .iter()
            .filter_map(|section| {
                let (offset, size) = section.pe_file_range();
                (size > 0).then_some((u64::from(offset), u64::from(size)))
            })
            .collect()
    };
    for (offset, size) in sections {
        data.fill(file, offset, size)?;
    }
    Ok(())
}

/// The build id of a 64-bit little-endian ELF file, read from its headers
/// and notes alone, or of a PE image from its headers and debug records
/// ([`pe_build_id`]): enough to find its table already loaded or kept on
/// disk without reading its unwind sections (or, for an image, all of
/// it). `None` for any other file, or one without a build id (its identity
/// needs those sections).
pub fn read_build_id(file: &File) -> Option<FileIdentity> {
    // Headers, notes and a few debug records: a small, fixed share.
    let (magic, mut data) = start_reading(file, BUILD_ID_READ_LIMIT).ok()?;
    if magic[..2] == *b"MZ" {
        read_pe_parts(file, &mut data).ok()?;
    } else if !read_elf_parts(file, &mut data, false).ok()? {
        return None;
    }
    match FileIdentity::of_elf_bytes(&data).ok()? {
        identity @ FileIdentity::BuildId(_) => Some(identity),
        FileIdentity::ContentHash(_) => None,
    }
}

/// Bytes [`read_build_id`] reads at most (headers, program and section
/// headers, notes).
const BUILD_ID_READ_LIMIT: u64 = 4 << 20;

/// Tags a PE image's identity, so it never equals an ELF build id.
const PE_BUILD_ID_TAG: &[u8] = b"PE:";
/// Debug records a PE identity holds ([`pe_build_id`]).
const PE_BUILD_ID_RECORDS: usize = 2;
/// Debug directory entries looked at.
const PE_DEBUG_ENTRIES: u32 = 16;
/// Bytes of a debug record kept: its magic (`RSDS` or `R2RM`), then a
/// GUID and an age or version.
const PE_DEBUG_RECORD_BYTES: u32 = 24;
/// The ReadyToRun perf map entry of the debug directory (crossgen2 writes
/// it: `R2RM`, the signature of the image's native code, a version).
const IMAGE_DEBUG_TYPE_PERFMAP: u32 = 21;
/// Largest PE header hashed into an identity (headers and section table;
/// the images seen have 512 or 4096 bytes).
const PE_HEADER_BYTES: u32 = 4096;

/// The build id of a 64-bit PE image, from what names it for debuggers
/// and perf tools: a hash of its headers (time stamp, image and section
/// sizes, data directories), then its first [`PE_BUILD_ID_RECORDS`]
/// CodeView (`RSDS`: PDB GUID and age) and ReadyToRun perf map (`R2RM`:
/// signature of the native code) records. `None` when it has neither.
/// Like a GNU build id it is what the file says of itself: a file forging
/// another's only misleads the unwinding of the processes that map it.
pub fn pe_build_id(data: &[u8]) -> Option<Box<[u8]>> {
    use object::LittleEndian as LE;
    use object::read::pe::ImageNtHeaders as _;
    let pe = object::read::pe::PeFile64::parse(data).ok()?;
    let headers = pe.nt_headers().optional_header().size_of_headers.get(LE);
    if headers > PE_HEADER_BYTES {
        return None;
    }
    let mut id = PE_BUILD_ID_TAG.to_vec();
    id.extend_from_slice(&XxHash3_64::oneshot(data.get(..headers as usize)?).to_le_bytes());
    let mut records = 0;
    for at in pe_debug_records(&pe, data)? {
        let Some(record) = data
            .get(at as usize..)
            .and_then(|d| d.get(..PE_DEBUG_RECORD_BYTES as usize))
        else {
            continue;
        };
        if matches!(&record[..4], b"RSDS" | b"R2RM") {
            id.extend_from_slice(&record[4..]);
            records += 1;
        }
    }
    (records > 0 && id.len() <= MAX_BUILD_ID_BYTES).then(|| id.into_boxed_slice())
}

/// File offsets of the first [`PE_BUILD_ID_RECORDS`] CodeView and perf map
/// records of an image's debug directory; `None` when it has no debug
/// directory (or cannot be read).
fn pe_debug_records(pe: &object::read::pe::PeFile64<'_>, data: &[u8]) -> Option<Vec<u64>> {
    use object::LittleEndian as LE;
    use object::pe::{IMAGE_DEBUG_TYPE_CODEVIEW, ImageDebugDirectory};
    let (offset, size) = pe_debug_directory(pe)?;
    let entries = data.get(offset as usize..)?.get(..size as usize)?;
    let (entries, _) = object::pod::slice_from_bytes::<ImageDebugDirectory>(
        entries,
        entries.len() / size_of::<ImageDebugDirectory>(),
    )
    .ok()?;
    Some(
        entries
            .iter()
            .filter(|e| {
                matches!(
                    e.typ.get(LE),
                    IMAGE_DEBUG_TYPE_CODEVIEW | IMAGE_DEBUG_TYPE_PERFMAP
                )
            })
            .take(PE_BUILD_ID_RECORDS)
            .map(|e| u64::from(e.pointer_to_raw_data.get(LE)))
            .collect(),
    )
}

/// Where an image's debug directory is in the file, at most
/// [`PE_DEBUG_ENTRIES`] entries of it.
fn pe_debug_directory(pe: &object::read::pe::PeFile64<'_>) -> Option<(u32, u32)> {
    use object::pe::{IMAGE_DIRECTORY_ENTRY_DEBUG, ImageDebugDirectory};
    let (offset, size) = pe
        .data_directory(IMAGE_DIRECTORY_ENTRY_DEBUG)?
        .file_range(&pe.section_table())
        .ok()?;
    Some((
        offset,
        size.min(PE_DEBUG_ENTRIES * size_of::<ImageDebugDirectory>() as u32),
    ))
}

/// Reads what [`pe_build_id`] needs of a 64-bit PE image into `data`: its
/// headers, its debug directory and the records it points to.
fn read_pe_parts(file: &File, data: &mut FileBytes) -> Result<(), UnwindTableError> {
    data.fill(file, 0, u64::from(PE_HEADER_BYTES))?;
    let directory = object::read::pe::PeFile64::parse(&**data)
        .ok()
        .and_then(|pe| pe_debug_directory(&pe));
    let Some((offset, size)) = directory else {
        return Ok(());
    };
    data.fill(file, u64::from(offset), u64::from(size))?;
    let records = object::read::pe::PeFile64::parse(&**data)
        .ok()
        .and_then(|pe| pe_debug_records(&pe, data));
    for at in records.unwrap_or_default() {
        data.fill(file, at, u64::from(PE_DEBUG_RECORD_BYTES))?;
    }
    Ok(())
}

/// Reads the headers, notes and [`UNWIND_SECTIONS`] of a 64-bit
/// little-endian ELF file into `data`; false (nothing wrong) for another
/// kind of ELF file, to be read whole.
fn read_elf_parts(
    file: &File,
    data: &mut FileBytes,
    sections: bool,
) -> Result<bool, UnwindTableError> {
    use object::elf::{FileHeader64, PT_NOTE, SHT_NOBITS, SHT_NOTE};
    use object::read::elf::{FileHeader as _, ProgramHeader as _, SectionHeader as _};
    type Header = FileHeader64<object::LittleEndian>;
    let parse_error = |source| UnwindTableError::Parse { source };
    const HEADER_BYTES: u64 = size_of::<Header>() as u64;
    const SECTION_HEADER_BYTES: u64 =
        size_of::<object::elf::SectionHeader64<object::LittleEndian>>() as u64;

    data.fill(file, 0, HEADER_BYTES)?;
    let (e_phoff, e_phentsize, e_shoff, e_shentsize) = {
        let Ok(header) = Header::parse(&**data) else {
            return Ok(false);
        };
        if !header.is_class_64() || !header.is_little_endian() {
            return Ok(false);
        }
        let e = header.endian().map_err(parse_error)?;
        (
            header.e_phoff.get(e),
            u64::from(header.e_phentsize.get(e)),
            header.e_shoff.get(e),
            u64::from(header.e_shentsize.get(e)),
        )
    };
    // Section 0 holds the real counts when they overflow the header's.
    data.fill(file, e_shoff, SECTION_HEADER_BYTES)?;
    let header = Header::parse(&**data).map_err(parse_error)?;
    let e = header.endian().map_err(parse_error)?;
    let phnum = header.phnum(e, &**data).map_err(parse_error)? as u64;
    let shnum = header.shnum(e, &**data).map_err(parse_error)? as u64;
    data.fill(file, e_phoff, e_phentsize.saturating_mul(phnum))?;
    data.fill(file, e_shoff, e_shentsize.saturating_mul(shnum))?;

    // The section names, then the sections and notes wanted.
    let mut wanted: Vec<(u64, u64)> = Vec::new();
    {
        let header = Header::parse(&**data).map_err(parse_error)?;
        let sections = header.section_headers(e, &**data).map_err(parse_error)?;
        let names = header.shstrndx(e, &**data).map_err(parse_error)? as usize;
        if let Some(names) = sections.get(names) {
            wanted.push((names.sh_offset(e), names.sh_size(e)));
        }
        for segment in header.program_headers(e, &**data).map_err(parse_error)? {
            if segment.p_type(e) == PT_NOTE {
                wanted.push((segment.p_offset(e), segment.p_filesz(e)));
            }
        }
    }
    for &(offset, len) in &wanted {
        data.fill(file, offset, len)?;
    }
    if !sections {
        return Ok(true);
    }
    wanted.clear();
    {
        let header = Header::parse(&**data).map_err(parse_error)?;
        let sections = header.sections(e, &**data).map_err(parse_error)?;
        for section in sections.iter() {
            if section.sh_type(e) == SHT_NOBITS {
                continue;
            }
            let wanted_name = sections
                .section_name(e, section)
                .is_ok_and(|name| UNWIND_SECTIONS.contains(&name));
            if wanted_name || section.sh_type(e) == SHT_NOTE {
                wanted.push((section.sh_offset(e), section.sh_size(e)));
            }
        }
    }
    for &(offset, len) in &wanted {
        data.fill(file, offset, len)?;
    }
    Ok(true)
}

/// Tables shared by file identity, least recently used evicted first once
/// their [`UnwindTable::size_bytes`] add up to more than the capacity.
/// Evicting only drops the cache's reference: a process still holding the
/// `Arc` keeps its table; the identities evicted are reported so the kernel
/// side can drop its copy.
pub struct UnwindTableCache {
    tables: LruCache<FileIdentity, Arc<UnwindTable>>,
    size_bytes: usize,
    capacity_bytes: usize,
    evicted: Vec<FileIdentity>,
    /// Tables kept between runs: asked on a miss, given what is built.
    disk: Option<DiskTableCache>,
}

impl UnwindTableCache {
    pub fn new(capacity_bytes: usize) -> Self {
        Self {
            tables: LruCache::unbounded(),
            size_bytes: 0,
            capacity_bytes,
            evicted: Vec::new(),
            disk: None,
        }
    }

    /// Keeps tables between runs in `disk` too.
    pub fn with_disk(mut self, disk: DiskTableCache) -> Self {
        self.disk = Some(disk);
        self
    }

    /// What the tables kept between runs did, when there are.
    pub fn disk_stats(&self) -> Option<DiskCacheStats> {
        self.disk.as_ref().map(|disk| disk.stats)
    }

    /// The table of a file, marking it recently used.
    pub fn get(&mut self, identity: &FileIdentity) -> Option<Arc<UnwindTable>> {
        self.tables.get(identity).cloned()
    }

    /// Adds a table (replacing one of the same identity), then evicts the
    /// least recently used others until the cache fits. A table larger than
    /// the whole capacity is returned but not kept.
    pub fn insert(&mut self, table: UnwindTable) -> Arc<UnwindTable> {
        let table = Arc::new(table);
        let size = table.size_bytes();
        if size > self.capacity_bytes {
            self.evicted.push(table.identity().clone());
            return table;
        }
        if let Some(old) = self
            .tables
            .put(table.identity().clone(), Arc::clone(&table))
        {
            self.size_bytes -= old.size_bytes();
        }
        self.size_bytes += size;
        while self.size_bytes > self.capacity_bytes {
            let Some((identity, old)) = self.tables.pop_lru() else {
                break;
            };
            self.size_bytes -= old.size_bytes();
            self.evicted.push(identity);
        }
        table
    }

    /// The table of `identity` in memory, else on disk. A table read from
    /// disk is not kept in memory too: the disk keeps it (and the kernel's
    /// row array, while a process maps the file).
    pub fn get_kept(&mut self, identity: &FileIdentity) -> Option<Arc<UnwindTable>> {
        if let Some(table) = self.get(identity) {
            return Some(table);
        }
        self.disk.as_mut()?.load(identity).map(Arc::new)
    }

    /// The cached table of the ELF file whose bytes are `data`: from
    /// memory, else from the disk cache, else built (and written to the
    /// disk cache).
    pub fn get_or_build(&mut self, data: &[u8]) -> Result<Arc<UnwindTable>, UnwindTableError> {
        let elf = object::File::parse(data).map_err(|source| UnwindTableError::Parse { source })?;
        let identity = FileIdentity::of_elf(&elf, data);
        if let Some(table) = self.get_kept(&identity) {
            return Ok(table);
        }
        let table = UnwindTable::from_object(&elf, data, identity)?;
        if let Some(disk) = self.disk.as_mut() {
            disk.store(&table);
        }
        Ok(self.insert(table))
    }

    /// Identities evicted (or refused) since the last call.
    #[cfg(test)]
    pub fn take_evicted(&mut self) -> Vec<FileIdentity> {
        std::mem::take(&mut self.evicted)
    }

    pub fn len(&self) -> usize {
        self.tables.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    pub fn size_bytes(&self) -> usize {
        self.size_bytes
    }

    pub fn capacity_bytes(&self) -> usize {
        self.capacity_bytes
    }

    /// Changes the capacity, evicting at once if the cache no longer fits.
    #[cfg(test)]
    pub fn set_capacity_bytes(&mut self, capacity_bytes: usize) {
        self.capacity_bytes = capacity_bytes;
        while self.size_bytes > self.capacity_bytes {
            let Some((identity, old)) = self.tables.pop_lru() else {
                break;
            };
            self.size_bytes -= old.size_bytes();
            self.evicted.push(identity);
        }
    }
}
