//! The CLR event side of one profiled .NET process during `record`: starts
//! its EventPipe session ([`super::session`]) once the runtime is seen,
//! retrying while the diagnostic socket is not there yet (a runtime creates
//! it early in startup, but after `libcoreclr.so` is mapped), drains it on
//! every tick into the [`ClrIntake`], and stops it at the end. Failures
//! (no socket: `DOTNET_EnableDiagnostics=0`; a process exiting
//! mid-session; a refused command) become one warning each; CPU profiling
//! of the process goes on regardless. Asked for runtime metrics (the
//! agent), the same session also carries the `System.Runtime`
//! EventCounters, added up in a [`RuntimeCounters`].

use std::time::{Duration, Instant};

use super::{
    counters::RuntimeCounters,
    events::{ClrEvent, MethodLoad},
    intake::{ClrCounters, ClrIntake, ClrSample},
    ipc::IpcError,
    session::{
        ClrEventKinds, ClrSession, SessionEnd, SessionEvent, WAIT_HANDLE_MIN_MAJOR, method_rundown,
    },
};
use crate::{process::ProcFs, profile::clr_sampling::Weighted};

/// How long a missing diagnostic socket is waited for after the runtime
/// was seen.
const SOCKET_WAIT: Duration = Duration::from_secs(10);
/// Pause between two attempts to start the session.
const RETRY_EVERY: Duration = Duration::from_millis(200);
/// How long a stream that ended by itself (the process exited) may take to
/// deliver its last events.
const ENDED_STREAM_DEADLINE: Duration = Duration::from_secs(3);
/// How long a method rundown may take.
const RUNDOWN_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Debug)]
enum CollectorState {
    Waiting {
        since: Instant,
        last_try: Option<Instant>,
    },
    /// Connecting and asking for the session, on a thread of its own: a
    /// runtime that is stopped, or a process that only looks like one and
    /// never answers, must not hold up the recording loop.
    Starting {
        since: Instant,
        job: std::thread::JoinHandle<Result<ClrSession, IpcError>>,
    },
    Running(Box<ClrSession>),
    Ended,
}

/// Per-process CLR event collection; see the module documentation.
#[derive(Debug)]
pub struct ClrCollector {
    pid: u32,
    kinds: ClrEventKinds,
    runtime_major: Option<u32>,
    state: CollectorState,
    intake: ClrIntake,
    end: Option<SessionEnd>,
    warnings: Vec<String>,
    /// Why the totals miss events: the stream broke before the recording
    /// ended (the process was killed, the runtime sent garbage).
    incomplete: Option<String>,
    sessions_started: u32,
    /// Run a method rundown once the session is up (catch-up for runtimes
    /// without EnablePerfMap).
    rundown: bool,
    rundown_methods: usize,
    /// The rundown runs on its own thread: it can take seconds in a big
    /// application, and the recording loop must keep draining samples.
    rundown_job: Option<std::thread::JoinHandle<RundownResult>>,
    /// The `System.Runtime` EventCounters interval (seconds) when runtime
    /// metrics are asked for, and what they added up to.
    counters_interval_sec: Option<u32>,
    runtime: RuntimeCounters,
}

type RundownResult = Result<(Vec<MethodLoad>, Option<String>), IpcError>;

impl ClrCollector {
    /// For host process `pid`, whose runtime was just seen.
    pub fn new(pid: u32, kinds: ClrEventKinds, runtime_major: Option<u32>, rundown: bool) -> Self {
        let mut warnings = Vec::new();
        if kinds.waits && runtime_major.is_some_and(|m| m < WAIT_HANDLE_MIN_MAJOR) {
            warnings.push(format!(
                "pid {pid}: wait-handle events need .NET 9+ (it runs .NET {}.x): no waits recorded",
                runtime_major.unwrap_or_default()
            ));
        }
        Self {
            pid,
            kinds,
            runtime_major,
            state: CollectorState::Waiting {
                since: Instant::now(),
                last_try: None,
            },
            intake: ClrIntake::default(),
            end: None,
            warnings,
            incomplete: None,
            sessions_started: 0,
            rundown,
            rundown_methods: 0,
            rundown_job: None,
            counters_interval_sec: None,
            runtime: RuntimeCounters::new(),
        }
    }

    /// Also asks the session for the `System.Runtime` EventCounters every
    /// `interval_sec` seconds ([`Self::runtime_counters`]).
    pub fn with_runtime_metrics(mut self, interval_sec: Option<u32>) -> Self {
        self.counters_interval_sec = interval_sec;
        self
    }

    /// The runtime counters received so far (since the session began);
    /// `None` unless runtime metrics were asked for and a session runs or
    /// ran.
    pub fn runtime_counters(&mut self) -> Option<&mut RuntimeCounters> {
        (self.counters_interval_sec.is_some() && self.sessions_started > 0)
            .then_some(&mut self.runtime)
    }

    /// Starts the session if due, then takes what it delivered. Method
    /// load events go to `on_method` (with their time), the others to the
    /// intake. Returns the number of events taken.
    pub fn poll(&mut self, procfs: &ProcFs, on_method: &mut impl FnMut(&MethodLoad, u64)) -> usize {
        if let CollectorState::Waiting { since, last_try } = &mut self.state {
            if last_try.is_some_and(|t| t.elapsed() < RETRY_EVERY) {
                return 0;
            }
            *last_try = Some(Instant::now());
            let since = *since;
            let (procfs, pid, kinds, major, interval) = (
                procfs.clone(),
                self.pid,
                self.kinds,
                self.runtime_major,
                self.counters_interval_sec,
            );
            match std::thread::Builder::new()
                .name(format!("clrbpf-session-{pid}"))
                .spawn(move || {
                    crate::process::priority::enter_background_thread();
                    ClrSession::start_with_counters(&procfs, pid, kinds, major, interval)
                }) {
                Ok(job) => self.state = CollectorState::Starting { since, job },
                Err(e) => {
                    self.warnings.push(format!(
                        "pid {pid}: no CLR events: cannot start a thread for the session: {e}"
                    ));
                    self.state = CollectorState::Ended;
                }
            }
        }
        if matches!(&self.state, CollectorState::Starting { job, .. } if job.is_finished()) {
            let CollectorState::Starting { since, job } =
                std::mem::replace(&mut self.state, CollectorState::Ended)
            else {
                unreachable!("matched above");
            };
            let started = job.join().unwrap_or_else(|_| {
                Err(IpcError::Io {
                    pid: self.pid,
                    command: super::ipc::CommandId::COLLECT_TRACING_2,
                    source: std::io::Error::other("the session thread panicked"),
                })
            });
            match started {
                Ok(session) => {
                    self.sessions_started += 1;
                    self.state = CollectorState::Running(Box::new(session));
                    if self.rundown {
                        let (procfs, pid) = (procfs.clone(), self.pid);
                        self.rundown_job = Some(std::thread::spawn(move || {
                            crate::process::priority::enter_background_thread();
                            method_rundown(&procfs, pid, RUNDOWN_DEADLINE)
                        }));
                    }
                }
                Err(IpcError::SocketNotFound { .. }) if since.elapsed() < SOCKET_WAIT => {
                    self.state = CollectorState::Waiting {
                        since,
                        last_try: Some(Instant::now()),
                    };
                }
                Err(e) => {
                    self.warnings.push(format!(
                        "pid {}: no CLR events (lock contention, exceptions): {e}; CPU profiling goes on",
                        self.pid
                    ));
                }
            }
        }
        self.collect_rundown(None, on_method);
        let Self {
            state,
            intake,
            end,
            runtime,
            ..
        } = self;
        let mut taken = 0;
        if let CollectorState::Running(session) = state {
            taken = session.drain(&mut |event| route(intake, on_method, event));
            for sample in session.take_counters() {
                runtime.observe(&sample);
            }
            if session.has_ended() {
                // The process exited (or the runtime closed the session).
                let CollectorState::Running(session) =
                    std::mem::replace(state, CollectorState::Ended)
                else {
                    unreachable!("matched above");
                };
                let (session_end, _) = session
                    .stop(Instant::now() + ENDED_STREAM_DEADLINE, &mut |event| {
                        route(intake, on_method, event)
                    });
                if let Some(error) = &session_end.error {
                    self.warnings.push(format!(
                        "pid {}: the CLR event stream broke before the end of the recording ({error}): its exception and contention totals are incomplete",
                        self.pid
                    ));
                    self.incomplete = Some(format!("the event stream broke: {error}"));
                }
                *end = Some(session_end);
            }
        }
        taken
    }

    /// Takes the rundown's methods once it is done (`wait_until`: wait for
    /// it until then; a rundown still running then is abandoned).
    fn collect_rundown(
        &mut self,
        wait_until: Option<Instant>,
        on_method: &mut impl FnMut(&MethodLoad, u64),
    ) {
        let Some(job) = self.rundown_job.as_ref() else {
            return;
        };
        if let Some(until) = wait_until {
            crate::stop::wait_until(until, || job.is_finished());
        }
        if !job.is_finished() {
            if wait_until.is_some() {
                self.rundown_job = None;
                self.warnings.push(format!(
                    "pid {}: the method rundown had not ended when the recording did: JIT frames compiled before the attach may be unnamed",
                    self.pid
                ));
            }
            return;
        }
        let Some(job) = self.rundown_job.take() else {
            return;
        };
        let Ok(result) = job.join() else {
            self.warnings.push(format!(
                "pid {}: the method rundown thread failed",
                self.pid
            ));
            return;
        };
        match result {
            Ok((methods, error)) => {
                tracing::debug!(pid = self.pid, methods = methods.len(), ?error, "method rundown");
                self.rundown_methods = methods.len();
                for method in &methods {
                    on_method(method, 0);
                }
                if let Some(error) = error {
                    self.warnings.push(format!(
                        "pid {}: method rundown incomplete ({} methods): {error}",
                        self.pid,
                        methods.len()
                    ));
                }
            }
            Err(e) => self.warnings.push(format!(
                "pid {}: method rundown failed, JIT frames compiled before the attach stay unnamed: {e}",
                self.pid
            )),
        }
    }

    /// Methods the rundown listed.
    pub fn rundown_methods(&self) -> usize {
        self.rundown_methods
    }

    /// Stops the session (the end of the recording) and takes its last
    /// events.
    pub fn stop(&mut self, until: Instant, on_method: &mut impl FnMut(&MethodLoad, u64)) {
        self.collect_rundown(Some(until), on_method);
        let state = std::mem::replace(&mut self.state, CollectorState::Ended);
        match state {
            CollectorState::Running(session) => {
                let intake = &mut self.intake;
                let (session_end, stop_error) =
                    session.stop(until, &mut |event| route(intake, on_method, event));
                if let Some(error) = &session_end.error {
                    self.warnings
                        .push(format!("pid {}: CLR event stream: {error}", self.pid));
                    self.incomplete = Some(format!("the event stream failed: {error}"));
                }
                if let Some(e) = stop_error
                    && session_end.error.is_some()
                {
                    self.warnings.push(format!(
                        "pid {}: stopping the EventPipe session: {e}",
                        self.pid
                    ));
                }
                self.end = Some(session_end);
            }
            // Left to its own deadline: the recording does not wait for it.
            CollectorState::Starting { .. } => self.warnings.push(format!(
                "pid {}: no CLR events: its runtime had not answered the session request when the recording ended",
                self.pid
            )),
            CollectorState::Waiting { .. } | CollectorState::Ended => {}
        }
        if let Some(end) = &self.end
            && end.stream.lost_events > 0
        {
            self.warnings.push(format!(
                "pid {}: the runtime dropped {} CLR events (its session buffer was full); totals are low by that much",
                self.pid, end.stream.lost_events
            ));
            self.incomplete
                .get_or_insert_with(|| format!("{} events dropped", end.stream.lost_events));
        }
    }

    /// Sends StopTracing to a running session without waiting, so that
    /// every process's session stops at once ([`Self::stop`] then drains).
    pub fn begin_stop(&mut self) {
        if let CollectorState::Running(session) = &mut self.state {
            session.begin_stop();
        }
    }

    /// Why the totals are incomplete, if they are.
    pub fn incomplete(&self) -> Option<&str> {
        self.incomplete.as_deref()
    }

    /// The kept samples of the sampling windows closed so far.
    pub fn take_completed(&mut self) -> Vec<Weighted<ClrSample>> {
        self.intake.take_completed()
    }

    /// Every kept sample with its weights (closes the sampling windows).
    pub fn finish(&mut self) -> Vec<Weighted<ClrSample>> {
        self.intake.finish()
    }

    pub fn counters(&self) -> ClrCounters {
        self.intake.counters()
    }

    /// Whether a session ever ran.
    pub fn had_session(&self) -> bool {
        self.sessions_started > 0
    }

    /// How the stream ended, once it has.
    pub fn session_end(&self) -> Option<&SessionEnd> {
        self.end.as_ref()
    }

    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }
}

fn route(
    intake: &mut ClrIntake,
    on_method: &mut impl FnMut(&MethodLoad, u64),
    event: SessionEvent,
) {
    if let ClrEvent::Method(method) = &event.event {
        on_method(method, event.time_ns);
    }
    intake.add(event);
}
