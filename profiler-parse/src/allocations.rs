//! Allocation events of the runtime, decoded from the payloads of the
//! profiler's allocation session (`clr::alloc_session`) for its allocation
//! sampler (`profile::alloc_sampling`). Layouts from
//! `ClrEtwAll.man`, as PerfView's `ClrTraceEventParser` and Datadog's
//! `ClrEventsParser` read them, with 64-bit pointers:
//!
//! - `GCAllocationTick` (id 10, GC keyword 0x1, level Verbose): fired on
//!   the allocating thread each time about 100 KiB ([`TICK_BYTES`]) were
//!   handed to allocation contexts of one object heap (SOH, LOH, POH),
//!   naming the object whose allocation crossed the threshold. V2 added
//!   `AllocationAmount64`, `TypeID`, `TypeName`, `HeapIndex`; V3 (.NET Core
//!   3.x and .NET 5) `Address`; V4 (.NET 6+) `ObjectSize`. V0 and V1 carry
//!   no type: they are ignored (no runtime clrbpf supports sends them).
//! - `AllocationSampled` (id 303, AllocationSampling keyword 0x80000000000,
//!   level Informational, .NET 10+): a randomized per-byte sample (mean
//!   one per 100 KiB per thread) with `ObjectSize` and `SampledByteOffset`.
//!   While a session enables it, the runtime sends no `GCAllocationTick`.
//!   No .NET 10 runtime is available on this machine: its decoder is tested
//!   on built payloads only, never against a live runtime.

use super::{
    events::{ClrEvent, MAX_STRING_UNITS},
    nettrace::{ReadError, reader::ByteReader},
};

/// `GCAllocationTick`'s event id in the runtime provider.
pub const GC_ALLOCATION_TICK: u32 = 10;
/// `AllocationSampled`'s event id (.NET 10+).
pub const ALLOCATION_SAMPLED: u32 = 303;
/// The runtime's allocation tick threshold (`etw_allocation_tick`) and the
/// mean distance of .NET 10's randomized samples, in bytes.
pub const TICK_BYTES: u64 = 100 * 1024;
/// The first .NET with `AllocationSampled`.
pub const ALLOCATION_SAMPLED_MIN_MAJOR: u32 = 10;
/// Longest type name kept, in UTF-16 code units (generic instantiations
/// of generic instantiations get long; beyond this they are cut).
const MAX_TYPE_NAME_UNITS: usize = 512;
const _: () = assert!(MAX_TYPE_NAME_UNITS <= MAX_STRING_UNITS);

/// The object heap an allocation went to (`AllocationKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllocationHeap {
    /// Small object heap.
    Small,
    /// Large object heap (objects of 85,000 bytes and more).
    Large,
    /// Pinned object heap (.NET 5+).
    Pinned,
}

impl AllocationHeap {
    fn from_kind(kind: u32) -> Self {
        match kind {
            1 => Self::Large,
            2 => Self::Pinned,
            // 0, and values a later runtime may add: the common heap.
            _ => Self::Small,
        }
    }

    /// The `allocation.heap` label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Small => "soh",
            Self::Large => "loh",
            Self::Pinned => "poh",
        }
    }
}

/// Which event an [`Allocation`] came from: their estimators differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocationSource {
    /// `GCAllocationTick`: `amount` bytes were allocated on this heap since
    /// the previous tick; the object named crossed the threshold.
    Tick { amount: u64 },
    /// `AllocationSampled` (.NET 10+): byte `offset` of the object was the
    /// sampled one.
    Sampled { offset: u64 },
}

/// A decoded allocation event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub source: AllocationSource,
    pub heap: AllocationHeap,
    /// The runtime's type name, e.g. `System.Byte[]` (empty when it sent
    /// none).
    pub type_name: String,
    /// MethodTable address.
    pub type_id: u64,
    /// The object's size: V4 ticks (.NET 6+) and `AllocationSampled`;
    /// `None` on .NET Core 3.1 and .NET 5.
    pub object_size: Option<u64>,
}

/// `GCAllocationTick` V2+ (the caller leaves V0/V1 out: no type, no
/// 64-bit amount).
pub(super) fn allocation_tick(r: &mut ByteReader<'_>, version: u32) -> Result<ClrEvent, ReadError> {
    let amount32 = r.u32("AllocationAmount")?;
    let kind = r.u32("AllocationKind")?;
    let _clr_instance_id = r.u16("ClrInstanceID")?;
    let amount64 = r.u64("AllocationAmount64")?;
    let type_id = r.u64("TypeID")?;
    let type_name = r.utf16z(MAX_TYPE_NAME_UNITS, "TypeName")?;
    let _heap_index = r.u32("HeapIndex")?;
    let mut object_size = None;
    if version >= 3 {
        let _address = r.u64("Address")?;
        if version >= 4 {
            object_size = Some(r.u64("ObjectSize")?);
        }
    }
    // The 32-bit amount is the 64-bit one truncated; a runtime that sent
    // 0 in the wide field still has the narrow one.
    let amount = if amount64 == 0 {
        u64::from(amount32)
    } else {
        amount64
    };
    Ok(ClrEvent::Allocation(Allocation {
        source: AllocationSource::Tick { amount },
        heap: AllocationHeap::from_kind(kind),
        type_name,
        type_id,
        object_size,
    }))
}

/// `AllocationSampled` V0 (.NET 10).
pub(super) fn allocation_sampled(
    r: &mut ByteReader<'_>,
    _version: u32,
) -> Result<ClrEvent, ReadError> {
    let kind = r.u32("AllocationKind")?;
    let _clr_instance_id = r.u16("ClrInstanceID")?;
    let type_id = r.u64("TypeID")?;
    let type_name = r.utf16z(MAX_TYPE_NAME_UNITS, "TypeName")?;
    let _address = r.u64("Address")?;
    let object_size = r.u64("ObjectSize")?;
    let offset = r.u64("SampledByteOffset")?;
    Ok(ClrEvent::Allocation(Allocation {
        source: AllocationSource::Sampled { offset },
        heap: AllocationHeap::from_kind(kind),
        type_name,
        type_id,
        object_size: Some(object_size),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{RUNTIME_PROVIDER, decode_clr_event};

    fn utf16z(text: &str) -> Vec<u8> {
        let mut out: Vec<u8> = text.encode_utf16().flat_map(u16::to_le_bytes).collect();
        out.extend_from_slice(&[0, 0]);
        out
    }

    /// A tick payload as the runtime lays it out (§1.2).
    fn tick(version: u32, kind: u32, amount: u64, name: &str, size: u64) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(&(amount as u32).to_le_bytes());
        p.extend_from_slice(&kind.to_le_bytes());
        p.extend_from_slice(&7u16.to_le_bytes());
        p.extend_from_slice(&amount.to_le_bytes());
        p.extend_from_slice(&0x7f00_1234u64.to_le_bytes());
        p.extend_from_slice(&utf16z(name));
        p.extend_from_slice(&0u32.to_le_bytes());
        if version >= 3 {
            p.extend_from_slice(&0x7e00_0000u64.to_le_bytes());
        }
        if version >= 4 {
            p.extend_from_slice(&size.to_le_bytes());
        }
        p
    }

    fn decode(id: u32, version: u32, payload: &[u8]) -> Option<Allocation> {
        match decode_clr_event(RUNTIME_PROVIDER, id, version, payload) {
            Ok(Some(ClrEvent::Allocation(a))) => Some(a),
            Ok(_) => None,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn v4_ticks_carry_the_object_size_and_have_the_documented_length() {
        let payload = tick(4, 0, 104_000, "System.String", 24);
        // PerfView's baseline: a V4 tick naming System.String is 74 bytes.
        assert_eq!(payload.len(), 74);
        let a = decode(GC_ALLOCATION_TICK, 4, &payload).expect("decoded");
        assert_eq!(a.source, AllocationSource::Tick { amount: 104_000 });
        assert_eq!(
            (a.heap, a.type_name.as_str(), a.object_size),
            (AllocationHeap::Small, "System.String", Some(24))
        );
        assert_eq!(a.type_id, 0x7f00_1234);
    }

    #[test]
    fn v3_ticks_of_net_core_3_have_no_object_size() {
        let payload = tick(3, 1, 5_000_000_000, "System.Byte[]", 0);
        let a = decode(GC_ALLOCATION_TICK, 3, &payload).expect("decoded");
        assert_eq!(a.object_size, None);
        assert_eq!(a.heap, AllocationHeap::Large);
        // The 64-bit amount, not the truncated 32-bit one.
        assert_eq!(
            a.source,
            AllocationSource::Tick {
                amount: 5_000_000_000
            }
        );
        // A later version only appends: decoded with the newest layout.
        let mut v5 = tick(4, 2, 1, "X", 9);
        v5.extend_from_slice(&[1, 2, 3]);
        let a = decode(GC_ALLOCATION_TICK, 5, &v5).expect("decoded");
        assert_eq!((a.heap, a.object_size), (AllocationHeap::Pinned, Some(9)));
    }

    #[test]
    fn old_and_malformed_ticks_are_ignored_or_errors() {
        assert_eq!(decode(GC_ALLOCATION_TICK, 1, &[0; 10]), None);
        let payload = tick(4, 0, 100, "System.Object", 24);
        for cut in [0, 9, 20, 40, payload.len() - 1] {
            assert!(
                decode_clr_event(RUNTIME_PROVIDER, GC_ALLOCATION_TICK, 4, &payload[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        // A name without its terminator: an error, not a read past the end.
        let mut open = tick(2, 0, 1, "", 0);
        open.truncate(26);
        open.extend_from_slice(&[0x41, 0]);
        assert!(decode_clr_event(RUNTIME_PROVIDER, GC_ALLOCATION_TICK, 2, &open).is_err());
    }

    #[test]
    fn allocation_sampled_of_net_10_decodes_from_a_built_payload() {
        // No .NET 10 runtime here: the layout of §3.2, built by hand.
        let mut p = Vec::new();
        p.extend_from_slice(&1u32.to_le_bytes());
        p.extend_from_slice(&3u16.to_le_bytes());
        p.extend_from_slice(&0x55u64.to_le_bytes());
        p.extend_from_slice(&utf16z("System.Int32[]"));
        p.extend_from_slice(&0x1000u64.to_le_bytes());
        p.extend_from_slice(&200_000u64.to_le_bytes());
        p.extend_from_slice(&777u64.to_le_bytes());
        assert_eq!(p.len(), 38 + 2 * 15);
        let a = decode(ALLOCATION_SAMPLED, 0, &p).expect("decoded");
        assert_eq!(a.source, AllocationSource::Sampled { offset: 777 });
        assert_eq!(
            (a.heap, a.type_name.as_str(), a.object_size),
            (AllocationHeap::Large, "System.Int32[]", Some(200_000))
        );
        assert!(
            decode_clr_event(RUNTIME_PROVIDER, ALLOCATION_SAMPLED, 0, &p[..p.len() - 1]).is_err()
        );
    }

    /// Generic types keep the runtime's form (`List`1[System.Int32]`, as a
    /// .NET 8 tick names them), the form managed frames show their
    /// declaring type in (the profiler's `symbolize::method_name` checks
    /// that its frames name these types the same way).
    #[test]
    fn generic_type_names_read_as_the_frames_name_their_types() {
        for tick_name in [
            "System.Collections.Generic.List`1[System.Int32]",
            "System.Collections.Generic.Dictionary`2[System.Int32,System.Int64]",
        ] {
            let a = decode(GC_ALLOCATION_TICK, 4, &tick(4, 0, 1, tick_name, 32)).expect("decoded");
            assert_eq!(a.type_name, tick_name);
        }
    }

    #[test]
    fn long_type_names_are_bounded() {
        let name = "A".repeat(5_000);
        let a = decode(GC_ALLOCATION_TICK, 4, &tick(4, 0, 1, &name, 8)).expect("decoded");
        assert_eq!(a.type_name.len(), MAX_TYPE_NAME_UNITS);
        assert_eq!(a.object_size, Some(8), "the rest of the payload still read");
    }
}
