//! ReadyToRun's NativeFormat readers (the method entry point arrays and
//! the instantiation hashtables of an image): any bytes give entries or
//! `None`, never a panic or an endless walk.
#![no_main]

use clrbpf_parse::native_format::{NativeArray, NativeReader, hashtable_entries};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let reader = NativeReader::new(input);
    if let Some(array) = NativeArray::new(reader, 0) {
        for index in 0..array.len().min(4096) {
            if let Some(at) = array.get(index) {
                let _ = reader.entry_point(at);
            }
        }
    }
    if let Some(entries) = hashtable_entries(reader, 0, 4096) {
        for at in entries {
            let _ = reader.skip_type(at);
        }
    }
});
