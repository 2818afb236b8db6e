//! Tests of the table builder on real system binaries, and replays of live
//! stacks (a native program without frame pointers, a .NET thread blocked in
//! `Monitor.Enter`) through the same walk the kernel side runs.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clrbpf_common::unwind::{CfaRule, RaRule, UnwindError, UnwindRow, walk};
use object::{Object, ObjectSymbol};

use super::capture::{CapturedThread, capture_thread};
use super::*;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_owned()
}

fn coreclr_dir() -> PathBuf {
    workspace_root().join("target/runtimes/net8/dnv/net/runtime/.net")
}

/// The libc.so.6 this test process runs with.
fn libc_path() -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    parse_proc_maps(&maps)
        .into_iter()
        .find(|m| m.path.ends_with("/libc.so.6"))
        .expect("libc.so.6 mapped in the test process")
        .path
}

fn table_of(path: &str) -> UnwindTable {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
    let started = Instant::now();
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
fn check_row_index(table: &UnwindTable) {
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

fn dynamic_symbol(data: &[u8], name: &str) -> u64 {
    let elf = object::File::parse(data).expect("ELF");
    elf.dynamic_symbols()
        .find(|s| s.name() == Ok(name))
        .unwrap_or_else(|| panic!("symbol {name}"))
        .address()
}

#[test]
fn xz_without_frame_pointers() {
    let table = table_of("/usr/bin/xz");
    let s = table.stats();
    assert!(s.rows > 300, "{s:?}");
    assert_eq!(s.parse_errors, 0);
    // Its .plt has an FDE with binutils' PLT expression.
    assert!(s.plt_rows >= 1, "{s:?}");
    assert_eq!(s.unsupported_cfa_rows, 0, "{s:?}");
    assert!(matches!(table.identity(), FileIdentity::BuildId(id) if id.len() == 20));
}

#[test]
fn libc_rows_and_signal_trampoline() {
    let path = libc_path();
    let table = table_of(&path);
    let s = table.stats();
    assert!(s.rows > 10_000, "{s:?}");
    assert_eq!(s.parse_errors, 0);
    assert!(s.unsupported_fraction(table.rows()) < 0.01, "{s:?}");
    assert_eq!(s.signal_frame_rows, 1, "__restore_rt: {s:?}");
    // The signal frame row sits at __restore_rt - 1 (glibc starts the FDE
    // one byte early so `pc - 1` lookups of the return address find it).
    let data = std::fs::read(&path).expect("libc");
    let signal_row = table
        .rows()
        .iter()
        .find(|r| r.cfa_rule == CfaRule::SignalFrame as u8)
        .expect("signal row");
    // __restore_rt is `mov $15, %rax; syscall` (rt_sigreturn).
    let elf = object::File::parse(&*data).expect("ELF");
    let text = elf.section_by_name(".text").expect(".text");
    let code = object::ObjectSection::data_range(&text, signal_row.pc + 1, 9)
        .expect("readable")
        .expect("in .text");
    assert_eq!(code, [0x48, 0xc7, 0xc0, 0x0f, 0, 0, 0, 0x0f, 0x05]);
    // A function the test process itself runs: getpid's row says CFA = rsp + 8.
    let getpid = dynamic_symbol(&data, "getpid");
    let row = table.find_row(getpid).expect("getpid row");
    assert_eq!((row.cfa_rule, row.cfa_offset), (CfaRule::SpOffset as u8, 8));
    assert_eq!(row.ra_rule, RaRule::AtCfaOffset as u8);
    assert_eq!(row.ra_offset, -8);
}

#[test]
#[ignore = "needs the .NET runtime `cargo xtask setup` unpacks: run by cargo xtask test"]
fn libcoreclr_rows_and_synthesized_plt() {
    let path = coreclr_dir().join("shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so");
    let table = table_of(path.to_str().expect("utf-8 path"));
    let s = table.stats();
    assert!(s.rows > 50_000, "{s:?}");
    // lld emits no FDE for .plt.
    assert_eq!(s.synthesized_plt_sections, 1, "{s:?}");
    assert!(s.plt_rows >= 1);
    assert!(s.unsupported_fraction(table.rows()) < 0.01, "{s:?}");
}

#[test]
fn load_bias_maps_pcs_to_elf_addresses() {
    let path = libc_path();
    let table = table_of(&path);
    let data = std::fs::read(&path).expect("libc");
    let maps = parse_proc_maps(&std::fs::read_to_string("/proc/self/maps").expect("maps"));
    let getpid_pc = libc::getpid as *const () as u64;
    let mapping = maps
        .iter()
        .find(|m| m.start <= getpid_pc && getpid_pc < m.end)
        .expect("getpid mapped");
    assert_eq!(mapping.path, path);
    let bias = table
        .load_bias(mapping.start, mapping.offset)
        .expect("bias");
    assert_eq!(
        getpid_pc.wrapping_sub(bias),
        dynamic_symbol(&data, "getpid")
    );
    assert_eq!(table.load_bias(0x1000, 0x7fff_0000_0000), None);
}

/// libcoreclr's layout (lld): the read-only segment's last bytes and the
/// code segment's first share the file page 0x1a8000, at different vaddr
/// pages. The code mapping's bias comes from the code segment; taking the
/// first segment covering the offset shifted every pc by a page.
#[test]
fn load_bias_of_segments_sharing_a_file_page() {
    let segments = [
        LoadSegment {
            file_offset: 0,
            file_size: 0x1a801c,
            vaddr: 0,
        },
        LoadSegment {
            file_offset: 0x1a8020,
            file_size: 0x4b67e0,
            vaddr: 0x1a9020,
        },
        LoadSegment {
            file_offset: 0x65e800,
            file_size: 0x1d398,
            vaddr: 0x660800,
        },
    ];
    let code_start = 0x7f64_067a_9000;
    let bias = load_bias(&segments, code_start, 0x1a8000).expect("code mapping");
    assert_eq!(code_start + 0x3b0 - bias, 0x1a93b0);
    // The read-only mapping at offset 0 keeps its own bias.
    assert_eq!(
        load_bias(&segments, 0x7f64_0660_0000, 0),
        Some(0x7f64_0660_0000)
    );
    // An offset past every segment has none.
    assert_eq!(load_bias(&segments, 0x1000, 0x70_0000), None);
    // Hostile: empty and overflowing segments never panic.
    assert_eq!(load_bias(&[], 0x1000, 0), None);
    let huge = [LoadSegment {
        file_offset: u64::MAX - 1,
        file_size: u64::MAX,
        vaddr: u64::MAX,
    }];
    let _ = load_bias(&huge, u64::MAX, u64::MAX - 0xfff);
}

/// .NET 8 maps its JIT code from a memfd of gigabytes: only its first
/// bytes may be read. Sparse files stand in for it.
#[test]
fn huge_or_foreign_mapped_files_are_refused_before_reading() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("doublemapper");
    let file = std::fs::File::create(&path).expect("create");
    file.set_len(4 << 30).expect("sparse 4 GiB");
    let file = std::fs::File::open(&path).expect("open");
    assert!(matches!(
        table::read_elf_file(&file),
        Err(UnwindTableError::NotElf)
    ));
    std::fs::write(&path, b"\x7fELF").expect("magic");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.set_len(2 << 30).expect("sparse 2 GiB");
    let file = std::fs::File::open(&path).expect("open");
    assert!(matches!(
        table::read_elf_file(&file),
        Err(UnwindTableError::TooLarge { .. })
    ));
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").expect("empty");
    let file = std::fs::File::open(&empty).expect("open");
    assert!(matches!(
        table::read_elf_file(&file),
        Err(UnwindTableError::Read { .. })
    ));
}

/// A sparse GiB starting with `MZ` (any process can map one executable at
/// no cost on disk) is refused after its first page: its headers are no
/// PE image. Before, it was read whole (1.08 GB of RSS).
#[test]
fn a_sparse_file_posing_as_pe_costs_a_page() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sparse.dll");
    std::fs::write(&path, b"MZ").expect("magic");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.set_len(1 << 30).expect("sparse 1 GiB");
    let file = std::fs::File::open(&path).expect("open");
    assert!(matches!(
        table::read_elf_file(&file),
        Err(UnwindTableError::Parse { .. })
    ));
    assert!(table::read_build_id(&file).is_none());
}

/// What is read of one file stays within the read limit (the memory
/// budget's share for one file): a file whose unwind sections pass it gets
/// no table rather than the memory.
#[test]
fn the_bytes_read_of_a_file_are_bounded() {
    let file = std::fs::File::open(libc_path()).expect("open libc");
    let whole = table::read_elf_file(&file).expect("read");
    assert!(whole.bytes_read() > 4096);
    assert!(matches!(
        table::read_elf_file_within(&file, whole.bytes_read() - 1),
        Err(UnwindTableError::OverBudget { .. })
    ));
    let again = table::read_elf_file_within(&file, whole.bytes_read()).expect("within");
    assert_eq!(&*again, &*whole);
}

/// An ELF file is read sparsely (headers, notes, unwind sections), and
/// what is built from it is what the whole file gives.
#[test]
fn a_sparse_read_builds_the_table_of_the_whole_file() {
    let mut paths = vec![libc_path(), "/usr/bin/xz".to_owned()];
    // The test binary itself: large, with .debug_frame-free Rust code.
    paths.push(std::env::current_exe().expect("exe").display().to_string());
    let coreclr = coreclr_dir().join("shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so");
    if coreclr.exists() {
        paths.push(coreclr.display().to_string());
    }
    for path in &paths {
        let whole = std::fs::read(path).expect("read");
        let file = std::fs::File::open(path).expect("open");
        let sparse = table::read_elf_file(&file).expect("sparse read");
        assert_eq!(sparse.len(), whole.len(), "{path}");
        let resident = sparse.iter().filter(|&&b| b != 0).count();
        let expected = UnwindTable::from_elf_bytes(&whole).expect("table");
        let built = UnwindTable::from_elf_bytes(&sparse).expect("table");
        assert_eq!(built.identity(), expected.identity(), "{path}");
        assert!(
            matches!(built.identity(), FileIdentity::BuildId(_)),
            "{path} has a build id"
        );
        assert_eq!(built.rows(), expected.rows(), "{path}");
        assert_eq!(built.segments(), expected.segments(), "{path}");
        assert!(built.stats().rows > 100, "{path}");
        // The headers and notes alone give the same identity.
        assert_eq!(
            table::read_build_id(&file).as_ref(),
            Some(expected.identity()),
            "{path}"
        );
        // The code itself was not read.
        let nonzero = whole.iter().filter(|&&b| b != 0).count();
        assert!(
            resident * 2 < nonzero,
            "{path}: {resident} of {nonzero} bytes read"
        );
    }
}

#[test]
fn hostile_elf_files_never_panic() {
    let data = std::fs::read("/usr/bin/xz").expect("xz");
    let elf = object::File::parse(&*data).expect("ELF");
    let eh_frame = elf.section_by_name(".eh_frame").expect(".eh_frame");
    let (offset, size) = object::ObjectSection::file_range(&eh_frame).expect("in file");
    let (offset, size) = (offset as usize, size as usize);
    let full = UnwindTable::from_elf_bytes(&data).expect("xz").stats().rows;
    // Truncations anywhere.
    for cut in (0..data.len()).step_by(data.len() / 97) {
        let _ = UnwindTable::from_elf_bytes(&data[..cut]);
    }
    // Corrupt bytes in .eh_frame: every outcome but a panic is fine, and
    // flipping one byte never invents more than a few rows per FDE.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..300 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut corrupt = data.clone();
        let at = offset + (seed as usize) % size;
        corrupt[at] = (seed >> 32) as u8;
        if let Ok(table) = UnwindTable::from_elf_bytes(&corrupt) {
            check_table_shape(&table);
            assert!(table.stats().rows < full + 4096);
        }
    }
    assert!(UnwindTable::from_elf_bytes(b"\x7fELF").is_err());
    assert!(UnwindTable::from_elf_bytes(&[]).is_err());
}

#[test]
fn identity_is_the_build_id_else_a_whole_content_hash() {
    let data = std::fs::read("/usr/bin/xz").expect("xz");
    let id = FileIdentity::of_elf_bytes(&data).expect("xz");
    assert!(matches!(&id, FileIdentity::BuildId(b) if b.len() == 20));
    assert!(id.to_string().starts_with("build-id:"));
    // Without the note: hash of everything, so a change in the middle shows.
    let mut stripped = data.clone();
    let elf = object::File::parse(&*data).expect("ELF");
    let note = elf.section_by_name(".note.gnu.build-id").expect("note");
    let (offset, _) = object::ObjectSection::file_range(&note).expect("in file");
    // The note's type field (NT_GNU_BUILD_ID = 3) at offset 8: make it 0.
    stripped[offset as usize + 8] = 0;
    let hashed = FileIdentity::of_elf_bytes(&stripped).expect("ELF");
    assert!(matches!(hashed, FileIdentity::ContentHash(_)), "{hashed}");
    let middle = stripped.len() / 2;
    stripped[middle] ^= 0xff;
    assert_ne!(FileIdentity::of_elf_bytes(&stripped).expect("ELF"), hashed);
    assert_ne!(hashed.key(), id.key());
}

#[test]
fn cache_shares_by_identity_and_evicts_by_bytes() {
    let xz = std::fs::read("/usr/bin/xz").expect("xz");
    let libc = std::fs::read(libc_path()).expect("libc");
    let xz_size = UnwindTable::from_elf_bytes(&xz).expect("xz").size_bytes();
    let libc_size = UnwindTable::from_elf_bytes(&libc)
        .expect("libc")
        .size_bytes();
    assert!(libc_size > xz_size);

    let mut cache = UnwindTableCache::new(libc_size + xz_size);
    let a = cache.get_or_build(&xz).expect("xz");
    let b = cache.get_or_build(&xz).expect("xz again");
    assert!(std::sync::Arc::ptr_eq(&a, &b), "one table per file");
    cache.get_or_build(&libc).expect("libc");
    assert_eq!(cache.len(), 2);
    assert_eq!(cache.size_bytes(), libc_size + xz_size);
    assert!(cache.take_evicted().is_empty());

    // Shrinking evicts the least recently used (xz, then libc).
    cache.get(&FileIdentity::of_elf_bytes(&libc).expect("libc"));
    cache.set_capacity_bytes(libc_size);
    assert_eq!(cache.take_evicted(), [a.identity().clone()]);
    assert_eq!(cache.size_bytes(), libc_size);
    // A table larger than the whole cache is returned, not kept.
    cache.set_capacity_bytes(xz_size);
    cache.take_evicted();
    assert!(cache.is_empty());
    let big = cache.get_or_build(&libc).expect("libc");
    assert!(big.rows().len() > 1000);
    assert!(cache.is_empty());
    assert_eq!(cache.take_evicted().len(), 1);
}

/// Code compiled without `.eh_frame` for its functions (only crt files keep
/// theirs) gets its rows from `.debug_frame`.
#[test]
fn debug_frame_rows_fill_what_eh_frame_lacks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let program = build_chain_program_with(dir.path(), &["-g", "-fno-asynchronous-unwind-tables"]);
    let data = std::fs::read(&program).expect("chain");
    let table = UnwindTable::from_elf_bytes(&data).expect("table");
    check_table_shape(&table);
    let s = table.stats();
    assert!(s.debug_frame_fdes >= 4, "c, b, a, main: {s:?}");
    let elf = object::File::parse(&*data).expect("ELF");
    let c = elf
        .symbols()
        .find(|s| s.name() == Ok("c"))
        .expect("symbol c");
    // At entry: CFA = rsp + 8; after `push rbx; sub rsp, N`: a larger offset.
    let entry = table.find_row(c.address()).expect("row at c");
    assert_eq!(
        (entry.cfa_rule, entry.cfa_offset),
        (CfaRule::SpOffset as u8, 8)
    );
    let body = table
        .find_row(c.address() + c.size() / 2)
        .expect("row in c");
    assert_eq!(body.cfa_rule, CfaRule::SpOffset as u8);
    assert!(body.cfa_offset > 16, "{body:?}");
}

// ---- Live captures (ptrace), replayed through `walk` ----

/// Kills and reaps the child on drop, so a failing test leaves nothing
/// running, and removes the perf files a .NET child wrote (a later process
/// with the same pid must not find them).
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let pid = self.0.id();
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_file(format!("/tmp/perf-{pid}.map"));
        let _ = std::fs::remove_file(format!("/tmp/jit-{pid}.dump"));
    }
}

/// The next line of the child's stdout, or a panic after `timeout`.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn wait_line(rx: &mpsc::Receiver<String>, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => return line,
            Ok(_) => continue,
            Err(e) => panic!("no line starting with {prefix:?} from the child: {e}"),
        }
    }
}

/// Waits until thread `tid` sits in syscall `nr` (`/proc/.../syscall`).
fn wait_in_syscall(pid: u32, tid: u32, nr: u32) {
    let path = format!("/proc/{pid}/task/{tid}/syscall");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.split_whitespace().next() == Some(&nr.to_string()) {
            // Registers are stable once it is blocked in the kernel.
            return;
        }
        assert!(
            Instant::now() < deadline,
            "thread {tid} never entered syscall {nr}: {text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One walked frame, named for assertions and failure messages.
#[derive(Debug, Clone)]
struct NamedFrame {
    pc: u64,
    file: String,
    symbol: Option<String>,
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
fn replay(
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
fn frame_pointer_only(captured: &CapturedThread) -> usize {
    let mut out = [0u64; 128];
    walk(
        captured.regs,
        |_| Ok(None::<UnwindRow>),
        &captured.memory,
        &mut out,
    )
    .0
}

fn show(frames: &[NamedFrame]) -> String {
    frames.iter().map(|f| format!("\n  {f}")).collect()
}

fn build_chain_program(dir: &Path) -> PathBuf {
    build_chain_program_with(dir, &[])
}

fn build_chain_program_with(dir: &Path, gcc_args: &[&str]) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/unwind/testdata/build-chain.sh");
    let out = dir.join("chain");
    let status = Command::new("sh")
        .arg(&script)
        .arg(&out)
        .args(gcc_args)
        .status()
        .expect("running build-chain.sh (is gcc installed?)");
    assert!(status.success(), "build-chain.sh failed: {status}");
    out
}

const SYS_PAUSE: u32 = 34;
const SYS_FUTEX: u32 = 202;

/// Runs chain.c in `mode` and replays a capture of it once it is blocked in
/// syscall `blocked_in`, or (for the spinning mode) once the leaf is `c`
/// itself: right after "ready" it may still be returning from `write`.
fn capture_chain(
    mode: &str,
    blocked_in: Option<u32>,
) -> (Vec<NamedFrame>, Option<UnwindError>, usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let program = build_chain_program(dir.path());
    let mut child = KillOnDrop(
        Command::new(&program)
            .arg(mode)
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting chain"),
    );
    let rx = lines_of(&mut child.0);
    wait_line(&rx, "ready");
    let pid = child.0.id();
    if let Some(nr) = blocked_in {
        wait_in_syscall(pid, pid, nr);
    }
    for _ in 0..100 {
        let captured = capture_thread(pid as i32, pid as i32).expect("ptrace capture");
        let (frames, err, _) = replay(&captured);
        if blocked_in.is_some() || frames.first().and_then(|f| f.symbol.as_deref()) == Some("c") {
            return (frames, err, frame_pointer_only(&captured));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("chain never reached its capture point");
}

fn names(frames: &[NamedFrame]) -> Vec<&str> {
    frames
        .iter()
        .map(|f| f.symbol.as_deref().unwrap_or("?"))
        .collect()
}

fn is_libc(frame: &NamedFrame) -> bool {
    frame.file.ends_with("/libc.so.6")
}

/// main's caller in glibc 2.34+ is `__libc_start_call_main`, a static
/// function stripped from Debian's libc (so unnamed here), then
/// `__libc_start_main` and the program's `_start`, whose CFI marks the
/// return address undefined: a clean end.
fn assert_chain_tail(frames: &[NamedFrame], err: Option<UnwindError>) {
    let text = show(frames);
    assert_eq!(err, None, "walk ended with an error:{text}");
    let n = frames.len();
    assert!(n >= 7, "{text}");
    assert_eq!(
        names(&frames[n - 7..n - 3]),
        ["c", "b", "a", "main"],
        "{text}"
    );
    assert!(is_libc(&frames[n - 3]), "{text}");
    assert_eq!(
        frames[n - 2].symbol.as_deref(),
        Some("__libc_start_main"),
        "{text}"
    );
    assert!(is_libc(&frames[n - 2]), "{text}");
    assert_eq!(frames[n - 1].symbol.as_deref(), Some("_start"), "{text}");
}

#[test]
#[ignore = "needs ptrace (root) and gcc: run by cargo xtask test"]
fn replay_native_chain_blocked_in_libc() {
    let (frames, err, fp_only) = capture_chain("0", Some(SYS_PAUSE));
    eprintln!(
        "blocked in pause ({fp_only} frames by frame pointers):{}",
        show(&frames)
    );
    assert_eq!(frames.len(), 8, "{}", show(&frames));
    assert!(
        is_libc(&frames[0]) && frames[0].symbol.as_deref() == Some("pause"),
        "{}",
        show(&frames)
    );
    assert_chain_tail(&frames, err);
}

#[test]
#[ignore = "needs ptrace (root) and gcc: run by cargo xtask test"]
fn replay_native_chain_spinning() {
    let (frames, err, fp_only) = capture_chain("1", None);
    eprintln!(
        "spinning in c ({fp_only} frames by frame pointers):{}",
        show(&frames)
    );
    assert_eq!(frames.len(), 7, "{}", show(&frames));
    assert_chain_tail(&frames, err);
}

#[test]
#[ignore = "needs ptrace (root) and gcc: run by cargo xtask test"]
fn replay_native_chain_through_a_signal_frame() {
    let (frames, err, fp_only) = capture_chain("2", Some(SYS_PAUSE));
    let text = show(&frames);
    eprintln!("signal handler blocked in pause ({fp_only} frames by frame pointers):{text}");
    // pause <- on_signal <- __restore_rt <- kill <- c <- b <- a <- main <- ...
    assert_eq!(frames.len(), 11, "{text}");
    assert_eq!(frames[0].symbol.as_deref(), Some("pause"), "{text}");
    assert_eq!(frames[1].symbol.as_deref(), Some("on_signal"), "{text}");
    assert!(is_libc(&frames[2]), "__restore_rt: {text}");
    assert_eq!(frames[3].symbol.as_deref(), Some("kill"), "{text}");
    assert_chain_tail(&frames, err);
}

const MONITOR_APP: &str = r#"
using System;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;

static class App {
    public static readonly object Gate = new object();

    static void Main() {
        var held = new ManualResetEvent(false);
        var owner = new Thread(() => { lock (Gate) { held.Set(); Thread.Sleep(Timeout.Infinite); } });
        owner.IsBackground = true;
        owner.Start();
        held.WaitOne();
        var waiter = new Thread(Waiter.Run);
        waiter.Start();
        waiter.Join();
    }
}

static class Waiter {
    [DllImport("libc")] static extern int gettid();

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Run() {
        Console.WriteLine("waiter " + gettid());
        Console.Out.Flush();
        TakeLock();
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void TakeLock() {
        lock (App.Gate) { Console.WriteLine("never"); }
    }
}
"#;

/// `start size name` lines of `/tmp/perf-PID.map`, for the methods named.
fn perf_map_ranges(pid: u32, name: &str) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/tmp/perf-{pid}.map")).expect("perf map");
    text.lines()
        .filter(|l| l.contains(name))
        .filter_map(|l| {
            let mut fields = l.splitn(3, ' ');
            let start = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
            let size = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
            Some((start, start + size))
        })
        .collect()
}

/// Compiles C# `source` with `mcs` (plus `mcs_args`) into a temporary
/// directory and starts it on .NET 8 with `args`, perf maps on and stdout
/// piped. The directory lives as long as the returned guard is kept.
fn start_dotnet_app(
    source: &str,
    mcs_args: &[&str],
    args: &[&str],
) -> (tempfile::TempDir, KillOnDrop) {
    start_dotnet_app_on(
        &coreclr_dir().join("dotnet"),
        NET8_CONFIG,
        source,
        mcs_args,
        args,
    )
}

const NET8_CONFIG: &str = r#"{"runtimeOptions":{"tfm":"net8.0","framework":{"name":"Microsoft.NETCore.App","version":"8.0.0"}}}"#;
const NETCORE31_CONFIG: &str = r#"{"runtimeOptions":{"tfm":"netcoreapp3.1","framework":{"name":"Microsoft.NETCore.App","version":"3.1.0"},"configProperties":{"System.Globalization.Invariant":true}}}"#;

/// [`start_dotnet_app`] on the runtime of host `dotnet` with its
/// `runtimeconfig` JSON.
fn start_dotnet_app_on(
    dotnet: &Path,
    runtime_config: &str,
    source: &str,
    mcs_args: &[&str],
    args: &[&str],
) -> (tempfile::TempDir, KillOnDrop) {
    assert!(
        dotnet.exists(),
        "{} missing: run cargo xtask setup",
        dotnet.display()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("App.cs"), source).expect("App.cs");
    std::fs::write(dir.path().join("App.runtimeconfig.json"), runtime_config)
        .expect("runtimeconfig");
    let status = Command::new("mcs")
        .current_dir(dir.path())
        .args(mcs_args)
        .args(["-out:App.dll", "App.cs"])
        .stdout(Stdio::null())
        .status()
        .expect("running mcs");
    assert!(status.success(), "mcs failed");
    let child = KillOnDrop(
        Command::new(dotnet)
            .arg(dir.path().join("App.dll"))
            .args(args)
            // .NET Core 3.1 reads only the COMPlus_ spelling.
            .env("DOTNET_PerfMapEnabled", "1")
            .env("COMPlus_PerfMapEnabled", "1")
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting dotnet"),
    );
    (dir, child)
}

#[test]
#[ignore = "needs ptrace (root), mcs and the .NET runtime: run by cargo xtask test"]
fn replay_dotnet_thread_blocked_in_monitor_enter() {
    let (_dir, mut child) = start_dotnet_app(MONITOR_APP, &[], &[]);
    let pid = child.0.id();
    let rx = lines_of(&mut child.0);
    let line = wait_line(&rx, "waiter ");
    let tid: u32 = line["waiter ".len()..].trim().parse().expect("tid");
    wait_in_syscall(pid, tid, SYS_FUTEX);
    let captured = capture_thread(pid as i32, tid as i32).expect("ptrace capture");
    let (frames, err, tables) = replay(&captured);
    let fp_only = frame_pointer_only(&captured);
    let text = show(&frames);
    eprintln!("Monitor.Enter wait ({fp_only} frames by frame pointers, error {err:?}):{text}");

    let take_lock = perf_map_ranges(pid, "Waiter::TakeLock");
    let run = perf_map_ranges(pid, "Waiter::Run");
    assert!(
        !take_lock.is_empty() && !run.is_empty(),
        "methods missing from the perf map"
    );
    let within = |ranges: &[(u64, u64)], pc: u64| ranges.iter().any(|(s, e)| *s < pc && pc <= *e);

    // glibc's wait first, then libcoreclr, then the managed method that
    // takes the lock, then its caller.
    assert!(is_libc(&frames[0]), "leaf not in libc:{text}");
    let coreclr = frames
        .iter()
        .position(|f| f.file.ends_with("/libcoreclr.so"))
        .unwrap_or_else(|| panic!("no libcoreclr frame:{text}"));
    let managed = frames
        .iter()
        .position(|f| within(&take_lock, f.pc))
        .unwrap_or_else(|| panic!("no Waiter::TakeLock frame:{text}"));
    assert!(coreclr < managed, "{text}");
    assert!(frames[..coreclr].iter().all(is_libc), "{text}");
    assert!(
        within(&run, frames[managed + 1].pc),
        "Waiter::Run calls TakeLock:{text}"
    );
    assert!(
        tables
            .mapping_for(frames[managed].pc)
            .is_some_and(|m| m.table.is_none()),
        "JIT code unwinds by frame pointer"
    );
    // The walk goes on to the thread's start; whatever ends it is counted,
    // but not "no row" inside a file that has a table.
    assert_ne!(err, Some(UnwindError::NoTableRow), "{text}");
    assert!(
        fp_only < managed,
        "frame pointers alone reach the managed frame?"
    );
}

/// Table build time and memory for libc, libcoreclr and every file a
/// running .NET 8 process maps: the figures the report quotes.
#[test]
#[ignore = "measurement, needs the .NET runtime: cargo test -- --ignored --nocapture measure_"]
fn measure_table_sizes_of_a_dotnet_process() {
    // Perf maps on add only the jitdump's marker mapping, which is not ELF
    // and is skipped below.
    let (_dir, mut child) = start_dotnet_app(MONITOR_APP, &[], &[]);
    let pid = child.0.id();
    let rx = lines_of(&mut child.0);
    wait_line(&rx, "waiter ");
    let maps =
        parse_proc_maps(&std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps"));
    let mut paths: Vec<&str> = maps
        .iter()
        .filter(|m| m.executable && m.path.starts_with('/'))
        .map(|m| m.path.as_str())
        .collect();
    paths.sort();
    paths.dedup();
    let (mut total_rows, mut total_bytes, mut total_time) = (0, 0, Duration::ZERO);
    // Distinct rules (a row without its pc): the size of a deduplicated rule
    // table a packed kernel-side format would index.
    let mut rules = std::collections::HashSet::new();
    for path in paths {
        let Ok(data) = std::fs::read(path) else {
            continue;
        };
        let started = Instant::now();
        let Ok(table) = UnwindTable::from_elf_bytes(&data) else {
            eprintln!("{path}: not ELF, frame-pointer rule");
            continue;
        };
        let took = started.elapsed();
        eprintln!(
            "{path}: {} rows, {} KiB, built in {took:?}, unsupported {:.3}%",
            table.rows().len(),
            table.size_bytes() / 1024,
            100.0 * table.stats().unsupported_fraction(table.rows()),
        );
        rules.extend(table.rows().iter().map(|r| UnwindRow { pc: 0, ..*r }));
        total_rows += table.rows().len();
        total_bytes += table.size_bytes();
        total_time += took;
    }
    eprintln!(
        "process total: {total_rows} rows, {} KiB, built in {total_time:?}; {} distinct rules",
        total_bytes / 1024,
        rules.len()
    );
}

/// The workload of the `--dwarf-unwind` integration test: managed code
/// calling glibc's `qsort` with a managed comparer.
const QSORT_APP: &str = include_str!("../../../tests/workloads/Qsort.cs");

/// A .NET thread inside glibc's qsort, called by P/Invoke, calling back
/// into a managed comparer: JIT frames (frame pointers) above and below
/// glibc frames (no frame pointers). The walk must cross both ways and
/// reach the managed caller of qsort.
#[test]
#[ignore = "needs ptrace (root), mcs and the .NET runtime: run by cargo xtask test"]
fn replay_dotnet_thread_in_qsort_with_a_managed_comparer() {
    let (_dir, mut child) = start_dotnet_app(QSORT_APP, &["-optimize+"], &["30"]);
    let pid = child.0.id();
    let rx = lines_of(&mut child.0);
    wait_line(&rx, "READY");
    // Let the comparer tier up and the loop settle.
    std::thread::sleep(Duration::from_secs(1));
    let sort_many = perf_map_ranges(pid, "Qsort::SortMany");
    assert!(!sort_many.is_empty(), "SortMany missing from the perf map");
    let within = |pc: u64| sort_many.iter().any(|(s, e)| *s < pc && pc <= *e);
    let (mut in_libc, mut reached) = (0, 0);
    let mut failures = Vec::new();
    for _ in 0..15 {
        let captured = capture_thread(pid as i32, pid as i32).expect("ptrace capture");
        let (frames, err, _) = replay(&captured);
        let text = show(&frames);
        // msort_with_tmp is static: Debian's libc names no symbol for it.
        if frames.iter().any(is_libc) {
            in_libc += 1;
            if frames.iter().any(|f| within(f.pc)) {
                reached += 1;
            } else if failures.len() < 3 {
                failures.push(format!("error {err:?}:{text}"));
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "{reached} of {in_libc} captures in libc reach SortMany{}",
        failures.join("\n")
    );
    assert!(in_libc >= 5, "only {in_libc} of 15 captures in qsort");
    // Known gap (issue 3): about one run in four, one capture stopped in
    // glibc ends with BadRead at its first step. One such capture is
    // tolerated and printed; two mean a regression.
    assert!(
        reached + 1 >= in_libc,
        "{reached} of {in_libc} captures in libc reach SortMany:\n{}",
        failures.join("\n")
    );
}

// ---- ReadyToRun images ----

/// The `dotnet` host of a runtime: `$var`, else where `cargo xtask setup`
/// unpacks it.
fn dotnet_host(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/runtimes").join(default))
}

/// `System.Private.CoreLib.dll` next to a `dotnet` host.
fn corelib_of(dotnet: &Path) -> PathBuf {
    let shared = dotnet
        .parent()
        .expect("dotnet in a directory")
        .join("shared/Microsoft.NETCore.App");
    let version = std::fs::read_dir(&shared)
        .unwrap_or_else(|e| panic!("{}: {e} (run cargo xtask setup)", shared.display()))
        .filter_map(Result::ok)
        .find(|e| e.path().join("System.Private.CoreLib.dll").is_file())
        .unwrap_or_else(|| panic!("no CoreLib under {}", shared.display()));
    version.path().join("System.Private.CoreLib.dll")
}

/// Checks a real CoreLib's table against its code: every function whose
/// first instruction is `push rbp` has "rbp saved at CFA - 16, CFA = rsp +
/// 16" right after it, every `push rax` wrapper "CFA = rsp + 16, rbp
/// untouched", and the table has the shape the kernel search needs.
fn check_corelib(dotnet: &Path) {
    let path = corelib_of(dotnet);
    let data = std::fs::read(&path).expect("CoreLib");
    let started = Instant::now();
    let table = UnwindTable::from_elf_bytes(&data).expect("R2R table");
    let s = table.stats();
    eprintln!(
        "{}: {} functions ({} without a frame register, {} chained), {} rows, {} KiB, built in {:?}",
        path.display(),
        s.runtime_functions,
        s.functions_without_frame_register,
        s.chained_functions,
        s.rows,
        table.size_bytes() / 1024,
        started.elapsed()
    );
    assert!(s.runtime_functions > 20_000, "{s:?}");
    assert!(s.functions_without_frame_register > 1000, "{s:?}");
    assert_eq!(s.parse_errors, 0, "{s:?}");
    assert_eq!(s.overlapping_fdes, 0, "{s:?}");
    assert_eq!(
        (s.unsupported_cfa_rows, s.unsupported_fp_rows),
        (0, 0),
        "{s:?}"
    );
    assert!(!s.truncated);
    let rows = table.rows();
    for pair in rows.windows(2) {
        assert!(pair[0].pc < pair[1].pc, "unsorted: {pair:?}");
        assert!(!pair[0].same_rule(&pair[1]), "unmerged: {pair:?}");
    }
    assert_eq!(
        rows.last().map(|r| r.cfa_rule),
        Some(CfaRule::FramePointer as u8)
    );
    check_row_index(&table);

    let pe = object::read::pe::PeFile64::parse(&*data).expect("PE");
    let image_base = object::read::pe::ImageNtHeaders::optional_header(pe.nt_headers())
        .image_base
        .get(object::LittleEndian);
    let (functions, _) = ready_to_run::runtime_function_list(&pe, &data).expect("functions");
    let sections = pe.section_table();
    let (mut push_rbp, mut push_rax) = (0, 0);
    for f in &functions {
        let Some(code) = sections.pe_data_at(&*data, f.begin) else {
            panic!("function at RVA {:#x} outside the file", f.begin);
        };
        let va = image_base + u64::from(f.begin);
        let entry = table.find_row(va).copied();
        let managed = |rule, offset| {
            UnwindRow::new(0, rule, offset)
                .with_cfa_param(clrbpf_common::unwind::CFA_PARAM_EPILOG_BY_CODE)
        };
        assert_eq!(
            entry.map(|r| UnwindRow { pc: 0, ..r }),
            Some(managed(CfaRule::SpOffset, 8)),
            "entry of {va:#x}"
        );
        let after = table
            .find_row(va + 1)
            .copied()
            .map(|r| UnwindRow { pc: 0, ..r });
        match code.first() {
            Some(0x55) => {
                push_rbp += 1;
                assert_eq!(
                    after,
                    Some(managed(CfaRule::SpOffset, 16).with_fp_at(-16)),
                    "after push rbp at {va:#x}"
                );
            }
            Some(0x50) => {
                push_rax += 1;
                assert_eq!(
                    after,
                    Some(managed(CfaRule::SpOffset, 16)),
                    "after push rax at {va:#x}"
                );
            }
            _ => {}
        }
    }
    eprintln!("{push_rbp} functions start with push rbp, {push_rax} with push rax");
    assert!(push_rbp > 10_000 && push_rax > 100, "{push_rbp} {push_rax}");
}

#[test]
#[ignore = "needs the .NET runtime `cargo xtask setup` unpacks: run by cargo xtask test"]
fn ready_to_run_rows_of_net8_corelib() {
    check_corelib(&dotnet_host(
        "CLRBPF_DOTNET8",
        "net8/dnv/net/runtime/.net/dotnet",
    ));
}

#[test]
#[ignore = "needs the .NET runtime `cargo xtask setup` unpacks: run by cargo xtask test"]
fn ready_to_run_rows_of_netcore31_corelib() {
    check_corelib(&dotnet_host(
        "CLRBPF_DOTNET31",
        "netcore31/dotnetcore2/bin/dotnet",
    ));
}

/// A ReadyToRun image is named by its CodeView records, read with its
/// headers alone: a table kept on disk is found without reading the image.
#[test]
#[ignore = "needs the .NET runtime `cargo xtask setup` unpacks: run by cargo xtask test"]
fn ready_to_run_images_are_identified_from_their_headers() {
    for (var, default) in [
        ("CLRBPF_DOTNET8", "net8/dnv/net/runtime/.net/dotnet"),
        ("CLRBPF_DOTNET31", "netcore31/dotnetcore2/bin/dotnet"),
    ] {
        let path = corelib_of(&dotnet_host(var, default));
        let whole = std::fs::read(&path).expect("CoreLib");
        let expected = UnwindTable::from_elf_bytes(&whole).expect("table");
        let Some(FileIdentity::BuildId(id)) = Some(expected.identity()) else {
            panic!("{}: {} is no build id", path.display(), expected.identity());
        };
        // The tag and the headers' hash, then the records: .NET 8's
        // CoreLib has a perf map record and a CodeView record, .NET Core
        // 3.1's a CodeView record.
        assert!(id.starts_with(b"PE:"), "{}", path.display());
        let records = if var == "CLRBPF_DOTNET8" { 2 } else { 1 };
        assert_eq!(id.len(), 3 + 8 + records * 20, "{}", path.display());
        let file = std::fs::File::open(&path).expect("open");
        assert_eq!(
            table::read_build_id(&file).as_ref(),
            Some(expected.identity()),
            "{}",
            path.display()
        );
        // Another image of the same runtime is another identity.
        let other = path.with_file_name("System.Runtime.dll");
        let other = UnwindTable::from_elf_bytes(&std::fs::read(&other).expect("System.Runtime"))
            .map(|t| t.identity().clone());
        assert_ne!(other.ok().as_ref(), Some(expected.identity()));
        // Cut anywhere, the image never panics the reader.
        for cut in (0..whole.len()).step_by(whole.len() / 31 + 1) {
            let _ = table::pe_build_id(&whole[..cut]);
        }
        let mut damaged = whole.clone();
        for b in damaged.iter_mut().take(4096).skip(0x80).step_by(7) {
            *b ^= 0x5a;
        }
        let _ = table::pe_build_id(&damaged);
    }
}

/// A ReadyToRun image is read as its headers and sections, not whole, and
/// gives the table the whole file gives.
#[test]
#[ignore = "needs the .NET runtime `cargo xtask setup` unpacks: run by cargo xtask test"]
fn ready_to_run_images_are_read_by_section() {
    for (var, default) in [
        ("CLRBPF_DOTNET8", "net8/dnv/net/runtime/.net/dotnet"),
        ("CLRBPF_DOTNET31", "netcore31/dotnetcore2/bin/dotnet"),
    ] {
        let path = corelib_of(&dotnet_host(var, default));
        let whole = std::fs::read(&path).expect("CoreLib");
        let file = std::fs::File::open(&path).expect("open");
        let read = table::read_elf_file(&file).expect("read by section");
        assert!(read.bytes_read() <= whole.len() as u64 + 4096);
        let expected = UnwindTable::from_elf_bytes(&whole).expect("table");
        let built = UnwindTable::from_elf_bytes(&read).expect("table");
        assert_eq!(built.identity(), expected.identity(), "{}", path.display());
        assert_eq!(built.rows(), expected.rows(), "{}", path.display());
        assert_eq!(built.segments(), expected.segments(), "{}", path.display());
    }
}

/// Hostile R2R images: truncations anywhere and corrupt bytes in the
/// runtime functions and unwind infos never panic.
#[test]
#[ignore = "needs the .NET runtime `cargo xtask setup` unpacks: run by cargo xtask test"]
fn hostile_ready_to_run_images_never_panic() {
    let path = corelib_of(&dotnet_host(
        "CLRBPF_DOTNET31",
        "netcore31/dotnetcore2/bin/dotnet",
    ));
    let data = std::fs::read(&path).expect("CoreLib");
    for cut in (0..data.len()).step_by(data.len() / 23) {
        let _ = UnwindTable::from_elf_bytes(&data[..cut]);
    }
    let pe = object::read::pe::PeFile64::parse(&*data).expect("PE");
    let (functions, _) = ready_to_run::runtime_function_list(&pe, &data).expect("functions");
    let sections = pe.section_table();
    let (first, _) = sections
        .pe_file_range_at(functions[0].unwind_info)
        .expect("unwind info in the file");
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..60 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut corrupt = data.clone();
        // Unwind infos follow each other after the first one.
        let at = first as usize + (seed as usize) % (1 << 20);
        if let Some(b) = corrupt.get_mut(at) {
            *b = (seed >> 32) as u8;
        }
        if let Ok(table) = UnwindTable::from_elf_bytes(&corrupt) {
            for pair in table.rows().windows(2) {
                assert!(pair[0].pc < pair[1].pc);
            }
        }
    }
}

/// The workload of the frameless-wrapper tests (issue 13).
const FRAMELESS_APP: &str = include_str!("../../../tests/workloads/Frameless.cs");

/// Threads blocked in `ManualResetEventSlim.Wait(int)`,
/// `SemaphoreSlim.Wait(int)` and `Task.Wait(int)` (ReadyToRun code without
/// a frame), and one running a task inline under `Task.Wait()`: the walk with the
/// ReadyToRun tables reaches the user method that called the framework;
/// frame pointers alone skip it.
#[test]
#[ignore = "needs ptrace (root), mcs and the .NET runtime: run by cargo xtask test"]
fn replay_dotnet_threads_under_frameless_ready_to_run_wrappers() {
    replay_frameless_app(&coreclr_dir().join("dotnet"), NET8_CONFIG);
}

/// The same on .NET Core 3.1.
#[test]
#[ignore = "needs ptrace (root), mcs and the .NET runtime: run by cargo xtask test"]
fn replay_netcore31_threads_under_frameless_ready_to_run_wrappers() {
    replay_frameless_app(
        &dotnet_host("CLRBPF_DOTNET31", "netcore31/dotnetcore2/bin/dotnet"),
        NETCORE31_CONFIG,
    );
}

fn replay_frameless_app(dotnet: &Path, runtime_config: &str) {
    let (_dir, mut child) = start_dotnet_app_on(
        dotnet,
        runtime_config,
        FRAMELESS_APP,
        &["-optimize+"],
        &["0", "60", "600000"],
    );
    let pid = child.0.id();
    let rx = lines_of(&mut child.0);
    let mut tids = HashMap::new();
    // Five threads announce themselves (the fifth, "often", is not replayed).
    for _ in 0..5 {
        let line = wait_line(&rx, "TID ");
        let mut fields = line.split_whitespace().skip(1);
        let (Some(name), Some(tid)) = (fields.next(), fields.next()) else {
            panic!("bad line {line:?}");
        };
        tids.insert(name.to_owned(), tid.parse::<u32>().expect("tid"));
    }
    for (thread, method) in [
        ("mres", "Frameless::WaitMres"),
        ("semaphore", "Frameless::WaitSemaphore"),
        ("task", "Frameless::WaitTask"),
        ("burn", "Frameless::BurnUnderTaskWait"),
    ] {
        let tid = tids[thread];
        // A thread that has just printed its TID line may still be blocked
        // on the console's lock (another thread writing), a futex too but
        // not yet the wait: capture again until it is in the wait, or fail
        // with the last stack.
        let mut attempt = 0;
        let (captured, frames, err, tables, text, ranges, at) = loop {
            attempt += 1;
            if thread == "burn" {
                std::thread::sleep(Duration::from_millis(200));
            } else {
                wait_in_syscall(pid, tid, SYS_FUTEX);
            }
            let captured = capture_thread(pid as i32, tid as i32).expect("ptrace capture");
            let (frames, err, tables) = replay(&captured);
            let text = show(&frames);
            let ranges = perf_map_ranges(pid, method);
            let at = frames
                .iter()
                .position(|f| ranges.iter().any(|(s, e)| *s < f.pc && f.pc <= *e));
            match at {
                Some(at) => break (captured, frames, err, tables, text, ranges, at),
                None if attempt < 10 => std::thread::sleep(Duration::from_millis(300)),
                None => {
                    assert!(!ranges.is_empty(), "{method} missing from the perf map");
                    panic!(
                        "{thread}: no {method} frame in {attempt} captures (error {err:?}):{text}"
                    );
                }
            }
        };
        let within = |pc: u64| ranges.iter().any(|(s, e)| *s < pc && pc <= *e);
        // Right below it: framework code from a ReadyToRun image's table.
        let callee = tables
            .mapping_for(frames[at - 1].pc)
            .unwrap_or_else(|| panic!("{thread}: callee unmapped:{text}"));
        assert!(
            callee.path.ends_with(".dll") && callee.table.is_some(),
            "{thread}: {method}'s callee is not ReadyToRun code:{text}"
        );
        // Frame pointers alone lose it.
        let mut out = [0u64; 128];
        let (n, _) = walk(
            captured.regs,
            |_| Ok(None::<UnwindRow>),
            &captured.memory,
            &mut out,
        );
        assert!(
            !out[..n].iter().any(|pc| within(*pc)),
            "{thread}: frame pointers alone reach {method}: the wrapper has a frame?"
        );
        eprintln!("{thread}: {method} is frame {at} (error {err:?}):{text}");
    }
}
