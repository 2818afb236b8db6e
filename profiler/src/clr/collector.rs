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
//!
//! With an exception budget (the agent's default), exception events come on
//! a second session of their own ([`ExceptionEvents`]), at level Error, that
//! the [`ExceptionGate`] stops during a storm and starts again after the
//! back-off. On .NET 9 and later a third session takes the same events
//! without stack walks (CollectTracing3's `requestStackwalk`), on through
//! the back-offs: it counts every exception by type, exactly, at every end
//! of the process or the recording, and the events with stacks give only
//! the shape; a type thrown only while the stacks are off is still listed,
//! without a stack. Before .NET 9 the main session carries the counters
//! (at the runtime metrics' interval, or every second without them), and
//! the exceptions the `exception-count` counter saw without an event are
//! added to the intake once the exception session is off and drained, in
//! the shape of the events: exact, but for those a process throws in its
//! last counter interval while the events are off (the runtime writes no
//! last value when it exits).

use std::time::{Duration, Instant};

use clrbpf_parse::events::{ClrEvent, MethodLoad};

use super::{
    alloc_session::{AllocationEvents, start_allocation_events},
    budget::{CounterLedger, ExceptionGate},
    counters::{CounterKind, CounterSample, RuntimeCounters},
    intake::{ClrCounters, ClrIntake, ClrSample},
    ipc::{DiagnosticPort, IpcError},
    jobs::{self, Job},
    session::{
        ClrEventKinds, ClrSession, RuntimeEventKind, SessionEnd, SessionEvent, method_rundown,
    },
};
use crate::profile::{clr_sampling::Weighted, kinds::EventKind};

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
/// How long a stopped exception session may take to deliver its last
/// events.
const EXCEPTION_STOP_DEADLINE: Duration = Duration::from_secs(5);
/// The `System.Runtime` counter of exceptions thrown.
const EXCEPTION_COUNTER: &str = "exception-count";

#[derive(Debug)]
enum CollectorState {
    Waiting {
        since: Instant,
        last_try: Option<Instant>,
    },
    /// Connecting and asking for the session, on the job pool
    /// ([`super::jobs`]): a runtime that is stopped, or a process that only
    /// looks like one and never answers, must not hold up the recording
    /// loop.
    Starting {
        since: Instant,
        job: Job<Result<StartedSessions, IpcError>>,
    },
    Running(Box<ClrSession>),
    Ended,
}

/// What every .NET process's collector asks its runtime for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClrSettings {
    pub kinds: ClrEventKinds,
    /// The `System.Runtime` EventCounters interval (seconds), for runtime
    /// metrics.
    pub counters_interval_sec: Option<u32>,
    /// Exception events with stacks per second and process at most
    /// ([`super::budget`]); `None`: every one.
    pub exceptions_per_second: Option<u32>,
    /// Allocation events with stacks per second and process at most
    /// ([`super::alloc_session`]); `None`: every one.
    pub allocations_per_second: Option<u32>,
}

/// Per-process CLR event collection; see the module documentation.
#[derive(Debug)]
pub struct ClrCollector {
    pid: u32,
    /// The runtime's diagnostic socket.
    port: DiagnosticPort,
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
    /// The rundown runs on the job pool: it can take seconds in a big
    /// application, and the recording loop must keep draining samples.
    rundown_job: Option<Job<RundownResult>>,
    /// The `System.Runtime` EventCounters interval (seconds) when runtime
    /// metrics are asked for, and what they added up to.
    counters_interval_sec: Option<u32>,
    runtime: RuntimeCounters,
    /// Exception events on a session of their own, under a budget.
    exception_events: Option<ExceptionEvents>,
    /// Allocation events, always on a session of their own.
    allocation_events: Option<AllocationEvents>,
}

/// The state of an event session of its own run under a budget: the
/// exception session and the allocation session.
#[derive(Debug)]
pub(super) enum BudgetedSession {
    /// Not started yet, or stopped over the budget until the gate opens.
    Off,
    Starting(Job<Result<ClrSession, IpcError>>),
    Running(Box<ClrSession>),
    /// StopTracing sent: its last events are drained until its end.
    Stopping(Box<ClrSession>, Instant),
    /// It could not start, or the process exited.
    Ended,
}

impl BudgetedSession {
    /// Whether the session's poll has work due by time, not by its
    /// deliveries: a start or a stop to take in, or a back-off to end.
    fn busy(&self) -> bool {
        matches!(self, Self::Off | Self::Starting(_) | Self::Stopping(..))
    }

    /// Starts the session of the `what` events (`exception`, `allocation`)
    /// of `pid` on the job pool: the runtime may answer late.
    pub(super) fn start(
        start: impl FnOnce() -> Result<ClrSession, IpcError> + Send + 'static,
    ) -> Self {
        Self::Starting(jobs::spawn(start))
    }

    /// The session a finished start gave, or `Ended` with a warning.
    pub(super) fn started(
        job: Job<Result<ClrSession, IpcError>>,
        pid: u32,
        what: &str,
        warnings: &mut Vec<String>,
    ) -> Self {
        match job.join() {
            Ok(Ok(session)) => Self::Running(Box::new(session)),
            Ok(Err(e)) => {
                warnings.push(format!(
                    "pid {pid}: no {what} events (their totals still come from the runtime's counter): {e}"
                ));
                Self::Ended
            }
            Err(e) => {
                warnings.push(format!("pid {pid}: no {what} events: {e}"));
                Self::Ended
            }
        }
    }
}

/// Exception events on a session of their own, stopped during a storm;
/// see the module documentation.
#[derive(Debug)]
pub struct ExceptionEvents {
    gate: ExceptionGate,
    session: BudgetedSession,
    /// Exceptions taken as events against those the counter saw.
    ledger: CounterLedger,
    /// The session without stack walks that counts every exception by
    /// type (.NET 9+), on through the back-offs until the process or the
    /// recording ends.
    counting: Option<Box<ClrSession>>,
    /// Whether `counting` ever ran: the totals are then its events', and
    /// the events with stacks give only the shape.
    counted_by_type: bool,
}

impl ExceptionEvents {
    fn new(per_second: u32) -> Self {
        Self {
            gate: ExceptionGate::new(per_second),
            session: BudgetedSession::Off,
            ledger: CounterLedger::new(super::budget::MAX_EXCEPTIONS_PER_SECOND),
            counting: None,
            counted_by_type: false,
        }
    }

    /// Takes the counting session (`None`: the runtime has none).
    fn counting_started(&mut self, session: Option<ClrSession>) {
        self.counted_by_type |= session.is_some();
        self.counting = session.map(Box::new);
    }

    /// Drains the counting session into `intake`; stops it once its
    /// stream ended (the process exited) and takes its last events. Its
    /// events carry no stack to name.
    fn drain_counting(&mut self, intake: &mut ClrIntake) {
        let Some(session) = self.counting.as_mut() else {
            return;
        };
        session.drain(&mut |event| intake.count_exception(event));
        if session.has_ended() {
            self.stop_counting(Instant::now() + ENDED_STREAM_DEADLINE, intake);
        }
    }

    /// Stops the counting session (the end of the recording or of the
    /// process) and counts its last events.
    fn stop_counting(&mut self, until: Instant, intake: &mut ClrIntake) {
        if let Some(session) = self.counting.take() {
            let (end, _) = session.stop(until, &mut |event| intake.count_exception(event));
            tracing::debug!(
                error = ?end.error,
                lost_events = end.stream.lost_events,
                "exception counting session stopped"
            );
        }
    }

    fn observe_counter(&mut self, sample: &CounterSample) {
        if sample.name == EXCEPTION_COUNTER && sample.kind == CounterKind::Sum {
            self.ledger
                .on_counter(sample.value, sample.time_ns, sample.interval_sec);
        }
    }

    /// Hands one event of the exception session to `intake`, tallying it;
    /// returns whether it went over the budget ([`Self::observe_event`]).
    fn take(
        &mut self,
        intake: &mut ClrIntake,
        event: SessionEvent,
        now_ns: u64,
        gated: bool,
    ) -> bool {
        let over = matches!(event.event, ClrEvent::ExceptionThrown(_))
            && self.observe_event(event.time_ns, now_ns, gated);
        if self.counted_by_type {
            intake.add_exception_shape(event);
        } else {
            intake.add(event);
        }
        over
    }

    /// Tallies one exception event; returns whether it went over the
    /// budget. The gate acts from the first event: the counter's first
    /// value may be one counter interval away ([`CounterLedger`]).
    fn observe_event(&mut self, time_ns: u64, now_ns: u64, gated: bool) -> bool {
        let over = gated && self.gate.observe(time_ns, now_ns);
        self.ledger.on_event(time_ns, 1.0, over);
        over
    }

    /// Exceptions the counter saw that no event stood for, not added yet.
    /// Only meaningful while no exception event is still on its way.
    fn unobserved(&mut self) -> u64 {
        if self.counted_by_type {
            // The counting session's events are the totals.
            return 0;
        }
        self.ledger.unobserved()
    }

    /// How many times the events were turned off over the budget.
    pub fn backoffs(&self) -> u64 {
        self.gate.backoffs()
    }
}

/// [`ClrSession::refresh_runtime_keywords`] on the job pool, after the
/// exception or the allocation session stopped.
pub(super) fn refresh_keywords_in_background(port: DiagnosticPort) {
    let pid = port.pid();
    // Nobody waits for it: its result is only logged.
    drop(jobs::spawn(move || {
        let refreshed = port
            .client()
            .and_then(|client| ClrSession::refresh_runtime_keywords(&client));
        if let Err(error) = refreshed {
            tracing::debug!(pid, %error, "refreshing the runtime's keywords");
        }
    }));
}

/// The main session and, with an exception budget, the exception session,
/// started in that order's reverse: the exception events are on before
/// the counters' baseline is taken (see [`ExceptionEvents`]).
#[derive(Debug)]
struct StartedSessions {
    main: ClrSession,
    exceptions: Option<ClrSession>,
    /// The exception session without stack walks, where the runtime has
    /// one.
    counting: Option<ClrSession>,
    allocations: Option<ClrSession>,
}

type RundownResult = Result<(Vec<MethodLoad>, Option<String>), IpcError>;

impl ClrCollector {
    /// For the process of `port`, whose runtime was just seen.
    pub fn new(
        port: DiagnosticPort,
        kinds: ClrEventKinds,
        runtime_major: Option<u32>,
        rundown: bool,
    ) -> Self {
        let pid = port.pid();
        // Said once, when the runtime is found: not a problem to fix, and
        // a host of .NET 8 services would otherwise hear it at every exit.
        let waits = RuntimeEventKind::of(EventKind::Wait);
        if kinds.contains(EventKind::Wait) && !waits.exists_on(runtime_major) {
            tracing::info!(
                "pid {pid}: wait-handle events need .NET {}+ (it runs .NET {}.x): no waits recorded",
                waits.min_major.unwrap_or_default(),
                runtime_major.unwrap_or_default()
            );
        }
        Self {
            pid,
            port,
            kinds,
            runtime_major,
            state: CollectorState::Waiting {
                since: Instant::now(),
                last_try: None,
            },
            intake: ClrIntake::default(),
            end: None,
            warnings: Vec::new(),
            incomplete: None,
            sessions_started: 0,
            rundown,
            rundown_methods: 0,
            rundown_job: None,
            counters_interval_sec: None,
            runtime: RuntimeCounters::new(),
            exception_events: None,
            allocation_events: None,
        }
    }

    /// Takes allocation events (when asked for) on a session of their own,
    /// at most `per_second` a second with their stacks (`None`: every
    /// one); the main session then carries the counters (every second
    /// unless [`Self::with_runtime_metrics`] sets their interval), whose
    /// `alloc-rate` gives the totals.
    pub fn with_allocation_budget(mut self, per_second: Option<u32>) -> Self {
        if self.kinds.contains(EventKind::Allocation) {
            self.allocation_events = Some(AllocationEvents::new(per_second, self.runtime_major));
        }
        self
    }

    /// Takes exception events with stacks at most `per_second` a second
    /// (see [`super::budget`]); `None` takes every one on the main session.
    /// The main session then carries the runtime's counters (every second
    /// unless [`Self::with_runtime_metrics`] sets their interval), whose
    /// `exception-count` gives the totals.
    pub fn with_exception_budget(mut self, per_second: Option<u32>) -> Self {
        if let Some(per_second) = per_second
            && self.kinds.contains(EventKind::Exception)
        {
            self.exception_events = Some(ExceptionEvents::new(per_second));
        }
        self
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

    /// Whether [`Self::poll`] has work due at every tick: the sessions'
    /// start, the rundown, an event session starting, stopping or off for
    /// its back-off. A settled collector (its sessions running or ended)
    /// has nothing to do until they deliver.
    pub fn busy(&self) -> bool {
        !matches!(
            self.state,
            CollectorState::Running(_) | CollectorState::Ended
        ) || self.rundown_job.is_some()
            || self
                .exception_events
                .as_ref()
                .is_some_and(|events| events.session.busy())
            || self
                .allocation_events
                .as_ref()
                .is_some_and(|events| events.session.busy())
    }

    /// Starts the session if due, then takes what it delivered. Method
    /// load events go to `on_method` (with their time), the others to the
    /// intake. Returns the number of events taken whose stacks are named
    /// later (contention, exception, wait and allocation events): method,
    /// module and rundown events carry none, and an idle process's tier-ups
    /// must not make its caller read the perf map for them.
    pub fn poll(&mut self, on_method: &mut impl FnMut(&MethodLoad, u64)) -> usize {
        if !self.start_if_due() {
            return 0;
        }
        self.take_started();
        self.collect_rundown(None, on_method);
        let Self {
            state,
            intake,
            end,
            runtime,
            exception_events,
            allocation_events,
            ..
        } = self;
        let mut taken = 0;
        if let CollectorState::Running(session) = state {
            session.drain(&mut |event| taken += usize::from(route(intake, on_method, event)));
            for sample in session.take_counters() {
                runtime.observe(&sample);
                if let Some(events) = exception_events.as_mut() {
                    events.observe_counter(&sample);
                }
                if let Some(events) = allocation_events.as_mut() {
                    events.observe_counter(&sample);
                }
            }
            if session.has_ended() {
                // The process exited (or the runtime closed the session).
                let CollectorState::Running(session) =
                    std::mem::replace(state, CollectorState::Ended)
                else {
                    unreachable!("matched above");
                };
                let (session_end, _) =
                    session.stop(Instant::now() + ENDED_STREAM_DEADLINE, &mut |event| {
                        taken += usize::from(route(intake, on_method, event));
                    });
                for sample in &session_end.counters {
                    runtime.observe(sample);
                    if let Some(events) = exception_events.as_mut() {
                        events.observe_counter(sample);
                    }
                    if let Some(events) = allocation_events.as_mut() {
                        events.observe_counter(sample);
                    }
                }
                if let Some(error) = &session_end.error {
                    self.warnings.push(format!(
                        "pid {}: the CLR event stream broke before the end of the recording ({error}): its exception, contention and wait totals are incomplete",
                        self.pid
                    ));
                    self.incomplete = Some(format!("the event stream broke: {error}"));
                }
                *end = Some(session_end);
            }
        }
        taken + self.poll_exception_events() + self.poll_allocation_events()
    }

    /// Runs the allocation session ([`AllocationEvents::poll`]).
    fn poll_allocation_events(&mut self) -> usize {
        let main_running = matches!(self.state, CollectorState::Running(_));
        let main_ended = matches!(self.state, CollectorState::Ended);
        let Some(events) = self.allocation_events.as_mut() else {
            return 0;
        };
        events.poll(
            &self.port,
            main_running,
            main_ended,
            &mut self.intake,
            &mut self.warnings,
        )
    }

    /// While waiting for the runtime's socket, starts the sessions from a
    /// thread every [`RETRY_EVERY`]; returns false when the next try is
    /// not due yet (nothing else to poll).
    fn start_if_due(&mut self) -> bool {
        if let CollectorState::Waiting { since, last_try } = &mut self.state {
            if last_try.is_some_and(|t| t.elapsed() < RETRY_EVERY) {
                return false;
            }
            *last_try = Some(Instant::now());
            let since = *since;
            let (mut kinds, mut interval) = (self.kinds, self.counters_interval_sec);
            // With a budget, the totals come from the runtime's counters:
            // at the runtime metrics' interval (the agent), every second
            // without them (`record`).
            if self.exception_events.is_some() {
                kinds = kinds.without(EventKind::Exception);
                interval = interval.or(Some(1));
            }
            if self.allocation_events.is_some() {
                interval = interval.or(Some(1));
            }
            let allocation_major = self
                .allocation_events
                .as_ref()
                .map(AllocationEvents::runtime_major);
            let (port, major) = (self.port.clone(), self.runtime_major);
            let exception_session = self.exception_events.is_some();
            let counting_session = exception_session
                && major.is_some_and(|m| m >= super::session::STACKWALK_OPTION_MIN_MAJOR);
            let job = jobs::spawn(move || {
                let client = port.client()?;
                // Counting first: no exception counted only as a shape.
                let counting = counting_session
                    .then(|| ClrSession::start_exception_counting(&client))
                    .and_then(|started| {
                        started
                            .inspect_err(|error| {
                                tracing::debug!(pid = client.pid(), %error, "no exception session without stacks");
                            })
                            .ok()
                    });
                let exceptions = exception_session
                    .then(|| ClrSession::start_exception_events(&client))
                    .transpose()?;
                let allocations = allocation_major
                    .map(|major| start_allocation_events(&client, major))
                    .transpose()?;
                let main = ClrSession::start_with_counters(&client, kinds, major, interval)?;
                Ok(StartedSessions {
                    main,
                    exceptions,
                    counting,
                    allocations,
                })
            });
            self.state = CollectorState::Starting { since, job };
        }
        true
    }

    /// Takes the started sessions once their thread is done (and starts
    /// the rundown), or waits for the socket a little longer.
    fn take_started(&mut self) {
        if matches!(&self.state, CollectorState::Starting { job, .. } if job.is_finished()) {
            let CollectorState::Starting { since, job } =
                std::mem::replace(&mut self.state, CollectorState::Ended)
            else {
                unreachable!("matched above");
            };
            let started = job.join().unwrap_or_else(|e| {
                Err(IpcError::Io {
                    pid: self.pid,
                    command: super::ipc::CommandId::COLLECT_TRACING_2,
                    source: std::io::Error::other(e),
                })
            });
            match started {
                Ok(StartedSessions {
                    main,
                    exceptions,
                    counting,
                    allocations,
                }) => {
                    self.sessions_started += 1;
                    self.state = CollectorState::Running(Box::new(main));
                    if let Some(events) = self.exception_events.as_mut() {
                        events.counting_started(counting);
                        if let Some(session) = exceptions {
                            events.session = BudgetedSession::Running(Box::new(session));
                        }
                    }
                    if let (Some(events), Some(session)) =
                        (self.allocation_events.as_mut(), allocations)
                    {
                        events.session = BudgetedSession::Running(Box::new(session));
                    }
                    if self.rundown {
                        let port = self.port.clone();
                        self.rundown_job = Some(jobs::spawn(move || {
                            method_rundown(&port.client()?, RUNDOWN_DEADLINE)
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
    }

    /// Runs the exception session: starts it once the main one runs and
    /// whenever the gate opens, drains it, stops it over the budget, and
    /// adds the exceptions only the counter saw once it is off and drained.
    fn poll_exception_events(&mut self) -> usize {
        let main_running = matches!(self.state, CollectorState::Running(_));
        let main_ended = matches!(self.state, CollectorState::Ended);
        let Self {
            pid,
            port,
            intake,
            exception_events,
            warnings,
            ..
        } = self;
        let Some(events) = exception_events.as_mut() else {
            return 0;
        };
        let now_ns = crate::profile::monotonic_ns();
        events.drain_counting(intake);
        let mut taken = 0;
        let mut take = |events: &mut ExceptionEvents, session: &mut ClrSession, gated: bool| {
            let mut over = false;
            taken += session.drain(&mut |event| {
                over |= events.take(intake, event, now_ns, gated);
            });
            over
        };
        let session = std::mem::replace(&mut events.session, BudgetedSession::Ended);
        let next = match session {
            BudgetedSession::Off if main_ended => BudgetedSession::Ended,
            BudgetedSession::Off if main_running && events.gate.is_on(now_ns) => {
                let port = port.clone();
                BudgetedSession::start(move || ClrSession::start_exception_events(&port.client()?))
            }
            BudgetedSession::Starting(job) if job.is_finished() => {
                BudgetedSession::started(job, *pid, "exception", warnings)
            }
            BudgetedSession::Running(mut session) => {
                let over = take(events, &mut session, true);
                if over {
                    tracing::debug!(
                        pid = *pid,
                        backoff = ?events.gate.backoff(),
                        "exception events over the budget: off for the back-off"
                    );
                    session.begin_stop();
                    BudgetedSession::Stopping(session, Instant::now() + EXCEPTION_STOP_DEADLINE)
                } else if session.has_ended() {
                    BudgetedSession::Stopping(session, Instant::now())
                } else {
                    BudgetedSession::Running(session)
                }
            }
            BudgetedSession::Stopping(mut session, deadline) => {
                take(events, &mut session, false);
                if session.has_ended() || Instant::now() >= deadline || main_ended {
                    let (end, _) = session.stop(Instant::now(), &mut |event| {
                        events.take(intake, event, now_ns, false);
                    });
                    tracing::debug!(
                        pid = *pid,
                        error = ?end.error,
                        lost_events = end.stream.lost_events,
                        "exception session stopped"
                    );
                    // Stopped while the gate is open: not over the budget
                    // but by its end (the process exiting), so not to be
                    // started again.
                    if main_ended || events.gate.is_on(now_ns) {
                        BudgetedSession::Ended
                    } else {
                        refresh_keywords_in_background(port.clone());
                        BudgetedSession::Off
                    }
                } else {
                    BudgetedSession::Stopping(session, deadline)
                }
            }
            other => other,
        };
        events.session = next;
        // No exception event is on its way: what the counter saw beyond the
        // events was thrown while they were off.
        if matches!(
            events.session,
            BudgetedSession::Off | BudgetedSession::Ended
        ) {
            let missing = events.unobserved();
            if missing > 0 {
                intake.add_unobserved_exceptions(now_ns, missing);
            }
        }
        intake.close_due(now_ns);
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
            self.warnings
                .push(format!("pid {}: the method rundown job failed", self.pid));
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
                    session.stop(until, &mut |event| {
                        route(intake, on_method, event);
                    });
                for sample in &session_end.counters {
                    self.runtime.observe(sample);
                    if let Some(events) = self.exception_events.as_mut() {
                        events.observe_counter(sample);
                    }
                    if let Some(events) = self.allocation_events.as_mut() {
                        events.observe_counter(sample);
                    }
                }
                if let Some(error) = &session_end.error {
                    self.warnings
                        .push(format!("pid {}: CLR event stream: {error}", self.pid));
                    self.incomplete = Some(format!("the event stream broke: {error}"));
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
        self.stop_exception_events(until);
        if let Some(events) = self.allocation_events.as_mut() {
            events.stop(until, &mut self.intake);
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

    /// Stops the exception session (the end of the recording), takes its
    /// last events and adds what only the counter saw.
    fn stop_exception_events(&mut self, until: Instant) {
        let Self {
            intake,
            exception_events,
            ..
        } = self;
        let Some(events) = exception_events.as_mut() else {
            return;
        };
        let session = std::mem::replace(&mut events.session, BudgetedSession::Ended);
        if let BudgetedSession::Running(session) | BudgetedSession::Stopping(session, _) = session {
            let now_ns = crate::profile::monotonic_ns();
            session.stop(until, &mut |event| {
                events.take(intake, event, now_ns, false);
            });
        }
        events.stop_counting(until, intake);
        let missing = events.unobserved();
        if missing > 0 {
            intake.add_unobserved_exceptions(crate::profile::monotonic_ns(), missing);
        }
    }

    /// Sends StopTracing to a running session without waiting, so that
    /// every process's session stops at once ([`Self::stop`] then drains).
    pub fn begin_stop(&mut self) {
        if let CollectorState::Running(session) = &mut self.state {
            session.begin_stop();
        }
        if let Some(events) = self.exception_events.as_mut() {
            if let BudgetedSession::Running(session) = &mut events.session {
                session.begin_stop();
            }
            if let Some(session) = events.counting.as_mut() {
                session.begin_stop();
            }
        }
        if let Some(events) = self.allocation_events.as_mut() {
            events.begin_stop();
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
        ClrCounters {
            exception_backoffs: self
                .exception_events
                .as_ref()
                .map_or(0, ExceptionEvents::backoffs),
            exceptions_counted_by_type: self
                .exception_events
                .as_ref()
                .is_some_and(|events| events.counted_by_type),
            allocation_backoffs: self
                .allocation_events
                .as_ref()
                .map_or(0, AllocationEvents::backoffs),
            ..self.intake.counters()
        }
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

/// Hands a main-session event to `on_method` or the intake; true for an
/// event whose stack is named later.
fn route(
    intake: &mut ClrIntake,
    on_method: &mut impl FnMut(&MethodLoad, u64),
    event: SessionEvent,
) -> bool {
    let has_stack_to_name = match &event.event {
        ClrEvent::Method(method) => {
            on_method(method, event.time_ns);
            false
        }
        ClrEvent::Module(_) | ClrEvent::R2REntryPoint(_) | ClrEvent::Rundown(_) => false,
        ClrEvent::ContentionStart(_)
        | ClrEvent::ContentionStop(_)
        | ClrEvent::ContentionLockCreated(_)
        | ClrEvent::ExceptionThrown(_)
        | ClrEvent::WaitHandleWaitStart(_)
        | ClrEvent::WaitHandleWaitStop(_)
        | ClrEvent::Allocation(_) => true,
    };
    intake.add(event);
    has_stack_to_name
}

#[cfg(test)]
mod tests {
    use super::*;
    use clrbpf_parse::events::{ContentionStart, MethodEventKind};

    #[test]
    fn only_events_with_stacks_to_name_are_counted_as_taken() {
        // An idle process's tier-ups come as method loads: they must not
        // make the instance read its perf map every second.
        let mut intake = ClrIntake::new(10, 10, super::super::intake::CLR_WINDOW_NS);
        let mut methods = 0;
        let mut on_method = |_: &MethodLoad, _| methods += 1;
        let event = |event| SessionEvent {
            time_ns: 1_000,
            thread_id: 7,
            stack: vec![0x1000],
            event,
        };
        let method = ClrEvent::Method(MethodLoad {
            kind: MethodEventKind::Load,
            method_id: 1,
            module_id: 2,
            start: 0x1000,
            size: 16,
            token: 0x0600_0001,
            flags: 0,
            namespace: "App".to_owned(),
            name: "Tick".to_owned(),
            signature: "void  ()".to_owned(),
            clr_instance_id: 0,
            rejit_id: 0,
        });
        assert!(!route(&mut intake, &mut on_method, event(method)));
        let contention = ClrEvent::ContentionStart(ContentionStart {
            flags: 0,
            clr_instance_id: 0,
            lock_id: None,
            associated_object_id: None,
            lock_owner_thread_id: None,
        });
        assert!(route(&mut intake, &mut on_method, event(contention)));
        assert_eq!(methods, 1, "the method still reaches on_method");
    }

    fn count(value: f64, time_ns: u64) -> CounterSample {
        CounterSample {
            name: EXCEPTION_COUNTER.to_owned(),
            kind: CounterKind::Sum,
            value,
            interval_sec: 1.0,
            display_units: String::new(),
            time_ns,
        }
    }

    #[test]
    fn events_count_up_to_the_first_counter_value_and_the_counter_after() {
        let mut events = ExceptionEvents::new(1_000);
        // 50 events before the counter's first value at t=100; 10 of them
        // arrive after it was seen but are older: still the events'.
        for t in 0..40 {
            assert!(!events.observe_event(t, 0, true));
        }
        assert_eq!(events.unobserved(), 0, "nothing before the first value");
        events.observe_counter(&count(77.0, 100));
        for t in 40..50 {
            events.observe_event(t, 0, true);
        }
        // Then 30 events and a counter saying 1030 more: 1000 without one.
        for t in 101..131 {
            events.observe_event(t, 0, true);
        }
        events.observe_counter(&count(1030.0, 2_000));
        assert_eq!(events.unobserved(), 1000);
        assert_eq!(events.unobserved(), 0, "added once");
        // The profile holds the 80 events and the 1000 added: the 50 early
        // events plus the 1030 counted after the first value.
        // Other counters and a garbage value change nothing.
        events.observe_counter(&CounterSample {
            name: "gen-0-gc-count".to_owned(),
            ..count(5.0, 3_000)
        });
        events.observe_counter(&count(f64::NAN, 3_000));
        assert_eq!(events.unobserved(), 0);
    }

    const S: u64 = 1_000_000_000;

    /// A first `exception-count` value at `time_ns` that measured over
    /// `interval_sec` seconds since its baseline.
    fn first_count(value: f64, time_ns: u64, interval_sec: f32) -> CounterSample {
        CounterSample {
            interval_sec,
            ..count(value, time_ns)
        }
    }

    #[test]
    fn the_gate_acts_before_the_first_counter_value() {
        // A storm at attach: at a 5 s counter interval, waiting for the
        // counter's first value would leave it unbounded for 5 s.
        let mut events = ExceptionEvents::new(10);
        let over: Vec<bool> = (0..20).map(|i| events.observe_event(i, 0, true)).collect();
        assert_eq!(over.iter().position(|&o| o), Some(10));
        assert_eq!(events.backoffs(), 1);
    }

    /// Counts a storm at attach: 3 events before the counter's baseline at
    /// 10 s (the exception session starts first), then 50 events from it
    /// until the gate turns them off, and 5,000 exceptions in all from the
    /// baseline to the first value at 15 s. `counter_first`: the counter's
    /// value is seen before the events (they come on another session).
    fn storm_at_attach(counter_first: bool) -> ExceptionEvents {
        let mut events = ExceptionEvents::new(10);
        let baseline = 10 * S;
        let times: Vec<u64> = (1..=3)
            .map(|i| baseline - i * 1000)
            .chain((1..=50).map(|i| baseline + i * 10_000_000))
            .collect();
        let first = first_count(5000.0, baseline + 5 * S, 5.0);
        if counter_first {
            events.observe_counter(&first);
        }
        for &t in &times {
            events.observe_event(t, t, true);
        }
        if !counter_first {
            assert_eq!(events.unobserved(), 0, "nothing before the first value");
            events.observe_counter(&first);
        }
        events
    }

    #[test]
    fn a_storm_at_attach_takes_its_totals_from_the_first_counter_value() {
        for counter_first in [false, true] {
            let mut events = storm_at_attach(counter_first);
            assert_eq!(events.backoffs(), 1);
            // 53 events and 4,950 without one: the 3 before the baseline
            // and the 5,000 the counter saw from it.
            assert_eq!(events.unobserved(), 4950, "counter first: {counter_first}");
            assert_eq!(events.unobserved(), 0, "added once");
            // The counter's next value: 700 more, all while off.
            events.observe_counter(&count(700.0, 20 * S));
            assert_eq!(events.unobserved(), 700);
        }
    }

    #[test]
    fn counted_by_type_the_counter_adds_nothing() {
        // A session without stacks counted every exception: what the
        // counter saw is already in the totals.
        let mut events = ExceptionEvents::new(10);
        events.counted_by_type = true;
        for i in 0..20 {
            events.observe_event(i, 0, true);
        }
        events.observe_counter(&first_count(5000.0, 5 * S, 5.0));
        events.observe_counter(&count(700.0, 10 * S));
        assert_eq!(events.unobserved(), 0);
        assert_eq!(events.backoffs(), 1, "the stacks are still bounded");
    }

    #[test]
    fn events_on_until_the_first_value_make_it_dropped() {
        // The events stayed on past the first value (5 s after the
        // baseline): the exceptions up to it are all events; the gate goes
        // off later, and the counter's later values count the rest.
        let mut events = ExceptionEvents::new(10);
        for i in 0..8 {
            events.observe_event(10 * S + i * S / 2, 0, true);
        }
        events.observe_counter(&first_count(8.0, 15 * S, 5.0));
        let over: Vec<bool> = (1..=20)
            .map(|i| events.observe_event(16 * S + i * 1000, 0, true))
            .collect();
        assert!(over.iter().any(|&o| o));
        events.observe_counter(&count(500.0, 20 * S));
        // 20 events after the first value, 500 exceptions counted.
        assert_eq!(events.unobserved(), 480);
    }
}
