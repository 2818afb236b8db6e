//! Folded stacks (Brendan Gregg's "collapsed" format), the text that
//! `perf script | stackcollapse-perf.pl` and `inferno-collapse-perf` write
//! and that `flamegraph.pl`, inferno, speedscope and many other tools read.
//! It is also the input of our own SVG writer ([`super::flamegraph`]).
//!
//! One line per distinct stack: frames root first, joined by `;`, then a
//! space and the summed value of one sample type. The exact choices:
//!
//! - The first frame is the process: the value of the
//!   `process.executable.name` string label (perf's collapsers put the
//!   `comm` there; a per-thread name would split a .NET process into its
//!   thread pool threads), `[unknown]` when the sample has none.
//! - Frames use [`Frame::name`]: managed methods without their JIT tier, so
//!   the tiers of one method fold together. An inline chain becomes one
//!   frame per function, outermost first.
//! - Annotations as `inferno-collapse-perf --all` writes them, which its
//!   `java` palette colours: kernel frames end in `_[k]`, managed (JIT and
//!   ReadyToRun) frames in `_[j]`, inlined functions in `_[i]`.
//! - Names are made safe for the format: `;` becomes `:` (as
//!   `stackcollapse-perf.pl` does), control characters (newlines, tabs)
//!   become spaces, surrounding spaces are trimmed and an empty name becomes
//!   `[unknown]`; a process name starting with `#` gets `_` instead, since
//!   the readers take `# ` lines for comments.
//! - Samples with the same folded stack are summed (saturating); stacks
//!   whose sum is zero or negative are left out; lines are sorted by stack
//!   (byte order) so the output is deterministic.

use std::{collections::BTreeMap, io::Write};

use super::{ExportError, check_sample_type_index};
use crate::profile::{Frame, FrameKind, LabelValue, Profile, label_keys};

/// Shown for a stack entry that points outside [`Profile::frames`], as the
/// pprof writer does.
const INVALID_FRAME: &str = "[invalid frame index]";

/// The name of a process or frame the profile could not name.
pub(crate) const UNKNOWN: &str = "[unknown]";

/// Writes the folded stacks of `profile`, valued by the sample type at
/// `sample_type_index`.
pub fn write_collapsed(
    profile: &Profile,
    sample_type_index: usize,
    mut w: impl Write,
) -> Result<(), ExportError> {
    let write_error = |source| ExportError::Write {
        what: "folded stacks",
        source,
    };
    for (stack, value) in folded_stacks(profile, sample_type_index)? {
        writeln!(w, "{stack} {value}").map_err(write_error)?;
    }
    w.flush().map_err(write_error)
}

/// The folded stacks of `profile` with their summed values, sorted by
/// stack, without the stacks whose sum is not positive.
pub(crate) fn folded_stacks(
    profile: &Profile,
    sample_type_index: usize,
) -> Result<BTreeMap<String, i64>, ExportError> {
    folded_stacks_by(profile, sample_type_index, Roots::Process)
}

/// The frames a folded stack starts with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Roots {
    /// The process's executable name.
    #[default]
    Process,
    /// The process, then its thread: `[name tid=N]` (async-profiler's
    /// `--threads` convention), so each thread gets its own tower.
    Thread,
}

/// [`folded_stacks`] with the roots chosen.
pub(crate) fn folded_stacks_by(
    profile: &Profile,
    sample_type_index: usize,
    roots: Roots,
) -> Result<BTreeMap<String, i64>, ExportError> {
    check_sample_type_index(profile, sample_type_index)?;
    // Each frame's folded text, built on first use.
    let mut frame_texts: Vec<Option<String>> = vec![None; profile.frames.len()];
    let mut stacks: BTreeMap<String, i64> = BTreeMap::new();
    let mut stack = String::new();
    for sample in &profile.samples {
        let value = sample.values.get(sample_type_index).copied().unwrap_or(0);
        if value == 0 {
            continue;
        }
        stack.clear();
        push_process(&mut stack, sample);
        if roots == Roots::Thread {
            stack.push(';');
            push_thread(&mut stack, sample);
        }
        for &index in sample.stack.iter().rev() {
            stack.push(';');
            let slot = usize::try_from(index)
                .ok()
                .filter(|&slot| slot < profile.frames.len());
            match slot {
                Some(slot) => stack.push_str(
                    frame_texts[slot].get_or_insert_with(|| frame_text(&profile.frames[slot])),
                ),
                None => stack.push_str(INVALID_FRAME),
            }
        }
        match stacks.get_mut(stack.as_str()) {
            Some(sum) => *sum = sum.saturating_add(value),
            None => {
                stacks.insert(stack.clone(), value);
            }
        }
    }
    stacks.retain(|_, sum| *sum > 0);
    Ok(stacks)
}

/// The root frame: the process's executable name.
fn push_process(stack: &mut String, sample: &crate::profile::ProfileSample) {
    let executable = sample
        .labels
        .iter()
        .find_map(|label| match (&*label.key, &label.value) {
            (label_keys::PROCESS_EXECUTABLE_NAME, LabelValue::Str(name)) => Some(&**name),
            _ => None,
        });
    let start = stack.len();
    push_name(stack, executable.unwrap_or(UNKNOWN));
    if stack[start..].starts_with('#') {
        stack.replace_range(start..start + 1, "_");
    }
}

/// The thread root of [`Roots::Thread`]: `[name tid=N]`, `[tid=N]`
/// without a name, `[unknown thread]` without an id.
pub(crate) fn push_thread(stack: &mut String, sample: &crate::profile::ProfileSample) {
    let mut name = None;
    let mut tid = None;
    for label in &sample.labels {
        match (&*label.key, &label.value) {
            (label_keys::THREAD_NAME, LabelValue::Str(value)) => name = Some(&**value),
            (label_keys::THREAD_ID, LabelValue::Num { value, .. }) => tid = Some(*value),
            _ => {}
        }
    }
    let text = match (name, tid) {
        (Some(name), Some(tid)) => format!("[{name} tid={tid}]"),
        (None, Some(tid)) => format!("[tid={tid}]"),
        (Some(name), None) => format!("[{name}]"),
        (None, None) => "[unknown thread]".to_owned(),
    };
    push_name(stack, &text);
}

/// A frame's folded text: its own function, then its inline chain from
/// the outermost to the innermost, each with its annotation.
pub(crate) fn frame_text(frame: &Frame) -> String {
    let mut text = String::new();
    push_name(&mut text, &frame.name);
    text.push_str(match frame.kind {
        FrameKind::Kernel => "_[k]",
        FrameKind::Managed => "_[j]",
        FrameKind::Native | FrameKind::Unknown | FrameKind::Synthetic => "",
    });
    for inlined in frame.inlined.iter().rev() {
        text.push(';');
        push_name(&mut text, &inlined.name);
        text.push_str("_[i]");
    }
    text
}

/// Appends `name` made safe for a folded line (see the module doc).
pub(crate) fn push_name(out: &mut String, name: &str) {
    let start = out.len();
    for c in name.trim().chars() {
        out.push(match c {
            ';' => ':',
            c if c.is_control() => ' ',
            c => c,
        });
    }
    // Control characters turned into spaces may now surround the name.
    let trimmed = out[start..].trim();
    if trimmed.is_empty() {
        out.truncate(start);
        out.push_str(UNKNOWN);
    } else if trimmed.len() != out.len() - start {
        let trimmed = trimmed.to_owned();
        out.truncate(start);
        out.push_str(&trimmed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        export::test_profile,
        profile::{Label, ProfileSample},
    };

    fn collapsed(profile: &Profile, index: usize) -> String {
        let mut out = Vec::new();
        write_collapsed(profile, index, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn folds_the_test_profile() {
        let expected = "\
[unknown];App.Main_[j] 10000000
dotnet;App.Main_[j];Hot.Spin_[j] 40000000
dotnet;App.Main_[j];Hot.Spin_[j];__GI___libc_write;__write_nocancel_[i];entry_SYSCALL_64_[k];do_syscall_64_[k] 20000000
my:app;[truncated];libcoreclr.so+0x1234;evil:name with  controls 10000000
";
        assert_eq!(collapsed(&test_profile::profile(), 1), expected);
    }

    #[test]
    fn sums_the_chosen_sample_type() {
        let expected = "\
[unknown];App.Main_[j] 1
dotnet;App.Main_[j];Hot.Spin_[j] 4
dotnet;App.Main_[j];Hot.Spin_[j];__GI___libc_write;__write_nocancel_[i];entry_SYSCALL_64_[k];do_syscall_64_[k] 2
my:app;[truncated];libcoreclr.so+0x1234;evil:name with  controls 1
";
        assert_eq!(collapsed(&test_profile::profile(), 0), expected);
    }

    #[test]
    fn every_line_parses_back() {
        let profile = test_profile::profile();
        let text = collapsed(&profile, 1);
        let mut total = 0;
        for line in text.lines() {
            let (stack, value) = line.rsplit_once(' ').unwrap();
            total += value.parse::<i64>().unwrap();
            assert!(stack.split(';').all(|frame| !frame.is_empty()), "{line}");
            assert!(!line.chars().any(char::is_control), "{line:?}");
        }
        let expected: i64 = profile.samples.iter().map(|s| s.values[1]).sum();
        assert_eq!(total, expected);
    }

    #[test]
    fn out_of_range_sample_type_is_an_error() {
        let result = write_collapsed(&test_profile::profile(), 2, Vec::new());
        assert!(matches!(
            result,
            Err(ExportError::SampleTypeOutOfRange { index: 2, count: 2 })
        ));
    }

    #[test]
    fn empty_profile_writes_nothing() {
        let mut profile = test_profile::profile();
        profile.samples.clear();
        assert_eq!(collapsed(&profile, 0), "");
    }

    #[test]
    fn zero_negative_missing_values_and_bad_indices() {
        let mut profile = test_profile::profile();
        profile.samples = vec![
            ProfileSample {
                stack: vec![test_profile::MAIN],
                values: vec![0, 5],
                labels: vec![Label::str("process.executable.name", "a")],
            },
            ProfileSample {
                stack: vec![test_profile::MAIN],
                values: vec![-3, 5],
                labels: vec![Label::str("process.executable.name", "b")],
            },
            ProfileSample {
                stack: vec![test_profile::MAIN],
                values: vec![],
                labels: vec![Label::str("process.executable.name", "c")],
            },
            ProfileSample {
                stack: vec![999, test_profile::MAIN],
                values: vec![i64::MAX, 1],
                labels: vec![Label::str("process.executable.name", "#d")],
            },
            ProfileSample {
                stack: vec![999, test_profile::MAIN],
                values: vec![1, 1],
                labels: vec![Label::str("process.executable.name", "#d")],
            },
            ProfileSample {
                stack: vec![],
                values: vec![2, 1],
                labels: vec![Label::num("process.executable.name", 12)],
            },
        ];
        let expected = "\
[unknown] 2
_d;App.Main_[j];[invalid frame index] 9223372036854775807
";
        assert_eq!(collapsed(&profile, 0), expected);
    }

    #[test]
    fn per_thread_roots_split_a_process_by_thread() {
        let stacks = folded_stacks_by(&test_profile::profile(), 0, Roots::Thread).unwrap();
        let lines: Vec<String> = stacks
            .iter()
            .map(|(stack, value)| format!("{stack} {value}"))
            .collect();
        assert_eq!(
            lines,
            [
                "[unknown];[tid=99];App.Main_[j] 1",
                "dotnet;[.NET TP Worker tid=43];App.Main_[j];Hot.Spin_[j];__GI___libc_write;__write_nocancel_[i];entry_SYSCALL_64_[k];do_syscall_64_[k] 2",
                "dotnet;[tid=43];App.Main_[j];Hot.Spin_[j] 3",
                "dotnet;[tid=44];App.Main_[j];Hot.Spin_[j] 1",
                "my:app;[tid=7];[truncated];libcoreclr.so+0x1234;evil:name with  controls 1",
            ]
        );
    }

    #[test]
    fn names_are_made_safe() {
        let mut out = String::new();
        for name in ["a;b", "  x\n", "\n\r", "", "tab\there", "ünïcode;"] {
            push_name(&mut out, name);
            out.push('|');
        }
        assert_eq!(out, "a:b|x|[unknown]|[unknown]|tab here|ünïcode:|");
    }
}
