//! Addresses to names: kernel (kallsyms), native (ELF symbols and debug info
//! through blazesym) and managed (perf map, jitdump, runtime rundown).
//!
//! Native and kernel code: [`native`] (blazesym over files kept open while
//! their process lives). Managed code: [`target_fs`] reads the runtime's
//! files safely inside the target's root, `clrbpf_parse`'s `perf_map` and `jitdump`
//! parse them incrementally ([`file_watch`] tells when they grew), [`jit_index`] keeps the code ranges by address and
//! time, and [`managed`] ties them together per process
//! ([`managed::ManagedSymbols`]); [`method_name`] gives a method the short
//! name .NET users read. [`stack`] names the frames of one raw stack with
//! them.

pub mod assembly_file;
pub mod debug_file;
pub mod debug_lookup;
pub mod file_watch;
pub mod jit_index;
pub mod kallsyms;
pub mod managed;
pub mod method_name;
pub mod native;
pub mod perf_files;
pub mod ready_to_run;
pub mod stack;
pub mod symbol_server;
pub mod target_fs;
