//! `clrbpf record`: wires the stages together for one recording.
//!
//! 1. Check the host ([`crate::bpf::system::prepare`]), load and attach the
//!    kernel side with the chosen target set.
//! 2. Optionally launch the command (as the invoking user, with
//!    `DOTNET_PerfMapEnabled=1`); the kernel side follows its children.
//! 3. Every tick, drain raw samples; learn each new process once (name,
//!    container, mappings, .NET runtime; for a running .NET 8+ process, ask
//!    it for perf maps over its diagnostic socket); symbolize samples a
//!    little after they were taken, so the perf map lines for code JIT-ted
//!    just before a sample have been written; aggregate.
//! 4. On duration, Ctrl-C, SIGTERM, the command's exit or the exit of every
//!    `-p` process: drain what is left, restore the .NET processes, write
//!    the profile, print the summary.

use std::{
    ffi::{CStr, CString, OsString},
    io::{IsTerminal as _, Write as _},
    path::PathBuf,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    bpf::{OffCpuConfig, Sampler, SamplerConfig, UnwindWorker, system},
    clr::session::ClrEventKinds,
    export::{
        frame_names::{FrameNames, apply_frame_names},
        output::{OutputFormat, sudo_owner},
        sink::{FileSink, ProfileSink as _},
    },
    pipeline::{
        Pipeline, WindowSpan, start_tables,
        summary::{RecordSummary, Warnings, add_still_blocked, off_cpu_threads},
    },
    process::ProcFs,
    process::main_module::ApplicationModule,
    profile::layout::ValueLayout,
};

const TICK: Duration = Duration::from_millis(50);
/// After the command exits, keep draining this long for its last samples.
const EXIT_GRACE: Duration = Duration::from_millis(100);

/// Everything `record` needs, already validated.
#[derive(Clone, Debug)]
pub struct RecordConfig {
    pub pids: Vec<u32>,
    pub all: bool,
    pub frequency_hz: u64,
    pub duration: Option<Duration>,
    pub output: PathBuf,
    pub format: OutputFormat,
    /// How managed frames are named in the output.
    pub frame_names: FrameNames,
    pub keep_perf_maps: bool,
    pub perf_map_attach: bool,
    /// Walk user stacks with `.eh_frame` unwind tables in the kernel.
    pub dwarf_unwind: bool,
    /// Kernel memory for unwind tables, allocated in full at load when
    /// [`Self::dwarf_unwind`] is on.
    pub unwind_table_memory_bytes: u64,
    /// Where unwind tables and this boot's kallsyms are kept between
    /// runs (`None`: nowhere).
    pub unwind_cache_dir: Option<PathBuf>,
    pub command: Vec<OsString>,
    /// Progress line and summary on stderr.
    pub verbose: bool,
    /// CLR events collected from .NET processes (none: no EventPipe session).
    pub clr_events: ClrEventKinds,
    /// Exception events with stacks per second and process at most
    /// ([`crate::clr::budget`]); `None`: every one.
    pub exceptions_per_second: Option<u32>,
    /// One output file per kind (`<stem>.cpu.pb.gz`, ...) instead of one.
    pub split: bool,
    /// Off-CPU intervals of the profiled threads, with their wakers.
    pub off_cpu: Option<OffCpuConfig>,
    /// A `wall/nanoseconds` sample type: CPU plus off-CPU time per thread
    /// (needs [`Self::off_cpu`]).
    pub wall: bool,
    /// Raise clrbpf's priority ([`crate::process::priority`]), with this
    /// nice value for its background threads (`None`: leave it).
    pub nice: Option<i32>,
    /// How long the start may wait for the unwind tables of the processes
    /// known then ([`crate::pipeline::start_tables`]).
    pub start_wait: Duration,
}

/// The invoking user under sudo: (uid, gid, name).
fn sudo_user() -> Option<(u32, u32, CString)> {
    let uid = std::env::var("SUDO_UID").ok()?.parse().ok()?;
    let gid = std::env::var("SUDO_GID").ok()?.parse().ok()?;
    let name = CString::new(std::env::var("SUDO_USER").ok()?).ok()?;
    (uid != 0).then_some((uid, gid, name))
}

fn spawn_command(command: &[OsString]) -> anyhow::Result<tokio::process::Child> {
    let (program, args) = command.split_first().context("no command given")?;
    let mut cmd = tokio::process::Command::new(program);
    // .NET 5+ reads DOTNET_ settings; .NET Core 3.x only COMPlus_ ones.
    cmd.args(args)
        .env("DOTNET_PerfMapEnabled", "1")
        .env("COMPlus_PerfMapEnabled", "1")
        .kill_on_drop(false);
    if let Some((uid, gid, name)) = sudo_user() {
        // The groups are looked up now: between fork and exec of a
        // multi-threaded process only async-signal-safe calls are allowed,
        // and initgroups (NSS, locks, malloc) is not; setgroups is.
        let groups = group_list(&name, gid);
        // SAFETY: only async-signal-safe libc calls between fork and exec,
        // on memory allocated before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd.spawn()
        .with_context(|| format!("cannot run {}", program.to_string_lossy()))
}

/// The groups of user `name` with primary group `gid`, as `initgroups`
/// would set them (`getgrouplist`). Only `gid` if the lookup fails.
fn group_list(name: &CStr, gid: u32) -> Vec<libc::gid_t> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    for _ in 0..8 {
        let mut count = libc::c_int::try_from(groups.len()).unwrap_or(libc::c_int::MAX);
        // SAFETY: `name` is NUL-terminated; `groups` has room for `count`
        // entries, and getgrouplist writes at most that many.
        let found =
            unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
        let count = usize::try_from(count).unwrap_or(0);
        if found >= 0 {
            groups.truncate(count);
            return groups;
        }
        // Too small: `count` is the number needed.
        groups.resize(count.max(groups.len() * 2), 0);
    }
    vec![gid]
}

fn process_exists(pid: u32) -> bool {
    ProcFs::default().is_running(pid)
}

/// Runs one recording to its end and writes the output file.
pub async fn record(config: RecordConfig) -> anyhow::Result<RecordSummary> {
    let RecordConfig {
        pids,
        all,
        frequency_hz,
        duration,
        output,
        format,
        frame_names,
        keep_perf_maps,
        perf_map_attach,
        dwarf_unwind,
        unwind_table_memory_bytes,
        unwind_cache_dir,
        command,
        verbose,
        clr_events,
        exceptions_per_second,
        split,
        off_cpu,
        wall,
        nice,
        start_wait,
    } = config;
    let record_started_ns = crate::profile::monotonic_ns();
    if wall && off_cpu.is_none() {
        bail!("--wall needs off-CPU time: add --off-cpu");
    }
    // This thread drains the rings: it must keep up on a saturated host.
    let priority_warning =
        nice.and_then(|nice| crate::process::priority::boost_sampling_thread(nice).err());
    for &pid in &pids {
        if !process_exists(pid) {
            bail!(
                "process {pid} does not exist (not running): check the pid with `ps` or `clrbpf ps`"
            );
        }
    }
    let mut warnings = system::prepare()?;
    warnings.extend(priority_warning);
    let layout = ValueLayout::new(off_cpu.is_some(), wall, clr_events.any());
    // Created now, with their final owner and mode: a bad output path
    // fails here, before anything is recorded.
    let mut sink = FileSink::create(&output, format, split, &layout, sudo_owner())
        .with_context(|| format!("cannot write the profile to {}", output.display()))?;
    let whole_host = all || (pids.is_empty() && command.is_empty());
    let mut initial_targets = pids.clone();
    if !command.is_empty() && !whole_host {
        // The command is forked by this process: following our own forks
        // until the child is in the set means none of its children escape.
        initial_targets.push(std::process::id());
    }
    tracing::debug!("loading the BPF programs");
    let mut sampler = Sampler::load(&SamplerConfig {
        frequency_hz,
        target_pids: (!whole_host).then_some(initial_targets),
        user_unwind: dwarf_unwind,
        unwind_table_memory_bytes,
        unwind_cache_dir: unwind_cache_dir.clone(),
        off_cpu,
        ..SamplerConfig::default()
    })?;
    let mut pipeline = Pipeline::new(perf_map_attach, clr_events, layout.clone());
    pipeline.keep_perf_files = keep_perf_maps;
    pipeline.keep_perf_map_ledger_in(unwind_cache_dir.as_deref());
    pipeline.keep_kernel_symbols_in(unwind_cache_dir);
    pipeline.clr.exceptions_per_second = exceptions_per_second;
    pipeline.unwind = match sampler.take_unwind_maps() {
        Some(maps) => Some(UnwindWorker::spawn(maps).context("start the unwind table thread")?),
        None => None,
    };
    let mut sigint = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let progress = verbose && std::io::stderr().is_terminal();
    // The processes known now get their unwind tables before the first
    // sample: their first stacks are whole.
    let mut stopped_early = None;
    if pipeline.unwind.is_some() {
        let targets = start_tables::start_targets(&ProcFs::default(), &pids, whole_host);
        let stop = async {
            tokio::select! {
                _ = sigint.recv() => "Ctrl-C",
                _ = sigterm.recv() => "SIGTERM",
            }
        };
        let (tables, stopped) =
            start_tables::wait_for_tables(&mut pipeline, targets, start_wait, progress, stop).await;
        tracing::debug!(?tables, "unwind tables at start");
        pipeline.summary.warnings.extend(tables.warning());
        pipeline.summary.tables_at_start = Some(tables);
        stopped_early = stopped;
    }
    sampler.start_sampling()?;
    for &pid in &pids {
        pipeline.track(pid);
    }
    let start_unix_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    let started = Instant::now();
    let start_mono_ns = crate::profile::monotonic_ns();
    tracing::debug!("sampling started");

    let mut child = if command.is_empty() || stopped_early.is_some() {
        None
    } else {
        let child = spawn_command(&command)?;
        if let Some(pid) = child.id()
            && !whole_host
        {
            sampler.add_target(pid)?;
            sampler.remove_target(std::process::id());
        }
        Some(child)
    };
    let app_pid = child
        .as_ref()
        .and_then(|c| c.id())
        .or(pids.first().copied());
    let mut application = ApplicationModule::new(&ProcFs::default(), app_pid);

    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_progress = Instant::now();
    let mut raw = Vec::with_capacity(4096);
    let mut command_exited_at: Option<Instant> = None;

    let ring = sampler.ring_wakeups();
    if let Err(error) = &ring {
        tracing::debug!(%error, "the sample ring cannot be polled: drained on the timer only");
    }
    let stopped_by = loop {
        if let Some(reason) = stopped_early {
            break reason;
        }
        tokio::select! {
            _ = tick.tick() => {}
            () = async { ring.as_ref().expect("guarded").woken().await }, if ring.is_ok() => {}
            _ = sigint.recv() => break "Ctrl-C",
            _ = sigterm.recv() => {
                if let Some(child) = child.as_mut() {
                    // Best effort: the command may have exited already.
                    let _ = child.start_kill();
                }
                break "SIGTERM";
            }
            status = async { child.as_mut().expect("guarded").wait().await }, if child.is_some() && command_exited_at.is_none() => {
                pipeline.summary.command_status = status.ok();
                command_exited_at = Some(Instant::now());
            }
        }
        pipeline.tick(&mut sampler, &mut raw);
        if pipeline.summary.first_sample_after.is_none() {
            // Held back SYMBOLIZE_DELAY before they are added: the first
            // samples are still pending here.
            pipeline.summary.first_sample_after = pipeline
                .pending
                .iter()
                .map(|s| s.time_ns)
                .min()
                .map(|t| Duration::from_nanos(t.saturating_sub(record_started_ns)));
        }
        application.poll(&ProcFs::default());
        if command_exited_at.is_some_and(|t| t.elapsed() >= EXIT_GRACE) {
            break "command exited";
        }
        if duration.is_some_and(|d| started.elapsed() >= d) {
            break "duration";
        }
        if child.is_none() && !pids.is_empty() && !pids.iter().any(|&p| process_exists(p)) {
            break "processes exited";
        }
        if progress && last_progress.elapsed() >= Duration::from_secs(1) {
            last_progress = Instant::now();
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\rclrbpf: recording {:>5.1} s, {} samples, {} processes (Ctrl-C to stop) ",
                started.elapsed().as_secs_f64(),
                pipeline.samples_seen(),
                pipeline.process_count()
            );
            let _ = err.flush();
        }
    };
    // From here on, a second Ctrl-C or SIGTERM ends every wait on the
    // targets at once; the profile is still written.
    if let Err(e) = crate::stop::arm_second_request() {
        tracing::debug!(error = %e, "no handler for a second stop request");
    }
    if progress {
        eprint!("\r{:80}\r", "");
    }
    let elapsed = started.elapsed();
    tracing::debug!(?elapsed, "sampling stopped");
    pipeline.pull(&mut sampler, &mut raw);
    let mut blocked_now = sampler.still_blocked(crate::profile::monotonic_ns());
    let mut off_cpu_totals = sampler.off_cpu_totals();
    add_still_blocked(&mut off_cpu_totals.threads, &blocked_now);
    pipeline.accept(&mut blocked_now);
    pipeline.summary.kernel = sampler.counters();
    pipeline.summary.bpf_stats = sampler.on_cpu_program_stats();
    pipeline.summary.off_cpu_bpf_stats = sampler.off_cpu_program_stats();
    if let Some(unwind) = pipeline.unwind.take() {
        pipeline.summary.unwind = unwind.finish();
        if pipeline.summary.unwind.is_none() {
            pipeline.summary.warnings.push(
                "the unwind-table thread was still building tables when the recording ended (a saturated host?): stacks of the processes it had not indexed were walked by frame pointers".to_owned(),
            );
        }
    }
    let period_ns = sampler.period_ns;
    drop(ring);
    drop(sampler);
    tracing::debug!("finishing CLR sessions and symbolizing");
    pipeline.finish_clr();
    pipeline.process_all();
    pipeline.restore_processes(keep_perf_maps);

    pipeline.count_evictions();
    let mut summary = std::mem::take(&mut pipeline.summary);
    summary.off_cpu_other_threads = (off_cpu_totals.other_threads, off_cpu_totals.others);
    summary.off_cpu_threads = off_cpu_threads(
        off_cpu_totals.threads,
        &pipeline.thread_names,
        &pipeline.off_cpu_recorded,
    );
    summary.duration = elapsed;
    summary.samples_lost = summary.kernel.samples_lost;
    summary.stopped_by = stopped_by;
    let mut warnings = Warnings::from(warnings);
    warnings.append(&mut summary.warnings);
    summary.warnings = warnings;

    // One window: the sampled span.
    let elapsed_ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
    let mut profile = pipeline.take_window(
        WindowSpan {
            start_ns: start_mono_ns,
            end_ns: start_mono_ns.saturating_add(elapsed_ns),
            start_unix_ns,
        },
        period_ns,
    );
    profile
        .comments
        .push(format!("clrbpf {}", env!("CARGO_PKG_VERSION")));
    profile
        .comments
        .push(format!("frequency {frequency_hz} Hz"));
    apply_frame_names(&mut profile, frame_names);
    profile.main_module = application.finish();
    sink.write_window(&profile).context("write the profile")?;
    summary.outputs = sink.written().to_vec();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_list_is_read_before_the_fork() {
        // root's primary group is always in its list; a user nobody knows
        // still gets the group it was given.
        let root = group_list(c"root", 0);
        assert!(root.contains(&0), "{root:?}");
        let unknown = group_list(c"clrbpf-no-such-user", 4242);
        assert_eq!(unknown, [4242]);
    }
}
