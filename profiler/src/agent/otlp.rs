//! The OTLP sink: OpenTelemetry profiles (`v1development`, the Alpha
//! signal; messages of the `opentelemetry-proto` crate, protos v1.10.0)
//! over HTTP, which an OpenTelemetry Collector with
//! `service.profilesSupport`, Pyroscope, Parca and Elastic accept.
//!
//! 1. One `POST {url}/v1development/profiles`,
//!    `Content-Type: application/x-protobuf`, `Content-Encoding: gzip`,
//!    per window; the body is an `ExportProfilesServiceRequest`. No `OTLP-Profiles-Development-Version`
//!    header: its absence means revision 1, what these messages are.
//! 2. Each distinct service + label set is one `ResourceProfiles` whose
//!    resource attributes follow the semantic conventions (`service.name`,
//!    `process.executable.name`, `k8s.*`, `host.name`), with one
//!    `ScopeProfiles` (scope `clrbpf`). No pid or container id: they
//!    change at every restart and would make a new resource each time;
//!    they are sample attributes instead.
//! 3. An OTLP profile has one sample type: each of our profiles becomes
//!    one OTLP profile per sample type (`samples/count` and
//!    `cpu/nanoseconds` for CPU), sharing stacks through the request's one
//!    `ProfilesDictionary`.
//! 4. The dictionary ([`DictionaryBuilder`]) interns every string,
//!    mapping, function, location, stack and attribute once; index 0 of
//!    every table is the zero value the spec requires. A location is a
//!    (mapping, address, lines) triple, its lines the inline chain
//!    innermost first then the frame's own function, as in our pprof
//!    writer; it carries `profile.frame.type` (`dotnet`, `native`,
//!    `kernel`). Stacks are leaf first. Sample labels become sample
//!    attributes; a sample whose value is 0 for a sample type is left out
//!    of that type's profile.
//! 5. A `partial_success` answer is logged; 4xx answers other than 408
//!    and 429 (a revision the server does not support is a 400) are not
//!    retried, as the versioning rules ask. At most the first 64 KiB of
//!    an answer are read ([`super::read_answer`]); a longer one is logged
//!    and its connection closed.

use std::{collections::HashMap, sync::Arc};

use opentelemetry_proto::tonic::{
    collector::profiles::v1development::{
        ExportProfilesServiceRequest, ExportProfilesServiceResponse,
    },
    common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value},
    profiles::v1development::{
        Function, KeyValueAndUnit, Line, Link, Location, Mapping, Profile as OtlpProfile,
        ProfilesDictionary, ResourceProfiles, Sample, ScopeProfiles, Stack, ValueType,
    },
    resource::v1::Resource,
};
use prost::Message as _;

use super::{
    BoxFuture, ServiceProfile, SinkUrl, UploadError, WindowBatch, WindowUploader, series_keys,
};
use crate::profile::{Frame, FrameKind, LabelValue, Module, Profile};

/// The export path, after the base URL.
pub const PROFILES_PATH: &str = "/v1development/profiles";
/// The instrumentation scope of every profile.
pub const SCOPE_NAME: &str = "clrbpf";
/// The frame kind attribute (OpenTelemetry `profile.frame.type`).
pub const FRAME_TYPE_KEY: &str = "profile.frame.type";
/// The GNU build id of a mapping's file.
pub const BUILD_ID_KEY: &str = "process.executable.build_id.gnu";
/// Characters of an error answer kept for the log.
const ERROR_BODY_LIMIT: usize = 512;

/// The OTLP sink's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpConfig {
    /// The receiver's base URL, e.g. `http://otel-collector:4318`.
    pub url: SinkUrl,
    /// `host.name` of every resource that has none.
    pub host_name: Option<String>,
}

/// The OTLP sink; see the module documentation.
#[derive(Debug)]
pub struct OtlpUploader {
    client: reqwest::Client,
    endpoint: SinkUrl,
    host_name: Option<String>,
}

impl OtlpUploader {
    pub fn new(config: OtlpConfig, client: reqwest::Client) -> Self {
        let OtlpConfig { url, host_name } = config;
        Self {
            client,
            endpoint: url.join(PROFILES_PATH),
            host_name,
        }
    }
}

impl WindowUploader for OtlpUploader {
    fn name(&self) -> &'static str {
        "otlp"
    }

    fn upload(&self, batch: Arc<WindowBatch>) -> BoxFuture<'_, Result<(), UploadError>> {
        Box::pin(async move {
            let body = export_request(&batch, self.host_name.as_deref()).encode_to_vec();
            let body = gzip(&body).map_err(|source| UploadError::Encode {
                sink: "otlp",
                source: crate::export::ExportError::Write {
                    what: "OTLP request",
                    source,
                },
            })?;
            let transport = |source: reqwest::Error| UploadError::Transport {
                sink: "otlp",
                url: self.endpoint.clone(),
                source: source.without_url(),
            };
            let response = self
                .client
                .post(self.endpoint.expose())
                .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
                .header(reqwest::header::CONTENT_ENCODING, "gzip")
                .body(body)
                .send()
                .await
                .map_err(transport)?;
            let status = response.status();
            let answer = super::read_answer(response, super::MAX_ANSWER_BYTES).await;
            if !status.is_success() {
                return Err(UploadError::Status {
                    sink: "otlp",
                    status: status.as_u16(),
                    body: super::body_excerpt(&answer.body, ERROR_BODY_LIMIT),
                });
            }
            if answer.cut {
                // Delivered (the status says so), but the answer is not
                // an ExportProfilesServiceResponse of any sensible size.
                tracing::warn!(
                    url = %self.endpoint,
                    answer = %super::body_excerpt(&answer.body, ERROR_BODY_LIMIT),
                    "the OTLP receiver's answer is longer than {} KiB: the rest was not read",
                    super::MAX_ANSWER_BYTES / 1024
                );
                return Ok(());
            }
            if let Ok(answer) = ExportProfilesServiceResponse::decode(answer.body.as_slice())
                && let Some(partial) = answer.partial_success
                && (partial.rejected_profiles > 0 || !partial.error_message.is_empty())
            {
                tracing::warn!(
                    rejected_profiles = partial.rejected_profiles,
                    message = %partial.error_message,
                    "the OTLP receiver rejected part of a window"
                );
            }
            Ok(())
        })
    }
}

/// Compresses a request body (OTLP/HTTP: `Content-Encoding: gzip`, which
/// collectors and Pyroscope accept; 2.8x smaller on the synthetic window
/// of `a_large_window_encodes_with_each_frame_once`, more on real,
/// repetitive stacks).
fn gzip(body: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Write as _;
    let mut encoder = flate2::write::GzEncoder::new(
        Vec::with_capacity(body.len() / 4),
        flate2::Compression::fast(),
    );
    encoder.write_all(body)?;
    encoder.finish()
}

/// The `ExportProfilesServiceRequest` of one window.
pub fn export_request(
    batch: &WindowBatch,
    host_name: Option<&str>,
) -> ExportProfilesServiceRequest {
    let mut dictionary = DictionaryBuilder::new();
    // One ResourceProfiles per distinct resource, in first-seen order.
    let mut resources: Vec<(Vec<KeyValue>, Vec<OtlpProfile>)> = Vec::new();
    for service_profile in &batch.profiles {
        let attributes = resource_attributes(service_profile, host_name);
        let profiles = dictionary.profiles(&batch.timed(&service_profile.profile));
        match resources.iter_mut().find(|(known, _)| *known == attributes) {
            Some((_, existing)) => existing.extend(profiles),
            None => resources.push((attributes, profiles)),
        }
    }
    let resource_profiles = resources
        .into_iter()
        .map(|(attributes, profiles)| ResourceProfiles {
            resource: Some(Resource {
                attributes,
                ..Default::default()
            }),
            scope_profiles: vec![ScopeProfiles {
                scope: Some(InstrumentationScope {
                    name: SCOPE_NAME.to_owned(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    ..Default::default()
                }),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        })
        .collect();
    ExportProfilesServiceRequest {
        resource_profiles,
        dictionary: Some(dictionary.finish()),
    }
}

/// `service.name`, the series' labels, then `host.name`
/// unless a label gave one. A key appears once (the first value wins).
pub fn resource_attributes(profile: &ServiceProfile, host_name: Option<&str>) -> Vec<KeyValue> {
    let mut attributes = vec![key_value(
        series_keys::SERVICE_NAME,
        string_value(&profile.service_name),
    )];
    let labels = profile
        .labels
        .iter()
        .map(|(key, value)| (key.as_str(), value.as_str()))
        .chain(host_name.map(|host| (series_keys::HOST_NAME, host)));
    for (key, value) in labels {
        if value.is_empty() || attributes.iter().any(|kv| kv.key == key) {
            continue;
        }
        attributes.push(key_value(key, string_value(value)));
    }
    attributes
}

fn key_value(key: &str, value: AnyValue) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(value),
        ..Default::default()
    }
}

fn string_value(value: &str) -> AnyValue {
    AnyValue {
        value: Some(any_value::Value::StringValue(value.to_owned())),
    }
}

/// Builds one request's `ProfilesDictionary`; see the module documentation.
#[derive(Debug)]
pub struct DictionaryBuilder {
    dictionary: ProfilesDictionary,
    strings: HashMap<String, i32>,
    mappings: HashMap<MappingKey, i32>,
    functions: HashMap<(i32, i32, i32), i32>,
    locations: HashMap<LocationKey, i32>,
    stacks: HashMap<Vec<i32>, i32>,
    attributes: HashMap<AttributeKey, i32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct MappingKey {
    path: Arc<str>,
    build_id: Option<Arc<str>>,
    memory_start: u64,
    memory_limit: u64,
    file_offset: u64,
}

/// A location's identity: mapping, address, (function, line) per line,
/// attributes.
type LocationKey = (i32, u64, Vec<(i32, i64)>, Vec<i32>);

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum AttributeValueKey {
    Str(String),
    Int(i64),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct AttributeKey {
    key: i32,
    value: AttributeValueKey,
    unit: i32,
}

impl Default for DictionaryBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl DictionaryBuilder {
    /// A dictionary with the zero value at index 0 of every table.
    pub fn new() -> Self {
        let dictionary = ProfilesDictionary {
            mapping_table: vec![Mapping::default()],
            location_table: vec![Location::default()],
            function_table: vec![Function::default()],
            link_table: vec![Link::default()],
            string_table: vec![String::new()],
            attribute_table: vec![KeyValueAndUnit::default()],
            stack_table: vec![Stack::default()],
        };
        Self {
            dictionary,
            strings: HashMap::from([(String::new(), 0)]),
            mappings: HashMap::new(),
            functions: HashMap::new(),
            locations: HashMap::new(),
            stacks: HashMap::from([(Vec::new(), 0)]),
            attributes: HashMap::new(),
        }
    }

    pub fn finish(self) -> ProfilesDictionary {
        self.dictionary
    }

    fn string(&mut self, text: &str) -> i32 {
        if let Some(&index) = self.strings.get(text) {
            return index;
        }
        let index = table_index(self.dictionary.string_table.len());
        self.dictionary.string_table.push(text.to_owned());
        self.strings.insert(text.to_owned(), index);
        index
    }

    fn attribute(&mut self, key: &str, value: AttributeValueKey, unit: Option<&str>) -> i32 {
        let key = self.string(key);
        let unit = unit.map_or(0, |unit| self.string(unit));
        let lookup = AttributeKey {
            key,
            value: value.clone(),
            unit,
        };
        if let Some(&index) = self.attributes.get(&lookup) {
            return index;
        }
        let value = match value {
            AttributeValueKey::Str(text) => any_value::Value::StringValue(text),
            AttributeValueKey::Int(number) => any_value::Value::IntValue(number),
        };
        let index = table_index(self.dictionary.attribute_table.len());
        self.dictionary.attribute_table.push(KeyValueAndUnit {
            key_strindex: key,
            value: Some(AnyValue { value: Some(value) }),
            unit_strindex: unit,
        });
        self.attributes.insert(lookup, index);
        index
    }

    fn mapping(&mut self, module: &Module) -> i32 {
        let key = MappingKey {
            path: Arc::clone(&module.path),
            build_id: module.build_id.clone(),
            memory_start: module.memory_start,
            memory_limit: module.memory_limit,
            file_offset: module.file_offset,
        };
        if let Some(&index) = self.mappings.get(&key) {
            return index;
        }
        let filename_strindex = self.string(&module.path);
        let attribute_indices = module
            .build_id
            .as_deref()
            .map(|id| self.attribute(BUILD_ID_KEY, AttributeValueKey::Str(id.to_owned()), None))
            .into_iter()
            .collect();
        let index = table_index(self.dictionary.mapping_table.len());
        self.dictionary.mapping_table.push(Mapping {
            memory_start: module.memory_start,
            memory_limit: module.memory_limit,
            file_offset: module.file_offset,
            filename_strindex,
            attribute_indices,
        });
        self.mappings.insert(key, index);
        index
    }

    fn function(&mut self, name: &str, system_name: &str, filename: &str) -> i32 {
        let key = (
            self.string(name),
            self.string(system_name),
            self.string(filename),
        );
        if let Some(&index) = self.functions.get(&key) {
            return index;
        }
        let index = table_index(self.dictionary.function_table.len());
        self.dictionary.function_table.push(Function {
            name_strindex: key.0,
            system_name_strindex: key.1,
            filename_strindex: key.2,
            start_line: 0,
        });
        self.functions.insert(key, index);
        index
    }

    fn location(&mut self, frame: &Frame) -> i32 {
        let mapping_index = frame
            .module
            .as_deref()
            .map_or(0, |module| self.mapping(module));
        let mut lines = Vec::with_capacity(frame.inlined.len() + 1);
        for inlined in &frame.inlined {
            let function_index = self.function(
                &inlined.name,
                &inlined.name,
                inlined.file.as_deref().unwrap_or(""),
            );
            lines.push(Line {
                function_index,
                line: i64::from(inlined.line),
                column: 0,
            });
        }
        let system_name = frame.system_name.as_deref().unwrap_or(&frame.name);
        let filename = frame
            .file
            .as_deref()
            .or_else(|| {
                // A managed frame's assembly is its module's file.
                (frame.kind == FrameKind::Managed)
                    .then(|| frame.module.as_deref().map(|module| &*module.path))
                    .flatten()
            })
            .unwrap_or("");
        let function_index = self.function(&frame.name, system_name, filename);
        lines.push(Line {
            function_index,
            line: i64::from(frame.line),
            column: 0,
        });
        let frame_type = match frame.kind {
            FrameKind::Managed => Some("dotnet"),
            FrameKind::Native => Some("native"),
            FrameKind::Kernel => Some("kernel"),
            FrameKind::Unknown | FrameKind::Synthetic => None,
        };
        let attribute_indices = frame_type
            .map(|kind| self.attribute(FRAME_TYPE_KEY, AttributeValueKey::Str(kind.into()), None))
            .into_iter()
            .collect();
        let location = Location {
            mapping_index,
            address: frame.address,
            lines,
            attribute_indices,
        };
        let key: LocationKey = (
            location.mapping_index,
            location.address,
            location
                .lines
                .iter()
                .map(|line| (line.function_index, line.line))
                .collect(),
            location.attribute_indices.clone(),
        );
        if let Some(&index) = self.locations.get(&key) {
            return index;
        }
        let index = table_index(self.dictionary.location_table.len());
        self.dictionary.location_table.push(location);
        self.locations.insert(key, index);
        index
    }

    fn stack(&mut self, location_indices: Vec<i32>) -> i32 {
        if let Some(&index) = self.stacks.get(&location_indices) {
            return index;
        }
        let index = table_index(self.dictionary.stack_table.len());
        self.dictionary.stack_table.push(Stack {
            location_indices: location_indices.clone(),
        });
        self.stacks.insert(location_indices, index);
        index
    }

    /// One OTLP profile per sample type of `profile`.
    pub fn profiles(&mut self, profile: &Profile) -> Vec<OtlpProfile> {
        let Profile {
            sample_types,
            default_sample_type: _,
            period_type,
            period,
            start_unix_ns,
            duration_ns,
            frames,
            samples,
            comments: _,
            main_module: _,
        } = profile;
        // Frames, stacks and attributes once for all sample types.
        let mut frame_locations: HashMap<u32, i32> = HashMap::new();
        let shared: Vec<(i32, Vec<i32>)> = samples
            .iter()
            .map(|sample| {
                let locations = sample
                    .stack
                    .iter()
                    .map(|&index| match frame_locations.get(&index) {
                        Some(&location) => location,
                        None => {
                            let location = match frames.get(index as usize) {
                                Some(frame) => self.location(frame),
                                None => self.location(&Frame::synthetic("[invalid frame index]")),
                            };
                            frame_locations.insert(index, location);
                            location
                        }
                    })
                    .collect();
                let stack_index = self.stack(locations);
                let mut seen_keys: Vec<&str> = Vec::new();
                let attribute_indices = sample
                    .labels
                    .iter()
                    .filter(|label| {
                        let fresh = !seen_keys.contains(&&*label.key);
                        seen_keys.push(&label.key);
                        fresh
                    })
                    .map(|label| match &label.value {
                        LabelValue::Str(text) => self.attribute(
                            &label.key,
                            AttributeValueKey::Str(text.to_string()),
                            None,
                        ),
                        LabelValue::Num { value, unit } => self.attribute(
                            &label.key,
                            AttributeValueKey::Int(*value),
                            unit.as_deref(),
                        ),
                    })
                    .collect();
                (stack_index, attribute_indices)
            })
            .collect();
        let period_type = period_type.as_ref().map(|value_type| ValueType {
            type_strindex: self.string(&value_type.r#type),
            unit_strindex: self.string(&value_type.unit),
        });
        sample_types
            .iter()
            .enumerate()
            .map(|(type_index, sample_type)| {
                let samples = samples
                    .iter()
                    .zip(&shared)
                    .filter_map(|(sample, (stack_index, attribute_indices))| {
                        let value = *sample.values.get(type_index)?;
                        (value != 0).then(|| Sample {
                            stack_index: *stack_index,
                            attribute_indices: attribute_indices.clone(),
                            link_index: 0,
                            values: vec![value],
                            timestamps_unix_nano: Vec::new(),
                        })
                    })
                    .collect();
                OtlpProfile {
                    sample_type: Some(ValueType {
                        type_strindex: self.string(&sample_type.r#type),
                        unit_strindex: self.string(&sample_type.unit),
                    }),
                    samples,
                    time_unix_nano: u64::try_from(*start_unix_ns).unwrap_or(0),
                    duration_nano: u64::try_from(*duration_ns).unwrap_or(0),
                    period_type,
                    period: *period,
                    profile_id: super::random_bytes::<16>().to_vec(),
                    ..Default::default()
                }
            })
            .collect()
    }
}

fn table_index(len: usize) -> i32 {
    i32::try_from(len).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        agent::{
            ProfileType,
            test_support::{Receiver, service_profile, window},
        },
        export::test_profile,
    };

    fn string_of(request: &ExportProfilesServiceRequest, index: i32) -> &str {
        &request.dictionary.as_ref().unwrap().string_table[index as usize]
    }

    fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
        attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref()?.value.as_ref())
    }

    /// Rebuilds each sample's stack as function names, leaf first, through
    /// the dictionary, the way a receiver reads it.
    fn stacks(
        request: &ExportProfilesServiceRequest,
        profile: &OtlpProfile,
    ) -> Vec<(Vec<String>, i64)> {
        let dictionary = request.dictionary.as_ref().unwrap();
        profile
            .samples
            .iter()
            .map(|sample| {
                let stack = &dictionary.stack_table[sample.stack_index as usize];
                let names = stack
                    .location_indices
                    .iter()
                    .flat_map(|&location| {
                        dictionary.location_table[location as usize]
                            .lines
                            .iter()
                            .map(|line| {
                                let function =
                                    &dictionary.function_table[line.function_index as usize];
                                string_of(request, function.name_strindex).to_owned()
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect();
                (names, sample.values[0])
            })
            .collect()
    }

    #[test]
    fn dictionary_tables_start_with_their_zero_values() {
        let request = export_request(&window(1), Some("node-1"));
        let dictionary = request.dictionary.as_ref().unwrap();
        assert_eq!(dictionary.string_table[0], "");
        assert_eq!(dictionary.mapping_table[0], Mapping::default());
        assert_eq!(dictionary.location_table[0], Location::default());
        assert_eq!(dictionary.function_table[0], Function::default());
        assert_eq!(dictionary.link_table[0], Link::default());
        assert_eq!(dictionary.attribute_table[0], KeyValueAndUnit::default());
        assert_eq!(dictionary.stack_table[0], Stack::default());
        // No duplicates in the string table.
        let mut strings = dictionary.string_table.clone();
        strings.sort();
        strings.dedup();
        assert_eq!(strings.len(), dictionary.string_table.len());
    }

    #[test]
    fn one_profile_per_sample_type_with_the_same_totals_as_the_model() {
        let batch = window(1_795_000_000);
        let model = &batch.profiles[0].profile;
        let request = export_request(&batch, None);
        let scope = &request.resource_profiles[0].scope_profiles[0];
        assert_eq!(scope.scope.as_ref().unwrap().name, SCOPE_NAME);
        assert_eq!(scope.profiles.len(), model.sample_types.len());
        for (type_index, profile) in scope.profiles.iter().enumerate() {
            let sample_type = profile.sample_type.unwrap();
            assert_eq!(
                string_of(&request, sample_type.type_strindex),
                &*model.sample_types[type_index].r#type
            );
            assert_eq!(profile.time_unix_nano, 1_795_000_000_000_000_000);
            assert_eq!(profile.duration_nano, 15_000_000_000);
            let total: i64 = profile.samples.iter().map(|s| s.values[0]).sum();
            let expected: i64 = model.samples.iter().map(|s| s.values[type_index]).sum();
            assert_eq!(total, expected, "sample type {type_index}");
            assert_eq!(profile.profile_id.len(), 16);
            assert!(profile.profile_id.iter().any(|&b| b != 0));
        }
        // The hot method is named, leaf first, with its inline chain.
        let cpu_stacks = stacks(&request, &scope.profiles[1]);
        assert!(
            cpu_stacks
                .iter()
                .any(|(names, _)| names.first().map(String::as_str)
                    == Some(test_profile::SPIN_SHORT)),
            "{cpu_stacks:?}"
        );
        // Managed frames are marked `dotnet`.
        let dictionary = request.dictionary.as_ref().unwrap();
        let dotnet = dictionary.attribute_table.iter().any(|kv| {
            string_of(&request, kv.key_strindex) == FRAME_TYPE_KEY
                && kv.value.as_ref().and_then(|v| v.value.as_ref())
                    == Some(&any_value::Value::StringValue("dotnet".into()))
        });
        assert!(dotnet);
    }

    #[test]
    fn resources_follow_the_semantic_conventions_and_group_by_service() {
        let mut batch = window(1);
        batch
            .profiles
            .push(service_profile("checkout", ProfileType::Exception));
        batch
            .profiles
            .push(service_profile("billing", ProfileType::ProcessCpu));
        let request = export_request(&batch, Some("node-1"));
        assert_eq!(
            request.resource_profiles.len(),
            2,
            "checkout twice, billing"
        );
        let checkout = &request.resource_profiles[0];
        let attributes = &checkout.resource.as_ref().unwrap().attributes;
        assert_eq!(
            attribute(attributes, "service.name"),
            Some(&any_value::Value::StringValue("checkout".into()))
        );
        assert_eq!(
            attribute(attributes, "process.pid"),
            None,
            "no pid names a series"
        );
        assert_eq!(
            attribute(attributes, "k8s.namespace.name"),
            Some(&any_value::Value::StringValue("shop".into()))
        );
        assert_eq!(
            attribute(attributes, "host.name"),
            Some(&any_value::Value::StringValue("node-1".into()))
        );
        assert_eq!(
            checkout.scope_profiles[0].profiles.len(),
            4,
            "cpu 2 + exception 2"
        );
    }

    /// Against a loopback receiver standing in for an OpenTelemetry
    /// collector (none can be installed here): the body decodes as an
    /// `ExportProfilesServiceRequest`, a 200 whose body is not an
    /// `ExportProfilesServiceResponse` still counts as delivered, and a
    /// 400 is final.
    #[tokio::test(flavor = "current_thread")]
    async fn posts_a_decodable_export_request() {
        let receiver = Receiver::start(vec![200, 400]).await;
        let client = crate::agent::http_client(Duration::from_secs(5)).unwrap();
        let uploader = OtlpUploader::new(
            OtlpConfig {
                url: SinkUrl::new(receiver.url()),
                host_name: Some("node-1".into()),
            },
            client,
        );
        let batch = Arc::new(window(1_795_000_000));
        uploader.upload(Arc::clone(&batch)).await.unwrap();
        let error = uploader.upload(batch).await.unwrap_err();
        assert!(matches!(error, UploadError::Status { status: 400, .. }));
        assert!(!error.is_retryable());
        let requests = receiver.requests();
        assert_eq!(requests[0].path, PROFILES_PATH);
        assert_eq!(
            requests[0].headers["content-type"],
            "application/x-protobuf"
        );
        assert_eq!(requests[0].headers["content-encoding"], "gzip");
        let mut body = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::GzDecoder::new(requests[0].body.as_ref()),
            &mut body,
        )
        .expect("gzip");
        let request = ExportProfilesServiceRequest::decode(body.as_slice()).expect("decodes");
        let resource = request.resource_profiles[0].resource.as_ref().unwrap();
        assert_eq!(
            attribute(&resource.attributes, "service.name"),
            Some(&any_value::Value::StringValue("checkout".into()))
        );
        let profile = &request.resource_profiles[0].scope_profiles[0].profiles[1];
        let names = stacks(&request, profile);
        assert!(
            names
                .iter()
                .any(|(frames, _)| frames.iter().any(|f| f == test_profile::MAIN_SHORT))
        );
    }

    /// A receiver that answers 200 with a body that never ends: the
    /// window counts as delivered after the first 64 KiB, the connection
    /// is dropped, and the upload does not wait for the timeout.
    #[tokio::test(flavor = "current_thread")]
    async fn an_endless_answer_is_cut_at_64_kib() {
        let receiver = crate::agent::test_support::EndlessAnswer::start(200, true).await;
        let client = crate::agent::http_client(Duration::from_secs(20)).unwrap();
        let uploader = OtlpUploader::new(
            OtlpConfig {
                url: SinkUrl::new(receiver.url()),
                host_name: None,
            },
            client,
        );
        let started = std::time::Instant::now();
        uploader.upload(Arc::new(window(1))).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        // Give the server a moment to notice the hang-up: what it got out
        // is the socket buffers' worth, not the 20 s of a read to the end.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sent = receiver.sent();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(receiver.sent(), sent, "still sending");
        assert!(sent < 32 << 20, "{sent} bytes sent");
    }

    /// Every index of `request` points into its table, as a receiver
    /// checks before it reads.
    fn assert_indices_in_range(request: &ExportProfilesServiceRequest) {
        let d = request.dictionary.as_ref().expect("a dictionary");
        let string = |i: i32| assert!((0..d.string_table.len() as i32).contains(&i), "string {i}");
        let attributes = |indices: &[i32]| {
            for &i in indices {
                assert!(
                    (1..d.attribute_table.len() as i32).contains(&i),
                    "attribute {i}"
                );
            }
        };
        for mapping in &d.mapping_table {
            string(mapping.filename_strindex);
            attributes(&mapping.attribute_indices);
        }
        for function in &d.function_table {
            string(function.name_strindex);
            string(function.system_name_strindex);
            string(function.filename_strindex);
        }
        for location in &d.location_table {
            assert!((0..d.mapping_table.len() as i32).contains(&location.mapping_index));
            for line in &location.lines {
                assert!((1..d.function_table.len() as i32).contains(&line.function_index));
            }
            attributes(&location.attribute_indices);
        }
        for stack in &d.stack_table {
            for &location in &stack.location_indices {
                assert!((1..d.location_table.len() as i32).contains(&location));
            }
        }
        for attribute in &d.attribute_table {
            string(attribute.key_strindex);
            string(attribute.unit_strindex);
        }
        for resource in &request.resource_profiles {
            for scope in &resource.scope_profiles {
                for profile in &scope.profiles {
                    let sample_type = profile.sample_type.expect("a sample type");
                    string(sample_type.type_strindex);
                    string(sample_type.unit_strindex);
                    for sample in &profile.samples {
                        assert!((1..d.stack_table.len() as i32).contains(&sample.stack_index));
                        assert_eq!(sample.link_index, 0);
                        assert_eq!(sample.values.len(), 1);
                        attributes(&sample.attribute_indices);
                    }
                }
            }
        }
    }

    #[test]
    fn every_index_points_into_its_table() {
        let mut batch = window(1);
        batch
            .profiles
            .push(service_profile("billing", ProfileType::Lock));
        let request = export_request(&batch, Some("node-1"));
        assert_indices_in_range(&request);
        // Sample labels became attributes: thread ids and pids as ints.
        let dictionary = request.dictionary.as_ref().unwrap();
        assert!(dictionary.attribute_table.iter().any(|kv| {
            string_of(&request, kv.key_strindex) == "thread.id"
                && matches!(
                    kv.value.as_ref().and_then(|v| v.value.as_ref()),
                    Some(any_value::Value::IntValue(_))
                )
        }));
    }

    /// One large window (20k samples over 5k frames) to both wire formats:
    /// the OTLP dictionary holds each frame once and every sample keeps its
    /// 24 frames; the sizes and times are printed (`--nocapture`).
    #[test]
    fn a_large_window_encodes_with_each_frame_once() {
        use std::time::Instant;

        use crate::{
            agent::pyroscope::push_request,
            profile::{Frame, FrameKind, Label, ProfileSample},
        };
        let mut profile = test_profile::profile();
        let module = profile.frames[test_profile::SPIN_TIER1 as usize]
            .module
            .clone();
        profile.frames = (0..5000u64)
            .map(|i| Frame {
                kind: FrameKind::Managed,
                name: format!("Shop.Api.Controllers.Method{i}()").into(),
                address: 0x7f36_8400_0000 + i * 64,
                module: module.clone(),
                ..Frame::synthetic("")
            })
            .collect();
        profile.samples = (0..20_000u32)
            .map(|i| ProfileSample {
                stack: (0..24)
                    .map(|d| (i.wrapping_mul(7919) + d * 131) % 5000)
                    .collect(),
                values: vec![1, 52_631_578],
                labels: vec![
                    Label::num("process.pid", 4242),
                    Label::num("thread.id", i64::from(4242 + i % 64)),
                ],
            })
            .collect();
        let batch = WindowBatch {
            start: std::time::UNIX_EPOCH + Duration::from_secs(1_795_000_000),
            duration: Duration::from_secs(15),
            profiles: vec![ServiceProfile {
                profile,
                ..service_profile("checkout", ProfileType::ProcessCpu)
            }],
        };
        let started = Instant::now();
        let request = export_request(&batch, Some("node-1"));
        let otlp = gzip(&request.encode_to_vec()).unwrap();
        let otlp_time = started.elapsed();
        let dictionary = request.dictionary.as_ref().expect("a dictionary");
        // Slot 0 of each table is the empty entry.
        assert!(
            dictionary.function_table.len() <= 5001,
            "{} functions",
            dictionary.function_table.len()
        );
        assert!(dictionary.location_table.len() <= 5001);
        let profiles: Vec<&OtlpProfile> = request
            .resource_profiles
            .iter()
            .flat_map(|r| &r.scope_profiles)
            .flat_map(|s| &s.profiles)
            .collect();
        assert!(!profiles.is_empty());
        for profile in profiles {
            let stacks = stacks(&request, profile);
            assert_eq!(stacks.len(), 20_000);
            assert!(stacks.iter().all(|(frames, _)| frames.len() == 24));
        }
        let started = Instant::now();
        let push = push_request(&batch).unwrap().encode_to_vec();
        let push_time = started.elapsed();
        assert!(!push.is_empty());
        println!(
            "window of 20000 samples, 5000 frames: OTLP (gzip) {} bytes in {:.1} ms; Pyroscope push (gzip pprof) {} bytes in {:.1} ms",
            otlp.len(),
            otlp_time.as_secs_f64() * 1e3,
            push.len(),
            push_time.as_secs_f64() * 1e3
        );
    }
}
