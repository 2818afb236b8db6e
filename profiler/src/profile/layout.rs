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

/// Where the allocation sample types ([`ALLOCATION_SAMPLE_TYPES`]) sit in
/// a sample's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocValues {
    pub samples: usize,
    pub size: usize,
}

/// Where the CLR sample types ([`CLR_SAMPLE_TYPES`]) sit in a sample's
/// values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClrValues {
    pub contentions: usize,
    pub delay: usize,
    pub exceptions: usize,
    pub waits: usize,
    pub wait_delay: usize,
}

impl ClrValues {
    /// The positions of [`CLR_SAMPLE_TYPES`] pushed from `first` on.
    fn from(first: usize) -> Self {
        Self {
            contentions: first,
            delay: first + 1,
            exceptions: first + 2,
            waits: first + 3,
            wait_delay: first + 4,
        }
    }
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
    pub clr: Option<ClrValues>,
    /// Allocations, after everything else ([`Self::with_allocations`]).
    pub alloc: Option<AllocValues>,
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
            clr: clr.map(ClrValues::from),
            alloc: None,
        }
    }

    /// Adds the allocation sample types (at the end) when `on`.
    pub fn with_allocations(mut self, on: bool) -> Self {
        if on && self.alloc.is_none() {
            let samples = self.types.len();
            self.types.extend(
                ALLOCATION_SAMPLE_TYPES
                    .iter()
                    .map(|(t, u)| ValueType::new(t, u)),
            );
            self.alloc = Some(AllocValues {
                samples,
                size: samples + 1,
            });
        }
        self
    }

    pub fn zeros(&self) -> Vec<i64> {
        vec![0; self.types.len()]
    }

    /// The values of `count` CPU samples of one stack, `cpu_ns` in all
    /// (wall time too, when recorded).
    pub fn on_cpu(&self, count: u64, cpu_ns: u64) -> Vec<i64> {
        let mut values = self.zeros();
        values[self.samples] = saturating_i64(count);
        values[self.cpu] = saturating_i64(cpu_ns);
        if let Some(wall) = self.wall {
            values[wall] = saturating_i64(cpu_ns);
        }
        values
    }

    /// The values of one off-CPU interval of `off_cpu_ns` (upscaled; wall
    /// time too, when recorded).
    pub fn off_cpu(&self, off_cpu_ns: u64) -> Vec<i64> {
        let mut values = self.zeros();
        if let Some(at) = self.off_cpu {
            values[at] = saturating_i64(off_cpu_ns);
        }
        if let Some(wall) = self.wall {
            values[wall] = saturating_i64(off_cpu_ns);
        }
        values
    }

    /// The values of the waker's stack of an off-CPU interval of
    /// `off_cpu_ns`; `None` when wakeups are not recorded.
    pub fn wakeup(&self, off_cpu_ns: u64) -> Option<Vec<i64>> {
        let at = self.wakeup?;
        let mut values = self.zeros();
        values[at] = saturating_i64(off_cpu_ns);
        Some(values)
    }

    /// The values of `count` lock contentions that waited `delay_ns` in
    /// all; `None` without CLR events.
    pub fn contention(&self, count: u64, delay_ns: u64) -> Option<Vec<i64>> {
        self.clr_pair(count, delay_ns, |clr| (clr.contentions, Some(clr.delay)))
    }

    /// The values of `count` exceptions thrown; `None` without CLR events.
    pub fn exception(&self, count: u64) -> Option<Vec<i64>> {
        self.clr_pair(count, 0, |clr| (clr.exceptions, None))
    }

    /// The values of `count` wait-handle waits of `delay_ns` in all;
    /// `None` without CLR events.
    pub fn wait(&self, count: u64, delay_ns: u64) -> Option<Vec<i64>> {
        self.clr_pair(count, delay_ns, |clr| (clr.waits, Some(clr.wait_delay)))
    }

    /// The values of `count` allocation events standing for `bytes`
    /// allocated; `None` without allocations.
    pub fn allocation(&self, count: u64, bytes: u64) -> Option<Vec<i64>> {
        let alloc = self.alloc?;
        let mut values = self.zeros();
        values[alloc.samples] = saturating_i64(count);
        values[alloc.size] = saturating_i64(bytes);
        Some(values)
    }

    fn clr_pair(
        &self,
        count: u64,
        delay_ns: u64,
        at: impl FnOnce(&ClrValues) -> (usize, Option<usize>),
    ) -> Option<Vec<i64>> {
        let (count_at, delay_at) = at(self.clr.as_ref()?);
        let mut values = self.zeros();
        values[count_at] = saturating_i64(count);
        if let Some(delay_at) = delay_at {
            values[delay_at] = saturating_i64(delay_ns);
        }
        Some(values)
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

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
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
        assert_eq!(layout.on_cpu(2, 20), [2, 20, 0, 0, 20, 0, 0, 0, 0, 0]);
        assert_eq!(layout.off_cpu(7), [0, 0, 7, 0, 7, 0, 0, 0, 0, 0]);
        assert_eq!(layout.wakeup(7), Some(vec![0, 0, 0, 7, 0, 0, 0, 0, 0, 0]));
        assert_eq!(
            layout.contention(1, 9),
            Some(vec![0, 0, 0, 0, 0, 1, 9, 0, 0, 0])
        );
        assert_eq!(
            layout.exception(3),
            Some(vec![0, 0, 0, 0, 0, 0, 0, 3, 0, 0])
        );
        assert_eq!(layout.wait(1, 5), Some(vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 5]));
        assert_eq!(layout.allocation(1, 5), None);
        let alloc = ValueLayout::new(false, false, true).with_allocations(true);
        assert_eq!(
            alloc.alloc,
            Some(AllocValues {
                samples: 7,
                size: 8
            })
        );
        assert_eq!(&*alloc.types[8].r#type, "alloc_size");
        assert_eq!(
            alloc.allocation(2, 300),
            Some(vec![0, 0, 0, 0, 0, 0, 0, 2, 300])
        );
        let cpu_only = ValueLayout::new(false, false, false);
        assert_eq!(cpu_only.types.len(), 2);
        assert_eq!(cpu_only.default_index(), 1);
        assert_eq!(cpu_only.folded_index(), 0);
        assert_eq!(cpu_only.wakeup(7), None);
        assert_eq!(cpu_only.exception(1), None);
        assert_eq!(cpu_only.on_cpu(1, u64::MAX), [1, i64::MAX]);
    }
}
