//! Writers for a finished [`crate::profile::Profile`]: the last stage of the
//! data flow. [`pprof`] builds and gzips a pprof protobuf (the primary
//! output, read by `go tool pprof`, Pyroscope, Parca), [`collapsed`] writes
//! Brendan Gregg's folded stacks, [`flamegraph`] turns those into an SVG
//! through `inferno`, and [`output`] picks the format and writes the file
//! atomically, never through a symlink.

pub mod collapsed;
pub mod flamegraph;
pub mod frame_names;
pub mod output;
pub mod pprof;
pub mod sink;
pub mod split;

#[cfg(test)]
pub(crate) mod test_profile;

use std::{io, path::PathBuf};

pub use collapsed::write_collapsed;
pub use flamegraph::write_flamegraph;
pub use output::{OutputFile, OutputFormat, create_output, sudo_owner, write_profile};
pub use pprof::{ValidationError, read_pprof, to_pprof, validate, write_pprof};

use crate::profile::Profile;

/// Why a profile could not be written (or, for tests, read back).
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("cannot write the {what}")]
    Write {
        /// The output being written: `pprof profile`, `folded stacks`, ...
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("sample type index {index} is out of range: the profile has {count} sample types")]
    SampleTypeOutOfRange { index: usize, count: usize },
    #[error("the pprof profile built from this profile is invalid")]
    InvalidPprof {
        #[source]
        source: ValidationError,
    },
    #[error("cannot decompress the gzip pprof profile")]
    Decompress {
        #[source]
        source: io::Error,
    },
    #[error("the decompressed pprof profile is larger than {limit} bytes")]
    PprofTooLarge { limit: u64 },
    #[error("cannot decode the pprof profile")]
    Decode {
        #[source]
        source: prost::DecodeError,
    },
    #[error("unknown output format `{name}` (expected pprof, collapsed or svg)")]
    UnknownFormat { name: String },
    #[error("output path `{path}` does not name a file")]
    NotAFilePath { path: PathBuf },
    #[error("cannot create a temporary output file in `{dir}`")]
    CreateTemp {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot write `{path}`")]
    WriteOutput {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot give the output file `{path}` to uid {uid} gid {gid}")]
    Chown {
        path: PathBuf,
        uid: u32,
        gid: u32,
        #[source]
        source: io::Error,
    },
    #[error("`{path}` is a directory: name a file to write the profile to")]
    OutputIsDirectory { path: PathBuf },
    #[error("cannot move the finished output to `{to}`; the profile is kept in `{from}`")]
    Rename {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The index of the sample type called `name` (`cpu`, `samples`, ...),
/// as `go tool pprof -sample_index=NAME` resolves it.
pub fn sample_type_index(profile: &Profile, name: &str) -> Option<usize> {
    profile
        .sample_types
        .iter()
        .position(|sample_type| &*sample_type.r#type == name)
}

/// Checks a sample type index against the profile, for the writers that
/// show one value per stack.
fn check_sample_type_index(profile: &Profile, index: usize) -> Result<(), ExportError> {
    let count = profile.sample_types.len();
    if index < count {
        Ok(())
    } else {
        Err(ExportError::SampleTypeOutOfRange { index, count })
    }
}
