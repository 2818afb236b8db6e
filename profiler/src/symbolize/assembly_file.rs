//! Reads a target's assembly file for its ECMA-335 metadata
//! (`clrbpf_parse::clr_metadata` parses it): the PE headers, then the
//! metadata alone, with positioned reads of a file the caller opened
//! inside the target's root. Nothing else of the file is read.

use std::fs::File;
use std::os::unix::fs::FileExt;

use clrbpf_parse::clr_metadata::{ClrMetadata, MAX_METADATA_BYTES, MetadataError, PE_HEADER_BYTES};

/// The metadata of the assembly opened as `file`, at most
/// [`MAX_METADATA_BYTES`].
pub fn read_metadata(file: &File) -> Result<ClrMetadata, MetadataError> {
    read_metadata_at_most(file, MAX_METADATA_BYTES)
}

/// [`read_metadata`], refusing metadata over `limit` bytes before it is
/// read.
pub fn read_metadata_at_most(file: &File, limit: u32) -> Result<ClrMetadata, MetadataError> {
    let read = |offset: u64, len: u32| -> Result<Vec<u8>, MetadataError> {
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, offset)
            .map_err(|source| MetadataError::Read { source })?;
        Ok(buf)
    };
    let mut header = vec![0u8; PE_HEADER_BYTES];
    let got = read_up_to(file, &mut header)?;
    header.truncate(got);
    ClrMetadata::from_parts(&header, limit, read)
}

/// Fills `buf` from the start of `file` as far as the file goes.
fn read_up_to(file: &File, buf: &mut [u8]) -> Result<usize, MetadataError> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => return Err(MetadataError::Read { source }),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Names.cs` built with mcs (a PE32, IL-only assembly).
    const NAMES_DLL: &[u8] =
        include_bytes!("../../../profiler-parse/src/clr_metadata/testdata/Names.dll");

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
    fn reads_only_headers_and_metadata_from_a_file() {
        let dir = std::env::temp_dir().join(format!("clrbpf-metadata-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("Names.dll");
        std::fs::write(&path, NAMES_DLL).expect("write");
        let file = File::open(&path).expect("open");
        let from_file = read_metadata(&file).expect("reads");
        let from_image = ClrMetadata::from_image(NAMES_DLL).expect("parses");
        assert_eq!(all_names(&from_file), all_names(&from_image));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
