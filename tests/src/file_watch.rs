//! A watch on the files of a directory (inotify sees every open and
//! read, root's and those through `/proc/PID/map_files` too; an `O_PATH`
//! handle is no open), for the tests that check what root opened.

use std::{collections::HashMap, path::Path};

/// Events of `mask` (`IN_OPEN`, `IN_ACCESS`) on the files of a directory.
pub struct FileWatch {
    fd: std::os::fd::OwnedFd,
}

impl FileWatch {
    pub fn new(dir: &Path, mask: u32) -> Self {
        use std::os::{fd::FromRawFd as _, unix::ffi::OsStrExt as _};
        // SAFETY: plain syscalls; the fd is checked and owned.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(fd >= 0, "inotify_init1");
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).expect("path");
        // SAFETY: a NUL-terminated path and a valid inotify fd.
        let wd = unsafe {
            libc::inotify_add_watch(std::os::fd::AsRawFd::as_raw_fd(&fd), path.as_ptr(), mask)
        };
        assert!(wd >= 0, "inotify_add_watch");
        Self { fd }
    }

    /// The events since the last call, by file name.
    pub fn take(&self) -> HashMap<String, u64> {
        let mut opens = HashMap::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: the buffer is writable for its length.
            let n = unsafe {
                libc::read(
                    std::os::fd::AsRawFd::as_raw_fd(&self.fd),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            if n <= 0 {
                return opens;
            }
            let mut at = 0;
            let header = size_of::<libc::inotify_event>();
            while at + header <= n as usize {
                // SAFETY: the kernel wrote a whole event at `at`.
                let event: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
                let name = &buf[at + header..at + header + event.len as usize];
                let name = String::from_utf8_lossy(name)
                    .trim_end_matches('\0')
                    .to_owned();
                *opens.entry(name).or_default() += 1;
                at += header + event.len as usize;
            }
        }
    }
}
