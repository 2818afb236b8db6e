//! The bodies of the four block kinds: event blobs with header compression
//! (EventBlock, MetadataBlock), interned stacks (StackBlock) and sequence
//! points (SPBlock). A damaged block loses at most its own remaining records:
//! the framing around it is intact, so parsing goes on with the next block.

use std::{collections::HashMap, sync::Arc};

use crate::budget::{BudgetDrop, StreamBudget};

use super::{
    EventMetadata, EventRecord, FieldDescription, NettraceLimits, NettraceStats, ParsedItem,
    SequencePoint, StackBlockInfo,
    error::{BlockKind, NettraceError},
    reader::{ByteReader, ReadError},
};

/// Longest provider or event name kept from a metadata record, in UTF-16
/// code units; longer names are truncated.
const MAX_METADATA_NAME_UNITS: usize = 1024;
/// Bytes of the fixed EventBlock/MetadataBlock header this parser reads.
const BLOCK_HEADER_LEN: u16 = 20;
/// Fixed part of an uncompressed event blob after its EventSize field.
const UNCOMPRESSED_HEADER_LEN: usize = 4 + 4 + 8 + 8 + 4 + 4 + 8 + 16 + 16 + 4;
/// At most this many distinct provider names are interned.
const MAX_INTERNED_PROVIDERS: usize = 256;

mod flags {
    pub(super) const METADATA_ID: u8 = 0x01;
    pub(super) const CAPTURE_THREAD_AND_SEQUENCE: u8 = 0x02;
    pub(super) const THREAD_ID: u8 = 0x04;
    pub(super) const STACK_ID: u8 = 0x08;
    pub(super) const ACTIVITY_ID: u8 = 0x10;
    pub(super) const RELATED_ACTIVITY_ID: u8 = 0x20;
    pub(super) const SORTED: u8 = 0x40;
    pub(super) const DATA_LENGTH: u8 = 0x80;
}

/// The decoded header of one event blob. Header compression encodes each
/// blob relative to the previous one in the same block.
#[derive(Clone, Copy, Debug, Default)]
struct BlobHeader {
    metadata_id: u32,
    sequence: u32,
    capture_thread_id: u64,
    processor: u32,
    thread_id: u64,
    stack_id: u32,
    timestamp: i64,
    activity_id: [u8; 16],
    related_activity_id: [u8; 16],
    is_sorted: bool,
    payload_size: u32,
}

/// A blob's header, its payload and the payload's offset in the block body.
type Blob<'a> = (BlobHeader, &'a [u8], usize);

/// Walks the event blobs of an EventBlock or MetadataBlock body.
struct BlobReader<'a> {
    reader: ByteReader<'a>,
    compressed: bool,
    previous: BlobHeader,
}

impl<'a> BlobReader<'a> {
    fn new(body: &'a [u8]) -> Result<Self, BlockFault> {
        let mut reader = ByteReader::new(body);
        let header_size = reader.u16("block HeaderSize")?;
        let block_flags = reader.u16("block Flags")?;
        reader.i64("block MinTimestamp")?;
        reader.i64("block MaxTimestamp")?;
        if header_size < BLOCK_HEADER_LEN {
            return Err(BlockFault::Invalid("header size below 20 bytes"));
        }
        reader.skip(usize::from(header_size - BLOCK_HEADER_LEN), "block header")?;
        Ok(Self {
            reader,
            compressed: block_flags & 1 != 0,
            previous: BlobHeader::default(),
        })
    }

    /// The next blob header and its payload, with the payload's offset in
    /// the block body.
    fn next_blob(&mut self) -> Option<Result<Blob<'a>, BlockFault>> {
        if self.reader.is_empty() {
            return None;
        }
        let result = if self.compressed {
            self.compressed_blob()
        } else {
            self.uncompressed_blob()
        };
        Some(result)
    }

    fn compressed_blob(&mut self) -> Result<Blob<'a>, BlockFault> {
        let r = &mut self.reader;
        let header = &mut self.previous;
        let blob_flags = r.u8("event flags")?;
        if blob_flags & flags::METADATA_ID != 0 {
            header.metadata_id = r.varuint32("MetadataId")?;
        }
        if blob_flags & flags::CAPTURE_THREAD_AND_SEQUENCE != 0 {
            let delta = r.varuint32("SequenceNumber delta")?;
            header.sequence = header.sequence.wrapping_add(delta);
            header.capture_thread_id = r.varuint64("CaptureThreadId")?;
            header.processor = r.varuint32("ProcessorNumber")?;
        }
        // The writer encodes `seq - previous - 1` for events; metadata
        // records carry no sequence number.
        if header.metadata_id != 0 {
            header.sequence = header.sequence.wrapping_add(1);
        }
        if blob_flags & flags::THREAD_ID != 0 {
            header.thread_id = r.varuint64("ThreadId")?;
        }
        if blob_flags & flags::STACK_ID != 0 {
            header.stack_id = r.varuint32("StackId")?;
        }
        let delta = r.varuint64("Timestamp delta")?;
        header.timestamp = header.timestamp.wrapping_add(delta as i64);
        if blob_flags & flags::ACTIVITY_ID != 0 {
            header.activity_id = r.guid("ActivityId")?;
        }
        if blob_flags & flags::RELATED_ACTIVITY_ID != 0 {
            header.related_activity_id = r.guid("RelatedActivityId")?;
        }
        header.is_sorted = blob_flags & flags::SORTED != 0;
        if blob_flags & flags::DATA_LENGTH != 0 {
            header.payload_size = r.varuint32("PayloadSize")?;
        }
        let payload_pos = r.pos();
        let payload = r.bytes(header.payload_size as usize, "event payload")?;
        Ok((*header, payload, payload_pos))
    }

    fn uncompressed_blob(&mut self) -> Result<Blob<'a>, BlockFault> {
        let start = self.reader.pos();
        let event_size = self.reader.u32("EventSize")? as usize;
        let blob_pos = self.reader.pos();
        let blob = self.reader.bytes(event_size, "event blob")?;
        let mut r = ByteReader::new(blob);
        if event_size < UNCOMPRESSED_HEADER_LEN {
            return Err(BlockFault::Invalid(
                "uncompressed event shorter than its header",
            ));
        }
        let raw_metadata_id = r.u32("MetadataId")?;
        let header = BlobHeader {
            metadata_id: raw_metadata_id & 0x7fff_ffff,
            is_sorted: raw_metadata_id & 0x8000_0000 != 0,
            sequence: r.u32("SequenceNumber")?,
            thread_id: r.u64("ThreadId")?,
            capture_thread_id: r.u64("CaptureThreadId")?,
            processor: r.u32("ProcessorNumber")?,
            stack_id: r.u32("StackId")?,
            timestamp: r.i64("TimeStamp")?,
            activity_id: r.guid("ActivityId")?,
            related_activity_id: r.guid("RelatedActivityId")?,
            payload_size: r.u32("PayloadSize")?,
        };
        let payload_pos = blob_pos + r.pos();
        let payload = r.bytes(header.payload_size as usize, "event payload")?;
        // Uncompressed blobs are padded to 4 bytes; the block body itself
        // starts 4-aligned in the stream.
        let end = start + 4 + event_size;
        let padding = (4 - (end & 3)) & 3;
        self.reader
            .skip(padding.min(self.reader.remaining()), "event padding")?;
        self.previous = header;
        Ok((header, payload, payload_pos))
    }
}

/// Why the rest of a block was given up.
#[derive(Debug)]
pub(crate) enum BlockFault {
    Read(ReadError),
    Invalid(&'static str),
}

impl From<ReadError> for BlockFault {
    fn from(error: ReadError) -> Self {
        Self::Read(error)
    }
}

impl BlockFault {
    fn into_error(self, kind: BlockKind, offset: u64) -> NettraceError {
        match self {
            Self::Read(source) => NettraceError::CorruptBlock {
                offset,
                kind,
                source,
            },
            Self::Invalid(reason) => NettraceError::InvalidBlock {
                offset,
                kind,
                reason,
            },
        }
    }
}

/// Stacks of the current sequence-point region, by id, in one arena.
#[derive(Debug, Default)]
pub(crate) struct StackCache {
    frames: Vec<u64>,
    index: HashMap<u32, (usize, usize)>,
}

impl StackCache {
    pub(crate) fn get(&self, id: u32) -> Option<&[u64]> {
        let &(start, len) = self.index.get(&id)?;
        self.frames.get(start..start + len)
    }

    pub(crate) fn clear(&mut self) {
        self.frames.clear();
        self.index.clear();
    }
}

/// Everything the parser remembers between blocks.
#[derive(Debug)]
pub(crate) struct StreamState {
    pub(crate) limits: NettraceLimits,
    pub(crate) pointer_size: u32,
    pub(crate) metadata: HashMap<u32, EventMetadata>,
    providers: Vec<Arc<str>>,
    pub(crate) stacks: StackCache,
    /// Last sequence number seen per capture thread, to count lost events.
    last_sequence: HashMap<u64, u32>,
    pub(crate) stats: NettraceStats,
    pub(crate) last_soft_error: Option<NettraceError>,
    /// Bytes the kept metadata records take ([`metadata_cost`]).
    metadata_bytes: usize,
    /// Stack cache frames already charged to `charge`.
    charged_frames: usize,
    /// This stream's metadata and stack cache, charged to the memory
    /// budget's pool for event streams.
    charge: Box<dyn StreamBudget>,
}

/// Frames of the stack cache charged at a time at most: a charge per stack
/// block would be an atomic operation per few stacks.
const STACK_CHARGE_FRAMES: usize = 64 << 10;
/// The first charge, in frames (32 KiB), doubled while the cache grows up
/// to [`STACK_CHARGE_FRAMES`] a step: the stacks of an idle process's
/// method loads do not hold 512 KiB of a pool shared by a node's worth of
/// processes.
const FIRST_STACK_CHARGE_FRAMES: usize = 4 << 10;

/// Heap bytes a metadata record holds, roughly: its fixed parts, its event
/// name and every field's name and description.
fn metadata_cost(event_name: &str, fields: &[FieldDescription]) -> usize {
    fn fields_cost(fields: &[FieldDescription]) -> usize {
        fields
            .iter()
            .map(|f| size_of::<FieldDescription>() + f.name.len() + fields_cost(&f.fields))
            .sum()
    }
    // The map slot and key besides the record.
    size_of::<EventMetadata>() + 16 + event_name.len() + fields_cost(fields)
}

impl StreamState {
    pub(crate) fn new(limits: NettraceLimits, charge: Box<dyn StreamBudget>) -> Self {
        Self {
            limits,
            pointer_size: 8,
            metadata: HashMap::new(),
            providers: Vec::new(),
            stacks: StackCache::default(),
            last_sequence: HashMap::new(),
            stats: NettraceStats::default(),
            last_soft_error: None,
            metadata_bytes: 0,
            charged_frames: 0,
            charge,
        }
    }

    fn soft_error(&mut self, error: NettraceError) {
        self.last_soft_error = Some(error);
    }

    pub(crate) fn block<F: FnMut(ParsedItem<'_>)>(
        &mut self,
        kind: BlockKind,
        body: &[u8],
        offset: u64,
        on_item: &mut F,
    ) {
        let result = match kind {
            BlockKind::Event => {
                self.stats.event_blocks += 1;
                self.event_block(body, on_item)
            }
            BlockKind::Metadata => {
                self.stats.metadata_blocks += 1;
                self.metadata_block(body, offset, on_item)
            }
            BlockKind::Stack => {
                self.stats.stack_blocks += 1;
                self.stack_block(body, on_item)
            }
            BlockKind::SequencePoint => {
                self.stats.sequence_points += 1;
                self.sequence_point_block(body, on_item)
            }
        };
        if let Err((fault, at)) = result {
            self.stats.corrupt_blocks += 1;
            self.soft_error(fault.into_error(kind, offset + at as u64));
        }
    }

    fn event_block<F: FnMut(ParsedItem<'_>)>(
        &mut self,
        body: &[u8],
        on_item: &mut F,
    ) -> Result<(), (BlockFault, usize)> {
        let Self {
            limits,
            metadata,
            stacks,
            last_sequence,
            stats,
            ..
        } = self;
        let mut blobs = BlobReader::new(body).map_err(|fault| (fault, 0))?;
        loop {
            let at = blobs.reader.pos();
            let (header, payload, _) = match blobs.next_blob() {
                None => return Ok(()),
                Some(Ok(blob)) => blob,
                Some(Err(fault)) => return Err((fault, at)),
            };
            if header.metadata_id != 0 {
                observe_sequence(
                    last_sequence,
                    limits.max_tracked_threads,
                    header.capture_thread_id,
                    header.sequence,
                    stats,
                );
            }
            let Some(meta) = metadata.get(&header.metadata_id) else {
                stats.events_without_metadata += 1;
                continue;
            };
            let stack = match header.stack_id {
                0 => None,
                id => {
                    let stack = stacks.get(id);
                    if stack.is_none() {
                        stats.missing_stacks += 1;
                    }
                    stack
                }
            };
            stats.events += 1;
            on_item(ParsedItem::Event(EventRecord {
                metadata_id: header.metadata_id,
                provider: &meta.provider,
                event_id: meta.event_id,
                version: meta.version,
                event_name: &meta.event_name,
                thread_id: header.thread_id,
                capture_thread_id: header.capture_thread_id,
                processor: header.processor,
                sequence: header.sequence,
                timestamp: header.timestamp,
                activity_id: header.activity_id,
                related_activity_id: header.related_activity_id,
                is_sorted: header.is_sorted,
                stack,
                payload,
            }));
        }
    }

    fn metadata_block<F: FnMut(ParsedItem<'_>)>(
        &mut self,
        body: &[u8],
        offset: u64,
        on_item: &mut F,
    ) -> Result<(), (BlockFault, usize)> {
        let mut blobs = BlobReader::new(body).map_err(|fault| (fault, 0))?;
        loop {
            let at = blobs.reader.pos();
            let (_, payload, payload_pos) = match blobs.next_blob() {
                None => return Ok(()),
                Some(Ok(blob)) => blob,
                Some(Err(fault)) => return Err((fault, at)),
            };
            // A bad record spoils only itself: its size is known.
            let record = match parse_metadata_payload(payload) {
                Ok(record) => record,
                Err(source) => {
                    self.stats.corrupt_metadata += 1;
                    self.soft_error(NettraceError::CorruptMetadata {
                        offset: offset + payload_pos as u64,
                        source,
                    });
                    continue;
                }
            };
            if record.metadata_id == 0 {
                self.stats.corrupt_metadata += 1;
                self.soft_error(NettraceError::InvalidBlock {
                    offset: offset + payload_pos as u64,
                    kind: BlockKind::Metadata,
                    reason: "metadata record defines id 0",
                });
                continue;
            }
            let replaces = self.metadata.contains_key(&record.metadata_id);
            if !replaces && self.metadata.len() >= self.limits.max_metadata {
                self.stats.corrupt_metadata += 1;
                self.soft_error(NettraceError::TooManyMetadata {
                    max: self.limits.max_metadata,
                });
                continue;
            }
            let cost = metadata_cost(&record.event_name, &record.fields);
            let freed = self
                .metadata
                .get(&record.metadata_id)
                .map_or(0, |old| metadata_cost(&old.event_name, &old.fields));
            if !self.admit_metadata(cost, freed) {
                self.stats.corrupt_metadata += 1;
                self.charge.count_drop(BudgetDrop::NettraceMetadata);
                self.soft_error(NettraceError::MetadataOverBudget {
                    max_bytes: self.limits.max_metadata_bytes,
                });
                continue;
            }
            let provider = self.intern_provider(&record.provider);
            let meta = EventMetadata {
                metadata_id: record.metadata_id,
                provider,
                event_id: record.event_id,
                event_name: record.event_name.into(),
                keywords: record.keywords,
                version: record.version,
                level: record.level,
                fields: record.fields.into(),
            };
            self.stats.metadata += 1;
            let id = meta.metadata_id;
            self.metadata.insert(id, meta);
            if let Some(meta) = self.metadata.get(&id) {
                on_item(ParsedItem::Metadata(meta));
            }
        }
    }

    /// Makes room for a metadata record of `cost` bytes that replaces one
    /// of `freed` bytes, within the stream's bound and the pool; `false`
    /// (nothing changed) when there is none.
    fn admit_metadata(&mut self, cost: usize, freed: usize) -> bool {
        let after = self.metadata_bytes - freed + cost;
        if after > self.limits.max_metadata_bytes {
            return false;
        }
        if cost > freed && !self.charge.try_add((cost - freed) as u64) {
            return false;
        }
        if freed > cost {
            self.charge.release((freed - cost) as u64);
        }
        self.metadata_bytes = after;
        true
    }

    /// Charges the stack cache for `frames` frames in all, in steps of
    /// [`STACK_CHARGE_FRAMES`]; `false` when the pool has no room.
    fn charge_stack_frames(&mut self, frames: usize) -> bool {
        if frames <= self.charged_frames {
            return true;
        }
        let step = (frames - self.charged_frames).max(
            self.charged_frames
                .clamp(FIRST_STACK_CHARGE_FRAMES, STACK_CHARGE_FRAMES),
        );
        if !self.charge.try_add((step * size_of::<u64>()) as u64) {
            return false;
        }
        self.charged_frames += step;
        true
    }

    fn intern_provider(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.providers.iter().find(|known| ***known == *name) {
            return Arc::clone(known);
        }
        let provider: Arc<str> = name.into();
        if self.providers.len() < MAX_INTERNED_PROVIDERS {
            self.providers.push(Arc::clone(&provider));
        }
        provider
    }

    fn stack_block<F: FnMut(ParsedItem<'_>)>(
        &mut self,
        body: &[u8],
        on_item: &mut F,
    ) -> Result<(), (BlockFault, usize)> {
        let mut r = ByteReader::new(body);
        let first_id = r.u32("stack FirstId").map_err(|e| (e.into(), 0))?;
        let count = r.u32("stack Count").map_err(|e| (e.into(), 4))?;
        let pointer_size = self.pointer_size as usize;
        let mut stored = 0u32;
        let result = (|| {
            for index in 0..count {
                let at = r.pos();
                let size = r.u32("StackSize").map_err(|e| (e.into(), at))? as usize;
                let bytes = r.bytes(size, "stack bytes").map_err(|e| (e.into(), at))?;
                if !size.is_multiple_of(pointer_size) {
                    return Err((
                        BlockFault::Invalid("stack size is not a multiple of the pointer size"),
                        at,
                    ));
                }
                let frames = size / pointer_size;
                let needed = self.stacks.frames.len() + frames;
                if needed > self.limits.max_cached_stack_frames || !self.charge_stack_frames(needed)
                {
                    if needed <= self.limits.max_cached_stack_frames {
                        self.charge.count_drop(BudgetDrop::NettraceStackReset);
                    }
                    self.stacks.clear();
                    self.stats.stack_cache_resets += 1;
                    if !self.charge_stack_frames(frames) {
                        // No room even alone: the stack is not kept.
                        continue;
                    }
                }
                let cache = &mut self.stacks;
                let start = cache.frames.len();
                if pointer_size == 8 {
                    cache.frames.extend(bytes.chunks_exact(8).map(|ip| {
                        u64::from_le_bytes([ip[0], ip[1], ip[2], ip[3], ip[4], ip[5], ip[6], ip[7]])
                    }));
                } else {
                    cache.frames.extend(
                        bytes
                            .chunks_exact(4)
                            .map(|ip| u64::from(u32::from_le_bytes([ip[0], ip[1], ip[2], ip[3]]))),
                    );
                }
                cache
                    .index
                    .insert(first_id.wrapping_add(index), (start, frames));
                stored += 1;
                self.stats.stacks += 1;
            }
            Ok(())
        })();
        on_item(ParsedItem::Stacks(StackBlockInfo {
            first_id,
            count: stored,
        }));
        result
    }

    fn sequence_point_block<F: FnMut(ParsedItem<'_>)>(
        &mut self,
        body: &[u8],
        on_item: &mut F,
    ) -> Result<(), (BlockFault, usize)> {
        // Events may only refer to stacks written since the last sequence
        // point; the runtime restarts stack ids after each one.
        self.stacks.clear();
        let mut r = ByteReader::new(body);
        let timestamp = r
            .i64("sequence point TimeStamp")
            .map_err(|e| (e.into(), 0))?;
        let thread_count = r
            .u32("sequence point ThreadCount")
            .map_err(|e| (e.into(), 8))?;
        let mut result = Ok(());
        for _ in 0..thread_count {
            let at = r.pos();
            let entry = r
                .u64("sequence point ThreadId")
                .and_then(|thread| Ok((thread, r.u32("sequence point SequenceNumber")?)));
            match entry {
                Ok((thread, sequence)) => self.sequence_point_thread(thread, sequence),
                Err(error) => {
                    result = Err((error.into(), at));
                    break;
                }
            }
        }
        on_item(ParsedItem::SequencePoint(SequencePoint {
            timestamp,
            thread_count,
        }));
        result
    }

    /// A sequence point gives, per thread, a lower bound on the sequence
    /// number of the last event it tried to write: anything above what was
    /// seen was lost.
    fn sequence_point_thread(&mut self, thread: u64, sequence: u32) {
        if let Some(last) = self.last_sequence.get_mut(&thread) {
            let gap = sequence.wrapping_sub(*last);
            if gap != 0 && gap < 1 << 31 {
                self.stats.lost_events += u64::from(gap);
                *last = sequence;
            }
        } else {
            if self.last_sequence.len() >= self.limits.max_tracked_threads {
                self.last_sequence.clear();
            }
            // Counters start at 1 per thread and session: a thread first
            // seen here lost every event it tried to write.
            self.stats.lost_events += u64::from(sequence);
            self.last_sequence.insert(thread, sequence);
        }
    }
}

/// Count gaps in a capture thread's sequence numbers. A restart at 1 is a
/// new thread that reused the id, not a loss.
fn observe_sequence(
    last_sequence: &mut HashMap<u64, u32>,
    max_threads: usize,
    thread: u64,
    sequence: u32,
    stats: &mut NettraceStats,
) {
    match last_sequence.get_mut(&thread) {
        Some(last) => {
            let gap = sequence.wrapping_sub(last.wrapping_add(1));
            if gap != 0 && sequence != 1 && gap < 1 << 31 {
                stats.lost_events += u64::from(gap);
            }
            *last = sequence;
        }
        None => {
            if last_sequence.len() >= max_threads {
                last_sequence.clear();
            }
            // Sequence numbers start at 1 per thread and session.
            stats.lost_events += u64::from(sequence.saturating_sub(1));
            last_sequence.insert(thread, sequence);
        }
    }
}

/// A metadata record's payload: the fixed part, then the V1 field list
/// (the runtime sends an empty one for its own events). V5 tags after it
/// are not read.
#[derive(Debug)]
struct MetadataPayload {
    metadata_id: u32,
    provider: String,
    event_id: u32,
    event_name: String,
    keywords: u64,
    version: u32,
    level: u32,
    fields: Vec<FieldDescription>,
}

/// Nesting of `Object` fields followed at most.
const MAX_FIELD_DEPTH: u32 = 8;
/// Fields described per event at most, nested ones included.
const MAX_FIELDS: usize = 256;
/// Longest field name kept, in UTF-16 code units.
const MAX_FIELD_NAME_UNITS: usize = 256;

fn parse_metadata_payload(payload: &[u8]) -> Result<MetadataPayload, ReadError> {
    let mut r = ByteReader::new(payload);
    let mut record = MetadataPayload {
        metadata_id: r.u32("MetaDataId")?,
        provider: r.utf16z(MAX_METADATA_NAME_UNITS, "ProviderName")?,
        event_id: r.u32("EventId")?,
        event_name: r.utf16z(MAX_METADATA_NAME_UNITS, "EventName")?,
        keywords: r.u64("Keywords")?,
        version: r.u32("Version")?,
        level: r.u32("Level")?,
        fields: Vec::new(),
    };
    // The field list is optional (older writers end the record here) and
    // only self-describing events need it: a bad one leaves it empty
    // rather than losing the record.
    if !r.is_empty() {
        let mut budget = MAX_FIELDS;
        record.fields = parse_fields(&mut r, 0, &mut budget).unwrap_or_default();
    }
    Ok(record)
}

/// `u32 count`, then `count` fields (see [`FieldDescription`]).
fn parse_fields(
    r: &mut ByteReader<'_>,
    depth: u32,
    budget: &mut usize,
) -> Result<Vec<FieldDescription>, ReadError> {
    let count = r.u32("FieldCount")? as usize;
    if count > *budget || depth > MAX_FIELD_DEPTH {
        return Err(ReadError::Truncated {
            field: "FieldCount",
            offset: r.pos(),
            needed: count,
            available: *budget,
        });
    }
    *budget -= count;
    let mut fields = Vec::with_capacity(count);
    for _ in 0..count {
        let type_code = r.u32("TypeCode")?;
        let nested = if type_code == super::type_code::OBJECT {
            parse_fields(r, depth + 1, budget)?
        } else {
            Vec::new()
        };
        let name = r.utf16z(MAX_FIELD_NAME_UNITS, "FieldName")?;
        fields.push(FieldDescription {
            name: name.into(),
            type_code,
            fields: nested.into(),
        });
    }
    Ok(fields)
}
