//! Which processes' samples are wanted at all (the agent's `--exe`,
//! `--container-id` and `--k8s-namespace`), decided once per process when
//! the pipeline learns it, from the labels its samples would carry.
//!
//! The sinks ship only the selected processes' samples. Naming the others'
//! stacks each window (their perf maps read, their frames symbolized) and
//! checking them for new JIT code would be work thrown away, so the
//! pipeline counts their samples and drops them before any of it. The
//! kernel still samples and walks them: a selection by container or
//! namespace is known only once a process is learnt.

use super::{
    Pipeline,
    tracked::{TrackedProcess, unknown_exe_name},
};
use crate::profile::RawSample;

/// What a selection is decided on: the labels the process's samples carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessKey<'a> {
    /// The executable name; `None` when it could not be read (the process
    /// exited first and is labelled `pid-PID`).
    pub executable: Option<&'a str>,
    pub container_id: Option<&'a str>,
    pub k8s_namespace: Option<&'a str>,
}

impl<'a> ProcessKey<'a> {
    pub(super) fn of(process: &'a TrackedProcess) -> Self {
        let executable =
            Some(&*process.exe_name).filter(|name| *name != unknown_exe_name(process.pid).as_str());
        Self {
            executable,
            container_id: process.container_id.as_deref(),
            k8s_namespace: process
                .pod
                .as_ref()
                .and_then(|pod| pod.namespace.as_deref()),
        }
    }
}

/// A selection of processes: the sinks' own rule, so that what the
/// pipeline drops is exactly what they would have left out.
pub trait ProcessFilter: Send + Sync {
    fn selects(&self, process: &ProcessKey<'_>) -> bool;
}

impl Pipeline {
    /// Keeps only the samples of the processes `filter` selects (the
    /// agent's `--exe`, `--container-id`, `--k8s-namespace`): the others
    /// are counted and dropped before they are named. Set before the
    /// first sample.
    pub fn select_processes(&mut self, filter: Box<dyn ProcessFilter>) {
        self.selection = Some(filter);
    }

    /// Counts `sample` as taken and drops it when its process is not
    /// selected; returns whether it did.
    pub(super) fn drop_unselected(&mut self, sample: &RawSample) -> bool {
        let unselected = self
            .processes
            .get(&sample.pid)
            .is_some_and(|process| !process.selected);
        if unselected {
            self.summary.samples += 1;
            self.summary.samples_not_selected += 1;
        }
        unselected
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct OnlyExe(String);

    impl ProcessFilter for OnlyExe {
        fn selects(&self, process: &ProcessKey<'_>) -> bool {
            process.executable == Some(self.0.as_str())
        }
    }

    fn discover(pid: u32) -> TrackedProcess {
        TrackedProcess::discover(
            &crate::process::ProcFs::default(),
            pid,
            &mut crate::symbolize::native::NativeSymbolizer::new(),
            crate::clr::instance::DotnetLoader::for_listing(),
            None,
        )
    }

    #[test]
    fn the_key_is_what_the_samples_are_labelled_with() {
        let me = discover(std::process::id());
        let key = ProcessKey::of(&me);
        assert_eq!(key.executable, Some(&*me.exe_name));
        assert_eq!(key.container_id, me.container_id.as_deref());
        assert!(OnlyExe(me.exe_name.to_string()).selects(&key));
        assert!(!OnlyExe("no-such-exe".to_owned()).selects(&key));
    }

    #[test]
    fn a_process_whose_executable_was_not_read_has_none() {
        // No such pid: its executable cannot be read.
        let gone = discover(u32::MAX - 7);
        assert_eq!(&*gone.exe_name, unknown_exe_name(u32::MAX - 7));
        let key = ProcessKey::of(&gone);
        assert_eq!(key.executable, None);
        // `--exe pid-4294967288` selects nothing: the sinks name no
        // series after the stand-in either.
        assert!(!OnlyExe(unknown_exe_name(u32::MAX - 7)).selects(&key));
    }

    #[test]
    fn a_process_outside_the_selection_is_learnt_unselected() {
        let me = std::process::id();
        let learnt = |filter: &dyn ProcessFilter| {
            TrackedProcess::discover(
                &crate::process::ProcFs::default(),
                me,
                &mut crate::symbolize::native::NativeSymbolizer::new(),
                crate::clr::instance::DotnetLoader::for_listing(),
                Some(filter),
            )
        };
        assert!(!learnt(&OnlyExe("no-such-exe".to_owned())).selected);
        let exe = discover(me).exe_name.to_string();
        assert!(learnt(&OnlyExe(exe)).selected);
    }

    fn sample(pid: u32, time_ns: u64) -> RawSample {
        RawSample::on_cpu(pid, pid, time_ns, vec![0x1000 + time_ns])
    }

    #[test]
    fn the_pipeline_counts_an_unselected_process_s_samples_and_names_none() {
        use crate::{
            clr::session::ClrEventKinds,
            pipeline::{Pipeline, WindowSpan},
            profile::{LabelValue, label_keys, layout::ValueLayout},
        };
        let mut pipeline = Pipeline::new(
            false,
            ClrEventKinds::NONE,
            ValueLayout::new(false, false, &[]),
        );
        let me = std::process::id();
        let exe = discover(me).exe_name.to_string();
        pipeline.select_processes(Box::new(OnlyExe(exe)));
        let other = u32::MAX - 1; // not a live process: `pid-4294967294`
        let mut samples: Vec<_> = (0..6)
            .map(|i| sample(if i % 2 == 0 { me } else { other }, 10 + i))
            .collect();
        pipeline.accept(&mut samples);
        pipeline.process_pending(1_000);
        assert_eq!(
            pipeline.raw_cpu.len(),
            3,
            "only the selected stacks wait to be named"
        );
        let profile = pipeline.take_window(
            WindowSpan {
                start_ns: 0,
                end_ns: 1_000,
                start_unix_ns: 0,
            },
            1000,
        );
        let pids: Vec<i64> = profile
            .samples
            .iter()
            .flat_map(|s| &s.labels)
            .filter(|l| &*l.key == label_keys::PROCESS_PID)
            .filter_map(|l| match l.value {
                LabelValue::Num { value, .. } => Some(value),
                _ => None,
            })
            .collect();
        assert_eq!(pids, [i64::from(me); 3], "only the selected process ships");
        assert_eq!(
            pipeline.summary.samples, 6,
            "every sample is counted as taken"
        );
        assert_eq!(pipeline.summary.samples_not_selected, 3);
    }
}
