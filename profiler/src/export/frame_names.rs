//! Which name a managed frame shows (`--frame-names`), applied to a finished
//! [`Profile`] before any writer sees it, so pprof, folded stacks and SVG
//! flame graphs agree.
//!
//! The symbolizer names a managed frame the way .NET users read it,
//! `Namespace.Type.Method` ([`crate::symbolize::method_name`]), and keeps the
//! runtime's full name (return type, assembly, parameters and JIT tier:
//! `int64 [Hot] Hot::Spin(int64)[OptimizedTier1]`) as its `system_name`.
//! [`FrameNames::Full`] puts that full name, without the tier, back in
//! `name`: overloads then stay apart, and tiers still merge.

use std::sync::Arc;

use crate::{
    profile::{FrameKind, Profile},
    symbolize::managed::split_tier,
};

/// How managed frames are named in the output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum FrameNames {
    /// `Namespace.Type.Method`, nested types joined with `+`, generic
    /// arguments kept; the full signature is the pprof `system_name`.
    #[default]
    Short,
    /// The runtime's full signature, `int64 [Hot] Hot::Spin(int64)`.
    Full,
}

/// Renames the managed frames of `profile` as `names` asks. The profile's
/// frames come named [`FrameNames::Short`]; that choice changes nothing.
pub fn apply_frame_names(profile: &mut Profile, names: FrameNames) {
    if names == FrameNames::Short {
        return;
    }
    for frame in &mut profile.frames {
        if frame.kind != FrameKind::Managed {
            continue;
        }
        if let Some(system_name) = &frame.system_name {
            let (full, _tier) = split_tier(system_name);
            if *full != *frame.name {
                frame.name = Arc::from(full);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::{collapsed::frame_text, test_profile};

    #[test]
    fn full_names_come_back_without_the_tier() {
        let mut profile = test_profile::profile();
        let short: Vec<String> = profile.frames.iter().map(frame_text).collect();
        apply_frame_names(&mut profile, FrameNames::Short);
        assert_eq!(
            short,
            profile.frames.iter().map(frame_text).collect::<Vec<_>>(),
            "short is the symbolizer's own naming"
        );
        apply_frame_names(&mut profile, FrameNames::Full);
        let managed: Vec<&str> = profile
            .frames
            .iter()
            .filter(|frame| frame.kind == FrameKind::Managed)
            .map(|frame| &*frame.name)
            .collect();
        assert_eq!(
            managed,
            [
                test_profile::SPIN,
                test_profile::SPIN,
                test_profile::MAIN_NAME
            ]
        );
        let others = |profile: &Profile| {
            profile
                .frames
                .iter()
                .filter(|frame| frame.kind != FrameKind::Managed)
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(others(&profile), others(&test_profile::profile()));
    }
}
