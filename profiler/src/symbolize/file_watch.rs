//! Change signals for the perf files the runtimes write (`inotify`), so
//! that the once-a-second check for newly compiled code
//! ([`super::managed::ManagedSymbols::refresh`], for the unwinder's JIT
//! rows) costs nothing for a process that compiles nothing.
//!
//! 1. A process's jitdump is opened safely inside its root
//!    ([`super::target_fs`]); the watch is added on that open file through
//!    `/proc/self/fd/N`, so it watches the very inode that was checked and
//!    never follows a path of the target's.
//! 2. One inotify descriptor serves every process ([`FileWatch`]); the
//!    pipeline drains it once a tick ([`FileWatch::drain`]), and each
//!    event marks its file's [`WatchedFile`] as changed. A lost event
//!    queue (`IN_Q_OVERFLOW`) marks every file changed.
//! 3. A file whose watch says "unchanged" is not opened again; a changed
//!    one, a removed watch (`IN_IGNORED`: the file was deleted) or a file
//!    without a watch is checked as before, by opening and `fstat`.
//!
//! Limits: at most [`MAX_WATCHES`] files are watched (and fewer if the
//! host's `fs.inotify.max_user_watches` says so); past that, and where
//! inotify is unavailable, files are polled. Writes the kernel does not
//! report to inotify (through a shared writable mapping) are caught by the
//! slower check the caller keeps as a backstop.

use std::{
    collections::HashMap,
    fs::File,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, Ordering},
    },
};

/// Files watched at most per run: a node's .NET processes, with room.
pub const MAX_WATCHES: usize = 4096;

/// What any of these events on a watched file means: it may hold more.
const WATCHED_EVENTS: u32 =
    libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_DELETE_SELF | libc::IN_MOVE_SELF;

/// Bytes of `struct inotify_event` before its name.
const EVENT_HEADER: usize = 16;

/// The run's inotify descriptor, shared by every process's perf files;
/// cloning shares it. Without inotify ([`Self::unavailable`]) every file
/// is polled.
#[derive(Clone, Debug, Default)]
pub struct FileWatch {
    inner: Option<Arc<Mutex<Watches>>>,
}

#[derive(Debug)]
struct Watches {
    fd: OwnedFd,
    /// Watch descriptor to the files it signals (one inode watched twice,
    /// e.g. a `/tmp` shared by two containers, gets one descriptor).
    by_wd: HashMap<i32, Vec<Arc<ChangeFlag>>>,
    /// Watches refused (limit reached): logged once.
    refused: u64,
}

#[derive(Debug, Default)]
struct ChangeFlag {
    changed: AtomicBool,
    /// The kernel removed the watch (the file was deleted).
    gone: AtomicBool,
}

/// One watched file; dropping it removes the watch.
#[derive(Debug)]
pub struct WatchedFile {
    wd: i32,
    flag: Arc<ChangeFlag>,
    watches: Weak<Mutex<Watches>>,
}

impl FileWatch {
    /// A watch with its own inotify descriptor, or one that polls
    /// everything when inotify cannot be had (said once at debug level).
    pub fn new() -> Self {
        // SAFETY: no pointers; the result is checked.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            tracing::debug!(
                error = %io::Error::last_os_error(),
                "no inotify: perf files are polled for new code"
            );
            return Self::unavailable();
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Self {
            inner: Some(Arc::new(Mutex::new(Watches {
                fd,
                by_wd: HashMap::new(),
                refused: 0,
            }))),
        }
    }

    /// A watch that watches nothing: every file is polled.
    pub fn unavailable() -> Self {
        Self { inner: None }
    }

    /// Watches the open `file` for writes, attribute changes (a removal)
    /// and its deletion; `None` when it cannot be (no inotify, limits):
    /// then the file is polled.
    pub fn watch(&self, file: &File) -> Option<WatchedFile> {
        let inner = self.inner.as_ref()?;
        let mut watches = lock(inner);
        let wd = add_watch(&watches, file, watches.by_wd.len() >= MAX_WATCHES);
        let wd = match wd {
            Ok(wd) => wd,
            Err(error) => {
                watches.refused += 1;
                if watches.refused == 1 {
                    tracing::debug!(
                        %error,
                        watched = watches.by_wd.len(),
                        "cannot watch more perf files: the others are polled for new code"
                    );
                }
                return None;
            }
        };
        let flag = Arc::new(ChangeFlag::default());
        watches.by_wd.entry(wd).or_default().push(Arc::clone(&flag));
        Some(WatchedFile {
            wd,
            flag,
            watches: Arc::downgrade(inner),
        })
    }

    /// Takes the events the kernel queued and marks their files changed.
    /// Never blocks.
    pub fn drain(&self) {
        let Some(inner) = self.inner.as_ref() else {
            return;
        };
        let mut watches = lock(inner);
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: the buffer is valid for its length.
            let n =
                unsafe { libc::read(watches.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            let Ok(n) = usize::try_from(n) else {
                // EAGAIN: nothing more queued; any other error: polled
                // files are checked anyway, watched ones at the backstop.
                break;
            };
            if n == 0 {
                break;
            }
            for (wd, mask) in parse_events(&buf[..n.min(buf.len())]) {
                watches.apply(wd, mask);
            }
        }
    }

    /// Files watched now.
    pub fn watched(&self) -> usize {
        self.inner
            .as_ref()
            .map_or(0, |inner| lock(inner).by_wd.len())
    }
}

impl Watches {
    fn apply(&mut self, wd: i32, mask: u32) {
        if mask & libc::IN_Q_OVERFLOW != 0 {
            // Events were lost: any file may have changed.
            for flag in self.by_wd.values().flatten() {
                flag.changed.store(true, Ordering::Relaxed);
            }
            return;
        }
        let ignored = mask & libc::IN_IGNORED != 0;
        let flags = if ignored {
            self.by_wd.remove(&wd).unwrap_or_default()
        } else {
            self.by_wd.get(&wd).cloned().unwrap_or_default()
        };
        for flag in flags {
            flag.changed.store(true, Ordering::Relaxed);
            if ignored {
                flag.gone.store(true, Ordering::Relaxed);
            }
        }
    }
}

impl WatchedFile {
    /// Whether the file may have changed since the last call; clears the
    /// mark. A file whose watch the kernel removed always may have.
    pub fn take_changed(&self) -> bool {
        self.flag.changed.swap(false, Ordering::Relaxed) || self.is_gone()
    }

    /// Whether the file changed since the last [`Self::take_changed`],
    /// without clearing the mark.
    pub fn changed(&self) -> bool {
        self.flag.changed.load(Ordering::Relaxed) || self.is_gone()
    }

    fn is_gone(&self) -> bool {
        self.flag.gone.load(Ordering::Relaxed)
    }

    /// Marks the file changed (its last read stopped short of its end).
    pub fn mark_changed(&self) {
        self.flag.changed.store(true, Ordering::Relaxed);
    }
}

impl Drop for WatchedFile {
    fn drop(&mut self) {
        let Some(inner) = self.watches.upgrade() else {
            return;
        };
        let mut watches = lock(&inner);
        let Some(flags) = watches.by_wd.get_mut(&self.wd) else {
            return; // removed by the kernel already (IN_IGNORED)
        };
        flags.retain(|flag| !Arc::ptr_eq(flag, &self.flag));
        if flags.is_empty() {
            watches.by_wd.remove(&self.wd);
            // SAFETY: no pointers. A failure (the kernel removed it first)
            // leaves nothing to undo.
            unsafe { libc::inotify_rm_watch(watches.fd.as_raw_fd(), self.wd) };
        }
    }
}

/// One process's perf file as [`FileWatch`] sees it: whether it can be
/// left unread now. Kept beside the file's parser.
#[derive(Debug, Default)]
pub struct WatchedPerfFile {
    watch: FileWatch,
    /// The watch, on the file of this `(st_dev, st_ino)`.
    current: Option<((u64, u64), WatchedFile)>,
    /// The last read reached the file's end (not the per-read byte bound).
    caught_up: bool,
}

impl WatchedPerfFile {
    pub fn new(watch: FileWatch) -> Self {
        Self {
            watch,
            current: None,
            caught_up: false,
        }
    }

    /// Before a read of the open `file` (whose identity is `identity`):
    /// watches it if it is not yet (a replaced file gets a new watch), and
    /// takes its change mark, so a write during the read marks it again.
    pub fn before_read(&mut self, file: &File, identity: Option<(u64, u64)>) {
        if self.current.as_ref().map(|(id, _)| Some(*id)) != Some(identity) {
            self.current = identity.zip(self.watch.watch(file));
        }
        if let Some((_, watched)) = &self.current {
            watched.take_changed();
        }
    }

    /// After the read: whether it reached the end of the file.
    pub fn after_read(&mut self, caught_up: bool) {
        self.caught_up = caught_up;
    }

    /// The file could not be read (missing, stale, failed): polled again.
    pub fn lost(&mut self) {
        self.current = None;
        self.caught_up = false;
    }

    /// Whether the file is watched, was read to its end, and nothing was
    /// written to it since: reading it again would find nothing.
    pub fn unchanged(&self) -> bool {
        self.caught_up
            && self
                .current
                .as_ref()
                .is_some_and(|(_, watched)| !watched.changed())
    }
}

fn lock(inner: &Mutex<Watches>) -> std::sync::MutexGuard<'_, Watches> {
    inner
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Adds the watch on the inode `file` has open, through its descriptor's
/// magic link: no path of the target's is resolved again.
fn add_watch(watches: &Watches, file: &File, full: bool) -> io::Result<i32> {
    if full {
        return Err(io::Error::other(format!(
            "{MAX_WATCHES} perf files watched already"
        )));
    }
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(io::Error::other)?;
    // SAFETY: `path` is a valid C string for the call.
    let wd =
        unsafe { libc::inotify_add_watch(watches.fd.as_raw_fd(), path.as_ptr(), WATCHED_EVENTS) };
    if wd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(wd)
}

/// `(wd, mask)` of each whole `struct inotify_event` in `bytes`.
fn parse_events(bytes: &[u8]) -> impl Iterator<Item = (i32, u32)> + '_ {
    let mut at = 0usize;
    std::iter::from_fn(move || {
        let header = bytes.get(at..at.checked_add(EVENT_HEADER)?)?;
        let word = |i: usize| -> [u8; 4] {
            let mut w = [0u8; 4];
            w.copy_from_slice(&header[i..i + 4]);
            w
        };
        let wd = i32::from_ne_bytes(word(0));
        let mask = u32::from_ne_bytes(word(4));
        let name_len = usize::try_from(u32::from_ne_bytes(word(12))).ok()?;
        at = at.checked_add(EVENT_HEADER)?.checked_add(name_len)?;
        Some((wd, mask))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn event(wd: i32, mask: u32, name_len: u32) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend(wd.to_ne_bytes());
        bytes.extend(mask.to_ne_bytes());
        bytes.extend(0u32.to_ne_bytes());
        bytes.extend(name_len.to_ne_bytes());
        bytes.extend(vec![0u8; name_len as usize]);
        bytes
    }

    #[test]
    fn parses_whole_events_and_stops_at_a_cut_one() {
        let mut bytes = event(3, libc::IN_MODIFY, 0);
        bytes.extend(event(4, libc::IN_ATTRIB, 16));
        bytes.extend(&event(5, libc::IN_MODIFY, 0)[..10]);
        let events: Vec<_> = parse_events(&bytes).collect();
        assert_eq!(events, [(3, libc::IN_MODIFY), (4, libc::IN_ATTRIB)]);
        // A name length past the buffer ends the walk, not the process.
        let huge = event(6, libc::IN_MODIFY, u32::MAX)[..EVENT_HEADER].to_vec();
        assert_eq!(parse_events(&huge).count(), 1);
    }

    #[test]
    fn a_write_marks_the_file_changed_and_reading_the_mark_clears_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jit-1.dump");
        let mut writer = File::create(&path).unwrap();
        let watch = FileWatch::new();
        let file = File::open(&path).unwrap();
        let watched = watch.watch(&file).expect("inotify works here");
        watch.drain();
        assert!(!watched.take_changed(), "nothing written yet");
        writer.write_all(b"more code").unwrap();
        watch.drain();
        assert!(watched.changed());
        assert!(watched.take_changed());
        assert!(!watched.take_changed(), "the mark is taken once");
        std::fs::remove_file(&path).unwrap();
        drop(writer);
        drop(file);
        watch.drain();
        assert!(watched.take_changed(), "a removal is a change");
        assert!(watched.take_changed(), "a removed watch is always changed");
        assert_eq!(watch.watched(), 0);
    }

    #[test]
    fn one_inode_watched_for_two_processes_keeps_both_until_both_drop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jit-1.dump");
        let mut writer = File::create(&path).unwrap();
        let watch = FileWatch::new();
        let first = watch.watch(&File::open(&path).unwrap()).unwrap();
        let second = watch.watch(&File::open(&path).unwrap()).unwrap();
        assert_eq!(watch.watched(), 1);
        drop(first);
        assert_eq!(watch.watched(), 1);
        writer.write_all(b"x").unwrap();
        watch.drain();
        assert!(second.take_changed());
        drop(second);
        assert_eq!(watch.watched(), 0);
    }

    #[test]
    fn without_inotify_nothing_is_watched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("perf-1.map");
        File::create(&path).unwrap();
        let watch = FileWatch::unavailable();
        assert!(watch.watch(&File::open(&path).unwrap()).is_none());
        watch.drain();
    }
}
