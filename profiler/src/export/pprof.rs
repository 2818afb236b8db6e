//! The pprof writer: turns a finished [`Profile`] into the protobuf of
//! google/pprof's `profile.proto` and writes it gzip-compressed, the form
//! `go tool pprof`, Pyroscope and Parca read. Also the checks that
//! `go tool pprof` itself applies on load ([`validate`], a port of
//! `profile.CheckValid` and of the index checks in its decoder), and a reader
//! ([`read_pprof`]) for tests.
//!
//! The rules (google/pprof `proto/profile.proto`, `profile/encode.go`):
//!
//! 1. `string_table[0]` is `""`; every string is interned once.
//! 2. Mapping, location and function ids are `1..=n`, in table order; id 0
//!    means "none" (a location without a mapping).
//! 3. One mapping per distinct [`Module`], the profile's main module (the
//!    application) first when it has one, whether or not a frame is in
//!    it: viewers name the profile after the first mapping. `has_functions` comes from the
//!    module: `go tool pprof` re-symbolizes a mapping with no `has_*` flag
//!    set from the binary on the reader's machine, which is what we want for
//!    modules the profiler could not name. The other `has_*` flags are set
//!    only on such symbolized mappings, from what their frames carry.
//! 4. One location per distinct (mapping, address, lines). For a given
//!    module and address that is one location, as pprof expects; the lines
//!    are part of the key because a JIT address can hold two different
//!    methods over one profile (code is freed and reused), and synthetic
//!    frames all sit at address 0. A location's lines are the inline chain,
//!    innermost first ([`Frame::inlined`]), then the frame's own function.
//! 5. One function per distinct (name, system_name, filename). Managed
//!    frames get `name` = `Namespace.Type.Method` (or, with
//!    `--frame-names full`, the signature without the JIT tier),
//!    `system_name` = the runtime's whole name with the tier, and
//!    `filename` = the assembly, so `go tool pprof` (which groups by
//!    `name`) shows one node per method while `-raw` still tells the
//!    tiers apart. A managed frame without a distinct system name gets none
//!    (string 0): when `system_name == name`, `go tool pprof` takes the name
//!    for demangled C++ and cuts its parameter and generic lists
//!    (`App::Main(string[])` -> `App::Main`), which would merge .NET
//!    overloads; other frames keep pprof's usual `system_name = name`.
//! 6. Labels: strings in `str`, numbers in `num` (+ `num_unit`). A key
//!    appears at most once per sample (pprof discourages multi-valued keys
//!    and most tools ignore all but one value): later duplicates are
//!    dropped. Note that `go tool pprof` ignores a numeric label whose value
//!    is 0 and has no unit, and a string label whose value is `""`: pprof
//!    cannot tell them from an absent field.

use std::{
    collections::{HashMap, HashSet},
    io::{Read as _, Write},
};

use flate2::{Compression, read::GzDecoder, write::GzEncoder};
use prost::Message as _;

use super::ExportError;
use crate::{
    pprof_proto,
    profile::{Frame, FrameIndex, FrameKind, LabelValue, Module, Profile},
};

/// The largest decompressed profile [`read_pprof`] accepts: a bound on
/// what a corrupt or hostile gzip stream can make us allocate.
pub const MAX_DECOMPRESSED_PPROF: u64 = 1 << 30;

/// The first two bytes of a gzip stream (RFC 1952).
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Where a sample's stack refers to a frame the profile does not have; an
/// aggregator bug, shown rather than dropped so the sample's value counts.
const INVALID_FRAME_NAME: &str = "[invalid frame index]";

/// Builds the pprof protobuf of `profile`. Never fails: a stack entry that
/// points outside [`Profile::frames`] becomes an `[invalid frame index]`
/// frame. The sample values are copied as they are; [`write_pprof`] checks
/// that their count matches the sample types.
pub fn to_pprof(profile: &Profile) -> pprof_proto::Profile {
    // Destructured so a new field in the model breaks the build here.
    let Profile {
        sample_types,
        default_sample_type,
        period_type,
        period,
        start_unix_ns,
        duration_ns,
        frames,
        samples,
        comments,
        main_module,
    } = profile;

    let mut builder = PprofBuilder::new(frames.len());
    if let Some(module) = main_module {
        // See rule 3 of the module doc.
        builder.mapping_id(module);
    }
    let sample_type = sample_types
        .iter()
        .map(|value_type| builder.value_type(&value_type.r#type, &value_type.unit))
        .collect();
    let period_type = period_type
        .as_ref()
        .map(|value_type| builder.value_type(&value_type.r#type, &value_type.unit));
    let default_sample_type = default_sample_type
        .and_then(|index| sample_types.get(index))
        .map_or(0, |value_type| builder.strings.intern(&value_type.r#type));
    let comment = comments
        .iter()
        .map(|comment| builder.strings.intern(comment))
        .collect();

    let sample = samples
        .iter()
        .map(|sample| {
            let location_id = sample
                .stack
                .iter()
                .map(|&index| builder.frame_location(frames, index))
                .collect();
            let mut label: Vec<pprof_proto::Label> = Vec::with_capacity(sample.labels.len());
            for profile_label in &sample.labels {
                let key = builder.strings.intern(&profile_label.key);
                if label.iter().any(|existing| existing.key == key) {
                    continue;
                }
                label.push(match &profile_label.value {
                    LabelValue::Str(value) => pprof_proto::Label {
                        key,
                        str: builder.strings.intern(value),
                        ..Default::default()
                    },
                    LabelValue::Num { value, unit } => pprof_proto::Label {
                        key,
                        num: *value,
                        num_unit: unit
                            .as_deref()
                            .map_or(0, |unit| builder.strings.intern(unit)),
                        ..Default::default()
                    },
                });
            }
            pprof_proto::Sample {
                location_id,
                value: sample.values.clone(),
                label,
            }
        })
        .collect();

    let PprofBuilder {
        strings,
        mapping,
        location,
        function,
        ..
    } = builder;
    pprof_proto::Profile {
        sample_type,
        sample,
        mapping,
        location,
        function,
        string_table: strings.strings,
        drop_frames: 0,
        keep_frames: 0,
        time_nanos: *start_unix_ns,
        duration_nanos: *duration_ns,
        period_type,
        period: *period,
        comment,
        default_sample_type,
        doc_url: 0,
    }
}

/// Writes `profile` as a gzip-compressed pprof protobuf.
///
/// Fails with [`ExportError::InvalidPprof`] when the result would not load
/// in `go tool pprof` (a sample whose value count differs from the sample
/// types), rather than writing a file no tool can read.
pub fn write_pprof(profile: &Profile, w: impl Write) -> Result<(), ExportError> {
    let pprof = to_pprof(profile);
    validate(&pprof).map_err(|source| ExportError::InvalidPprof { source })?;
    let write_error = |source| ExportError::Write {
        what: "pprof profile",
        source,
    };
    // The fastest level, as Go's runtime/pprof writes its profiles: at the
    // end of a recording the user waits, and a profile of a million frames
    // took 1 s at the default level.
    let mut gzip = GzEncoder::new(w, Compression::fast());
    gzip.write_all(&pprof.encode_to_vec())
        .map_err(write_error)?;
    gzip.finish()
        .map_err(write_error)?
        .flush()
        .map_err(write_error)
}

/// Reads a pprof protobuf, gzip-compressed or raw (both are what
/// `go tool pprof` accepts). It does not [`validate`] it.
pub fn read_pprof(bytes: &[u8]) -> Result<pprof_proto::Profile, ExportError> {
    if bytes.starts_with(&GZIP_MAGIC) {
        let mut decompressed = Vec::new();
        GzDecoder::new(bytes)
            .take(MAX_DECOMPRESSED_PPROF + 1)
            .read_to_end(&mut decompressed)
            .map_err(|source| ExportError::Decompress { source })?;
        if decompressed.len() as u64 > MAX_DECOMPRESSED_PPROF {
            return Err(ExportError::PprofTooLarge {
                limit: MAX_DECOMPRESSED_PPROF,
            });
        }
        decode(&decompressed)
    } else {
        decode(bytes)
    }
}

fn decode(bytes: &[u8]) -> Result<pprof_proto::Profile, ExportError> {
    pprof_proto::Profile::decode(bytes).map_err(|source| ExportError::Decode { source })
}

/// Interned strings: `strings[i]` is string index `i`; index 0 is `""`.
struct StringTable {
    strings: Vec<String>,
    index: HashMap<String, i64>,
}

impl StringTable {
    fn new() -> Self {
        Self {
            strings: vec![String::new()],
            index: HashMap::from([(String::new(), 0)]),
        }
    }

    fn intern(&mut self, s: &str) -> i64 {
        if let Some(&index) = self.index.get(s) {
            return index;
        }
        let index = i64::try_from(self.strings.len()).expect("fewer than 2^63 strings");
        self.strings.push(s.to_owned());
        self.index.insert(s.to_owned(), index);
        index
    }
}

/// A function's identity in the function table: string indices.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct FunctionKey {
    name: i64,
    system_name: i64,
    filename: i64,
}

/// A location's identity: its mapping, address and `(function id, line)`
/// per line.
#[derive(Clone, PartialEq, Eq, Hash)]
struct LocationKey {
    mapping_id: u64,
    address: u64,
    lines: Vec<(u64, i64)>,
}

/// The tables of one pprof under construction.
struct PprofBuilder {
    strings: StringTable,
    function: Vec<pprof_proto::Function>,
    function_ids: HashMap<FunctionKey, u64>,
    mapping: Vec<pprof_proto::Mapping>,
    /// Keyed by value: a `Module` is a few `Arc`s and numbers.
    mapping_ids: HashMap<Module, u64>,
    location: Vec<pprof_proto::Location>,
    location_ids: HashMap<LocationKey, u64>,
    /// Location id of each [`Profile::frames`] entry, once built.
    frame_locations: Vec<Option<u64>>,
    invalid_frame_location: Option<u64>,
}

/// A 1-based id for the next entry of a table of `len` entries.
fn next_id(len: usize) -> u64 {
    u64::try_from(len).expect("table length fits u64") + 1
}

impl PprofBuilder {
    fn new(frame_count: usize) -> Self {
        Self {
            strings: StringTable::new(),
            function: Vec::new(),
            function_ids: HashMap::new(),
            mapping: Vec::new(),
            mapping_ids: HashMap::new(),
            location: Vec::new(),
            location_ids: HashMap::new(),
            frame_locations: vec![None; frame_count],
            invalid_frame_location: None,
        }
    }

    fn value_type(&mut self, r#type: &str, unit: &str) -> pprof_proto::ValueType {
        pprof_proto::ValueType {
            r#type: self.strings.intern(r#type),
            unit: self.strings.intern(unit),
        }
    }

    fn frame_location(&mut self, frames: &[Frame], index: FrameIndex) -> u64 {
        let Some(slot) = usize::try_from(index)
            .ok()
            .filter(|&index| index < frames.len())
        else {
            return self.invalid_frame_location();
        };
        if let Some(id) = self.frame_locations[slot] {
            return id;
        }
        let id = self.location(&frames[slot]);
        self.frame_locations[slot] = Some(id);
        id
    }

    fn invalid_frame_location(&mut self) -> u64 {
        if let Some(id) = self.invalid_frame_location {
            return id;
        }
        let id = self.location(&Frame::synthetic(INVALID_FRAME_NAME));
        self.invalid_frame_location = Some(id);
        id
    }

    fn location(&mut self, frame: &Frame) -> u64 {
        let mut lines = Vec::with_capacity(frame.inlined.len() + 1);
        for inlined in &frame.inlined {
            let function_id = self.function(&inlined.name, &inlined.name, inlined.file.as_deref());
            lines.push((function_id, i64::from(inlined.line)));
        }
        let system_name = match (&frame.system_name, frame.kind) {
            (Some(system_name), _) if *system_name != frame.name => system_name,
            // See rule 5 of the module doc.
            (_, FrameKind::Managed) => "",
            _ => &*frame.name,
        };
        let function_id = self.function(&frame.name, system_name, frame.file.as_deref());
        lines.push((function_id, i64::from(frame.line)));

        let mapping_id = frame
            .module
            .as_deref()
            .map_or(0, |module| self.mapping_for(frame, module));
        let key = LocationKey {
            mapping_id,
            address: frame.address,
            lines,
        };
        if let Some(&id) = self.location_ids.get(&key) {
            return id;
        }
        let id = next_id(self.location.len());
        self.location.push(pprof_proto::Location {
            id,
            mapping_id,
            address: frame.address,
            line: key
                .lines
                .iter()
                .map(|&(function_id, line)| pprof_proto::Line {
                    function_id,
                    line,
                    column: 0,
                })
                .collect(),
            is_folded: false,
        });
        self.location_ids.insert(key, id);
        id
    }

    /// The id of `module`'s mapping, created on first use.
    fn mapping_id(&mut self, module: &Module) -> u64 {
        if let Some(&id) = self.mapping_ids.get(module) {
            return id;
        }
        let id = next_id(self.mapping.len());
        let Module {
            path,
            build_id,
            memory_start,
            memory_limit,
            file_offset,
            has_functions,
        } = module;
        self.mapping.push(pprof_proto::Mapping {
            id,
            memory_start: *memory_start,
            memory_limit: *memory_limit,
            file_offset: *file_offset,
            filename: self.strings.intern(path),
            build_id: build_id
                .as_deref()
                .map_or(0, |build_id| self.strings.intern(build_id)),
            has_functions: *has_functions,
            has_filenames: false,
            has_line_numbers: false,
            has_inline_frames: false,
        });
        self.mapping_ids.insert(module.clone(), id);
        id
    }

    /// The mapping of `module` ([`Self::mapping_id`]), with its `has_*`
    /// flags widened by what `frame` carries.
    fn mapping_for(&mut self, frame: &Frame, module: &Module) -> u64 {
        let id = self.mapping_id(module);
        let mapping = &mut self.mapping[usize::try_from(id - 1).expect("id fits usize")];
        if frame.kind == FrameKind::Unknown {
            // A placeholder name (`[libcoreclr.so]`): a reader that has the
            // debug file (`go tool pprof`, a backend) names these
            // addresses only in a mapping that does not claim functions.
            mapping.has_functions = false;
            mapping.has_filenames = false;
            mapping.has_line_numbers = false;
            mapping.has_inline_frames = false;
        }
        if mapping.has_functions {
            let inline_files = frame.inlined.iter().any(|inlined| inlined.file.is_some());
            let inline_lines = frame.inlined.iter().any(|inlined| inlined.line != 0);
            mapping.has_filenames |= frame.file.is_some() || inline_files;
            mapping.has_line_numbers |= frame.line != 0 || inline_lines;
            mapping.has_inline_frames |= !frame.inlined.is_empty();
        }
        id
    }

    fn function(&mut self, name: &str, system_name: &str, filename: Option<&str>) -> u64 {
        let key = FunctionKey {
            name: self.strings.intern(name),
            system_name: self.strings.intern(system_name),
            filename: filename.map_or(0, |filename| self.strings.intern(filename)),
        };
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = next_id(self.function.len());
        self.function.push(pprof_proto::Function {
            id,
            name: key.name,
            system_name: key.system_name,
            filename: key.filename,
            start_line: 0,
        });
        self.function_ids.insert(key, id);
        id
    }
}

/// Why a pprof profile would not load in `go tool pprof` (or breaks a rule
/// of `profile.proto` that tools rely on).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    #[error("the string table is empty: string 0 must be \"\"")]
    EmptyStringTable,
    #[error("string 0 of the string table is {value:?}, not \"\"")]
    FirstStringNotEmpty { value: String },
    #[error("`{field}` refers to string {index}, but the string table has {len} strings")]
    StringOutOfRange {
        field: &'static str,
        index: i64,
        len: usize,
    },
    #[error("the profile has samples but no sample types")]
    MissingSampleTypes,
    #[error("sample {sample} has {values} values for {types} sample types")]
    ValueCountMismatch {
        sample: usize,
        values: usize,
        types: usize,
    },
    #[error("{table} entry {position} has the reserved id 0")]
    ZeroId {
        table: &'static str,
        position: usize,
    },
    #[error("{table} id {id} is used more than once")]
    DuplicateId { table: &'static str, id: u64 },
    #[error("sample {sample} refers to location id {id}, which does not exist")]
    UnknownLocation { sample: usize, id: u64 },
    #[error("location {location} refers to mapping id {id}, which does not exist")]
    UnknownMapping { location: u64, id: u64 },
    #[error("line {line} of location {location} refers to function id {id}, which does not exist")]
    UnknownFunction { location: u64, line: usize, id: u64 },
    #[error("sample {sample} has the label key `{key}` more than once")]
    DuplicateLabelKey { sample: usize, key: String },
    #[error("label `{key}` of sample {sample} has both a string and a numeric value")]
    LabelStrAndNum { sample: usize, key: String },
}

/// Checks what `go tool pprof` checks when it loads a profile (google/pprof
/// `profile.CheckValid` and the string-index checks of its decoder), and
/// more strictly: it also rejects unknown mapping ids (pprof silently drops
/// them), label keys used twice in one sample and labels with both a string
/// and a number (both discouraged by `profile.proto`).
pub fn validate(profile: &pprof_proto::Profile) -> Result<(), ValidationError> {
    let pprof_proto::Profile {
        sample_type,
        sample,
        mapping,
        location,
        function,
        string_table,
        drop_frames,
        keep_frames,
        time_nanos: _,
        duration_nanos: _,
        period_type,
        period: _,
        comment,
        default_sample_type,
        doc_url,
    } = profile;

    match string_table.first() {
        None => return Err(ValidationError::EmptyStringTable),
        Some(first) if !first.is_empty() => {
            return Err(ValidationError::FirstStringNotEmpty {
                value: first.clone(),
            });
        }
        Some(_) => {}
    }
    let strings = Strings(string_table);
    let string = |field, index| strings.get(field, index);

    for value_type in sample_type {
        string("sample_type.type", value_type.r#type)?;
        string("sample_type.unit", value_type.unit)?;
    }
    if let Some(period_type) = period_type {
        string("period_type.type", period_type.r#type)?;
        string("period_type.unit", period_type.unit)?;
    }
    string("drop_frames", *drop_frames)?;
    string("keep_frames", *keep_frames)?;
    string("default_sample_type", *default_sample_type)?;
    string("doc_url", *doc_url)?;
    for &comment in comment {
        string("comment", comment)?;
    }

    let mut mapping_ids = HashSet::with_capacity(mapping.len());
    for (position, mapping) in mapping.iter().enumerate() {
        string("mapping.filename", mapping.filename)?;
        string("mapping.build_id", mapping.build_id)?;
        check_id("mapping", position, mapping.id, &mut mapping_ids)?;
    }
    let mut function_ids = HashSet::with_capacity(function.len());
    for (position, function) in function.iter().enumerate() {
        string("function.name", function.name)?;
        string("function.system_name", function.system_name)?;
        string("function.filename", function.filename)?;
        check_id("function", position, function.id, &mut function_ids)?;
    }
    let mut location_ids = HashSet::with_capacity(location.len());
    for (position, location) in location.iter().enumerate() {
        check_id("location", position, location.id, &mut location_ids)?;
        if location.mapping_id != 0 && !mapping_ids.contains(&location.mapping_id) {
            return Err(ValidationError::UnknownMapping {
                location: location.id,
                id: location.mapping_id,
            });
        }
        for (line_index, line) in location.line.iter().enumerate() {
            if !function_ids.contains(&line.function_id) {
                return Err(ValidationError::UnknownFunction {
                    location: location.id,
                    line: line_index,
                    id: line.function_id,
                });
            }
        }
    }

    if sample_type.is_empty() && !sample.is_empty() {
        return Err(ValidationError::MissingSampleTypes);
    }
    validate_samples(sample, sample_type.len(), &location_ids, &strings)
}

/// A profile's string table, read index by index.
struct Strings<'a>(&'a [String]);

impl<'a> Strings<'a> {
    fn get(&self, field: &'static str, index: i64) -> Result<&'a str, ValidationError> {
        usize::try_from(index)
            .ok()
            .and_then(|at| self.0.get(at))
            .map(String::as_str)
            .ok_or(ValidationError::StringOutOfRange {
                field,
                index,
                len: self.0.len(),
            })
    }
}

/// The samples' part of [`validate`]: `types` values each, known
/// locations, labels with one kind of value and distinct keys.
fn validate_samples(
    samples: &[pprof_proto::Sample],
    types: usize,
    location_ids: &HashSet<u64>,
    strings: &Strings<'_>,
) -> Result<(), ValidationError> {
    let mut keys = Vec::new();
    for (index, sample) in samples.iter().enumerate() {
        if sample.value.len() != types {
            return Err(ValidationError::ValueCountMismatch {
                sample: index,
                values: sample.value.len(),
                types,
            });
        }
        if let Some(&id) = sample
            .location_id
            .iter()
            .find(|id| !location_ids.contains(*id))
        {
            return Err(ValidationError::UnknownLocation { sample: index, id });
        }
        keys.clear();
        for label in &sample.label {
            let key = strings.get("label.key", label.key)?;
            strings.get("label.str", label.str)?;
            strings.get("label.num_unit", label.num_unit)?;
            if label.str != 0 && (label.num != 0 || label.num_unit != 0) {
                return Err(ValidationError::LabelStrAndNum {
                    sample: index,
                    key: key.to_owned(),
                });
            }
            if keys.contains(&label.key) {
                return Err(ValidationError::DuplicateLabelKey {
                    sample: index,
                    key: key.to_owned(),
                });
            }
            keys.push(label.key);
        }
    }
    Ok(())
}

/// Ids are non-zero and unique within their table.
fn check_id(
    table: &'static str,
    position: usize,
    id: u64,
    seen: &mut HashSet<u64>,
) -> Result<(), ValidationError> {
    if id == 0 {
        return Err(ValidationError::ZeroId { table, position });
    }
    if !seen.insert(id) {
        return Err(ValidationError::DuplicateId { table, id });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        export::test_profile::{
            self, MAIN, MAIN_NAME, MAIN_SHORT, SPIN, SPIN_QUICK_SYSTEM, SPIN_SHORT,
            SPIN_TIER1_SYSTEM, TRUNCATED,
        },
        profile::{Label, ProfileSample, label_keys},
    };

    fn string(pprof: &pprof_proto::Profile, index: i64) -> &str {
        &pprof.string_table[usize::try_from(index).unwrap()]
    }

    fn location(pprof: &pprof_proto::Profile, id: u64) -> &pprof_proto::Location {
        pprof.location.iter().find(|l| l.id == id).unwrap()
    }

    fn function(pprof: &pprof_proto::Profile, id: u64) -> &pprof_proto::Function {
        pprof.function.iter().find(|f| f.id == id).unwrap()
    }

    fn mapping<'a>(pprof: &'a pprof_proto::Profile, file: &str) -> &'a pprof_proto::Mapping {
        pprof
            .mapping
            .iter()
            .find(|m| string(pprof, m.filename) == file)
            .unwrap()
    }

    /// `(name, system_name, line)` of each line of a location, innermost first.
    fn lines(pprof: &pprof_proto::Profile, id: u64) -> Vec<(&str, &str, i64)> {
        location(pprof, id)
            .line
            .iter()
            .map(|line| {
                let f = function(pprof, line.function_id);
                (
                    string(pprof, f.name),
                    string(pprof, f.system_name),
                    line.line,
                )
            })
            .collect()
    }

    fn labels(pprof: &pprof_proto::Profile, sample: usize) -> Vec<String> {
        pprof.sample[sample]
            .label
            .iter()
            .map(|l| {
                let key = string(pprof, l.key);
                if l.str != 0 {
                    format!("{key}={}", string(pprof, l.str))
                } else {
                    format!("{key}={}{}", l.num, string(pprof, l.num_unit))
                }
            })
            .collect()
    }

    fn round_trip(profile: &Profile) -> pprof_proto::Profile {
        let mut bytes = Vec::new();
        write_pprof(profile, &mut bytes).unwrap();
        assert!(bytes.starts_with(&GZIP_MAGIC), "output is gzip");
        let read = read_pprof(&bytes).unwrap();
        assert_eq!(read, to_pprof(profile));
        validate(&read).unwrap();
        read
    }

    #[test]
    fn round_trip_keeps_header_fields() {
        let pprof = round_trip(&test_profile::profile());
        assert_eq!(pprof.string_table[0], "");
        let types: Vec<_> = pprof
            .sample_type
            .iter()
            .map(|t| (string(&pprof, t.r#type), string(&pprof, t.unit)))
            .collect();
        assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds")]);
        let period_type = pprof.period_type.unwrap();
        assert_eq!(string(&pprof, period_type.r#type), "cpu");
        assert_eq!(string(&pprof, period_type.unit), "nanoseconds");
        assert_eq!(pprof.period, 10_101_010);
        assert_eq!(pprof.time_nanos, 1_700_000_000_000_000_000);
        assert_eq!(pprof.duration_nanos, 5_000_000_000);
        assert_eq!(string(&pprof, pprof.default_sample_type), "cpu");
        let comments: Vec<_> = pprof.comment.iter().map(|&c| string(&pprof, c)).collect();
        assert_eq!(comments, ["clrbpf test"]);
    }

    #[test]
    fn strings_are_interned_and_ids_start_at_one() {
        let pprof = round_trip(&test_profile::profile());
        let mut sorted = pprof.string_table.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            pprof.string_table.len(),
            "no duplicate strings"
        );
        let ids = |ids: Vec<u64>| assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>());
        ids(pprof.mapping.iter().map(|m| m.id).collect());
        ids(pprof.location.iter().map(|l| l.id).collect());
        ids(pprof.function.iter().map(|f| f.id).collect());
        // 9 distinct frames, 4 modules, 10 functions (the Spin tiers are
        // two functions sharing a name; `__write_nocancel` is inlined).
        assert_eq!(pprof.location.len(), 9);
        assert_eq!(pprof.mapping.len(), 4);
        assert_eq!(pprof.function.len(), 10);
    }

    #[test]
    fn samples_keep_stacks_values_and_labels() {
        let profile = test_profile::profile();
        let pprof = round_trip(&profile);
        assert_eq!(pprof.sample.len(), profile.samples.len());
        for (sample, expected) in pprof.sample.iter().zip(&profile.samples) {
            assert_eq!(sample.value, expected.values);
            let names: Vec<_> = sample
                .location_id
                .iter()
                .map(|&id| lines(&pprof, id).last().unwrap().0.to_owned())
                .collect();
            let expected_names: Vec<_> = expected
                .stack
                .iter()
                .map(|&i| profile.frames[i as usize].name.to_string())
                .collect();
            assert_eq!(names, expected_names, "leaf first, frame by frame");
        }
        assert_eq!(
            labels(&pprof, 0),
            [
                "process.pid=42",
                "process.executable.name=dotnet",
                "thread.id=43",
                "thread.name=.NET TP Worker",
            ]
        );
        assert_eq!(
            labels(&pprof, 2),
            [
                "process.pid=7",
                "process.executable.name=my;app\n",
                "thread.id=7",
                "lock.wait=5milliseconds",
            ]
        );
        // Same frame in two samples: same location.
        assert_eq!(
            pprof.sample[0].location_id[4],
            pprof.sample[1].location_id[1]
        );
    }

    #[test]
    fn inline_chain_is_innermost_first_then_the_frame() {
        let pprof = round_trip(&test_profile::profile());
        let write = pprof.sample[0].location_id[2];
        assert_eq!(
            lines(&pprof, write),
            [
                ("__write_nocancel", "__write_nocancel", 10),
                ("__GI___libc_write", "__GI___libc_write", 26),
            ]
        );
        let write = location(&pprof, write);
        assert_eq!(write.address, 0x7f00_0000_1000);
        let files: Vec<_> = write
            .line
            .iter()
            .map(|l| string(&pprof, function(&pprof, l.function_id).filename))
            .collect();
        assert_eq!(
            files,
            ["write_nocancel.c", "../sysdeps/unix/sysv/linux/write.c"]
        );
    }

    #[test]
    fn jit_tiers_share_the_name_and_keep_the_system_name() {
        let pprof = round_trip(&test_profile::profile());
        let tier1 = lines(&pprof, pprof.sample[0].location_id[3]);
        let quick = lines(&pprof, pprof.sample[1].location_id[0]);
        assert_eq!(tier1, [(SPIN_SHORT, SPIN_TIER1_SYSTEM, 0)]);
        let spin = location(&pprof, pprof.sample[0].location_id[3]).line[0].function_id;
        assert_eq!(string(&pprof, function(&pprof, spin).filename), "Hot");
        assert_eq!(quick, [(SPIN_SHORT, SPIN_QUICK_SYSTEM, 0)]);
        // Without a tier, the system name is the full signature.
        let main = lines(&pprof, pprof.sample[0].location_id[4]);
        assert_eq!(main, [(MAIN_SHORT, MAIN_NAME, 0)]);
        // A managed frame without a distinct system name gets none (see
        // rule 5): the full names of `--frame-names full`.
        let mut full = test_profile::profile();
        crate::export::frame_names::apply_frame_names(
            &mut full,
            crate::export::frame_names::FrameNames::Full,
        );
        let pprof_full = round_trip(&full);
        let main = lines(&pprof_full, pprof_full.sample[0].location_id[4]);
        assert_eq!(main, [(MAIN_NAME, "", 0)]);
        let tier1 = lines(&pprof_full, pprof_full.sample[0].location_id[3]);
        assert_eq!(tier1, [(SPIN, SPIN_TIER1_SYSTEM, 0)]);
        // Other frames use their name for both.
        let kernel = lines(&pprof, pprof.sample[0].location_id[0]);
        assert_eq!(kernel, [("do_syscall_64", "do_syscall_64", 0)]);
    }

    #[test]
    fn the_main_module_is_the_first_mapping() {
        let mut profile = test_profile::profile();
        let without = round_trip(&profile);
        assert_eq!(
            string(&without, without.mapping[0].filename),
            "[kernel.kallsyms]",
            "first use order without a main module"
        );
        profile.main_module = Some(std::sync::Arc::new(Module {
            path: "/srv/app/App.dll".into(),
            build_id: None,
            memory_start: 0x7f10_a000_0000,
            memory_limit: 0x7f10_a000_2000,
            file_offset: 0,
            has_functions: true,
        }));
        let pprof = round_trip(&profile);
        let first = &pprof.mapping[0];
        assert_eq!(first.id, 1);
        assert_eq!(string(&pprof, first.filename), "/srv/app/App.dll");
        assert_eq!(
            (first.memory_start, first.memory_limit, first.file_offset),
            (0x7f10_a000_0000, 0x7f10_a000_2000, 0)
        );
        assert!(first.has_functions && !first.has_filenames);
        // The frames' mappings follow, in first-use order, ids unchanged
        // in meaning.
        let names: Vec<&str> = pprof
            .mapping
            .iter()
            .map(|m| string(&pprof, m.filename))
            .collect();
        assert_eq!(names.len(), without.mapping.len() + 1);
        assert_eq!(names[1], "[kernel.kallsyms]");
        validate(&pprof).expect("valid with an unused mapping");
        // A main module that frames use too is one mapping.
        let mut shared = test_profile::profile();
        shared.main_module = shared.frames[test_profile::LIBC_WRITE as usize]
            .module
            .clone();
        let pprof = round_trip(&shared);
        assert_eq!(pprof.mapping.len(), without.mapping.len());
        assert_eq!(
            string(&pprof, pprof.mapping[0].filename),
            "/usr/lib/x86_64-linux-gnu/libc.so.6"
        );
        assert!(
            pprof.mapping[0].has_filenames,
            "flags still follow the frames"
        );
    }

    #[test]
    fn mappings_follow_the_modules() {
        let pprof = round_trip(&test_profile::profile());
        let libc = mapping(&pprof, "/usr/lib/x86_64-linux-gnu/libc.so.6");
        assert_eq!(
            string(&pprof, libc.build_id),
            "c4bd5b2aee7fd2b6dc15b64a4f7a3ba2e8b8a8e1"
        );
        assert_eq!(
            (libc.memory_start, libc.memory_limit, libc.file_offset),
            (0x7f00_0000_0000, 0x7f00_0010_0000, 0x28000)
        );
        assert!(libc.has_functions && libc.has_filenames && libc.has_line_numbers);
        assert!(libc.has_inline_frames);
        let jit = mapping(&pprof, "[jit]");
        assert!(jit.has_functions);
        // The assemblies are the managed functions' file names.
        assert!(jit.has_filenames && !jit.has_line_numbers && !jit.has_inline_frames);
        assert_eq!(jit.build_id, 0);
        // Unsymbolized: no flag, so `go tool pprof` may symbolize it locally.
        let coreclr = mapping(
            &pprof,
            "/usr/share/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so",
        );
        assert!(!coreclr.has_functions && !coreclr.has_filenames);
        let unknown = location(&pprof, pprof.sample[2].location_id[1]);
        assert_eq!(unknown.mapping_id, coreclr.id);
        assert_eq!(unknown.address, 0x7f40_0000_1234);
        // A synthetic frame has no module: mapping id 0.
        let truncated = pprof.sample[2].location_id[2];
        assert_eq!(location(&pprof, truncated).mapping_id, 0);
        assert_eq!(lines(&pprof, truncated)[0].0, "[truncated]");
        let kernel = mapping(&pprof, "[kernel.kallsyms]");
        assert_eq!(
            location(&pprof, pprof.sample[0].location_id[0]).mapping_id,
            kernel.id
        );
    }

    #[test]
    fn one_location_per_address_and_name() {
        let mut profile = test_profile::profile();
        // The aggregator left a duplicate frame: same module, address, name.
        profile.frames.push(profile.frames[MAIN as usize].clone());
        let duplicate = (profile.frames.len() - 1) as u32;
        // JIT code reuse: another method at Main's address.
        let mut reused = profile.frames[MAIN as usize].clone();
        reused.name = "void [App] App::Other()".into();
        profile.frames.push(reused);
        let reused = (profile.frames.len() - 1) as u32;
        // Two synthetic frames, both at address 0 without a module.
        profile.frames.push(Frame::synthetic("[GC]"));
        let gc = (profile.frames.len() - 1) as u32;
        profile.samples.push(ProfileSample {
            stack: vec![duplicate, reused, gc, TRUNCATED],
            values: vec![1, 1],
            labels: Vec::new(),
        });
        let pprof = round_trip(&profile);
        let ids = &pprof.sample.last().unwrap().location_id;
        assert_eq!(ids[0], pprof.sample[0].location_id[4], "duplicate merged");
        assert_ne!(ids[1], ids[0], "reused address, other method");
        assert_eq!(location(&pprof, ids[1]).address, 0x7f36_84a0_0010);
        assert_ne!(ids[2], ids[3], "synthetic frames kept apart");
        assert_eq!(pprof.location.len(), 11);
    }

    #[test]
    fn bad_frame_index_becomes_a_placeholder() {
        let mut profile = test_profile::profile();
        profile.samples[1].stack.push(10_000);
        profile.samples[2].stack.push(u32::MAX);
        let pprof = round_trip(&profile);
        let first = *pprof.sample[1].location_id.last().unwrap();
        let second = *pprof.sample[2].location_id.last().unwrap();
        assert_eq!(first, second);
        assert_eq!(
            lines(&pprof, first),
            [(INVALID_FRAME_NAME, INVALID_FRAME_NAME, 0)]
        );
        assert_eq!(location(&pprof, first).mapping_id, 0);
    }

    #[test]
    fn duplicate_label_keys_keep_the_first() {
        let mut profile = test_profile::profile();
        profile.samples[1]
            .labels
            .push(Label::num(label_keys::PROCESS_PID, 1));
        profile.samples[1]
            .labels
            .push(Label::str(label_keys::THREAD_ID, "forty-four"));
        let pprof = round_trip(&profile);
        assert_eq!(
            labels(&pprof, 1),
            [
                "process.pid=42",
                "process.executable.name=dotnet",
                "thread.id=44"
            ]
        );
    }

    #[test]
    fn empty_profile_is_valid() {
        let pprof = round_trip(&Profile::default());
        assert_eq!(pprof.string_table, [""]);
        assert!(pprof.sample.is_empty() && pprof.location.is_empty());
        assert_eq!(pprof.period_type, None);
        assert_eq!(pprof.default_sample_type, 0);
    }

    #[test]
    fn out_of_range_default_sample_type_is_dropped() {
        let mut profile = test_profile::profile();
        profile.default_sample_type = Some(2);
        assert_eq!(to_pprof(&profile).default_sample_type, 0);
    }

    #[test]
    fn write_refuses_a_value_count_mismatch() {
        let mut profile = test_profile::profile();
        profile.samples[3].values.pop();
        let error = write_pprof(&profile, Vec::new()).unwrap_err();
        assert!(
            matches!(
                error,
                ExportError::InvalidPprof {
                    source: ValidationError::ValueCountMismatch {
                        sample: 3,
                        values: 1,
                        types: 2
                    }
                }
            ),
            "{error:?}"
        );
        profile.sample_types.clear();
        profile.samples.iter_mut().for_each(|s| s.values.clear());
        let error = write_pprof(&profile, Vec::new()).unwrap_err();
        assert!(
            matches!(
                error,
                ExportError::InvalidPprof {
                    source: ValidationError::MissingSampleTypes
                }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn read_accepts_raw_protobuf() {
        let pprof = to_pprof(&test_profile::profile());
        assert_eq!(read_pprof(&pprof.encode_to_vec()).unwrap(), pprof);
    }

    #[test]
    fn read_rejects_garbage_and_truncated_gzip() {
        assert!(matches!(
            read_pprof(b"\xff\xff\xff\xff not a protobuf"),
            Err(ExportError::Decode { .. })
        ));
        let mut bytes = Vec::new();
        write_pprof(&test_profile::profile(), &mut bytes).unwrap();
        for len in [2, 10, bytes.len() / 2, bytes.len() - 1] {
            let result = read_pprof(&bytes[..len]);
            assert!(
                matches!(result, Err(ExportError::Decompress { .. })),
                "{len}: {result:?}"
            );
        }
    }

    /// Each broken profile and the error `validate` must give.
    #[test]
    fn validate_rejects_broken_profiles() {
        type Breaker = fn(&mut pprof_proto::Profile);
        let cases: Vec<(&str, Breaker, ValidationError)> = vec![
            (
                "empty string table",
                |p| p.string_table.clear(),
                ValidationError::EmptyStringTable,
            ),
            (
                "string 0 not empty",
                |p| p.string_table[0] = "x".into(),
                ValidationError::FirstStringNotEmpty { value: "x".into() },
            ),
            (
                "sample type string out of range",
                |p| p.sample_type[1].unit = 100_000,
                ValidationError::StringOutOfRange {
                    field: "sample_type.unit",
                    index: 100_000,
                    len: 0,
                },
            ),
            (
                "negative string index",
                |p| p.function[0].name = -1,
                ValidationError::StringOutOfRange {
                    field: "function.name",
                    index: -1,
                    len: 0,
                },
            ),
            (
                "comment out of range",
                |p| p.comment.push(i64::MAX),
                ValidationError::StringOutOfRange {
                    field: "comment",
                    index: i64::MAX,
                    len: 0,
                },
            ),
            (
                "label value out of range",
                |p| p.sample[0].label[1].str = 5_000,
                ValidationError::StringOutOfRange {
                    field: "label.str",
                    index: 5_000,
                    len: 0,
                },
            ),
            (
                "samples without sample types",
                |p| {
                    p.sample_type.clear();
                    p.sample.iter_mut().for_each(|s| s.value.clear());
                },
                ValidationError::MissingSampleTypes,
            ),
            (
                "too many values",
                |p| p.sample[1].value.push(7),
                ValidationError::ValueCountMismatch {
                    sample: 1,
                    values: 3,
                    types: 2,
                },
            ),
            (
                "mapping id 0",
                |p| p.mapping[1].id = 0,
                ValidationError::ZeroId {
                    table: "mapping",
                    position: 1,
                },
            ),
            (
                "duplicate function id",
                |p| p.function[2].id = 1,
                ValidationError::DuplicateId {
                    table: "function",
                    id: 1,
                },
            ),
            (
                "location id 0",
                |p| p.location[0].id = 0,
                ValidationError::ZeroId {
                    table: "location",
                    position: 0,
                },
            ),
            (
                "unknown mapping",
                |p| p.location[0].mapping_id = 99,
                ValidationError::UnknownMapping {
                    location: 1,
                    id: 99,
                },
            ),
            (
                "line without function",
                |p| p.location[0].line[0].function_id = 0,
                ValidationError::UnknownFunction {
                    location: 1,
                    line: 0,
                    id: 0,
                },
            ),
            (
                "unknown location",
                |p| p.sample[1].location_id[1] = 77,
                ValidationError::UnknownLocation { sample: 1, id: 77 },
            ),
            (
                "location id 0 in a sample",
                |p| p.sample[0].location_id[0] = 0,
                ValidationError::UnknownLocation { sample: 0, id: 0 },
            ),
            (
                "label key twice",
                |p| {
                    let label = p.sample[0].label[0];
                    p.sample[0].label.push(label);
                },
                ValidationError::DuplicateLabelKey {
                    sample: 0,
                    key: "process.pid".into(),
                },
            ),
            (
                "label string and number",
                |p| p.sample[0].label[1].num = 3,
                ValidationError::LabelStrAndNum {
                    sample: 0,
                    key: "process.executable.name".into(),
                },
            ),
        ];
        let valid = to_pprof(&test_profile::profile());
        validate(&valid).unwrap();
        for (name, breaker, expected) in cases {
            let mut broken = valid.clone();
            breaker(&mut broken);
            let mut error = validate(&broken).expect_err(name);
            // The string table length is not interesting to spell out.
            if let ValidationError::StringOutOfRange { len, .. } = &mut error {
                assert_eq!(*len, valid.string_table.len(), "{name}");
                *len = 0;
            }
            assert_eq!(error, expected, "{name}");
        }
    }

    /// The reference reader: `go tool pprof` loads what we write, keeps
    /// the inline chain and groups the JIT tiers of one method. Ignored
    /// because it needs `go` (Debian `golang-go`); run it with
    /// `cargo test -p clrbpf --lib go_tool_pprof -- --ignored`.
    #[test]
    #[ignore = "needs `go tool pprof`"]
    fn go_tool_pprof_reads_the_output() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cpu.pb.gz");
        let mut bytes = Vec::new();
        write_pprof(&test_profile::profile(), &mut bytes).unwrap();
        std::fs::write(&path, bytes).unwrap();
        if let Some(keep) = std::env::var_os("CLRBPF_KEEP_PPROF") {
            std::fs::copy(&path, keep).unwrap();
        }
        let run = |args: &[&str]| {
            let output = std::process::Command::new("go")
                .args(["tool", "pprof"])
                .args(args)
                .arg(&path)
                .env("HOME", dir.path())
                .output()
                .expect("`go` runs (install golang-go)");
            let stdout = String::from_utf8(output.stdout).unwrap();
            let stderr = String::from_utf8(output.stderr).unwrap();
            assert!(output.status.success(), "go tool pprof {args:?}: {stderr}");
            stdout
        };
        let raw = run(&["-raw"]);
        assert!(raw.contains("__write_nocancel"), "{raw}");
        assert!(raw.contains(SPIN_SHORT), "{raw}");
        let top = run(&["-top", "-nodecount=20"]);
        // Tier1 (20 + 30 ms) and QuickJitted (10 ms) flat in one line.
        let spin = top
            .lines()
            .find(|line| line.ends_with(SPIN_SHORT))
            .expect(&top);
        assert!(spin.trim_start().starts_with("40ms"), "{top}");
        assert_eq!(top.matches(SPIN_SHORT).count(), 1, "{top}");
        assert!(top.lines().any(|line| line.ends_with(MAIN_SHORT)), "{top}");
    }
}
