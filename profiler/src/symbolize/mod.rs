//! Addresses to names: kernel (kallsyms), native (ELF symbols and debug info
//! through blazesym) and managed (perf map, jitdump, runtime rundown).

pub mod native;
