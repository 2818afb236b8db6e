//! The kernel-side row array of the DWARF unwinder, as BPF map I/O: the
//! chunks of rows (mmap-able BPF arrays in the `UNWIND_ROW_CHUNKS` array
//! of maps) and the copies into them. What goes where, and when, is
//! [`super::unwind_maps`]'s policy.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
};

use aya::maps::{ArrayOfMaps, MapData};
use clrbpf_common::unwind::{UNWIND_ROWS_PER_CHUNK, UnwindRow};

use super::BpfError;

/// The row array: chunks of [`UNWIND_ROWS_PER_CHUNK`] rows, each an
/// mmap-able BPF array, created as tables need them and hung in the
/// kernel's `UNWIND_ROW_CHUNKS` array of maps. A chunk is mapped into this
/// process only while rows are copied into it: the rows are kernel memory
/// (reported as such), not clrbpf's, and a mapping kept would count them
/// in its RSS as well.
pub(super) struct RowChunks {
    outer: ArrayOfMaps<MapData, MapData>,
    chunks: Vec<MapData>,
    max_chunks: u32,
}

pub(super) const CHUNK_ROWS: u32 = UNWIND_ROWS_PER_CHUNK as u32;
pub(super) const CHUNK_BYTES: usize = UNWIND_ROWS_PER_CHUNK * size_of::<UnwindRow>();

/// Rows of a chunk mapped here for writing or reading, unmapped when
/// dropped. The kernel maps every page of the range at once (an array's
/// mmap is `remap_vmalloc_range`), so a write maps only the pages its rows
/// fall in: mapping a whole chunk (1.5 MiB) for each JIT table of a few
/// hundred rows made mapping and unmapping most of a table's cost.
struct ChunkWriter {
    mapping: NonNull<u8>,
    len: usize,
    /// The chunk's byte at the mapping's start.
    first_byte: usize,
}

/// The size of a page, for the offsets of partial mappings.
fn page_size() -> usize {
    // SAFETY: sysconf has no memory preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

impl ChunkWriter {
    /// The whole chunk.
    fn map(chunk: &MapData) -> std::io::Result<Self> {
        Self::map_rows(chunk, 0, UNWIND_ROWS_PER_CHUNK)
    }

    /// The pages that hold rows `within..within + count` of the chunk.
    fn map_rows(chunk: &MapData, within: usize, count: usize) -> std::io::Result<Self> {
        assert!(within + count <= UNWIND_ROWS_PER_CHUNK);
        let row = size_of::<UnwindRow>();
        let page = page_size();
        let first_byte = within * row / page * page;
        let end = ((within + count) * row).div_ceil(page) * page;
        let len = (end.min(CHUNK_BYTES.div_ceil(page) * page) - first_byte).max(page);
        let offset = libc::off_t::try_from(first_byte).map_err(std::io::Error::other)?;
        // SAFETY: a fresh shared mapping of an mmap-able BPF array's fd; the
        // kernel checks the offset and length against the array.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                chunk.fd().as_fd().as_raw_fd(),
                offset,
            )
        };
        NonNull::new(base.cast::<u8>())
            .filter(|_| base != libc::MAP_FAILED)
            .map(|mapping| Self {
                mapping,
                len,
                first_byte,
            })
            .ok_or_else(std::io::Error::last_os_error)
    }

    /// Where row `within` of the chunk is mapped, if it is.
    fn row_ptr(&self, within: usize) -> Option<*mut UnwindRow> {
        let row = size_of::<UnwindRow>();
        let byte = within.checked_mul(row)?.checked_sub(self.first_byte)?;
        (within < UNWIND_ROWS_PER_CHUNK && byte + row <= self.len).then(|| {
            // SAFETY: inside the mapping (checked just above).
            unsafe { self.mapping.as_ptr().add(byte).cast::<UnwindRow>() }
        })
    }

    /// Copies `rows` to row `within` of the chunk.
    fn write(&mut self, within: usize, rows: &[UnwindRow]) {
        let Some(last) = rows.len().checked_sub(1) else {
            return;
        };
        let (Some(first), Some(_)) = (self.row_ptr(within), self.row_ptr(within + last)) else {
            panic!("rows {within}..+{} outside the chunk's mapping", rows.len());
        };
        // SAFETY: the first and the last row are inside the mapping
        // (checked above), so all between are; the array is ours to write.
        unsafe {
            std::ptr::copy_nonoverlapping(rows.as_ptr(), first, rows.len());
        }
    }

    /// Row `within` of the chunk.
    fn read(&self, within: usize) -> Option<UnwindRow> {
        // SAFETY: inside the mapping (`row_ptr` checks), and aligned (a
        // page is a multiple of 8 bytes, a row 24); rows are plain data,
        // written by this thread only.
        self.row_ptr(within).map(|p| unsafe { p.read() })
    }
}

impl Drop for ChunkWriter {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `ChunkWriter::map_rows`.
        unsafe { libc::munmap(self.mapping.as_ptr().cast(), self.len) };
    }
}

/// Reads rows of the array, mapping each chunk it touches once, until
/// dropped: the userspace replay of copied stacks
/// ([`crate::unwind::stack_copy::replay`]) reads the rows the kernel would.
pub(super) struct RowReader<'a> {
    chunks: &'a RowChunks,
    mapped: std::cell::RefCell<std::collections::HashMap<usize, ChunkWriter>>,
}

impl RowReader<'_> {
    /// Row `i` of the array, `None` past the chunks created or when a
    /// chunk cannot be mapped.
    pub(super) fn row(&self, i: u32) -> Option<UnwindRow> {
        let (chunk, within) = (
            i as usize / UNWIND_ROWS_PER_CHUNK,
            i as usize % UNWIND_ROWS_PER_CHUNK,
        );
        let data = self.chunks.chunks.get(chunk)?;
        let mut mapped = self.mapped.borrow_mut();
        let writer = match mapped.entry(chunk) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(ChunkWriter::map(data).ok()?),
        };
        writer.read(within)
    }
}

impl RowChunks {
    /// A reader of the rows; chunks stay mapped while it lives.
    pub(super) fn reader(&self) -> RowReader<'_> {
        RowReader {
            chunks: self,
            mapped: Default::default(),
        }
    }

    pub(super) fn new(outer: ArrayOfMaps<MapData, MapData>, max_chunks: u32) -> Self {
        Self {
            outer,
            chunks: Vec::new(),
            max_chunks,
        }
    }

    /// Chunks created so far.
    pub(super) fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// No more chunks: the kernel refused the last one.
    pub(super) fn stop_growing(&mut self) {
        self.max_chunks = self.chunks.len() as u32;
    }

    /// Rows the chunks created so far hold.
    pub(super) fn rows(&self) -> u32 {
        self.chunks.len() as u32 * CHUNK_ROWS
    }

    /// Rows the array may grow to.
    pub(super) fn max_rows(&self) -> u32 {
        self.max_chunks.saturating_mul(CHUNK_ROWS)
    }

    /// Creates the next chunk and hands it to the kernel. Returns false at
    /// the cap or when the kernel refuses the memory.
    pub(super) fn grow(&mut self) -> Result<bool, BpfError> {
        let index = self.chunks.len() as u32;
        if index >= self.max_chunks {
            return Ok(false);
        }
        let name = clrbpf_common::names::MAP_UNWIND_ROW_CHUNKS;
        let definition = aya_obj::Map::new_from_params(
            aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
            size_of::<u32>() as u32,
            size_of::<UnwindRow>() as u32,
            CHUNK_ROWS,
            aya_obj::generated::BPF_F_MMAPABLE,
        );
        let map = MapData::create(definition, "unwind_rows", None)
            .map_err(|source| BpfError::Map { map: name, source })?;
        // Mappable now, or the chunk is of no use.
        drop(ChunkWriter::map(&map).map_err(|source| BpfError::Mmap { map: name, source })?);
        self.outer
            .set(index, &map, 0)
            .map_err(|source| BpfError::Map { map: name, source })?;
        self.chunks.push(map);
        Ok(true)
    }

    /// Copies `rows` to row `offset` of the array, mapping each chunk it
    /// touches for the copy.
    pub(super) fn write(&mut self, offset: u32, rows: &[UnwindRow]) -> std::io::Result<()> {
        assert!(
            offset as usize + rows.len() <= self.rows() as usize,
            "the arena hands out ranges inside the chunks"
        );
        let mut at = offset as usize;
        let mut rows = rows;
        while !rows.is_empty() {
            let (chunk, within) = (at / UNWIND_ROWS_PER_CHUNK, at % UNWIND_ROWS_PER_CHUNK);
            let n = rows.len().min(UNWIND_ROWS_PER_CHUNK - within);
            ChunkWriter::map_rows(&self.chunks[chunk], within, n)?.write(within, &rows[..n]);
            rows = &rows[n..];
            at += n;
        }
        Ok(())
    }
}
