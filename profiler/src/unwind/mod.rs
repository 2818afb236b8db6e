//! Unwinding without frame pointers: `.eh_frame` (native code) and
//! ReadyToRun unwind info (precompiled managed code) to compact tables for
//! the kernel side.
//!
//! Place in the data flow: for each executable mapping of a profiled process,
//! userspace builds (once per file, shared by [`FileIdentity`]) an
//! [`UnwindTable`] of sorted rows ([`eh_frame`] for ELF files,
//! [`ready_to_run`] for R2R `.dll`s), keeps them in an
//! [`UnwindTableCache`] under a byte budget ([`table`]), and
//! `crate::bpf::unwind_maps` loads them into BPF maps ([`arena`] places the
//! rows) with a per-process index of mappings. The kernel side
//! then walks a sampled stack with the pure step function of
//! [`clrbpf_common::unwind`]; the privileged tests run that same walk on the
//! host over captured memory (`tests/src/replay.rs`).

pub mod arena;
pub mod disk_cache;
pub mod eh_frame;
pub mod jit_code;
pub mod ready_to_run;
pub mod stack_copy;
pub mod table;

#[cfg(test)]
mod tests;

pub use arena::{RowArena, build_process_mappings};
pub use eh_frame::UnwindRowStats;
pub use table::{FileIdentity, LoadSegment, UnwindTable, UnwindTableCache, load_bias};

/// Why a file got no unwind table.
#[derive(Debug, thiserror::Error)]
pub enum UnwindTableError {
    #[error("reading the ELF file for its unwind table")]
    Read {
        #[source]
        source: std::io::Error,
    },
    #[error("file is larger than the {limit}-byte limit for unwind tables")]
    TooLarge { limit: u64 },
    #[error(
        "the parts of the file an unwind table needs are over the memory budget's {limit}-byte share for one file"
    )]
    OverBudget { limit: u64 },
    #[error("mapped file is neither ELF nor PE (no magic), so it has no unwind table")]
    NotElf,
    #[error("PE file has no ReadyToRun unwind information: {reason}")]
    NotReadyToRun { reason: &'static str },
    #[error("parsing the ELF file for its unwind table")]
    Parse {
        #[source]
        source: object::Error,
    },
    #[error("unwind tables for {architecture} ELF files are not supported")]
    UnsupportedArchitecture { architecture: String },
}
