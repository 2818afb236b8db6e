//! One thread reads every EventPipe session of the host: the stage between
//! the runtimes' sockets and each [`super::session::ClrSession`]'s channel.
//! A thread per session cost a .NET process two threads (its main and its
//! exception session), each with a stack, a malloc arena and a 64 KiB read
//! buffer, for processes that send a few counter values a second.
//!
//! 1. [`attach`] hands a session's stream, made non-blocking, to the reader
//!    thread (started on first use) through a command queue and an eventfd.
//! 2. The thread waits in `epoll_wait` (level-triggered) and, per readable
//!    stream, reads one chunk into its one buffer, feeds that session's
//!    [`StreamDecoder`] and sends the batch on the session's bounded
//!    channel with `try_send`.
//! 3. Back-pressure stays per session: a full channel parks the batch and
//!    takes the stream out of the wait set until the batch is delivered
//!    (retried every [`RETRY_FULL`]), so the runtime's own buffer fills and
//!    it counts what it drops, as when a reader thread blocked on a send.
//!    The other sessions are read on.
//! 4. The end of a stream (the session stopped, the process exited, or a
//!    read failed) is sent as the session's [`SessionMessage::Ended`];
//!    dropping the [`ReaderTicket`] closes the stream, ended or not.
//! 5. Each delivery notes the session's pid for the pipeline
//!    ([`take_delivered`]), which then drains those sessions and leaves
//!    the idle ones alone; a batch parked on a full channel also wakes the
//!    recording loop at once ([`channel_full`]).

use std::{
    collections::HashMap,
    io::{self, Read as _},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::net::UnixStream,
    },
    sync::{
        Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
        mpsc::{SyncSender, TrySendError},
    },
    time::Duration,
};

use clrbpf_parse::{
    events::ClrEventDecoder,
    nettrace::{NettraceParser, ParsedItem, TraceHeader},
};

use super::{
    counters::CounterDecoder,
    session::{ClrEventKinds, SessionEnd, SessionEvent, SessionMessage},
};

/// Bytes per socket read, one buffer for all sessions.
const READ_CHUNK: usize = 64 * 1024;
/// How often a batch parked on a full channel is offered again.
const RETRY_FULL: Duration = Duration::from_millis(5);
/// Readiness events taken per `epoll_wait`.
const MAX_EVENTS: usize = 64;
/// The epoll key of the wake-up eventfd (session ids start at 1).
const WAKE_KEY: u64 = 0;
/// Pids noted for [`take_delivered`] at most.
const MAX_DELIVERED: usize = 4096;

/// One session's stream decoding: nettrace -> CLR events and counter
/// values, with the clock conversion. Owned by the reader thread.
pub(super) struct StreamDecoder {
    pid: u32,
    kinds: ClrEventKinds,
    parser: NettraceParser,
    decoder: ClrEventDecoder,
    counter_decoder: CounterDecoder,
    counter_errors: u64,
    header: Option<TraceHeader>,
    clock_skew_ns: Option<i64>,
}

impl StreamDecoder {
    pub(super) fn new(pid: u32, kinds: ClrEventKinds) -> Self {
        Self {
            pid,
            kinds,
            parser: crate::memory_budget::nettrace_parser(),
            decoder: ClrEventDecoder::new(),
            counter_decoder: CounterDecoder::new(),
            counter_errors: 0,
            header: None,
            clock_skew_ns: None,
        }
    }

    /// Decodes `bytes` of the stream into `batch`; a hard stream error
    /// ends the session.
    pub(super) fn feed(
        &mut self,
        bytes: &[u8],
        batch: &mut Vec<SessionMessage>,
    ) -> Result<(), String> {
        let Self {
            pid,
            kinds,
            parser,
            decoder,
            counter_decoder,
            counter_errors,
            header,
            clock_skew_ns,
        } = self;
        let fed = parser.feed(bytes, &mut |item| match item {
            ParsedItem::Trace(h) => {
                *header = Some(*h);
                *clock_skew_ns = super::session::clock_skew(h);
            }
            ParsedItem::Metadata(metadata) => counter_decoder.on_metadata(metadata),
            ParsedItem::Event(record) => {
                match counter_decoder.decode(&record) {
                    Some(Ok(mut sample)) => {
                        sample.time_ns = header
                            .and_then(|h| h.ticks_to_ns(record.timestamp))
                            .unwrap_or(0);
                        batch.push(SessionMessage::Counter(sample));
                        return;
                    }
                    Some(Err(error)) => {
                        *counter_errors += 1;
                        tracing::debug!(%error, "undecodable EventCounters payload");
                        return;
                    }
                    None => {}
                }
                let Some(event) = decoder.decode(&record) else {
                    return;
                };
                if !kinds.wants(&event) {
                    return;
                }
                let time_ns = header
                    .and_then(|h| h.ticks_to_ns(record.timestamp))
                    .unwrap_or(0);
                batch.push(SessionMessage::Event(SessionEvent {
                    time_ns,
                    thread_id: record.thread_id,
                    stack: record.stack.map(<[u64]>::to_vec).unwrap_or_default(),
                    event,
                }));
            }
            _ => {}
        });
        super::session::warn_if_metadata_over_budget(*pid, parser);
        fed.map_err(|e| e.to_string())
    }

    /// How the stream ended; `error` is a read or stream error already
    /// seen.
    pub(super) fn end(mut self, mut error: Option<String>, undelivered: u64) -> SessionEnd {
        if error.is_none()
            && let Err(e) = self.parser.finish()
        {
            // A runtime that exits normally, or stops the session when
            // asked, ends the stream with its end tag; a stream cut without
            // it lost whatever the runtime still buffered (the process was
            // killed or crashed, or something cut the connection).
            error = Some(format!(
                "it ended without its end-of-stream tag ({e}): the process was killed or crashed"
            ));
        }
        SessionEnd {
            stream: *self.parser.stats(),
            decode: self.decoder.stats().clone(),
            error,
            undelivered,
            clock_skew_ns: self.clock_skew_ns,
            counter_errors: self.counter_errors,
            counters: Vec::new(),
        }
    }
}

/// A session's place on the reader thread; dropping it closes the stream.
#[derive(Debug)]
pub(super) struct ReaderTicket {
    key: u64,
}

impl Drop for ReaderTicket {
    fn drop(&mut self) {
        if let Some(Ok(reader)) = READER.get() {
            reader.command(Command::Close(self.key));
        }
    }
}

/// Hands `stream` to the reader thread: its events and counter values go
/// to `sender` in batches, then its [`SessionMessage::Ended`].
pub(super) fn attach(
    pid: u32,
    stream: UnixStream,
    kinds: ClrEventKinds,
    sender: SyncSender<Vec<SessionMessage>>,
) -> io::Result<ReaderTicket> {
    let reader = READER
        .get_or_init(Reader::start)
        .as_ref()
        .map_err(|e| io::Error::new(e.kind(), e.to_string()))?;
    stream.set_nonblocking(true)?;
    let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    reader.command(Command::Add(
        key,
        Box::new(Stream {
            pid,
            stream,
            decoder: Some(StreamDecoder::new(pid, kinds)),
            sender,
            parked: None,
        }),
    ));
    Ok(ReaderTicket { key })
}

static READER: OnceLock<io::Result<Reader>> = OnceLock::new();
static NEXT_KEY: AtomicU64 = AtomicU64::new(WAKE_KEY + 1);
/// Pids whose sessions were sent messages since [`take_delivered`].
static DELIVERED: Mutex<Vec<u32>> = Mutex::new(Vec::new());
/// Notified when a session's channel is full.
static CHANNEL_FULL: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// The pids whose sessions were sent events, counters or their end since
/// the last call (each once): the sessions worth draining now.
pub fn take_delivered() -> Vec<u32> {
    let mut pids = std::mem::take(
        &mut *DELIVERED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    pids.sort_unstable();
    pids
}

/// Notes that `pid`'s session was sent something. Each pid is noted once
/// until taken; past [`MAX_DELIVERED`] pids (no pipeline takes them) the
/// rest are not noted: a pipeline drains every session at its backstop.
fn note_delivered(pid: u32) {
    let mut pids = DELIVERED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if pids.len() < MAX_DELIVERED && !pids.contains(&pid) {
        pids.push(pid);
    }
}

/// Resolves when a session's channel was found full (its batch parked):
/// the loop should drain the sessions ([`take_delivered`]) now rather than
/// at its next tick. Cancel safe; a notification with no waiter is kept
/// for the next wait.
pub async fn channel_full() {
    CHANNEL_FULL.notified().await;
}

enum Command {
    Add(u64, Box<Stream>),
    Close(u64),
}

struct Stream {
    pid: u32,
    stream: UnixStream,
    /// `None` once its end is sent (or parked): nothing more is read.
    decoder: Option<StreamDecoder>,
    sender: SyncSender<Vec<SessionMessage>>,
    /// Messages the full channel did not take yet. While there are, the
    /// stream is out of the epoll set (level-triggered, a hung-up socket
    /// would be reported on every wait even with no events asked for).
    parked: Option<Vec<SessionMessage>>,
}

/// The epoll set and the command queue shared with the thread.
struct Reader {
    /// Held open for the thread, which waits on it by its raw fd.
    _epoll: OwnedFd,
    wake: OwnedFd,
    commands: Mutex<Vec<Command>>,
}

impl Reader {
    fn start() -> io::Result<Self> {
        // SAFETY: plain syscalls; the fds returned are checked and owned.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd of ours.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        // SAFETY: as above.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd of ours.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        ctl(
            epoll.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            wake.as_raw_fd(),
            WAKE_KEY,
            true,
        )?;
        let (epoll_fd, wake_fd) = (epoll.as_raw_fd(), wake.as_raw_fd());
        std::thread::Builder::new()
            .name("clrbpf-events".to_owned())
            .spawn(move || {
                crate::process::priority::enter_background_thread();
                // Waits for `READER` to hold the queue: this thread is
                // started from inside its initialisation.
                let reader = loop {
                    if let Some(Ok(reader)) = READER.get() {
                        break reader;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                };
                run(reader, epoll_fd, wake_fd);
            })?;
        Ok(Self {
            _epoll: epoll,
            wake,
            commands: Mutex::new(Vec::new()),
        })
    }

    fn command(&self, command: Command) {
        self.commands
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(command);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd; a full
        // counter (never, at 2^64) would only lose a wake-up already due.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

/// `epoll_ctl` for `fd` under `key`, waiting for input or not.
fn ctl(epoll: RawFd, op: libc::c_int, fd: RawFd, key: u64, input: bool) -> io::Result<()> {
    let mut event = libc::epoll_event {
        events: if input { libc::EPOLLIN as u32 } else { 0 },
        u64: key,
    };
    // SAFETY: a valid epoll fd and event struct.
    if unsafe { libc::epoll_ctl(epoll, op, fd, &mut event) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The reader thread.
fn run(reader: &Reader, epoll: RawFd, wake: RawFd) {
    let mut streams: HashMap<u64, Stream> = HashMap::new();
    let mut buf = vec![0u8; READ_CHUNK];
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; MAX_EVENTS];
    loop {
        let commands = std::mem::take(
            &mut *reader
                .commands
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for command in commands {
            match command {
                Command::Add(key, stream) => {
                    let mut stream = *stream;
                    let fd = stream.stream.as_raw_fd();
                    if let Err(error) = ctl(epoll, libc::EPOLL_CTL_ADD, fd, key, true) {
                        end(
                            &mut stream,
                            Some(format!("cannot wait for the stream: {error}")),
                        );
                    }
                    streams.insert(key, stream);
                }
                // Dropping the socket takes it out of the epoll set.
                Command::Close(key) => drop(streams.remove(&key)),
            }
        }
        // Offer parked messages again; a stream whose messages went is
        // read again, or forgotten after its end.
        streams.retain(|&key, stream| {
            if stream.parked.is_none() {
                return true;
            }
            match deliver_parked(stream) {
                Delivery::Sent if stream.decoder.is_none() => false,
                Delivery::Sent => {
                    let fd = stream.stream.as_raw_fd();
                    if let Err(error) = ctl(epoll, libc::EPOLL_CTL_ADD, fd, key, true) {
                        end(stream, Some(format!("cannot wait for the stream: {error}")));
                    }
                    true
                }
                Delivery::Parked => true,
                Delivery::Gone => false,
            }
        });
        let timeout = if streams.values().any(|s| s.parked.is_some()) {
            RETRY_FULL.as_millis() as libc::c_int
        } else {
            -1
        };
        // SAFETY: `events` is a live array of MAX_EVENTS entries.
        let ready = unsafe {
            libc::epoll_wait(
                epoll,
                events.as_mut_ptr(),
                MAX_EVENTS as libc::c_int,
                timeout,
            )
        };
        let Ok(ready) = usize::try_from(ready) else {
            continue; // EINTR
        };
        for event in &events[..ready.min(MAX_EVENTS)] {
            let key = event.u64;
            if key == WAKE_KEY {
                let mut count = [0u8; 8];
                // SAFETY: reads 8 bytes into a live buffer from our eventfd.
                unsafe { libc::read(wake, count.as_mut_ptr().cast(), count.len()) };
                continue;
            }
            let Some(stream) = streams.get_mut(&key) else {
                continue;
            };
            if stream.parked.is_some() || stream.decoder.is_none() {
                continue; // taken out of the set earlier in this batch
            }
            read_once(stream, &mut buf);
            match deliver_parked(stream) {
                // Dropping the socket takes it out of the epoll set.
                Delivery::Gone => drop(streams.remove(&key)),
                Delivery::Sent if stream.decoder.is_none() => drop(streams.remove(&key)),
                Delivery::Sent => {}
                Delivery::Parked => {
                    let _ = ctl(
                        epoll,
                        libc::EPOLL_CTL_DEL,
                        stream.stream.as_raw_fd(),
                        key,
                        false,
                    );
                }
            }
        }
    }
}

/// Reads one chunk of `stream` and parks what it decoded (and its end, if
/// the stream ended) for delivery.
fn read_once(stream: &mut Stream, buf: &mut [u8]) {
    let Some(decoder) = stream.decoder.as_mut() else {
        return;
    };
    let n = match stream.stream.read(buf) {
        Ok(0) => return end(stream, None),
        Ok(n) => n,
        Err(e)
            if e.kind() == io::ErrorKind::Interrupted || e.kind() == io::ErrorKind::WouldBlock =>
        {
            return;
        }
        Err(e) => return end(stream, Some(format!("reading the event stream: {e}"))),
    };
    let mut batch = Vec::new();
    let fed = decoder.feed(&buf[..n], &mut batch);
    if !batch.is_empty() {
        stream
            .parked
            .get_or_insert_with(Vec::new)
            .append(&mut batch);
    }
    if let Err(error) = fed {
        end(stream, Some(error));
    }
}

/// Parks the session's end (its decoder's [`SessionEnd`]) after what is
/// parked already.
fn end(stream: &mut Stream, error: Option<String>) {
    let Some(decoder) = stream.decoder.take() else {
        return;
    };
    stream
        .parked
        .get_or_insert_with(Vec::new)
        .push(SessionMessage::Ended(Box::new(decoder.end(error, 0))));
}

enum Delivery {
    Sent,
    Parked,
    Gone,
}

/// Offers the parked messages to the session's channel.
fn deliver_parked(stream: &mut Stream) -> Delivery {
    let Some(batch) = stream.parked.take() else {
        return Delivery::Sent;
    };
    match stream.sender.try_send(batch) {
        Ok(()) => {
            note_delivered(stream.pid);
            Delivery::Sent
        }
        Err(TrySendError::Full(batch)) => {
            stream.parked = Some(batch);
            CHANNEL_FULL.notify_one();
            Delivery::Parked
        }
        Err(TrySendError::Disconnected(_)) => Delivery::Gone,
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Read as _, Write as _},
        sync::mpsc::{Receiver, sync_channel},
        time::Instant,
    };

    use super::*;

    /// The .NET 8 capture of `nettrace/testdata`: contention, exceptions,
    /// method loads, rundown, and its end tag.
    fn capture() -> Vec<u8> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../profiler-parse/src/nettrace/testdata/net8.nettrace.gz"
        );
        let mut bytes = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(path).expect("the capture"))
            .read_to_end(&mut bytes)
            .expect("gunzip the capture");
        bytes
    }

    /// What the stream decodes to when fed in one piece.
    fn events_in(bytes: &[u8]) -> usize {
        let mut decoder = StreamDecoder::new(1, ClrEventKinds::ALL);
        let mut batch = Vec::new();
        decoder.feed(bytes, &mut batch).expect("a valid capture");
        batch
            .iter()
            .filter(|m| matches!(m, SessionMessage::Event(_)))
            .count()
    }

    /// A session of `bytes` written from a thread then closed, read by the
    /// reader thread into a channel of `capacity` batches.
    fn session(bytes: Vec<u8>, capacity: usize) -> (ReaderTicket, Receiver<Vec<SessionMessage>>) {
        let (ours, theirs) = UnixStream::pair().expect("a socket pair");
        std::thread::spawn(move || {
            let mut theirs = theirs;
            let _ = theirs.write_all(&bytes);
        });
        let (sender, receiver) = sync_channel(capacity);
        let ticket = attach(1, ours, ClrEventKinds::ALL, sender).expect("attach");
        (ticket, receiver)
    }

    /// Events until the session's end, and the end's error.
    fn drain(receiver: &Receiver<Vec<SessionMessage>>) -> (usize, Option<String>) {
        let mut events = 0;
        loop {
            let batch = receiver
                .recv_timeout(Duration::from_secs(20))
                .expect("the session's messages and its end");
            for message in batch {
                match message {
                    SessionMessage::Event(_) => events += 1,
                    SessionMessage::Counter(_) => {}
                    SessionMessage::Ended(end) => return (events, end.error),
                }
            }
        }
    }

    #[test]
    fn a_full_channel_holds_back_its_session_alone_and_loses_nothing() {
        let bytes = capture();
        let expected = events_in(&bytes);
        assert!(expected > 100, "{expected}");
        // Session A's channel takes one batch and nobody drains it yet.
        let (_a, slow) = session(bytes.clone(), 1);
        let (_b, fast) = session(bytes, 64);
        let started = Instant::now();
        assert_eq!(drain(&fast), (expected, None), "B is read while A waits");
        assert!(started.elapsed() < Duration::from_secs(10));
        // A: every event, in order of batches, then its clean end.
        assert_eq!(drain(&slow), (expected, None));
    }

    #[test]
    fn a_delivery_notes_its_pid_once_and_a_full_channel_wakes_the_loop() {
        const PID: u32 = 4_000_001;
        let (ours, theirs) = UnixStream::pair().expect("a socket pair");
        std::thread::spawn(move || {
            let mut theirs = theirs;
            let _ = theirs.write_all(&capture());
        });
        // One batch fills the channel, nobody drains it: the next parks.
        let (sender, _receiver) = sync_channel(1);
        let _ticket = attach(PID, ours, ClrEventKinds::ALL, sender).expect("attach");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        let woken = runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(20), channel_full()).await
        });
        assert!(woken.is_ok(), "a parked batch did not wake the loop");
        // Another test's full channel may have woken it first.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !take_delivered().contains(&PID) {
            assert!(Instant::now() < deadline, "the delivery was not noted");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Noted once: the full channel takes nothing more.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!take_delivered().contains(&PID));
    }

    #[test]
    fn a_cut_stream_ends_with_an_error_and_a_dropped_ticket_closes_it() {
        let bytes = capture();
        let (_ticket, receiver) = session(bytes[..bytes.len() / 2].to_vec(), 4);
        let (_, error) = drain(&receiver);
        assert!(error.is_some_and(|e| e.contains("end-of-stream")));
        // A session dropped mid-stream: its socket is closed, so the writer
        // sees its peer gone.
        let (ours, mut theirs) = UnixStream::pair().expect("a socket pair");
        let (sender, _receiver) = sync_channel(1);
        let ticket = attach(1, ours, ClrEventKinds::ALL, sender).expect("attach");
        drop(ticket);
        let deadline = Instant::now() + Duration::from_secs(10);
        let closed = loop {
            if theirs.write_all(&[0u8; 4096]).is_err() {
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(closed, "the reader still holds a dropped session's socket");
    }
}
