//! `--split`: one output file per kind of sample (CPU, off-CPU, wall,
//! contention, exceptions, waits) cut from the combined profile.

use std::path::{Path, PathBuf};

use super::output::OutputFormat;
use crate::profile::{
    Profile, ProfileSample, ValueType,
    kinds::{period_type_of, profile_type_of, standalone_sample_type},
    layout::ValueLayout,
};

/// `--split`: for `out.pb.gz`, `out.cpu.pb.gz` (samples, cpu),
/// `out.offcpu.pb.gz` (off_cpu, wakeup), `out.wall.pb.gz`,
/// and one per event kind the recording has (`out.contention.pb.gz`:
/// contentions, delay; [`crate::profile::kinds::EVENT_KINDS`]), with the
/// sample types each keeps (indices into the combined profile) and the one
/// folded stacks and flame graphs show (an index into the kept ones).
pub fn split_outputs(
    output: &Path,
    format: OutputFormat,
    layout: &ValueLayout,
) -> Vec<(PathBuf, Vec<usize>, usize)> {
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (stem, extension) = match name.strip_suffix(".pb.gz") {
        Some(stem) => (stem.to_owned(), ".pb.gz".to_owned()),
        None => match name.rsplit_once('.') {
            Some((stem, ext)) if !stem.is_empty() => (stem.to_owned(), format!(".{ext}")),
            _ => (name.clone(), String::new()),
        },
    };
    let folded = !matches!(format, OutputFormat::Pprof);
    let mut parts = vec![(
        "cpu",
        vec![layout.samples, layout.cpu],
        if folded { 0 } else { 1 },
    )];
    if let (Some(off_cpu), Some(wakeup)) = (layout.off_cpu, layout.wakeup) {
        parts.push(("offcpu", vec![off_cpu, wakeup], 0));
    }
    if let Some(wall) = layout.wall {
        parts.push(("wall", vec![wall], 0));
    }
    for (spec, columns) in layout.recorded_events() {
        parts.push((spec.split_file, columns.collect(), spec.folded));
    }
    parts
        .into_iter()
        .map(|(kind, types, index)| {
            (
                output.with_file_name(format!("{stem}.{kind}{extension}")),
                types,
                index,
            )
        })
        .collect()
}

/// The part of `profile` with only the sample types `types` (named as in
/// a profile of their kind alone: waits' delay is `delay` there), and only
/// the samples with a value in one of them.
pub fn select_sample_types(profile: &Profile, types: &[usize]) -> Profile {
    let mut part = profile.clone();
    part.sample_types = types
        .iter()
        .filter_map(|&i| profile.sample_types.get(i))
        .map(|t| ValueType::new(standalone_sample_type(&t.r#type), &t.unit))
        .collect();
    part.samples = profile
        .samples
        .iter()
        .filter_map(|sample| {
            let values: Vec<i64> = types
                .iter()
                .map(|&i| sample.values.get(i).copied().unwrap_or(0))
                .collect();
            values.iter().any(|&v| v != 0).then(|| ProfileSample {
                values,
                ..sample.clone()
            })
        })
        .collect();
    let keeps_cpu = types.contains(&1);
    if !keeps_cpu {
        part.period_type = None;
        part.period = 0;
    }
    // A kind's own period type (allocations: Pyroscope's memory
    // profiles' `space/bytes`, 1).
    let own_period = types
        .iter()
        .filter_map(|&i| profile.sample_types.get(i))
        .find_map(|t| profile_type_of(&t.r#type).and_then(period_type_of));
    if let Some((period_type, unit)) = own_period {
        part.period_type = Some(ValueType::new(period_type, unit));
        part.period = 1;
    }
    part
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::kinds::EventKind;

    #[test]
    fn split_files_are_named_by_kind_with_their_sample_types() {
        let layout = ValueLayout::new(
            true,
            true,
            &[EventKind::Contention, EventKind::Exception, EventKind::Wait],
        );
        let parts = split_outputs(Path::new("/x/out.pb.gz"), OutputFormat::Pprof, &layout);
        let files: Vec<String> = parts
            .iter()
            .map(|(p, _, _)| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            files,
            [
                "out.cpu.pb.gz",
                "out.offcpu.pb.gz",
                "out.wall.pb.gz",
                "out.contention.pb.gz",
                "out.exceptions.pb.gz",
                "out.waits.pb.gz"
            ]
        );
        assert_eq!(parts[1].1, vec![2, 3]);
        assert_eq!(parts[4].1, vec![7]);
        assert_eq!(parts[5].1, vec![8, 9]);
        assert_eq!(parts[5].2, 1, "folded stacks show the waits' delay");
    }

    #[test]
    fn the_allocations_part_has_its_own_period_type() {
        let layout = ValueLayout::new(false, false, &EventKind::ALL);
        let parts = split_outputs(Path::new("out.pb.gz"), OutputFormat::Pprof, &layout);
        let (path, columns, folded) = parts.last().expect("parts");
        assert_eq!(path, Path::new("out.allocations.pb.gz"));
        assert_eq!((columns.as_slice(), *folded), (&[7, 8][..], 1));
        let mut profile = crate::export::test_profile::profile();
        profile.sample_types = layout.types.clone();
        for sample in &mut profile.samples {
            sample.values = layout.zeros();
        }
        profile.samples[0].values = layout
            .event(EventKind::Allocation, 1, 4096)
            .expect("allocations");
        let part = select_sample_types(&profile, columns);
        assert_eq!(part.period_type, Some(ValueType::new("space", "bytes")));
        assert_eq!((part.period, part.samples.len()), (1, 1));
        let exceptions = select_sample_types(&profile, &[4]);
        assert_eq!(exceptions.period_type, None);
    }

    #[test]
    fn the_waits_part_names_its_delay_as_contention_does() {
        let mut profile = crate::export::test_profile::profile();
        let layout = ValueLayout::new(false, false, &[EventKind::Wait]);
        profile.sample_types = layout.types.clone();
        for sample in &mut profile.samples {
            sample.values = layout.zeros();
        }
        profile.samples[0].values = layout.event(EventKind::Wait, 2, 9_000).expect("waits");
        let columns: Vec<usize> = layout.event_columns(EventKind::Wait).unwrap().collect();
        let waits = select_sample_types(&profile, &columns);
        let types: Vec<(&str, &str)> = waits
            .sample_types
            .iter()
            .map(|t| (&*t.r#type, &*t.unit))
            .collect();
        assert_eq!(types, [("waits", "count"), ("delay", "nanoseconds")]);
        assert_eq!(waits.samples.len(), 1);
        assert_eq!(waits.samples[0].values, [2, 9_000]);
        assert_eq!(waits.period, 0, "no CPU period in a profile of waits");
    }
}
