//! What `record` does with the events of one process's EventPipe session
//! ([`super::session`]) before they become profile samples: pairs
//! ContentionStart/Stop per thread into contentions with a duration, and
//! WaitHandleWaitStart/Stop (.NET 9+) into waits ([`super::waits`]), counts
//! every contention, wait and exception exactly (the per-process counters
//! of the summary), and hands each one to its sampler
//! ([`crate::profile::clr_sampling`]). The kept events come out weighted,
//! with raw stacks still to symbolize like CPU samples' user stacks.

use std::collections::HashMap;

use clrbpf_parse::events::{ClrEvent, ContentionStart, ExceptionThrown, WaitHandleWaitStart};

use super::{
    session::SessionEvent,
    waits::{WaitPairing, WaitSource},
};
use crate::profile::{
    Label,
    alloc_sampling::{AllocationSampler, DEFAULT_ALLOCATION_LIMIT},
    clr_sampling::{
        ContentionSampler, DEFAULT_CONTENTION_LIMIT, DEFAULT_EXCEPTION_LIMIT, ExceptionSampler,
        Weighted,
    },
    kinds::{ALLOCATION_TYPE_LABEL, EventKind},
};

/// Label keys of CLR event samples (OpenTelemetry semantic-convention names).
pub mod clr_label_keys {
    pub const EXCEPTION_TYPE: &str = "exception.type";
    pub const EXCEPTION_MESSAGE: &str = "exception.message";
    pub const LOCK_OWNER_THREAD_ID: &str = "lock.owner.thread.id";
    /// What a wait-handle wait waited in: `wait_handle` or `monitor_wait`.
    pub const WAIT_SOURCE: &str = "wait.source";
    /// The allocated type, as the runtime names it (`System.Byte[]`).
    pub const ALLOCATION_TYPE: &str = super::ALLOCATION_TYPE_LABEL;
    /// The object heap: `soh`, `loh` (large objects) or `poh` (pinned).
    pub const ALLOCATION_HEAP: &str = "allocation.heap";
}

/// The `allocation.type` of an event without a type name.
pub const UNKNOWN_ALLOCATION_TYPE: &str = "[unknown type]";

/// The `exception.type` of exceptions counted while their events were off
/// and before any event showed their shape.
pub const UNOBSERVED_EXCEPTION_TYPE: &str = "[not sampled: events off over the budget]";
/// Window of the samplers' limits.
pub const CLR_WINDOW_NS: u64 = 60 * 1_000_000_000;
/// Threads with an open ContentionStart tracked at most.
const MAX_OPEN_CONTENTIONS: usize = 1 << 16;
/// Longest exception message kept in a label, in bytes.
const MAX_MESSAGE_BYTES: usize = 256;

/// A kept event, still with raw addresses.
#[derive(Clone, Debug, PartialEq)]
pub struct ClrSample {
    pub kind: EventKind,
    pub time_ns: u64,
    pub thread_id: u64,
    /// Return addresses, leaf first.
    pub stack: Vec<u64>,
    pub labels: Vec<Label>,
}

/// Exact per-process counters, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClrCounters {
    pub exceptions: u64,
    pub contentions: u64,
    pub contention_ns: u64,
    /// ContentionStop without a start (attached mid-wait, or lost events)
    /// and without a runtime-measured duration: not counted.
    pub unpaired_contention_stops: u64,
    pub method_loads: u64,
    /// Of [`Self::exceptions`], those the runtime's counter saw while
    /// their events were off over the budget ([`crate::clr::budget`]).
    pub exceptions_without_event: u64,
    /// How many times the exception events were turned off.
    pub exception_backoffs: u64,
    /// Exception events with stacks taken while a session without stack
    /// walks counted every exception ([`ClrIntake::count_exception`]).
    pub exception_stacks: u64,
    /// Whether [`Self::exceptions`] were counted by type from events
    /// without stacks (.NET 9+), rather than from the runtime's counter.
    pub exceptions_counted_by_type: bool,
    /// Wait-handle waits (.NET 9+) with a Start and a Stop, and their time.
    pub waits: u64,
    pub wait_ns: u64,
    /// WaitHandleWaitStop without a Start on its thread: not in the totals.
    pub unpaired_wait_stops: u64,
    /// Waits with a Start and no Stop (open when the stream ended, or their
    /// Stop lost): not in the totals ([`super::waits`]).
    pub unfinished_waits: u64,
    /// Allocation events taken, and the bytes they and the runtime's
    /// counter stand for ([`super::alloc_session`]).
    pub allocation_events: u64,
    pub allocated_bytes: u64,
    /// Of [`Self::allocated_bytes`], those only the counter saw.
    pub allocated_bytes_without_event: u64,
    /// How many times the allocation events were turned off.
    pub allocation_backoffs: u64,
}

impl ClrCounters {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &ClrCounters) {
        let ClrCounters {
            exceptions,
            contentions,
            contention_ns,
            unpaired_contention_stops,
            method_loads,
            exceptions_without_event,
            exception_backoffs,
            exception_stacks,
            exceptions_counted_by_type,
            waits,
            wait_ns,
            unpaired_wait_stops,
            unfinished_waits,
            allocation_events,
            allocated_bytes,
            allocated_bytes_without_event,
            allocation_backoffs,
        } = other;
        // Saturating: the counts come from target-chosen values (the
        // runtime's counter) and add up over every process of a run.
        let sum = |into: &mut u64, more: &u64| *into = into.saturating_add(*more);
        sum(&mut self.exceptions, exceptions);
        sum(&mut self.contentions, contentions);
        sum(&mut self.contention_ns, contention_ns);
        sum(
            &mut self.unpaired_contention_stops,
            unpaired_contention_stops,
        );
        sum(&mut self.method_loads, method_loads);
        sum(&mut self.exceptions_without_event, exceptions_without_event);
        sum(&mut self.exception_backoffs, exception_backoffs);
        sum(&mut self.exception_stacks, exception_stacks);
        self.exceptions_counted_by_type |= exceptions_counted_by_type;
        sum(&mut self.waits, waits);
        sum(&mut self.wait_ns, wait_ns);
        sum(&mut self.unpaired_wait_stops, unpaired_wait_stops);
        sum(&mut self.unfinished_waits, unfinished_waits);
        sum(&mut self.allocation_events, allocation_events);
        sum(&mut self.allocated_bytes, allocated_bytes);
        sum(
            &mut self.allocated_bytes_without_event,
            allocated_bytes_without_event,
        );
        sum(&mut self.allocation_backoffs, allocation_backoffs);
    }
}

#[derive(Debug)]
struct OpenContention {
    time_ns: u64,
    stack: Vec<u64>,
    owner: Option<u64>,
}

/// Per-process intake; see the module documentation.
#[derive(Debug)]
pub struct ClrIntake {
    open: HashMap<u64, OpenContention>,
    contention: ContentionSampler<ClrSample>,
    exceptions: ExceptionSampler<ClrSample>,
    waits: WaitPairing,
    /// Sampled like contention, with a sampler of its own and the same
    /// limit.
    wait_sampler: ContentionSampler<ClrSample>,
    allocations: AllocationSampler<ClrSample>,
    counters: ClrCounters,
    /// CLOCK_MONOTONIC ns when the intake began: no contention or wait it
    /// takes lasted longer than it has run (see [`Self::physical`]).
    started_ns: u64,
    window_ns: u64,
}

impl Default for ClrIntake {
    fn default() -> Self {
        Self::new(
            DEFAULT_CONTENTION_LIMIT,
            DEFAULT_EXCEPTION_LIMIT,
            CLR_WINDOW_NS,
        )
    }
}

impl ClrIntake {
    pub fn new(contention_limit: usize, exception_limit: usize, window_ns: u64) -> Self {
        Self {
            open: HashMap::new(),
            contention: ContentionSampler::new(contention_limit, window_ns, 0x00c0_ffee),
            exceptions: ExceptionSampler::new(exception_limit, window_ns, 0x0bad_cafe),
            waits: WaitPairing::default(),
            wait_sampler: ContentionSampler::new(contention_limit, window_ns, 0x5eed_a175),
            allocations: AllocationSampler::new(DEFAULT_ALLOCATION_LIMIT, window_ns, 0xa110_c8ed),
            counters: ClrCounters::default(),
            started_ns: crate::profile::monotonic_ns(),
            window_ns,
        }
    }

    /// As if the intake had begun at `started_ns` (CLOCK_MONOTONIC), for
    /// tests whose events are older than the intake.
    #[cfg(test)]
    pub fn started_at(mut self, started_ns: u64) -> Self {
        self.started_ns = started_ns;
        self
    }

    /// `duration_ns` as far as it can be true. The duration and the event
    /// times are the target's to choose (a `DurationNs` of 2^63, a Stop a
    /// century after its Start); clrbpf's own clock bounds them: nothing it
    /// takes lasted longer than the intake has run, nor longer than one
    /// sampler window (a longer one counts for the window it ends in).
    fn physical(&self, duration_ns: u64) -> u64 {
        let elapsed = crate::profile::monotonic_ns().saturating_sub(self.started_ns);
        duration_ns.min(elapsed).min(self.window_ns)
    }

    /// An event's time as far as it can be true: no event happened after
    /// now. A target that stamps an event a century on would otherwise
    /// open a sampler window there, and every later event of the process
    /// would fall in it: a window that no event or clock ever closes.
    fn no_later_than_now(time_ns: u64) -> u64 {
        time_ns.min(crate::profile::monotonic_ns())
    }

    pub fn counters(&self) -> ClrCounters {
        ClrCounters {
            unpaired_wait_stops: self.waits.unpaired_stops(),
            unfinished_waits: self.waits.unfinished(),
            ..self.counters
        }
    }

    /// Takes one event. Method events are not handled here (they feed the
    /// symbol index); the caller passes them elsewhere.
    pub fn add(&mut self, event: SessionEvent) {
        let SessionEvent {
            time_ns,
            thread_id,
            stack,
            event,
        } = event;
        let time_ns = Self::no_later_than_now(time_ns);
        match event {
            ClrEvent::ContentionStart(ContentionStart {
                lock_owner_thread_id,
                ..
            }) => {
                if self.open.len() >= MAX_OPEN_CONTENTIONS && !self.open.contains_key(&thread_id) {
                    return;
                }
                self.open.insert(
                    thread_id,
                    OpenContention {
                        time_ns,
                        stack,
                        owner: lock_owner_thread_id,
                    },
                );
            }
            ClrEvent::ContentionStop(stop) => {
                let start = self.open.remove(&thread_id);
                let measured = stop
                    .duration_ns
                    .filter(|d| d.is_finite() && *d >= 0.0)
                    .map(|d| d.min(u64::MAX as f64) as u64);
                let duration_ns = match (&start, measured) {
                    (_, Some(d)) => d,
                    (Some(start), None) => time_ns.saturating_sub(start.time_ns),
                    (None, None) => {
                        self.counters.unpaired_contention_stops += 1;
                        return;
                    }
                };
                let duration_ns = self.physical(duration_ns);
                self.counters.contentions += 1;
                self.counters.contention_ns =
                    self.counters.contention_ns.saturating_add(duration_ns);
                self.contention.offer(time_ns, duration_ns, || {
                    let (stack, owner) = match start {
                        Some(start) if !start.stack.is_empty() => (start.stack, start.owner),
                        Some(start) => (stack, start.owner),
                        None => (stack, None),
                    };
                    let mut labels = Vec::new();
                    if let Some(owner) = owner {
                        labels.push(Label::num(
                            clr_label_keys::LOCK_OWNER_THREAD_ID,
                            i64::try_from(owner).unwrap_or(i64::MAX),
                        ));
                    }
                    ClrSample {
                        kind: EventKind::Contention,
                        time_ns,
                        thread_id,
                        stack,
                        labels,
                    }
                });
            }
            ClrEvent::ExceptionThrown(ExceptionThrown {
                type_name, message, ..
            }) => {
                self.counters.exceptions += 1;
                self.exceptions.offer(time_ns, &type_name, || {
                    exception_sample(time_ns, thread_id, stack, &type_name, &message)
                });
            }
            ClrEvent::WaitHandleWaitStart(WaitHandleWaitStart { wait_source, .. }) => {
                let source = WaitSource::from_event(wait_source);
                self.waits.start(thread_id, time_ns, stack, source);
            }
            ClrEvent::WaitHandleWaitStop(_) => self.end_wait(thread_id, time_ns),
            ClrEvent::Method(_) => self.counters.method_loads += 1,
            ClrEvent::Allocation(_) => {
                self.add_allocation(SessionEvent {
                    time_ns,
                    thread_id,
                    stack,
                    event,
                });
            }
            _ => {}
        }
    }

    /// Counts one exception event of a session without stack walks
    /// ([`crate::clr::session::ClrSession::start_exception_counting`]):
    /// the exact per-type totals, while [`Self::add_exception_shape`]
    /// takes the events with stacks. Other events are ignored.
    pub fn count_exception(&mut self, event: SessionEvent) {
        let ClrEvent::ExceptionThrown(ExceptionThrown {
            type_name, message, ..
        }) = event.event
        else {
            return;
        };
        self.counters.exceptions += 1;
        let (time_ns, thread_id) = (Self::no_later_than_now(event.time_ns), event.thread_id);
        self.exceptions.count(time_ns, &type_name, || {
            exception_sample(time_ns, thread_id, Vec::new(), &type_name, &message)
        });
    }

    /// Takes one exception event with its stack whose exception
    /// [`Self::count_exception`] counts: it gives its type's shape.
    pub fn add_exception_shape(&mut self, event: SessionEvent) {
        let SessionEvent {
            time_ns,
            thread_id,
            stack,
            event:
                ClrEvent::ExceptionThrown(ExceptionThrown {
                    type_name, message, ..
                }),
        } = event
        else {
            return;
        };
        let time_ns = Self::no_later_than_now(time_ns);
        self.counters.exception_stacks += 1;
        self.exceptions.offer_shape(time_ns, &type_name, || {
            exception_sample(time_ns, thread_id, stack, &type_name, &message)
        });
    }

    /// Takes one allocation event (other events are ignored); returns the
    /// bytes it stands for.
    pub fn add_allocation(&mut self, event: SessionEvent) -> f64 {
        let SessionEvent {
            time_ns,
            thread_id,
            stack,
            event: ClrEvent::Allocation(allocation),
        } = event
        else {
            return 0.0;
        };
        let time_ns = Self::no_later_than_now(time_ns);
        self.counters.allocation_events += 1;
        let estimate = self.allocations.offer(time_ns, &allocation, || {
            let type_name = if allocation.type_name.is_empty() {
                UNKNOWN_ALLOCATION_TYPE
            } else {
                allocation.type_name.as_str()
            };
            ClrSample {
                kind: EventKind::Allocation,
                time_ns,
                thread_id,
                stack,
                labels: vec![
                    Label::str(clr_label_keys::ALLOCATION_TYPE, type_name),
                    Label::str(clr_label_keys::ALLOCATION_HEAP, allocation.heap.name()),
                ],
            }
        });
        self.counters.allocated_bytes = self
            .counters
            .allocated_bytes
            .saturating_add(estimate.bytes as u64);
        estimate.bytes
    }

    /// Adds `bytes` allocated by `time_ns` that the runtime's counter saw
    /// while no allocation event stood for them.
    /// Negative: bytes the events counted that the counter did not see
    /// (.NET Core 3.1's ticks count some twice).
    pub fn add_unobserved_allocations(&mut self, time_ns: u64, bytes: i64) {
        let time_ns = Self::no_later_than_now(time_ns);
        self.counters.allocated_bytes = self.counters.allocated_bytes.saturating_add_signed(bytes);
        self.counters.allocated_bytes_without_event = self
            .counters
            .allocated_bytes_without_event
            .saturating_add(bytes.max(0).unsigned_abs());
        self.allocations.add_unobserved(time_ns, bytes);
    }

    /// A WaitHandleWaitStop: the wait it ends, if its Start was seen, is
    /// counted and offered to the wait sampler on the Start's stack.
    fn end_wait(&mut self, thread_id: u64, time_ns: u64) {
        let Some(wait) = self.waits.stop(thread_id, time_ns) else {
            return;
        };
        let duration_ns = self.physical(wait.duration_ns);
        self.counters.waits += 1;
        self.counters.wait_ns = self.counters.wait_ns.saturating_add(duration_ns);
        self.wait_sampler
            .offer(wait.end_ns, duration_ns, || ClrSample {
                kind: EventKind::Wait,
                // Its stack is the Start's: named as the code was then.
                time_ns: wait.start_ns,
                thread_id: wait.thread_id,
                stack: wait.stack,
                labels: vec![Label::str(clr_label_keys::WAIT_SOURCE, wait.source.name())],
            });
    }

    /// Adds `count` exceptions thrown by `time_ns` that the runtime
    /// counted but sent no event for (their events were off over the
    /// budget): they count in the totals and take the shape of the events
    /// ([`ExceptionSampler::add_unobserved`]).
    pub fn add_unobserved_exceptions(&mut self, time_ns: u64, count: u64) {
        let time_ns = Self::no_later_than_now(time_ns);
        self.counters.exceptions = self.counters.exceptions.saturating_add(count);
        self.counters.exceptions_without_event =
            self.counters.exceptions_without_event.saturating_add(count);
        self.exceptions
            .add_unobserved(time_ns, count, || ClrSample {
                kind: EventKind::Exception,
                time_ns,
                thread_id: 0,
                stack: Vec::new(),
                labels: vec![Label::str(
                    clr_label_keys::EXCEPTION_TYPE,
                    UNOBSERVED_EXCEPTION_TYPE,
                )],
            });
    }

    /// Closes the exception window if it ended before `now_ns`
    /// (CLOCK_MONOTONIC), so its samples come out without a later event.
    pub fn close_due(&mut self, now_ns: u64) {
        self.exceptions.close_due(now_ns);
        self.allocations.close_due(now_ns);
    }

    /// Weighted samples of the windows closed so far.
    pub fn take_completed(&mut self) -> Vec<Weighted<ClrSample>> {
        let mut out = self.contention.take_completed();
        out.append(&mut self.exceptions.take_completed());
        out.append(&mut self.wait_sampler.take_completed());
        out.append(&mut self.allocations.take_completed());
        out
    }

    /// Closes the current windows: every kept sample not taken yet.
    pub fn finish(&mut self) -> Vec<Weighted<ClrSample>> {
        let mut out = self.contention.finish();
        out.append(&mut self.exceptions.finish());
        out.append(&mut self.wait_sampler.finish());
        out.append(&mut self.allocations.finish());
        out
    }
}

/// The sample of an exception event, labelled with its type and message.
fn exception_sample(
    time_ns: u64,
    thread_id: u64,
    stack: Vec<u64>,
    type_name: &str,
    message: &str,
) -> ClrSample {
    ClrSample {
        kind: EventKind::Exception,
        time_ns,
        thread_id,
        stack,
        labels: vec![
            Label::str(clr_label_keys::EXCEPTION_TYPE, type_name),
            Label::str(
                clr_label_keys::EXCEPTION_MESSAGE,
                truncate(message, MAX_MESSAGE_BYTES),
            ),
        ],
    }
}

fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use clrbpf_parse::events::ContentionStop;

    fn start(time_ns: u64, tid: u64, owner: Option<u64>) -> SessionEvent {
        SessionEvent {
            time_ns,
            thread_id: tid,
            stack: vec![0x1000, 0x2000],
            event: ClrEvent::ContentionStart(ContentionStart {
                flags: 0,
                clr_instance_id: 0,
                lock_id: None,
                associated_object_id: None,
                lock_owner_thread_id: owner,
            }),
        }
    }

    fn stop(time_ns: u64, tid: u64, duration_ns: Option<f64>) -> SessionEvent {
        SessionEvent {
            time_ns,
            thread_id: tid,
            stack: vec![0x3000],
            event: ClrEvent::ContentionStop(ContentionStop {
                flags: 0,
                clr_instance_id: 0,
                duration_ns,
            }),
        }
    }

    fn exception(time_ns: u64, ty: &str) -> SessionEvent {
        SessionEvent {
            time_ns,
            thread_id: 9,
            stack: vec![0x4000],
            event: ClrEvent::ExceptionThrown(ExceptionThrown {
                type_name: ty.to_owned(),
                message: "é".repeat(300),
                eip: 0,
                hresult: 0,
                flags: 0,
                clr_instance_id: 0,
            }),
        }
    }

    #[test]
    fn contentions_pair_per_thread_and_prefer_the_runtime_duration() {
        let mut intake = ClrIntake::default().started_at(0);
        intake.add(start(100, 1, Some(77)));
        intake.add(start(150, 2, None));
        intake.add(stop(1_100, 1, None));
        intake.add(stop(2_150, 2, Some(1_500.0)));
        intake.add(stop(3_000, 3, None));
        intake.add(stop(3_000, 4, Some(f64::NAN)));
        let counters = intake.counters();
        assert_eq!(counters.contentions, 2);
        assert_eq!(counters.contention_ns, 1_000 + 1_500);
        assert_eq!(counters.unpaired_contention_stops, 2);
        let out = intake.finish();
        assert_eq!(out.len(), 2);
        let first = out
            .iter()
            .find(|w| w.item.thread_id == 1)
            .expect("thread 1");
        assert_eq!(first.delay_ns, 1_000);
        assert_eq!(first.item.stack, vec![0x1000, 0x2000], "stack of the start");
        assert_eq!(
            first.item.labels,
            vec![Label::num(clr_label_keys::LOCK_OWNER_THREAD_ID, 77)]
        );
    }

    fn wait_start(time_ns: u64, tid: u64, source: u8, leaf: u64) -> SessionEvent {
        SessionEvent {
            time_ns,
            thread_id: tid,
            stack: vec![leaf, 0x9000],
            event: ClrEvent::WaitHandleWaitStart(WaitHandleWaitStart {
                wait_source: source,
                associated_object_id: 0,
                clr_instance_id: 0,
            }),
        }
    }

    fn wait_stop(time_ns: u64, tid: u64) -> SessionEvent {
        SessionEvent {
            time_ns,
            thread_id: tid,
            stack: vec![0xdead],
            event: ClrEvent::WaitHandleWaitStop(clrbpf_parse::events::WaitHandleWaitStop {
                clr_instance_id: 0,
            }),
        }
    }

    #[test]
    fn waits_become_samples_on_the_start_stack_with_their_source() {
        let mut intake = ClrIntake::default().started_at(0);
        intake.add(wait_stop(50, 3)); // began before the session
        intake.add(wait_start(100, 1, 0, 0x1000));
        intake.add(wait_start(120, 2, 1, 0x2000));
        intake.add(wait_stop(2_120, 2));
        intake.add(wait_stop(5_100, 1));
        intake.add(wait_start(6_000, 1, 0, 0x3000)); // cut: never ends
        let counters = intake.counters();
        assert_eq!(
            (counters.waits, counters.wait_ns),
            (2, 5_000 + 2_000),
            "exact"
        );
        assert_eq!(counters.unpaired_wait_stops, 1);
        assert_eq!(counters.unfinished_waits, 1);
        assert_eq!(counters.contentions, 0, "waits are not contentions");
        let mut out = intake.finish();
        out.sort_by_key(|w| w.item.thread_id);
        assert_eq!(out.len(), 2);
        for (weighted, (tid, delay, leaf, source)) in out.iter().zip([
            (1, 5_000, 0x1000, "wait_handle"),
            (2, 2_000, 0x2000, "monitor_wait"),
        ]) {
            let Weighted {
                item,
                count,
                delay_ns,
            } = weighted;
            assert_eq!((item.kind, item.thread_id), (EventKind::Wait, tid));
            assert_eq!((*count, *delay_ns), (1, delay));
            assert_eq!(item.stack, vec![leaf, 0x9000], "the Start's stack");
            assert_eq!(
                item.labels,
                vec![Label::str(clr_label_keys::WAIT_SOURCE, source)]
            );
        }
    }

    #[test]
    fn waits_beyond_the_limit_are_sampled_and_upscaled_to_exact_totals() {
        let mut intake = ClrIntake::new(10, 10, CLR_WINDOW_NS).started_at(0);
        let mut total = 0;
        for i in 0..1_000u64 {
            // 1 ms to 100 ms: several duration buckets.
            let duration = (i % 100 + 1) * 1_000_000;
            intake.add(wait_start(i * 200_000_000, i % 7, 0, 0x1000 + i));
            intake.add(wait_stop(i * 200_000_000 + duration, i % 7));
            total += duration;
        }
        assert_eq!(intake.counters().wait_ns, total);
        let out = intake.finish();
        // Four one-minute windows, at most 2 kept per bucket in each.
        assert!(out.len() <= 4 * 10, "{} kept", out.len());
        assert_eq!(out.iter().map(|w| w.count).sum::<u64>(), 1_000);
        assert_eq!(out.iter().map(|w| w.delay_ns).sum::<u64>(), total);
    }

    #[test]
    fn exceptions_are_counted_labelled_and_truncated() {
        let mut intake = ClrIntake::default();
        for i in 0..10 {
            intake.add(exception(i, "System.InvalidOperationException"));
        }
        assert_eq!(intake.counters().exceptions, 10);
        let out = intake.finish();
        assert_eq!(out.iter().map(|w| w.count).sum::<u64>(), 10);
        let labels = &out[0].item.labels;
        assert_eq!(
            labels[0],
            Label::str(
                clr_label_keys::EXCEPTION_TYPE,
                "System.InvalidOperationException"
            )
        );
        let crate::profile::LabelValue::Str(message) = &labels[1].value else {
            panic!("message is a string label");
        };
        assert!(message.len() <= MAX_MESSAGE_BYTES && message.starts_with('é'));
    }

    #[test]
    fn hostile_durations_and_counts_are_bounded_by_the_intake_clock() {
        // Issue 33, defect 1: two ContentionStops of 2^63 ns, waits whose
        // Stop comes ages after their Start, and an exception counter
        // beyond any real one. The intake has run for a second.
        let second = 1_000_000_000;
        let started = crate::profile::monotonic_ns().saturating_sub(second);
        let mut intake = ClrIntake::default().started_at(started);
        let huge = (1u64 << 63) as f64;
        intake.add(stop(10, 1, Some(huge)));
        intake.add(stop(20, 2, Some(huge)));
        intake.add(wait_start(0, 3, 0, 0x1000));
        intake.add(wait_stop(u64::MAX, 3));
        intake.add(exception(30, "A"));
        intake.add(exception(40, "B"));
        intake.add_unobserved_exceptions(50, u64::MAX);
        intake.add_unobserved_exceptions(60, u64::MAX);
        let counters = intake.counters();
        // At most what has elapsed since `started` (a second and the
        // test's own run time).
        let bound = 60 * second;
        assert!(counters.contention_ns <= 2 * bound, "{counters:?}");
        assert!(counters.wait_ns <= bound, "{counters:?}");
        assert_eq!(counters.exceptions, u64::MAX, "saturated, not wrapped");
        let out = intake.finish();
        let delay = |kind| -> u128 {
            out.iter()
                .filter(|w| w.item.kind == kind)
                .map(|w| u128::from(w.delay_ns))
                .sum()
        };
        assert_eq!(
            delay(EventKind::Contention),
            u128::from(counters.contention_ns)
        );
        assert!(delay(EventKind::Contention) <= 2 * u128::from(bound));
        assert_eq!(delay(EventKind::Wait), u128::from(counters.wait_ns));
        let thrown: u128 = out
            .iter()
            .filter(|w| w.item.kind == EventKind::Exception)
            .map(|w| u128::from(w.count))
            .sum();
        // Each type's share saturates at u64::MAX on its own; the sum of
        // two shares may be a little above.
        assert!(thrown >= u128::from(u64::MAX), "{thrown}");
    }

    #[test]
    fn an_event_stamped_in_the_future_holds_no_window_open() {
        // A wait whose Stop a target stamps 146 years on used to open the
        // wait sampler's window there: every later wait of the process
        // fell in it, and it never closed before the process ended.
        let window_ns = 1_000_000;
        let mut intake = ClrIntake::new(10, 10, window_ns);
        intake.add(wait_start(1, 1, 0, 0x1000));
        intake.add(wait_stop(1 << 62, 1));
        std::thread::sleep(std::time::Duration::from_millis(5));
        let now = crate::profile::monotonic_ns();
        intake.add(wait_start(now, 2, 0, 0x2000));
        intake.add(wait_stop(now, 2));
        let closed = intake.take_completed();
        let waits: Vec<_> = closed
            .iter()
            .filter(|w| w.item.kind == EventKind::Wait)
            .collect();
        assert_eq!(waits.len(), 1, "the future-stamped wait's window closed");
        assert!(waits[0].item.time_ns <= now);
        let rest = intake.finish();
        assert_eq!(
            rest.iter()
                .filter(|w| w.item.kind == EventKind::Wait)
                .count(),
            1
        );
    }
}
