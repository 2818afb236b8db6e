//! Which value of a profile sample is which: the sample types a recording
//! has (CPU always; off-CPU, wakeups, wall and CLR events when asked) and
//! their positions, shared by the stage that builds samples
//! ([`crate::pipeline`]) and the one that splits profiles by kind
//! ([`crate::export::split`]).

use std::ops::Range;

use super::{
    ValueType,
    kinds::{EVENT_KINDS, EventKind, EventKindSpec},
};

/// Which value of a profile sample is which: positions in the sample types.
#[derive(Clone, Debug)]
pub struct ValueLayout {
    pub types: Vec<ValueType>,
    pub samples: usize,
    pub cpu: usize,
    pub off_cpu: Option<usize>,
    pub wakeup: Option<usize>,
    pub wall: Option<usize>,
    /// The event kinds recorded, each with the position of its first
    /// sample type, in [`EVENT_KINDS`] order, after everything else.
    pub events: Vec<(EventKind, usize)>,
}

impl ValueLayout {
    /// CPU samples, then off-CPU time and wakeups (`off_cpu`), wall time
    /// (`wall`), and the sample types of the `events` kinds.
    pub fn new(off_cpu: bool, wall: bool, events: &[EventKind]) -> Self {
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
        let mut recorded = Vec::new();
        for spec in EVENT_KINDS.iter().filter(|s| events.contains(&s.kind)) {
            recorded.push((spec.kind, types.len()));
            types.extend(
                spec.sample_types
                    .iter()
                    .map(|t| ValueType::new(t.name, t.unit)),
            );
        }
        Self {
            types,
            samples: 0,
            cpu: 1,
            off_cpu: off_cpu_at,
            wakeup,
            wall,
            events: recorded,
        }
    }

    /// Each recorded event kind's entry, with the positions of its sample
    /// types.
    pub fn recorded_events(
        &self,
    ) -> impl Iterator<Item = (&'static EventKindSpec, Range<usize>)> + '_ {
        self.events.iter().map(|&(kind, first)| {
            let spec = kind.spec();
            (spec, first..first + spec.sample_types.len())
        })
    }

    /// The positions of `kind`'s sample types, when it is recorded.
    pub fn event_columns(&self, kind: EventKind) -> Option<Range<usize>> {
        self.recorded_events()
            .find(|(spec, _)| spec.kind == kind)
            .map(|(_, columns)| columns)
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

    /// The values of `count` events of `kind` standing for `amount` (a
    /// delay in nanoseconds, bytes; ignored by kinds without one); `None`
    /// when `kind` is not recorded.
    pub fn event(&self, kind: EventKind, count: u64, amount: u64) -> Option<Vec<i64>> {
        let columns = self.event_columns(kind)?;
        let mut values = self.zeros();
        values[columns.start] = saturating_i64(count);
        if columns.len() > 1 {
            values[columns.start + 1] = saturating_i64(amount);
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

    const SESSION_KINDS: [EventKind; 3] =
        [EventKind::Contention, EventKind::Exception, EventKind::Wait];

    #[test]
    fn value_layout_places_each_kind_once() {
        let layout = ValueLayout::new(true, true, &SESSION_KINDS);
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
        assert_eq!(layout.default_index(), 4);
        assert_eq!(layout.folded_index(), 4);
        assert_eq!(layout.on_cpu(2, 20), [2, 20, 0, 0, 20, 0, 0, 0, 0, 0]);
        assert_eq!(layout.off_cpu(7), [0, 0, 7, 0, 7, 0, 0, 0, 0, 0]);
        assert_eq!(layout.wakeup(7), Some(vec![0, 0, 0, 7, 0, 0, 0, 0, 0, 0]));
        assert_eq!(
            layout.event(EventKind::Contention, 1, 9),
            Some(vec![0, 0, 0, 0, 0, 1, 9, 0, 0, 0])
        );
        assert_eq!(
            layout.event(EventKind::Exception, 3, 99),
            Some(vec![0, 0, 0, 0, 0, 0, 0, 3, 0, 0]),
            "an exception has no amount"
        );
        assert_eq!(
            layout.event(EventKind::Wait, 1, 5),
            Some(vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 5])
        );
        assert_eq!(layout.event(EventKind::Allocation, 1, 5), None);
        let all = ValueLayout::new(false, false, &EventKind::ALL);
        assert_eq!(all.event_columns(EventKind::Allocation), Some(7..9));
        assert_eq!(&*all.types[8].r#type, "alloc_size");
        assert_eq!(
            all.event(EventKind::Allocation, 2, 300),
            Some(vec![0, 0, 0, 0, 0, 0, 0, 2, 300])
        );
        let alloc_only = ValueLayout::new(false, false, &[EventKind::Allocation]);
        assert_eq!(alloc_only.event_columns(EventKind::Allocation), Some(2..4));
        let cpu_only = ValueLayout::new(false, false, &[]);
        assert_eq!(cpu_only.types.len(), 2);
        assert_eq!(cpu_only.default_index(), 1);
        assert_eq!(cpu_only.folded_index(), 0);
        assert_eq!(cpu_only.wakeup(7), None);
        assert_eq!(cpu_only.event(EventKind::Exception, 1, 0), None);
        assert_eq!(cpu_only.on_cpu(1, u64::MAX), [1, i64::MAX]);
    }
}
