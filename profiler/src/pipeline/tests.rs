//! The pipeline's windows and lifecycle, fed by a fake kernel.

use super::*;
use crate::profile::label_keys;

/// A fake kernel: samples handed out in the order given, a few per
/// drain, as ticks would.
struct FakeSource(VecDeque<RawSample>);

impl SampleSource for FakeSource {
    fn drain(
        &mut self,
        out: &mut Vec<RawSample>,
        _events: &mut Vec<crate::bpf::ProcessEventAt>,
    ) -> u64 {
        let n = self.0.len().min(3);
        out.extend(self.0.drain(..n));
        0
    }
}

/// A CPU sample of a process that does not exist: its frames stay
/// unknown, which is all a window needs.
fn cpu_sample(time_ns: u64, tid: u32, user_stack: Vec<u64>) -> RawSample {
    RawSample::on_cpu(u32::MAX - 1, tid, time_ns, user_stack)
}

fn totals(profile: &Profile) -> (i64, i64) {
    profile
        .samples
        .iter()
        .fold((0, 0), |(n, cpu), s| (n + s.values[0], cpu + s.values[1]))
}

#[test]
fn consecutive_windows_add_up_to_the_whole() {
    let samples: Vec<RawSample> = (0..20u64)
        .map(|i| cpu_sample(i * 100, 1 + (i % 3) as u32, vec![0x1000 + i % 4, 0x2000]))
        .collect();
    let layout = ValueLayout::new(false, false, &[]);
    let mut windowed = Pipeline::new(false, ClrEventKinds::NONE, layout.clone());
    let mut source = FakeSource(samples.iter().cloned().collect());
    let mut scratch = Vec::new();
    // 12 samples pulled: two of them are past the first window's end.
    for _ in 0..4 {
        windowed.pull(&mut source, &mut scratch);
    }
    let first = windowed.take_window(
        WindowSpan {
            start_ns: 0,
            end_ns: 1000,
            start_unix_ns: 5_000,
        },
        1000,
    );
    for _ in 0..10 {
        windowed.pull(&mut source, &mut scratch);
    }
    let second = windowed.take_window(
        WindowSpan {
            start_ns: 1000,
            end_ns: 2000,
            start_unix_ns: 6_000,
        },
        1000,
    );
    assert_eq!(totals(&first), (10, 10_000), "samples at 0..900 ns");
    assert_eq!(totals(&second), (10, 10_000), "samples at 1000..1900 ns");
    assert_eq!((first.start_unix_ns, first.duration_ns), (5_000, 1000));
    assert_eq!((second.start_unix_ns, second.duration_ns), (6_000, 1000));

    let mut whole = Pipeline::new(false, ClrEventKinds::NONE, layout);
    let mut samples = samples;
    whole.accept(&mut samples);
    let all = whole.take_window(
        WindowSpan {
            start_ns: 0,
            end_ns: 2000,
            start_unix_ns: 5_000,
        },
        1000,
    );
    assert_eq!(totals(&all), (20, 20_000));
    // Per stack and thread, the two windows hold what the whole holds.
    let by_key = |profiles: &[&Profile]| {
        let mut sums: HashMap<(Vec<String>, String), i64> = HashMap::new();
        for p in profiles {
            for s in &p.samples {
                let names = s
                    .stack
                    .iter()
                    .map(|&f| p.frames[f as usize].name.to_string())
                    .collect();
                let tid = format!(
                    "{:?}",
                    s.labels.iter().find(|l| &*l.key == label_keys::THREAD_ID)
                );
                *sums.entry((names, tid)).or_default() += s.values[0];
            }
        }
        sums
    };
    assert_eq!(by_key(&[&first, &second]), by_key(&[&all]));
}

#[test]
fn an_exit_releases_the_process_after_its_last_samples() {
    let mut pipeline = Pipeline::new(
        false,
        ClrEventKinds::NONE,
        ValueLayout::new(false, false, &[]),
    );
    let pid = u32::MAX - 1;
    let exit = 25;
    pipeline.accept(&mut vec![
        cpu_sample(10, 1, vec![1]),
        cpu_sample(20, 1, vec![1]),
        // Taken while it exits, after its exit event.
        cpu_sample(exit + 1_000_000, 1, vec![1]),
        // The pid reused by a new process after the exit.
        cpu_sample(exit + EXIT_GRACE_NS + 1, 1, vec![1]),
    ]);
    pipeline
        .lifecycle
        .push_back(crate::bpf::ProcessEvent::Exited { pid, time_ns: exit });
    pipeline.process_pending(exit + 2_000_000);
    assert!(
        pipeline.processes.contains_key(&pid),
        "not released while it may still run"
    );
    pipeline.process_pending(exit + EXIT_GRACE_NS + 1);
    assert_eq!(pipeline.summary.samples, 3);
    assert_eq!(pipeline.summary.processes_exited, 1);
    assert!(
        !pipeline.processes.contains_key(&pid),
        "released after its exit"
    );
    pipeline.process_pending(u64::MAX);
    assert_eq!(pipeline.samples_seen(), 4);
    assert!(pipeline.processes.contains_key(&pid), "the new process");
    assert_eq!(
        pipeline.process_count(),
        2,
        "two processes seen under one pid"
    );
}

#[test]
fn a_process_gone_without_its_exit_event_is_retired_at_the_second_check() {
    let mut pipeline = Pipeline::new(
        false,
        ClrEventKinds::NONE,
        ValueLayout::new(false, false, &[]),
    );
    let pid = u32::MAX - 1; // never a live process
    pipeline.accept(&mut vec![cpu_sample(10, 1, vec![1])]);
    pipeline.process_pending(u64::MAX);
    assert!(pipeline.processes.contains_key(&pid));
    let check = |pipeline: &mut Pipeline| {
        pipeline.vanished.1 = std::time::Instant::now() - VANISHED_CHECK_EVERY;
        pipeline.retire_vanished();
    };
    check(&mut pipeline);
    assert!(
        pipeline.processes.contains_key(&pid),
        "the first check only notes it"
    );
    check(&mut pipeline);
    assert!(!pipeline.processes.contains_key(&pid));
    assert_eq!(pipeline.summary.processes_vanished, 1);
    assert_eq!(pipeline.summary.processes_exited, 1);
    assert_eq!(pipeline.summary.samples, 1, "its stack was named first");
}

#[test]
fn an_off_cpu_sample_and_its_waker_carry_their_labels_values_and_stacks() {
    let layout = ValueLayout::new(true, false, &[]);
    let mut pipeline = Pipeline::new(false, ClrEventKinds::NONE, layout);
    let mut sample = cpu_sample(10, 7, vec![0x1000]);
    sample.kind = clrbpf_common::SampleKind::OffCpu;
    sample.value = 5_000;
    sample.off_cpu = Some(crate::profile::OffCpuDetail {
        interval_ns: 5_000,
        syscall: None,
        woken_tid: 0,
        waker: Some(crate::profile::Waker {
            pid: u32::MAX - 2,
            tid: 9,
            thread_name: "releaser".into(),
            user_stack: vec![0x2000],
        }),
        waker_kernel_stack: Vec::new(),
        stack_not_taken: false,
    });
    pipeline.accept(&mut vec![sample]);
    let profile = pipeline.take_window(
        WindowSpan {
            start_ns: 0,
            end_ns: 100,
            start_unix_ns: 0,
        },
        1,
    );
    let keys = |s: &crate::profile::ProfileSample| -> Vec<String> {
        s.labels.iter().map(|l| l.key.to_string()).collect()
    };
    let [blocked, woken] = &profile.samples[..] else {
        panic!("two samples: {:?}", profile.samples);
    };
    assert_eq!(blocked.values, [0, 0, 5_000, 0]);
    assert_eq!(
        keys(blocked),
        [
            label_keys::PROCESS_PID,
            label_keys::PROCESS_EXECUTABLE_NAME,
            label_keys::THREAD_ID,
            label_keys::THREAD_NAME,
            label_keys::WAIT_KIND,
        ]
    );
    assert_eq!(woken.values, [0, 0, 0, 5_000]);
    assert_eq!(
        keys(woken)[5..],
        [
            label_keys::WAKER_PROCESS_PID,
            label_keys::WAKER_THREAD_ID,
            label_keys::WAKER_THREAD_NAME,
        ]
    );
    let names: Vec<&str> = woken
        .stack
        .iter()
        .map(|&f| &*profile.frames[f as usize].name)
        .collect();
    assert_eq!(
        names[..3],
        [
            &*format!("releaser (pid {})", u32::MAX - 2),
            "[process not profiled]",
            "--"
        ]
    );
    assert_eq!(names.len(), 3 + blocked.stack.len());
}

#[test]
fn a_window_leaves_later_samples_for_the_next() {
    let mut pipeline = Pipeline::new(
        false,
        ClrEventKinds::NONE,
        ValueLayout::new(false, false, &[]),
    );
    pipeline.accept(&mut vec![
        cpu_sample(50, 1, vec![1]),
        cpu_sample(150, 1, vec![1]),
    ]);
    let span = |start_ns, end_ns| WindowSpan {
        start_ns,
        end_ns,
        start_unix_ns: 0,
    };
    assert_eq!(totals(&pipeline.take_window(span(0, 100), 1)), (1, 1000));
    assert_eq!(totals(&pipeline.take_window(span(100, 200), 1)), (1, 1000));
    assert_eq!(totals(&pipeline.take_window(span(200, 300), 1)), (0, 0));
}

/// A fake `/proc/<pid>` of a process named `name` that started at `start`
/// ticks (issue 33, defect 8: the pid's next process has another start).
fn fake_proc_entry(dir: &std::path::Path, pid: u32, name: &str, start: u64) -> ProcFs {
    let status = crate::process::tests::STATUS.replace("dotnet", name);
    let stat = crate::process::tests::stat_line(name, start);
    crate::process::tests::fake_process(
        dir,
        pid,
        &[
            ("status", status.as_bytes()),
            ("stat", &stat),
            ("cmdline", name.as_bytes()),
        ],
    )
}

/// The executable names of the window's samples.
fn executable_names(profile: &Profile) -> Vec<String> {
    let mut names: Vec<String> = profile
        .samples
        .iter()
        .filter_map(|s| {
            s.labels
                .iter()
                .find(|l| &*l.key == label_keys::PROCESS_EXECUTABLE_NAME)
        })
        .map(|l| match &l.value {
            crate::profile::LabelValue::Str(s) => s.to_string(),
            crate::profile::LabelValue::Num { value, .. } => value.to_string(),
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Issue 33, defect 8: a process whose exit event was lost does not keep
/// its entry for the next process under its pid. At the new process's exec
/// the start time differs and the old entry is retired; at the check (every
/// 5 s, or at once when the kernel dropped records) an exit is queued at the
/// new process's start: an old sample still waiting stays the old
/// process's, and the new process's samples carry its own labels.
#[test]
fn a_reused_pid_gets_the_new_process_not_the_old_entry() {
    // Clock ticks after boot far enough on to be on the samples' clock.
    let new_ticks = 1_000_000_000;
    let new_start = crate::profile::boot_ticks_to_monotonic_ns(new_ticks);
    for at_exec in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let pid = u32::MAX - 1;
        let layout = ValueLayout::new(false, false, &[]);
        let mut pipeline = Pipeline::new(false, ClrEventKinds::NONE, layout);
        pipeline.procfs = fake_proc_entry(dir.path(), pid, "old-app", 100);
        pipeline.accept(&mut vec![cpu_sample(10, 1, vec![0x1000])]);
        pipeline.process_pending(20);
        assert_eq!(pipeline.processes[&pid].start_time_ticks, Some(100));
        // Taken before the old process ended, not added yet.
        pipeline.accept(&mut vec![cpu_sample(
            new_start - 2 * EXIT_GRACE_NS,
            1,
            vec![0x1000],
        )]);
        // The old process exits unseen (its exit event lost); another
        // process gets its pid and execs.
        fake_proc_entry(dir.path(), pid, "new-app", new_ticks);
        if at_exec {
            pipeline
                .lifecycle
                .push_back(crate::bpf::ProcessEvent::Exec {
                    pid,
                    time_ns: new_start,
                });
        } else {
            pipeline.vanished.1 = std::time::Instant::now() - VANISHED_CHECK_EVERY;
            pipeline.retire_vanished();
        }
        let old = pipeline.take_window(
            WindowSpan {
                start_ns: 0,
                end_ns: new_start + 1,
                start_unix_ns: 0,
            },
            35,
        );
        assert!(
            !pipeline.processes.contains_key(&pid),
            "the old entry retired (at exec: {at_exec})"
        );
        assert_eq!(pipeline.summary.processes_vanished, 1);
        assert_eq!(
            executable_names(&old),
            ["old-app"],
            "the sample taken before the new process started is the old one's (at exec: {at_exec})"
        );
        pipeline.accept(&mut vec![cpu_sample(new_start + 2, 1, vec![0x1000])]);
        pipeline.process_pending(new_start + 3);
        assert_eq!(pipeline.processes[&pid].start_time_ticks, Some(new_ticks));
        let new = pipeline.take_window(
            WindowSpan {
                start_ns: new_start + 1,
                end_ns: new_start + 100,
                start_unix_ns: 35,
            },
            100,
        );
        assert_eq!(
            executable_names(&new),
            ["new-app"],
            "the new process's samples carry its own labels (at exec: {at_exec})"
        );
        assert_eq!(pipeline.process_count(), 2);
    }
}
