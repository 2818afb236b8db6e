//! Debug-file parsers (ELF section and program headers, `.gnu_debuglink`,
//! the build-id note) and the paths made from what they return: never
//! panic, never name a path that leaves its directory.
#![no_main]

use clrbpf::symbolize::debug_file::{
    build_id_path, debuglink_candidates, find_section, load_segments, parse_build_id_note,
    parse_debuglink, symbol_store_keys, virtual_offset,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = find_section(&mut &data[..], b".gnu_debuglink");
    if let Ok(segments) = load_segments(&mut &data[..]) {
        let _ = virtual_offset(&segments, u64::from_le_bytes([data.first().copied().unwrap_or(0); 8]));
    }
    if let Ok(link) = parse_debuglink(data) {
        assert!(!link.name.contains('/') && link.name != "..");
        if let Some(paths) = debuglink_candidates("/opt/app/libx.so", &link.name) {
            for path in paths {
                assert!(path.components().all(|c| c.as_os_str() != ".."));
            }
        }
    }
    if let Ok(id) = parse_build_id_note(data) {
        let path = build_id_path(&id).expect("a parsed build id makes a path");
        assert!(path.components().all(|c| c.as_os_str() != ".."));
        assert!(symbol_store_keys("libx.so", &id).is_some());
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Some(keys) = symbol_store_keys(text, "abcd") {
            assert!(keys.iter().all(|k| !k.split('/').any(|part| part == "..")));
        }
    }
});
