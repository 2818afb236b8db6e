//! Finding a native file's debug file on disk, the way gdb does, for
//! [`super::native`]: the paths come from [`super::debug_file`], the files
//! are opened through [`super::target_fs`]'s safe opener (inside the
//! target's root for its own paths, with `/` as the root on the host), and
//! a candidate is believed only when its build id is the file's.
//!
//! In order, first found wins:
//! 1. each `--debug-dir DIR` (host): `DIR/.build-id/xx/rest.debug`, then
//!    the symbol-store layout `dotnet-symbol` writes
//!    (`DIR/libcoreclr.so.dbg/elf-buildid-sym-<id>/libcoreclr.so.dbg`,
//!    `DIR/_.debug/elf-buildid-sym-<id>/_.debug`);
//! 2. inside the target's root: `/usr/lib/debug/.build-id/xx/rest.debug`
//!    and the file's `.gnu_debuglink` beside it, in `.debug/` beside it
//!    and under `/usr/lib/debug`;
//! 3. the same paths on the host.
//!
//! Bounded: at most [`MAX_DEBUG_DIRS`] directories, so a fixed number of
//! opens per file; each candidate read for its header, section table,
//! section names and build-id note only ([`super::debug_file`]'s bounds);
//! a debug file over [`MAX_DEBUG_FILE_BYTES`] is refused.

use std::{
    fs::File,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use super::debug_file::{self, ReadAt};
use super::target_fs;

/// Most `--debug-dir`s used.
pub const MAX_DEBUG_DIRS: usize = 16;
/// Largest debug file believed (blazesym maps it and parses its symbols
/// and line tables as they are asked for).
pub const MAX_DEBUG_FILE_BYTES: u64 = 2 << 30;

/// Where a debug file was found, for the summary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DebugFileSource {
    /// A `--debug-dir`.
    DebugDir,
    /// Inside the target's root.
    TargetRoot,
    /// On the host.
    Host,
}

/// A debug file whose build id matched.
#[derive(Debug)]
pub struct FoundDebugFile {
    pub file: File,
    pub source: DebugFileSource,
}

/// What looking for debug files came across, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DebugLookupStats {
    /// Candidates opened whose build id was another file's (or none).
    pub wrong_build_id: u64,
    /// Candidates refused for their size.
    pub too_large: u64,
    /// Files whose `.gnu_debuglink` or section table did not parse.
    pub malformed: u64,
}

/// `&File` read at an offset, for the pure parsers.
pub struct FileAt<'a>(pub &'a File);

impl ReadAt for FileAt<'_> {
    fn read_at(&mut self, offset: u64, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0; len];
        self.0.read_exact_at(&mut buf, offset).ok()?;
        Some(buf)
    }
}

/// The build id of `file` (its GNU build-id note), lower-case hex.
pub fn build_id_of(file: &File) -> Option<String> {
    let note = debug_file::find_section(&mut FileAt(file), b".note.gnu.build-id").ok()??;
    debug_file::parse_build_id_note(&note).ok()
}

/// The debug file of the file `original`, mapped by process `pid` at
/// `path` (as the process sees it), whose build id is `build_id`.
pub fn find_debug_file(
    pid: u32,
    path: &str,
    original: &File,
    build_id: &str,
    debug_dirs: &[PathBuf],
    stats: &mut DebugLookupStats,
) -> Option<FoundDebugFile> {
    let build_id_path = debug_file::build_id_path(build_id)?;
    let file_name = Path::new(path).file_name()?.to_str()?;
    for dir in debug_dirs.iter().take(MAX_DEBUG_DIRS) {
        let mut candidates = vec![dir.join(&build_id_path)];
        for key in debug_file::symbol_store_keys(file_name, build_id)
            .into_iter()
            .flatten()
        {
            candidates.push(dir.join(key));
        }
        for candidate in candidates {
            if let Some(file) = open_checked(Path::new("/"), &candidate, build_id, stats) {
                return Some(FoundDebugFile {
                    file,
                    source: DebugFileSource::DebugDir,
                });
            }
        }
    }
    let mut own_paths = vec![Path::new(debug_file::USR_LIB_DEBUG).join(&build_id_path)];
    match debug_file::find_section(&mut FileAt(original), b".gnu_debuglink") {
        Ok(Some(section)) => match debug_file::parse_debuglink(&section) {
            Ok(link) => {
                own_paths.extend(
                    debug_file::debuglink_candidates(path, &link.name)
                        .into_iter()
                        .flatten(),
                );
            }
            Err(_) => stats.malformed += 1,
        },
        Ok(None) => {}
        Err(_) => stats.malformed += 1,
    }
    let target_root = target_fs::proc_root(pid);
    for (root, source) in [
        (target_root.as_path(), DebugFileSource::TargetRoot),
        (Path::new("/"), DebugFileSource::Host),
    ] {
        for candidate in &own_paths {
            if let Some(file) = open_checked(root, candidate, build_id, stats) {
                return Some(FoundDebugFile { file, source });
            }
        }
    }
    None
}

/// `path` opened inside `root` when it is a regular file of believable
/// size whose build id is `build_id`.
fn open_checked(
    root: &Path,
    path: &Path,
    build_id: &str,
    stats: &mut DebugLookupStats,
) -> Option<File> {
    let file = target_fs::open_in_root_dir(root, path).ok()?;
    let size = file.metadata().ok()?.len();
    if size > MAX_DEBUG_FILE_BYTES {
        stats.too_large += 1;
        return None;
    }
    if build_id_of(&file).as_deref() != Some(build_id) {
        stats.wrong_build_id += 1;
        tracing::debug!(path = %path.display(), "debug file with another build id, not used");
        return None;
    }
    Some(file)
}
