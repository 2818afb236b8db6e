//! ECMA-335 metadata: a (corrupt) PE image or metadata blob never panics,
//! and every MethodDef it claims gets a name or `None`.
#![no_main]

use clrbpf_parse::clr_metadata::ClrMetadata;
use libfuzzer_sys::fuzz_target;

fn name_all(metadata: &ClrMetadata) {
    for rid in 0..=metadata.method_count().min(1 << 16) + 1 {
        if let Some(name) = metadata.method_name(0x0600_0000 | rid) {
            assert!(name.len() <= 64 * 1024);
        }
    }
    let _ = metadata.assembly_name();
}

fuzz_target!(|input: &[u8]| {
    if let Ok(metadata) = ClrMetadata::from_image(input) {
        name_all(&metadata);
    }
    if let Ok(metadata) = ClrMetadata::parse_metadata(input.into()) {
        name_all(&metadata);
    }
});
