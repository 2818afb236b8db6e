//! clrbpf: an eBPF whole-host profiler for .NET on Linux.
//!
//! A sample flows one way through the stages, one module each:
//! [`bpf`] (kernel programs, raw samples) -> [`process`] (what a pid is) ->
//! [`symbolize`] (kernel, native and managed names) -> [`profile`]
//! (aggregation, sampling, upscaling) -> [`export`] (pprof, folded stacks,
//! flame graphs). [`clr`] talks to .NET runtimes over their diagnostic socket;
//! [`unwind`] prepares native unwind tables for the kernel side; [`k8s`]
//! names the pod and container of a process from its container id.

pub mod bpf;
pub mod cli;
pub mod clr;
pub mod export;
pub mod k8s;
pub mod process;
pub mod profile;
pub mod record;
pub mod symbolize;
pub mod unwind;

/// The pprof protobuf types, generated from `proto/profile.proto`.
pub mod pprof_proto {
    #![allow(clippy::all, reason = "generated code: lints may or may not fire")]
    include!(concat!(env!("OUT_DIR"), "/perftools.profiles.rs"));
}
