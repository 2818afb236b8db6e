//! `clrbpf record`: one recording, driven by the
//! [driver](crate::pipeline::driver) with one window and a file sink.
//!
//! 1. Check the options ([`RecordConfig::from_args`]) and the host, create
//!    the output files (a bad path fails before anything is recorded),
//!    load the kernel side with the chosen target set.
//! 2. Optionally launch the command (as the invoking user, with
//!    `DOTNET_PerfMapEnabled=1`); the kernel side follows its children.
//! 3. The driver's loop runs until the duration, Ctrl-C, SIGTERM, the
//!    command's exit or the exit of every `-p` process ([`RecordFront`]),
//!    with a progress line on a terminal.
//! 4. The driver drains what is left and restores the .NET processes; the
//!    one window ([`OneWindow`]) is written ([`RecordOutput`]) and the
//!    summary returned for printing.

use std::{
    ffi::{CStr, CString, OsString},
    io::{IsTerminal as _, Write as _},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, bail};

use crate::{
    bpf::Sampler,
    cli::RecordArgs,
    export::{
        ExportError,
        flamegraph::FlameGraphOptions,
        frame_names::{FrameNames, apply_frame_names},
        output::{OutputFormat, sudo_owner},
        sink::{ClosedWindow, FileSink, ProfileSink},
    },
    pipeline::{
        driver::{
            Cutter, Driver, DriverSetup, Front, OneWindow, SamplingConfig, StopSignal, prepare_host,
        },
        start_tables,
        summary::{RecordSummary, Warnings},
    },
    process::{ProcFs, main_module::ApplicationModule},
    profile::{Module, kinds::EventKind},
};

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
    /// How an .svg output is drawn.
    pub flame_graph: FlameGraphOptions,
    pub perf_map_attach: bool,
    /// What is collected besides CPU samples, and how stacks are walked.
    pub sampling: SamplingConfig,
    pub command: Vec<OsString>,
    /// What is printed on stderr: a progress line and the summary, with
    /// clrbpf's own figures or not.
    pub report: Report,
    /// Exception events with stacks per second and process at most
    /// ([`crate::clr::budget`]); `None`: every one.
    pub exceptions_per_second: Option<u32>,
    /// One output file per kind (`<stem>.cpu.pb.gz`, ...) instead of one.
    pub split: bool,
    /// Raise clrbpf's priority ([`crate::process::priority`]), with this
    /// nice value for its background threads (`None`: leave it).
    pub nice: Option<i32>,
    /// How long the start may wait for the unwind tables of the processes
    /// known then ([`crate::pipeline::start_tables`]).
    pub start_wait: Duration,
}

/// What `record` prints on stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// Nothing but errors (`--quiet`).
    Quiet,
    /// A progress line on a terminal, and the summary.
    Summary,
    /// The summary with clrbpf's own figures too (`--verbose`).
    Verbose,
}

impl RecordConfig {
    /// Checks every option of `clrbpf record`.
    pub fn from_args(args: RecordArgs) -> anyhow::Result<Self> {
        let RecordArgs {
            pids,
            all,
            frequency,
            duration,
            output,
            format,
            frame_names,
            keep_perf_maps,
            flame_graph,
            no_perf_map_attach,
            dwarf_unwind: _,
            call_graph: _,
            exceptions_per_second,
            alloc,
            split,
            sampling,
            nice,
            no_priority_boost,
            start_wait,
            quiet,
            verbose,
            command,
        } = args;
        let mut sampling = SamplingConfig::from_args(sampling)?;
        // --alloc is `allocations` added to --clr-events.
        if alloc {
            sampling.clr_events = sampling.clr_events.with(EventKind::Allocation);
        }
        let format = match format.or_else(|| OutputFormat::from_path(&output)) {
            Some(format) => format,
            None => bail!(
                "cannot tell the output format from {}: use an extension (.pb.gz, .folded, .svg) or --format",
                output.display()
            ),
        };
        if flame_graph.any() && format != OutputFormat::Svg {
            bail!(
                "--title, --reverse, --inverted, --per-thread and --min-width draw a flame graph: write one with -o FILE.svg or --format svg (the output is {format})"
            );
        }
        check_command(&command)?;
        let report = match (quiet, verbose) {
            (true, _) => Report::Quiet,
            (false, false) => Report::Summary,
            (false, true) => Report::Verbose,
        };
        Ok(Self {
            pids,
            all,
            frequency_hz: frequency,
            duration,
            output,
            format,
            frame_names,
            keep_perf_maps,
            flame_graph: FlameGraphOptions {
                title: flame_graph.title,
                reverse: flame_graph.reverse,
                inverted: flame_graph.inverted,
                per_thread: flame_graph.per_thread,
                min_width: flame_graph.min_width,
            },
            perf_map_attach: !no_perf_map_attach,
            sampling,
            command,
            report,
            // The agent's budget by default: an exception storm costs the
            // target a stack walk per event.
            exceptions_per_second: (exceptions_per_second > 0).then_some(exceptions_per_second),
            split,
            nice: (!no_priority_boost).then_some(nice),
            start_wait,
        })
    }
}

/// Refuses, before anything is loaded, a command that cannot be run: one
/// that looks like an option (`record -- -1` after clap's tip for a
/// negative value), or a program that is not an executable file, by its
/// path or on PATH.
fn check_command(command: &[OsString]) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let Some(program) = command.first() else {
        return Ok(());
    };
    let shown = program.to_string_lossy();
    if shown.starts_with('-') {
        bail!(
            "`{shown}` after `--` is taken as the command to run, and it is not one: options go before `--`"
        );
    }
    let executable = |path: &std::path::Path| {
        std::fs::metadata(path)
            .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
    };
    let path = std::path::Path::new(program);
    if path.as_os_str().as_encoded_bytes().contains(&b'/') {
        if !executable(path) {
            bail!("cannot run {shown}: no such executable file");
        }
        return Ok(());
    }
    let search = std::env::var_os("PATH").unwrap_or_default();
    if !std::env::split_paths(&search).any(|dir| executable(&dir.join(path))) {
        bail!("cannot run {shown}: not found on PATH");
    }
    Ok(())
}

/// The invoking user under sudo: (uid, gid, name).
fn sudo_user() -> Option<(u32, u32, CString)> {
    let uid = std::env::var("SUDO_UID").ok()?.parse().ok()?;
    let gid = std::env::var("SUDO_GID").ok()?.parse().ok()?;
    let name = CString::new(std::env::var("SUDO_USER").ok()?).ok()?;
    (uid != 0).then_some((uid, gid, name))
}

/// Starts the command; with `perf_maps`, its .NET processes write them.
fn spawn_command(command: &[OsString], perf_maps: bool) -> anyhow::Result<tokio::process::Child> {
    let (program, args) = command.split_first().context("no command given")?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).kill_on_drop(false);
    if perf_maps {
        // .NET 5+ reads DOTNET_ settings; .NET Core 3.x only COMPlus_ ones.
        cmd.env("DOTNET_PerfMapEnabled", "1")
            .env("COMPlus_PerfMapEnabled", "1");
    }
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
        flame_graph,
        perf_map_attach,
        sampling,
        command,
        report,
        exceptions_per_second,
        split,
        nice,
        start_wait,
    } = config;
    let record_started_ns = crate::profile::monotonic_ns();
    let launched_perf_maps = sampling.managed_names.uses_perf_maps();
    for &pid in &pids {
        if !process_exists(pid) {
            bail!(
                "process {pid} does not exist (not running): check the pid with `ps` or `clrbpf ps`"
            );
        }
    }
    let host_warnings = prepare_host(nice)?;
    // Created now, with their final owner and mode: a bad output path
    // fails here, before anything is recorded.
    let file = FileSink::create(&output, format, split, &sampling.layout(), sudo_owner())
        .with_context(|| format!("cannot write the profile to {}", output.display()))?
        .with_flame_graph(flame_graph);
    let whole_host = all || (pids.is_empty() && command.is_empty());
    let mut initial_targets = pids.clone();
    if !command.is_empty() && !whole_host {
        // The command is forked by this process: following our own forks
        // until the child is in the set means none of its children escape.
        initial_targets.push(std::process::id());
    }
    let mut driver = Driver::load(DriverSetup {
        sampling,
        frequency_hz,
        target_pids: (!whole_host).then_some(initial_targets),
        attach_perf_maps: perf_map_attach,
        keep_perf_maps,
        exceptions_per_second,
        counters_interval_sec: None,
        count_still_blocked: true,
    })?;
    let progress = report != Report::Quiet && std::io::stderr().is_terminal();
    // The processes known now get their unwind tables before the first
    // sample: their first stacks are whole.
    let targets = start_tables::start_targets(&ProcFs::default(), &pids, whole_host);
    let stopped_early = driver
        .wait_for_start_tables(targets, start_wait, progress)
        .await;
    driver.start_sampling()?;
    driver.track(&pids);
    let started = Instant::now();
    let child = if command.is_empty() || stopped_early.is_some() {
        None
    } else {
        let child = spawn_command(&command, launched_perf_maps)?;
        if let Some(pid) = child.id()
            && !whole_host
        {
            driver.sampler().add_target(pid)?;
            driver.sampler().remove_target(std::process::id());
        }
        Some(child)
    };
    let app_pid = child
        .as_ref()
        .and_then(|c| c.id())
        .or(pids.first().copied());
    let mut front = RecordFront {
        application: ApplicationModule::new(&ProcFs::default(), app_pid),
        child,
        command_exited_at: None,
        command_status: None,
        duration,
        pids,
        started,
        progress: progress.then(Instant::now),
        record_started_ns,
        policy: OneWindow {
            start: driver.started_at(),
        },
        output: RecordOutput {
            file,
            frame_names,
            frequency_hz,
            main_module: None,
        },
    };
    let stopped_by = match stopped_early {
        Some(reason) => reason,
        None => driver.run(&mut front).await,
    };
    let mut summary = driver.finish(&mut front, stopped_by)?;
    summary.command_status = front.command_status;
    let mut warnings = Warnings::from(host_warnings);
    warnings.append(&mut summary.warnings);
    summary.warnings = warnings;
    summary.outputs = front.output.file.written().to_vec();
    Ok(summary)
}

/// `record`'s part of the loop: the launched command, the `-p`
/// processes, the duration and the progress line.
struct RecordFront {
    child: Option<tokio::process::Child>,
    /// When the command exited: the loop drains [`EXIT_GRACE`] longer.
    command_exited_at: Option<Instant>,
    command_status: Option<std::process::ExitStatus>,
    duration: Option<Duration>,
    pids: Vec<u32>,
    started: Instant,
    /// When `record` started, in sample time: the summary says how long
    /// after it the first sample came.
    record_started_ns: u64,
    /// When the progress line was last written (`None`: no progress line).
    progress: Option<Instant>,
    /// The module of the application profiled (the command or the first
    /// `-p` process), for the profile's main mapping.
    application: ApplicationModule,
    policy: OneWindow,
    output: RecordOutput,
}

impl Front for RecordFront {
    async fn event(&mut self) {
        match self.child.as_mut() {
            Some(child) if self.command_exited_at.is_none() => {
                self.command_status = child.wait().await.ok();
                self.command_exited_at = Some(Instant::now());
            }
            _ => std::future::pending().await,
        }
    }

    fn stop_signal(&mut self, signal: StopSignal) -> &'static str {
        match signal {
            StopSignal::Interrupt => "Ctrl-C",
            StopSignal::Terminate => {
                if let Some(child) = self.child.as_mut() {
                    // Best effort: the command may have exited already.
                    let _ = child.start_kill();
                }
                "SIGTERM"
            }
        }
    }

    fn after_tick(&mut self, cutter: &mut Cutter<'_>, _sampler: &Sampler) -> Option<&'static str> {
        cutter.pipeline().note_first_sample(self.record_started_ns);
        self.application.poll(&ProcFs::default());
        if self
            .command_exited_at
            .is_some_and(|t| t.elapsed() >= EXIT_GRACE)
        {
            return Some("command exited");
        }
        if self.duration.is_some_and(|d| self.started.elapsed() >= d) {
            return Some("duration");
        }
        if self.child.is_none()
            && !self.pids.is_empty()
            && !self.pids.iter().any(|&p| process_exists(p))
        {
            return Some("processes exited");
        }
        if let Some(last) = self.progress
            && last.elapsed() >= Duration::from_secs(1)
        {
            self.progress = Some(Instant::now());
            let pipeline = cutter.pipeline();
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\rclrbpf: recording {:>5.1} s, {} samples, {} processes (Ctrl-C to stop) ",
                self.started.elapsed().as_secs_f64(),
                pipeline.samples_seen(),
                pipeline.process_count()
            );
            let _ = err.flush();
        }
        None
    }

    fn stopped(&mut self) {
        if self.progress.is_some() {
            eprint!("\r{:80}\r", "");
        }
    }

    fn finish(&mut self, cutter: &mut Cutter<'_>, end: SystemTime) -> anyhow::Result<()> {
        let application = std::mem::replace(
            &mut self.application,
            ApplicationModule::new(&ProcFs::default(), None),
        );
        self.output.main_module = application.finish();
        cutter.cut_last(&mut self.policy, &mut self.output, end)
    }
}

/// `record`'s sink: the output files, with the profile's comments, frame
/// names and main module set.
struct RecordOutput {
    file: FileSink,
    frame_names: FrameNames,
    frequency_hz: u64,
    main_module: Option<Arc<Module>>,
}

impl ProfileSink for RecordOutput {
    fn submit(&mut self, mut window: ClosedWindow) -> Result<(), ExportError> {
        let profile = &mut window.profile;
        profile
            .comments
            .push(format!("clrbpf {}", env!("CARGO_PKG_VERSION")));
        profile
            .comments
            .push(format!("frequency {} Hz", self.frequency_hz));
        apply_frame_names(profile, self.frame_names);
        profile.main_module = self.main_module.take();
        self.file.submit(window)
    }
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

    fn config(args: &[&str]) -> anyhow::Result<RecordConfig> {
        use clap::Parser as _;
        let cli = crate::cli::Cli::try_parse_from(["clrbpf", "record"].iter().chain(args))?;
        match cli.command {
            crate::cli::Command::Record(args) => RecordConfig::from_args(*args),
            _ => panic!("not record"),
        }
    }

    #[test]
    fn flame_graph_options_reach_the_config_and_need_an_svg() {
        let svg = config(&[
            "-a",
            "-o",
            "x.svg",
            "--title",
            "T",
            "--reverse",
            "--inverted",
            "--per-thread",
            "--min-width",
            "0.5",
        ])
        .unwrap();
        assert_eq!(
            svg.flame_graph,
            FlameGraphOptions {
                title: Some("T".to_owned()),
                reverse: true,
                inverted: true,
                per_thread: true,
                min_width: Some(0.5),
            }
        );
        assert_eq!(
            config(&["-a", "-o", "x.svg"]).unwrap().flame_graph,
            FlameGraphOptions::default()
        );
        assert!(config(&["-a", "--format", "svg", "--reverse"]).is_ok());
        for option in [&["--reverse"][..], &["--title", "T"], &["--min-width", "1"]] {
            let args: Vec<&str> = ["-a", "-o", "x.pb.gz"]
                .iter()
                .chain(option)
                .copied()
                .collect();
            let error = config(&args).unwrap_err().to_string();
            assert!(error.contains("-o FILE.svg or --format svg"), "{error}");
        }
        assert_eq!(
            config(&["-a", "-o", "x.svg", "--min-width", "2%"])
                .unwrap()
                .flame_graph
                .min_width,
            Some(2.0)
        );
        for bad in ["-1", "101", "NaN", "wide"] {
            assert!(
                config(&["-a", "-o", "x.svg", "--min-width", bad]).is_err(),
                "{bad}"
            );
        }
    }
}
