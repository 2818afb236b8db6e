//! Typed CLR runtime events, decoded from the payloads the nettrace parser
//! ([`super::nettrace`]) delivers. The runtime sends no field descriptions
//! for its own events, so the layouts are written down here, keyed by
//! (provider, event id, version) as in dotnet/runtime's
//! `src/coreclr/vm/ClrEtwAll.man`. The decoded events
//! go to the contention, exception and wait samplers and to the managed
//! symbol index (method load and rundown events).
//!
//! Versioning follows ETW's rule that a new version only appends fields: a
//! version newer than the newest layout known here is decoded with that
//! layout and its extra bytes are ignored. Strings are UTF-16, bounded to
//! [`MAX_STRING_UNITS`] code units and decoded lossily. Pointer-sized fields
//! are read as 8 bytes: 64-bit targets only (x86-64, arm64).

use thiserror::Error;

use super::{
    allocations,
    nettrace::{EventRecord, ReadError, reader::ByteReader},
};

/// The runtime's own provider (JIT, loader, contention, exceptions, waits).
pub const RUNTIME_PROVIDER: &str = "Microsoft-Windows-DotNETRuntime";
/// The provider of rundown events, sent when a session with rundown stops.
pub const RUNDOWN_PROVIDER: &str = "Microsoft-Windows-DotNETRuntimeRundown";
/// Longest string kept from a payload, in UTF-16 code units (4 KiB).
pub const MAX_STRING_UNITS: usize = 2048;

/// Event ids of [`RUNTIME_PROVIDER`] decoded here.
pub mod runtime_event {
    pub const EXCEPTION_THROWN: u32 = 80;
    pub const CONTENTION_START: u32 = 81;
    pub const CONTENTION_LOCK_CREATED: u32 = 90;
    pub const CONTENTION_STOP: u32 = 91;
    pub const METHOD_LOAD_VERBOSE: u32 = 143;
    pub const METHOD_UNLOAD_VERBOSE: u32 = 144;
    pub const MODULE_LOAD: u32 = 152;
    pub const MODULE_UNLOAD: u32 = 153;
    pub const R2R_GET_ENTRY_POINT: u32 = 159;
    pub const WAIT_HANDLE_WAIT_START: u32 = 301;
    pub const WAIT_HANDLE_WAIT_STOP: u32 = 302;
}

/// Event ids of [`RUNDOWN_PROVIDER`] decoded here.
pub mod rundown_event {
    pub const METHOD_DC_START_VERBOSE: u32 = 143;
    pub const METHOD_DC_END_VERBOSE: u32 = 144;
    pub const DC_START_COMPLETE: u32 = 145;
    pub const DC_END_COMPLETE: u32 = 146;
    pub const DC_START_INIT: u32 = 147;
    pub const DC_END_INIT: u32 = 148;
    pub const MODULE_DC_START: u32 = 153;
    pub const MODULE_DC_END: u32 = 154;
}

/// `ContentionFlags` bit 0: the lock is a native (runtime-internal) one.
pub const CONTENTION_FLAG_NATIVE: u8 = 1;

/// A thread started waiting for a contended lock (ContentionStart, id 81).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContentionStart {
    /// 0 managed, [`CONTENTION_FLAG_NATIVE`] native.
    pub flags: u8,
    pub clr_instance_id: u16,
    /// V2 (.NET 8+): identity of the lock.
    pub lock_id: Option<u64>,
    /// V2: the object locked on (`lock (obj)`).
    pub associated_object_id: Option<u64>,
    /// V2: OS thread id of the thread holding the lock; `None` also when
    /// the runtime reports 0 (no owner at that instant).
    pub lock_owner_thread_id: Option<u64>,
}

/// A thread acquired the lock it contended for (ContentionStop, id 91).
#[derive(Clone, Debug, PartialEq)]
pub struct ContentionStop {
    pub flags: u8,
    pub clr_instance_id: u16,
    /// V1 (.NET 8+): how long the thread waited, measured by the runtime.
    pub duration_ns: Option<f64>,
}

/// A lock object was created (ContentionLockCreated, id 90, .NET 8+).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContentionLockCreated {
    pub lock_id: u64,
    pub associated_object_id: u64,
    pub clr_instance_id: u16,
}

/// An exception was thrown (ExceptionThrown_V1, id 80).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExceptionThrown {
    /// Full type name, e.g. `System.InvalidOperationException`.
    pub type_name: String,
    pub message: String,
    /// Instruction pointer of the throw.
    pub eip: u64,
    pub hresult: u32,
    /// 0x1 HasInnerException, 0x2 Nested, 0x4 ReThrown, 0x8 CorruptedState,
    /// 0x10 CLSCompliant.
    pub flags: u16,
    pub clr_instance_id: u16,
}

/// A thread started waiting on a wait handle (id 301, .NET 9+).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitHandleWaitStart {
    /// 0 other, 1 Monitor.Wait.
    pub wait_source: u8,
    pub associated_object_id: u64,
    pub clr_instance_id: u16,
}

/// The wait that started last on this thread ended (id 302, .NET 9+).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitHandleWaitStop {
    pub clr_instance_id: u16,
}

/// Which event a [`MethodLoad`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MethodEventKind {
    /// MethodLoadVerbose (runtime provider, 143): code was just compiled.
    Load,
    /// MethodUnloadVerbose (runtime provider, 144): code is gone.
    Unload,
    /// MethodDCStartVerbose (rundown provider, 143).
    RundownStart,
    /// MethodDCEndVerbose (rundown provider, 144): code alive when the
    /// session stopped.
    RundownEnd,
}

/// One native code body of a method, with the names the runtime gives it
/// (MethodLoadVerbose and its unload and rundown twins share the layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MethodLoad {
    pub kind: MethodEventKind,
    pub method_id: u64,
    pub module_id: u64,
    /// First byte of the native code.
    pub start: u64,
    pub size: u32,
    pub token: u32,
    /// Bit set described at [`MethodLoad::tier`] and `MethodFlags` in the
    /// reference.
    pub flags: u32,
    /// The declaring type, dotted and with generic arity
    /// (`System.Collections.Generic.List`1[System.Int32]`).
    pub namespace: String,
    pub name: String,
    /// Return type and parameters in the runtime's IL-like syntax,
    /// e.g. `int64  (int64)` or `instance void  (class System.String)`.
    pub signature: String,
    pub clr_instance_id: u16,
    /// V2: non-zero for a re-JIT (a new code version of the same method).
    pub rejit_id: u64,
}

/// JIT optimization tier, `MethodFlags` bits 7..9, numbered and named as
/// the runtime's `JitOptimizationTier` (prestub.cpp).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptimizationTier {
    Unknown,
    MinOptJitted,
    Optimized,
    QuickJitted,
    OptimizedTier1,
    OptimizedTier1Osr,
    /// Tier 0 with instrumentation for profile-guided optimization.
    InstrumentedTier,
    /// Optimized code with instrumentation.
    InstrumentedTierOptimized,
}

impl OptimizationTier {
    /// The name the runtime puts in perf map brackets (`[QuickJitted]`,
    /// `GetJitOptimizationTierStr`).
    pub fn perf_map_name(self) -> &'static str {
        match self {
            Self::Unknown => "Unknown",
            Self::MinOptJitted => "MinOptJitted",
            Self::Optimized => "Optimized",
            Self::QuickJitted => "QuickJitted",
            Self::OptimizedTier1 => "OptimizedTier1",
            Self::OptimizedTier1Osr => "OptimizedTier1OSR",
            Self::InstrumentedTier => "InstrumentedTier",
            Self::InstrumentedTierOptimized => "InstrumentedTierOptimized",
        }
    }
}

/// `MethodFlags` bits.
pub mod method_flags {
    pub const DYNAMIC: u32 = 0x1;
    pub const GENERIC: u32 = 0x2;
    pub const HAS_SHARED_GENERIC_CODE: u32 = 0x4;
    pub const JITTED: u32 = 0x8;
    pub const JIT_HELPER: u32 = 0x10;
    pub const TIER_SHIFT: u32 = 7;
    pub const TIER_MASK: u32 = 0x7 << TIER_SHIFT;
}

impl MethodLoad {
    /// The JIT tier encoded in [`Self::flags`].
    pub fn tier(&self) -> OptimizationTier {
        match (self.flags & method_flags::TIER_MASK) >> method_flags::TIER_SHIFT {
            1 => OptimizationTier::MinOptJitted,
            2 => OptimizationTier::Optimized,
            3 => OptimizationTier::QuickJitted,
            4 => OptimizationTier::OptimizedTier1,
            5 => OptimizationTier::OptimizedTier1Osr,
            6 => OptimizationTier::InstrumentedTier,
            7 => OptimizationTier::InstrumentedTierOptimized,
            _ => OptimizationTier::Unknown,
        }
    }

    /// Whether the code came from the JIT (else ReadyToRun/NGen).
    #[cfg(test)]
    pub fn is_jitted(&self) -> bool {
        self.flags & method_flags::JITTED != 0
    }

    /// `[start, start + size)`.
    #[cfg(test)]
    pub fn code_range(&self) -> std::ops::Range<u64> {
        self.start..self.start.saturating_add(u64::from(self.size))
    }

    /// The frame name, shaped like the runtime's perf map names; see
    /// [`method_display_name`].
    pub fn display_name(&self) -> String {
        method_display_name(&self.namespace, &self.name, &self.signature)
    }
}

/// Which event a [`ModuleLoad`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModuleEventKind {
    Load,
    Unload,
    RundownStart,
    RundownEnd,
}

/// A module (assembly file) of the process (ModuleLoad_V2 family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleLoad {
    pub kind: ModuleEventKind,
    pub module_id: u64,
    pub assembly_id: u64,
    /// 0x1 DomainNeutral, 0x2 Native, 0x4 Dynamic, 0x8 Manifest,
    /// 0x20 ReadyToRun, 0x40 PartialReadyToRun.
    pub flags: u32,
    pub il_path: String,
    pub native_path: String,
    pub clr_instance_id: u16,
}

/// A ReadyToRun method's precompiled entry point was looked up
/// (R2RGetEntryPoint, id 159, CompilationDiagnostic keyword).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct R2REntryPoint {
    pub method_id: u64,
    pub namespace: String,
    pub name: String,
    pub signature: String,
    pub entry_point: u64,
    pub clr_instance_id: u16,
}

/// Markers around a rundown (DCStartInit/DCEndInit and
/// DCStartComplete/DCEndComplete).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RundownMarker {
    StartInit,
    StartComplete,
    EndInit,
    /// The rundown's last event: every live method has been reported.
    EndComplete,
}

/// A decoded runtime event.
#[derive(Clone, Debug, PartialEq)]
pub enum ClrEvent {
    ContentionStart(ContentionStart),
    ContentionStop(ContentionStop),
    ContentionLockCreated(ContentionLockCreated),
    ExceptionThrown(ExceptionThrown),
    WaitHandleWaitStart(WaitHandleWaitStart),
    WaitHandleWaitStop(WaitHandleWaitStop),
    Method(MethodLoad),
    Module(ModuleLoad),
    R2REntryPoint(R2REntryPoint),
    Rundown(RundownMarker),
    /// GCAllocationTick or AllocationSampled ([`super::allocations`]).
    Allocation(allocations::Allocation),
}

/// The kinds of [`ClrEvent`], for counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClrEventKind {
    ContentionStart,
    ContentionStop,
    ContentionLockCreated,
    ExceptionThrown,
    WaitHandleWaitStart,
    WaitHandleWaitStop,
    Method,
    Module,
    R2REntryPoint,
    Rundown,
    Allocation,
}

impl ClrEventKind {
    pub const ALL: [Self; 11] = [
        Self::ContentionStart,
        Self::ContentionStop,
        Self::ContentionLockCreated,
        Self::ExceptionThrown,
        Self::WaitHandleWaitStart,
        Self::WaitHandleWaitStop,
        Self::Method,
        Self::Module,
        Self::R2REntryPoint,
        Self::Rundown,
        Self::Allocation,
    ];

    /// The event's name as the runtime manifest spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::ContentionStart => "ContentionStart",
            Self::ContentionStop => "ContentionStop",
            Self::ContentionLockCreated => "ContentionLockCreated",
            Self::ExceptionThrown => "ExceptionThrown",
            Self::WaitHandleWaitStart => "WaitHandleWaitStart",
            Self::WaitHandleWaitStop => "WaitHandleWaitStop",
            Self::Method => "MethodLoadVerbose",
            Self::Module => "ModuleLoad",
            Self::R2REntryPoint => "R2RGetEntryPoint",
            Self::Rundown => "DCStartEnd",
            Self::Allocation => "GCAllocationTick",
        }
    }
}

impl ClrEvent {
    pub fn kind(&self) -> ClrEventKind {
        match self {
            Self::ContentionStart(_) => ClrEventKind::ContentionStart,
            Self::ContentionStop(_) => ClrEventKind::ContentionStop,
            Self::ContentionLockCreated(_) => ClrEventKind::ContentionLockCreated,
            Self::ExceptionThrown(_) => ClrEventKind::ExceptionThrown,
            Self::WaitHandleWaitStart(_) => ClrEventKind::WaitHandleWaitStart,
            Self::WaitHandleWaitStop(_) => ClrEventKind::WaitHandleWaitStop,
            Self::Method(_) => ClrEventKind::Method,
            Self::Module(_) => ClrEventKind::Module,
            Self::R2REntryPoint(_) => ClrEventKind::R2REntryPoint,
            Self::Rundown(_) => ClrEventKind::Rundown,
            Self::Allocation(_) => ClrEventKind::Allocation,
        }
    }
}

/// A payload too short or malformed for the layout of its (id, version).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{} event (id {event_id}, version {version}) payload of {payload_len} bytes: {source}", kind.name())]
pub struct ClrEventError {
    pub kind: ClrEventKind,
    pub event_id: u32,
    pub version: u32,
    pub payload_len: usize,
    #[source]
    pub source: ReadError,
}

/// Decode one event. `Ok(None)` means the event is not one this module
/// knows (other providers, other ids, version 0 of events whose V0 carried
/// no useful fields).
pub fn decode_clr_event(
    provider: &str,
    event_id: u32,
    version: u32,
    payload: &[u8],
) -> Result<Option<ClrEvent>, ClrEventError> {
    let Some((kind, decode)) = decoder_for(provider, event_id, version) else {
        return Ok(None);
    };
    let mut reader = ByteReader::new(payload);
    decode(&mut reader, version)
        .map(Some)
        .map_err(|source| ClrEventError {
            kind,
            event_id,
            version,
            payload_len: payload.len(),
            source,
        })
}

type Decode = fn(&mut ByteReader<'_>, u32) -> Result<ClrEvent, ReadError>;

fn decoder_for(provider: &str, event_id: u32, version: u32) -> Option<(ClrEventKind, Decode)> {
    use ClrEventKind as K;
    if provider == RUNTIME_PROVIDER {
        use runtime_event as E;
        Some(match event_id {
            E::EXCEPTION_THROWN if version >= 1 => (K::ExceptionThrown, exception_thrown),
            E::CONTENTION_START => (K::ContentionStart, contention_start),
            E::CONTENTION_LOCK_CREATED => (K::ContentionLockCreated, contention_lock_created),
            E::CONTENTION_STOP => (K::ContentionStop, contention_stop),
            E::METHOD_LOAD_VERBOSE => (K::Method, |r, v| method(r, v, MethodEventKind::Load)),
            E::METHOD_UNLOAD_VERBOSE => (K::Method, |r, v| method(r, v, MethodEventKind::Unload)),
            E::MODULE_LOAD if version >= 1 => {
                (K::Module, |r, v| module(r, v, ModuleEventKind::Load))
            }
            E::MODULE_UNLOAD if version >= 1 => {
                (K::Module, |r, v| module(r, v, ModuleEventKind::Unload))
            }
            E::R2R_GET_ENTRY_POINT => (K::R2REntryPoint, r2r_entry_point),
            E::WAIT_HANDLE_WAIT_START => (K::WaitHandleWaitStart, wait_start),
            E::WAIT_HANDLE_WAIT_STOP => (K::WaitHandleWaitStop, wait_stop),
            allocations::GC_ALLOCATION_TICK if version >= 2 => {
                (K::Allocation, allocations::allocation_tick)
            }
            allocations::ALLOCATION_SAMPLED => (K::Allocation, allocations::allocation_sampled),
            _ => return None,
        })
    } else if provider == RUNDOWN_PROVIDER {
        use rundown_event as E;
        Some(match event_id {
            E::METHOD_DC_START_VERBOSE => (K::Method, |r, v| {
                method(r, v, MethodEventKind::RundownStart)
            }),
            E::METHOD_DC_END_VERBOSE => {
                (K::Method, |r, v| method(r, v, MethodEventKind::RundownEnd))
            }
            E::MODULE_DC_START if version >= 1 => (K::Module, |r, v| {
                module(r, v, ModuleEventKind::RundownStart)
            }),
            E::MODULE_DC_END if version >= 1 => {
                (K::Module, |r, v| module(r, v, ModuleEventKind::RundownEnd))
            }
            E::DC_START_INIT => (K::Rundown, |_, _| {
                Ok(ClrEvent::Rundown(RundownMarker::StartInit))
            }),
            E::DC_START_COMPLETE => (K::Rundown, |_, _| {
                Ok(ClrEvent::Rundown(RundownMarker::StartComplete))
            }),
            E::DC_END_INIT => (K::Rundown, |_, _| {
                Ok(ClrEvent::Rundown(RundownMarker::EndInit))
            }),
            E::DC_END_COMPLETE => (K::Rundown, |_, _| {
                Ok(ClrEvent::Rundown(RundownMarker::EndComplete))
            }),
            _ => return None,
        })
    } else {
        None
    }
}

/// ClrInstanceID when the payload still has it (absent in some V0 layouts).
fn optional_u16(r: &mut ByteReader<'_>, field: &'static str) -> Result<u16, ReadError> {
    if r.remaining() >= 2 {
        r.u16(field)
    } else {
        Ok(0)
    }
}

fn string(r: &mut ByteReader<'_>, field: &'static str) -> Result<String, ReadError> {
    r.utf16z(MAX_STRING_UNITS, field)
}

fn exception_thrown(r: &mut ByteReader<'_>, _version: u32) -> Result<ClrEvent, ReadError> {
    Ok(ClrEvent::ExceptionThrown(ExceptionThrown {
        type_name: string(r, "ExceptionType")?,
        message: string(r, "ExceptionMessage")?,
        eip: r.u64("ExceptionEIP")?,
        hresult: r.u32("ExceptionHRESULT")?,
        flags: r.u16("ExceptionFlags")?,
        clr_instance_id: r.u16("ClrInstanceID")?,
    }))
}

/// Two V2 layouts shipped: `LockID, AssociatedObjectID, u64 owner` (27 bytes,
/// .NET 8) and an earlier `LockObjectID, LockOwnerThreadID` (19 bytes); the
/// payload length tells them apart.
fn contention_start(r: &mut ByteReader<'_>, version: u32) -> Result<ClrEvent, ReadError> {
    let mut event = ContentionStart {
        flags: 0,
        clr_instance_id: 0,
        lock_id: None,
        associated_object_id: None,
        lock_owner_thread_id: None,
    };
    // V0 carried no payload on some runtimes.
    if version == 0 && r.is_empty() {
        return Ok(ClrEvent::ContentionStart(event));
    }
    event.flags = r.u8("ContentionFlags")?;
    event.clr_instance_id = r.u16("ClrInstanceID")?;
    if version >= 2 {
        if r.remaining() >= 24 {
            event.lock_id = Some(r.u64("LockID")?);
            event.associated_object_id = Some(r.u64("AssociatedObjectID")?);
            event.lock_owner_thread_id = Some(r.u64("LockOwnerThreadID")?).filter(|&id| id != 0);
        } else {
            event.associated_object_id = Some(r.u64("LockObjectID")?);
            event.lock_owner_thread_id = Some(r.u64("LockOwnerThreadID")?).filter(|&id| id != 0);
        }
    }
    Ok(ClrEvent::ContentionStart(event))
}

fn contention_stop(r: &mut ByteReader<'_>, version: u32) -> Result<ClrEvent, ReadError> {
    if version == 0 && r.is_empty() {
        return Ok(ClrEvent::ContentionStop(ContentionStop {
            flags: 0,
            clr_instance_id: 0,
            duration_ns: None,
        }));
    }
    let flags = r.u8("ContentionFlags")?;
    let clr_instance_id = r.u16("ClrInstanceID")?;
    let duration_ns = if version >= 1 {
        Some(r.f64("DurationNs")?)
    } else {
        None
    };
    Ok(ClrEvent::ContentionStop(ContentionStop {
        flags,
        clr_instance_id,
        duration_ns,
    }))
}

fn contention_lock_created(r: &mut ByteReader<'_>, _version: u32) -> Result<ClrEvent, ReadError> {
    Ok(ClrEvent::ContentionLockCreated(ContentionLockCreated {
        lock_id: r.u64("LockID")?,
        associated_object_id: r.u64("AssociatedObjectID")?,
        clr_instance_id: r.u16("ClrInstanceID")?,
    }))
}

fn wait_start(r: &mut ByteReader<'_>, _version: u32) -> Result<ClrEvent, ReadError> {
    Ok(ClrEvent::WaitHandleWaitStart(WaitHandleWaitStart {
        wait_source: r.u8("WaitSource")?,
        associated_object_id: r.u64("AssociatedObjectID")?,
        clr_instance_id: r.u16("ClrInstanceID")?,
    }))
}

fn wait_stop(r: &mut ByteReader<'_>, _version: u32) -> Result<ClrEvent, ReadError> {
    Ok(ClrEvent::WaitHandleWaitStop(WaitHandleWaitStop {
        clr_instance_id: r.u16("ClrInstanceID")?,
    }))
}

/// V0: no ClrInstanceID; V1 adds it; V2 adds ReJITID.
fn method(
    r: &mut ByteReader<'_>,
    version: u32,
    kind: MethodEventKind,
) -> Result<ClrEvent, ReadError> {
    let method_id = r.u64("MethodID")?;
    let module_id = r.u64("ModuleID")?;
    let start = r.u64("MethodStartAddress")?;
    let size = r.u32("MethodSize")?;
    let token = r.u32("MethodToken")?;
    let flags = r.u32("MethodFlags")?;
    let namespace = string(r, "MethodNamespace")?;
    let name = string(r, "MethodName")?;
    let signature = string(r, "MethodSignature")?;
    let clr_instance_id = if version >= 1 {
        r.u16("ClrInstanceID")?
    } else {
        optional_u16(r, "ClrInstanceID")?
    };
    let rejit_id = if version >= 2 { r.u64("ReJITID")? } else { 0 };
    Ok(ClrEvent::Method(MethodLoad {
        kind,
        method_id,
        module_id,
        start,
        size,
        token,
        flags,
        namespace,
        name,
        signature,
        clr_instance_id,
        rejit_id,
    }))
}

/// ModuleLoad V1/V2 up to ClrInstanceID; the V2 PDB fields after it are not
/// needed.
fn module(
    r: &mut ByteReader<'_>,
    _version: u32,
    kind: ModuleEventKind,
) -> Result<ClrEvent, ReadError> {
    let module_id = r.u64("ModuleID")?;
    let assembly_id = r.u64("AssemblyID")?;
    let flags = r.u32("ModuleFlags")?;
    r.u32("Reserved1")?;
    Ok(ClrEvent::Module(ModuleLoad {
        kind,
        module_id,
        assembly_id,
        flags,
        il_path: string(r, "ModuleILPath")?,
        native_path: string(r, "ModuleNativePath")?,
        clr_instance_id: r.u16("ClrInstanceID")?,
    }))
}

fn r2r_entry_point(r: &mut ByteReader<'_>, _version: u32) -> Result<ClrEvent, ReadError> {
    Ok(ClrEvent::R2REntryPoint(R2REntryPoint {
        method_id: r.u64("MethodID")?,
        namespace: string(r, "MethodNamespace")?,
        name: string(r, "MethodName")?,
        signature: string(r, "MethodSignature")?,
        entry_point: r.u64("EntryPoint")?,
        clr_instance_id: r.u16("ClrInstanceID")?,
    }))
}

/// Counters of a [`ClrEventDecoder`], per event kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClrDecodeStats {
    decoded: [u64; ClrEventKind::ALL.len()],
    malformed: [u64; ClrEventKind::ALL.len()],
    /// Events of providers, ids or versions not decoded here.
    pub ignored: u64,
}

impl ClrDecodeStats {
    pub fn decoded(&self, kind: ClrEventKind) -> u64 {
        self.decoded[kind as usize]
    }

    pub fn malformed(&self, kind: ClrEventKind) -> u64 {
        self.malformed[kind as usize]
    }

    #[cfg(test)]
    pub fn total_decoded(&self) -> u64 {
        self.decoded.iter().sum()
    }

    #[cfg(test)]
    pub fn total_malformed(&self) -> u64 {
        self.malformed.iter().sum()
    }
}

/// Decodes the events of one session and counts what it saw.
#[derive(Clone, Debug, Default)]
pub struct ClrEventDecoder {
    stats: ClrDecodeStats,
    last_error: Option<ClrEventError>,
}

impl ClrEventDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The event, or `None` for an ignored or malformed one (both counted).
    pub fn decode(&mut self, record: &EventRecord<'_>) -> Option<ClrEvent> {
        match decode_clr_event(
            record.provider,
            record.event_id,
            record.version,
            record.payload,
        ) {
            Ok(Some(event)) => {
                self.stats.decoded[event.kind() as usize] += 1;
                Some(event)
            }
            Ok(None) => {
                self.stats.ignored += 1;
                None
            }
            Err(error) => {
                self.stats.malformed[error.kind as usize] += 1;
                self.last_error = Some(error);
                None
            }
        }
    }

    pub fn stats(&self) -> &ClrDecodeStats {
        &self.stats
    }

    pub fn last_error(&self) -> Option<&ClrEventError> {
        self.last_error.as_ref()
    }
}

/// A managed frame name from MethodLoadVerbose fields, spelled like the
/// perf map names the runtime writes. For the perf map line
/// `int64 [App] Demo.Worker::Spin(int64)[QuickJitted]` this gives
/// `int64 Demo.Worker::Spin(int64)`; see [`method_display_name_in_assembly`]
/// for the `[App]` part.
///
/// The event spells types like ILDASM's signature printer
/// (`class System.String`, `value class X`, `wchar`, `unsigned int32`,
/// `int`); they are respelled the perf map's way (`string`, `valuetype X`,
/// `char`, `uint32`, `native int`), and the `generic` calling-convention
/// word the perf map omits is dropped. Differences that remain:
/// - the JIT tier (`[QuickJitted]`) is not part of the name: it is
///   [`MethodLoad::tier`], kept apart so a method's tiers stay one function;
/// - types the runtime could not name print as `pMT: 0x...` in the event
///   and as `Name /* MT: 0x... */` in the perf map;
/// - in IL stubs, types of other assemblies and nested types are qualified
///   in the perf map (`class [System.Runtime]X`, `Interop/Sys/FileStatus`)
///   and not in the event (`class X`, `FileStatus`);
/// - the perf map's `[Assembly]` needs the module's name (not in the event).
pub fn method_display_name(namespace: &str, name: &str, signature: &str) -> String {
    format_method_name(None, namespace, name, signature)
}

/// [`method_display_name`] with the assembly's simple name in brackets after
/// the return type, as in the perf map: `int64 [App] Demo.Worker::Spin(int64)`.
/// The assembly comes from the method's module ([`ModuleLoad::il_path`],
/// through [`assembly_simple_name`]).
#[cfg(test)]
pub fn method_display_name_in_assembly(
    assembly: &str,
    namespace: &str,
    name: &str,
    signature: &str,
) -> String {
    format_method_name(Some(assembly), namespace, name, signature)
}

/// The simple name of the assembly in a module file: the file name without
/// directory and `.dll`/`.exe` (`/app/App.dll` -> `App`). An assembly whose
/// file was renamed is named after its file here.
#[cfg(test)]
pub fn assembly_simple_name(module_path: &str) -> &str {
    let file = module_path
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or(module_path);
    let lower = file.to_ascii_lowercase();
    if lower.ends_with(".dll") || lower.ends_with(".exe") {
        &file[..file.len() - 4]
    } else {
        file
    }
}

fn format_method_name(
    assembly: Option<&str>,
    namespace: &str,
    name: &str,
    signature: &str,
) -> String {
    let signature = respell_signature(signature.trim());
    // `[instance ]<return type>  (<parameters>)`: the runtime puts two spaces
    // before the parameter list; a return type only holds parentheses in the
    // rare function-pointer case, which the double space keeps apart.
    let (return_part, parameters) = match signature.find("  (").or_else(|| signature.find('(')) {
        Some(split) => (signature[..split].trim(), signature[split..].trim()),
        None => (signature.as_str(), "()"),
    };
    let mut out = String::with_capacity(
        return_part.len()
            + assembly.map_or(0, str::len)
            + namespace.len()
            + name.len()
            + parameters.len()
            + 8,
    );
    if !return_part.is_empty() {
        out.push_str(return_part);
        out.push(' ');
    }
    if let Some(assembly) = assembly {
        out.push('[');
        out.push_str(assembly);
        out.push_str("] ");
    }
    if !namespace.is_empty() {
        out.push_str(namespace);
        out.push_str("::");
    }
    out.push_str(name);
    out.push_str(parameters);
    out
}

/// Characters that end a word of a signature.
fn is_signature_delimiter(c: char) -> bool {
    matches!(c, ' ' | '(' | ')' | ',' | '<' | '>' | '[' | ']' | '&' | '*')
}

/// Split `text` into its first word (up to a delimiter) and the rest.
fn first_word(text: &str) -> (&str, &str) {
    text.split_at(text.find(is_signature_delimiter).unwrap_or(text.len()))
}

/// Respell an event signature's type names the way the perf map writes them.
fn respell_signature(signature: &str) -> String {
    let mut out = String::with_capacity(signature.len());
    let mut rest = signature.strip_prefix("generic ").unwrap_or(signature);
    while let Some(c) = rest.chars().next() {
        if is_signature_delimiter(c) {
            out.push(c);
            rest = &rest[c.len_utf8()..];
            continue;
        }
        let (word, after) = first_word(rest);
        // Two-word spellings: look at the word after a single space.
        let (next, after_next) = after
            .strip_prefix(' ')
            .map(first_word)
            .unwrap_or(("", after));
        let (replacement, consumed_rest) = match (word, next) {
            ("class", "System.String") => ("string", after_next),
            ("class", "System.Object") => ("object", after_next),
            ("value", "class") => ("valuetype", after_next),
            ("unsigned", "int8") => ("uint8", after_next),
            ("unsigned", "int16") => ("uint16", after_next),
            ("unsigned", "int32") => ("uint32", after_next),
            ("unsigned", "int64") => ("uint64", after_next),
            ("unsigned", "int") => ("native uint", after_next),
            ("int", _) => ("native int", after),
            ("wchar", _) => ("char", after),
            _ => (word, after),
        };
        out.push_str(replacement);
        rest = consumed_rest;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nettrace::writer::utf16z;

    fn method_payload(version: u32) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend(0x1111u64.to_le_bytes()); // MethodID
        p.extend(0x2222u64.to_le_bytes()); // ModuleID
        p.extend(0x7f00_1000u64.to_le_bytes()); // start
        p.extend(0x9au32.to_le_bytes()); // size
        p.extend(0x0600_0003u32.to_le_bytes()); // token
        p.extend((0x8u32 | 3 << 7).to_le_bytes()); // jitted, QuickJitted
        p.extend(utf16z("Demo.Worker"));
        p.extend(utf16z("Spin"));
        p.extend(utf16z("int64  (int64)"));
        if version >= 1 {
            p.extend(7u16.to_le_bytes());
        }
        if version >= 2 {
            p.extend(3u64.to_le_bytes());
        }
        p
    }

    #[test]
    fn method_events_decode_in_every_version_and_provider() {
        for version in 0..=2 {
            let payload = method_payload(version);
            for (provider, id, kind) in [
                (RUNTIME_PROVIDER, 143, MethodEventKind::Load),
                (RUNTIME_PROVIDER, 144, MethodEventKind::Unload),
                (RUNDOWN_PROVIDER, 143, MethodEventKind::RundownStart),
                (RUNDOWN_PROVIDER, 144, MethodEventKind::RundownEnd),
            ] {
                let Some(ClrEvent::Method(method)) =
                    decode_clr_event(provider, id, version, &payload).unwrap()
                else {
                    panic!("{provider} {id} v{version} not decoded");
                };
                assert_eq!(method.kind, kind);
                assert_eq!(
                    (
                        method.method_id,
                        method.module_id,
                        method.start,
                        method.size,
                        method.token
                    ),
                    (0x1111, 0x2222, 0x7f00_1000, 0x9a, 0x0600_0003)
                );
                assert_eq!(method.clr_instance_id, if version >= 1 { 7 } else { 0 });
                assert_eq!(method.rejit_id, if version >= 2 { 3 } else { 0 });
                assert_eq!(method.tier(), OptimizationTier::QuickJitted);
                assert!(method.is_jitted());
                assert_eq!(method.code_range(), 0x7f00_1000..0x7f00_109a);
                assert_eq!(method.display_name(), "int64 Demo.Worker::Spin(int64)");
            }
        }
    }

    #[test]
    fn truncated_payloads_are_errors_and_counted() {
        let payload = method_payload(2);
        for len in 0..payload.len() {
            let error = decode_clr_event(RUNTIME_PROVIDER, 143, 2, &payload[..len]).unwrap_err();
            assert_eq!(
                (error.kind, error.event_id, error.version, error.payload_len),
                (ClrEventKind::Method, 143, 2, len)
            );
            assert!(
                error
                    .to_string()
                    .starts_with("MethodLoadVerbose event (id 143, version 2)"),
                "{error}"
            );
        }
    }

    #[test]
    fn newer_versions_decode_with_the_newest_known_layout() {
        let mut payload = method_payload(2);
        payload.extend([0xee; 12]); // fields a future version appends
        let event = decode_clr_event(RUNTIME_PROVIDER, 143, 3, &payload).unwrap();
        assert!(matches!(
            event,
            Some(ClrEvent::Method(MethodLoad { rejit_id: 3, .. }))
        ));
    }

    #[test]
    fn contention_events_decode_every_shipped_layout() {
        let start = |version, payload: &[u8]| match decode_clr_event(
            RUNTIME_PROVIDER,
            81,
            version,
            payload,
        ) {
            Ok(Some(ClrEvent::ContentionStart(start))) => start,
            other => panic!("{other:?}"),
        };
        let empty = start(0, &[]);
        assert_eq!((empty.flags, empty.lock_owner_thread_id), (0, None));
        let v1 = start(1, &[1, 5, 0]);
        assert_eq!(
            (v1.flags, v1.clr_instance_id, v1.lock_id),
            (CONTENTION_FLAG_NATIVE, 5, None)
        );

        let mut v2 = vec![0, 1, 0];
        v2.extend(0xaaaau64.to_le_bytes());
        v2.extend(0xbbbbu64.to_le_bytes());
        v2.extend(4321u64.to_le_bytes());
        let v2 = start(2, &v2);
        assert_eq!(
            (v2.lock_id, v2.associated_object_id, v2.lock_owner_thread_id),
            (Some(0xaaaa), Some(0xbbbb), Some(4321))
        );
        // The first V2 layout (19 bytes): object and owner only.
        let mut early = vec![0, 1, 0];
        early.extend(0xbbbbu64.to_le_bytes());
        early.extend(99u64.to_le_bytes());
        let early = start(2, &early);
        assert_eq!(
            (
                early.lock_id,
                early.associated_object_id,
                early.lock_owner_thread_id
            ),
            (None, Some(0xbbbb), Some(99))
        );
        // Owner 0 means no owner.
        let mut unowned = vec![0, 1, 0];
        unowned.extend([0; 24]);
        assert_eq!(start(2, &unowned).lock_owner_thread_id, None);
        assert!(decode_clr_event(RUNTIME_PROVIDER, 81, 2, &[0, 1, 0, 1]).is_err());

        let mut stop = vec![0, 1, 0];
        stop.extend(1.5e6f64.to_le_bytes());
        let stop = decode_clr_event(RUNTIME_PROVIDER, 91, 1, &stop).unwrap();
        assert_eq!(
            stop,
            Some(ClrEvent::ContentionStop(ContentionStop {
                flags: 0,
                clr_instance_id: 1,
                duration_ns: Some(1.5e6)
            }))
        );
        let stop = decode_clr_event(RUNTIME_PROVIDER, 91, 0, &[1, 0, 0]).unwrap();
        assert!(matches!(
            stop,
            Some(ClrEvent::ContentionStop(ContentionStop {
                duration_ns: None,
                flags: 1,
                ..
            }))
        ));

        let mut created = Vec::new();
        created.extend(1u64.to_le_bytes());
        created.extend(2u64.to_le_bytes());
        created.extend(3u16.to_le_bytes());
        assert_eq!(
            decode_clr_event(RUNTIME_PROVIDER, 90, 0, &created).unwrap(),
            Some(ClrEvent::ContentionLockCreated(ContentionLockCreated {
                lock_id: 1,
                associated_object_id: 2,
                clr_instance_id: 3
            }))
        );
    }

    #[test]
    fn exceptions_decode_with_bounded_lossy_strings() {
        let mut payload = utf16z("System.InvalidOperationException");
        let long_message: String = std::iter::repeat_n('m', MAX_STRING_UNITS + 500).collect();
        payload.extend(utf16z(&long_message));
        payload.extend(0x7f00_2000u64.to_le_bytes());
        payload.extend(0x8013_1509u32.to_le_bytes());
        payload.extend(0x10u16.to_le_bytes());
        payload.extend(0u16.to_le_bytes());
        let Some(ClrEvent::ExceptionThrown(exception)) =
            decode_clr_event(RUNTIME_PROVIDER, 80, 1, &payload).unwrap()
        else {
            panic!("not decoded");
        };
        assert_eq!(exception.type_name, "System.InvalidOperationException");
        assert_eq!(exception.message.len(), MAX_STRING_UNITS);
        assert_eq!(
            (exception.eip, exception.hresult, exception.flags),
            (0x7f00_2000, 0x8013_1509, 0x10)
        );

        // An unpaired surrogate becomes U+FFFD instead of failing.
        let mut odd = vec![0x00, 0xd8, b'A', 0, 0, 0];
        odd.extend(utf16z(""));
        odd.extend([0; 16]);
        let Some(ClrEvent::ExceptionThrown(exception)) =
            decode_clr_event(RUNTIME_PROVIDER, 80, 1, &odd).unwrap()
        else {
            panic!("not decoded");
        };
        assert_eq!(exception.type_name, "\u{fffd}A");
        // V0 (no payload in the manifest) is not decoded.
        assert_eq!(
            decode_clr_event(RUNTIME_PROVIDER, 80, 0, &payload).unwrap(),
            None
        );
        // Missing terminator.
        assert!(decode_clr_event(RUNTIME_PROVIDER, 80, 1, &[b'A', 0, b'B', 0]).is_err());
    }

    #[test]
    fn waits_modules_entry_points_and_rundown_markers_decode() {
        let mut wait = vec![1];
        wait.extend(0xcafeu64.to_le_bytes());
        wait.extend(2u16.to_le_bytes());
        assert_eq!(
            decode_clr_event(RUNTIME_PROVIDER, 301, 0, &wait).unwrap(),
            Some(ClrEvent::WaitHandleWaitStart(WaitHandleWaitStart {
                wait_source: 1,
                associated_object_id: 0xcafe,
                clr_instance_id: 2
            }))
        );
        assert_eq!(
            decode_clr_event(RUNTIME_PROVIDER, 302, 0, &[2, 0]).unwrap(),
            Some(ClrEvent::WaitHandleWaitStop(WaitHandleWaitStop {
                clr_instance_id: 2
            }))
        );

        let mut module = Vec::new();
        module.extend(0x10u64.to_le_bytes());
        module.extend(0x20u64.to_le_bytes());
        module.extend(0x28u32.to_le_bytes());
        module.extend(0u32.to_le_bytes());
        module.extend(utf16z("/app/App.dll"));
        module.extend(utf16z(""));
        module.extend(0u16.to_le_bytes());
        module.extend([0; 20]); // V2 PDB fields, not decoded
        for (provider, id, kind) in [
            (RUNTIME_PROVIDER, 152, ModuleEventKind::Load),
            (RUNTIME_PROVIDER, 153, ModuleEventKind::Unload),
            (RUNDOWN_PROVIDER, 153, ModuleEventKind::RundownStart),
            (RUNDOWN_PROVIDER, 154, ModuleEventKind::RundownEnd),
        ] {
            let Some(ClrEvent::Module(decoded)) =
                decode_clr_event(provider, id, 2, &module).unwrap()
            else {
                panic!("{provider} {id}");
            };
            assert_eq!(
                (decoded.kind, decoded.module_id, decoded.flags),
                (kind, 0x10, 0x28)
            );
            assert_eq!(assembly_simple_name(&decoded.il_path), "App");
        }
        // 154 of the runtime provider is AssemblyLoad, a different layout.
        assert_eq!(
            decode_clr_event(RUNTIME_PROVIDER, 154, 1, &module).unwrap(),
            None
        );

        let mut entry = 5u64.to_le_bytes().to_vec();
        entry.extend(utf16z("System.String"));
        entry.extend(utf16z("Concat"));
        entry.extend(utf16z(
            "class System.String  (class System.String,class System.String)",
        ));
        entry.extend(0x7f00_3000u64.to_le_bytes());
        entry.extend(0u16.to_le_bytes());
        let Some(ClrEvent::R2REntryPoint(entry)) =
            decode_clr_event(RUNTIME_PROVIDER, 159, 0, &entry).unwrap()
        else {
            panic!("R2RGetEntryPoint not decoded");
        };
        assert_eq!((entry.method_id, entry.entry_point), (5, 0x7f00_3000));
        // 159 of the rundown provider is ThreadDC: not decoded.
        assert_eq!(
            decode_clr_event(RUNDOWN_PROVIDER, 159, 0, &[]).unwrap(),
            None
        );

        for (id, marker) in [
            (145, RundownMarker::StartComplete),
            (146, RundownMarker::EndComplete),
            (147, RundownMarker::StartInit),
            (148, RundownMarker::EndInit),
        ] {
            assert_eq!(
                decode_clr_event(RUNDOWN_PROVIDER, id, 1, &[0, 0]).unwrap(),
                Some(ClrEvent::Rundown(marker))
            );
        }
    }

    #[test]
    fn unknown_events_are_ignored_and_counted() {
        assert_eq!(
            decode_clr_event("Other-Provider", 80, 1, &[]).unwrap(),
            None
        );
        assert_eq!(
            decode_clr_event(RUNTIME_PROVIDER, 250, 0, &[]).unwrap(),
            None
        );

        let provider: std::sync::Arc<str> = RUNTIME_PROVIDER.into();
        let record = |event_id, payload| EventRecord {
            metadata_id: 1,
            provider: &provider,
            event_id,
            version: 1,
            event_name: "",
            thread_id: 1,
            capture_thread_id: 1,
            processor: 0,
            sequence: 1,
            timestamp: 0,
            activity_id: [0; 16],
            related_activity_id: [0; 16],
            is_sorted: false,
            stack: None,
            payload,
        };
        let mut decoder = ClrEventDecoder::new();
        assert!(decoder.decode(&record(81, &[0, 0, 0])).is_some());
        assert!(decoder.decode(&record(81, &[0])).is_none());
        assert!(decoder.decode(&record(999, &[])).is_none());
        let stats = decoder.stats();
        assert_eq!(stats.decoded(ClrEventKind::ContentionStart), 1);
        assert_eq!(stats.malformed(ClrEventKind::ContentionStart), 1);
        assert_eq!(
            (
                stats.total_decoded(),
                stats.total_malformed(),
                stats.ignored
            ),
            (1, 1, 1)
        );
        assert!(decoder.last_error().is_some());
    }

    #[test]
    fn display_names_use_the_perf_map_spelling() {
        let cases = [
            (
                ("Demo.Worker", "Spin", "int64  (int64)"),
                "int64 Demo.Worker::Spin(int64)",
            ),
            (
                (
                    "System.String",
                    "Concat",
                    "class System.String  (class System.String,class System.Object)",
                ),
                "string System.String::Concat(string,object)",
            ),
            (
                (
                    "System.Text.Ascii",
                    "NarrowUtf16ToAscii",
                    "unsigned int  (wchar*,unsigned int8*,unsigned int)",
                ),
                "native uint System.Text.Ascii::NarrowUtf16ToAscii(char*,uint8*,native uint)",
            ),
            (
                (
                    "System.RuntimeTypeHandle",
                    "GetNativeHandle",
                    "instance value class System.RuntimeTypeHandle  ()",
                ),
                "instance valuetype System.RuntimeTypeHandle System.RuntimeTypeHandle::GetNativeHandle()",
            ),
            (
                (
                    "System.PackedSpanHelpers",
                    "IndexOf",
                    "generic int32  (int16&,int16,int32)",
                ),
                "int32 System.PackedSpanHelpers::IndexOf(int16&,int16,int32)",
            ),
            (
                (
                    "C",
                    "M",
                    "void  (int,unsigned int16,unsigned int64[],class System.Collections.Generic.List`1<class System.String>)",
                ),
                "void C::M(native int,uint16,uint64[],class System.Collections.Generic.List`1<string>)",
            ),
            // Words that only start like a respelled one stay.
            (
                ("C", "M", "void  (class System.StringBuilder,interior)"),
                "void C::M(class System.StringBuilder,interior)",
            ),
            // No signature, no namespace.
            (("", "Stub", ""), "Stub()"),
        ];
        for ((namespace, name, signature), expected) in cases {
            assert_eq!(method_display_name(namespace, name, signature), expected);
        }
        assert_eq!(
            method_display_name_in_assembly(
                "App",
                "Demo.Worker",
                "Main",
                "void  (class System.String[])"
            ),
            "void [App] Demo.Worker::Main(string[])"
        );
        assert_eq!(
            assembly_simple_name("/usr/share/dotnet/System.Private.CoreLib.dll"),
            "System.Private.CoreLib"
        );
        assert_eq!(assembly_simple_name(r"C:\app\Tool.EXE"), "Tool");
        assert_eq!(assembly_simple_name("NoExtension"), "NoExtension");
        assert_eq!(
            OptimizationTier::InstrumentedTierOptimized.perf_map_name(),
            "InstrumentedTierOptimized"
        );
    }
}
