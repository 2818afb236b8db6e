//! ReadyToRun unwind info: decoding an `UNWIND_INFO` never panics and its
//! rows stay inside the function, sorted; a whole (corrupt) image never
//! panics either and gives sorted rows.
#![no_main]

use clrbpf::unwind::{UnwindTable, ready_to_run::rows_of_unwind_info};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Some((&len, info)) = input.split_first() {
        let begin = 0x1_8000_1000u64;
        let len = u64::from(len) + 1;
        if let Some(rows) = rows_of_unwind_info(info, begin, len) {
            assert!(!rows.is_empty());
            assert_eq!(rows[0].pc, begin);
            for pair in rows.windows(2) {
                assert!(pair[0].pc < pair[1].pc);
            }
            assert!(rows.iter().all(|r| r.pc < begin + len));
        }
    }
    if let Ok(table) = UnwindTable::from_elf_bytes(input) {
        for pair in table.rows().windows(2) {
            assert!(pair[0].pc < pair[1].pc);
        }
    }
});
