//! Garbage collector attribution, between symbolization and aggregation:
//! every stack of a thread the runtime created for its garbage collector
//! gets a synthetic root frame `Garbage Collector`, so a viewer shows GC
//! work as one subtree next to the application's code, as the in-process
//! .NET profilers do.
//!
//! The threads are recognised by the name CoreCLR gives them when it
//! creates them (`GCToEEInterface::CreateThread` in gc.cpp), which is what
//! the kernel reports as `comm`:
//!
//! 1. `.NET Server GC`: one per server GC heap; runs the blocking
//!    collections under server GC.
//! 2. `.NET BGC`: a background GC thread; runs the concurrent gen2
//!    collections, under server GC (one per heap) and under workstation
//!    concurrent GC (one).
//!
//! Limits: under workstation GC a blocking collection runs on the thread
//! that triggered it, an application thread, and stays there. Older
//! runtimes do not name their threads on Linux (every thread of .NET Core
//! 3.1 is `dotnet`, verified on 3.1.23), so their GC threads are not
//! recognised.

use super::{
    aggregate::Aggregator,
    model::{Frame, FrameIndex},
};

/// The synthetic root frame of a GC thread's stacks.
pub const GC_ROOT_FRAME_NAME: &str = "Garbage Collector";

/// Name of a server GC thread (14 bytes: the kernel keeps it whole).
pub const SERVER_GC_THREAD_NAME: &str = ".NET Server GC";

/// Name of a background GC thread.
pub const BACKGROUND_GC_THREAD_NAME: &str = ".NET BGC";

/// Whether a thread with this name (its `comm`) is one of the runtime's GC
/// threads. Exact match: a prefix would also take an application's thread
/// that happens to be named `.NET BGC worker`.
pub fn is_gc_thread(thread_name: &str) -> bool {
    thread_name == SERVER_GC_THREAD_NAME || thread_name == BACKGROUND_GC_THREAD_NAME
}

/// The `Garbage Collector` root frame.
pub fn gc_root_frame() -> Frame {
    Frame::synthetic(GC_ROOT_FRAME_NAME)
}

/// Appends the `Garbage Collector` root to `stack` (leaf first, so the last
/// frame is the root) when `thread_name` is a GC thread's; leaves it alone
/// otherwise. Called for every sample of a thread, whatever its kind, once
/// its frames are assembled.
pub fn add_gc_root(thread_name: &str, stack: &mut Vec<FrameIndex>, aggregator: &mut Aggregator) {
    if is_gc_thread(thread_name) {
        stack.push(aggregator.intern(&gc_root_frame()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{FrameKind, ValueType};

    fn aggregator() -> Aggregator {
        Aggregator::new(vec![ValueType::new("samples", "count")])
    }

    #[test]
    fn the_runtime_gc_thread_names_are_recognised() {
        assert!(is_gc_thread(".NET Server GC"));
        assert!(is_gc_thread(".NET BGC"));
    }

    #[test]
    fn other_runtime_and_application_threads_are_not() {
        for name in [
            "",
            "dotnet",
            ".NET Finalizer",
            ".NET Tiered Com",
            ".NET TP Worker",
            ".NET SigHandler",
            "gcheavy-0",
            ".NET BGC worker",
            ".NET Server G",
            ".net bgc",
            " .NET BGC",
            ".NET BGC\0",
            "Garbage Collector",
        ] {
            assert!(!is_gc_thread(name), "{name:?} is not a GC thread");
        }
    }

    #[test]
    fn a_gc_thread_stack_gets_the_root_last() {
        let mut a = aggregator();
        let leaf = a.intern(&Frame::synthetic("gc_heap::mark_object_simple"));
        let caller = a.intern(&Frame::synthetic("gc_heap::gc_thread_function"));
        let mut stack = vec![leaf, caller];
        add_gc_root(".NET Server GC", &mut stack, &mut a);
        assert_eq!(stack.len(), 3);
        assert_eq!(&stack[..2], &[leaf, caller], "the thread's own frames stay");
        let profile = a.finish(None, 0, 0, 0);
        let root = &profile.frames[stack[2] as usize];
        assert_eq!(root.kind, FrameKind::Synthetic);
        assert_eq!(&*root.name, GC_ROOT_FRAME_NAME);
        assert_eq!(root.module, None);
    }

    #[test]
    fn an_empty_gc_stack_is_the_root_alone() {
        let mut a = aggregator();
        let mut stack = Vec::new();
        add_gc_root(".NET BGC", &mut stack, &mut a);
        assert_eq!(stack, vec![a.intern(&gc_root_frame())]);
    }

    #[test]
    fn every_gc_thread_shares_one_root_frame() {
        let mut a = aggregator();
        let mut server = Vec::new();
        let mut background = Vec::new();
        add_gc_root(".NET Server GC", &mut server, &mut a);
        add_gc_root(".NET BGC", &mut background, &mut a);
        assert_eq!(server, background);
    }

    #[test]
    fn other_threads_stacks_are_left_alone() {
        let mut a = aggregator();
        let main = a.intern(&Frame::synthetic("Main"));
        for name in ["gcheavy-0", "dotnet", ".NET Finalizer"] {
            let mut stack = vec![main];
            add_gc_root(name, &mut stack, &mut a);
            assert_eq!(stack, vec![main], "{name}");
        }
        assert_eq!(a.finish(None, 0, 0, 0).frames.len(), 1, "no root interned");
    }
}
