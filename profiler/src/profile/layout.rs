//! Which value of a profile sample is which: the sample types a recording
//! has (CPU always; off-CPU, wakeups, wall and CLR events when asked) and
//! their positions, shared by the stage that builds samples
//! ([`crate::pipeline`]) and the one that splits profiles by kind
//! ([`crate::export::split`]).

use super::ValueType;

/// Sample types added after `samples/count` and `cpu/nanoseconds` when CLR
/// events are collected. Waits' delay has a name of its own here, so that
/// `-sample_index=delay` of the combined profile stays contention's; in a
/// profile of waits alone it is `delay` ([`standalone_sample_type`]).
pub const CLR_SAMPLE_TYPES: [(&str, &str); 5] = [
    ("contentions", "count"),
    ("delay", "nanoseconds"),
    ("exceptions", "count"),
    ("waits", "count"),
    ("wait_delay", "nanoseconds"),
];

/// Sample types of allocation profiles, after Pyroscope's .NET profiler
/// (`memory:alloc_samples:count:space:bytes` and
/// `memory:alloc_size:bytes:space:bytes`); their period type is
/// [`ALLOCATION_PERIOD_TYPE`].
pub const ALLOCATION_SAMPLE_TYPES: [(&str, &str); 2] =
    [("alloc_samples", "count"), ("alloc_size", "bytes")];
/// The period type of a profile of allocations alone.
pub const ALLOCATION_PERIOD_TYPE: (&str, &str) = ("space", "bytes");

/// Offsets of the CLR sample types from [`ValueLayout::clr`].
pub mod clr_offsets {
    pub const CONTENTIONS: usize = 0;
    pub const DELAY: usize = 1;
    pub const EXCEPTIONS: usize = 2;
    pub const WAITS: usize = 3;
    pub const WAIT_DELAY: usize = 4;
}

/// The name of a combined profile's sample type in a profile of its kind
/// alone (a `--split` file, an agent series): the waits' profile holds
/// `waits/count` and `delay/nanoseconds`, as contention's does
/// `contentions/count` and `delay/nanoseconds`.
pub fn standalone_sample_type(name: &str) -> &str {
    match name {
        "wait_delay" => "delay",
        other => other,
    }
}

/// Which value of a profile sample is which: positions in the sample types.
#[derive(Clone, Debug)]
pub struct ValueLayout {
    pub types: Vec<ValueType>,
    pub samples: usize,
    pub cpu: usize,
    pub off_cpu: Option<usize>,
    pub wakeup: Option<usize>,
    pub wall: Option<usize>,
    /// First of [`CLR_SAMPLE_TYPES`] (contentions, delay, exceptions, waits,
    /// wait_delay; offsets in [`clr_offsets`]).
    pub clr: Option<usize>,
    /// First of [`ALLOCATION_SAMPLE_TYPES`] (alloc_samples, alloc_size).
    pub alloc: Option<usize>,
}

impl ValueLayout {
    pub fn new(off_cpu: bool, wall: bool, clr: bool) -> Self {
        let mut types = vec![
            ValueType::new("samples", "count"),
            ValueType::new("cpu", "nanoseconds"),
        ];
        let mut push = |on: bool, t: &[(&str, &str)]| {
            on.then(|| {
                let at = types.len();
                types.extend(t.iter().map(|(t, u)| ValueType::new(t, u)));
                at
            })
        };
        let off_cpu_at = push(off_cpu, &[("off_cpu", "nanoseconds")]);
        let wakeup = push(off_cpu, &[("wakeup", "nanoseconds")]);
        let wall = push(wall, &[("wall", "nanoseconds")]);
        let clr = push(clr, &CLR_SAMPLE_TYPES);
        Self {
            types,
            samples: 0,
            cpu: 1,
            off_cpu: off_cpu_at,
            wakeup,
            wall,
            clr,
            alloc: None,
        }
    }

    /// Adds the allocation sample types (at the end) when `on`.
    pub fn with_allocations(mut self, on: bool) -> Self {
        if on && self.alloc.is_none() {
            self.alloc = Some(self.types.len());
            self.types.extend(
                ALLOCATION_SAMPLE_TYPES
                    .iter()
                    .map(|(t, u)| ValueType::new(t, u)),
            );
        }
        self
    }

    pub fn zeros(&self) -> Vec<i64> {
        vec![0; self.types.len()]
    }

    /// The sample type a viewer opens on: wall when there is one, else CPU.
    pub fn default_index(&self) -> usize {
        self.wall.unwrap_or(self.cpu)
    }

    /// The one value folded stacks and flame graphs show: wall time, else
    /// off-CPU time, else (as perf's) CPU sample counts.
    pub fn folded_index(&self) -> usize {
        self.wall.or(self.off_cpu).unwrap_or(self.samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_layout_places_each_kind_once() {
        let layout = ValueLayout::new(true, true, true);
        let names: Vec<&str> = layout.types.iter().map(|t| &*t.r#type).collect();
        assert_eq!(
            names,
            [
                "samples",
                "cpu",
                "off_cpu",
                "wakeup",
                "wall",
                "contentions",
                "delay",
                "exceptions",
                "waits",
                "wait_delay"
            ]
        );
        assert_eq!(standalone_sample_type("wait_delay"), "delay");
        assert_eq!(standalone_sample_type("delay"), "delay");
        assert_eq!(standalone_sample_type("cpu"), "cpu");
        assert_eq!(layout.default_index(), 4);
        assert_eq!(layout.folded_index(), 4);
        let alloc = ValueLayout::new(false, false, true).with_allocations(true);
        assert_eq!(alloc.alloc, Some(7));
        assert_eq!(&*alloc.types[8].r#type, "alloc_size");
        let cpu_only = ValueLayout::new(false, false, false);
        assert_eq!(cpu_only.types.len(), 2);
        assert_eq!(cpu_only.default_index(), 1);
        assert_eq!(cpu_only.folded_index(), 0);
    }
}
