//! ReadyToRun method tables: a (corrupt) image never panics (the
//! NativeFormat readers alone are the `native_format` target).
#![no_main]

use clrbpf::symbolize::ready_to_run::AssemblyImage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    if let Ok(image) = AssemblyImage::from_image(input) {
        for offset in (0..input.len() as u64).step_by(97) {
            if let Some(token) = image.token_at_file_offset(offset) {
                let _ = image.metadata.method_name(token);
            }
        }
    }
});
