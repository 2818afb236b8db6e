//! CLR events into the profile: each kept event's stack named like a CPU
//! sample's user stack, at the event's time ([`crate::symbolize::stack`]),
//! and added with its exact share ([`crate::profile::clr_sampling`]).

use super::{labels, tracked::TrackedProcess};
use crate::{
    clr::intake::{ClrSample, ClrSampleKind},
    process::ProcFs,
    profile::{Aggregator, Frame, clr_sampling::Weighted, layout::ValueLayout},
    symbolize::{native::NativeSymbolizer, stack::user_frame},
};

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
            // An allocation's `delay_ns` is the bytes it stands for.
            ClrSampleKind::Allocation => layout.allocation(count, delay_ns),
        };
        stack.clear();
        if let Some(leaf) = allocation_leaf(&item) {
            // The allocated type as the leaf, as Pyroscope's .NET profiler
            // shows it, so flame graphs and folded stacks name it.
            stack.push(aggregator.intern(&Frame::synthetic(leaf)));
        }
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

/// The type name an allocation sample's leaf frame shows.
fn allocation_leaf(item: &ClrSample) -> Option<&str> {
    if item.kind != ClrSampleKind::Allocation {
        return None;
    }
    item.labels.iter().find_map(|label| match &label.value {
        crate::profile::LabelValue::Str(name)
            if &*label.key == crate::clr::intake::clr_label_keys::ALLOCATION_TYPE =>
        {
            Some(&**name)
        }
        _ => None,
    })
}
