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
    bpf::{KernelCounters, ProgramStats, StackCopyStats, UnwindReport},
    clr::intake::ClrCounters,
    profile::RawSample,
};

/// What naming native frames found of debug files.
#[derive(Clone, Debug, Default)]
pub struct DebugFileSummary {
    pub found: u64,
    pub frames_named: u64,
    /// Candidates whose build id was another file's.
    pub wrong_build_id: u64,
    /// (path, build id) of files no place had a debug file for.
    pub missing: Vec<(Arc<str>, String)>,
    pub missing_count: u64,
    pub downloads: Option<crate::symbolize::symbol_server::DownloadStats>,
}

/// What one recording collected, for the summary line and for tests.
#[derive(Clone, Debug, Default)]
pub struct RecordSummary {
    pub duration: Duration,
    pub samples: u64,
    /// Of `samples`, those of processes outside the agent's selection,
    /// dropped unnamed ([`super::selection`]).
    pub samples_not_selected: u64,
    pub samples_lost: u64,
    pub malformed_records: u64,
    pub processes: usize,
    /// Processes whose exit the kernel reported during the recording; what
    /// they held was released then.
    pub processes_exited: usize,
    /// Of those, the ones retired because they had vanished from `/proc`
    /// (their exit event lost, or a late sample tracked them again).
    pub processes_vanished: usize,
    /// What the bounded caches let go of to stay within their caps.
    pub evictions: Evictions,
    /// What targets' input would have grown past the memory budget,
    /// dropped ([`crate::memory_budget`]).
    pub over_budget: crate::memory_budget::DropCounts,
    /// Lookups and scans of runtimes' memory the naming budgets refused
    /// ([`crate::clr::memory::budget`]).
    pub memory_naming: crate::clr::memory::budget::NamingBudgetSnapshot,
    /// CPU stacks the end of the recording had no time to name.
    pub not_named_in_time: NotNamedInTime,
    /// The time naming CPU stacks took, before and at the end.
    pub naming: NamingTime,
    pub kernel_frames: u64,
    pub managed_frames: u64,
    pub native_frames: u64,
    /// Frames in a known file without a symbol (`[libcoreclr.so]`).
    pub unnamed_frames: u64,
    pub unknown_frames: u64,
    /// `[unknown]` frames past their process's share of distinct addresses
    /// a window, kept as its one `[unknown]` frame without an address
    /// ([`crate::profile::UNKNOWN_FRAMES_PER_PROCESS`]).
    pub unknown_frames_over_share: u64,
    pub truncated_stacks: u64,
    /// Native debug files: found, frames they named, files without one.
    pub debug_files: DebugFileSummary,
    pub perf_maps_enabled: usize,
    /// Which source named how many managed frames, per .NET process (the
    /// processes with the most named frames, at most
    /// [`MAX_NAME_SOURCE_LINES`]), and for all of them.
    pub name_sources: Vec<(u32, crate::clr::name_sources::NameSourceCounts)>,
    pub name_sources_total: crate::clr::name_sources::NameSourceCounts,
    pub kernel: KernelCounters,
    pub bpf_stats: ProgramStats,
    /// Kernel-side user-stack walks ended by each error kind.
    /// Kernel-side unwinding (`--dwarf-unwind`): walks ended early by
    /// kind, table memory, processes indexed.
    pub unwind: Option<UnwindReport>,
    /// What became of the user stacks copied while their processes had no
    /// unwind tables (known even when the unwind thread was busy at the
    /// end and gave no report).
    pub stack_copies: StackCopyStats,
    pub command_status: Option<std::process::ExitStatus>,
    pub stopped_by: &'static str,
    pub warnings: Warnings,
    /// Exact CLR event counters of the processes that had an EventPipe
    /// session (the busiest ones one by one).
    pub clr: ClrTotals,
    /// Files written (more than one with `split`).
    pub outputs: Vec<PathBuf>,
    /// Exact off-CPU totals of every thread that blocked, most blocked first.
    pub off_cpu_threads: Vec<OffCpuThread>,
    /// Exited threads beyond the per-thread bound, and their summed totals.
    pub off_cpu_other_threads: (u64, OffCpuThreadTotals),
    /// BPF stats of the `sched_switch` program (every switch on the host).
    pub off_cpu_bpf_stats: ProgramStats,
    /// The unwind tables loaded before sampling started (`None`: frame
    /// pointers only).
    pub tables_at_start: Option<super::start_tables::TablesAtStart>,
    /// How long after `record` started its first sample was taken.
    pub first_sample_after: Option<Duration>,
}

/// CPU stacks the end of a recording had no time to name
/// ([`super::Pipeline::process_all`]): kept, with their labels and values,
/// under one frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NotNamedInTime {
    pub stacks: u64,
    pub samples: u64,
    /// The time the end's naming had.
    pub limit: Duration,
    /// A second stop request ended it before that.
    pub hurried: bool,
}

/// The time spent naming CPU stacks (symbol tables, debug files, perf
/// maps, the runtime's images and memory), in the loop's thread: what
/// `cargo xtask bench`'s `naming` part reports of `record -a`'s end and of
/// the agent's windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NamingTime {
    /// Distinct raw CPU stacks named (once per window), early or at its end.
    pub stacks: u64,
    /// Naming while recording: the stacks of native processes named
    /// early, and every window's end (the agent's, `record --split`'s).
    pub before_end: Duration,
    /// The end of a recording: the perf maps read once more, the samples
    /// held back and every stack of the last window named.
    pub end: Duration,
}

/// .NET processes whose name sources the summary shows one by one.
pub const MAX_NAME_SOURCE_LINES: usize = 8;

impl RecordSummary {
    /// Adds the name sources of a .NET process at its release.
    pub fn add_name_sources(
        &mut self,
        pid: u32,
        counts: crate::clr::name_sources::NameSourceCounts,
    ) {
        if counts.total() == 0 {
            return;
        }
        self.name_sources_total.add(counts);
        self.name_sources.push((pid, counts));
        self.name_sources
            .sort_by_key(|(pid, c)| (std::cmp::Reverse(c.total()), *pid));
        self.name_sources.truncate(MAX_NAME_SOURCE_LINES);
    }
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
    /// The ReadyToRun code the processes' jitdumps share, and what was
    /// kept per process (tables full, or an entry disagreeing).
    pub shared_image_code: crate::symbolize::managed::SharedImageCodeStats,
}

/// Warnings for the summary, bounded: a host that starts a .NET process
/// every few seconds would otherwise hold (and print) one "pid N: ..." line
/// per process for as long as the recording runs. Warnings that differ
/// only in their pid are one entry, with the first few pids and a count.
#[derive(Clone, Debug, Default)]
pub struct Warnings {
    kinds: Vec<WarningKind>,
    /// Warnings past [`MAX_WARNING_KINDS`] distinct texts.
    dropped: u64,
}

#[derive(Clone, Debug)]
struct WarningKind {
    /// The text after its `pid N: ` prefix, or all of it.
    text: String,
    /// The first pids it was given for.
    pids: Vec<u32>,
    count: u64,
}

/// Distinct warning texts kept.
const MAX_WARNING_KINDS: usize = 64;
/// Pids named per warning text.
const PIDS_PER_WARNING: usize = 5;

impl Warnings {
    pub fn push(&mut self, warning: String) {
        let (pid, text) = match warning
            .strip_prefix("pid ")
            .and_then(|rest| rest.split_once(": "))
            .and_then(|(pid, text)| Some((pid.parse::<u32>().ok()?, text)))
        {
            Some((pid, text)) => (Some(pid), text),
            None => (None, warning.as_str()),
        };
        if let Some(kind) = self.kinds.iter_mut().find(|k| k.text == text) {
            kind.count += 1;
            if kind.pids.len() < PIDS_PER_WARNING {
                kind.pids.extend(pid);
            }
            return;
        }
        if self.kinds.len() >= MAX_WARNING_KINDS {
            self.dropped += 1;
            return;
        }
        self.kinds.push(WarningKind {
            text: text.to_owned(),
            pids: pid.into_iter().collect(),
            count: 1,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Moves `other`'s warnings after these.
    pub fn append(&mut self, other: &mut Warnings) {
        let other = std::mem::take(other);
        for kind in other.kinds {
            // Re-pushed one pid at a time would lose the count of those
            // past the first few.
            if let Some(mine) = self.kinds.iter_mut().find(|k| k.text == kind.text) {
                mine.count += kind.count;
                let room = PIDS_PER_WARNING.saturating_sub(mine.pids.len());
                mine.pids.extend(kind.pids.into_iter().take(room));
            } else if self.kinds.len() < MAX_WARNING_KINDS {
                self.kinds.push(kind);
            } else {
                self.dropped += kind.count;
            }
        }
        self.dropped += other.dropped;
    }

    /// One line per distinct warning, without the `clrbpf: warning: `
    /// prefix.
    pub fn lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .kinds
            .iter()
            .map(|kind| {
                let more = kind.count.saturating_sub(kind.pids.len() as u64);
                match kind.pids.as_slice() {
                    [] => kind.text.clone(),
                    [pid] if more == 0 => format!("pid {pid}: {}", kind.text),
                    pids => {
                        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
                        let more = if more > 0 {
                            format!(" and {more} more")
                        } else {
                            String::new()
                        };
                        format!("pids {}{more}: {}", pids.join(", "), kind.text)
                    }
                }
            })
            .collect();
        if self.dropped > 0 {
            lines.push(format!(
                "{} more warnings of other kinds (only {MAX_WARNING_KINDS} kinds are kept)",
                self.dropped
            ));
        }
        lines
    }
}

impl Extend<String> for Warnings {
    fn extend<I: IntoIterator<Item = String>>(&mut self, warnings: I) {
        for warning in warnings {
            self.push(warning);
        }
    }
}

impl From<Vec<String>> for Warnings {
    fn from(warnings: Vec<String>) -> Self {
        let mut all = Self::default();
        all.extend(warnings);
        all
    }
}

/// The CLR totals of the processes that had an EventPipe session: the
/// [`CLR_PROCESSES_LISTED`] busiest one by one, the others summed (a long
/// recording on a busy host sees thousands of .NET processes).
#[derive(Clone, Debug, Default)]
pub struct ClrTotals {
    pub listed: Vec<ClrProcessTotals>,
    /// The processes not listed, and their summed counters.
    pub others: u64,
    pub others_counters: ClrCounters,
    pub others_incomplete: u64,
}

/// Processes whose CLR totals the summary lists one by one.
pub const CLR_PROCESSES_LISTED: usize = 20;

impl ClrTotals {
    pub fn push(&mut self, totals: ClrProcessTotals) {
        self.listed.push(totals);
        if self.listed.len() <= CLR_PROCESSES_LISTED {
            return;
        }
        let activity = |t: &ClrProcessTotals| t.counters.exceptions + t.counters.contentions;
        let Some((quietest, _)) = self
            .listed
            .iter()
            .enumerate()
            .min_by_key(|(i, t)| (activity(t), std::cmp::Reverse(*i)))
        else {
            return;
        };
        let folded = self.listed.remove(quietest);
        self.others += 1;
        self.others_incomplete += u64::from(folded.incomplete.is_some());
        self.others_counters.add(&folded.counters);
    }

    /// Every process's totals, listed or not.
    pub fn all_counters(&self) -> ClrCounters {
        let mut all = self.others_counters;
        for totals in &self.listed {
            all.add(&totals.counters);
        }
        all
    }
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

/// The off-CPU headline: exact totals against what the profile holds;
/// with `verbose`, the cost of the `sched_switch` program too.
fn off_cpu_summary(summary: &RecordSummary, verbose: bool) -> Option<String> {
    let k = &summary.kernel;
    if k.off_cpu_blocked == 0 && summary.off_cpu_threads.is_empty() {
        return None;
    }
    let (other_threads, others) = summary.off_cpu_other_threads;
    let sum = |f: fn(&OffCpuThread) -> u64| -> u64 { summary.off_cpu_threads.iter().map(f).sum() };
    let blocked = sum(|t| t.totals.blocked_ns) + others.blocked_ns;
    let recorded = sum(|t| t.recorded_ns);
    let stats = &summary.off_cpu_bpf_stats;
    let per_switch = if verbose && stats.run_count > 0 {
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

/// The end-of-recording summary, for a person: what was recorded, what
/// was lost or left unnamed and why, the CLR and off-CPU totals, the
/// command's end and the warnings. With `verbose` (`-v`), clrbpf's own
/// figures too: BPF time, unwind tables and caches.
pub fn print_summary(
    summary: &RecordSummary,
    output: &Path,
    verbose: bool,
    mut w: impl std::io::Write,
) -> std::io::Result<()> {
    print_recorded(summary, output, &mut w)?;
    print_lost(summary, &mut w)?;
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
    print_clr_totals(&summary.clr, &mut w)?;
    print_refused_files(&mut w)?;
    if summary.outputs.len() > 1 {
        for path in &summary.outputs {
            writeln!(w, "clrbpf: wrote {}", path.display())?;
        }
    }
    print_off_cpu(summary, verbose, &mut w)?;
    if verbose {
        print_internals(summary, &mut w)?;
    }
    for warning in summary.warnings.lines() {
        writeln!(w, "clrbpf: warning: {warning}")?;
    }
    Ok(())
}

/// The targets' files refused as hostile: a device, FIFO or directory
/// where a mapped file should be, a path swapped since the mapping
/// ([`crate::process::mapped_file`]), a `libcoreclr.so` built to cost its
/// reader ([`crate::clr::memory::runtime_image`]). Counted since start.
fn print_refused_files(w: &mut impl std::io::Write) -> std::io::Result<()> {
    let files = crate::process::mapped_file::counts();
    let images = crate::clr::memory::runtime_image::refused_images();
    if files.not_regular + files.replaced + images == 0 {
        return Ok(());
    }
    writeln!(
        w,
        "clrbpf: target files refused: {} not regular files, {} swapped since they were mapped, {} libcoreclr.so over their caps or sparse",
        files.not_regular, files.replaced, images
    )
}

/// What was recorded: the span, samples and processes, and how the
/// frames of the stacks were named.
fn print_recorded(
    summary: &RecordSummary,
    output: &Path,
    w: &mut impl std::io::Write,
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
    if summary.unknown_frames_over_share > 0 {
        writeln!(
            w,
            "clrbpf: {} unknown frames past their process's share of {} distinct addresses a window, kept as one [unknown] frame",
            summary.unknown_frames_over_share,
            crate::profile::UNKNOWN_FRAMES_PER_PROCESS
        )?;
    }
    write_debug_files(w, &summary.debug_files)?;
    for (pid, counts) in &summary.name_sources {
        writeln!(w, "clrbpf: pid {pid}: managed frames named: {counts}")?;
    }
    let shown: u64 = summary.name_sources.iter().map(|(_, c)| c.total()).sum();
    if shown < summary.name_sources_total.total() {
        writeln!(
            w,
            "clrbpf: all .NET processes: managed frames named: {}",
            summary.name_sources_total
        )?;
    }
    if summary.processes_exited > 0 {
        let vanished = match summary.processes_vanished {
            0 => String::new(),
            n => format!(" ({n} of them found gone without their exit event)"),
        };
        writeln!(
            w,
            "clrbpf: {} processes exited during the recording{vanished}; their symbols, files and sessions were released then",
            summary.processes_exited
        )?;
    }
    Ok(())
}

/// What the profile misses, and why: samples the kernel could not hand
/// over, input over the memory budget, stacks cut short.
fn print_lost(summary: &RecordSummary, w: &mut impl std::io::Write) -> std::io::Result<()> {
    if summary.samples_lost > 0 {
        writeln!(
            w,
            "clrbpf: {} samples lost: the ring the kernel writes them to was full (clrbpf fell behind: a saturated host, or a high -F)",
            summary.samples_lost
        )?;
    }
    if summary.kernel.process_events_lost > 0 {
        writeln!(
            w,
            "clrbpf: {} process exits and execs lost to the same full ring ({} processes ended without their exit event)",
            summary.kernel.process_events_lost, summary.processes_vanished
        )?;
    }
    let d = summary.over_budget;
    if d.any() {
        writeln!(
            w,
            "clrbpf: over the {} MiB memory budget, dropped: {} mappings ({} maps files read in part), {} files over the read share for one file, for unwind tables or images ({:.1} MiB), {} managed symbols, {} EventPipe metadata records, {} early stack-cache resets, {} .NET sessions, {} memory-path names not cached, {} images refused",
            crate::memory_budget::current().total_bytes >> 20,
            d.mappings,
            d.maps_files_truncated,
            d.files,
            d.file_bytes as f64 / 1048576.0,
            d.managed_symbols,
            d.nettrace_metadata,
            d.nettrace_stack_resets,
            d.sessions,
            d.memory_names,
            d.images
        )?;
    }
    print_memory_naming(&summary.memory_naming, w)?;
    print_not_named_in_time(&summary.not_named_in_time, w)?;
    if summary.truncated_stacks > 0 || summary.malformed_records > 0 {
        writeln!(
            w,
            "clrbpf: {} stacks deeper than the limit (marked [truncated]), {} malformed records",
            summary.truncated_stacks, summary.malformed_records
        )?;
    }
    Ok(())
}

/// What naming frames from runtimes' memory was refused to stay within its
/// budgets: frames left unnamed, no sample lost.
fn print_memory_naming(
    n: &crate::clr::memory::budget::NamingBudgetSnapshot,
    w: &mut impl std::io::Write,
) -> std::io::Result<()> {
    if !n.any() {
        return Ok(());
    }
    writeln!(
        w,
        "clrbpf: naming from runtime memory over budget, lookups not made (frames left unnamed, samples kept): {} over a process's budget for the window, {} where a lookup had just failed, {} of processes put aside ({} times a process was: its lookups all failed); code heap scans: {} put off, {} cut short",
        n.over_budget,
        n.known_bad,
        n.put_aside,
        n.processes_put_aside,
        n.scans_deferred,
        n.scans_cut_short
    )
}

/// The CPU stacks the end of the recording had no time to name.
fn print_not_named_in_time(n: &NotNamedInTime, w: &mut impl std::io::Write) -> std::io::Result<()> {
    if n.stacks == 0 {
        return Ok(());
    }
    let why = if n.hurried {
        "a second stop request ended the naming".to_owned()
    } else {
        format!(
            "the end's naming has {:.1} s, the heaviest stacks of each process first",
            n.limit.as_secs_f64()
        )
    };
    writeln!(
        w,
        "clrbpf: {} samples of {} CPU stacks not named in time ({why}): kept with their labels under {}",
        n.samples,
        n.stacks,
        super::NOT_NAMED_IN_TIME
    )
}

/// The exact CLR event totals: the busiest processes one by one, the
/// others summed.
fn print_clr_totals(clr: &ClrTotals, w: &mut impl std::io::Write) -> std::io::Result<()> {
    for totals in &clr.listed {
        let ClrProcessTotals {
            pid,
            exe_name,
            counters,
            incomplete,
        } = totals;
        let incomplete = incomplete
            .as_ref()
            .map_or(String::new(), |why| format!(" (incomplete: {why})"));
        let budget = exception_budget(counters);
        writeln!(
            w,
            "clrbpf: pid {pid} ({exe_name}): {} exceptions thrown{budget}, {} contentions, {:.1} ms contention time{}{}{incomplete}",
            counters.exceptions,
            counters.contentions,
            counters.contention_ns as f64 / 1e6,
            wait_totals(counters),
            allocation_totals(counters)
        )?;
    }
    if clr.others > 0 {
        let counters = &clr.others_counters;
        let incomplete = match clr.others_incomplete {
            0 => String::new(),
            n => format!(" ({n} of them incomplete: their event stream broke)"),
        };
        writeln!(
            w,
            "clrbpf: {} more .NET processes: {} exceptions thrown, {} contentions, {:.1} ms contention time{}{incomplete}",
            clr.others,
            counters.exceptions,
            counters.contentions,
            counters.contention_ns as f64 / 1e6,
            wait_totals(counters)
        )?;
    }
    Ok(())
}

/// The off-CPU totals, and the most blocked threads.
fn print_off_cpu(
    summary: &RecordSummary,
    verbose: bool,
    w: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let Some(line) = off_cpu_summary(summary, verbose) else {
        return Ok(());
    };
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
    Ok(())
}

/// clrbpf's own figures (`-v`): its caches' evictions, BPF time per
/// sample, the unwind tables, their cache between runs, and the JIT code
/// given unwind rows.
fn print_internals(summary: &RecordSummary, w: &mut impl std::io::Write) -> std::io::Result<()> {
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
    let shared = e.shared_image_code;
    if shared.entries > 0 || shared.tables_freed > 0 {
        writeln!(
            w,
            "clrbpf: ReadyToRun code named once for every process: {} entries of {} images ({:.1} MiB, at most {:.0} MiB), {} images freed with their last process; {} entries kept per process (tables full), {} (another name at their place)",
            shared.entries,
            shared.tables,
            shared.bytes as f64 / 1048576.0,
            shared.limit_bytes as f64 / 1048576.0,
            shared.tables_freed,
            shared.refused_full,
            shared.conflicts
        )?;
    }
    let naming = summary.naming;
    if naming.stacks > 0 {
        writeln!(
            w,
            "clrbpf: naming {} distinct CPU stacks took {:.3} s at the end and {:.3} s before",
            naming.stacks,
            naming.end.as_secs_f64(),
            naming.before_end.as_secs_f64()
        )?;
    }
    if summary.bpf_stats.run_count > 0 {
        writeln!(
            w,
            "clrbpf: BPF time per sample {:.2} us",
            summary.bpf_stats.run_time_ns as f64 / summary.bpf_stats.run_count as f64 / 1000.0
        )?;
    }
    let tables = summary
        .tables_at_start
        .as_ref()
        .and_then(|t| t.summary_line());
    let first = summary
        .first_sample_after
        .map(|d| format!("first sample {:.2} s after the start", d.as_secs_f64()));
    let start: Vec<String> = tables.into_iter().chain(first).collect();
    if !start.is_empty() {
        writeln!(w, "clrbpf: {}", start.join("; "))?;
    }
    if let Some(unwind) = &summary.unwind {
        print_unwind(summary, unwind, w)?;
    }
    write_stack_copies(summary, w)?;
    Ok(())
}

/// The unwind tables: their size, the stacks walked with them, the walks
/// ended early, their cache between runs, the JIT code given rows.
fn print_unwind(
    summary: &RecordSummary,
    unwind: &UnwindReport,
    w: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let errors: Vec<String> = unwind
        .errors
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(e, n)| format!("{} {n}", e.name()))
        .collect();
    let memory = &unwind.memory;
    writeln!(
        w,
        "clrbpf: unwind tables {:.1} MiB in {} files, {} processes indexed ({:.1} MiB allocated, cap {:.0} MiB); {} user stacks walked with them, {} by frame pointers (process not indexed yet){}; walks ended early: {}",
        memory.table_bytes as f64 / 1048576.0,
        memory.tables,
        unwind.stats.processes_indexed,
        memory.allocated_bytes as f64 / 1048576.0,
        memory.capacity_bytes as f64 / 1048576.0,
        summary.kernel.user_stacks_unwound,
        // Copied stacks unwound later count as walked with the tables.
        summary
            .kernel
            .unwind_process_unknown
            .saturating_sub(summary.stack_copies.unwound),
        match summary.kernel.waker_process_unknown {
            0 => String::new(),
            n => format!(", {n} wakers' stacks in processes without tables"),
        },
        if errors.is_empty() {
            "none".to_owned()
        } else {
            errors.join(", ")
        }
    )?;
    if let Some(disk) = unwind.disk_cache
        && disk.hits + disk.misses > 0
    {
        writeln!(
            w,
            "clrbpf: unwind tables kept between runs (--cache-dir): {} read, {} built and written{}",
            disk.hits,
            disk.written,
            if disk.rejected > 0 {
                format!(", {} stale or damaged entries replaced", disk.rejected)
            } else {
                String::new()
            }
        )?;
    }
    write_new_processes(&unwind.new_processes, w)?;
    let s = &unwind.stats;
    if s.jit_methods > 0 {
        writeln!(
            w,
            "clrbpf: JIT-compiled methods: {} prologues decoded, {} without an rbp frame given rows ({} OSR methods, through their tier-0 frame), {} with one given rows for their prologue, {} unrecognised and {} unread (walked by frame pointer)",
            s.jit_methods,
            s.jit_frameless,
            s.jit_osr,
            s.jit_prologues,
            s.jit_unrecognised,
            s.jit_not_decoded
        )?;
    }
    Ok(())
}

/// How long the processes exec'd while recording that ran JIT code (.NET)
/// waited for their unwind tables: one line each (10 at most).
fn write_new_processes(
    times: &[crate::bpf::table_times::ProcessTableTimes],
    w: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let dotnet: Vec<_> = times.iter().filter(|p| p.jit_code_ns.is_some()).collect();
    for p in dotnet.iter().take(10) {
        writeln!(w, "clrbpf: unwind tables of a new process: {}", p.line())?;
    }
    if dotnet.len() > 10 {
        writeln!(
            w,
            "clrbpf: unwind tables of {} more new .NET processes not shown",
            dotnet.len() - 10
        )?;
    }
    Ok(())
}

/// How a process's exceptions were counted when their stacks went off
/// over the budget (` (1200 of them counted from the runtime's counter
/// while their stacks were off over the budget)`); empty when they never
/// did.
fn exception_budget(counters: &ClrCounters) -> String {
    if counters.exception_backoffs == 0 {
        String::new()
    } else if counters.exceptions_counted_by_type {
        format!(
            " (each counted by type; {} with a stack, the others while their stacks were off over the budget)",
            counters.exception_stacks
        )
    } else {
        format!(
            " ({} of them counted from the runtime's counter while their stacks were off over the budget)",
            counters.exceptions_without_event
        )
    }
}

/// The allocation part of a process's CLR line (`, 240.5 MB allocated
/// (2400 allocation events; 120.0 MB counted from the runtime's counter
/// while their events were off over the budget)`); empty without
/// allocation events.
fn allocation_totals(counters: &ClrCounters) -> String {
    let ClrCounters {
        allocation_events,
        allocated_bytes,
        allocated_bytes_without_event,
        allocation_backoffs,
        ..
    } = *counters;
    if allocation_events == 0 && allocated_bytes == 0 {
        return String::new();
    }
    let mb = |bytes: u64| bytes as f64 / 1e6;
    let budget = if allocation_backoffs > 0 {
        format!(
            "; {:.1} MB counted from the runtime's counter while their events were off over the budget",
            mb(allocated_bytes_without_event)
        )
    } else {
        String::new()
    };
    format!(
        ", {:.1} MB allocated ({allocation_events} allocation events{budget})",
        mb(allocated_bytes)
    )
}

/// The wait-handle part of a process's CLR line (`, 3 waits, 250.0 ms
/// waiting (1 stop without a start, 1 unfinished)`); empty when the
/// runtime sent no wait events (before .NET 9, or none asked for).
fn wait_totals(counters: &ClrCounters) -> String {
    let ClrCounters {
        waits,
        wait_ns,
        unpaired_wait_stops,
        unfinished_waits,
        ..
    } = *counters;
    if waits + unpaired_wait_stops + unfinished_waits == 0 {
        return String::new();
    }
    let mut uncounted = Vec::new();
    if unpaired_wait_stops > 0 {
        uncounted.push(format!("{unpaired_wait_stops} stops without a start"));
    }
    if unfinished_waits > 0 {
        uncounted.push(format!("{unfinished_waits} unfinished"));
    }
    let uncounted = if uncounted.is_empty() {
        String::new()
    } else {
        format!(" (not counted: {})", uncounted.join(", "))
    };
    format!(
        ", {waits} waits, {:.1} ms waiting{uncounted}",
        wait_ns as f64 / 1e6
    )
}

/// The summary's line on the user stacks copied while processes had no
/// unwind tables (nothing when none was).
fn write_stack_copies(summary: &RecordSummary, w: &mut impl std::io::Write) -> std::io::Result<()> {
    let kernel = &summary.kernel;
    let copies = &summary.stack_copies;
    if kernel.stack_copies + kernel.stack_copies_over_budget == 0 {
        return Ok(());
    }
    writeln!(
        w,
        "clrbpf: stack copies while processes had no unwind tables: {} ({:.1} MiB, {:.1} KiB each), {} unwound once the tables came ({} still meeting unindexed code), {} kept by frame pointers (no tables in time {}, memory {}); {} samples not copied (over --stack-copy-kib-per-second)",
        kernel.stack_copies,
        kernel.stack_copy_bytes as f64 / 1048576.0,
        kernel.stack_copy_bytes as f64 / 1024.0 / kernel.stack_copies.max(1) as f64,
        copies.unwound,
        copies.unwound_unindexed,
        copies.without_tables + copies.over_memory,
        copies.without_tables,
        copies.over_memory,
        kernel.stack_copies_over_budget,
    )
}

/// The native debug files line: what was found and named, which files
/// (by build id) had none anywhere, what the symbol servers gave.
fn write_debug_files(w: &mut impl std::io::Write, d: &DebugFileSummary) -> std::io::Result<()> {
    if d.found > 0 || d.frames_named > 0 {
        writeln!(
            w,
            "clrbpf: native frames named by debug files: {} (from {} debug files)",
            d.frames_named, d.found
        )?;
    }
    if d.wrong_build_id > 0 {
        writeln!(
            w,
            "clrbpf: {} debug files not used: another build id",
            d.wrong_build_id
        )?;
    }
    if let Some(s) = &d.downloads {
        writeln!(
            w,
            "clrbpf: symbol servers: {} asked, {} downloaded, {} not found, {} refused, {} dropped",
            s.requested, s.downloaded, s.missing, s.refused, s.dropped
        )?;
    }
    if d.missing_count > 0 {
        let listed: Vec<String> = d
            .missing
            .iter()
            .map(|(path, id)| {
                let name = path.rsplit('/').next().unwrap_or(path);
                format!("{name} ({id})")
            })
            .collect();
        writeln!(
            w,
            "clrbpf: no debug file for {} native files (get them with dotnet-symbol, --debug-dir, --symbol-server or DEBUGINFOD_URLS): {}",
            d.missing_count,
            listed.join(", ")
        )?;
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
    fn refused_memory_lookups_are_one_line_only_when_any() {
        use crate::clr::memory::budget::NamingBudgetSnapshot;
        let mut out = Vec::new();
        print_memory_naming(&NamingBudgetSnapshot::default(), &mut out).unwrap();
        assert!(out.is_empty());
        let counts = NamingBudgetSnapshot {
            over_budget: 3,
            known_bad: 40,
            put_aside: 500,
            processes_put_aside: 1,
            scans_deferred: 2,
            scans_cut_short: 0,
        };
        print_memory_naming(&counts, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 1);
        for part in [
            "3 over a process's budget",
            "40 where a lookup had just failed",
            "500 of processes put aside (1 times",
            "2 put off",
        ] {
            assert!(text.contains(part), "{part:?} in {text}");
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

    #[test]
    fn wait_totals_say_what_was_not_counted() {
        let none = ClrCounters::default();
        assert_eq!(wait_totals(&none), "");
        let counters = ClrCounters {
            waits: 3,
            wait_ns: 250_000_000,
            unpaired_wait_stops: 1,
            unfinished_waits: 2,
            ..ClrCounters::default()
        };
        assert_eq!(
            wait_totals(&counters),
            ", 3 waits, 250.0 ms waiting (not counted: 1 stops without a start, 2 unfinished)"
        );
        let clean = ClrCounters {
            waits: 1,
            wait_ns: 1_500_000,
            ..ClrCounters::default()
        };
        assert_eq!(wait_totals(&clean), ", 1 waits, 1.5 ms waiting");
    }

    #[test]
    fn exceptions_over_the_budget_say_where_their_count_came_from() {
        assert_eq!(exception_budget(&ClrCounters::default()), "");
        let counter = ClrCounters {
            exceptions: 16_403,
            exceptions_without_event: 14_351,
            exception_backoffs: 1,
            ..ClrCounters::default()
        };
        assert_eq!(
            exception_budget(&counter),
            " (14351 of them counted from the runtime's counter while their stacks were off over the budget)"
        );
        let by_type = ClrCounters {
            exceptions: 20_501,
            exception_stacks: 201,
            exception_backoffs: 1,
            exceptions_counted_by_type: true,
            ..ClrCounters::default()
        };
        assert_eq!(
            exception_budget(&by_type),
            " (each counted by type; 201 with a stack, the others while their stacks were off over the budget)"
        );
    }

    #[test]
    fn bytes_over_the_budget_say_where_their_count_came_from() {
        assert_eq!(allocation_totals(&ClrCounters::default()), "");
        let within = ClrCounters {
            allocation_events: 2_400,
            allocated_bytes: 240_500_000,
            ..ClrCounters::default()
        };
        assert_eq!(
            allocation_totals(&within),
            ", 240.5 MB allocated (2400 allocation events)"
        );
        let counter = ClrCounters {
            allocated_bytes_without_event: 120_000_000,
            allocation_backoffs: 1,
            ..within
        };
        let line = allocation_totals(&counter);
        assert_eq!(
            line,
            ", 240.5 MB allocated (2400 allocation events; 120.0 MB counted from the runtime's counter while their events were off over the budget)"
        );
        assert!(!line.contains("1 times"), "{line}");
    }

    #[test]
    fn warnings_that_differ_only_in_their_pid_are_one_line() {
        let mut warnings = Warnings::default();
        warnings.push("tracefs is not mounted".to_owned());
        for pid in 100..110 {
            warnings.push(format!("pid {pid}: wait-handle events need .NET 9+"));
        }
        warnings.push("pid 7: its perf map is not readable".to_owned());
        assert_eq!(
            warnings.lines(),
            [
                "tracefs is not mounted",
                "pids 100, 101, 102, 103, 104 and 5 more: wait-handle events need .NET 9+",
                "pid 7: its perf map is not readable",
            ]
        );
    }

    #[test]
    fn warnings_keep_a_bounded_number_of_kinds_and_count_the_rest() {
        let mut warnings = Warnings::default();
        for i in 0..MAX_WARNING_KINDS + 3 {
            warnings.push(format!("pid {i}: problem {i}"));
        }
        let mut later = Warnings::from(vec!["pid 1: problem 1".to_owned(), "new".to_owned()]);
        warnings.append(&mut later);
        let lines = warnings.lines();
        assert_eq!(lines.len(), MAX_WARNING_KINDS + 1);
        assert_eq!(lines[1], "pids 1, 1: problem 1");
        assert_eq!(
            lines[MAX_WARNING_KINDS],
            format!("4 more warnings of other kinds (only {MAX_WARNING_KINDS} kinds are kept)")
        );
        assert!(later.is_empty());
    }

    fn clr_totals(pid: u32, exceptions: u64, incomplete: bool) -> ClrProcessTotals {
        ClrProcessTotals {
            pid,
            exe_name: "dotnet".into(),
            counters: ClrCounters {
                exceptions,
                contentions: 1,
                ..ClrCounters::default()
            },
            incomplete: incomplete.then(|| "broke".to_owned()),
        }
    }

    #[test]
    fn clr_totals_list_the_busiest_processes_and_sum_the_others() {
        let mut totals = ClrTotals::default();
        totals.push(clr_totals(1, 1_000, false));
        for pid in 2..=(CLR_PROCESSES_LISTED as u32 + 5) {
            totals.push(clr_totals(pid, 0, pid == CLR_PROCESSES_LISTED as u32 + 2));
        }
        totals.push(clr_totals(99, 500, false));
        assert_eq!(totals.listed.len(), CLR_PROCESSES_LISTED);
        let listed: Vec<u32> = totals.listed.iter().map(|t| t.pid).collect();
        assert_eq!(listed[..3], [1, 2, 3], "the first quiet ones stay listed");
        assert_eq!(*listed.last().unwrap(), 99, "a busy late process is listed");
        assert_eq!(totals.others, 6);
        assert_eq!(totals.others_counters.contentions, 6);
        assert_eq!(totals.others_incomplete, 1);
        let all = totals.all_counters();
        assert_eq!((all.exceptions, all.contentions), (1_500, 26));
    }
}
