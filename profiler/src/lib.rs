//! clrbpf: an eBPF whole-host profiler for .NET on Linux.
//!
//! A sample flows one way through the stages, one module each:
//! [`bpf`] (kernel programs, raw samples) -> [`process`] (what a pid is) ->
//! [`symbolize`] (kernel, native and managed names) -> [`profile`]
//! (aggregation, sampling, upscaling) -> [`export`] (pprof, folded stacks,
//! flame graphs); [`pipeline`] wires the stages for `record` and the agent.
//! A language runtime plugs in through [`runtime`] (a loader that
//! recognises it in a process, an instance per process that names its
//! frames and polls its events): [`clr`] is .NET's, and talks to its
//! runtimes over their diagnostic socket;
//! [`unwind`] prepares native unwind tables for the kernel side. [`agent`]
//! ships profiles continuously to Pyroscope, OTLP or a directory; [`k8s`]
//! names the pod and container of a process from its container id.

pub mod agent;
pub mod bpf;
pub mod cli;
pub mod clr;
pub mod export;
pub mod k8s;
pub mod memory_budget;
pub mod pipeline;
pub mod process;
pub mod profile;
pub mod ps;
pub mod record;
pub mod runtime;
pub mod stop;
pub mod symbolize;
pub mod unwind;

/// Gives the heap's free pages back to the kernel. glibc keeps what was
/// freed in its arenas: after tables are dropped or a window's aggregates
/// are shipped, the process's RSS would otherwise keep their peak, and
/// pieces freed between smaller live allocations make it creep up over
/// days. It walks the free chunks: 15-35 ms for a heap cut in 150,000
/// free pieces (a C test), too little to show in a 60 s profile of the
/// agent under churn at 999 Hz (four window cuts).
pub fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heap; no pointers passed.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Pyroscope's push API types, generated from `proto/pyroscope/`.
pub mod pyroscope_proto {
    #![allow(clippy::all, reason = "generated code: lints may or may not fire")]
    pub mod push {
        pub mod v1 {
            include!(concat!(env!("OUT_DIR"), "/push.v1.rs"));
        }
    }
    pub mod types {
        pub mod v1 {
            include!(concat!(env!("OUT_DIR"), "/types.v1.rs"));
        }
    }
}

/// The pprof protobuf types, generated from `proto/profile.proto`.
pub mod pprof_proto {
    #![allow(clippy::all, reason = "generated code: lints may or may not fire")]
    include!(concat!(env!("OUT_DIR"), "/perftools.profiles.rs"));
}
