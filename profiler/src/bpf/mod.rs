//! Kernel side, user half: loads the eBPF programs, attaches them to per-CPU
//! perf events and tracepoints, and turns ring-buffer records into
//! [`crate::profile::RawSample`]s.
