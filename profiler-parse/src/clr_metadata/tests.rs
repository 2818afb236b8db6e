use super::*;

/// `testdata/Names.cs` built with mcs (a PE32, IL-only assembly).
const NAMES_DLL: &[u8] = include_bytes!("testdata/Names.dll");

fn all_names(metadata: &ClrMetadata) -> Vec<String> {
    (1..=metadata.method_count())
        .map(|rid| {
            metadata
                .method_name(0x0600_0000 | rid)
                .unwrap_or_else(|| panic!("method {rid} has a name"))
        })
        .collect()
}

#[test]
fn names_methods_of_namespaces_nested_and_generic_types() {
    let metadata = ClrMetadata::from_image(NAMES_DLL).expect("Names.dll parses");
    assert_eq!(metadata.assembly_name(), Some("Names"));
    let names = all_names(&metadata);
    for expected in [
        "Shop.Orders.Program.Main",
        "Shop.Orders.Program.Work",
        "Shop.Orders.Program..ctor",
        "Shop.Orders.Program.<Main>m__0",
        "Shop.Orders.Outer+Inner.M",
        "Shop.Orders.Outer+Inner+Deepest.Deep",
        "Shop.Orders.Outer+Box`1.Get",
        "NoNamespace.Run",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} in {names:?}"
        );
    }
    assert_eq!(
        metadata.method_parts(0x0600_0001).map(|(t, _)| t),
        Some("Shop.Orders.Program".to_owned())
    );
    // Not a MethodDef, or past the table.
    assert_eq!(metadata.method_name(0x0200_0001), None);
    assert_eq!(metadata.method_name(0x0600_0000), None);
    assert_eq!(
        metadata.method_name(0x0600_0000 | (metadata.method_count() + 1)),
        None
    );
}

#[test]
fn other_files_are_clear_errors() {
    assert!(matches!(
        ClrMetadata::from_image(b"\x7fELF"),
        Err(MetadataError::NotPe { .. })
    ));
    assert!(matches!(
        ClrMetadata::parse_metadata(Box::new(*b"nope")),
        Err(MetadataError::Malformed { .. })
    ));
}

/// Every truncation and many single-byte changes of a real assembly give an
/// error or names, never a panic (what the fuzz target checks at scale).
#[test]
fn truncated_and_corrupted_images_never_panic() {
    for cut in 0..NAMES_DLL.len() {
        if let Ok(metadata) = ClrMetadata::from_image(&NAMES_DLL[..cut]) {
            let _ = all_names_lossy(&metadata);
        }
    }
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..4000 {
        let mut image = NAMES_DLL.to_vec();
        for _ in 0..4 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let at = (seed >> 16) as usize % image.len();
            image[at] = seed as u8;
        }
        if let Ok(metadata) = ClrMetadata::from_image(&image) {
            let _ = all_names_lossy(&metadata);
        }
    }
}

fn all_names_lossy(metadata: &ClrMetadata) -> Vec<Option<String>> {
    (0..=metadata.method_count().min(4096) + 1)
        .map(|rid| metadata.method_name(0x0600_0000 | rid))
        .collect()
}

#[test]
fn nesting_cycles_end() {
    let mut metadata = ClrMetadata::from_image(NAMES_DLL).expect("parses");
    // Two types each enclosing the other.
    metadata.enclosing.insert(2, 3);
    metadata.enclosing.insert(3, 2);
    let name = metadata.type_name(2).expect("a name");
    assert_eq!(name.matches('+').count(), MAX_NESTING - 1, "{name}");
}
