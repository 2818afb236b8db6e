//! ReadyToRun method tables: a (corrupt) image never panics, and the
//! NativeFormat readers never panic on any bytes.
#![no_main]

use clrbpf::symbolize::ready_to_run::AssemblyImage;
use clrbpf_parse::native_format::{NativeArray, NativeReader, hashtable_entries};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Ok(image) = AssemblyImage::from_image(input) {
        for offset in (0..input.len() as u64).step_by(97) {
            if let Some(token) = image.token_at_file_offset(offset) {
                let _ = image.metadata.method_name(token);
            }
        }
    }
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
