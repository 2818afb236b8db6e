//! CLR events into the profile: each kept event's stack named like a CPU
//! sample's user stack, at the event's time ([`crate::symbolize::stack`]),
//! and added with its exact share ([`crate::profile::clr_sampling`]).

use super::{labels, tracked::TrackedProcess};
use crate::{
    clr::intake::{ClrSample, clr_label_keys},
    process::ProcFs,
    profile::{Aggregator, Frame, Label, LabelValue, clr_sampling::Weighted, layout::ValueLayout},
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
        // `delay_ns` is the kind's amount: an allocation's bytes.
        let values = layout.event(item.kind, count, delay_ns);
        stack.clear();
        if let Some(leaf) = synthetic_leaf(&item) {
            stack.push(aggregator.intern(&Frame::synthetic(leaf)));
        }
        for &addr in &item.stack {
            let frame = user_frame(native, procfs, process, addr, true, item.time_ns);
            stack.push(aggregator.intern_user(process.pid, &frame));
        }
        if item.stack.is_empty() {
            stack.push(aggregator.intern(&Frame::synthetic("[no stack]")));
        }
        // The runtime's thread ids are its PID namespace's: the host's
        // make a thread the same in every sample type.
        let thread = process.threads.host(procfs, process.pid, item.thread_id);
        let mut labels = labels::sample_labels(
            process,
            thread.as_ref().map(|t| i64::from(t.tid)),
            thread.as_ref().and_then(|t| t.name.as_ref()),
        );
        labels.extend(
            item.labels
                .into_iter()
                .filter_map(|label| host_lock_owner(procfs, process, label)),
        );
        let Some(values) = values else {
            continue;
        };
        aggregator.add(stack, labels, &values);
    }
}

/// `label`, with a lock owner's thread id made the host's; `None` when the
/// owner's host id is not known (a thread of a process in its own PID
/// namespace that is gone).
fn host_lock_owner(procfs: &ProcFs, process: &mut TrackedProcess, label: Label) -> Option<Label> {
    let owner = match &label.value {
        LabelValue::Num { value, .. } if &*label.key == clr_label_keys::LOCK_OWNER_THREAD_ID => {
            u64::try_from(*value).ok()?
        }
        _ => return Some(label),
    };
    let owner = process.threads.host(procfs, process.pid, owner)?;
    Some(Label::num(
        clr_label_keys::LOCK_OWNER_THREAD_ID,
        i64::from(owner.tid),
    ))
}

/// The name of the leaf frame its kind adds above the stack
/// ([`crate::profile::kinds::EventKindSpec::leaf_label`]).
fn synthetic_leaf(item: &ClrSample) -> Option<&str> {
    let key = item.kind.spec().leaf_label?;
    item.labels.iter().find_map(|label| match &label.value {
        LabelValue::Str(name) if &*label.key == key => Some(&**name),
        _ => None,
    })
}
