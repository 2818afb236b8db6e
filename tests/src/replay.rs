//! Host-side replay of a live stack: [`capture_thread`] stops a thread with
//! ptrace and copies its registers, stack and mappings; the process's
//! executable mappings get their unwind tables from the library (the
//! userspace model of the kernel-side per-process mapping table), and
//! [`clrbpf_common::unwind::walk`] runs over the copy exactly as in the
//! kernel. The "coredump suite" of `tests/unwind_replay.rs`.

use std::{collections::HashMap, fs::File, io, os::unix::fs::FileExt as _, sync::Arc};

use clrbpf_common::unwind::{CfaRule, MemoryReader, UnwindError, UnwindRegs, UnwindRow, walk};
use object::{Object as _, ObjectSymbol as _};

use clrbpf::{
    process::maps::parse_maps_line,
    unwind::{UnwindTable, UnwindTableCache},
};

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

/// Parses `/proc/PID/maps` with the library's parser, skipping lines that
/// do not parse.
pub fn parse_proc_maps(text: &str) -> Vec<MapsEntry> {
    text.lines()
        .filter_map(|line| parse_maps_line(line).ok())
        .map(|m| MapsEntry {
            start: m.start,
            end: m.end,
            offset: m.offset,
            executable: m.is_executable(),
            path: m.path.as_deref().unwrap_or("").to_owned(),
        })
        .collect()
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

/// Most stack bytes captured above sp.
const STACK_BYTES: u64 = 1 << 20;

/// What a replayed walk needs from one thread.
pub struct CapturedThread {
    pub regs: UnwindRegs,
    pub memory: MemorySnapshot,
    pub maps: Vec<MapsEntry>,
}

/// Detaches on drop, so a failing test never leaves a thread stopped.
struct Seized(libc::pid_t);

impl Drop for Seized {
    fn drop(&mut self) {
        // SAFETY: plain syscalls on a thread id; `status` outlives waitpid.
        unsafe {
            if libc::ptrace(libc::PTRACE_DETACH, self.0, 0usize, 0usize) == 0 {
                return;
            }
            // Detaching needs a ptrace-stopped tracee: an error path that
            // left before the stop (an interrupted waitpid on a loaded
            // machine) would leave the thread traced, and the next capture
            // would fail with EPERM. Stop it, then detach.
            libc::ptrace(libc::PTRACE_INTERRUPT, self.0, 0usize, 0usize);
            let mut status = 0;
            libc::waitpid(self.0, &mut status, libc::__WALL);
            libc::ptrace(libc::PTRACE_DETACH, self.0, 0usize, 0usize);
        }
    }
}

fn check(ret: libc::c_long, what: &str) -> io::Result<()> {
    if ret == -1 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

/// Stops thread `tid` of process `pid`, copies its registers, the stack
/// above sp (up to 1 MiB, within the stack's mapping), 64 bytes of code
/// around pc (for the leaf prologue check) and the process's maps, then
/// lets it go.
pub fn capture_thread(pid: libc::pid_t, tid: libc::pid_t) -> io::Result<CapturedThread> {
    // SAFETY: ptrace requests with integer arguments only.
    check(
        unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0usize, 0usize) },
        "PTRACE_SEIZE",
    )?;
    let seized = Seized(tid);
    // SAFETY: as above.
    check(
        unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0usize, 0usize) },
        "PTRACE_INTERRUPT",
    )?;
    let mut status = 0;
    loop {
        // SAFETY: `status` outlives the call.
        let waited = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
        if waited == tid {
            break;
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
    // SAFETY: user_regs_struct is plain integers; all-zero is valid.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    // SAFETY: PTRACE_GETREGS writes one user_regs_struct into `regs`.
    check(
        unsafe { libc::ptrace(libc::PTRACE_GETREGS, tid, 0usize, &mut regs as *mut _) },
        "PTRACE_GETREGS",
    )?;
    let maps = parse_proc_maps(&std::fs::read_to_string(format!("/proc/{pid}/maps"))?);
    let mem = File::open(format!("/proc/{pid}/mem"))?;
    let mut memory = MemorySnapshot::new();
    let sp = regs.rsp;
    if let Some(stack) = maps.iter().find(|m| m.start <= sp && sp < m.end) {
        let start = sp & !7;
        let end = stack.end.min(start + STACK_BYTES);
        memory.add_region(start, read_at(&mem, start, end - start)?);
    }
    let code = regs.rip.saturating_sub(32);
    if let Ok(bytes) = read_at(&mem, code, 64) {
        memory.add_region(code, bytes);
    }
    drop(seized);
    Ok(CapturedThread {
        regs: UnwindRegs {
            pc: regs.rip,
            sp: regs.rsp,
            fp: regs.rbp,
            lr: 0,
        },
        memory,
        maps,
    })
}

fn read_at(mem: &File, address: u64, len: u64) -> io::Result<Vec<u8>> {
    let len = usize::try_from(len).map_err(io::Error::other)?;
    let mut bytes = vec![0u8; len];
    mem.read_exact_at(&mut bytes, address)?;
    Ok(bytes)
}

/// One walked frame, named for assertions and failure messages.
#[derive(Debug, Clone)]
pub struct NamedFrame {
    pub pc: u64,
    pub file: String,
    pub symbol: Option<String>,
}

impl std::fmt::Display for NamedFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let file = self.file.rsplit('/').next().unwrap_or("");
        write!(
            f,
            "{:#x} {file}!{}",
            self.pc,
            self.symbol.as_deref().unwrap_or("?")
        )
    }
}

/// Names pcs with ELF symbol tables (`.symtab`, else `.dynsym`).
#[derive(Default)]
struct ElfSymbols {
    by_file: HashMap<String, Vec<(u64, u64, String)>>,
}

impl ElfSymbols {
    fn name(&mut self, tables: &ProcessUnwindTables, pc: u64, return_address: bool) -> NamedFrame {
        let Some(mapping) = tables.mapping_for(pc) else {
            return NamedFrame {
                pc,
                file: "?".into(),
                symbol: None,
            };
        };
        let symbols = self.by_file.entry(mapping.path.clone()).or_insert_with(|| {
            let Ok(data) = std::fs::read(&mapping.path) else {
                return Vec::new();
            };
            let Ok(elf) = object::File::parse(&*data) else {
                return Vec::new();
            };
            elf.symbols()
                .chain(elf.dynamic_symbols())
                .filter(|s| s.size() > 0)
                .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_owned())))
                .collect()
        });
        let vaddr = pc.wrapping_sub(mapping.bias) - u64::from(return_address);
        let symbol = mapping.table.as_ref().and_then(|_| {
            symbols
                .iter()
                .find(|(start, size, _)| *start <= vaddr && vaddr < start + size)
                .map(|(_, _, name)| name.clone())
        });
        NamedFrame {
            pc,
            file: mapping.path.clone(),
            symbol,
        }
    }
}

/// Walks a captured thread and names its frames.
pub fn replay(
    captured: &CapturedThread,
) -> (Vec<NamedFrame>, Option<UnwindError>, ProcessUnwindTables) {
    let mut cache = UnwindTableCache::new(1 << 30);
    let tables = ProcessUnwindTables::build(&captured.maps, &mut cache, |m| {
        if m.path.starts_with('/') {
            std::fs::read(&m.path).ok()
        } else {
            None
        }
    });
    let mut out = [0u64; 128];
    let (n, err) = walk(
        captured.regs,
        |pc| tables.lookup(pc),
        &captured.memory,
        &mut out,
    );
    let mut symbols = ElfSymbols::default();
    let frames = out[..n]
        .iter()
        .enumerate()
        .map(|(i, pc)| symbols.name(&tables, *pc, i > 0))
        .collect();
    (frames, err, tables)
}

/// What a frame-pointer-only walk (the kernel's `bpf_get_stack`) gets from
/// the same capture, for comparison.
pub fn frame_pointer_only(captured: &CapturedThread) -> usize {
    let mut out = [0u64; 128];
    walk(
        captured.regs,
        |_| Ok(None::<UnwindRow>),
        &captured.memory,
        &mut out,
    )
    .0
}

pub fn show(frames: &[NamedFrame]) -> String {
    frames.iter().map(|f| format!("\n  {f}")).collect()
}

/// The table of the ELF file at `path`, checked, its figures printed.
pub fn table_of(path: &str) -> UnwindTable {
    let file = File::open(path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
    let started = std::time::Instant::now();
    let table = UnwindTable::from_file(&file).unwrap_or_else(|e| panic!("table of {path}: {e}"));
    let s = table.stats();
    eprintln!(
        "{path}: {} rows ({} KiB) from {} FDEs in {:?}; unsupported: {:.3}% (cfa {}, fp {}, ra {}); plt rows {}, signal rows {}, synthesized plt sections {}, parse errors {}",
        s.rows,
        table.size_bytes() / 1024,
        s.fdes,
        started.elapsed(),
        100.0 * s.unsupported_fraction(table.rows()),
        s.unsupported_cfa_rows,
        s.unsupported_fp_rows,
        s.unsupported_ra_rows,
        s.plt_rows,
        s.signal_frame_rows,
        s.synthesized_plt_sections,
        s.parse_errors,
    );
    check_table_shape(&table);
    table
}

/// Sorted strictly, no two neighbours with the same rule, ends with NoInfo.
fn check_table_shape(table: &UnwindTable) {
    let rows = table.rows();
    for pair in rows.windows(2) {
        assert!(pair[0].pc < pair[1].pc, "unsorted: {pair:?}");
        assert!(!pair[0].same_rule(&pair[1]), "unmerged: {pair:?}");
    }
    if let Some(last) = rows.last() {
        assert_eq!(last.cfa_rule, CfaRule::NoInfo as u8);
    }
    check_row_index(table);
}

/// The row index finds what a binary search of the whole table finds, at
/// every row start, just around it and between rows; its words cost at
/// most one slot per 24 rows.
pub fn check_row_index(table: &UnwindTable) {
    let rows = table.rows();
    let index = table.row_index();
    eprintln!(
        "row index: {} words, {}-byte buckets, {} slots for {} rows",
        index.len,
        1u64 << index.shift,
        table.index_slots().len(),
        rows.len()
    );
    assert!(table.index_slots().len() <= rows.len().div_ceil(24) + 1);
    let mut probes = Vec::new();
    for pair in rows.windows(2) {
        let (a, b) = (pair[0].pc, pair[1].pc);
        probes.extend([
            a.wrapping_sub(1),
            a,
            a.wrapping_add(1),
            a + (b - a) / 2,
            b - 1,
        ]);
    }
    if let Some(last) = rows.last() {
        probes.extend([
            last.pc,
            last.pc.wrapping_add(1),
            last.pc.wrapping_add(0x10_0000),
            u64::MAX,
            0,
        ]);
    }
    for pc in probes {
        assert_eq!(
            table.find_row(pc),
            clrbpf_common::unwind::find_row(rows, pc),
            "pc {pc:#x}"
        );
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
