//! The frames of one raw stack, named: kernel addresses through kallsyms,
//! user addresses through the process's runtime first (JIT-compiled code,
//! at the sample's time) and its mapped files second (blazesym), then the
//! synthetic frames that say what is missing (`[truncated]`) and the GC
//! root of a collector thread. The pipeline calls it when a window closes
//! (CPU stacks, once per distinct stack) or as a sample is added (off-CPU
//! intervals, CLR events, wakers); what it needs of a process is
//! [`ProcessCode`].

use std::sync::Arc;

use super::native::{MappedFile, NativeSymbolizer, unnamed_frame};
use crate::{
    process::ProcFs,
    profile::{Aggregator, Frame, FrameIndex, FrameKind, RawSample, gc::add_gc_root},
};

/// What naming a process's user frames needs of the process.
pub trait ProcessCode {
    /// The frame of the runtime's code at `lookup` (the address, or a
    /// return address minus one) as it was at `time_ns`, reported at
    /// `addr`; `None` when no runtime in the process names it.
    fn runtime_frame(&self, lookup: u64, addr: u64, time_ns: u64) -> Option<Arc<Frame>>;
    /// Whether the process runs a runtime that compiles code at run time:
    /// an unnamed anonymous frame may then be named by a later read of its
    /// symbols.
    fn has_runtime(&self) -> bool;
    /// The file mapped at `addr`, the mappings read again first (rate
    /// limited) when none covers it; `None` for anonymous memory or no
    /// mapping at all.
    fn mapped_file(
        &mut self,
        addr: u64,
        procfs: &ProcFs,
        native: &mut NativeSymbolizer,
    ) -> Option<MappedFile<'_>>;
}

/// Names the user frame at `addr` in `process` at `time_ns`.
/// `is_return_address`: every frame but the leaf, whose address is the
/// instruction after the call (looked up one byte earlier).
pub fn user_frame(
    native: &mut NativeSymbolizer,
    procfs: &ProcFs,
    process: &mut impl ProcessCode,
    addr: u64,
    is_return_address: bool,
    time_ns: u64,
) -> Arc<Frame> {
    let lookup = if is_return_address {
        addr.saturating_sub(1)
    } else {
        addr
    };
    if let Some(frame) = process.runtime_frame(lookup, addr, time_ns) {
        return frame;
    }
    match process.mapped_file(addr, procfs, native) {
        Some(mapped) => native.symbolize_user(&mapped, addr, is_return_address),
        None => Arc::new(unnamed_frame(None, addr)),
    }
}

/// How the frames of one stack were named, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameCounts {
    pub kernel: u64,
    pub managed: u64,
    pub native: u64,
    /// In a mapped file, without a symbol.
    pub unnamed: u64,
    /// In no file (anonymous memory no runtime named).
    pub unknown: u64,
    /// 1 when the user stack was cut at its depth limit.
    pub truncated_stacks: u64,
}

impl FrameCounts {
    /// These counts for `n` samples of the stack.
    pub fn times(self, n: u64) -> Self {
        let Self {
            kernel,
            managed,
            native,
            unnamed,
            unknown,
            truncated_stacks,
        } = self;
        Self {
            kernel: kernel * n,
            managed: managed * n,
            native: native * n,
            unnamed: unnamed * n,
            unknown: unknown * n,
            truncated_stacks: truncated_stacks * n,
        }
    }
}

/// Names raw stacks, one at a time: [`Self::name_user`], then
/// [`Self::intern`]. Keeps its buffers from one stack to the next.
#[derive(Debug)]
pub struct StackNamer {
    user: Vec<Arc<Frame>>,
    kernel: Vec<Arc<Frame>>,
    /// A run of consecutive unnamed frames of one module is one frame
    /// (`[libcoreclr.so]`, at the run's innermost address), as perf and
    /// stackcollapse-perf show it; off: each keeps its own frame
    /// (`--keep-unnamed-frames`).
    pub group_unnamed: bool,
}

impl Default for StackNamer {
    fn default() -> Self {
        Self {
            user: Vec::new(),
            kernel: Vec::new(),
            group_unnamed: true,
        }
    }
}

/// Whether `frame` continues the run of unnamed frames `previous` is in:
/// both unnamed, in the same file.
fn same_unnamed_run(previous: Option<&Arc<Frame>>, frame: &Frame) -> bool {
    let Some(previous) = previous else {
        return false;
    };
    match (&previous.module, &frame.module) {
        (Some(a), Some(b)) => {
            previous.kind == FrameKind::Unknown
                && frame.kind == FrameKind::Unknown
                && a.path == b.path
        }
        _ => false,
    }
}

impl StackNamer {
    /// Names the user frames of `sample` in `process`; returns whether one
    /// of them is code of the process's runtime that it has not named yet
    /// (anonymous memory in no file), which a later read may name.
    pub fn name_user(
        &mut self,
        native: &mut NativeSymbolizer,
        procfs: &ProcFs,
        process: &mut impl ProcessCode,
        sample: &RawSample,
    ) -> bool {
        self.user.clear();
        for (i, &addr) in sample.user_stack.iter().enumerate() {
            let frame = user_frame(native, procfs, process, addr, i > 0, sample.time_ns);
            self.user.push(frame);
        }
        process.has_runtime()
            && self
                .user
                .iter()
                .any(|f| f.kind == FrameKind::Unknown && f.module.is_none())
    }

    /// The user frames [`Self::name_user`] named last, leaf first.
    pub fn user_frames(&self) -> &[Arc<Frame>] {
        &self.user
    }

    /// Names the kernel frames of `sample` and puts the whole stack into
    /// `stack` (leaf first): kernel, then the user frames named by
    /// [`Self::name_user`], the truncation markers and the GC root.
    /// Returns how its frames were named.
    pub fn intern(
        &mut self,
        native: &mut NativeSymbolizer,
        sample: &RawSample,
        aggregator: &mut Aggregator,
        stack: &mut Vec<FrameIndex>,
    ) -> FrameCounts {
        let mut counts = FrameCounts::default();
        stack.clear();
        self.kernel.clear();
        for &addr in &sample.kernel_stack {
            let frame = native.symbolize_kernel(addr);
            counts.kernel += 1;
            stack.push(aggregator.intern(&frame));
            self.kernel.push(frame);
        }
        if sample.kernel_stack_truncated {
            stack.push(aggregator.intern(&Frame::synthetic("[truncated kernel stack]")));
        }
        let mut previous = None;
        for frame in &self.user {
            let grouped = self.group_unnamed && same_unnamed_run(previous, frame);
            previous = Some(frame);
            match (frame.kind, &frame.module) {
                (FrameKind::Managed, _) => counts.managed += 1,
                (FrameKind::Native, _) => counts.native += 1,
                (_, Some(_)) => counts.unnamed += 1,
                (_, None) => counts.unknown += 1,
            }
            if !grouped {
                stack.push(aggregator.intern_user(sample.pid, frame));
            }
        }
        if sample.user_stack_truncated {
            counts.truncated_stacks = 1;
            stack.push(aggregator.intern(&Frame::synthetic("[truncated]")));
        }
        add_gc_root(&sample.thread_name, stack, aggregator);
        counts
    }

    /// The names of the kernel frames of the last stack
    /// [`Self::intern`]ed, leaf first.
    pub fn kernel_names(&self) -> impl Iterator<Item = &str> + Clone {
        self.kernel.iter().map(|f| &*f.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Module;

    fn unnamed_in(path: &str, addr: u64) -> Arc<Frame> {
        let module = Arc::new(Module {
            path: path.into(),
            build_id: Some("ab12".into()),
            memory_start: 0x7f00_0000_0000,
            memory_limit: 0x7f00_0010_0000,
            file_offset: 0,
            has_functions: true,
        });
        Arc::new(unnamed_frame(Some(&module), addr))
    }

    #[test]
    fn a_run_of_unnamed_frames_of_one_file_is_one_frame() {
        let coreclr = |addr| unnamed_in("/dotnet/libcoreclr.so", addr);
        let named = Arc::new(Frame {
            kind: FrameKind::Native,
            ..(*coreclr(0x7f00_0000_0100)).clone()
        });
        let stack = [
            coreclr(0x7f00_0000_1000),
            coreclr(0x7f00_0000_2000),
            coreclr(0x7f00_0000_3000),
            unnamed_in("/dotnet/libclrjit.so", 0x7f10_0000_0000),
            named,
            coreclr(0x7f00_0000_4000),
        ];
        let mut previous = None;
        let kept: Vec<u64> = stack
            .iter()
            .filter(|frame| {
                let grouped = same_unnamed_run(previous, frame);
                previous = Some(*frame);
                !grouped
            })
            .map(|frame| frame.address)
            .collect();
        // The run keeps its innermost address; another file, a named frame
        // and a later run of the same file each start again.
        assert_eq!(
            kept,
            [
                0x7f00_0000_1000,
                0x7f10_0000_0000,
                0x7f00_0000_0100,
                0x7f00_0000_4000
            ]
        );
        assert_eq!(&*stack[0].name, "[libcoreclr.so]");
        assert_eq!(stack[0].name, stack[2].name);
        assert!(StackNamer::default().group_unnamed);
    }
}
