//! The memory name path over hostile target memory: any bytes a process
//! could hold where the runtime's code range map, code heaps, code headers
//! and MethodDescs should be give a name or an error, never a panic or an
//! endless walk. The input picks a layout (.NET 6-10), the PC looked up,
//! and fills up to 16 pages the pointers in it may point into.
#![no_main]

use clrbpf::{
    clr::memory::{ClrMemoryReader, runtime_image::RuntimeImage, target::FakeMemory},
    process::MappingTable,
};
use libfuzzer_sys::fuzz_target;

const PAGES: u64 = 0x5600_0000_0000;
const PAGE: usize = 4096;

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let major = 6 + u32::from(data[0] % 5);
    let pc = u64::from_le_bytes(data[1..9].try_into().expect("8 bytes"));
    let mut mem = FakeMemory::new();
    for (i, chunk) in data[9..].chunks(PAGE).take(16).enumerate() {
        let mut page = vec![0u8; PAGE];
        page[..chunk.len()].copy_from_slice(chunk);
        mem.put(PAGES + (i * PAGE) as u64, &page);
    }
    let image = RuntimeImage {
        // The DAC table is the first page.
        dac_table: PAGES,
        contract_descriptor: None,
        segments: vec![(0, 0, 0x100_0000)],
        file_version: None,
    };
    let mappings = MappingTable::parse(&b""[..]).expect("empty maps");
    let Ok(reader) = ClrMemoryReader::new(mem, &image, 0, major, &mappings) else {
        return;
    };
    for pc in [pc, pc & !0xfff | 0x40, PAGES + (pc & 0xffff)] {
        let _ = reader.code_at(pc);
    }
});
