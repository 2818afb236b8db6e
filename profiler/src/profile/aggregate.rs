//! Sums symbolized samples into a [`Profile`]: frames are interned once
//! (one per distinct frame and address, so one pprof location each) and
//! samples with the same stack and labels add their values.
//!
//! [`Aggregator::take`] hands out the profile of the window so far and
//! starts the next one empty (frames too: a window's profile holds only
//! the frames its samples use), so a long run holds one window at a time.

use std::collections::HashMap;

use super::model::{Frame, FrameIndex, FrameKind, Label, Profile, ProfileSample, ValueType};

/// The distinct frames in no file that nothing named (`[unknown]`, one per
/// address) one process may add to a window. Each costs a frame here and a
/// location, function and string in the pprof, and a process that returns
/// into fresh anonymous addresses at every sample (rewritten frame-pointer
/// chains) would otherwise add 100 k of them a second. Past the share, its
/// further ones are one `[unknown]` frame without an address, as perf
/// shows them: the samples and their other frames are kept.
pub const UNKNOWN_FRAMES_PER_PROCESS: u32 = 16_384;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SampleKey {
    stack: Box<[FrameIndex]>,
    labels: Box<[Label]>,
}

/// Accumulates samples of fixed sample types.
#[derive(Debug)]
pub struct Aggregator {
    sample_types: Vec<ValueType>,
    frames: Vec<Frame>,
    frame_index: HashMap<Frame, FrameIndex>,
    /// Each distinct stack and labels, held once, with the index of its
    /// values in [`Self::values`]: the order of first arrival, so output is
    /// deterministic. A whole-host `record` holds every distinct sample of
    /// its one window (a churning host's short processes each have their
    /// own pid label), so a second copy of each key would cost as much as
    /// the profile.
    samples: HashMap<SampleKey, usize>,
    values: Vec<Box<[i64]>>,
    /// Per pid, the `[unknown]` frames it added to this window.
    unknown: HashMap<u32, u32>,
    /// `[unknown]` frames made the one shared frame, over the whole run.
    unknown_over_share: u64,
}

impl Aggregator {
    pub fn new(sample_types: Vec<ValueType>) -> Self {
        Self {
            sample_types,
            frames: Vec::new(),
            frame_index: HashMap::new(),
            samples: HashMap::new(),
            values: Vec::new(),
            unknown: HashMap::new(),
            unknown_over_share: 0,
        }
    }

    pub fn sample_types(&self) -> &[ValueType] {
        &self.sample_types
    }

    /// The index of `frame`, adding it on first sight.
    pub fn intern(&mut self, frame: &Frame) -> FrameIndex {
        if let Some(&index) = self.frame_index.get(frame) {
            return index;
        }
        let index =
            FrameIndex::try_from(self.frames.len()).expect("fewer than 2^32 distinct frames");
        self.frames.push(frame.clone());
        self.frame_index.insert(frame.clone(), index);
        index
    }

    /// The index of `frame`, a user frame of process `pid`: as
    /// [`Self::intern`], but a new `[unknown]` frame past the process's
    /// [`UNKNOWN_FRAMES_PER_PROCESS`] for the window is the one `[unknown]`
    /// frame without an address.
    pub fn intern_user(&mut self, pid: u32, frame: &Frame) -> FrameIndex {
        if frame.kind != FrameKind::Unknown || frame.module.is_some() || frame.address == 0 {
            return self.intern(frame);
        }
        if let Some(&index) = self.frame_index.get(frame) {
            return index;
        }
        let added = self.unknown.entry(pid).or_insert(0);
        if *added < UNKNOWN_FRAMES_PER_PROCESS {
            *added += 1;
            return self.intern(frame);
        }
        self.unknown_over_share = self.unknown_over_share.saturating_add(1);
        let shared = Frame {
            address: 0,
            ..frame.clone()
        };
        self.intern(&shared)
    }

    /// How many `[unknown]` frames were made the shared one, over the run.
    pub fn unknown_over_share(&self) -> u64 {
        self.unknown_over_share
    }

    /// Adds `values` (one per sample type; missing ones count as 0) to the
    /// sample with this stack (leaf first) and labels.
    pub fn add(&mut self, stack: &[FrameIndex], labels: Vec<Label>, values: &[i64]) {
        let key = SampleKey {
            stack: stack.into(),
            labels: labels.into_boxed_slice(),
        };
        let width = self.sample_types.len();
        if let Some(&at) = self.samples.get(&key) {
            for (total, v) in self.values[at].iter_mut().zip(values) {
                *total = total.saturating_add(*v);
            }
            return;
        }
        let mut sum = vec![0; width].into_boxed_slice();
        for (total, v) in sum.iter_mut().zip(values) {
            *total = *v;
        }
        self.samples.insert(key, self.values.len());
        self.values.push(sum);
    }

    pub fn frame_count(&self) -> usize {
        self.frames.len()
    }

    pub fn distinct_samples(&self) -> usize {
        self.samples.len()
    }

    /// The profile of the window so far, with the caller's period and
    /// timing fields; the aggregator starts the next window empty.
    pub fn take(
        &mut self,
        period_type: Option<ValueType>,
        period: i64,
        start_unix_ns: i64,
        duration_ns: i64,
    ) -> Profile {
        self.frame_index.clear();
        self.unknown.clear();
        let frames = std::mem::take(&mut self.frames);
        let mut keys: Vec<(usize, SampleKey)> = std::mem::take(&mut self.samples)
            .into_iter()
            .map(|(key, at)| (at, key))
            .collect();
        keys.sort_unstable_by_key(|&(at, _)| at);
        let values = std::mem::take(&mut self.values);
        let samples = keys
            .into_iter()
            .zip(values)
            .map(|((_, SampleKey { stack, labels }), values)| ProfileSample {
                stack: stack.into_vec(),
                values: values.into_vec(),
                labels: labels.into_vec(),
            })
            .collect();
        Profile {
            sample_types: self.sample_types.clone(),
            default_sample_type: None,
            period_type,
            period,
            start_unix_ns,
            duration_ns,
            frames,
            samples,
            comments: Vec::new(),
            main_module: None,
        }
    }

    /// One profile of consecutive windows' profiles (of the same sample
    /// types): frames interned once, samples with the same stack and
    /// labels summed, the period fields of the first, and the caller's
    /// start and duration. `None` for no profile.
    pub fn merge(parts: &[Profile], start_unix_ns: i64, duration_ns: i64) -> Option<Profile> {
        let first = parts.first()?;
        let mut merged = Self::new(first.sample_types.clone());
        let mut stack = Vec::new();
        for part in parts {
            let indexes: Vec<FrameIndex> = part.frames.iter().map(|f| merged.intern(f)).collect();
            for sample in &part.samples {
                stack.clear();
                stack.extend(
                    sample
                        .stack
                        .iter()
                        .filter_map(|&i| indexes.get(i as usize).copied()),
                );
                merged.add(&stack, sample.labels.clone(), &sample.values);
            }
        }
        let mut profile = merged.take(
            first.period_type.clone(),
            first.period,
            start_unix_ns,
            duration_ns,
        );
        profile.default_sample_type = first.default_sample_type;
        profile.comments = first.comments.clone();
        profile.main_module = first.main_module.clone();
        Some(profile)
    }

    /// The profile of the one window there is.
    pub fn finish(
        mut self,
        period_type: Option<ValueType>,
        period: i64,
        start_unix_ns: i64,
        duration_ns: i64,
    ) -> Profile {
        self.take(period_type, period, start_unix_ns, duration_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types() -> Vec<ValueType> {
        vec![
            ValueType::new("samples", "count"),
            ValueType::new("cpu", "nanoseconds"),
        ]
    }

    #[test]
    fn merged_windows_add_up_to_the_whole() {
        let mut whole = Aggregator::new(types());
        let mut parts = Vec::new();
        let mut a = Aggregator::new(types());
        for (window, name, values) in [
            (0, "main", [1, 10]),
            (0, "work", [2, 20]),
            (1, "work", [3, 30]),
            (1, "idle", [4, 40]),
        ] {
            if parts.len() < window {
                parts.push(a.take(None, 10, 100, 5));
            }
            for agg in [&mut a, &mut whole] {
                let root = agg.intern(&Frame::synthetic("root"));
                let leaf = agg.intern(&Frame::synthetic(name));
                agg.add(&[leaf, root], vec![Label::num("k", 1)], &values);
            }
        }
        parts.push(a.take(None, 10, 105, 5));
        let merged = Aggregator::merge(&parts, 100, 10).expect("parts");
        let whole = whole.finish(None, 10, 100, 10);
        assert_eq!(merged, whole);
        assert_eq!(merged.samples.len(), 3, "work's two windows are one sample");
        assert!(Aggregator::merge(&[], 0, 0).is_none());
    }

    #[test]
    fn take_hands_out_a_window_and_starts_the_next_empty() {
        let mut a = Aggregator::new(types());
        let main = a.intern(&Frame::synthetic("main"));
        a.add(&[main], vec![], &[1, 10]);
        let first = a.take(None, 10, 100, 5);
        assert_eq!(first.samples.len(), 1);
        assert_eq!((first.start_unix_ns, first.duration_ns), (100, 5));
        assert_eq!(a.distinct_samples(), 0);
        let work = a.intern(&Frame::synthetic("work"));
        assert_eq!(work, 0, "each window interns its own frames");
        a.add(&[work], vec![], &[2, 20]);
        let second = a.finish(None, 10, 105, 5);
        assert_eq!(second.frames.len(), 1);
        assert_eq!(second.frames[0].name.as_ref(), "work");
        assert_eq!(second.samples[0].values, vec![2, 20]);
    }

    #[test]
    fn a_process_past_its_unknown_frames_gets_one_more() {
        let mut a = Aggregator::new(types());
        let unknown = |addr| Frame {
            kind: FrameKind::Unknown,
            name: "[unknown]".into(),
            address: addr,
            ..Frame::synthetic("")
        };
        let share = u64::from(UNKNOWN_FRAMES_PER_PROCESS);
        for addr in 1..=share + 1000 {
            a.intern_user(7, &unknown(addr));
        }
        assert_eq!(a.frame_count() as u64, share + 1);
        assert_eq!(a.unknown_over_share(), 1000);
        let other = a.intern_user(8, &unknown(1 << 40));
        assert_eq!(other as u64, share + 1, "another process has its own share");
        assert_eq!(a.intern_user(7, &unknown(5)), 4, "one seen is still itself");
        let _ = a.take(None, 1, 0, 0);
        assert_eq!(
            a.intern_user(7, &unknown(share + 5)),
            0,
            "a new window, a new share"
        );
    }

    #[test]
    fn equal_frames_are_interned_once() {
        let mut a = Aggregator::new(types());
        let f = Frame::synthetic("main");
        let g = Frame {
            address: 0x10,
            ..Frame::synthetic("main")
        };
        assert_eq!(a.intern(&f), 0);
        assert_eq!(a.intern(&f), 0);
        assert_eq!(a.intern(&g), 1, "another address is another location");
    }

    #[test]
    fn samples_with_equal_stack_and_labels_add_up() {
        let mut a = Aggregator::new(types());
        let main = a.intern(&Frame::synthetic("main"));
        let work = a.intern(&Frame::synthetic("work"));
        let labels = || vec![Label::num("thread.id", 7)];
        a.add(&[work, main], labels(), &[1, 10]);
        a.add(&[work, main], labels(), &[1, 10]);
        a.add(&[main], labels(), &[1, 10]);
        a.add(&[work, main], vec![Label::num("thread.id", 8)], &[1, 10]);
        assert_eq!(a.distinct_samples(), 3);
        let p = a.finish(Some(ValueType::new("cpu", "nanoseconds")), 10, 0, 0);
        assert_eq!(p.samples.len(), 3);
        assert_eq!(p.samples[0].stack, vec![work, main]);
        assert_eq!(p.samples[0].values, vec![2, 20]);
        assert_eq!(p.samples[1].values, vec![1, 10]);
        let total: i64 = p.samples.iter().map(|s| s.values[1]).sum();
        assert_eq!(total, 40);
    }

    #[test]
    fn short_value_lists_are_padded_with_zero() {
        let mut a = Aggregator::new(types());
        a.add(&[], Vec::new(), &[3]);
        let p = a.finish(None, 0, 0, 0);
        assert_eq!(p.samples[0].values, vec![3, 0]);
    }
}
