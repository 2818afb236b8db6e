//! Stack resolution: the addresses of a raw sample (or of a CLR event's
//! stack) to frames, managed first (the process's JIT code index, at the
//! sample's time), then native (the mapping's file, through blazesym), with
//! the mappings re-read once when an address falls in none of them.

use std::sync::Arc;

use super::tracked::{TrackedProcess, mapped_file};
use crate::{
    clr::intake::ClrSampleKind,
    process::ProcFs,
    profile::{
        Aggregator, Frame, FrameKind, Label, label_keys,
        layout::{ValueLayout, clr_offsets},
    },
    symbolize::native::NativeSymbolizer,
};

pub(super) fn user_frame(
    native: &mut NativeSymbolizer,
    procfs: &ProcFs,
    process: &mut TrackedProcess,
    addr: u64,
    is_return_address: bool,
    time_ns: u64,
) -> Arc<Frame> {
    let lookup = if is_return_address {
        addr.saturating_sub(1)
    } else {
        addr
    };
    if let Some(managed) = process.managed.as_ref()
        && let Some(symbol) = managed.lookup(lookup, time_ns)
    {
        return Arc::new(Frame {
            kind: FrameKind::Managed,
            name: symbol.short_name.clone(),
            system_name: (symbol.raw_name != symbol.short_name).then(|| symbol.raw_name.clone()),
            jit_tier: symbol.jit_tier,
            module: Some(process.jit_module.clone()),
            address: addr,
            file: symbol.assembly,
            line: 0,
            inlined: Vec::new(),
        });
    }
    if process.mapping_for(addr).is_none() {
        process.refresh_maps(procfs, native);
    }
    let pid = process.pid;
    match process.mapping_for(addr) {
        Some(m) => match mapped_file(pid, m) {
            Some(mapped) => native.symbolize_user(&mapped, addr, is_return_address),
            None => Arc::new(crate::symbolize::native::unnamed_frame(None, addr, 0)),
        },
        None => Arc::new(crate::symbolize::native::unnamed_frame(None, addr, 0)),
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
    kept: Vec<crate::profile::clr_sampling::Weighted<crate::clr::intake::ClrSample>>,
) {
    for weighted in kept {
        let crate::profile::clr_sampling::Weighted {
            item,
            count,
            delay_ns,
        } = weighted;
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
        let mut labels = vec![
            Label::num(label_keys::PROCESS_PID, i64::from(process.pid)),
            Label::str(
                label_keys::PROCESS_EXECUTABLE_NAME,
                process.exe_name.clone(),
            ),
            Label::num(
                label_keys::THREAD_ID,
                i64::try_from(item.thread_id).unwrap_or(i64::MAX),
            ),
        ];
        if let Some(id) = &process.container_id {
            labels.push(Label::str(label_keys::CONTAINER_ID, id.clone()));
        }
        labels.extend(process.pod.iter().flat_map(|pod| pod.sample_labels()));
        labels.extend(item.labels);
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        let delay = i64::try_from(delay_ns).unwrap_or(i64::MAX);
        let mut values = layout.zeros();
        if item.kind == ClrSampleKind::Allocation {
            let Some(alloc) = layout.alloc else {
                continue;
            };
            values[alloc] = count;
            values[alloc + 1] = delay;
            aggregator.add(stack, labels, &values);
            continue;
        }
        let Some(clr) = layout.clr else {
            continue;
        };
        match item.kind {
            ClrSampleKind::Contention => {
                values[clr + clr_offsets::CONTENTIONS] = count;
                values[clr + clr_offsets::DELAY] = delay;
            }
            ClrSampleKind::Exception => values[clr + clr_offsets::EXCEPTIONS] = count,
            ClrSampleKind::Wait => {
                values[clr + clr_offsets::WAITS] = count;
                values[clr + clr_offsets::WAIT_DELAY] = delay;
            }
            ClrSampleKind::Allocation => {}
        }
        aggregator.add(stack, labels, &values);
    }
}

/// The type name an allocation sample's leaf frame shows.
fn allocation_leaf(item: &crate::clr::intake::ClrSample) -> Option<&str> {
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
