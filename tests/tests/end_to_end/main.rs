//! The privileged end-to-end tests, one module per feature, in one test
//! binary: the real `clrbpf` binary (`CLRBPF_BIN`) with its BPF programs on
//! this kernel, real .NET 8 and .NET Core 3.1 processes, and the pprof that
//! comes out. `cargo xtask test` runs them as root, one at a time (they
//! profile the whole host, so two at once would see each other).
//!
//! One binary rather than one per file: it compiles and links once (about
//! half the CPU time of 38 binaries). One module alone:
//! `cargo test -p clrbpf-integration-tests --release --test end_to_end -- off_cpu:: --test-threads=1`
//! (with the environment `cargo xtask test` sets; see docs/development.md).

mod agent;
mod agent_attackers;
mod agent_http;
mod agent_sinks;
mod allocations;
mod attach_stacks;
mod chart;
mod churn;
mod cli;
mod clr_events;
mod counters;
mod diagnostics;
mod exact_exceptions;
mod first_stacks;
mod frameless;
mod gc;
mod hostile;
mod hostile_events;
mod hostile_files;
mod hostile_memory;
mod hostile_naming;
mod hostile_pid_reuse;
mod identity;
mod jit_names_from_memory;
mod least_privilege;
mod lifecycle;
mod managed_symbols;
mod memory_budget;
mod names;
mod names_without_socket;
mod native_debug_files;
mod native_symbol_servers;
mod new_process_stacks;
mod new_process_tables;
mod node_scale;
mod off_cpu;
mod perf_files;
mod ps;
mod record;
mod security;
mod system_info;
mod unwind;
mod unwind_replay;
mod waits;
