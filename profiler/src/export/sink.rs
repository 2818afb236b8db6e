//! Where the profile of a closed window goes: a [`ProfileSink`], the last
//! stage of the data flow. The driver ([`crate::pipeline::driver`]) hands
//! every window its policy cuts to one:
//!
//! - `record`: a [`FileSink`] (one file, or one per kind with `--split`),
//!   one window;
//! - the agent: [`crate::agent::ship::ServiceSinks`], which splits each
//!   window per service and hands it to the delivery queues of the
//!   directory, Pyroscope and OTLP backends;
//! - an on-demand profile (`/debug/pprof/profile`):
//!   [`crate::agent::cuts::PullReply`], which answers the HTTP client.

use std::{
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    time::{Duration, SystemTime},
};

use super::{
    ExportError,
    flamegraph::FlameGraphOptions,
    output::{OutputFile, OutputFormat, create_output},
    split::{select_sample_types, split_outputs},
};
use crate::profile::{Profile, layout::ValueLayout};

/// A boxed, sendable future: what the object-safe traits of the sinks
/// return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One window the pipeline closed: the whole host's samples of
/// `[start, start + duration)`.
#[derive(Clone, Debug, PartialEq)]
pub struct ClosedWindow {
    pub profile: Profile,
    /// Wall-clock start.
    pub start: SystemTime,
    pub duration: Duration,
}

impl Default for ClosedWindow {
    fn default() -> Self {
        Self {
            profile: Profile::default(),
            start: SystemTime::UNIX_EPOCH,
            duration: Duration::ZERO,
        }
    }
}

/// Where the windows the driver cuts go: a file, the agent's backends, the
/// client of an on-demand profile.
pub trait ProfileSink {
    /// Takes one closed window. A file sink writes it now (and fails if it
    /// cannot); a network sink queues it and never blocks the loop.
    fn submit(&mut self, window: ClosedWindow) -> Result<(), ExportError>;

    /// Waits until every window submitted so far is delivered or given up,
    /// for at most `grace` (at the end, after the last window); what is
    /// still queued then is dropped and counted.
    fn flush(&mut self, grace: Duration) -> BoxFuture<'_, FlushReport> {
        let _ = grace;
        Box::pin(std::future::ready(FlushReport::default()))
    }
}

/// What [`ProfileSink::flush`] achieved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// Windows still queued when the grace period ended (now dropped).
    pub abandoned: u64,
}

impl FlushReport {
    pub fn merge(self, other: Self) -> Self {
        Self {
            abandoned: self.abandoned + other.abandoned,
        }
    }
}

/// The output files of `record`, created (mode 0600, owned by the invoking
/// user under sudo) before anything is recorded, so a bad path fails first;
/// filled and renamed into place with the one window's profile.
pub struct FileSink {
    format: OutputFormat,
    flame_graph: FlameGraphOptions,
    planned: Vec<PlannedOutput>,
    written: Vec<PathBuf>,
}

/// One output file and what goes in it.
struct PlannedOutput {
    path: PathBuf,
    /// The sample types it keeps (indices into the combined profile);
    /// `None`: all of them.
    types: Option<Vec<usize>>,
    /// The sample type folded stacks and flame graphs show.
    index: usize,
    file: OutputFile,
}

impl FileSink {
    /// Creates `output` (or, with `split`, one file per kind of `layout`)
    /// as `format`, owned by `owner`.
    pub fn create(
        output: &Path,
        format: OutputFormat,
        split: bool,
        layout: &ValueLayout,
        owner: Option<(u32, u32)>,
    ) -> Result<Self, ExportError> {
        let parts: Vec<(PathBuf, Option<Vec<usize>>, usize)> = if split {
            split_outputs(output, format, layout)
                .into_iter()
                .map(|(path, types, index)| (path, Some(types), index))
                .collect()
        } else {
            let index = match format {
                OutputFormat::Pprof => layout.default_index(),
                OutputFormat::Collapsed | OutputFormat::Svg => layout.folded_index(),
            };
            vec![(output.to_owned(), None, index)]
        };
        let planned = parts
            .into_iter()
            .map(|(path, types, index)| {
                Ok(PlannedOutput {
                    file: create_output(&path, owner)?,
                    path,
                    types,
                    index,
                })
            })
            .collect::<Result<_, ExportError>>()?;
        Ok(Self {
            format,
            flame_graph: FlameGraphOptions::default(),
            planned,
            written: Vec::new(),
        })
    }

    /// The files written so far.
    /// How the .svg outputs are drawn.
    pub fn with_flame_graph(mut self, options: FlameGraphOptions) -> Self {
        self.flame_graph = options;
        self
    }

    pub fn written(&self) -> &[PathBuf] {
        &self.written
    }
}

impl ProfileSink for FileSink {
    /// Fills and commits every file; a second window has nowhere to go.
    fn submit(&mut self, window: ClosedWindow) -> Result<(), ExportError> {
        let profile = &window.profile;
        if self.planned.is_empty() {
            return Err(ExportError::NotAFilePath {
                path: PathBuf::from("(the output files were written already)"),
            });
        }
        for planned in std::mem::take(&mut self.planned) {
            let PlannedOutput {
                path,
                types,
                index,
                file,
            } = planned;
            match types {
                Some(types) => {
                    let mut part = select_sample_types(profile, &types);
                    part.default_sample_type = Some(index);
                    file.write_profile_with(&part, self.format, index, &self.flame_graph)?;
                }
                None => file.write_profile_with(profile, self.format, index, &self.flame_graph)?,
            }
            self.written.push(path);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::{pprof::read_pprof, test_profile};

    #[test]
    fn split_files_exist_from_the_start_and_hold_their_kinds_after_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let layout = ValueLayout::new(true, false, &[]);
        let out = dir.path().join("p.pb.gz");
        let mut sink = FileSink::create(&out, OutputFormat::Pprof, true, &layout, None).unwrap();
        let temporaries = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(temporaries, 2, "cpu and offcpu, created before any sample");
        let mut profile = test_profile::profile();
        profile.sample_types = layout.types.clone();
        for sample in &mut profile.samples {
            sample.values.resize(layout.types.len(), 1);
        }
        let window = ClosedWindow {
            profile,
            ..ClosedWindow::default()
        };
        sink.submit(window.clone()).unwrap();
        assert_eq!(sink.written().len(), 2);
        let cpu = read_pprof(&std::fs::read(dir.path().join("p.cpu.pb.gz")).unwrap()).unwrap();
        assert_eq!(cpu.sample_type.len(), 2);
        assert!(sink.submit(window).is_err(), "one window only");
    }
}
