//! Reading another process's memory: the one way bytes enter the memory
//! name path ([`super`]). Every read is a fixed, small size chosen by the
//! caller, every pointer read out of the target is checked before it is
//! followed ([`checked_ptr`]), and every failure is counted
//! ([`ReadCounters`]) rather than raised past the frame being named.

use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicU64, Ordering},
};

/// The lowest address a pointer into the target may hold: the first page
/// is never mapped, and small values are flags or stub kinds.
pub const MIN_POINTER: u64 = 0x1000;
/// One past the highest user-space address on x86-64 and arm64 (47/48-bit
/// user halves); anything above is the kernel's or not canonical.
pub const MAX_POINTER: u64 = 0x0001_0000_0000_0000;
/// The largest single read the walk ever asks for (a RangeSectionMap level
/// of 256 pointers).
pub const MAX_READ: usize = 4096;

/// Why a read of target memory failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ReadError {
    #[error("address {addr:#x} is not a user-space pointer")]
    BadPointer { addr: u64 },
    #[error("read of {len} bytes at {addr:#x} is larger than {MAX_READ}")]
    TooLarge { addr: u64, len: usize },
    #[error("read of {len} bytes at {addr:#x} failed: errno {errno}")]
    Failed { addr: u64, len: usize, errno: i32 },
    #[error("read of {len} bytes at {addr:#x} returned only {got}")]
    Short { addr: u64, len: usize, got: usize },
    #[error("read at {addr:#x} refused: the lookup's read or time budget is spent")]
    OverBudget { addr: u64 },
}

/// A source of target memory: the live process, or a synthetic image in
/// tests and fuzzing.
pub trait TargetMemory {
    /// Fills `buf` from `addr` or fails; never a partial success.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError>;
}

/// Typed little-endian reads over any [`TargetMemory`].
pub trait ReadExt: TargetMemory {
    fn read_array<const N: usize>(&self, addr: u64) -> Result<[u8; N], ReadError> {
        let mut buf = [0u8; N];
        self.read(addr, &mut buf)?;
        Ok(buf)
    }
    fn read_u8(&self, addr: u64) -> Result<u8, ReadError> {
        Ok(self.read_array::<1>(addr)?[0])
    }
    fn read_u16(&self, addr: u64) -> Result<u16, ReadError> {
        Ok(u16::from_le_bytes(self.read_array(addr)?))
    }
    fn read_u32(&self, addr: u64) -> Result<u32, ReadError> {
        Ok(u32::from_le_bytes(self.read_array(addr)?))
    }
    fn read_u64(&self, addr: u64) -> Result<u64, ReadError> {
        Ok(u64::from_le_bytes(self.read_array(addr)?))
    }
    /// A pointer that must point somewhere ([`checked_ptr`]).
    fn read_ptr(&self, addr: u64) -> Result<u64, ReadError> {
        checked_ptr(self.read_u64(addr)?)
    }
    /// A NUL-terminated UTF-8 string of at most `max` bytes (lossy), read
    /// page by page so that a string near the end of a mapping is read.
    fn read_c_string(&self, addr: u64, max: usize) -> Result<String, ReadError> {
        const PAGE: u64 = 4096;
        let max = max.min(MAX_READ);
        let mut out = Vec::new();
        let mut at = addr;
        while out.len() < max {
            let page_end = (at / PAGE + 1) * PAGE;
            let len = ((page_end - at) as usize).min(max - out.len());
            let mut buf = [0u8; PAGE as usize];
            self.read(at, &mut buf[..len])?;
            if let Some(nul) = buf[..len].iter().position(|&b| b == 0) {
                out.extend_from_slice(&buf[..nul]);
                return Ok(String::from_utf8_lossy(&out).into_owned());
            }
            out.extend_from_slice(&buf[..len]);
            at = page_end;
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }
}

impl<T: TargetMemory + ?Sized> ReadExt for T {}

/// `ptr` if it can be a user-space pointer, else [`ReadError::BadPointer`].
pub fn checked_ptr(ptr: u64) -> Result<u64, ReadError> {
    if (MIN_POINTER..MAX_POINTER).contains(&ptr) {
        Ok(ptr)
    } else {
        Err(ReadError::BadPointer { addr: ptr })
    }
}

fn check_range(addr: u64, len: usize) -> Result<(), ReadError> {
    if len > MAX_READ {
        return Err(ReadError::TooLarge { addr, len });
    }
    checked_ptr(addr)?;
    if addr.saturating_add(len as u64) > MAX_POINTER {
        return Err(ReadError::BadPointer { addr });
    }
    Ok(())
}

/// Counts of reads and their failures, per reader.
#[derive(Debug, Default)]
pub struct ReadCounters {
    pub reads: AtomicU64,
    pub failed: AtomicU64,
}

impl ReadCounters {
    pub fn snapshot(&self) -> (u64, u64) {
        (
            self.reads.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// The memory of a live process, read with `process_vm_readv` (needs
/// `CAP_SYS_PTRACE` or the same uid; nothing is written and the target is
/// not stopped).
#[derive(Debug)]
pub struct ProcessMemory {
    pid: u32,
    pub counters: ReadCounters,
}

impl ProcessMemory {
    pub fn new(pid: u32) -> Self {
        Self {
            pid,
            counters: ReadCounters::default(),
        }
    }
}

impl TargetMemory for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        let result = read_process(self.pid, addr, buf);
        if result.is_err() {
            self.counters.failed.fetch_add(1, Ordering::Relaxed);
        }
        result
    }
}

fn read_process(pid: u32, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
    let len = buf.len();
    check_range(addr, len)?;
    if len == 0 {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `local` describes `buf`, which we own mutably for the call;
    // the remote iovec is only an address in the other process, which the
    // kernel checks.
    let got = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    if got < 0 {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        return Err(ReadError::Failed { addr, len, errno });
    }
    let got = got as usize;
    if got != len {
        return Err(ReadError::Short { addr, len, got });
    }
    Ok(())
}

/// A synthetic memory image: byte regions at addresses, as tests and the
/// fuzz target build them. Reads must fall inside one region.
#[derive(Debug, Default, Clone)]
pub struct FakeMemory {
    regions: BTreeMap<u64, Vec<u8>>,
}

impl FakeMemory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Places `bytes` at `addr` (regions must not overlap).
    pub fn put(&mut self, addr: u64, bytes: &[u8]) -> &mut Self {
        self.regions.insert(addr, bytes.to_vec());
        self
    }

    pub fn put_u64(&mut self, addr: u64, value: u64) -> &mut Self {
        self.put(addr, &value.to_le_bytes())
    }

    /// Writes into an existing region (for building structures in place).
    pub fn poke(&mut self, addr: u64, bytes: &[u8]) {
        let (start, region) = self
            .regions
            .range_mut(..=addr)
            .next_back()
            .expect("poke inside a region that was put");
        let at = (addr - *start) as usize;
        region[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

impl TargetMemory for FakeMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let len = buf.len();
        check_range(addr, len)?;
        let failed = ReadError::Failed {
            addr,
            len,
            errno: libc::EFAULT,
        };
        let Some((start, region)) = self.regions.range(..=addr).next_back() else {
            return Err(failed);
        };
        let at = (addr - start) as usize;
        let Some(bytes) = region.get(at..at.saturating_add(len)) else {
            return Err(failed);
        };
        buf.copy_from_slice(bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_inside_regions_only() {
        let mut mem = FakeMemory::new();
        mem.put(0x10_000, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(mem.read_u32(0x10_004).unwrap(), 0x0807_0605);
        assert!(mem.read_u64(0x10_004).is_err());
        assert!(mem.read_u8(0x20_000).is_err());
        assert_eq!(
            mem.read_u8(0x10).unwrap_err(),
            ReadError::BadPointer { addr: 0x10 }
        );
    }

    #[test]
    fn pointers_are_checked() {
        assert!(checked_ptr(0).is_err());
        assert!(checked_ptr(0xffff_8000_0000_0000).is_err());
        assert_eq!(checked_ptr(0x7fff_0000_1000).unwrap(), 0x7fff_0000_1000);
    }

    #[test]
    fn strings_stop_at_nul_and_mapping_end() {
        let mut mem = FakeMemory::new();
        let mut page = vec![b'x'; 4096];
        page[..9].copy_from_slice(b"HotA\0junk");
        mem.put(0x10_000, &page);
        assert_eq!(mem.read_c_string(0x10_000, 256).unwrap(), "HotA");
        // A name running into the next page, which is unmapped.
        assert!(mem.read_c_string(0x10_ff0, 256).is_err());
        assert_eq!(mem.read_c_string(0x10_ff0, 16).unwrap(), "x".repeat(16));
        let mut two_pages = vec![b'y'; 8192];
        two_pages[4100] = 0;
        mem.put(0x20_000, &two_pages);
        assert_eq!(mem.read_c_string(0x20_ffe, 256).unwrap(), "y".repeat(6));
    }

    #[test]
    fn reads_own_memory() {
        let value: u64 = 0x1234_5678_9abc_def0;
        let mem = ProcessMemory::new(std::process::id());
        let got = mem.read_u64(std::ptr::addr_of!(value) as u64).unwrap();
        assert_eq!(got, value);
        assert_eq!(mem.counters.snapshot(), (1, 0));
    }
}
