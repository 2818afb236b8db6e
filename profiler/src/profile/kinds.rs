//! The kinds of samples a profile holds, in one table: CPU, off-CPU and
//! wall time, and the event kinds a runtime's event stream adds
//! ([`EVENT_KINDS`]: lock contention, exceptions, waits, allocations).
//!
//! Each entry says everything the house needs of a kind past its decoder:
//! its sample types and units in the combined profile and in a profile of
//! it alone, its `--split` file, its agent series ([`ProfileType`]) with
//! the names Pyroscope's views expect, and what a flame graph of it
//! shows. No other file matches a sample type's name. The runtime side of
//! a kind (provider keyword, lowest runtime version, decoder) is the
//! runtime's: [`crate::clr::session::ClrEventKinds`].

use std::fmt;

/// What a profile measures: one agent series per service and type. The
/// names are Pyroscope's (the ones its .NET views know), used for
/// `__name__` and in file names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProfileType {
    /// On-CPU samples (`samples/count`, `cpu/nanoseconds`).
    ProcessCpu,
    /// CPU plus off-CPU time per thread (`wall/nanoseconds`).
    Wall,
    /// Where threads blocked (`off_cpu/nanoseconds`).
    OffCpu,
    /// Monitor contention (`contentions/count`, `delay/nanoseconds`).
    Lock,
    /// Exceptions thrown (`exceptions/count`).
    Exception,
    /// Wait-handle waits (.NET 9+).
    Wait,
    /// Allocations (`alloc_samples/count`, `alloc_size/bytes`), Pyroscope's
    /// `memory` profile.
    Memory,
}

impl ProfileType {
    pub const ALL: [Self; 7] = [
        Self::ProcessCpu,
        Self::Wall,
        Self::OffCpu,
        Self::Lock,
        Self::Exception,
        Self::Wait,
        Self::Memory,
    ];

    /// The profile name: Pyroscope's `__name__` (`process_cpu`, `wall`,
    /// `lock`, `exception` are the ones grafana/pyroscope-dotnet sends;
    /// `offcpu` is Grafana Alloy's eBPF name), also the file-name part.
    pub fn name(self) -> &'static str {
        match self {
            Self::ProcessCpu => "process_cpu",
            Self::Wall => "wall",
            Self::OffCpu => "offcpu",
            Self::Lock => "lock",
            Self::Exception => "exception",
            Self::Wait => "wait",
            Self::Memory => "memory",
        }
    }
}

impl fmt::Display for ProfileType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A kind of event sample: what a runtime's events add to a profile, each
/// with an exact count and, for some, an amount (a delay, bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// A lock contention and how long it waited.
    Contention,
    /// An exception thrown.
    Exception,
    /// A wait-handle wait and how long it waited.
    Wait,
    /// Allocation samples and the bytes they stand for.
    Allocation,
}

/// One sample type of an [`EventKind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventSampleType {
    /// Its name in the combined profile, unique there.
    pub name: &'static str,
    pub unit: &'static str,
    /// Its name in a profile of its kind alone (a `--split` file, an
    /// agent series): waits' `wait_delay` is `delay` there, as
    /// contention's is.
    pub standalone: &'static str,
    /// Its name in what the agent sends Pyroscope (its .NET views':
    /// `lock_count`, `lock_time`, `exception`).
    pub pyroscope: &'static str,
}

/// An [`EventKind`]'s entry in [`EVENT_KINDS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventKindSpec {
    pub kind: EventKind,
    /// Its word in `--clr-events`.
    pub word: &'static str,
    /// Its part of a `--split` file name (`out.contention.pb.gz`).
    pub split_file: &'static str,
    /// Its sample types, in profile order: the count, then the amount
    /// when it has one.
    pub sample_types: &'static [EventSampleType],
    /// Its agent series.
    pub profile_type: ProfileType,
    /// The sample type a folded file or flame graph of it alone shows
    /// (an index into [`Self::sample_types`]).
    pub folded: usize,
    /// The period type of a profile of it alone; `None`: none (it has no
    /// CPU period).
    pub period_type: Option<(&'static str, &'static str)>,
    /// The label whose value names a frame added above each sample's
    /// stack, so flame graphs and folded stacks show it (allocations:
    /// the allocated type, as Pyroscope's .NET profiler shows it).
    pub leaf_label: Option<&'static str>,
}

/// The label of an allocation sample's type (`System.Byte[]`).
pub const ALLOCATION_TYPE_LABEL: &str = "allocation.type";

const fn same(name: &'static str, unit: &'static str) -> EventSampleType {
    EventSampleType {
        name,
        unit,
        standalone: name,
        pyroscope: name,
    }
}

/// Every event kind, in the order their sample types follow CPU, off-CPU
/// and wall time in a profile.
pub const EVENT_KINDS: [EventKindSpec; 4] = [
    EventKindSpec {
        kind: EventKind::Contention,
        word: "contention",
        split_file: "contention",
        sample_types: &[
            EventSampleType {
                pyroscope: "lock_count",
                ..same("contentions", "count")
            },
            EventSampleType {
                pyroscope: "lock_time",
                ..same("delay", "nanoseconds")
            },
        ],
        profile_type: ProfileType::Lock,
        folded: 1,
        period_type: None,
        leaf_label: None,
    },
    EventKindSpec {
        kind: EventKind::Exception,
        word: "exceptions",
        split_file: "exceptions",
        sample_types: &[EventSampleType {
            pyroscope: "exception",
            ..same("exceptions", "count")
        }],
        profile_type: ProfileType::Exception,
        folded: 0,
        period_type: None,
        leaf_label: None,
    },
    EventKindSpec {
        kind: EventKind::Wait,
        word: "waits",
        split_file: "waits",
        sample_types: &[
            same("waits", "count"),
            // A name of its own in the combined profile, so that its
            // `-sample_index=delay` stays contention's.
            EventSampleType {
                standalone: "delay",
                pyroscope: "delay",
                ..same("wait_delay", "nanoseconds")
            },
        ],
        profile_type: ProfileType::Wait,
        folded: 1,
        period_type: None,
        leaf_label: None,
    },
    EventKindSpec {
        kind: EventKind::Allocation,
        word: "allocations",
        split_file: "allocations",
        // Pyroscope's .NET profiler's: `memory:alloc_samples:count:space:bytes`
        // and `memory:alloc_size:bytes:space:bytes`.
        sample_types: &[same("alloc_samples", "count"), same("alloc_size", "bytes")],
        profile_type: ProfileType::Memory,
        folded: 1,
        period_type: Some(("space", "bytes")),
        leaf_label: Some(ALLOCATION_TYPE_LABEL),
    },
];

impl EventKind {
    pub const ALL: [Self; 4] = [
        Self::Contention,
        Self::Exception,
        Self::Wait,
        Self::Allocation,
    ];

    /// Its entry in [`EVENT_KINDS`].
    pub fn spec(self) -> &'static EventKindSpec {
        // The table lists the kinds in declaration order.
        &EVENT_KINDS[self as usize]
    }

    /// The kind whose `--clr-events` word is `word`.
    pub fn from_word(word: &str) -> Option<Self> {
        EVENT_KINDS.iter().find(|s| s.word == word).map(|s| s.kind)
    }
}

/// The sample types of CPU samples, off-CPU intervals with their wakers,
/// and wall time, with their series.
const BASE_SAMPLE_TYPES: [(&str, ProfileType); 5] = [
    ("samples", ProfileType::ProcessCpu),
    ("cpu", ProfileType::ProcessCpu),
    ("off_cpu", ProfileType::OffCpu),
    ("wakeup", ProfileType::OffCpu),
    ("wall", ProfileType::Wall),
];

/// The event sample type named `name` in a profile (combined or of its
/// kind alone), with its kind's entry.
fn event_sample_type(name: &str) -> Option<(&'static EventKindSpec, &'static EventSampleType)> {
    EVENT_KINDS.iter().find_map(|spec| {
        spec.sample_types
            .iter()
            .find(|t| t.name == name)
            .map(|t| (spec, t))
    })
}

/// The series a sample type of the combined profile belongs to, by its
/// name.
pub fn profile_type_of(sample_type: &str) -> Option<ProfileType> {
    BASE_SAMPLE_TYPES
        .iter()
        .find(|(name, _)| *name == sample_type)
        .map(|&(_, t)| t)
        .or_else(|| event_sample_type(sample_type).map(|(spec, _)| spec.profile_type))
}

/// The name of a combined profile's sample type in a profile of its kind
/// alone (a `--split` file, an agent series): the waits' profile holds
/// `waits/count` and `delay/nanoseconds`, as contention's does
/// `contentions/count` and `delay/nanoseconds`.
pub fn standalone_sample_type(name: &str) -> &str {
    event_sample_type(name).map_or(name, |(_, t)| t.standalone)
}

/// The period type of a profile of `profile_type` alone, when its kind
/// has one of its own (allocations: `space/bytes`).
pub fn period_type_of(profile_type: ProfileType) -> Option<(&'static str, &'static str)> {
    EVENT_KINDS
        .iter()
        .find(|spec| spec.profile_type == profile_type)
        .and_then(|spec| spec.period_type)
}

/// The Pyroscope name of a sample type of a `profile_type` series (named
/// as in a profile of its kind alone), when it differs.
pub fn pyroscope_sample_type(profile_type: ProfileType, standalone: &str) -> Option<&'static str> {
    EVENT_KINDS
        .iter()
        .filter(|spec| spec.profile_type == profile_type)
        .flat_map(|spec| spec.sample_types)
        .find(|t| t.standalone == standalone && t.pyroscope != standalone)
        .map(|t| t.pyroscope)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_each_kind_at_its_place_with_unique_names() {
        for (i, kind) in EventKind::ALL.into_iter().enumerate() {
            assert_eq!(EVENT_KINDS[i].kind, kind);
            assert_eq!(kind.spec().kind, kind);
            assert_eq!(EventKind::from_word(kind.spec().word), Some(kind));
            let spec = kind.spec();
            assert!(spec.folded < spec.sample_types.len());
        }
        let mut names: Vec<&str> = BASE_SAMPLE_TYPES.iter().map(|(n, _)| *n).collect();
        names.extend(
            EVENT_KINDS
                .iter()
                .flat_map(|s| s.sample_types)
                .map(|t| t.name),
        );
        let count = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), count, "a sample type name is used twice");
        assert_eq!(EventKind::from_word("gc"), None);
    }

    #[test]
    fn sample_types_map_to_their_series_and_standalone_names() {
        assert_eq!(profile_type_of("cpu"), Some(ProfileType::ProcessCpu));
        assert_eq!(profile_type_of("wakeup"), Some(ProfileType::OffCpu));
        assert_eq!(profile_type_of("delay"), Some(ProfileType::Lock));
        assert_eq!(profile_type_of("wait_delay"), Some(ProfileType::Wait));
        assert_eq!(profile_type_of("alloc_size"), Some(ProfileType::Memory));
        assert_eq!(profile_type_of("nope"), None);
        assert_eq!(standalone_sample_type("wait_delay"), "delay");
        assert_eq!(standalone_sample_type("delay"), "delay");
        assert_eq!(standalone_sample_type("cpu"), "cpu");
        assert_eq!(
            period_type_of(ProfileType::Memory),
            Some(("space", "bytes"))
        );
        assert_eq!(period_type_of(ProfileType::Lock), None);
        assert_eq!(
            pyroscope_sample_type(ProfileType::Lock, "delay"),
            Some("lock_time")
        );
        assert_eq!(pyroscope_sample_type(ProfileType::Wait, "delay"), None);
        assert_eq!(
            pyroscope_sample_type(ProfileType::Exception, "exceptions"),
            Some("exception")
        );
    }
}
