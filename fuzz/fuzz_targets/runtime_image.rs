//! The bounded reader of a target's `libcoreclr.so`: any bytes give an
//! image or an error, never a panic, and never a read past the caps
//! (a table claiming gigabytes is refused, not allocated).
#![no_main]

use clrbpf::clr::memory::runtime_image::RuntimeImage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(image) = RuntimeImage::parse(data) {
        let _ = image.major();
        for &(offset, _, _) in &image.segments {
            let _ = image.load_bias(0x7f00_0000_0000, offset);
        }
    }
});
