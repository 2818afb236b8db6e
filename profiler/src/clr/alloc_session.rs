//! The allocation session of one .NET process: allocation events
//! ([`super::allocations`]) with their stacks, on an EventPipe session of
//! their own, under a budget. Driven by the collector
//! ([`super::collector`]); its events go to the intake
//! ([`super::intake`]).
//!
//! 1. The session enables the runtime provider's GC keyword at Verbose
//!    (`GCAllocationTick`, before .NET 10) or its AllocationSampling
//!    keyword at Informational (`AllocationSampled`, .NET 10+; a runtime of
//!    unknown version gets both: a .NET 10 runtime then sends only
//!    `AllocationSampled`, an older one ignores the bit). A session of its
//!    own, because the GC keyword at Verbose brings every verbose GC event
//!    with it, and so that it can be stopped alone.
//! 2. The runtime walks the managed stack of every event, about 10,000 a
//!    second at 1 GB/s. An [`ExceptionGate`] (the exceptions' rate limiter,
//!    [`super::budget`]) counts the events per second; over the budget the
//!    session is stopped for the back-off period, then started again.
//! 3. The totals come from the runtime's `alloc-rate` counter (bytes per
//!    interval, read by the main session every second, or at the runtime
//!    metrics' interval in the agent; see [`CounterLedger`]): the bytes it saw
//!    beyond those the events charged are added to the intake once the
//!    session is off and drained, and take the events' shape
//!    ([`crate::profile::alloc_sampling`]).
//! 4. .NET Core 3.1's ticks count more than was allocated: its
//!    `try_allocate_more_space` adds `alloc_limit - alloc_ptr` of the
//!    context, and a context extended in place keeps its old `alloc_ptr`,
//!    so the unused end of the previous quantum counts again (8% more on
//!    the Allocs workload; .NET 6+ count the bytes added). Where the
//!    events carry more than the counter saw, they are scaled by its ratio
//!    to them ([`CounterLedger::ratio`]), those outside any counter value
//!    (a process's last interval) too ([`CounterLedger::correction`]).

use std::time::Instant;

use clrbpf_parse::{
    allocations::{ALLOCATION_SAMPLED_MIN_MAJOR, AllocationSource},
    events::{ClrEvent, RUNTIME_PROVIDER},
};

use crate::profile::{alloc_sampling::estimate, kinds::EventKind};

use super::{
    budget::{CounterLedger, ExceptionGate},
    collector::{BudgetedSession, refresh_keywords_in_background},
    counters::{CounterKind, CounterSample},
    intake::ClrIntake,
    ipc::{DiagnosticClient, DiagnosticPort, IpcError},
    session::{
        ClrEventKinds, ClrSession, LEVEL_INFORMATIONAL, LEVEL_VERBOSE, ProviderConfig,
        SessionEvent, keywords,
    },
};

/// The `System.Runtime` counter of bytes allocated per interval.
const ALLOC_COUNTER: &str = "alloc-rate";
/// Most bytes `alloc-rate` can count in a second (1 TiB: above the memory
/// bandwidth of any host); the counter's values are the target's.
pub const MAX_ALLOCATED_BYTES_PER_SECOND: f64 = (1u64 << 40) as f64;
/// How long a stopped allocation session may take to deliver its last
/// events.
const STOP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
/// Default allocation events with stacks per second and process.
pub const DEFAULT_ALLOCATIONS_PER_SECOND: u32 = 1000;
/// Bytes of events the counter must have covered before its ratio to
/// them scales later events (some 10 ticks).
const MIN_RATIO_BYTES: f64 = 1e6;

/// The provider of the allocation session for a runtime of major version
/// `runtime_major`.
pub fn allocation_provider(runtime_major: Option<u32>) -> ProviderConfig {
    let (keywords, level) = match runtime_major {
        Some(m) if m >= ALLOCATION_SAMPLED_MIN_MAJOR => {
            (keywords::ALLOCATION_SAMPLING, LEVEL_INFORMATIONAL)
        }
        Some(_) => (keywords::GC, LEVEL_VERBOSE),
        None => (keywords::GC | keywords::ALLOCATION_SAMPLING, LEVEL_VERBOSE),
    };
    ProviderConfig {
        name: RUNTIME_PROVIDER.to_owned(),
        keywords,
        level,
        filter: String::new(),
    }
}

/// Starts the allocation session through `client`.
pub fn start_allocation_events(
    client: &DiagnosticClient,
    runtime_major: Option<u32>,
) -> Result<ClrSession, IpcError> {
    let kinds = ClrEventKinds::of(&[EventKind::Allocation]);
    ClrSession::start_providers(client, kinds, &[allocation_provider(runtime_major)])
}

/// Allocation events on a session of their own; see the module
/// documentation.
#[derive(Debug)]
pub struct AllocationEvents {
    gate: Option<ExceptionGate>,
    pub(super) session: BudgetedSession,
    runtime_major: Option<u32>,
    /// Bytes charged by events against those the counter saw (the session
    /// is on from before the counters' baseline).
    ledger: CounterLedger,
    /// Time of the latest event taken.
    last_event_ns: u64,
}

impl AllocationEvents {
    /// `per_second`: events with stacks per second at most (`None`: all).
    pub fn new(per_second: Option<u32>, runtime_major: Option<u32>) -> Self {
        Self {
            gate: per_second.map(ExceptionGate::new),
            session: BudgetedSession::Off,
            runtime_major,
            ledger: CounterLedger::new(MAX_ALLOCATED_BYTES_PER_SECOND),
            last_event_ns: 0,
        }
    }

    pub(super) fn runtime_major(&self) -> Option<u32> {
        self.runtime_major
    }

    pub(super) fn observe_counter(&mut self, sample: &CounterSample) {
        if sample.name == ALLOC_COUNTER && sample.kind == CounterKind::Sum {
            self.ledger
                .on_counter(sample.value, sample.time_ns, sample.interval_sec);
        }
    }

    /// Hands one event to `intake`; returns whether it went over the
    /// budget. The gate acts from the first event: the counter's first
    /// value may be one counter interval away ([`CounterLedger`]).
    pub(super) fn take(
        &mut self,
        intake: &mut ClrIntake,
        event: SessionEvent,
        now_ns: u64,
        gated: bool,
    ) -> bool {
        let mut event = event;
        let ClrEvent::Allocation(allocation) = &mut event.event else {
            return false;
        };
        let time_ns = event.time_ns;
        self.last_event_ns = self.last_event_ns.max(time_ns);
        let bytes = estimate(allocation).bytes;
        // Ticks that count more than the counter saw (.NET Core 3.1) are
        // scaled down as they come, so each window holds its share.
        let ratio = self.ledger.ratio(MIN_RATIO_BYTES);
        if let AllocationSource::Tick { amount } = &mut allocation.source
            && ratio < 1.0
        {
            *amount = (*amount as f64 * ratio).round() as u64;
        }
        let handed = intake.add_allocation(event);
        let over = gated
            && self
                .gate
                .as_mut()
                .is_some_and(|g| g.observe(time_ns, now_ns));
        self.ledger.on_scaled_event(time_ns, bytes, handed, over);
        over
    }

    /// Bytes to add (or, negative, to take away) so that the intake's
    /// match the counter's, not added yet ([`CounterLedger::correction`]).
    /// Only meaningful while no event is still on its way.
    pub(super) fn unobserved(&mut self) -> i64 {
        self.ledger.correction()
    }

    pub(super) fn gate_is_on(&mut self, now_ns: u64) -> bool {
        self.gate.as_mut().is_none_or(|g| g.is_on(now_ns))
    }

    /// How many times the events were turned off over the budget.
    pub fn backoffs(&self) -> u64 {
        self.gate.as_ref().map_or(0, ExceptionGate::backoffs)
    }

    /// One poll: starts the session when due, drains it, stops it over the
    /// budget, and adds the counter's bytes once it is off.
    pub(super) fn poll(
        &mut self,
        port: &DiagnosticPort,
        main_running: bool,
        main_ended: bool,
        intake: &mut ClrIntake,
        warnings: &mut Vec<String>,
    ) -> usize {
        let pid = port.pid();
        let now_ns = crate::profile::monotonic_ns();
        let mut taken = 0;
        let session = std::mem::replace(&mut self.session, BudgetedSession::Ended);
        self.session = match session {
            BudgetedSession::Off if main_ended => BudgetedSession::Ended,
            BudgetedSession::Off if main_running && self.gate_is_on(now_ns) => {
                let (port, major) = (port.clone(), self.runtime_major);
                BudgetedSession::start(move || start_allocation_events(&port.client()?, major))
            }
            BudgetedSession::Starting(job) if job.is_finished() => {
                BudgetedSession::started(job, pid, "allocation", warnings)
            }
            BudgetedSession::Running(mut session) => {
                let mut over = false;
                taken += session.drain(&mut |event| over |= self.take(intake, event, now_ns, true));
                if over {
                    tracing::debug!(
                        pid,
                        "allocation events over the budget: off for the back-off"
                    );
                    session.begin_stop();
                    BudgetedSession::Stopping(session, Instant::now() + STOP_DEADLINE)
                } else if session.has_ended() {
                    BudgetedSession::Stopping(session, Instant::now())
                } else {
                    BudgetedSession::Running(session)
                }
            }
            BudgetedSession::Stopping(mut session, deadline) => {
                taken += session.drain(&mut |event| {
                    self.take(intake, event, now_ns, false);
                });
                if session.has_ended() || Instant::now() >= deadline || main_ended {
                    session.stop(Instant::now(), &mut |event| {
                        self.take(intake, event, now_ns, false);
                    });
                    // Stopped while the gate is open: by its end (the
                    // process exiting), not over the budget.
                    if main_ended || self.gate_is_on(now_ns) {
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
        self.add_unobserved_if_idle(intake, now_ns);
        taken
    }

    /// The counter's bytes beyond the events', once no event is on its way.
    fn add_unobserved_if_idle(&mut self, intake: &mut ClrIntake, now_ns: u64) {
        if matches!(self.session, BudgetedSession::Off | BudgetedSession::Ended) {
            let missing = self.unobserved();
            // Bytes taken away belong to the events that counted them, in
            // their window; bytes added to the time they were seen.
            let at = if missing < 0 {
                self.last_event_ns
            } else {
                now_ns
            };
            if missing != 0 {
                intake.add_unobserved_allocations(at, missing);
            }
        }
    }

    /// Stops the session at the end of the recording, takes its last
    /// events and adds what only the counter saw.
    pub(super) fn stop(&mut self, until: Instant, intake: &mut ClrIntake) {
        let session = std::mem::replace(&mut self.session, BudgetedSession::Ended);
        if let BudgetedSession::Running(session) | BudgetedSession::Stopping(session, _) = session {
            let now_ns = crate::profile::monotonic_ns();
            session.stop(until, &mut |event| {
                self.take(intake, event, now_ns, false);
            });
        }
        self.add_unobserved_if_idle(intake, crate::profile::monotonic_ns());
    }

    /// Sends StopTracing without waiting ([`Self::stop`] drains).
    pub(super) fn begin_stop(&mut self) {
        if let BudgetedSession::Running(session) = &mut self.session {
            session.begin_stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clrbpf_parse::allocations::{Allocation, AllocationHeap, AllocationSource};

    fn rate(value: f64, time_ns: u64) -> CounterSample {
        CounterSample {
            name: ALLOC_COUNTER.to_owned(),
            kind: CounterKind::Sum,
            value,
            interval_sec: 1.0,
            display_units: "B".to_owned(),
            time_ns,
        }
    }

    fn tick(time_ns: u64, amount: u64) -> SessionEvent {
        SessionEvent {
            time_ns,
            thread_id: 1,
            stack: vec![0x1000],
            event: ClrEvent::Allocation(Allocation {
                source: AllocationSource::Tick { amount },
                heap: AllocationHeap::Small,
                type_name: "System.Byte[]".to_owned(),
                type_id: 1,
                object_size: Some(1_000),
            }),
        }
    }

    #[test]
    fn providers_follow_the_runtime_version() {
        let p = allocation_provider(Some(8));
        assert_eq!((p.keywords, p.level), (keywords::GC, LEVEL_VERBOSE));
        let p = allocation_provider(Some(10));
        assert_eq!(
            (p.keywords, p.level),
            (keywords::ALLOCATION_SAMPLING, LEVEL_INFORMATIONAL)
        );
        assert_eq!(
            allocation_provider(None).keywords,
            keywords::GC | keywords::ALLOCATION_SAMPLING
        );
    }

    #[test]
    fn the_counter_fills_in_the_bytes_the_events_missed() {
        const S: u64 = 1_000_000_000;
        let mut events = AllocationEvents::new(Some(5), Some(8));
        let mut intake = ClrIntake::default();
        // Before the counter's first value: the events' bytes.
        for t in 0..5 {
            assert!(!events.take(&mut intake, tick(t, 100_000), 0, true));
        }
        events.observe_counter(&rate(123.0, 100));
        // Then a storm: the 6th event in a second goes over the budget.
        let over = (S..S + 9).map(|t| events.take(&mut intake, tick(t, 100_000), 0, true));
        assert_eq!(over.collect::<Vec<_>>().iter().position(|&o| o), Some(5));
        assert_eq!(events.backoffs(), 1);
        // The counter saw 5 MB after its first value; the events 0.9 MB.
        events.observe_counter(&rate(5_000_000.0, 2 * S));
        assert_eq!(events.unobserved(), 4_100_000);
        assert_eq!(events.unobserved(), 0, "added once");
        let out = intake.finish();
        let bytes: u64 = out.iter().map(|w| w.delay_ns).sum();
        assert_eq!(bytes, 14 * 100_000, "the intake has what was taken");
    }

    /// .NET Core 3.1's ticks count more bytes than were allocated (see
    /// the module documentation): 110 KB each where the counter saw 100 KB.
    /// Once the counter has covered 1 MB of them, later ticks are scaled
    /// down as they come; at the process's exit the ticks after the last
    /// value (which no value will cover) take the same ratio, and the
    /// total is the counter's.
    #[test]
    fn ticks_that_count_more_than_the_counter_are_scaled_to_it() {
        const S: u64 = 1_000_000_000;
        let mut events = AllocationEvents::new(Some(1000), Some(3));
        let mut intake = ClrIntake::default();
        events.observe_counter(&rate(0.0, S));
        // 100 ticks a second for 3.5 s; a value every second.
        for i in 0..350u64 {
            let t = S + 1 + i * S / 100;
            assert!(!events.take(&mut intake, tick(t, 110_000), 0, true));
            if (i + 1) % 100 == 0 {
                let end = S + (i + 1) / 100 * S;
                events.observe_counter(&rate(10_000_000.0, end));
            }
        }
        events.stop(Instant::now(), &mut intake);
        let bytes: u64 = intake.finish().iter().map(|w| w.delay_ns).sum();
        assert_eq!(bytes, 35_000_000, "3 s counted, 0.5 s at the ratio");
    }

    #[test]
    fn an_allocation_storm_at_attach_is_gated_before_the_first_value() {
        const S: u64 = 1_000_000_000;
        let mut events = AllocationEvents::new(Some(5), Some(8));
        let mut intake = ClrIntake::default();
        // The counters' baseline at 10 s, the first value 5 s later: the
        // gate goes off at the 6th event, and the first value counts the
        // 3 MB allocated from the baseline on, 0.6 MB of them in events.
        let over = (0..6).map(|i| {
            let t = 10 * S + (i + 1) * 1000;
            events.take(&mut intake, tick(t, 100_000), 0, true)
        });
        assert_eq!(
            over.collect::<Vec<_>>(),
            [false, false, false, false, false, true]
        );
        events.observe_counter(&CounterSample {
            interval_sec: 5.0,
            ..rate(3_000_000.0, 15 * S)
        });
        assert_eq!(events.unobserved(), 2_400_000);
    }
}
