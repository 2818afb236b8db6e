//! Test support: capture a live thread's registers, stack and mappings with
//! ptrace, the input of a replayed walk. Needs root (or CAP_SYS_PTRACE).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use clrbpf_common::unwind::UnwindRegs;

use super::replay::{MapsEntry, MemorySnapshot, parse_proc_maps};

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
