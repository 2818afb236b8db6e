//! From one window's combined profile (every process, every sample type,
//! as the pipeline aggregates it) to a [`WindowBatch`]: one
//! [`ServiceProfile`] per service and [`ProfileType`].
//!
//! 1. Each sample is given to its service by the caller's `service_of`
//!    (the pipeline knows which pid is which service, and its labels);
//!    samples of no service are left out.
//! 2. The sample types are grouped by profile type
//!    ([`crate::profile::kinds::profile_type_of`]): `samples`+`cpu` ->
//!    `process_cpu`, `off_cpu`+`wakeup` -> `offcpu`, `wall` -> `wall`, and
//!    each event kind to its own (`contentions`+`delay` -> `lock`; waits'
//!    profile names `wait_delay` `delay`,
//!    [`crate::profile::kinds::standalone_sample_type`]). Other sample
//!    types are not shipped.
//! 3. Over `max_series` services (a service with its series labels), the
//!    busiest `max_series - 1` (most samples) keep their names and the
//!    samples of the rest are shipped as one service,
//!    [`OVERFLOW_SERVICE`], without series labels: a process names its own
//!    service, and thousands of names must not become thousands of series.
//!    The samples keep their own labels (pid, executable) in the profile.
//! 4. Each (service, profile type) profile keeps only its columns, only
//!    the samples with a value in them, and only the frames those samples
//!    use (renumbered), so no profile carries another service's frames.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, SystemTime},
};

use super::{ProfileType, ServiceProfile, WindowBatch};
use crate::profile::{
    FrameIndex, Profile, ProfileSample, ValueType,
    kinds::{period_type_of, profile_type_of, standalone_sample_type},
};

/// The service of the samples of services over the cap.
pub const OVERFLOW_SERVICE: &str = "clrbpf-overflow";

/// The service a sample belongs to: its name and its series labels
/// (OpenTelemetry keys, see [`super::series_keys`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub service_name: String,
    pub labels: Vec<(String, String)>,
}

/// Splits `profile` into the window's batch; see the module documentation.
/// Also returns how many services went into [`OVERFLOW_SERVICE`].
pub fn window_batch(
    start: SystemTime,
    duration: Duration,
    profile: &Profile,
    max_series: usize,
    mut service_of: impl FnMut(&ProfileSample) -> Option<ServiceKey>,
) -> (WindowBatch, usize) {
    // Sample type columns of each profile type, in profile order.
    let mut columns: BTreeMap<ProfileType, Vec<usize>> = BTreeMap::new();
    for (index, sample_type) in profile.sample_types.iter().enumerate() {
        if let Some(profile_type) = profile_type_of(&sample_type.r#type) {
            columns.entry(profile_type).or_default().push(index);
        }
    }
    let mut by_service: BTreeMap<ServiceKey, Vec<&ProfileSample>> = BTreeMap::new();
    for sample in &profile.samples {
        if let Some(key) = service_of(sample) {
            by_service.entry(key).or_default().push(sample);
        }
    }
    let overflowed = cap_series(&mut by_service, max_series);
    let mut profiles = Vec::new();
    for (key, samples) in by_service {
        for (&profile_type, columns) in &columns {
            let part = project(profile, &samples, columns, profile_type);
            if part.samples.is_empty() {
                continue;
            }
            profiles.push(ServiceProfile {
                service_name: key.service_name.clone(),
                profile_type,
                labels: key.labels.clone(),
                profile: part,
            });
        }
    }
    let batch = WindowBatch {
        start,
        duration,
        profiles,
    };
    (batch, overflowed)
}

/// Folds the services past the busiest `max_series - 1` into
/// [`OVERFLOW_SERVICE`]; returns how many were folded.
fn cap_series(
    by_service: &mut BTreeMap<ServiceKey, Vec<&ProfileSample>>,
    max_series: usize,
) -> usize {
    if by_service.len() <= max_series {
        return 0;
    }
    // Most samples first; equal ones in key order, so a window's cut does
    // not depend on hashing.
    let mut ranked: Vec<(usize, ServiceKey)> = by_service
        .iter()
        .map(|(key, samples)| (samples.len(), key.clone()))
        .collect();
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let mut folded = Vec::new();
    let mut overflowed = 0;
    for (_, key) in ranked.into_iter().skip(max_series.saturating_sub(1)) {
        if let Some(samples) = by_service.remove(&key) {
            folded.extend(samples);
            overflowed += 1;
        }
    }
    by_service
        .entry(ServiceKey {
            service_name: OVERFLOW_SERVICE.to_owned(),
            labels: Vec::new(),
        })
        .or_default()
        .extend(folded);
    overflowed
}

/// The part of `profile` with `samples`, the sample types `columns`, and
/// only the frames used.
fn project(
    profile: &Profile,
    samples: &[&ProfileSample],
    columns: &[usize],
    profile_type: ProfileType,
) -> Profile {
    let mut frame_map: HashMap<FrameIndex, FrameIndex> = HashMap::new();
    let mut frames = Vec::new();
    let mut kept = Vec::new();
    for sample in samples {
        let values: Vec<i64> = columns
            .iter()
            .map(|&column| sample.values.get(column).copied().unwrap_or(0))
            .collect();
        if values.iter().all(|&value| value == 0) {
            continue;
        }
        let stack = sample
            .stack
            .iter()
            .filter_map(|&index| {
                let frame = profile.frames.get(index as usize)?;
                Some(*frame_map.entry(index).or_insert_with(|| {
                    frames.push(frame.clone());
                    FrameIndex::try_from(frames.len() - 1).unwrap_or(FrameIndex::MAX)
                }))
            })
            .collect();
        kept.push(ProfileSample {
            stack,
            values,
            labels: sample.labels.clone(),
        });
    }
    let sample_types = columns
        .iter()
        .map(|&column| {
            let t = &profile.sample_types[column];
            ValueType::new(standalone_sample_type(&t.r#type), &t.unit)
        })
        .collect::<Vec<_>>();
    // The CPU profile opens on CPU time; the others on their last type
    // (delay for locks), as `go tool pprof` would.
    let default_sample_type = match profile_type {
        ProfileType::ProcessCpu => sample_types.iter().position(|t| &*t.r#type == "cpu"),
        _ => sample_types.len().checked_sub(1),
    };
    // Allocation profiles are Pyroscope's `memory` ones: period
    // `space/bytes` (`memory:alloc_size:bytes:space:bytes`).
    let (period_type, period) = match period_type_of(profile_type) {
        Some((name, unit)) => (Some(ValueType::new(name, unit)), 1),
        None => (profile.period_type.clone(), profile.period),
    };
    Profile {
        sample_types,
        default_sample_type,
        period_type,
        period,
        start_unix_ns: profile.start_unix_ns,
        duration_ns: profile.duration_ns,
        frames,
        samples: kept,
        comments: profile.comments.clone(),
        // The combined profile's application is one process's; a
        // service's profile lists its mappings as its frames use them.
        main_module: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        export::{test_profile, to_pprof, validate},
        profile::{LabelValue, ValueType, label_keys},
    };

    /// The test profile with a contentions/delay/exceptions column added
    /// and its samples spread over two pids.
    fn combined() -> Profile {
        let mut profile = test_profile::profile();
        profile.sample_types.extend([
            ValueType::new("contentions", "count"),
            ValueType::new("delay", "nanoseconds"),
            ValueType::new("exceptions", "count"),
        ]);
        for (index, sample) in profile.samples.iter_mut().enumerate() {
            sample.values.extend([0, 0, 0]);
            if index == 0 {
                sample.values[2] = 3;
                sample.values[3] = 7_000;
            }
        }
        profile
    }

    fn pid_of(sample: &ProfileSample) -> Option<i64> {
        sample
            .labels
            .iter()
            .find_map(|label| match (&*label.key, &label.value) {
                (label_keys::PROCESS_PID, LabelValue::Num { value, .. }) => Some(*value),
                _ => None,
            })
    }

    #[test]
    fn allocations_become_pyroscope_memory_profiles() {
        let mut profile = test_profile::profile();
        profile.sample_types.extend([
            ValueType::new("alloc_samples", "count"),
            ValueType::new("alloc_size", "bytes"),
        ]);
        for sample in &mut profile.samples {
            sample.values.extend([0, 0]);
        }
        let n = profile.sample_types.len();
        profile.samples[0].values[n - 2] = 50;
        profile.samples[0].values[n - 1] = 102_400;
        let (batch, _) = window_batch(
            SystemTime::UNIX_EPOCH,
            Duration::from_secs(15),
            &profile,
            100,
            |_| {
                Some(ServiceKey {
                    service_name: "a".to_owned(),
                    labels: Vec::new(),
                })
            },
        );
        let memory = batch
            .profiles
            .iter()
            .find(|p| p.profile_type == ProfileType::Memory)
            .expect("a memory profile");
        assert_eq!(memory.profile_type.name(), "memory");
        let p = &memory.profile;
        assert_eq!(
            p.sample_types,
            [
                ValueType::new("alloc_samples", "count"),
                ValueType::new("alloc_size", "bytes")
            ]
        );
        // memory:alloc_size:bytes:space:bytes in Pyroscope.
        assert_eq!(p.period_type, Some(ValueType::new("space", "bytes")));
        assert_eq!(p.samples.len(), 1);
        assert_eq!(p.samples[0].values, [50, 102_400]);
        validate(&to_pprof(p)).expect("a valid pprof");
    }

    #[test]
    fn splits_by_service_and_profile_type() {
        let profile = combined();
        let pids: Vec<i64> = profile.samples.iter().filter_map(pid_of).collect();
        let first_pid = pids[0];
        let (batch, overflowed) = window_batch(
            SystemTime::UNIX_EPOCH,
            Duration::from_secs(15),
            &profile,
            100,
            |sample| {
                let pid = pid_of(sample)?;
                Some(ServiceKey {
                    service_name: if pid == first_pid { "a" } else { "b" }.to_owned(),
                    labels: vec![("process.pid".to_owned(), pid.to_string())],
                })
            },
        );
        assert_eq!(overflowed, 0);
        let kinds: Vec<(&str, ProfileType)> = batch
            .profiles
            .iter()
            .map(|p| (p.service_name.as_str(), p.profile_type))
            .collect();
        assert!(kinds.contains(&("a", ProfileType::ProcessCpu)), "{kinds:?}");
        assert!(kinds.contains(&("a", ProfileType::Lock)), "{kinds:?}");
        assert!(
            !kinds.contains(&("a", ProfileType::Exception)),
            "no exceptions: no profile"
        );
        // Totals are kept: the CPU of every service adds up to the whole.
        let total_cpu: i64 = batch
            .profiles
            .iter()
            .filter(|p| p.profile_type == ProfileType::ProcessCpu)
            .flat_map(|p| p.profile.samples.iter().map(|s| s.values[1]))
            .sum();
        let expected: i64 = profile.samples.iter().map(|s| s.values[1]).sum();
        assert_eq!(total_cpu, expected);
        for part in &batch.profiles {
            validate(&to_pprof(&part.profile)).expect("a valid pprof");
            assert!(part.profile.frames.len() <= profile.frames.len());
            let used: std::collections::HashSet<FrameIndex> = part
                .profile
                .samples
                .iter()
                .flat_map(|s| s.stack.iter().copied())
                .collect();
            assert_eq!(used.len(), part.profile.frames.len(), "only used frames");
        }
        let lock = batch
            .profiles
            .iter()
            .find(|p| p.profile_type == ProfileType::Lock)
            .expect("a lock profile");
        assert_eq!(lock.profile.samples.len(), 1);
        assert_eq!(lock.profile.samples[0].values, [3, 7_000]);
        assert_eq!(lock.profile.default_sample_type, Some(1));
    }

    /// A flood of service names: at most `max_series` services a window,
    /// the busiest keep their names, the rest share the overflow service
    /// with every sample kept.
    #[test]
    fn services_over_the_cap_share_one_overflow_service() {
        let mut profile = combined();
        let distinct = profile.samples.len();
        profile.samples = (0..20)
            .map(|i| profile.samples[i % distinct].clone())
            .collect();
        let total_cpu: i64 = profile.samples.iter().map(|s| s.values[1]).sum();
        let mut next = 0usize;
        // The first 5 samples are the busy service's; every other sample
        // names a service of its own.
        let mut names = Vec::new();
        for index in 0..profile.samples.len() {
            names.push(if index < 5 {
                "busy".to_owned()
            } else {
                next += 1;
                format!("flood-{next}")
            });
        }
        let mut index = 0;
        let (batch, overflowed) = window_batch(
            SystemTime::UNIX_EPOCH,
            Duration::from_secs(15),
            &profile,
            3,
            |_| {
                let name = names[index].clone();
                index += 1;
                Some(ServiceKey {
                    service_name: name,
                    labels: vec![("process.executable.name".into(), "dotnet".into())],
                })
            },
        );
        let services: std::collections::BTreeSet<&str> = batch
            .profiles
            .iter()
            .map(|p| p.service_name.as_str())
            .collect();
        assert_eq!(services.len(), 3, "{services:?}");
        assert!(services.contains("busy") && services.contains(OVERFLOW_SERVICE));
        assert_eq!(overflowed, next - 1);
        let overflow = batch
            .profiles
            .iter()
            .find(|p| p.service_name == OVERFLOW_SERVICE)
            .unwrap();
        assert!(overflow.labels.is_empty());
        let cpu: i64 = batch
            .profiles
            .iter()
            .filter(|p| p.profile_type == ProfileType::ProcessCpu)
            .flat_map(|p| p.profile.samples.iter().map(|s| s.values[1]))
            .sum();
        assert_eq!(cpu, total_cpu, "no sample lost");
    }

    #[test]
    fn waits_ship_as_the_wait_profile_with_their_delay_named_delay() {
        let mut profile = combined();
        profile.sample_types.extend([
            ValueType::new("waits", "count"),
            ValueType::new("wait_delay", "nanoseconds"),
        ]);
        for (index, sample) in profile.samples.iter_mut().enumerate() {
            sample
                .values
                .extend(if index == 1 { [4, 25_000] } else { [0, 0] });
        }
        let (batch, _) = window_batch(
            SystemTime::UNIX_EPOCH,
            Duration::from_secs(15),
            &profile,
            256,
            |_| {
                Some(ServiceKey {
                    service_name: "svc".to_owned(),
                    labels: Vec::new(),
                })
            },
        );
        let of = |t: ProfileType| batch.profiles.iter().find(|p| p.profile_type == t);
        let wait = of(ProfileType::Wait).expect("a wait profile");
        let types: Vec<(&str, &str)> = wait
            .profile
            .sample_types
            .iter()
            .map(|t| (&*t.r#type, &*t.unit))
            .collect();
        assert_eq!(types, [("waits", "count"), ("delay", "nanoseconds")]);
        assert_eq!(wait.profile.samples.len(), 1);
        assert_eq!(wait.profile.samples[0].values, [4, 25_000]);
        assert_eq!(wait.profile.default_sample_type, Some(1));
        // The lock profile keeps contention's delay alone.
        let lock = of(ProfileType::Lock).expect("a lock profile");
        assert_eq!(lock.profile.samples[0].values, [3, 7_000]);
        validate(&to_pprof(&wait.profile)).expect("a valid pprof");
    }
}
