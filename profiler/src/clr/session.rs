//! One EventPipe session per profiled .NET process: the source of CLR
//! events (contention, exceptions, waits, method loads) for `record`. It
//! sits between the diagnostic IPC client ([`super::ipc`]) and the samplers
//! of [`crate::profile::clr_sampling`].
//!
//! 1. [`ClrSession::start`] sends CollectTracing2 (provider
//!    `Microsoft-Windows-DotNETRuntime`, the keywords of the chosen
//!    [`ClrEventKinds`] plus Jit | Loader, level Verbose, no rundown) and
//!    keeps the connection: the nettrace stream follows on it.
//! 2. The one reader thread of all sessions ([`super::session_reader`])
//!    feeds the stream to [`NettraceParser`], decodes each event with
//!    [`ClrEventDecoder`], keeps the kinds asked for, converts its
//!    timestamp to CLOCK_MONOTONIC ns (the runtime's tick clock on Linux,
//!    the clock of BPF samples) and sends it over a bounded channel. A full
//!    channel stops the reading of this session alone, so back-pressure
//!    reaches the runtime, which drops events into its own counters
//!    ([`NettraceStats::lost_events`]) rather than us dropping them
//!    silently.
//! 3. [`ClrSession::stop`] sends StopTracing on a second connection and
//!    drains the stream to its end (bounded by a deadline). A target that
//!    exits mid-session just ends the stream: what was read is kept.
//!
//! With [`ClrSession::start_with_counters`] the same session also carries
//! the `System.Runtime` EventCounters ([`super::counters`]): the reader
//! decodes them by their metadata and [`ClrSession::take_counters`] hands
//! them out.
//!
//! Limits: the thread ids are the target's own (its PID namespace); a
//! process in a time namespace has its own CLOCK_MONOTONIC offset.

use std::{
    io::Read,
    sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError, sync_channel},
    time::{Duration, Instant},
};

use clrbpf_parse::{
    events::{ClrDecodeStats, ClrEvent, ClrEventDecoder, RUNTIME_PROVIDER},
    nettrace::{NettraceParser, NettraceStats, ParsedItem, TraceHeader},
};

use super::{
    counters::{CounterSample, counters_provider},
    ipc::{CommandId, DiagnosticClient, IpcError, encode_string},
    jobs::Job,
    session_reader::ReaderTicket,
};
use crate::profile::kinds::{EVENT_KINDS, EventKind};

/// Runtime keywords ([`RUNTIME_PROVIDER`]).
pub mod keywords {
    /// GC: `GCAllocationTick` at level Verbose.
    pub const GC: u64 = 0x1;
    pub const LOADER: u64 = 0x8;
    pub const JIT: u64 = 0x10;
    pub const CONTENTION: u64 = 0x4000;
    pub const EXCEPTION: u64 = 0x8000;
    /// .NET 9+.
    pub const WAIT_HANDLE: u64 = 0x400_0000_0000;
    /// .NET 10+: `AllocationSampled`.
    pub const ALLOCATION_SAMPLING: u64 = 0x800_0000_0000;
}

/// EventPipe levels.
pub const LEVEL_VERBOSE: u32 = 5;
pub const LEVEL_INFORMATIONAL: u32 = 4;
pub const LEVEL_ERROR: u32 = 2;
/// The runtime's session buffer; events beyond it are dropped (and counted).
pub const SESSION_BUFFER_MB: u32 = 64;
/// NetTrace format on the wire.
const FORMAT_NETTRACE: u32 = 1;
/// Batches in flight between the reader thread and the recording loop: one
/// batch holds the events of one read of at most 64 KiB of stream, so
/// this bounds what waits to at most 4 MiB of stream. (A channel of single
/// events allocates all its slots up front: 65,536 of them took 11 MiB per
/// session, and a .NET process has two.)
const CHANNEL_BATCHES: usize = 64;
/// How long the throwaway session of [`ClrSession::refresh_runtime_keywords`]
/// may take to end.
const REFRESH_DEADLINE: Duration = Duration::from_secs(5);
/// Bytes per socket read of a method rundown.
const READ_CHUNK: usize = 64 * 1024;
/// The first .NET with WaitHandle events.
pub const WAIT_HANDLE_MIN_MAJOR: u32 = 9;

/// The runtime side of an [`EventKind`] ([`EVENT_KINDS`] has the
/// profile side): how its events are asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeEventKind {
    pub kind: EventKind,
    /// Its keyword on the main session's [`RUNTIME_PROVIDER`]; `None`: it
    /// has a session of its own (allocations, [`super::alloc_session`]).
    pub keyword: Option<u64>,
    /// The first .NET major version with its events; `None`: every one
    /// clrbpf supports (.NET Core 3.1+).
    pub min_major: Option<u32>,
}

/// The runtime side of every [`EventKind`], in [`EVENT_KINDS`] order.
pub const RUNTIME_EVENT_KINDS: [RuntimeEventKind; 4] = [
    RuntimeEventKind {
        kind: EventKind::Contention,
        keyword: Some(keywords::CONTENTION),
        min_major: None,
    },
    RuntimeEventKind {
        kind: EventKind::Exception,
        keyword: Some(keywords::EXCEPTION),
        min_major: None,
    },
    RuntimeEventKind {
        kind: EventKind::Wait,
        keyword: Some(keywords::WAIT_HANDLE),
        min_major: Some(WAIT_HANDLE_MIN_MAJOR),
    },
    RuntimeEventKind {
        kind: EventKind::Allocation,
        keyword: None,
        min_major: None,
    },
];

impl RuntimeEventKind {
    /// `kind`'s entry in [`RUNTIME_EVENT_KINDS`].
    pub fn of(kind: EventKind) -> &'static Self {
        // The table lists the kinds in declaration order.
        &RUNTIME_EVENT_KINDS[kind as usize]
    }

    /// Whether a runtime of major version `runtime_major` has these events
    /// (an unknown version is given the benefit of the doubt: older
    /// runtimes ignore unknown keyword bits).
    pub fn exists_on(&self, runtime_major: Option<u32>) -> bool {
        match (self.min_major, runtime_major) {
            (Some(min), Some(major)) => major >= min,
            _ => true,
        }
    }
}

/// The event kind a decoded event belongs to; `None` for the method events
/// that name JIT frames, and for events no kind takes.
pub fn kind_of(event: &ClrEvent) -> Option<EventKind> {
    Some(match event {
        ClrEvent::ContentionStart(_) | ClrEvent::ContentionStop(_) => EventKind::Contention,
        ClrEvent::ExceptionThrown(_) => EventKind::Exception,
        ClrEvent::WaitHandleWaitStart(_) | ClrEvent::WaitHandleWaitStop(_) => EventKind::Wait,
        ClrEvent::Allocation(_) => EventKind::Allocation,
        _ => return None,
    })
}

/// Which CLR event kinds to collect: a set of [`EventKind`]s.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct ClrEventKinds(u8);

impl std::fmt::Debug for ClrEventKinds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl ClrEventKinds {
    pub const ALL: Self = Self((1 << EventKind::ALL.len()) - 1);
    pub const NONE: Self = Self(0);

    /// The set of `kinds`.
    pub fn of(kinds: &[EventKind]) -> Self {
        kinds.iter().fold(Self::NONE, |set, &kind| set.with(kind))
    }

    /// This set with `kind` in it.
    pub fn with(self, kind: EventKind) -> Self {
        Self(self.0 | 1 << kind as u8)
    }

    /// This set without `kind`.
    pub fn without(self, kind: EventKind) -> Self {
        Self(self.0 & !(1 << kind as u8))
    }

    pub fn contains(self, kind: EventKind) -> bool {
        self.0 & 1 << kind as u8 != 0
    }

    pub fn iter(self) -> impl Iterator<Item = EventKind> {
        EventKind::ALL
            .into_iter()
            .filter(move |&k| self.contains(k))
    }

    /// Parses the kinds' `--clr-events` words (any subset, comma
    /// separated: `contention,exceptions,waits,allocations`).
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut kinds = Self::NONE;
        for word in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let Some(kind) = EventKind::from_word(word) else {
                let words: Vec<&str> = EVENT_KINDS.iter().map(|s| s.word).collect();
                return Err(format!(
                    "unknown CLR event kind {word:?}: use {}",
                    words.join(", ")
                ));
            };
            kinds = kinds.with(kind);
        }
        Ok(kinds)
    }

    pub fn any(self) -> bool {
        self != Self::NONE
    }

    /// The runtime keywords to enable for these kinds on a runtime of
    /// major version `runtime_major` ([`RuntimeEventKind::exists_on`]).
    /// Jit | Loader are always on: method loads name JIT frames. Kinds
    /// with a session of their own add none.
    pub fn keywords(self, runtime_major: Option<u32>) -> u64 {
        RUNTIME_EVENT_KINDS
            .iter()
            .filter(|k| self.contains(k.kind) && k.exists_on(runtime_major))
            .filter_map(|k| k.keyword)
            .fold(keywords::JIT | keywords::LOADER, |all, k| all | k)
    }

    /// Whether a decoded event is one the recording wants.
    pub fn wants(self, event: &ClrEvent) -> bool {
        match kind_of(event) {
            Some(kind) => self.contains(kind),
            None => matches!(event, ClrEvent::Method(_)),
        }
    }
}

/// One provider of a CollectTracing request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderConfig {
    pub name: String,
    pub keywords: u64,
    pub level: u32,
    /// `key=value;key=value` arguments of the provider (EventSources read
    /// them, e.g. `EventCounterIntervalSec=15`); empty for none.
    pub filter: String,
}

/// The CollectTracing2 payload: buffer size, format, rundown flag and
/// providers (`keywords | level | name | filter data`).
pub fn collect_tracing2_payload(
    buffer_mb: u32,
    request_rundown: bool,
    providers: &[ProviderConfig],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + providers.len() * 96);
    out.extend_from_slice(&buffer_mb.to_le_bytes());
    out.extend_from_slice(&FORMAT_NETTRACE.to_le_bytes());
    out.push(u8::from(request_rundown));
    let count = u32::try_from(providers.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&count.to_le_bytes());
    for provider in providers {
        out.extend_from_slice(&provider.keywords.to_le_bytes());
        out.extend_from_slice(&provider.level.to_le_bytes());
        encode_string(&mut out, &provider.name);
        encode_string(&mut out, &provider.filter);
    }
    out
}

/// First runtime major version whose sessions may ask for no stack walks
/// (CollectTracing3's `requestStackwalk`, runtime PR #84077). .NET 8.0.4
/// answers CollectTracing3 with `DS_IPC_E_UNKNOWN_COMMAND` (measured), and
/// setting `DOTNET_EventPipeEnableStackwalk=0` through the
/// SetEnvironmentVariable command before a session starts leaves its
/// events with stacks: before .NET 9 there is no session without them.
pub const STACKWALK_OPTION_MIN_MAJOR: u32 = 9;

/// The CollectTracing3 payload: [`collect_tracing2_payload`]'s, with the
/// `requestStackwalk` flag after the rundown flag. Runtimes from
/// [`STACKWALK_OPTION_MIN_MAJOR`] on honour it; older ones refuse the
/// command.
pub fn collect_tracing3_payload(
    buffer_mb: u32,
    request_rundown: bool,
    request_stackwalk: bool,
    providers: &[ProviderConfig],
) -> Vec<u8> {
    let mut out = collect_tracing2_payload(buffer_mb, request_rundown, providers);
    // After the buffer size (4), the format (4) and the rundown flag (1).
    out.insert(9, u8::from(request_stackwalk));
    out
}

/// A decoded event with what every consumer needs.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionEvent {
    /// CLOCK_MONOTONIC ns (0 if the stream had no usable header).
    pub time_ns: u64,
    /// OS thread id in the target's PID namespace.
    pub thread_id: u64,
    /// Return addresses, leaf first (empty when the runtime walked none).
    pub stack: Vec<u64>,
    pub event: ClrEvent,
}

/// How a session's stream ended.
#[derive(Clone, Debug, Default)]
pub struct SessionEnd {
    pub stream: NettraceStats,
    pub decode: ClrDecodeStats,
    /// A hard stream error or read failure, for the summary.
    pub error: Option<String>,
    /// Events not delivered because the recording stopped listening.
    pub undelivered: u64,
    /// The trace header's sync tick converted like event times, minus
    /// CLOCK_MONOTONIC when the header arrived: near 0 (the runtime stamps
    /// it at session start) when the runtime's tick clock is the clock of
    /// BPF samples, as on Linux. `None` without a header.
    pub clock_skew_ns: Option<i64>,
    /// `System.Runtime` EventCounters payloads that did not match their
    /// metadata.
    pub counter_errors: u64,
    /// Counter values not taken before [`ClrSession::stop`].
    pub counters: Vec<CounterSample>,
}

#[derive(Debug)]
pub(super) enum SessionMessage {
    Event(SessionEvent),
    Counter(CounterSample),
    Ended(Box<SessionEnd>),
}

/// A running EventPipe session; see the module documentation.
#[derive(Debug)]
pub struct ClrSession {
    client: DiagnosticClient,
    session_id: u64,
    receiver: Receiver<Vec<SessionMessage>>,
    /// The rest of the batch being handed out.
    inbox: std::vec::IntoIter<SessionMessage>,
    /// Its stream's place on the reader thread ([`super::session_reader`]).
    reader: Option<ReaderTicket>,
    /// StopTracing, sent from the job pool by [`Self::begin_stop`].
    stopper: Option<Job<Result<(), IpcError>>>,
    end: Option<SessionEnd>,
    /// Counter values not yet taken, at most [`MAX_PENDING_COUNTERS`].
    counters: Vec<CounterSample>,
}

/// Counter values a session holds before they are taken: a few minutes of
/// the runtime's ~25 counters at the shortest interval.
const MAX_PENDING_COUNTERS: usize = 4096;

impl ClrSession {
    /// Starts a streaming session for `kinds` in the runtime `client`
    /// talks to.
    pub fn start(
        client: &DiagnosticClient,
        kinds: ClrEventKinds,
        runtime_major: Option<u32>,
    ) -> Result<Self, IpcError> {
        Self::start_with_counters(client, kinds, runtime_major, None)
    }

    /// [`Self::start`], also enabling the `System.Runtime` EventCounters
    /// every `counters_interval_sec` seconds when given: their values
    /// arrive through [`Self::take_counters`].
    pub fn start_with_counters(
        client: &DiagnosticClient,
        kinds: ClrEventKinds,
        runtime_major: Option<u32>,
        counters_interval_sec: Option<u32>,
    ) -> Result<Self, IpcError> {
        let provider = ProviderConfig {
            name: RUNTIME_PROVIDER.to_owned(),
            keywords: kinds.keywords(runtime_major),
            level: LEVEL_VERBOSE,
            filter: String::new(),
        };
        let mut providers = vec![provider];
        if let Some(interval_sec) = counters_interval_sec {
            providers.push(counters_provider(interval_sec));
        }
        Self::start_providers(client, kinds, &providers)
    }

    /// A session of exception events alone, at level Error: the runtime
    /// then writes ExceptionThrown (level Error) and none of the catch,
    /// finally and filter events (Informational), so it walks one stack
    /// per throw instead of several. The collector's budget turns it off
    /// and on ([`super::budget`]).
    pub fn start_exception_events(client: &DiagnosticClient) -> Result<Self, IpcError> {
        let (kinds, provider) = exceptions_at_level_error();
        Self::start_providers(client, kinds, &[provider])
    }

    /// A session of exception events without stacks (CollectTracing3,
    /// `requestStackwalk` false; .NET 9 and later): the runtime writes each
    /// ExceptionThrown with its type and message but walks no stack, so
    /// it can stay on through a storm and count every exception by type
    /// while [`Self::start_exception_events`]'s session is off over the
    /// budget ([`super::budget`]).
    pub fn start_exception_counting(client: &DiagnosticClient) -> Result<Self, IpcError> {
        let (kinds, provider) = exceptions_at_level_error();
        let payload = collect_tracing3_payload(SESSION_BUFFER_MB, false, false, &[provider]);
        Self::start_payload(client, kinds, CommandId::COLLECT_TRACING_3, &payload)
    }

    /// Makes the runtime recompute which runtime keywords are on, after the
    /// exception session stopped. EventPipe computes a provider's keywords
    /// for all sessions before it takes a stopping session out of its list,
    /// so the runtime still sees the Exception keyword on and prepares each
    /// exception's event (type name, message) for nothing, at a sixth of a
    /// storm's throughput (measured, .NET 8). Starting and stopping a
    /// session with the runtime provider (Loader at level Error: no event)
    /// makes it compute them again over the sessions left.
    pub fn refresh_runtime_keywords(client: &DiagnosticClient) -> Result<(), IpcError> {
        let provider = ProviderConfig {
            name: RUNTIME_PROVIDER.to_owned(),
            keywords: keywords::LOADER,
            level: LEVEL_ERROR,
            filter: String::new(),
        };
        let session = Self::start_providers(client, ClrEventKinds::NONE, &[provider])?;
        // Sent from this thread (a job of the pool, which must not wait on
        // another job): the session carries no event, so nothing fills
        // its channel while StopTracing waits for the runtime's flush.
        let stopped = client.stop_tracing(session.session_id);
        session.finish(Instant::now() + REFRESH_DEADLINE, &mut |_| {});
        stopped
    }

    pub(super) fn start_providers(
        client: &DiagnosticClient,
        kinds: ClrEventKinds,
        providers: &[ProviderConfig],
    ) -> Result<Self, IpcError> {
        let payload = collect_tracing2_payload(SESSION_BUFFER_MB, false, providers);
        Self::start_payload(client, kinds, CommandId::COLLECT_TRACING_2, &payload)
    }

    /// Starts a session with `command` (CollectTracing2 or 3) and its
    /// `payload`.
    fn start_payload(
        client: &DiagnosticClient,
        kinds: ClrEventKinds,
        command: CommandId,
        payload: &[u8],
    ) -> Result<Self, IpcError> {
        let pid = client.pid();
        let (stream, session_id) = client.collect_tracing_with(command, payload)?;
        let (sender, receiver) = sync_channel(CHANNEL_BATCHES);
        let reader =
            super::session_reader::attach(pid, stream, kinds, sender).map_err(|source| {
                IpcError::Io {
                    pid,
                    command,
                    source,
                }
            })?;
        tracing::debug!(pid, session_id, "EventPipe session started");
        Ok(Self {
            client: client.clone(),
            session_id,
            receiver,
            inbox: Vec::new().into_iter(),
            reader: Some(reader),
            stopper: None,
            end: None,
            counters: Vec::new(),
        })
    }

    /// The counter values received so far (see
    /// [`Self::start_with_counters`]), oldest first; call after
    /// [`Self::drain`], which collects them.
    pub fn take_counters(&mut self) -> Vec<CounterSample> {
        std::mem::take(&mut self.counters)
    }

    /// The host pid.
    pub fn pid(&self) -> u32 {
        self.client.pid()
    }

    /// Hands every event received so far to `on_event`; returns how many.
    pub fn drain(&mut self, on_event: &mut impl FnMut(SessionEvent)) -> usize {
        let mut n = 0;
        while self.end.is_none() {
            let message = match self.inbox.next() {
                Some(message) => message,
                None => match self.receiver.try_recv() {
                    Ok(batch) => {
                        self.inbox = batch.into_iter();
                        continue;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.end = Some(SessionEnd {
                            error: Some("the session reader stopped".to_owned()),
                            ..SessionEnd::default()
                        });
                        break;
                    }
                },
            };
            if let SessionMessage::Event(_) = message {
                n += 1;
            }
            self.handle(message, on_event);
        }
        n
    }

    fn handle(&mut self, message: SessionMessage, on_event: &mut impl FnMut(SessionEvent)) {
        match message {
            SessionMessage::Event(event) => on_event(event),
            SessionMessage::Counter(sample) => self.keep_counter(sample),
            SessionMessage::Ended(end) => self.end = Some(*end),
        }
    }

    fn keep_counter(&mut self, sample: CounterSample) {
        if self.counters.len() >= MAX_PENDING_COUNTERS {
            self.counters.remove(0);
        }
        self.counters.push(sample);
    }

    /// Whether the stream has ended (target exited or session stopped).
    pub fn has_ended(&self) -> bool {
        self.end.is_some()
    }

    /// Stops the session, hands the remaining events to `on_event` and
    /// returns how the stream ended. Waits until `until` at most for the
    /// end of the stream; the StopTracing error, if any, is returned too (it
    /// is normal when the process has exited).
    pub fn stop(
        mut self,
        until: Instant,
        on_event: &mut impl FnMut(SessionEvent),
    ) -> (SessionEnd, Option<IpcError>) {
        self.begin_stop();
        self.finish(until, on_event)
    }

    /// Hands out what is left until the stream's end (StopTracing sent).
    fn finish(
        mut self,
        until: Instant,
        on_event: &mut impl FnMut(SessionEvent),
    ) -> (SessionEnd, Option<IpcError>) {
        while self.end.is_none() {
            if crate::stop::hurry() {
                self.end = Some(SessionEnd {
                    error: Some(
                        "stopped before the stream ended (a second stop request)".to_owned(),
                    ),
                    ..SessionEnd::default()
                });
                break;
            }
            // In short steps, so a second stop request is seen at once.
            let left = until
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(50));
            if let Some(message) = self.inbox.next() {
                self.handle(message, on_event);
                continue;
            }
            match self.receiver.recv_timeout(left) {
                Ok(batch) => self.inbox = batch.into_iter(),
                Err(RecvTimeoutError::Timeout) if Instant::now() < until => {}
                Err(RecvTimeoutError::Timeout) => {
                    self.end = Some(SessionEnd {
                        error: Some(
                            "the stream did not end in time after StopTracing (the runtime is stopped or overloaded)"
                                .to_owned(),
                        ),
                        ..SessionEnd::default()
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.end = Some(SessionEnd {
                        error: Some("the session reader stopped".to_owned()),
                        ..SessionEnd::default()
                    });
                }
            }
        }
        // The reader thread closes the stream, ended or not (a stopped
        // process may never end it).
        drop(self.reader.take());
        // Likewise StopTracing: a runtime that never answers it is not
        // waited for (the client's deadline ends that thread).
        let stop_error = self
            .stopper
            .take()
            .filter(Job::is_finished)
            .and_then(|stopper| stopper.join().ok().and_then(Result::err));
        let mut end = self.end.take().unwrap_or_default();
        end.counters = std::mem::take(&mut self.counters);
        (end, stop_error)
    }

    /// Sends StopTracing without waiting: the end of a recording stops
    /// every process's session at once, then drains them against one
    /// deadline ([`Self::stop`]).
    pub fn begin_stop(&mut self) {
        // StopTracing is answered only once the runtime has flushed the
        // session into the stream: it is sent from another thread while
        // this one keeps draining, or a full channel would stall both sides.
        if self.end.is_none() && self.stopper.is_none() {
            self.stopper = Some(stop_in_background(&self.client, self.session_id));
        }
    }
}

/// Method rundown for catch-up on runtimes that cannot write perf maps on
/// request (.NET Core 3.x-7): a throw-away session with `requestRundown`,
/// stopped at once, makes the runtime list every method compiled so far
/// (MethodDCEndVerbose). Start the streaming session first, so a method
/// compiled during the rundown is in one of the two (seed 004: enumerate
/// after the events are on; duplicates are harmless, the index keys them
/// by address and time). Blocks up to `deadline`; returns the methods the
/// stream held by then, and an error string if it did not end cleanly.
pub fn method_rundown(
    client: &DiagnosticClient,
    deadline: Duration,
) -> Result<(Vec<clrbpf_parse::events::MethodLoad>, Option<String>), IpcError> {
    // A session needs a provider; level Informational keeps the verbose
    // method events of the live process out of this one.
    let provider = ProviderConfig {
        name: RUNTIME_PROVIDER.to_owned(),
        keywords: keywords::JIT | keywords::LOADER,
        level: 4,
        filter: String::new(),
    };
    let payload = collect_tracing2_payload(SESSION_BUFFER_MB, true, &[provider]);
    let (mut stream, session_id) = client.collect_tracing(&payload)?;
    // The runtime writes the rundown before it answers StopTracing: read
    // the stream here while another thread waits for the answer. A thread
    // of its own, not a job: this runs on the job pool, and a job waiting
    // on a job queued behind it could wait for ever.
    let stopper = {
        let client = client.clone();
        std::thread::spawn(move || client.stop_tracing(session_id))
    };
    let until = Instant::now() + deadline;
    let mut parser = crate::memory_budget::nettrace_parser();
    let mut decoder = ClrEventDecoder::new();
    let mut methods = Vec::new();
    let mut buf = vec![0u8; READ_CHUNK];
    let mut error = None;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            error = Some(format!("rundown did not end within {deadline:?}"));
            break;
        }
        if let Err(e) = stream.set_read_timeout(Some(left)) {
            error = Some(e.to_string());
            break;
        }
        let n = match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                error = Some(format!("reading the rundown stream: {e}"));
                break;
            }
        };
        let fed = parser.feed(&buf[..n], &mut |item| {
            if let ParsedItem::Event(record) = item
                && let Some(ClrEvent::Method(method)) = decoder.decode(&record)
            {
                methods.push(method);
            }
        });
        if let Err(e) = fed {
            error = Some(e.to_string());
            break;
        }
    }
    if error.is_none()
        && let Err(e) = parser.finish()
    {
        error = Some(e.to_string());
    }
    match stopper.join() {
        Ok(Err(e)) if methods.is_empty() => return Err(e),
        Ok(Err(e)) => error = error.or_else(|| Some(e.to_string())),
        _ => {}
    }
    Ok((methods, error))
}

/// Sends StopTracing from the job pool; join it for the result.
fn stop_in_background(client: &DiagnosticClient, session_id: u64) -> Job<Result<(), IpcError>> {
    let client = client.clone();
    super::jobs::spawn(move || client.stop_tracing(session_id))
}

/// How far the runtime's event clock (at the trace header's sync point)
/// is from CLOCK_MONOTONIC, the clock of BPF samples; warns when it is
/// clearly another clock.
pub(super) fn clock_skew(header: &TraceHeader) -> Option<i64> {
    let skew = header
        .ticks_to_ns(header.sync_time_qpc)
        .map(|t| t as i64 - crate::profile::monotonic_ns() as i64);
    if skew.is_some_and(|skew| skew.abs() > 10_000_000_000) {
        tracing::warn!(
            clock_skew_ns = ?skew,
            "the runtime's event clock is not CLOCK_MONOTONIC: CLR event times are off"
        );
    }
    skew
}

/// Warns once for `pid` when its stream defined more metadata than the
/// parser keeps.
pub(super) fn warn_if_metadata_over_budget(pid: u32, parser: &NettraceParser) {
    if let Some(clrbpf_parse::nettrace::NettraceError::MetadataOverBudget { max_bytes }) =
        parser.last_soft_error()
    {
        let max_bytes = *max_bytes;
        crate::memory_budget::warn_once(pid, crate::memory_budget::OverBudget::Nettrace, || {
            format!(
                "pid {pid}'s event stream defines more metadata than its {max_bytes}-byte bound or the budget's share for event streams: records dropped"
            )
        });
    }
}

/// The runtime provider's exception events at level Error, the one
/// provider of both exception sessions (with stacks, and counting).
fn exceptions_at_level_error() -> (ClrEventKinds, ProviderConfig) {
    let kinds = ClrEventKinds::of(&[EventKind::Exception]);
    let provider = ProviderConfig {
        name: RUNTIME_PROVIDER.to_owned(),
        keywords: keywords::EXCEPTION,
        level: LEVEL_ERROR,
        filter: String::new(),
    };
    (kinds, provider)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collect_tracing3_adds_the_stackwalk_flag_after_the_rundown_flag() {
        let providers = [ProviderConfig {
            name: RUNTIME_PROVIDER.to_owned(),
            keywords: keywords::EXCEPTION,
            level: LEVEL_ERROR,
            filter: String::new(),
        }];
        let two = collect_tracing2_payload(64, true, &providers);
        let three = collect_tracing3_payload(64, true, false, &providers);
        // buffer | format | requestRundown | requestStackwalk | providers
        assert_eq!(three.len(), two.len() + 1);
        assert_eq!(three[..9], two[..9]);
        assert_eq!(three[9], 0);
        assert_eq!(three[10..], two[9..]);
        assert_eq!(collect_tracing3_payload(64, true, true, &providers)[9], 1);
    }

    #[test]
    fn payload_matches_the_documented_collect_tracing2_request() {
        // dotnet/diagnostics ipc-protocol.md (CollectTracing2), dotnet/runtime#42382,
        // except that we send an empty filter as count 0.
        let payload = collect_tracing2_payload(
            256,
            true,
            &[ProviderConfig {
                name: RUNTIME_PROVIDER.to_owned(),
                keywords: 0xFFFF_FFFF_FFFF_FFBF,
                level: 5,
                filter: String::new(),
            }],
        );
        let mut expected = vec![0, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0];
        expected.extend_from_slice(&[0xbf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        expected.extend_from_slice(&[5, 0, 0, 0, 32, 0, 0, 0]);
        for unit in "Microsoft-Windows-DotNETRuntime\0".encode_utf16() {
            expected.extend_from_slice(&unit.to_le_bytes());
        }
        expected.extend_from_slice(&[0, 0, 0, 0]);
        assert_eq!(payload, expected);
    }

    #[test]
    fn kinds_parse_and_choose_keywords() {
        let kinds = ClrEventKinds::parse("contention, exceptions").expect("valid");
        assert_eq!(
            kinds,
            ClrEventKinds::of(&[EventKind::Contention, EventKind::Exception])
        );
        assert_eq!(format!("{kinds:?}"), "{Contention, Exception}");
        let allocations = ClrEventKinds::parse("allocations").expect("valid");
        assert!(allocations.contains(EventKind::Allocation) && allocations.any());
        assert!(!allocations.contains(EventKind::Wait));
        assert_eq!(ClrEventKinds::ALL.iter().count(), EventKind::ALL.len());
        for (runtime, table) in RUNTIME_EVENT_KINDS.iter().zip(&EVENT_KINDS) {
            assert_eq!(runtime.kind, table.kind, "the two tables in one order");
            assert_eq!(RuntimeEventKind::of(runtime.kind), runtime);
        }
        let waits = RuntimeEventKind::of(EventKind::Wait);
        assert!(!waits.exists_on(Some(8)) && waits.exists_on(Some(9)) && waits.exists_on(None));
        assert_eq!(
            allocations.keywords(Some(8)),
            keywords::JIT | keywords::LOADER,
            "allocations have a session of their own"
        );
        let unknown = ClrEventKinds::parse("locks").expect_err("unknown");
        assert!(
            unknown.contains("use contention, exceptions, waits, allocations"),
            "{unknown}"
        );
        assert!(!ClrEventKinds::parse("").expect("empty").any());
        assert_eq!(
            ClrEventKinds::ALL.keywords(Some(8)),
            0x4000 | 0x8000 | 0x10 | 0x8
        );
        assert_eq!(
            ClrEventKinds::ALL.keywords(Some(9)),
            0x4000 | 0x8000 | 0x10 | 0x8 | 0x400_0000_0000
        );
        for later in [Some(10), Some(11), None] {
            assert_ne!(
                ClrEventKinds::ALL.keywords(later) & keywords::WAIT_HANDLE,
                0,
                "{later:?}"
            );
        }
        assert_eq!(ClrEventKinds::NONE.keywords(None), 0x18);
    }
}
