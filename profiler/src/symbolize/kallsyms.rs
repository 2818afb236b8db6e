//! Which `kallsyms` names kernel frames: `/proc/kallsyms`, or this boot's
//! copy of it in clrbpf's cache directory (`--cache-dir`).
//!
//! The kernel formats the whole of `/proc/kallsyms` (some 120,000 lines)
//! at every read: about 40 ms of system CPU, a good part of a short
//! recording's own CPU. The core kernel's symbols do not move until the
//! next boot, so the first run after a boot keeps a copy, named by the
//! boot id, the loaded modules and the core kernel's text range, and later
//! runs name from it. Addresses outside that text (modules loaded since,
//! BPF programs, trampolines) are named from the live file, as is
//! everything when there is no cache or kallsyms hides its addresses.

use std::fs::File;
use std::io::Read as _;
use std::ops::Range;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use twox_hash::XxHash3_64;

use crate::process::root::{TargetDir, fd_path};
use crate::unwind::disk_cache::{open_cache_dir, write_entry};

/// Largest kallsyms read or kept (today's kernels: about 5 MiB).
const MAX_KALLSYMS_BYTES: u64 = 64 << 20;
const PREFIX: &str = "kallsyms-";

/// This boot's kept copy, open for as long as blazesym may read it.
struct KallsymsCopy {
    _file: File,
    /// `/proc/self/fd/N` of the open copy: exactly the file checked.
    path: PathBuf,
    core_text: Range<u64>,
}

/// Chooses the kallsyms file for each kernel address.
pub struct KernelSymbolFiles {
    cache_dir: Option<PathBuf>,
    /// `None` until the first kernel address; then the copy, if any.
    copy: Option<Option<KallsymsCopy>>,
}

impl KernelSymbolFiles {
    /// Names from `/proc/kallsyms`, through this boot's copy in
    /// `cache_dir` when there is one.
    pub fn new(cache_dir: Option<PathBuf>) -> Self {
        Self {
            cache_dir,
            copy: None,
        }
    }

    /// The kept copy to name `addr` from, `None` for the live
    /// `/proc/kallsyms`.
    pub fn copy_for(&mut self, addr: u64) -> Option<&Path> {
        let cache_dir = self.cache_dir.as_deref();
        self.copy
            .get_or_insert_with(|| {
                cache_dir.and_then(|dir| {
                    open_copy(dir)
                        .inspect_err(|error| tracing::debug!(%error, "no kept copy of kallsyms"))
                        .ok()
                })
            })
            .as_ref()
            .filter(|copy| copy.core_text.contains(&addr))
            .map(|copy| copy.path.as_path())
    }
}

/// This boot's copy in `dir`, written from `/proc/kallsyms` when missing.
fn open_copy(dir: &Path) -> std::io::Result<KallsymsCopy> {
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
    let prefix = format!("{PREFIX}{boot_id}-{:016x}-", XxHash3_64::oneshot(&modules));
    let kept = dir.entries()?.into_iter().find_map(|name| {
        let text = name.to_str()?;
        let range = text.strip_prefix(&prefix)?;
        let (start, end) = range.split_once('-')?;
        let core_text = u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?;
        Some((name, core_text))
    });
    let (name, core_text) = match kept {
        Some(kept) => kept,
        None => write_copy(&dir, &prefix)?,
    };
    let file = dir.open_file(&name)?;
    if file.metadata()?.len() > MAX_KALLSYMS_BYTES || core_text.is_empty() {
        return Err(std::io::Error::other("kept kallsyms out of bounds"));
    }
    Ok(KallsymsCopy {
        path: fd_path(file.as_fd()),
        _file: file,
        core_text,
    })
}

/// Writes a copy of `/proc/kallsyms` named `prefix` + its core text range,
/// and removes the copies of other boots or module sets.
fn write_copy(dir: &TargetDir, prefix: &str) -> std::io::Result<(std::ffi::OsString, Range<u64>)> {
    let mut text = Vec::new();
    File::open("/proc/kallsyms")?
        .take(MAX_KALLSYMS_BYTES + 1)
        .read_to_end(&mut text)?;
    if text.len() as u64 > MAX_KALLSYMS_BYTES {
        return Err(std::io::Error::other("kallsyms larger than the bound"));
    }
    let core_text = core_text(&text)
        .ok_or_else(|| std::io::Error::other("kallsyms has no _stext/_etext addresses"))?;
    let name =
        std::ffi::OsString::from(format!("{prefix}{:x}-{:x}", core_text.start, core_text.end));
    for old in dir.entries()? {
        if old.to_str().is_some_and(|n| n.starts_with(PREFIX)) {
            let _ = dir.unlink(&old);
        }
    }
    write_entry(dir, &name, &text)?;
    Ok((name, core_text))
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

    /// As root: the first lookup writes this boot's copy, a second
    /// symbolizer finds it, and only core kernel text is named from it.
    #[test]
    fn a_kept_copy_serves_core_kernel_addresses_only() {
        let live = std::fs::read("/proc/kallsyms").unwrap_or_default();
        let Some(core) = core_text(&live) else {
            return; // addresses hidden without privileges: nothing to keep
        };
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let mut first = KernelSymbolFiles::new(Some(cache.clone()));
        assert!(first.copy_for(core.start).is_some());
        let kept: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert!(kept[0].starts_with(PREFIX));
        let mut second = KernelSymbolFiles::new(Some(cache));
        assert!(second.copy_for(core.start + 1).is_some());
        assert!(
            second.copy_for(core.end).is_none(),
            "past _etext: live file"
        );
        assert!(KernelSymbolFiles::new(None).copy_for(core.start).is_none());
    }
}
