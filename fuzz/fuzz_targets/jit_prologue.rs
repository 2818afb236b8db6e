//! JIT prologues: any code bytes a target maps decode without a panic, to
//! rows that start at the method, stay inside the bytes read and are
//! sorted (an OSR method's too, over any tier-0 bytes); a process table made
//! of such methods stays sorted.
#![no_main]

use clrbpf::unwind::jit_code::{
    JitCodeRows, PROLOGUE_BYTES, method_frame, osr_method_frame,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|code: &[u8]| {
    let start = 0x7f00_0000_1000u64;
    let mut table = JitCodeRows::default();
    let mut previous: &[u8] = &[];
    for (i, chunk) in code.chunks(PROLOGUE_BYTES).enumerate() {
        let at = start + 0x100 * i as u64;
        // Every other chunk an OSR method on the previous one's frame.
        let frame = if i % 2 == 1 {
            osr_method_frame(chunk, at, previous, at - 0x100)
        } else {
            method_frame(chunk, at)
        };
        previous = chunk;
        if let Some(rows) = frame.rows() {
            assert_eq!(rows[0].pc, at);
            assert!(rows.windows(2).all(|w| w[0].pc < w[1].pc));
            assert!(rows.iter().all(|r| r.pc < at + chunk.len() as u64));
        }
        table.insert(at, at + chunk.len().max(1) as u64, &frame);
    }
    let rows = table.rows();
    assert!(rows.windows(2).all(|w| w[0].pc < w[1].pc));
});
