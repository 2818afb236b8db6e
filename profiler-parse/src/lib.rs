//! The parsers of untrusted bytes: everything clrbpf reads that a profiled
//! process wrote (its perf map and jitdump files, its EventPipe stream, the
//! replies of its diagnostic socket, its assemblies) is decoded here, and
//! nowhere else.
//!
//! Place in the data flow: the profiler (`clrbpf`) reads the bytes (files
//! through the target's root, sockets, memory) and hands them to these
//! parsers; they do no I/O and no logging, keep every allocation bounded by
//! explicit limits, and report bad input as errors and counts. That makes
//! each one a function of its input alone, which `fuzz/` exercises with one
//! cargo-fuzz target per parser, as aya keeps its object parser (`aya-obj`)
//! apart from the loader.

pub mod allocations;
pub mod budget;
pub mod clr_metadata;
pub mod events;
pub mod ipc;
pub mod jitdump;
pub mod native_format;
pub mod nettrace;
pub mod perf_map;
pub mod version;
