//! Host-side replay of a captured stack: a process's executable mappings
//! with their unwind tables (the userspace model of the kernel-side
//! per-process mapping table), and a memory snapshot to read from. With
//! these, [`clrbpf_common::unwind::walk`] runs on the host exactly as in the
//! kernel: the "coredump suite" of regression tests, and a debugging aid.

use std::sync::Arc;

use clrbpf_common::unwind::{MemoryReader, UnwindError, UnwindRow};

use super::table::{UnwindTable, UnwindTableCache};

/// Pieces of a target's memory (stack, a few code bytes), each at its
/// address.
#[derive(Clone, Debug, Default)]
pub struct MemorySnapshot {
    regions: Vec<(u64, Vec<u8>)>,
}

impl MemorySnapshot {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the bytes read at `address`.
    pub fn add_region(&mut self, address: u64, bytes: Vec<u8>) {
        self.regions.push((address, bytes));
    }

    pub fn regions(&self) -> &[(u64, Vec<u8>)] {
        &self.regions
    }
}

impl MemoryReader for MemorySnapshot {
    fn read_u64(&self, addr: u64) -> Option<u64> {
        self.regions.iter().find_map(|(base, bytes)| {
            let at = usize::try_from(addr.checked_sub(*base)?).ok()?;
            let word = bytes.get(at..at.checked_add(8)?)?;
            Some(u64::from_le_bytes(word.try_into().ok()?))
        })
    }
}

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapsEntry {
    pub start: u64,
    pub end: u64,
    /// Offset in the file of `start`.
    pub offset: u64,
    pub executable: bool,
    /// The path (or `[stack]`-style name), empty for anonymous memory.
    pub path: String,
}

/// Parses `/proc/PID/maps`, skipping lines that do not parse.
pub fn parse_proc_maps(text: &str) -> Vec<MapsEntry> {
    text.lines().filter_map(parse_maps_line).collect()
}

fn parse_maps_line(line: &str) -> Option<MapsEntry> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    let offset = fields.next()?;
    let _device = fields.next()?;
    let _inode = fields.next()?;
    let path = fields.next().unwrap_or("").trim_start();
    Some(MapsEntry {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        offset: u64::from_str_radix(offset, 16).ok()?,
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        path: path.to_owned(),
    })
}

/// An executable mapping and how to unwind in it.
#[derive(Clone, Debug)]
pub struct UnwindMapping {
    pub start: u64,
    pub end: u64,
    /// pc - bias = the table's ELF virtual address.
    pub bias: u64,
    /// `None`: anonymous memory (JIT code), a file that is not ELF (a
    /// ReadyToRun `.dll`, CoreCLR's `memfd:doublemapper`), or a file that
    /// could not be read: the frame-pointer rule applies.
    pub table: Option<Arc<UnwindTable>>,
    pub path: String,
}

/// The executable mappings of one process, sorted by address.
#[derive(Clone, Debug, Default)]
pub struct ProcessUnwindTables {
    mappings: Vec<UnwindMapping>,
}

impl ProcessUnwindTables {
    /// Builds the tables of every executable mapping. `read_file` returns
    /// the bytes of a mapping's file (`None` for anonymous memory or a file
    /// it cannot or will not read); tables come from and go to `cache`.
    pub fn build(
        maps: &[MapsEntry],
        cache: &mut UnwindTableCache,
        mut read_file: impl FnMut(&MapsEntry) -> Option<Vec<u8>>,
    ) -> Self {
        let mut mappings: Vec<UnwindMapping> = maps
            .iter()
            .filter(|m| m.executable && m.start < m.end)
            .map(|m| {
                let table = read_file(m).and_then(|bytes| cache.get_or_build(&bytes).ok());
                let bias = table.as_ref().and_then(|t| t.load_bias(m.start, m.offset));
                UnwindMapping {
                    start: m.start,
                    end: m.end,
                    bias: bias.unwrap_or(0),
                    table: table.filter(|_| bias.is_some()),
                    path: m.path.clone(),
                }
            })
            .collect();
        mappings.sort_by_key(|m| m.start);
        Self { mappings }
    }

    pub fn mappings(&self) -> &[UnwindMapping] {
        &self.mappings
    }

    /// The mapping holding `pc`.
    pub fn mapping_for(&self, pc: u64) -> Option<&UnwindMapping> {
        let at = self.mappings.partition_point(|m| m.end <= pc);
        self.mappings.get(at).filter(|m| m.start <= pc)
    }

    /// The lookup [`clrbpf_common::unwind::walk`] needs: the row for `pc`, no
    /// row (frame-pointer rule) for mappings without a table, or the error
    /// that ends the walk.
    pub fn lookup(&self, pc: u64) -> Result<Option<UnwindRow>, UnwindError> {
        let mapping = self.mapping_for(pc).ok_or(UnwindError::NoMapping)?;
        let Some(table) = &mapping.table else {
            return Ok(None);
        };
        table
            .find_row(pc.wrapping_sub(mapping.bias))
            .copied()
            .map(Some)
            .ok_or(UnwindError::NoTableRow)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines() {
        let text = "\
55d0c0a00000-55d0c0a02000 r--p 00000000 fe:01 1234   /usr/bin/xz
55d0c0a02000-55d0c0a0c000 r-xp 00002000 fe:01 1234   /usr/bin/xz
7f0000000000-7f0000001000 rwxp 00000000 00:00 0 
7f0000002000-7f0000003000 r-xs 00000000 00:01 99     /memfd:doublemapper (deleted)
garbage line
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
";
        let maps = parse_proc_maps(text);
        assert_eq!(maps.len(), 5);
        assert_eq!(
            maps[1],
            MapsEntry {
                start: 0x55d0c0a02000,
                end: 0x55d0c0a0c000,
                offset: 0x2000,
                executable: true,
                path: "/usr/bin/xz".into(),
            }
        );
        assert_eq!(maps[2].path, "");
        assert!(maps[2].executable);
        assert_eq!(maps[3].path, "/memfd:doublemapper (deleted)");
        assert_eq!(maps[4].path, "[stack]");
        assert!(!maps[4].executable);
    }

    #[test]
    fn snapshot_reads_inside_regions_only() {
        let mut mem = MemorySnapshot::new();
        mem.add_region(0x1000, (0u8..16).collect());
        assert_eq!(mem.read_u64(0x1000), Some(0x0706_0504_0302_0100));
        assert_eq!(mem.read_u64(0x1008), Some(0x0f0e_0d0c_0b0a_0908));
        assert_eq!(mem.read_u64(0x1009), None);
        assert_eq!(mem.read_u64(0xfff), None);
        assert_eq!(mem.read_u64(u64::MAX), None);
    }

    #[test]
    fn lookup_rules() {
        let maps = parse_proc_maps(
            "1000-2000 r-xp 00000000 00:00 0 \n3000-4000 r-xp 00000000 00:01 7 /x.dll\n",
        );
        let tables =
            ProcessUnwindTables::build(&maps, &mut UnwindTableCache::new(1 << 20), |_| None);
        assert_eq!(tables.lookup(0x1800), Ok(None));
        assert_eq!(tables.lookup(0x3000), Ok(None));
        assert_eq!(tables.lookup(0x2000), Err(UnwindError::NoMapping));
        assert_eq!(tables.lookup(0x10), Err(UnwindError::NoMapping));
    }
}
