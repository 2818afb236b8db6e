use super::*;

fn methods(
    functions: &[(u32, u32)],
    entries: &[(u32, u32)],
    cold: &[(u32, u32)],
) -> ReadyToRunMethods {
    let mut methods = ReadyToRunMethods {
        functions: functions.into(),
        order: sorted_order(functions),
        tokens: vec![0; functions.len()].into_boxed_slice(),
        stats: ReadyToRunStats::default(),
    };
    for &(index, token) in entries {
        methods.set_entry(index, token);
    }
    let cold: Vec<u8> = cold
        .iter()
        .flat_map(|&(c, h)| c.to_le_bytes().into_iter().chain(h.to_le_bytes()))
        .collect();
    methods.resolve_funclets_and_cold_code(&cold);
    methods
}

#[test]
fn funclets_and_cold_code_belong_to_their_method() {
    // 0: method A, 1: its funclet, 2: method B, 3: B's cold part (listed
    // after C), 4: method C.
    let m = methods(
        &[
            (0x100, 0x180),
            (0x180, 0x1a0),
            (0x1a0, 0x200),
            (0x300, 0x320),
            (0x200, 0x280),
        ],
        &[(0, 0x0600_0001), (2, 0x0600_0002), (4, 0x0600_0003)],
        &[(3, 2)],
    );
    // Unsorted by begin: an index sorted once, then binary searched.
    assert_eq!(m.order.as_deref(), Some(&[0, 1, 2, 4, 3][..]));
    assert_eq!(m.token_at(0x100), Some(0x0600_0001));
    assert_eq!(m.token_at(0x190), Some(0x0600_0001));
    assert_eq!(m.token_at(0x1ff), Some(0x0600_0002));
    assert_eq!(m.token_at(0x310), Some(0x0600_0002));
    assert_eq!(m.token_at(0x27f), Some(0x0600_0003));
    // Gaps and the space past the table are nobody's.
    assert_eq!(m.token_at(0x280), None);
    assert_eq!(m.token_at(0x50), None);
}

#[test]
fn an_unnamed_entry_ends_the_method_before_it() {
    let m = methods(
        &[(0x10, 0x20), (0x20, 0x30), (0x30, 0x40), (0x40, 0x50)],
        &[(0, 0x0600_0001), (2, UNNAMED_ENTRY)],
        &[],
    );
    assert_eq!(m.token_at(0x25), Some(0x0600_0001));
    assert_eq!(m.token_at(0x35), None);
    assert_eq!(m.token_at(0x45), None);
}

#[test]
fn sorted_tables_are_binary_searched_and_entries_checked() {
    let m = methods(
        &[(0x10, 0x20), (0x20, 0x30), (0x40, 0x50)],
        &[(1, 0x0600_0007), (9, 0x0600_0008)],
        &[(7, 0), (0, 9)],
    );
    assert!(m.order.is_none(), "sorted: searched in place");
    assert_eq!(m.stats.bad_entries, 1);
    // Before the first entry: no method.
    assert_eq!(m.token_at(0x15), None);
    assert_eq!(m.token_at(0x25), Some(0x0600_0007));
    assert_eq!(m.token_at(0x45), Some(0x0600_0007));
    assert_eq!(m.token_at(0x35), None);
}

#[test]
fn instantiation_signatures() {
    // OwnerType | MethodInstantiation: owner GENERICINST CLASS tok 1 arg I4,
    // rid 0x22, one type argument STRING, then entry point 5 (no fixups).
    let sig = [
        0x44,
        0x15,
        0x12,
        0x09,
        0x01,
        0x08,
        0x22,
        0x01,
        0x0e,
        (5 << 1) << 1,
    ];
    assert_eq!(
        instance_entry(NativeReader::new(&sig), 0),
        Some((Some(0x22), 5))
    );
    // With fixups (bit 0): the index is id >> 2.
    let sig = [0x00, 0x05, (7 << 2 | 1) << 1];
    assert_eq!(
        instance_entry(NativeReader::new(&sig), 0),
        Some((Some(5), 7))
    );
    // Another module's method (flags 0x80 take two bytes), a MemberRef, a
    // slot: an entry, not named here.
    assert_eq!(
        instance_entry(NativeReader::new(&[0x80, 0x80, 0x01, 0x05, 3 << 2]), 0),
        Some((None, 3))
    );
    for flags in [0x10, 0x08] {
        assert_eq!(
            instance_entry(NativeReader::new(&[flags, 0x05, 3 << 2]), 0),
            Some((None, 3))
        );
    }
    // Truncated.
    assert_eq!(instance_entry(NativeReader::new(&[0x44, 0x15]), 0), None);
}

#[test]
fn il_only_assemblies_have_metadata_and_no_code() {
    let image = AssemblyImage::from_image(include_bytes!(
        "../../../../profiler-parse/src/clr_metadata/testdata/Names.dll"
    ))
    .expect("an assembly");
    assert!(image.methods.is_none());
    assert_eq!(image.token_at_file_offset(0x200), None);
    assert!(matches!(
        AssemblyImage::from_image(b"MZ"),
        Err(ReadyToRunError::Metadata(_))
    ));
}

/// A hostile unsorted table of many entries is searched in O(log n) per
/// lookup: every function is found through the sorted index.
#[test]
fn unsorted_tables_are_binary_searched_through_a_sorted_index() {
    let n = 100_000u32;
    // Reversed: the worst order for a linear search from the front.
    let functions: Vec<(u32, u32)> = (0..n).rev().map(|i| (i * 16, i * 16 + 16)).collect();
    let entries: Vec<(u32, u32)> = (0..n).map(|i| (i, 0x0600_0000 | (i + 1))).collect();
    let m = methods(&functions, &entries, &[]);
    assert_eq!(m.order.as_ref().map(|o| o.len()), Some(n as usize));
    assert_eq!(m.memory_bytes(), n as usize * 16, "the index is charged");
    for rva in [0, 15, 16 * 500 + 3, 16 * (n - 1) + 15] {
        let index = n - 1 - rva / 16;
        assert_eq!(m.token_at(rva), Some(0x0600_0000 | (index + 1)), "{rva:#x}");
    }
    assert_eq!(m.token_at(16 * n), None);
}
