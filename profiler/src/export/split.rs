//! `--split`: one output file per kind of sample (CPU, off-CPU, wall,
//! contention, exceptions, waits) cut from the combined profile.

use std::path::{Path, PathBuf};

use super::output::OutputFormat;
use crate::profile::{
    Profile, ProfileSample, ValueType,
    layout::{
        ALLOCATION_PERIOD_TYPE, ALLOCATION_SAMPLE_TYPES, ValueLayout, standalone_sample_type,
    },
};

/// `--split`: for `out.pb.gz`, `out.cpu.pb.gz` (samples, cpu),
/// `out.offcpu.pb.gz` (off_cpu, wakeup), `out.wall.pb.gz`,
/// `out.contention.pb.gz` (contentions, delay), `out.exceptions.pb.gz` and
/// `out.waits.pb.gz` (waits, delay), those the recording has, with the sample types each keeps (indices
/// into the combined profile) and the one folded stacks and flame graphs
/// show (an index into the kept ones).
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
    if let Some(clr) = layout.clr {
        parts.push(("contention", vec![clr.contentions, clr.delay], 1));
        parts.push(("exceptions", vec![clr.exceptions], 0));
        parts.push(("waits", vec![clr.waits, clr.wait_delay], 1));
    }
    if let Some(alloc) = layout.alloc {
        parts.push(("allocations", vec![alloc.samples, alloc.size], 1));
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
    if part.sample_types.iter().any(|t| {
        ALLOCATION_SAMPLE_TYPES
            .iter()
            .any(|(name, _)| **name == *t.r#type)
    }) {
        // Pyroscope's memory profiles: period `space/bytes`, 1.
        let (period_type, unit) = ALLOCATION_PERIOD_TYPE;
        part.period_type = Some(ValueType::new(period_type, unit));
        part.period = 1;
    }
    part
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_files_are_named_by_kind_with_their_sample_types() {
        let layout = ValueLayout::new(true, true, true);
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
    fn the_waits_part_names_its_delay_as_contention_does() {
        let mut profile = crate::export::test_profile::profile();
        let layout = ValueLayout::new(false, false, true);
        profile.sample_types = layout.types.clone();
        for sample in &mut profile.samples {
            sample.values = layout.zeros();
        }
        let clr = layout.clr.expect("CLR types");
        profile.samples[0].values = layout.wait(2, 9_000).expect("CLR types");
        let waits = select_sample_types(&profile, &[clr.waits, clr.wait_delay]);
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
