//! Where a .NET process's managed frames get their names, and the choice
//! between them (`--managed-names`). Part of the runtime seam: the
//! [`super::instance::DotnetInstance`] asks its sources in order for a
//! frame of the runtime's code.
//!
//! 1. The perf map and jitdump, or method rundown and MethodLoad events
//!    ([`crate::symbolize::managed::ManagedSymbols`]): they need the
//!    diagnostic socket (or a runtime started with perf maps on) and a
//!    writable `/tmp` in the target.
//! 2. ReadyToRun images, from the mapped `.dll` files alone
//!    ([`crate::symbolize::ready_to_run`]): no socket, nothing written.
//! 3. JIT-compiled code from the runtime's memory: a [`JitMemoryNames`]
//!    made by the loader's [`JitMemoryFactory`] (none until a reader plugs
//!    in there).
//!
//! With `auto` every source is asked, in that order, so a process without
//! a socket (`DOTNET_EnableDiagnostics=0`) or whose perf map cannot be
//! written still gets names, and framework frames are named before its
//! perf map arrives. `memory` asks only 2 and 3 and never asks the runtime
//! for perf maps; `perf-map` only 1 (as before these sources existed).

use std::sync::Arc;

use crate::{
    process::{MappingTable, ProcFs, dotnet::DotnetRuntime},
    profile::{Frame, FrameKind, Module},
    symbolize::ready_to_run::AssemblyCache,
    unwind::jit_code::JitMethod,
};

/// Which sources name managed frames (`--managed-names`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum ManagedNames {
    /// Perf maps where the runtime can write them, the runtime's images and
    /// memory for the rest.
    #[default]
    Auto,
    /// ReadyToRun images and the runtime's memory only: nothing is asked
    /// of the runtime or written into the target.
    Memory,
    /// Perf maps and runtime events only.
    PerfMap,
}

impl ManagedNames {
    /// Whether perf maps and runtime method events name frames.
    pub fn uses_perf_maps(self) -> bool {
        self != Self::Memory
    }

    /// Whether images and the runtime's memory name frames.
    pub fn uses_memory(self) -> bool {
        self != Self::PerfMap
    }
}

/// A method's name as a memory reader gives it; the instance makes the
/// frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeName {
    /// `Namespace.Type.Method`, or a stub's kind (`[stub: precode]`).
    pub name: Arc<str>,
    /// A longer form for the pprof `system_name`, if any.
    pub system_name: Option<Arc<str>>,
    /// The assembly: `System.Private.CoreLib`.
    pub assembly: Option<Arc<str>>,
    /// `OptimizedTier1`, ... when known.
    pub jit_tier: Option<Arc<str>>,
}

/// Names JIT-compiled code by reading the runtime's memory: the hook a
/// memory reader plugs into (through [`JitMemoryFactory`]).
pub trait JitMemoryNames: Send {
    /// The process's mappings were read again.
    fn sync_mappings(&mut self, mappings: &MappingTable);
    /// The name of the code at `lookup` (an address, or a return address
    /// minus one) at `time_ns`; `None` when it is not the runtime's code
    /// or cannot be read.
    fn name(&self, lookup: u64, time_ns: u64) -> Option<CodeName>;
    /// What went wrong reading the process, for the summary's warnings.
    fn problems(&self) -> Option<String> {
        None
    }
    /// The JIT-compiled methods found in the runtime's memory since the
    /// last call, for the unwinder's rows when no perf map lists them (the
    /// reader decides how often it looks).
    fn take_new_code(&mut self) -> Vec<JitMethod> {
        Vec::new()
    }
}

/// What a [`JitMemoryFactory`] is told of the process.
pub struct JitMemoryContext<'a> {
    pub procfs: &'a ProcFs,
    pub pid: u32,
    pub runtime: &'a DotnetRuntime,
    pub mappings: &'a MappingTable,
    /// Parsed assemblies shared by every process (metadata to name tokens).
    pub assemblies: &'a AssemblyCache,
}

/// Makes a process's [`JitMemoryNames`] once its runtime has started;
/// `None` when its runtime cannot be read.
pub type JitMemoryFactory = fn(&JitMemoryContext<'_>) -> Option<Box<dyn JitMemoryNames>>;

/// The factory used until a memory reader plugs in: none.
pub fn no_jit_memory_reader(_: &JitMemoryContext<'_>) -> Option<Box<dyn JitMemoryNames>> {
    None
}

/// How many managed frames of a process each source named (CPU samples,
/// each frame counted once per sample).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NameSourceCounts {
    /// Perf map, jitdump or runtime events.
    pub perf_map: u64,
    pub ready_to_run: u64,
    pub jit_memory: u64,
}

impl NameSourceCounts {
    pub fn total(&self) -> u64 {
        let Self {
            perf_map,
            ready_to_run,
            jit_memory,
        } = *self;
        perf_map + ready_to_run + jit_memory
    }

    pub fn add(&mut self, other: Self) {
        self.perf_map += other.perf_map;
        self.ready_to_run += other.ready_to_run;
        self.jit_memory += other.jit_memory;
    }

    /// Counts `n` samples of `frames`: which source named each managed
    /// one, told by the module the sources give their frames
    /// (`perf_map_module`, `jit_memory_module`, or an image's).
    pub fn count(
        &mut self,
        frames: &[Arc<Frame>],
        n: u64,
        perf_map_module: &Arc<Module>,
        jit_memory_module: &Arc<Module>,
    ) {
        for frame in frames {
            if frame.kind != FrameKind::Managed {
                continue;
            }
            match &frame.module {
                Some(m) if Arc::ptr_eq(m, perf_map_module) => self.perf_map += n,
                Some(m) if Arc::ptr_eq(m, jit_memory_module) => self.jit_memory += n,
                Some(_) => self.ready_to_run += n,
                None => {}
            }
        }
    }
}

impl std::fmt::Display for NameSourceCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} by perf map or runtime events, {} by ReadyToRun images, {} by runtime memory",
            self.perf_map, self.ready_to_run, self.jit_memory
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(path: &str) -> Arc<Module> {
        Arc::new(Module {
            path: path.into(),
            build_id: None,
            memory_start: 0,
            memory_limit: 0,
            file_offset: 0,
            has_functions: true,
        })
    }

    #[test]
    fn frames_are_counted_by_the_module_their_source_gives() {
        let (perf, memory, image) = (module("[jit]"), module("[jit]"), module("/x/A.dll"));
        let frame = |kind, module: &Arc<Module>| {
            Arc::new(Frame {
                kind,
                module: Some(module.clone()),
                ..Frame::synthetic("f")
            })
        };
        let frames = [
            frame(FrameKind::Managed, &perf),
            frame(FrameKind::Managed, &memory),
            frame(FrameKind::Managed, &image),
            frame(FrameKind::Managed, &image),
            frame(FrameKind::Native, &image),
        ];
        let mut counts = NameSourceCounts::default();
        counts.count(&frames, 3, &perf, &memory);
        assert_eq!(
            counts,
            NameSourceCounts {
                perf_map: 3,
                ready_to_run: 6,
                jit_memory: 3
            }
        );
        assert_eq!(counts.total(), 12);
        assert!(ManagedNames::Auto.uses_memory() && ManagedNames::Auto.uses_perf_maps());
        assert!(!ManagedNames::Memory.uses_perf_maps());
        assert!(!ManagedNames::PerfMap.uses_memory());
    }
}
