//! Tests of the table builder on real system binaries (libc, xz, a C
//! program built here). The replays of live stacks and the tables of the
//! .NET runtimes' files are privileged tests: `tests/tests/end_to_end/unwind_replay.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clrbpf_common::unwind::{CfaRule, RaRule};
use object::{Object, ObjectSymbol};

use super::*;
use crate::process::maps::{Mapping, MappingTable};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_owned()
}

fn coreclr_dir() -> PathBuf {
    workspace_root().join("target/runtimes/net8/dnv/net/runtime/.net")
}

/// The mappings of this test process.
fn own_mappings() -> Vec<Mapping> {
    let maps = std::fs::File::open("/proc/self/maps").expect("/proc/self/maps");
    MappingTable::parse(std::io::BufReader::new(maps))
        .expect("/proc/self/maps")
        .mappings()
        .to_vec()
}

/// The libc.so.6 this test process runs with.
fn libc_path() -> String {
    own_mappings()
        .into_iter()
        .find_map(|m| {
            m.file_path()
                .filter(|p| p.ends_with("/libc.so.6"))
                .map(str::to_owned)
        })
        .expect("libc.so.6 mapped in the test process")
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
fn load_bias_maps_pcs_to_elf_addresses() {
    let path = libc_path();
    let table = table_of(&path);
    let data = std::fs::read(&path).expect("libc");
    let maps = own_mappings();
    let getpid_pc = libc::getpid as *const () as u64;
    let mapping = maps
        .iter()
        .find(|m| m.contains(getpid_pc))
        .expect("getpid mapped");
    assert_eq!(mapping.file_path(), Some(path.as_str()));
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
