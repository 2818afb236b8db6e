//! A streaming parser of the NetTrace V4/V5 format that a .NET runtime
//! writes on its diagnostic socket for an EventPipe session. It sits between
//! the IPC client (bytes in arbitrary chunks) and the CLR event decoders
//! ([`crate::events`]): [`NettraceParser::feed`] takes whatever the
//! socket returned and calls back once per metadata record, event, stack
//! block and sequence point that became complete.
//!
//! Strategy:
//! 1. The stream is a list of FastSerialization objects (the `Trace`
//!    header, then EventBlock, MetadataBlock, StackBlock and SPBlock objects,
//!    then a NullReference tag). The parser buffers at most one object: when
//!    the buffer is empty it parses straight out of the caller's chunk and
//!    copies only an incomplete tail; objects above
//!    [`NettraceLimits::max_block_bytes`] are a hard error.
//! 2. Blocks are decoded in place: events borrow their payload from the
//!    block and their stack from the stack cache, so steady-state parsing
//!    allocates nothing per event.
//! 3. A malformed object header ends the stream ([`NettraceError`] is
//!    returned and kept; what was delivered stays delivered). A malformed
//!    record inside a block loses the rest of that block only and is counted
//!    in [`NettraceStats`].
//! 4. The runtime sends empty metadata (no event name, no field list) for its
//!    own events, so payload layouts live in the decoders, keyed by provider,
//!    event id and version.
//!
//! Reference: perfview `src/TraceEvent/EventPipe/NetTraceFormat_v5.md` and
//! dotnet/runtime `src/native/eventpipe/ep-block.c`. Limits: V6 streams
//! (`dotnet-trace collect-linux`) and NetPerf (V3) are rejected; metadata
//! field descriptions and V5 tags are not parsed.

/// Intake throughput, for `cargo xtask bench` (the `bench` example).
#[cfg(any(test, feature = "bench"))]
pub mod bench;
mod blocks;
mod error;
mod framing;
pub mod reader;
#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod writer;

use std::sync::Arc;

use crate::budget::{StreamBudget, Unbounded};

pub use error::{BlockKind, NettraceError};
pub use reader::ReadError;

use blocks::StreamState;
use framing::{Frame, Phase, Step, next_frame};

/// Bounds on what a (possibly hostile) stream can make the parser hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NettraceLimits {
    /// Largest block object accepted; the runtime writes blocks of about
    /// 100 KiB.
    pub max_block_bytes: usize,
    /// Distinct metadata records kept; more are counted and dropped.
    pub max_metadata: usize,
    /// Bytes of metadata records kept (names and field descriptions); a
    /// record past it is counted and dropped. The runtime's own sessions
    /// hold a few KiB.
    pub max_metadata_bytes: usize,
    /// Stack frames cached between sequence points; the cache is emptied
    /// when full, or when the memory budget's share for event streams is
    /// (later references count as missing stacks).
    pub max_cached_stack_frames: usize,
    /// Capture threads tracked for lost-event counting.
    pub max_tracked_threads: usize,
}

impl Default for NettraceLimits {
    fn default() -> Self {
        Self {
            max_block_bytes: 16 << 20,
            max_metadata: 1 << 16,
            max_metadata_bytes: 4 << 20,
            max_cached_stack_frames: 4 << 20,
            max_tracked_threads: 1 << 16,
        }
    }
}

/// Counters of a stream, including soft errors per kind. Totals are exact for
/// what the stream contained; `lost_events` is what the runtime's sequence
/// numbers say it dropped before writing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NettraceStats {
    /// Bytes consumed from the stream (framing included).
    pub bytes: u64,
    pub event_blocks: u64,
    pub metadata_blocks: u64,
    pub stack_blocks: u64,
    pub sequence_points: u64,
    /// Events delivered to the callback.
    pub events: u64,
    pub metadata: u64,
    pub stacks: u64,
    /// Events the runtime assigned a sequence number but never wrote.
    pub lost_events: u64,
    /// Events whose metadata id was never defined (dropped).
    pub events_without_metadata: u64,
    /// Events whose stack id was not in the cache (delivered without stack).
    pub missing_stacks: u64,
    /// Blocks whose remaining records were given up after a malformed one.
    pub corrupt_blocks: u64,
    /// Metadata records that could not be parsed or kept.
    pub corrupt_metadata: u64,
    pub stack_cache_resets: u64,
    /// Bytes after the end-of-stream tag (ignored).
    pub trailing_bytes: u64,
}

/// The `SyncTimeUTC` field of the trace header (a Windows SYSTEMTIME).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceSyncTime {
    pub year: u16,
    pub month: u16,
    pub day_of_week: u16,
    pub day: u16,
    pub hour: u16,
    pub minute: u16,
    pub second: u16,
    pub millisecond: u16,
}

impl TraceSyncTime {
    /// Nanoseconds since the Unix epoch, or `None` for an impossible date.
    pub fn unix_ns(&self) -> Option<i64> {
        let Self {
            year,
            month,
            day_of_week: _,
            day,
            hour,
            minute,
            second,
            millisecond,
        } = *self;
        if !(1..=12).contains(&month)
            || !(1..=31).contains(&day)
            || hour > 23
            || minute > 59
            || second > 60
        {
            return None;
        }
        // Days from civil (Howard Hinnant's algorithm).
        let (y, m, d) = (i64::from(year), i64::from(month), i64::from(day));
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        let days = era * 146_097 + doe - 719_468;
        let seconds =
            days * 86_400 + i64::from(hour) * 3600 + i64::from(minute) * 60 + i64::from(second);
        seconds
            .checked_mul(1_000_000_000)?
            .checked_add(i64::from(millisecond) * 1_000_000)
    }
}

/// The `Trace` object at the start of every stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceHeader {
    pub sync_time_utc: TraceSyncTime,
    /// The tick count at `sync_time_utc`.
    pub sync_time_qpc: i64,
    /// Ticks per second; on Linux 1e9 (ticks are CLOCK_MONOTONIC ns, the
    /// clock of `bpf_ktime_get_ns`).
    pub qpc_frequency: i64,
    pub pointer_size: u32,
    /// The process id in the target's own PID namespace.
    pub process_id: u32,
    pub number_of_processors: u32,
    pub expected_cpu_sampling_rate: u32,
}

impl TraceHeader {
    /// An event timestamp in nanoseconds of the runtime's tick clock
    /// (CLOCK_MONOTONIC on Linux), or `None` if negative or out of range.
    pub fn ticks_to_ns(&self, ticks: i64) -> Option<u64> {
        let ns = i128::from(ticks) * 1_000_000_000 / i128::from(self.qpc_frequency.max(1));
        u64::try_from(ns).ok()
    }

    /// An event timestamp as nanoseconds since the Unix epoch, through the
    /// header's sync point.
    #[cfg(test)]
    pub fn ticks_to_unix_ns(&self, ticks: i64) -> Option<i64> {
        let since_sync = (i128::from(ticks) - i128::from(self.sync_time_qpc)) * 1_000_000_000
            / i128::from(self.qpc_frequency.max(1));
        let unix = i128::from(self.sync_time_utc.unix_ns()?) + since_sync;
        i64::try_from(unix).ok()
    }
}

/// One metadata record: what a metadata id stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventMetadata {
    pub metadata_id: u32,
    /// Interned: every record of one provider shares the allocation.
    pub provider: Arc<str>,
    pub event_id: u32,
    /// Empty for the runtime's own native events.
    pub event_name: Box<str>,
    pub keywords: u64,
    pub version: u32,
    pub level: u32,
    /// The payload layout, for self-describing events (EventSource and
    /// TraceLogging events such as `EventCounters`). Empty for the
    /// runtime's native events, and when the list could not be parsed.
    pub fields: Box<[FieldDescription]>,
}

/// One field of a self-describing event payload (V1 field layout of the
/// NetTrace V4/V5 metadata: `u32 TypeCode`, for `Object` a nested
/// `u32 count` and fields, then the UTF-16 name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldDescription {
    pub name: Box<str>,
    /// System.TypeCode numbering (9 Int32, 13 Single, 14 Double, 18
    /// String, 1 Object, ...), EventPipe's 17 for Guid.
    pub type_code: u32,
    /// The fields of an `Object`.
    pub fields: Box<[FieldDescription]>,
}

/// Type codes of [`FieldDescription::type_code`].
pub mod type_code {
    pub const OBJECT: u32 = 1;
    pub const BOOLEAN: u32 = 3;
    pub const CHAR: u32 = 4;
    pub const SBYTE: u32 = 5;
    pub const BYTE: u32 = 6;
    pub const INT16: u32 = 7;
    pub const UINT16: u32 = 8;
    pub const INT32: u32 = 9;
    pub const UINT32: u32 = 10;
    pub const INT64: u32 = 11;
    pub const UINT64: u32 = 12;
    pub const SINGLE: u32 = 13;
    pub const DOUBLE: u32 = 14;
    pub const DECIMAL: u32 = 15;
    pub const DATE_TIME: u32 = 16;
    pub const GUID: u32 = 17;
    pub const STRING: u32 = 18;
}

/// One event, borrowed from the parser for the duration of the callback.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EventRecord<'a> {
    pub metadata_id: u32,
    pub provider: &'a Arc<str>,
    pub event_id: u32,
    pub version: u32,
    pub event_name: &'a str,
    /// The OS thread the event describes.
    pub thread_id: u64,
    /// The OS thread that wrote it (sequence numbers are per capture thread).
    pub capture_thread_id: u64,
    pub processor: u32,
    pub sequence: u32,
    /// Runtime ticks; convert with [`TraceHeader::ticks_to_ns`].
    pub timestamp: i64,
    pub activity_id: [u8; 16],
    pub related_activity_id: [u8; 16],
    /// No later event in the stream is older than this one.
    pub is_sorted: bool,
    /// Managed return addresses, leaf first, when the session walks stacks.
    pub stack: Option<&'a [u64]>,
    pub payload: &'a [u8],
}

impl EventRecord<'_> {
    /// A copy that outlives the callback.
    #[cfg(test)]
    pub fn to_owned_record(&self) -> OwnedEventRecord {
        let &Self {
            metadata_id,
            provider,
            event_id,
            version,
            event_name,
            thread_id,
            capture_thread_id,
            processor,
            sequence,
            timestamp,
            activity_id,
            related_activity_id,
            is_sorted,
            stack,
            payload,
        } = self;
        OwnedEventRecord {
            metadata_id,
            provider: Arc::clone(provider),
            event_id,
            version,
            event_name: event_name.into(),
            thread_id,
            capture_thread_id,
            processor,
            sequence,
            timestamp,
            activity_id,
            related_activity_id,
            is_sorted,
            stack: stack.map(<[u64]>::to_vec),
            payload: payload.to_vec(),
        }
    }
}

/// An [`EventRecord`] that owns its data.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedEventRecord {
    pub metadata_id: u32,
    pub provider: Arc<str>,
    pub event_id: u32,
    pub version: u32,
    pub event_name: Box<str>,
    pub thread_id: u64,
    pub capture_thread_id: u64,
    pub processor: u32,
    pub sequence: u32,
    pub timestamp: i64,
    pub activity_id: [u8; 16],
    pub related_activity_id: [u8; 16],
    pub is_sorted: bool,
    pub stack: Option<Vec<u64>>,
    pub payload: Vec<u8>,
}

/// A StackBlock was read: `count` stacks with ids from `first_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackBlockInfo {
    pub first_id: u32,
    pub count: u32,
}

/// A sequence point: all events before it in the stream are older than
/// `timestamp`, all after it are newer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequencePoint {
    pub timestamp: i64,
    pub thread_count: u32,
}

/// What [`NettraceParser::feed`] hands to its callback, in stream order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ParsedItem<'a> {
    Trace(&'a TraceHeader),
    Metadata(&'a EventMetadata),
    Event(EventRecord<'a>),
    Stacks(StackBlockInfo),
    SequencePoint(SequencePoint),
    /// The stream's NullReference tag: the session ended cleanly.
    EndOfStream,
}

/// Incremental NetTrace V4/V5 parser; see the module documentation.
#[derive(Debug)]
pub struct NettraceParser {
    phase: Phase,
    /// Absolute stream offset of the first byte not yet consumed.
    offset: u64,
    /// An incomplete frame, at most one object.
    pending: Vec<u8>,
    /// Bytes `pending` must reach before parsing is retried.
    pending_need: usize,
    trace: Option<TraceHeader>,
    state: StreamState,
    failed: Option<NettraceError>,
}

impl Default for NettraceParser {
    fn default() -> Self {
        Self::new()
    }
}

/// Bytes of framing an object may add around its block body (tags, type
/// object, size field, padding).
const MAX_FRAMING_BYTES: usize = 128;

impl NettraceParser {
    pub fn new() -> Self {
        Self::with_limits(NettraceLimits::default())
    }

    /// `limits` alone bound what the parser keeps ([`Unbounded`]).
    pub fn with_limits(limits: NettraceLimits) -> Self {
        Self::with_budget(limits, Box::new(Unbounded))
    }

    /// `limits`, and the metadata and stack cache also charged to `budget`
    /// (the profiler's memory budget, shared by every stream).
    pub fn with_budget(limits: NettraceLimits, budget: Box<dyn StreamBudget>) -> Self {
        Self {
            phase: Phase::Preamble,
            offset: 0,
            pending: Vec::new(),
            pending_need: 0,
            trace: None,
            state: StreamState::new(limits, budget),
            failed: None,
        }
    }

    /// Parse `bytes`, the next chunk of the stream, calling `on_item` for
    /// every item that became complete. After an `Err` the parser is stopped:
    /// later calls return the same error and deliver nothing.
    pub fn feed<F>(&mut self, bytes: &[u8], on_item: &mut F) -> Result<(), NettraceError>
    where
        F: FnMut(ParsedItem<'_>),
    {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        let result = self.feed_inner(bytes, on_item);
        if let Err(error) = &result {
            self.failed = Some(error.clone());
            self.pending = Vec::new();
        }
        result
    }

    fn feed_inner<F>(&mut self, mut input: &[u8], on_item: &mut F) -> Result<(), NettraceError>
    where
        F: FnMut(ParsedItem<'_>),
    {
        loop {
            if self.phase == Phase::Ended {
                self.state.stats.trailing_bytes += input.len() as u64;
                return Ok(());
            }
            if self.pending.is_empty() {
                if input.is_empty() {
                    return Ok(());
                }
                // Fast path: parse straight out of the caller's chunk.
                match self.next(input)? {
                    Step::Complete { len, frame } => {
                        let (consumed, rest) = input.split_at(len);
                        self.complete(frame, consumed, on_item);
                        input = rest;
                    }
                    Step::NeedBytes(needed) => {
                        self.pending.extend_from_slice(input);
                        self.pending_need = needed;
                        return Ok(());
                    }
                }
            } else {
                // Top the buffer up to what the frame is known to need, no
                // more, so it never holds more than one object.
                let missing = self.pending_need.saturating_sub(self.pending.len());
                let (take, rest) = input.split_at(missing.min(input.len()));
                self.pending.extend_from_slice(take);
                input = rest;
                if self.pending.len() < self.pending_need {
                    return Ok(());
                }
                // Taken out of `self` so `complete` can borrow both; the
                // allocation is put back and reused.
                let mut pending = std::mem::take(&mut self.pending);
                match self.next(&pending)? {
                    Step::Complete { len, frame } => {
                        self.complete(frame, &pending[..len], on_item);
                        // The buffer is only ever topped up to the frame's
                        // end, so nothing should be left; if something is,
                        // it is the start of the next frame: keep it.
                        pending.drain(..len);
                        self.pending_need = pending.len();
                    }
                    Step::NeedBytes(needed) => self.pending_need = needed,
                }
                self.pending = pending;
            }
        }
    }

    /// Find the next frame in `data`, checking that an incomplete frame can
    /// never need more than one object's worth of buffer.
    fn next(&self, data: &[u8]) -> Result<Step, NettraceError> {
        let max_block_bytes = self.state.limits.max_block_bytes;
        let step = next_frame(data, self.offset, self.phase, max_block_bytes)?;
        if let Step::NeedBytes(needed) = step {
            // next_frame already rejected larger block sizes; this guards
            // the invariant the buffering relies on.
            debug_assert!(needed <= max_block_bytes + MAX_FRAMING_BYTES);
        }
        Ok(step)
    }

    fn complete<F>(&mut self, frame: Frame, bytes: &[u8], on_item: &mut F)
    where
        F: FnMut(ParsedItem<'_>),
    {
        let offset = self.offset;
        self.offset += bytes.len() as u64;
        self.state.stats.bytes += bytes.len() as u64;
        match frame {
            Frame::Preamble => self.phase = Phase::TraceObject,
            Frame::Trace(header) => {
                self.phase = Phase::Objects;
                self.state.pointer_size = header.pointer_size;
                let header = self.trace.insert(header);
                on_item(ParsedItem::Trace(header));
            }
            Frame::Block {
                kind,
                body_start,
                body_len,
            } => {
                let body = &bytes[body_start..body_start + body_len];
                self.state
                    .block(kind, body, offset + body_start as u64, on_item);
            }
            Frame::EndOfStream => {
                self.phase = Phase::Ended;
                on_item(ParsedItem::EndOfStream);
            }
        }
    }

    /// Call when the socket reached end of file: an error unless the stream
    /// ended with its end-of-stream tag.
    pub fn finish(&mut self) -> Result<(), NettraceError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        if self.phase == Phase::Ended {
            return Ok(());
        }
        let error = if self.pending.is_empty() {
            NettraceError::MissingEndOfStream {
                offset: self.offset,
            }
        } else {
            NettraceError::Truncated {
                offset: self.offset,
                pending_bytes: self.pending.len(),
            }
        };
        self.failed = Some(error.clone());
        Err(error)
    }

    /// Whether the end-of-stream tag was seen.
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Ended
    }

    /// The hard error that stopped the parser, if any.
    pub fn error(&self) -> Option<&NettraceError> {
        self.failed.as_ref()
    }

    /// The most recent soft error (counted in [`Self::stats`]).
    pub fn last_soft_error(&self) -> Option<&NettraceError> {
        self.state.last_soft_error.as_ref()
    }

    pub fn stats(&self) -> &NettraceStats {
        &self.state.stats
    }

    #[cfg(test)]
    pub fn trace_header(&self) -> Option<&TraceHeader> {
        self.trace.as_ref()
    }

    pub fn metadata(&self, metadata_id: u32) -> Option<&EventMetadata> {
        self.state.metadata.get(&metadata_id)
    }

    /// Bytes currently buffered for an incomplete object (the nettrace fuzz
    /// target checks the bound).
    pub fn buffered_bytes(&self) -> usize {
        self.pending.len()
    }
}
