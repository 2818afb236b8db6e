//! Which `kallsyms` names kernel frames: `/proc/kallsyms`, or this boot's
//! table of the core kernel's functions kept in clrbpf's cache directory
//! (`--cache-dir`).
//!
//! The kernel formats the whole of `/proc/kallsyms` (some 120,000 lines)
//! at every read: about 40 ms of system CPU, and parsing it again another
//! 10 ms, a good part of a short recording's own CPU. The core kernel's
//! symbols do not move until the next boot, so the first run after a boot
//! keeps them, sorted, as a compact table ([`KernelTable`]) named by the
//! boot id, the loaded modules and the core kernel's text range; later
//! runs read its addresses (about 1 MiB) and each name they need. Addresses
//! outside that text (modules loaded since, BPF programs, trampolines) are
//! named from the live file, as is everything when there is no cache or
//! kallsyms hides its addresses.

use std::fs::File;
use std::io::Read as _;
use std::ops::Range;
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;

use twox_hash::XxHash3_64;

use crate::process::root::TargetDir;
use crate::unwind::disk_cache::{open_cache_dir, write_entry};

/// Largest kallsyms read (today's kernels: about 5 MiB).
const MAX_KALLSYMS_BYTES: u64 = 64 << 20;
/// Names of the kept tables; the text copies of earlier clrbpf versions
/// share the first part of it and are removed with the tables of other
/// boots.
const PREFIX: &str = "kallsyms-";
const TABLE_PREFIX: &str = "kallsyms-table-";
const MAGIC: &[u8; 8] = b"clrbpfK1";
/// Most functions a kept table holds (today's kernels: about 120,000).
const MAX_SYMBOLS: u64 = 4 << 20;
/// Longest symbol name (the kernel's `KSYM_NAME_LEN`).
const MAX_NAME_BYTES: u64 = 512;

/// This boot's core-kernel functions, sorted: their addresses in memory,
/// their names read from the file when asked for.
pub struct KernelTable {
    file: File,
    core_text: Range<u64>,
    addresses: Vec<u64>,
    /// `name_ends[i]` ends name `i` in the names, which start at
    /// `names_at` in the file.
    name_ends: Vec<u32>,
    names_at: u64,
}

/// Chooses what names each kernel address.
pub struct KernelSymbolFiles {
    cache_dir: Option<PathBuf>,
    /// `None` until the first kernel address; then the table, if any.
    table: Option<Option<KernelTable>>,
}

impl KernelSymbolFiles {
    /// Names from `/proc/kallsyms`, through this boot's table in
    /// `cache_dir` when there is one.
    pub fn new(cache_dir: Option<PathBuf>) -> Self {
        Self {
            cache_dir,
            table: None,
        }
    }

    /// The kept table when it covers `addr` (the core kernel's text);
    /// `None`: name it from the live `/proc/kallsyms`.
    pub fn table_for(&mut self, addr: u64) -> Option<&KernelTable> {
        let cache_dir = self.cache_dir.as_deref();
        self.table
            .get_or_insert_with(|| {
                cache_dir.and_then(|dir| {
                    open_table(dir)
                        .inspect_err(|error| tracing::debug!(%error, "no kept kallsyms table"))
                        .ok()
                })
            })
            .as_ref()
            .filter(|table| table.core_text.contains(&addr))
    }
}

impl KernelTable {
    /// The name of the function holding `addr`; `None` outside the core
    /// kernel's text or when the name cannot be read.
    pub fn name_of(&self, addr: u64) -> Option<String> {
        if !self.core_text.contains(&addr) {
            return None;
        }
        let i = self
            .addresses
            .partition_point(|&a| a <= addr)
            .checked_sub(1)?;
        let start = match i {
            0 => 0,
            _ => *self.name_ends.get(i - 1)?,
        };
        let end = *self.name_ends.get(i)?;
        let mut name = vec![0u8; end.checked_sub(start)? as usize];
        self.file
            .read_exact_at(&mut name, self.names_at + u64::from(start))
            .ok()?;
        String::from_utf8(name).ok()
    }

    /// Reads a kept table: header, addresses and name ends in memory,
    /// checked whole (sorted addresses inside the core text, names within
    /// the file and bounded), names left in the file.
    fn read(file: File, core_text: Range<u64>) -> std::io::Result<Self> {
        let bad = |what: &str| std::io::Error::other(format!("kept kallsyms table: {what}"));
        let len = file.metadata()?.len();
        let mut header = [0u8; 16];
        file.read_exact_at(&mut header, 0)?;
        if header[..8] != *MAGIC {
            return Err(bad("not a table"));
        }
        let count = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
        if count == 0 || count > MAX_SYMBOLS {
            return Err(bad("symbol count out of bounds"));
        }
        let addresses_at = 16u64;
        let ends_at = addresses_at + 8 * count;
        let names_at = ends_at + 4 * count;
        if names_at > len || len - names_at > count * MAX_NAME_BYTES {
            return Err(bad("sizes do not match the file"));
        }
        let mut bytes = vec![0u8; (names_at - addresses_at) as usize];
        file.read_exact_at(&mut bytes, addresses_at)?;
        let (address_bytes, end_bytes) = bytes.split_at((8 * count) as usize);
        let addresses: Vec<u64> = address_bytes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect();
        let name_ends: Vec<u32> = end_bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect();
        let sorted = addresses.windows(2).all(|w| w[0] < w[1]);
        let inside = addresses.first().is_some_and(|&a| core_text.contains(&a))
            && addresses.last().is_some_and(|&a| core_text.contains(&a));
        let mut previous = 0u32;
        let names_fit = name_ends.iter().all(|&end| {
            let fits = end >= previous && u64::from(end - previous) <= MAX_NAME_BYTES;
            previous = end;
            fits
        }) && u64::from(previous) == len - names_at;
        if !(sorted && inside && names_fit) {
            return Err(bad("damaged"));
        }
        Ok(Self {
            file,
            core_text,
            addresses,
            name_ends,
            names_at,
        })
    }
}

/// This boot's table in `dir`, written from `/proc/kallsyms` when missing.
fn open_table(dir: &std::path::Path) -> std::io::Result<KernelTable> {
    let dir = open_cache_dir(dir).map_err(std::io::Error::other)?;
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let boot_id = boot_id.trim();
    if boot_id.is_empty()
        || boot_id.len() > 64
        || !boot_id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
    {
        return Err(std::io::Error::other("unexpected boot id"));
    }
    // A kernel built without modules has no /proc/modules.
    let modules = match std::fs::read("/proc/modules") {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        other => other?,
    };
    let prefix = format!(
        "{TABLE_PREFIX}{boot_id}-{:016x}-",
        XxHash3_64::oneshot(&modules)
    );
    let kept = dir.entries()?.into_iter().find_map(|name| {
        let text = name.to_str()?;
        let range = text.strip_prefix(&prefix)?;
        let (start, end) = range.split_once('-')?;
        let core_text = u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?;
        Some((name, core_text))
    });
    let (name, core_text) = match kept {
        Some(kept) => kept,
        None => write_table(&dir, &prefix)?,
    };
    if core_text.is_empty() {
        return Err(std::io::Error::other("kept kallsyms table out of bounds"));
    }
    KernelTable::read(dir.open_file(&name)?, core_text)
}

/// Writes the table of `/proc/kallsyms`'s core-kernel functions, named
/// `prefix` + its core text range, and removes the tables (and text
/// copies) of other boots or module sets.
fn write_table(dir: &TargetDir, prefix: &str) -> std::io::Result<(std::ffi::OsString, Range<u64>)> {
    let mut text = Vec::new();
    File::open("/proc/kallsyms")?
        .take(MAX_KALLSYMS_BYTES + 1)
        .read_to_end(&mut text)?;
    if text.len() as u64 > MAX_KALLSYMS_BYTES {
        return Err(std::io::Error::other("kallsyms larger than the bound"));
    }
    let core_text = core_text(&text)
        .ok_or_else(|| std::io::Error::other("kallsyms has no _stext/_etext addresses"))?;
    let table = encode_table(&text, &core_text)
        .ok_or_else(|| std::io::Error::other("kallsyms has no core kernel functions"))?;
    let name =
        std::ffi::OsString::from(format!("{prefix}{:x}-{:x}", core_text.start, core_text.end));
    for old in dir.entries()? {
        if old.to_str().is_some_and(|n| n.starts_with(PREFIX)) {
            let _ = dir.unlink(&old);
        }
    }
    write_entry(dir, &name, &table)?;
    Ok((name, core_text))
}

/// The table of the functions (`t`, `T`, `w`, `W`) of kallsyms text inside
/// `core_text`: the header, the sorted addresses (one name per address, the
/// first listed), the names' ends, the names. `None` when there are none.
fn encode_table(text: &[u8], core_text: &Range<u64>) -> Option<Vec<u8>> {
    let mut symbols: Vec<(u64, &[u8])> = text
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            let mut fields = line.split(|&b| b == b' ' || b == b'\t');
            let address = std::str::from_utf8(fields.next()?).ok()?;
            let address = u64::from_str_radix(address, 16).ok()?;
            let kind = fields.next()?;
            let name = fields.next()?;
            let function = matches!(kind, [b't' | b'T' | b'w' | b'W']);
            (function
                && core_text.contains(&address)
                && !name.is_empty()
                && name.len() as u64 <= MAX_NAME_BYTES)
                .then_some((address, name))
        })
        .collect();
    symbols.sort_by_key(|&(address, _)| address);
    symbols.dedup_by_key(|&mut (address, _)| address);
    if symbols.is_empty() || symbols.len() as u64 > MAX_SYMBOLS {
        return None;
    }
    let names: usize = symbols.iter().map(|(_, n)| n.len()).sum();
    let mut out = Vec::with_capacity(16 + 12 * symbols.len() + names);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(symbols.len() as u64).to_le_bytes());
    for (address, _) in &symbols {
        out.extend_from_slice(&address.to_le_bytes());
    }
    let mut end = 0u32;
    for (_, name) in &symbols {
        end += name.len() as u32;
        out.extend_from_slice(&end.to_le_bytes());
    }
    for (_, name) in &symbols {
        out.extend_from_slice(name);
    }
    Some(out)
}

/// `[_stext, _etext)` from kallsyms text; `None` when it hides addresses
/// (`kptr_restrict`) or lacks either symbol.
fn core_text(text: &[u8]) -> Option<Range<u64>> {
    let address_of = |symbol: &str| {
        text.split(|&b| b == b'\n').find_map(|line| {
            let line = std::str::from_utf8(line).ok()?;
            let mut fields = line.split_ascii_whitespace();
            let address = fields.next()?;
            let _kind = fields.next()?;
            (fields.next()? == symbol).then(|| u64::from_str_radix(address, 16).ok())?
        })
    };
    let range = address_of("_stext")?..address_of("_etext")?;
    (range.start != 0 && !range.is_empty()).then_some(range)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_core_text_range_comes_from_stext_and_etext() {
        let text = b"ffffffff81000000 T _text\nffffffff81001000 T _stext\n\
            ffffffff81002000 t helper\nffffffff8220bb08 T _etext\n\
            ffffffffc0201000 t ftrace_trampoline\t[__builtin__ftrace]\n";
        assert_eq!(
            core_text(text),
            Some(0xffff_ffff_8100_1000..0xffff_ffff_8220_bb08)
        );
        // kptr_restrict: every address is zero.
        let hidden = b"0000000000000000 T _stext\n0000000000000000 T _etext\n";
        assert_eq!(core_text(hidden), None);
        assert_eq!(core_text(b"ffffffff81001000 T _stext\n"), None);
    }

    #[test]
    fn a_kept_table_names_functions_and_refuses_damage() {
        let text = b"ffffffff81000000 T _text\nffffffff81001000 T _stext\n\
            ffffffff81001000 T first_alias\nffffffff81002000 t helper\n\
            ffffffff81002800 d some_data\nffffffff81003000 W weak_fn\n\
            ffffffff8220bb08 T _etext\n\
            ffffffffc0201000 t ftrace_trampoline\t[__builtin__ftrace]\n";
        let core = core_text(text).unwrap();
        let table = encode_table(text, &core).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        std::fs::write(&path, &table).unwrap();
        let read = KernelTable::read(File::open(&path).unwrap(), core.clone()).unwrap();
        assert_eq!(read.name_of(0xffff_ffff_8100_1000), Some("_stext".into()));
        assert_eq!(read.name_of(0xffff_ffff_8100_2900), Some("helper".into()));
        assert_eq!(read.name_of(0xffff_ffff_8100_3010), Some("weak_fn".into()));
        assert_eq!(read.name_of(0xffff_ffff_8100_0fff), None, "before _stext");
        assert_eq!(read.name_of(0xffff_ffff_c020_1000), None, "a module");
        // Every cut and every flipped byte of the header and arrays is
        // refused or still names within the file, never panics.
        for cut in 0..table.len() {
            std::fs::write(&path, &table[..cut]).unwrap();
            assert!(KernelTable::read(File::open(&path).unwrap(), core.clone()).is_err());
        }
        for at in 0..table.len() {
            let mut damaged = table.clone();
            damaged[at] ^= 0x80;
            std::fs::write(&path, &damaged).unwrap();
            if let Ok(t) = KernelTable::read(File::open(&path).unwrap(), core.clone()) {
                let _ = t.name_of(0xffff_ffff_8100_2900);
            }
        }
    }

    /// As root: the first lookup writes this boot's table, a second
    /// symbolizer finds it, names core kernel addresses as the live file
    /// does, and leaves the rest to the live file.
    #[test]
    fn a_kept_table_serves_core_kernel_addresses_only() {
        let live = std::fs::read("/proc/kallsyms").unwrap_or_default();
        let Some(core) = core_text(&live) else {
            return; // addresses hidden without privileges: nothing to keep
        };
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let mut first = KernelSymbolFiles::new(Some(cache.clone()));
        assert!(first.table_for(core.start).is_some());
        let kept: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert!(kept[0].starts_with(TABLE_PREFIX));
        let mut second = KernelSymbolFiles::new(Some(cache));
        let table = second.table_for(core.start + 1).expect("kept table");
        assert!(table.name_of(core.start + 1).is_some());
        let schedule = String::from_utf8_lossy(&live)
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                let a = u64::from_str_radix(f.next()?, 16).ok()?;
                (f.next()? == "T" && f.next()? == "schedule").then_some(a)
            })
            .expect("schedule in kallsyms");
        assert_eq!(table.name_of(schedule + 4).as_deref(), Some("schedule"));
        assert!(
            second.table_for(core.end).is_none(),
            "past _etext: live file"
        );
        assert!(KernelSymbolFiles::new(None).table_for(core.start).is_none());
    }
}
