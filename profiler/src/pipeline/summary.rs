//! What one recording collected, and the summary printed for a person at
//! its end: samples kept and lost, how frames were named, CLR and off-CPU
//! totals, the command's status, warnings.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use clrbpf_common::offcpu::OffCpuThreadTotals;

use crate::{
    bpf::{KernelCounters, ProgramStats, UnwindReport},
    clr::intake::ClrCounters,
    profile::RawSample,
};

/// What one recording collected, for the summary line and for tests.
#[derive(Clone, Debug, Default)]
pub struct RecordSummary {
    pub duration: Duration,
    pub samples: u64,
    pub samples_lost: u64,
    pub malformed_records: u64,
    pub processes: usize,
    /// Processes whose exit the kernel reported during the recording; what
    /// they held was released then.
    pub processes_exited: usize,
    /// What the bounded caches let go of to stay within their caps.
    pub evictions: Evictions,
    pub kernel_frames: u64,
    pub managed_frames: u64,
    pub native_frames: u64,
    /// Frames in a known file without a symbol (`libcoreclr.so+0x1234`).
    pub unnamed_frames: u64,
    pub unknown_frames: u64,
    pub truncated_stacks: u64,
    pub perf_maps_enabled: usize,
    pub kernel: KernelCounters,
    pub bpf_stats: ProgramStats,
    /// Kernel-side user-stack walks ended by each error kind.
    /// Kernel-side unwinding (`--dwarf-unwind`): walks ended early by
    /// kind, table memory, processes indexed.
    pub unwind: Option<UnwindReport>,
    pub command_status: Option<std::process::ExitStatus>,
    pub stopped_by: &'static str,
    pub warnings: Vec<String>,
    /// Exact CLR event counters per process that had an EventPipe session.
    pub clr: Vec<ClrProcessTotals>,
    /// Files written (more than one with `split`).
    pub outputs: Vec<PathBuf>,
    /// Exact off-CPU totals of every thread that blocked, most blocked first.
    pub off_cpu_threads: Vec<OffCpuThread>,
    /// Exited threads beyond the per-thread bound, and their summed totals.
    pub off_cpu_other_threads: (u64, OffCpuThreadTotals),
    /// BPF stats of the `sched_switch` program (every switch on the host).
    pub off_cpu_bpf_stats: ProgramStats,
}

/// What the bounded caches evicted during a recording (the unwind tables'
/// own evictions are in [`UnwindReport`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Evictions {
    /// Times a process's managed symbols were dropped to stay within the
    /// global budget, and the bytes freed.
    pub managed_tables: u64,
    pub managed_bytes: u64,
    /// Native symbol files closed by the open-file bound while still mapped.
    pub native_files: u64,
    /// Cached native frames dropped by the frame-cache bounds.
    pub native_frames: u64,
}

/// One process's exact CLR event totals, for the summary.
#[derive(Clone, Debug)]
pub struct ClrProcessTotals {
    pub pid: u32,
    pub exe_name: Arc<str>,
    pub counters: ClrCounters,
    /// Why the totals miss events (the stream broke), if they do.
    pub incomplete: Option<String>,
}

/// One thread's exact off-CPU totals, for the summary.
#[derive(Clone, Debug, Default)]
pub struct OffCpuThread {
    pub pid: u32,
    pub tid: u32,
    pub thread_name: Arc<str>,
    pub totals: OffCpuThreadTotals,
    /// Off-CPU nanoseconds the profile holds for it (upscaled), and from
    /// how many waits.
    pub recorded_ns: u64,
    pub recorded: u64,
}

/// Adds the intervals of the threads still blocked at the end, which no
/// switch-in measured, to the exact totals.
pub(crate) fn add_still_blocked(
    totals: &mut Vec<(u32, OffCpuThreadTotals)>,
    blocked: &[RawSample],
) {
    for sample in blocked {
        let interval = sample.off_cpu.as_ref().map_or(0, |o| o.interval_ns);
        let at = match totals.iter().position(|(tid, _)| *tid == sample.tid) {
            Some(at) => at,
            None => {
                totals.push((
                    sample.tid,
                    OffCpuThreadTotals {
                        pid: sample.pid,
                        ..Default::default()
                    },
                ));
                totals.len() - 1
            }
        };
        let t = &mut totals[at].1;
        t.blocked_ns += interval;
        t.intervals += 1;
    }
}

/// The totals as summary rows, most blocked first, with what the profile
/// holds of each thread (`recorded`).
pub(crate) fn off_cpu_threads(
    totals: Vec<(u32, OffCpuThreadTotals)>,
    names: &HashMap<u32, Arc<str>>,
    recorded: &HashMap<u32, (u64, u64)>,
) -> Vec<OffCpuThread> {
    let mut rows: Vec<OffCpuThread> = totals
        .into_iter()
        .map(|(tid, totals)| {
            let (recorded_ns, recorded) = recorded.get(&tid).copied().unwrap_or_default();
            OffCpuThread {
                pid: totals.pid,
                tid,
                thread_name: names.get(&tid).cloned().unwrap_or_else(|| "?".into()),
                totals,
                recorded_ns,
                recorded,
            }
        })
        .collect();
    rows.sort_by_key(|t| std::cmp::Reverse(t.totals.blocked_ns));
    rows
}

/// Threads listed by name in the off-CPU part of the summary.
const OFF_CPU_SUMMARY_THREADS: usize = 10;

/// The off-CPU headline: exact totals against what the profile holds.
fn off_cpu_summary(summary: &RecordSummary) -> Option<String> {
    let k = &summary.kernel;
    if k.off_cpu_blocked == 0 && summary.off_cpu_threads.is_empty() {
        return None;
    }
    let (other_threads, others) = summary.off_cpu_other_threads;
    let sum = |f: fn(&OffCpuThread) -> u64| -> u64 { summary.off_cpu_threads.iter().map(f).sum() };
    let blocked = sum(|t| t.totals.blocked_ns) + others.blocked_ns;
    let recorded = sum(|t| t.recorded_ns);
    let stats = &summary.off_cpu_bpf_stats;
    let per_switch = if stats.run_count > 0 {
        format!(
            ", sched_switch BPF {:.2} us per switch over {} switches",
            stats.run_time_ns as f64 / stats.run_count as f64 / 1000.0,
            stats.run_count
        )
    } else {
        String::new()
    };
    Some(format!(
        "clrbpf: off-CPU: {:.1} ms blocked (exact) in {} waits of {} threads; the profile holds {:.1} ms ({:+.1}%) from {} kept waits; {} stacks skipped by the rate limit, {} lost to a full ring, {} not tracked (pending map full), {} wakers recorded{per_switch}",
        blocked as f64 / 1e6,
        sum(|t| t.totals.intervals) + others.intervals,
        summary.off_cpu_threads.len() as u64 + other_threads,
        recorded as f64 / 1e6,
        if blocked == 0 {
            0.0
        } else {
            100.0 * (recorded as f64 - blocked as f64) / blocked as f64
        },
        sum(|t| t.recorded),
        k.off_cpu_stacks_skipped,
        sum(|t| t.totals.lost) + others.lost,
        k.off_cpu_pending_full,
        k.off_cpu_wakers,
    ))
}

/// "exited with status 1", "was killed by signal 15 (SIGTERM)".
fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => {
            // SAFETY: strsignal returns a pointer to a static or
            // thread-local string, read at once.
            let name = unsafe {
                let text = libc::strsignal(signal);
                (!text.is_null()).then(|| {
                    std::ffi::CStr::from_ptr(text)
                        .to_string_lossy()
                        .into_owned()
                })
            };
            match name {
                Some(name) => format!("was killed by signal {signal} ({name})"),
                None => format!("was killed by signal {signal}"),
            }
        }
        (None, None) => "ended".to_owned(),
    }
}

/// The end-of-recording summary, for a person.
pub fn print_summary(
    summary: &RecordSummary,
    output: &Path,
    mut w: impl std::io::Write,
) -> std::io::Result<()> {
    let user_frames = summary.managed_frames
        + summary.native_frames
        + summary.unnamed_frames
        + summary.unknown_frames;
    let share = |n: u64| {
        if user_frames == 0 {
            0.0
        } else {
            100.0 * n as f64 / user_frames as f64
        }
    };
    writeln!(
        w,
        "clrbpf: recorded {:.1} s ({}), {} samples from {} processes, {} lost, written to {}",
        summary.duration.as_secs_f64(),
        summary.stopped_by,
        summary.samples,
        summary.processes,
        summary.samples_lost,
        output.display()
    )?;
    writeln!(
        w,
        "clrbpf: user frames: {:.1}% managed, {:.1}% native named, {:.1}% native without symbols (file+offset), {:.1}% unknown ({} frames); {} kernel frames",
        share(summary.managed_frames),
        share(summary.native_frames),
        share(summary.unnamed_frames),
        share(summary.unknown_frames),
        user_frames,
        summary.kernel_frames
    )?;
    if summary.processes_exited > 0 {
        writeln!(
            w,
            "clrbpf: {} processes exited during the recording; their symbols, files and sessions were released then",
            summary.processes_exited
        )?;
    }
    let unwind_evicted = summary
        .unwind
        .as_ref()
        .map_or(0, |u| u.stats.tables_evicted);
    let e = summary.evictions;
    let evicted = unwind_evicted + e.managed_tables + e.native_files + e.native_frames;
    if evicted > 0 || summary.processes_exited > 0 {
        writeln!(
            w,
            "clrbpf: caches stayed within their caps by evicting {unwind_evicted} unwind tables, {} processes' managed symbols ({:.1} MiB), {} native symbol files, {} cached native frames",
            e.managed_tables,
            e.managed_bytes as f64 / 1048576.0,
            e.native_files,
            e.native_frames
        )?;
    }
    if summary.truncated_stacks > 0 || summary.malformed_records > 0 {
        writeln!(
            w,
            "clrbpf: {} stacks deeper than the limit (marked [truncated]), {} malformed records",
            summary.truncated_stacks, summary.malformed_records
        )?;
    }
    if let Some(status) = summary.command_status {
        writeln!(w, "clrbpf: the command {}", describe_exit(status))?;
    }
    if summary.perf_maps_enabled > 0 {
        writeln!(
            w,
            "clrbpf: turned perf maps on and off again in {} running .NET processes",
            summary.perf_maps_enabled
        )?;
    }
    for totals in &summary.clr {
        let ClrProcessTotals {
            pid,
            exe_name,
            counters,
            incomplete,
        } = totals;
        let incomplete = incomplete
            .as_ref()
            .map_or(String::new(), |why| format!(" (incomplete: {why})"));
        let budget = if counters.exception_backoffs > 0 {
            format!(
                " ({} of them counted while their events were off over the budget, {} times)",
                counters.exceptions_without_event, counters.exception_backoffs
            )
        } else {
            String::new()
        };
        writeln!(
            w,
            "clrbpf: pid {pid} ({exe_name}): {} exceptions thrown{budget}, {} contentions, {:.1} ms contention time{incomplete}",
            counters.exceptions,
            counters.contentions,
            counters.contention_ns as f64 / 1e6
        )?;
    }
    if summary.outputs.len() > 1 {
        for path in &summary.outputs {
            writeln!(w, "clrbpf: wrote {}", path.display())?;
        }
    }
    if let Some(line) = off_cpu_summary(summary) {
        writeln!(w, "{line}")?;
        for t in summary.off_cpu_threads.iter().take(OFF_CPU_SUMMARY_THREADS) {
            writeln!(
                w,
                "clrbpf:   tid {} ({}, pid {}): {:.1} ms off-CPU in {} waits; the profile holds {:.1} ms from {} of them",
                t.tid,
                t.thread_name,
                t.pid,
                t.totals.blocked_ns as f64 / 1e6,
                t.totals.intervals,
                t.recorded_ns as f64 / 1e6,
                t.recorded
            )?;
        }
        if summary.off_cpu_threads.len() > OFF_CPU_SUMMARY_THREADS {
            writeln!(
                w,
                "clrbpf:   ... and {} more threads",
                summary.off_cpu_threads.len() - OFF_CPU_SUMMARY_THREADS
            )?;
        }
    }
    if summary.bpf_stats.run_count > 0 {
        writeln!(
            w,
            "clrbpf: BPF time per sample {:.2} us",
            summary.bpf_stats.run_time_ns as f64 / summary.bpf_stats.run_count as f64 / 1000.0
        )?;
    }
    if let Some(unwind) = &summary.unwind {
        let errors: Vec<String> = unwind
            .errors
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(e, n)| format!("{} {n}", e.name()))
            .collect();
        let memory = &unwind.memory;
        writeln!(
            w,
            "clrbpf: unwind tables {:.1} MiB in {} files, {} processes indexed ({:.1} MiB allocated, cap {:.0} MiB); {} user stacks walked with them, {} by frame pointers (process not indexed yet); walks ended early: {}",
            memory.table_bytes as f64 / 1048576.0,
            memory.tables,
            unwind.stats.processes_indexed,
            memory.allocated_bytes as f64 / 1048576.0,
            memory.capacity_bytes as f64 / 1048576.0,
            summary.kernel.user_stacks_unwound,
            summary.kernel.unwind_process_unknown,
            if errors.is_empty() {
                "none".to_owned()
            } else {
                errors.join(", ")
            }
        )?;
        let s = &unwind.stats;
        if s.jit_methods > 0 {
            writeln!(
                w,
                "clrbpf: JIT-compiled methods: {} prologues decoded, {} without an rbp frame given rows ({} OSR methods, through their tier-0 frame), {} unrecognised and {} unread (walked by frame pointer)",
                s.jit_methods, s.jit_frameless, s.jit_osr, s.jit_unrecognised, s.jit_not_decoded
            )?;
        }
    }
    for warning in &summary.warnings {
        writeln!(w, "clrbpf: warning: {warning}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::OffCpuDetail;

    fn blocked(pid: u32, tid: u32, interval_ns: u64) -> RawSample {
        RawSample {
            time_ns: 0,
            pid,
            tid,
            cpu: 0,
            kind: clrbpf_common::SampleKind::OffCpu,
            value: interval_ns,
            thread_name: "t".into(),
            kernel_stack: Vec::new(),
            user_stack: Vec::new(),
            kernel_stack_truncated: false,
            user_stack_truncated: false,
            off_cpu: Some(OffCpuDetail {
                interval_ns,
                syscall: Some(202),
                woken_tid: 0,
                waker: None,
                waker_kernel_stack: Vec::new(),
                stack_not_taken: false,
            }),
        }
    }

    #[test]
    fn still_blocked_threads_join_the_exact_totals() {
        let mut totals = vec![(
            7,
            OffCpuThreadTotals {
                blocked_ns: 1_000,
                intervals: 3,
                pid: 5,
                ..Default::default()
            },
        )];
        add_still_blocked(&mut totals, &[blocked(5, 7, 500), blocked(5, 8, 40)]);
        assert_eq!(totals.len(), 2);
        assert_eq!(totals[0].1.blocked_ns, 1_500);
        assert_eq!(totals[0].1.intervals, 4);
        assert_eq!(totals[1].0, 8);
        assert_eq!(totals[1].1.pid, 5);
        assert_eq!(totals[1].1.blocked_ns, 40);
        let rows = off_cpu_threads(
            totals,
            &HashMap::from([(8, Arc::from("Worker"))]),
            &HashMap::from([(7, (2_000, 2))]),
        );
        assert_eq!(rows[0].recorded_ns, 2_000, "the profile's figure");
        assert_eq!(rows[0].recorded, 2);
        assert_eq!(rows[1].recorded_ns, 0);
        assert_eq!(rows[0].tid, 7, "most blocked first");
        assert_eq!(&*rows[1].thread_name, "Worker");
    }
}
