//! Where a finished profile lands: the output format (from `--format` or
//! the file's extension) and the file itself.
//!
//! The profiler runs as root (through sudo) and often writes into shared
//! directories such as `/tmp`, so the file is written the safe way:
//!
//! 1. a new temporary file is created next to the target with
//!    `O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC`, mode 0600 (it holds every
//!    process's command line, thread names and exception messages, as
//!    perf's files do), so no symlink planted there is ever followed and no
//!    existing file is ever opened. It is given to the invoking user
//!    (`SUDO_UID`/`SUDO_GID`; perf leaves root-owned files behind, which
//!    users then cannot open or delete) right away. `record` does this when
//!    it starts, so a bad output path fails before any work;
//! 2. the profile is written and synced;
//! 3. `rename(2)` puts it at the target path. `rename` replaces a symlink
//!    at the target itself instead of writing where it points, and readers
//!    never see a half-written file. A write that fails (or an
//!    [`OutputFile`] dropped without [`OutputFile::commit`]) removes the
//!    temporary file and leaves the target as it was; a rename that fails
//!    (a directory planted at the target meanwhile) keeps the temporary
//!    file, whole, and the error names it.
//!
//! The directories on the path are the user's choice and are followed as
//! usual; only the last component is protected.

use std::{
    ffi::OsString,
    fmt,
    fs::{self, File, OpenOptions},
    io::{self, BufWriter, Write},
    os::unix::{
        ffi::{OsStrExt as _, OsStringExt as _},
        fs::OpenOptionsExt as _,
    },
    path::{Path, PathBuf},
    str::FromStr,
    sync::atomic::{AtomicU64, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

use super::{
    ExportError,
    collapsed::write_collapsed,
    flamegraph::{FlameGraphOptions, write_flamegraph_with},
    pprof::write_pprof,
};
use crate::profile::Profile;

/// Set by sudo to the invoking user's uid.
pub const SUDO_UID_ENV: &str = "SUDO_UID";
/// Set by sudo to the invoking user's gid.
pub const SUDO_GID_ENV: &str = "SUDO_GID";

/// How many temporary names to try before giving up: they only collide
/// when someone else creates files with our naming scheme.
const TEMP_ATTEMPTS: u32 = 64;

/// How much of the target's name the temporary name keeps, so the prefix
/// and suffix still fit in NAME_MAX (255 bytes).
const TEMP_NAME_KEEP: usize = 160;

/// Mode of a new output file, before the umask: the owner's only.
const OUTPUT_MODE: u32 = 0o600;

/// What a profile is written as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum OutputFormat {
    /// gzip-compressed pprof protobuf (`go tool pprof`, Pyroscope, Parca).
    Pprof,
    /// Folded stacks, one `root;...;leaf value` line per stack.
    #[value(alias = "folded")]
    Collapsed,
    /// Interactive SVG flame graph.
    #[value(alias = "flamegraph")]
    Svg,
}

impl OutputFormat {
    /// The format a file name asks for: `.pb.gz`, `.pb`, `.pprof` ->
    /// pprof; `.folded`, `.collapsed`, `.txt` -> collapsed; `.svg` -> SVG
    /// (case-insensitive). `None` for anything else.
    pub fn from_path(path: &Path) -> Option<Self> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        let has = |extension: &str| {
            name.strip_suffix(extension)
                .is_some_and(|stem| !stem.is_empty())
        };
        if has(".pb.gz") || has(".pb") || has(".pprof") {
            Some(Self::Pprof)
        } else if has(".folded") || has(".collapsed") || has(".txt") {
            Some(Self::Collapsed)
        } else if has(".svg") {
            Some(Self::Svg)
        } else {
            None
        }
    }

    /// The extension a file of this format gets by default.
    pub fn extension(self) -> &'static str {
        match self {
            Self::Pprof => ".pb.gz",
            Self::Collapsed => ".folded",
            Self::Svg => ".svg",
        }
    }

    /// The name `--format` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pprof => "pprof",
            Self::Collapsed => "collapsed",
            Self::Svg => "svg",
        }
    }
}

impl fmt::Display for OutputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OutputFormat {
    type Err = ExportError;

    /// The `--format` names and aliases, case-insensitive.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        <Self as clap::ValueEnum>::from_str(name, true).map_err(|_| ExportError::UnknownFormat {
            name: name.to_owned(),
        })
    }
}

/// The invoking user when running under sudo (`SUDO_UID`, `SUDO_GID`), to
/// give output files back to.
pub fn sudo_owner() -> Option<(u32, u32)> {
    owner_from(
        std::env::var(SUDO_UID_ENV).ok().as_deref(),
        std::env::var(SUDO_GID_ENV).ok().as_deref(),
    )
}

fn owner_from(uid: Option<&str>, gid: Option<&str>) -> Option<(u32, u32)> {
    Some((uid?.trim().parse().ok()?, gid?.trim().parse().ok()?))
}

/// An output file being written: a temporary file next to the target that
/// [`OutputFile::commit`] renames over it. Dropping it uncommitted removes
/// the temporary file.
pub struct OutputFile {
    writer: Option<BufWriter<File>>,
    temp_path: PathBuf,
    target: PathBuf,
}

/// Makes temporary names unique within this process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Starts writing `path`: creates the temporary file (see the module doc).
/// `owner` is the `(uid, gid)` the finished file is given to.
pub fn create_output(path: &Path, owner: Option<(u32, u32)>) -> Result<OutputFile, ExportError> {
    let not_a_file = || ExportError::NotAFilePath {
        path: path.to_owned(),
    };
    let file_name = path.file_name().ok_or_else(not_a_file)?;
    if fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(ExportError::OutputIsDirectory {
            path: path.to_owned(),
        });
    }
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        Some(_) => Path::new("."),
        None => return Err(not_a_file()),
    };
    let kept = &file_name.as_bytes()[..file_name.len().min(TEMP_NAME_KEEP)];
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.subsec_nanos());

    let mut last_error = None;
    for _ in 0..TEMP_ATTEMPTS {
        let count = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut temp_name = b".".to_vec();
        temp_name.extend_from_slice(kept);
        temp_name
            .extend_from_slice(format!(".{}.{nanos}.{count}.tmp", std::process::id()).as_bytes());
        let temp_path = dir.join(OsString::from_vec(temp_name));
        let opened = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(OUTPUT_MODE)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&temp_path);
        match opened {
            Ok(file) => {
                let output = OutputFile {
                    writer: Some(BufWriter::new(file)),
                    temp_path,
                    target: path.to_owned(),
                };
                // The final owner from the start; dropping `output` on
                // failure removes the temporary file.
                if let Some((uid, gid)) = owner
                    && let Some(writer) = output.writer.as_ref()
                {
                    std::os::unix::fs::fchown(writer.get_ref(), Some(uid), Some(gid)).map_err(
                        |source| ExportError::Chown {
                            path: path.to_owned(),
                            uid,
                            gid,
                            source,
                        },
                    )?;
                }
                return Ok(output);
            }
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => last_error = Some(error),
            Err(source) => {
                return Err(ExportError::CreateTemp {
                    dir: dir.to_owned(),
                    source,
                });
            }
        }
    }
    Err(ExportError::CreateTemp {
        dir: dir.to_owned(),
        source: last_error.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists)),
    })
}

impl OutputFile {
    /// The path the file will have once committed.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Where the file is until committed.
    pub fn temp_path(&self) -> &Path {
        &self.temp_path
    }

    /// Writes `profile` as `format` (see [`write_profile`]) and commits.
    pub fn write_profile(
        self,
        profile: &Profile,
        format: OutputFormat,
        sample_type_index: usize,
    ) -> Result<(), ExportError> {
        self.write_profile_with(
            profile,
            format,
            sample_type_index,
            &FlameGraphOptions::default(),
        )
    }

    /// [`Self::write_profile`], an SVG drawn as `flame_graph` asks.
    pub fn write_profile_with(
        mut self,
        profile: &Profile,
        format: OutputFormat,
        sample_type_index: usize,
        flame_graph: &FlameGraphOptions,
    ) -> Result<(), ExportError> {
        if format != OutputFormat::Pprof {
            super::check_sample_type_index(profile, sample_type_index)?;
        }
        let written = match format {
            OutputFormat::Pprof => write_pprof(profile, &mut self),
            OutputFormat::Collapsed => write_collapsed(profile, sample_type_index, &mut self),
            OutputFormat::Svg => {
                write_flamegraph_with(profile, sample_type_index, flame_graph, &mut self)
            }
        };
        written.map_err(|error| match error {
            ExportError::Write { source, .. } => ExportError::WriteOutput {
                path: self.target.clone(),
                source,
            },
            error => error,
        })?;
        self.commit()
    }

    /// Finishes the file: flushes and syncs it and renames it over the
    /// target. If the rename fails, the temporary file stays (the error
    /// names it): the profile is whole there.
    pub fn commit(mut self) -> Result<(), ExportError> {
        let writer = self
            .writer
            .take()
            .expect("an uncommitted OutputFile has a writer");
        let write_error = |source| ExportError::WriteOutput {
            path: self.target.clone(),
            source,
        };
        let file = writer
            .into_inner()
            .map_err(|error| write_error(error.into_error()))?;
        file.sync_all().map_err(write_error)?;
        drop(file);
        let renamed = fs::rename(&self.temp_path, &self.target);
        // Committed, or kept for the user: nothing for `drop` to remove.
        let temp_path = std::mem::take(&mut self.temp_path);
        renamed.map_err(|source| ExportError::Rename {
            from: temp_path,
            to: self.target.clone(),
            source,
        })
    }

    fn writer(&mut self) -> io::Result<&mut BufWriter<File>> {
        self.writer
            .as_mut()
            .ok_or_else(|| io::Error::other("output file already committed"))
    }
}

impl Write for OutputFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer()?.write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.writer()?.write_all(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.writer()?.flush()
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        if !self.temp_path.as_os_str().is_empty() {
            // Best effort: the file is ours and unfinished; an error here
            // (the directory vanished) leaves nothing to do.
            let _ = fs::remove_file(&self.temp_path);
        }
    }
}

/// Writes `profile` to `path` as `format`, atomically (see the module doc).
///
/// `sample_type_index` picks the value the folded stacks and the SVG show
/// ([`super::sample_type_index`] finds one by name); a pprof keeps every
/// sample type and ignores it. `owner` is the
/// `(uid, gid)` the file is given to, usually [`sudo_owner`].
pub fn write_profile(
    profile: &Profile,
    format: OutputFormat,
    sample_type_index: usize,
    path: &Path,
    owner: Option<(u32, u32)>,
) -> Result<(), ExportError> {
    // Checked before the file is created, so a bad index leaves no trace.
    if format != OutputFormat::Pprof {
        super::check_sample_type_index(profile, sample_type_index)?;
    }
    create_output(path, owner)?.write_profile(profile, format, sample_type_index)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt as _, symlink};

    use super::*;
    use crate::export::{pprof::read_pprof, test_profile};

    fn dir_entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn format_from_path() {
        let cases = [
            ("out.pb.gz", Some(OutputFormat::Pprof)),
            ("/tmp/x/cpu.PB.GZ", Some(OutputFormat::Pprof)),
            ("out.pb", Some(OutputFormat::Pprof)),
            ("out.pprof", Some(OutputFormat::Pprof)),
            ("out.folded", Some(OutputFormat::Collapsed)),
            ("out.collapsed", Some(OutputFormat::Collapsed)),
            ("stacks.txt", Some(OutputFormat::Collapsed)),
            ("flame.svg", Some(OutputFormat::Svg)),
            ("out.gz", None),
            ("out.json", None),
            ("out", None),
            (".svg", None),
            ("svg", None),
            ("/", None),
        ];
        for (path, expected) in cases {
            assert_eq!(OutputFormat::from_path(Path::new(path)), expected, "{path}");
        }
    }

    #[test]
    fn format_from_str_and_clap() {
        use clap::ValueEnum as _;
        for format in OutputFormat::value_variants() {
            assert_eq!(format.name().parse::<OutputFormat>().unwrap(), *format);
            assert_eq!(format.to_string(), format.name());
            assert_eq!(
                OutputFormat::from_path(Path::new(&format!("x{}", format.extension()))),
                Some(*format)
            );
        }
        assert_eq!("SVG".parse::<OutputFormat>().unwrap(), OutputFormat::Svg);
        assert_eq!(
            "folded".parse::<OutputFormat>().unwrap(),
            OutputFormat::Collapsed
        );
        assert!(matches!(
            "json".parse::<OutputFormat>(),
            Err(ExportError::UnknownFormat { name }) if name == "json"
        ));
    }

    #[test]
    fn owner_parsing() {
        assert_eq!(owner_from(Some("1000"), Some("100")), Some((1000, 100)));
        assert_eq!(owner_from(Some("1000"), None), None);
        assert_eq!(owner_from(None, Some("100")), None);
        assert_eq!(owner_from(Some("-1"), Some("100")), None);
        assert_eq!(owner_from(Some("root"), Some("0")), None);
    }

    #[test]
    fn commit_writes_the_target_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.txt");
        let mut output = create_output(&target, None).unwrap();
        output.write_all(b"hello\n").unwrap();
        assert_eq!(dir_entries(dir.path()).len(), 1, "only the temporary file");
        assert!(!target.exists(), "nothing at the target before commit");
        output.commit().unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"hello\n");
        assert_eq!(dir_entries(dir.path()), ["out.txt"]);
    }

    #[test]
    fn drop_without_commit_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.folded");
        fs::write(&target, "old").unwrap();
        let mut output = create_output(&target, None).unwrap();
        output.write_all(b"half").unwrap();
        drop(output);
        assert_eq!(fs::read_to_string(&target).unwrap(), "old");
        assert_eq!(dir_entries(dir.path()), ["out.folded"]);
    }

    #[test]
    fn symlink_at_the_target_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        let target = dir.path().join("cpu.pb.gz");
        symlink(&victim, &target).unwrap();

        let profile = test_profile::profile();
        write_profile(&profile, OutputFormat::Pprof, 0, &target, None).unwrap();

        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        let metadata = fs::symlink_metadata(&target).unwrap();
        assert!(metadata.file_type().is_file(), "the symlink was replaced");
        let pprof = read_pprof(&fs::read(&target).unwrap()).unwrap();
        assert_eq!(pprof.sample.len(), profile.samples.len());
        assert_eq!(dir_entries(dir.path()), ["cpu.pb.gz", "victim"]);
    }

    #[test]
    fn dangling_symlink_at_the_target_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("created-through-the-link");
        let target = dir.path().join("out.svg");
        symlink(&missing, &target).unwrap();
        write_profile(
            &test_profile::profile(),
            OutputFormat::Svg,
            1,
            &target,
            None,
        )
        .unwrap();
        assert!(!missing.exists(), "nothing was created through the link");
        assert!(fs::symlink_metadata(&target).unwrap().file_type().is_file());
        assert!(fs::read_to_string(&target).unwrap().starts_with("<?xml"));
    }

    #[test]
    fn every_format_writes_what_its_writer_writes() {
        let dir = tempfile::tempdir().unwrap();
        let profile = test_profile::profile();
        let folded = dir.path().join("a.folded");
        for index in [0, 1] {
            write_profile(&profile, OutputFormat::Collapsed, index, &folded, None).unwrap();
            let mut expected = Vec::new();
            write_collapsed(&profile, index, &mut expected).unwrap();
            assert_eq!(fs::read(&folded).unwrap(), expected);
        }
        let svg = dir.path().join("a.svg");
        write_profile(&profile, OutputFormat::Svg, 1, &svg, None).unwrap();
        assert!(fs::read_to_string(&svg).unwrap().contains("Hot.Spin"));
    }

    #[test]
    fn bad_sample_type_index_creates_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("a.svg");
        let profile = test_profile::profile();
        let result = write_profile(&profile, OutputFormat::Svg, 7, &target, None);
        assert!(matches!(
            result,
            Err(ExportError::SampleTypeOutOfRange { index: 7, count: 2 })
        ));
        let empty = Profile::default();
        let result = write_profile(&empty, OutputFormat::Collapsed, 0, &target, None);
        assert!(matches!(
            result,
            Err(ExportError::SampleTypeOutOfRange { index: 0, count: 0 })
        ));
        assert!(dir_entries(dir.path()).is_empty());
        // A pprof of an empty profile is fine.
        write_profile(&empty, OutputFormat::Pprof, 3, &target, None).unwrap();
    }

    #[test]
    fn invalid_pprof_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("a.pb.gz");
        fs::write(&target, "old").unwrap();
        let mut profile = test_profile::profile();
        profile.samples[0].values.push(1);
        let result = write_profile(&profile, OutputFormat::Pprof, 0, &target, None);
        assert!(matches!(result, Err(ExportError::InvalidPprof { .. })));
        assert_eq!(fs::read_to_string(&target).unwrap(), "old");
        assert_eq!(dir_entries(dir.path()), ["a.pb.gz"]);
    }

    #[test]
    fn owner_is_applied() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("a.folded");
        // SAFETY: plain getters without preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        // Root can give files away; anyone can "give" one to themselves.
        let owner = if uid == 0 { (65534, 65534) } else { (uid, gid) };
        write_profile(
            &test_profile::profile(),
            OutputFormat::Collapsed,
            0,
            &target,
            Some(owner),
        )
        .unwrap();
        let metadata = fs::metadata(&target).unwrap();
        assert_eq!((metadata.uid(), metadata.gid()), owner);
        assert_eq!(
            metadata.mode() & 0o777,
            0o600,
            "only the owner reads a profile"
        );
    }

    #[test]
    fn the_temporary_file_has_its_final_owner_and_mode_from_the_start() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: plain getters without preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let owner = if uid == 0 { (65534, 65534) } else { (uid, gid) };
        let output = create_output(&dir.path().join("a.pb.gz"), Some(owner)).unwrap();
        let metadata = fs::metadata(output.temp_path()).unwrap();
        assert_eq!((metadata.uid(), metadata.gid()), owner);
        assert_eq!(metadata.mode() & 0o777, 0o600);
    }

    #[test]
    fn a_directory_at_the_target_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("planted.pb.gz");
        fs::create_dir(&target).unwrap();
        assert!(matches!(
            create_output(&target, None),
            Err(ExportError::OutputIsDirectory { .. })
        ));
        assert_eq!(dir_entries(dir.path()), ["planted.pb.gz"]);
    }

    #[test]
    fn a_failed_rename_keeps_the_finished_profile_and_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("late.pb.gz");
        let output = create_output(&target, None).unwrap();
        // Planted after the start, as a local user could in /tmp.
        fs::create_dir(&target).unwrap();
        fs::write(target.join("x"), "x").unwrap();
        let error = output
            .write_profile(&test_profile::profile(), OutputFormat::Pprof, 0)
            .unwrap_err();
        let ExportError::Rename { from, .. } = &error else {
            panic!("expected a rename error, got {error:?}");
        };
        assert!(error.to_string().contains(&from.display().to_string()));
        let kept = fs::read(from).unwrap();
        let profile = read_pprof(&kept[..]).unwrap();
        assert!(!profile.sample.is_empty());
    }

    #[test]
    fn paths_that_name_no_file_are_refused() {
        for path in ["/", "..", "a/.."] {
            let result = create_output(Path::new(path), None);
            assert!(
                matches!(result, Err(ExportError::NotAFilePath { .. })),
                "{path}"
            );
        }
    }

    #[test]
    fn missing_directory_is_a_create_error() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("no/such/dir/a.svg");
        let result = create_output(&target, None);
        assert!(matches!(result, Err(ExportError::CreateTemp { .. })));
    }

    #[test]
    fn long_names_still_fit() {
        let dir = tempfile::tempdir().unwrap();
        let name = format!("{}.folded", "x".repeat(240));
        let target = dir.path().join(&name);
        let mut output = create_output(&target, None).unwrap();
        output.write_all(b"a 1\n").unwrap();
        output.commit().unwrap();
        assert_eq!(dir_entries(dir.path()), [name]);
    }

    #[test]
    fn relative_path_in_the_current_directory() {
        // `Path::parent` of a bare name is "": the temporary goes in ".".
        let output = create_output(Path::new("clrbpf-test-never-committed.svg"), None).unwrap();
        assert!(output.temp_path.starts_with("."));
        assert_eq!(
            output.target(),
            Path::new("clrbpf-test-never-committed.svg")
        );
        drop(output);
        assert!(!Path::new("clrbpf-test-never-committed.svg").exists());
    }
}
