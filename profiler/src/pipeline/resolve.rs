//! CLR events into the profile: each kept event's stack named like a CPU
//! sample's user stack, at the event's time ([`crate::symbolize::stack`]),
//! and added with its exact share ([`crate::profile::clr_sampling`]).

use std::sync::Arc;

use super::{
    labels,
    tracked::{TrackedProcess, mapped_file},
};
use crate::{
    clr::intake::{ClrSample, ClrSampleKind},
    process::ProcFs,
    profile::{Aggregator, Frame, FrameKind, clr_sampling::Weighted, layout::ValueLayout},
    symbolize::{
        native::{MappedFile, NativeSymbolizer},
        stack::{ProcessCode, user_frame},
    },
};

impl ProcessCode for TrackedProcess {
    fn runtime_frame(&self, lookup: u64, addr: u64, time_ns: u64) -> Option<Arc<Frame>> {
        let symbol = self.managed.as_ref()?.lookup(lookup, time_ns)?;
        Some(Arc::new(Frame {
            kind: FrameKind::Managed,
            name: symbol.short_name.clone(),
            system_name: (symbol.raw_name != symbol.short_name).then(|| symbol.raw_name.clone()),
            jit_tier: symbol.jit_tier,
            module: Some(self.jit_module.clone()),
            address: addr,
            file: symbol.assembly,
            line: 0,
            inlined: Vec::new(),
        }))
    }

    fn has_runtime(&self) -> bool {
        self.managed.is_some()
    }

    fn mapped_file(
        &mut self,
        addr: u64,
        procfs: &ProcFs,
        native: &mut NativeSymbolizer,
    ) -> Option<MappedFile<'_>> {
        if self.mapping_for(addr).is_none() {
            self.refresh_maps(procfs, native);
        }
        mapped_file(self.pid, self.mapping_for(addr)?)
    }
}

/// Symbolizes weighted CLR samples (their stacks like CPU samples' user
/// stacks, at the event's time) and adds them with their exact shares.
pub(super) fn add_clr_samples(
    native: &mut NativeSymbolizer,
    procfs: &ProcFs,
    layout: &ValueLayout,
    aggregator: &mut Aggregator,
    stack: &mut Vec<u32>,
    process: &mut TrackedProcess,
    kept: Vec<Weighted<ClrSample>>,
) {
    for weighted in kept {
        let Weighted {
            item,
            count,
            delay_ns,
        } = weighted;
        let values = match item.kind {
            ClrSampleKind::Contention => layout.contention(count, delay_ns),
            ClrSampleKind::Exception => layout.exception(count),
            ClrSampleKind::Wait => layout.wait(count, delay_ns),
        };
        stack.clear();
        for &addr in &item.stack {
            let frame = user_frame(native, procfs, process, addr, true, item.time_ns);
            stack.push(aggregator.intern(&frame));
        }
        if item.stack.is_empty() {
            stack.push(aggregator.intern(&Frame::synthetic("[no stack]")));
        }
        let tid = i64::try_from(item.thread_id).unwrap_or(i64::MAX);
        let mut labels = labels::sample_labels(process, tid, None);
        labels.extend(item.labels);
        let Some(values) = values else {
            continue;
        };
        aggregator.add(stack, labels, &values);
    }
}
