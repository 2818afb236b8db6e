//! CLR event payloads: any bytes a runtime could send as the payload of an
//! event the decoders know (contention, exceptions, waits, method and
//! module loads, ReadyToRun entry points, rundown, allocation ticks and
//! samples), in any version, decode to an event or an error, never a
//! panic. The nettrace target
//! reaches the decoders only through well-framed blocks; this one hands
//! them payloads directly.
#![no_main]

use clrbpf_parse::{
    allocations::{ALLOCATION_SAMPLED, GC_ALLOCATION_TICK},
    events::{
        ClrEvent, MAX_STRING_UNITS, RUNDOWN_PROVIDER, RUNTIME_PROVIDER, decode_clr_event,
        rundown_event, runtime_event,
    },
};
use libfuzzer_sys::fuzz_target;

/// Every (provider, event id) with a decoder.
const EVENTS: &[(&str, u32)] = &[
    (RUNTIME_PROVIDER, runtime_event::EXCEPTION_THROWN),
    (RUNTIME_PROVIDER, runtime_event::CONTENTION_START),
    (RUNTIME_PROVIDER, runtime_event::CONTENTION_LOCK_CREATED),
    (RUNTIME_PROVIDER, runtime_event::CONTENTION_STOP),
    (RUNTIME_PROVIDER, runtime_event::METHOD_LOAD_VERBOSE),
    (RUNTIME_PROVIDER, runtime_event::METHOD_UNLOAD_VERBOSE),
    (RUNTIME_PROVIDER, runtime_event::MODULE_LOAD),
    (RUNTIME_PROVIDER, runtime_event::MODULE_UNLOAD),
    (RUNTIME_PROVIDER, runtime_event::R2R_GET_ENTRY_POINT),
    (RUNTIME_PROVIDER, runtime_event::WAIT_HANDLE_WAIT_START),
    (RUNTIME_PROVIDER, runtime_event::WAIT_HANDLE_WAIT_STOP),
    (RUNTIME_PROVIDER, GC_ALLOCATION_TICK),
    (RUNTIME_PROVIDER, ALLOCATION_SAMPLED),
    (RUNDOWN_PROVIDER, rundown_event::METHOD_DC_START_VERBOSE),
    (RUNDOWN_PROVIDER, rundown_event::METHOD_DC_END_VERBOSE),
    (RUNDOWN_PROVIDER, rundown_event::DC_START_COMPLETE),
    (RUNDOWN_PROVIDER, rundown_event::DC_END_COMPLETE),
    (RUNDOWN_PROVIDER, rundown_event::DC_START_INIT),
    (RUNDOWN_PROVIDER, rundown_event::DC_END_INIT),
    (RUNDOWN_PROVIDER, rundown_event::MODULE_DC_START),
    (RUNDOWN_PROVIDER, rundown_event::MODULE_DC_END),
];

fuzz_target!(|data: &[u8]| {
    // Byte 0 picks the event, byte 1 the version (0-7: past the newest
    // layout too); the rest is the payload.
    let [which, version, payload @ ..] = data else {
        return;
    };
    let (provider, id) = EVENTS[usize::from(*which) % EVENTS.len()];
    let version = u32::from(*version % 8);
    if let Ok(Some(event)) = decode_clr_event(provider, id, version, payload) {
        // Strings are bounded (UTF-16 units become at most 3 UTF-8 bytes).
        let bound = 3 * MAX_STRING_UNITS;
        match &event {
            ClrEvent::ExceptionThrown(e) => {
                assert!(e.type_name.len() <= bound && e.message.len() <= bound);
            }
            ClrEvent::Method(m) => {
                assert!(m.namespace.len() <= bound && m.name.len() <= bound);
                assert!(m.signature.len() <= bound);
            }
            _ => {}
        }
    }
});
