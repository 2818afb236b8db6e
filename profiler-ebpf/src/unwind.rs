//! User-stack walking in the kernel with the unwind tables userspace loads
//! (`clrbpf::bpf::unwind_maps`): the kernel half of issue 3.
//!
//! Strategy, per sample:
//! 1. The user registers come from the perf context when the tick hit user
//!    mode, else from the task's saved `pt_regs` (`bpf_task_pt_regs`), which
//!    hold the user registers at kernel entry.
//! 2. `bpf_loop` runs [`walk_one`] up to [`MAX_USER_STACK_DEPTH`] times; each
//!    call records a pc and calls [`next_frame`] of `clrbpf_common::unwind`,
//!    the same code the host tests replay, with a [`MemoryReader`] over
//!    `bpf_probe_read_user`: stack words through a per-CPU copy of the
//!    stack page being read ([`StackWindow`]), since the helper's cost is
//!    per call, not per byte. Walk state lives in a per-CPU map, not on the
//!    512-byte stack.
//! 3. A lookup finds the pc's mapping: one of the last four found (by
//!    this walk, or by the last one on this CPU when it was of the same
//!    process and the process's index has not changed since) when it
//!    holds the pc, else by binary search (at most 10 probes) in the
//!    process's sorted [`ProcessMappings`], found with one hash lookup per
//!    sample (by the program that chose the walk). The row comes from a per-CPU cache of recent lookups
//!    ([`ROW_CACHE`]), else from the table's coarse [`RowIndex`] (two
//!    adjacent words naming a few rows) and a search among those rows in
//!    the shared row array (`UNWIND_ROW_CHUNKS`): a binary search over a whole
//!    multi-MiB table costs ~20 cache and TLB misses, the dominant cost of a
//!    walk before the index. A mapping without rows (JIT code, files without
//!    tables) gives "no row": the frame-pointer rule.
//! 4. A failed step ends the walk with its [`UnwindError`], counted per kind
//!    in `UNWIND_ERRORS` and carried in the sample; a walk that still had
//!    frames after the last slot is marked truncated.
//!
//! A per-process sorted array was chosen over an LPM trie keyed by (pid,
//! address), as the OpenTelemetry profiler and parca use: userspace replaces
//! a process's whole index with one map update (the kernel never sees half of
//! a refresh), there is no prefix decomposition, and the lookup cost is one
//! hash lookup plus a short search. The price is a fixed bound of
//! [`clrbpf_common::unwind::MAX_PROCESS_MAPPINGS`] executable mappings per
//! process (userspace merges contiguous ones and counts what it drops).

use core::{ffi::c_void, ptr::addr_of};

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC, pt_regs},
    btf_maps::{Array, ArrayOfMaps},
    helpers::{
        bpf_probe_read_kernel, bpf_probe_read_user,
        generated::{
            bpf_get_current_task_btf, bpf_loop, bpf_probe_read_user as bpf_probe_read_user_raw,
            bpf_task_pt_regs,
        },
    },
    macros::{btf_map, map},
    maps::{HashMap, PerCpuArray},
    programs::PerfEventContext,
};
use clrbpf_common::{
    MAX_USER_STACK_DEPTH, RawSampleEvent, UNWIND_ERROR_SLOTS,
    unwind::{
        CfaRule, Epilog, EpilogScan, MAX_PROCESS_MAPPINGS, MAX_PROCESS_MAPPINGS_LOG2,
        MAX_TABLE_ROWS_LOG2, MappingEntry, MemoryReader, ProcessMappings, ROW_INDEX_WORDS_PER_ROW,
        SortedSearch, UNWIND_ROWS_PER_CHUNK, UNWIND_ROWS_PER_CHUNK_LOG2, UnwindError, UnwindRegs,
        UnwindRow, next_frame, row_index_word,
    },
};

/// One chunk of the row array: [`UNWIND_ROWS_PER_CHUNK`] rows, written by
/// userspace through `mmap`.
type RowChunk = Array<UnwindRow, UNWIND_ROWS_PER_CHUNK, { BPF_F_MMAPABLE as usize }>;

/// Every loaded table's rows, as one array of row indexes cut in chunks:
/// row `i` is entry `i % UNWIND_ROWS_PER_CHUNK` of chunk
/// `i / UNWIND_ROWS_PER_CHUNK`. Userspace creates chunks as tables need
/// them, up to the memory cap (it sets this map's size from the cap), so
/// the kernel memory follows the tables loaded instead of the cap.
#[btf_map]
pub static UNWIND_ROW_CHUNKS: ArrayOfMaps<RowChunk, 1> = ArrayOfMaps::new();

/// Row `i` of the row array, `None` past the chunks created.
#[inline(always)]
fn unwind_row(i: u32) -> Option<&'static UnwindRow> {
    UNWIND_ROW_CHUNKS.get_value(
        i >> UNWIND_ROWS_PER_CHUNK_LOG2,
        &(i & (UNWIND_ROWS_PER_CHUNK as u32 - 1)),
    )
}

/// tgid -> the process's executable mappings.
#[map]
pub static PROCESS_MAPPINGS: HashMap<u32, ProcessMappings> =
    HashMap::with_max_entries(16_384, BPF_F_NO_PREALLOC);

/// Walks ended by each [`UnwindError`], indexed by its number.
#[map]
pub static UNWIND_ERRORS: PerCpuArray<u64> = PerCpuArray::with_max_entries(UNWIND_ERROR_SLOTS, 0);

/// The sample being built: too large for the stack.
#[map]
pub static EVENT_SCRATCH: PerCpuArray<RawSampleEvent> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU state of the walk in progress, shared by the `bpf_loop` calls.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct WalkState {
    regs: UnwindRegs,
    tgid: u32,
    /// 1 while the frame in `regs` is interrupted (the leaf, a signal frame).
    interrupted: u32,
    /// Frames written to the sample's user stack.
    frames: u32,
    /// The [`UnwindError`] that ended the walk, 0 for none.
    error: u32,
    /// 1 while `regs` hold a frame not yet recorded.
    more: u32,
    /// 1 once a pc was in no indexed mapping (see
    /// [`clrbpf_common::sample_flags::USER_PC_UNINDEXED`]).
    unindexed: u32,
    /// The [`ProcessMappings::generation`] `recent_mappings` come from, 0
    /// for none.
    generation: u32,
    /// The mappings the walk found last, kept for the next walk of the
    /// same process on this CPU (a busy process is sampled again and
    /// again) while its index is the same: see [`RecentMappings`].
    recent_mappings: RecentMappings,
}

/// Slots of [`RecentMappings`] (a power of two).
const RECENT_MAPPINGS: usize = 4;

/// The last mappings found, replaced in turn. A .NET stack moves between
/// JIT code, the runtime's library, CoreLib's ReadyToRun code and libc, a
/// native one stays in a file for several frames. Kept from one walk of a
/// process to the next, four of them spare most walks any search: on an
/// allocating .NET app, walks searched 3 times each (0.7 us of a 6 us
/// walk) with two slots emptied at every walk, 0.07 times with these.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RecentMappings {
    /// `end` 0 for an empty slot.
    entries: [MappingEntry; RECENT_MAPPINGS],
    /// The slot the next search's result goes to.
    next: u32,
    _pad: u32,
}

impl RecentMappings {
    /// Empties every slot (in place: the struct is too large for the BPF
    /// stack).
    #[inline(always)]
    fn clear(&mut self) {
        for entry in &mut self.entries {
            entry.start = 0;
            entry.end = 0;
        }
        self.next = 0;
    }
}

/// A row looked up before, in [`RowCache`]: 32 bytes, so that the 1,024
/// slots fit one per-CPU value (at most 32 KiB). The row's `pc` is left
/// out (the step never reads it).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CachedRow {
    vaddr: u64,
    /// The table's [`MappingEntry::row_offset`].
    row_offset: u32,
    cfa_offset: i32,
    fp_offset: i16,
    ra_offset: i16,
    /// The table's [`MappingEntry::table_serial`]; 0 for an empty slot.
    table_serial: u16,
    /// 1 when the row is the answer, 0 when the table has no row for
    /// `vaddr`.
    found: u8,
    cfa_rule: u8,
    fp_rule: u8,
    ra_rule: u8,
    cfa_param: u8,
    _pad: [u8; 5],
}

const _: () = assert!(size_of::<CachedRow>() == 32);

impl CachedRow {
    #[inline(always)]
    fn row(&self, vaddr: u64) -> UnwindRow {
        UnwindRow {
            pc: vaddr,
            cfa_offset: self.cfa_offset,
            fp_offset: self.fp_offset,
            ra_offset: self.ra_offset,
            cfa_rule: self.cfa_rule,
            fp_rule: self.fp_rule,
            ra_rule: self.ra_rule,
            cfa_param: self.cfa_param,
            _pad: [0; 4],
        }
    }

    #[inline(always)]
    fn set_row(&mut self, row: &UnwindRow) {
        self.cfa_offset = row.cfa_offset;
        self.fp_offset = row.fp_offset;
        self.ra_offset = row.ra_offset;
        self.cfa_rule = row.cfa_rule;
        self.fp_rule = row.fp_rule;
        self.ra_rule = row.ra_rule;
        self.cfa_param = row.cfa_param;
    }
}

/// Sets of two slots in [`RowCache`] (a power of two).
const ROW_CACHE_SETS: usize = 512;

/// Per CPU, the rows of recent lookups, in sets of two chosen by (vaddr,
/// table), the newer first.
/// Profiles repeat their return addresses (thread entry points, the loops
/// that call the hot code), and a hit reads one slot instead of an index
/// word and a few rows of a multi-MiB array, each a likely TLB miss at a
/// sampling period's distance.
///
/// One per-CPU value holds every slot: a per-CPU array of slots costs a
/// lookup of the slot's per-CPU pointer as well, a second cache miss when
/// the app's own work (a garbage collection) has pushed the table of
/// pointers out of the caches.
#[repr(C)]
pub struct RowCache {
    sets: [[CachedRow; 2]; ROW_CACHE_SETS],
}

#[map]
static ROW_CACHE: PerCpuArray<RowCache> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn row_cache_set(vaddr: u64, table_serial: u16) -> usize {
    let h = (vaddr ^ (u64::from(table_serial) << 48)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> 55) as usize & (ROW_CACHE_SETS - 1)
}

/// What [`walk_one`] gets from [`walk_user_stack`] through `bpf_loop`'s
/// context pointer: the values looked up once per walk.
#[repr(C)]
struct WalkContext {
    state: *mut WalkState,
    event: *mut RawSampleEvent,
    /// The process's mapping index, looked up once per sample by the
    /// program that chose the walk ([`process_mappings`]).
    mappings: *const ProcessMappings,
    row_cache: *mut RowCache,
}

#[map]
static WALK_STATE: PerCpuArray<WalkState> = PerCpuArray::with_max_entries(1, 0);

/// The binary search in progress. Kept in map memory between probes (read
/// and written volatile) so the verifier sees unknown bounds at each probe
/// and prunes, instead of exploring every (lo, hi) pair of the search.
#[map]
static SEARCH: PerCpuArray<SortedSearch> = PerCpuArray::with_max_entries(1, 0);

/// What [`search_probe`] gets through `bpf_loop`'s context pointer.
#[repr(C)]
struct SearchContext<'a, F> {
    state: *mut SortedSearch,
    key_at: &'a F,
    key: u64,
}

/// One probe of [`search`], a `bpf_loop` iteration: returns 1 once the
/// search is over, or cut short by a key that cannot be read (the bounds
/// then stay apart, which [`SortedSearch::found`] reports as not found).
#[inline(never)]
extern "C" fn search_probe<F: Fn(u32) -> Option<u64>>(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `search` passes its `SearchContext`, which outlives the loop;
    // the state is a per-CPU value only this program on this CPU uses.
    unsafe {
        let ctx = &*(ctx as *const SearchContext<'_, F>);
        let mut s = core::ptr::read_volatile(ctx.state);
        let Some(mid) = s.probe() else {
            return 1;
        };
        let Some(at) = (ctx.key_at)(mid) else {
            return 1;
        };
        s.narrow(mid, at <= ctx.key);
        core::ptr::write_volatile(ctx.state, s);
        0
    }
}

/// [`clrbpf_common::unwind::find_row_index`]'s steps with the state in
/// `SEARCH`: from `start`, the index of the last entry whose key (`key_at`)
/// is at or before `key`.
///
/// Each probe is a `bpf_loop` iteration: the verifier checks the probe's
/// code once for each way the walk reaches the search, where an unrolled
/// loop of `LOG2 + 1` probes was checked once per probe and per way (most
/// of the program's verification time, about a third of a short
/// recording's CPU).
#[inline(always)]
fn search<const LOG2: u32, F: Fn(u32) -> Option<u64>>(
    start: SortedSearch,
    key_at: F,
    key: u64,
) -> Option<u32> {
    let state = SEARCH.get_ptr_mut(0)?;
    let mut ctx = SearchContext {
        state,
        key_at: &key_at,
        key,
    };
    // SAFETY: per-CPU value, only this program on this CPU uses it; the
    // context outlives the loop.
    unsafe {
        core::ptr::write_volatile(state, start);
        bpf_loop(
            LOG2 + 1,
            search_probe::<F> as *mut c_void,
            (&raw mut ctx).cast::<c_void>(),
            0,
        );
        core::ptr::read_volatile(state).found()
    }
}

/// Bytes of the stack window: one page.
const STACK_WINDOW_BYTES: u64 = 4096;

/// A copy of the stack from the last address read to the end of its page.
/// A walk reads the stack upwards, a few words per frame, and each
/// `bpf_probe_read_user` costs its call whatever its size (~100 ns here):
/// one copy per stack page serves several frames. Never crossing a page
/// boundary keeps the copy from faulting at the top of the stack.
#[repr(C)]
pub struct StackWindow {
    /// User address of `words[0]`.
    start: u64,
    /// Valid bytes from `start`; 0 for none.
    len: u64,
    words: [u64; (STACK_WINDOW_BYTES / 8) as usize],
}

#[map]
static STACK_WINDOW: PerCpuArray<StackWindow> = PerCpuArray::with_max_entries(1, 0);

/// The epilog decoding in progress, in map memory for the same reason as
/// [`SEARCH`]: decisions taken on what the scan found do not make the
/// verifier tell apart every way of decoding 8 bytes.
#[map]
static EPILOG_SCAN: PerCpuArray<EpilogScan> = PerCpuArray::with_max_entries(1, 0);

/// What [`epilog_step`] gets through `bpf_loop`'s context pointer.
#[repr(C)]
struct EpilogContext {
    state: *mut EpilogScan,
    code: u64,
}

/// One [`EpilogScan::step`], a `bpf_loop` iteration: returns 1 once the
/// scan is over.
#[inline(never)]
extern "C" fn epilog_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `epilog_at` passes its `EpilogContext`, which outlives the
    // loop; the state is a per-CPU value only this program on this CPU uses.
    unsafe {
        let ctx = &*(ctx as *const EpilogContext);
        let mut scan = core::ptr::read_volatile(ctx.state);
        let more = scan.step(ctx.code);
        core::ptr::write_volatile(ctx.state, scan);
        i64::from(!more)
    }
}

/// Target memory, read with `bpf_probe_read_user`: stack words through
/// the [`StackWindow`], code directly.
struct UserMemory;

impl UserMemory {
    /// The `N` words at `addr` from the stack window, loaded from `addr`
    /// to its page's end when it does not hold them.
    #[inline(always)]
    fn stack_words<const N: usize>(addr: u64) -> Option<[u64; N]> {
        let window = STACK_WINDOW.get_ptr_mut(0)?;
        // SAFETY: per-CPU value, only this program on this CPU uses it.
        let window = unsafe { &mut *window };
        let bytes = 8 * N as u64;
        let mut off = addr.wrapping_sub(window.start);
        if off >= window.len || window.len - off < bytes {
            let len = STACK_WINDOW_BYTES - (addr & (STACK_WINDOW_BYTES - 1));
            if !addr.is_multiple_of(8) || len < bytes || len > STACK_WINDOW_BYTES {
                // Unaligned, or straddling two pages: one direct read.
                // SAFETY: the helper checks the address; a fault gives an error.
                return unsafe { bpf_probe_read_user(addr as *const [u64; N]) }.ok();
            }
            window.len = 0;
            // SAFETY: `len` is at most the buffer's size (checked above).
            let rc = unsafe {
                bpf_probe_read_user_raw(
                    window.words.as_mut_ptr().cast::<c_void>(),
                    len as u32,
                    addr as *const c_void,
                )
            };
            if rc != 0 {
                return None;
            }
            window.start = addr;
            window.len = len;
            off = 0;
        }
        // `off + 8 * N <= len <= STACK_WINDOW_BYTES` (checked above or just
        // loaded): the mask changes nothing but shows the verifier the bound.
        let first = (off / 8) as usize;
        let mut out = [0u64; N];
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = window.words[(first + i) & (window.words.len() - 1)];
        }
        Some(out)
    }
}

impl MemoryReader for UserMemory {
    #[inline(always)]
    fn read_u64(&self, addr: u64) -> Option<u64> {
        Self::stack_words::<1>(addr).map(|[w]| w)
    }

    #[inline(always)]
    fn read_u64_pair(&self, addr: u64) -> Option<(u64, u64)> {
        Self::stack_words::<2>(addr).map(|[a, b]| (a, b))
    }

    #[inline(always)]
    fn read_code_u64(&self, addr: u64) -> Option<u64> {
        // SAFETY: the helper checks the address; a fault gives an error.
        unsafe { bpf_probe_read_user(addr as *const u64) }.ok()
    }

    #[inline(always)]
    fn epilog_at(&self, pc: u64) -> Option<Epilog> {
        let code = self.read_code_u64(pc)?;
        let state = EPILOG_SCAN.get_ptr_mut(0)?;
        let mut ctx = EpilogContext { state, code };
        // SAFETY: per-CPU value, only this program on this CPU uses it; the
        // context outlives the loop.
        unsafe {
            core::ptr::write_volatile(state, EpilogScan::default());
            bpf_loop(
                EpilogScan::STEPS,
                epilog_step as *mut c_void,
                (&raw mut ctx).cast::<c_void>(),
                0,
            );
            core::ptr::read_volatile(state).result()
        }
    }
}

/// The user registers of the sampled thread, `None` for a kernel thread or
/// when they cannot be read.
#[inline(always)]
pub fn user_regs(ctx: &PerfEventContext) -> Option<UnwindRegs> {
    // SAFETY: the perf context's `regs` are readable by perf_event programs.
    let regs = unsafe { &(*ctx.ctx).regs };
    if regs.cs & 3 == 3 {
        return Some(UnwindRegs {
            pc: regs.rip,
            sp: regs.rsp,
            fp: regs.rbp,
            lr: 0,
        });
    }
    // The tick hit kernel mode: the user registers are the ones saved at
    // kernel entry.
    // SAFETY: helpers available to tracing programs since 5.15; the result
    // is only read through bpf_probe_read_kernel.
    let saved = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as *const pt_regs;
    if saved.is_null() {
        return None;
    }
    // SAFETY: probe reads of kernel memory; a fault gives an error.
    unsafe {
        let cs: u64 = bpf_probe_read_kernel(addr_of!((*saved).cs)).ok()?;
        if cs & 3 != 3 {
            return None;
        }
        Some(UnwindRegs {
            pc: bpf_probe_read_kernel(addr_of!((*saved).rip)).ok()?,
            sp: bpf_probe_read_kernel(addr_of!((*saved).rsp)).ok()?,
            fp: bpf_probe_read_kernel(addr_of!((*saved).rbp)).ok()?,
            lr: 0,
        })
    }
}

/// The process's mapping index, `None` until userspace has indexed it.
/// The value stays valid until the program ends (userspace replaces
/// values whole), so one lookup serves the whole sample.
#[inline(always)]
pub fn process_mappings(tgid: u32) -> Option<*const ProcessMappings> {
    PROCESS_MAPPINGS.get_ptr(&tgid)
}

/// The mapping holding `pc`: one of `recent` when it holds it, else the
/// one found in `mappings` (then kept in `recent`, in the next slot's
/// turn).
#[inline(always)]
fn find_mapping<'a>(
    mappings: Option<&ProcessMappings>,
    recent: &'a mut RecentMappings,
    pc: u64,
) -> Result<&'a MappingEntry, UnwindError> {
    let mut hit = RECENT_MAPPINGS;
    for (i, entry) in recent.entries.iter().enumerate() {
        if entry.start <= pc && pc < entry.end {
            hit = i;
            break;
        }
    }
    if hit < RECENT_MAPPINGS {
        return recent.entries.get(hit).ok_or(UnwindError::NoMapping);
    }
    let mappings = mappings.ok_or(UnwindError::NoMapping)?;
    let len = if mappings.len as usize > MAX_PROCESS_MAPPINGS {
        MAX_PROCESS_MAPPINGS as u32
    } else {
        mappings.len
    };
    let index = search::<MAX_PROCESS_MAPPINGS_LOG2, _>(
        SortedSearch::new(len),
        |i| mappings.entries.get(i as usize).map(|e| e.start),
        pc,
    )
    .ok_or(UnwindError::NoMapping)?;
    let entry = mappings
        .entries
        .get(index as usize)
        .ok_or(UnwindError::NoMapping)?;
    if pc >= entry.end {
        return Err(UnwindError::NoMapping);
    }
    let slot = recent.next as usize & (RECENT_MAPPINGS - 1);
    recent.next = recent.next.wrapping_add(1);
    let kept = recent.entries.get_mut(slot).ok_or(UnwindError::NoMapping)?;
    *kept = *entry;
    Ok(kept)
}

/// The row for `pc`: the lookup of [`clrbpf_common::unwind::walk`].
#[inline(always)]
fn lookup(
    mappings: Option<&ProcessMappings>,
    recent: &mut RecentMappings,
    row_cache: &mut RowCache,
    pc: u64,
) -> Result<Option<UnwindRow>, UnwindError> {
    let entry = find_mapping(mappings, recent, pc)?;
    if entry.row_count == 0 {
        return Ok(None);
    }
    let vaddr = pc.wrapping_sub(entry.bias);
    let set = row_cache
        .sets
        .get_mut(row_cache_set(vaddr, entry.table_serial))
        .ok_or(UnwindError::NoTableRow)?;
    for cached in set.iter() {
        if cached.vaddr == vaddr
            && cached.table_serial == entry.table_serial
            && cached.row_offset == entry.row_offset
        {
            return if cached.found != 0 {
                Ok(Some(cached.row(vaddr)))
            } else {
                Err(UnwindError::NoTableRow)
            };
        }
    }
    let found = search_table(entry, vaddr);
    // The new row goes first, the first moves second, the older second
    // is dropped.
    set[1] = set[0];
    let cached = &mut set[0];
    cached.vaddr = vaddr;
    cached.row_offset = entry.row_offset;
    cached.table_serial = entry.table_serial;
    match &found {
        Ok(row) => {
            cached.found = 1;
            cached.set_row(row);
        }
        Err(_) => cached.found = 0,
    }
    found.map(Some)
}

/// The row of `vaddr` in the table of `entry`.
#[inline(always)]
fn search_table(entry: &MappingEntry, vaddr: u64) -> Result<UnwindRow, UnwindError> {
    let first = entry.row_offset;
    let words = first.wrapping_add(entry.row_count);
    let rows = entry
        .row_index()
        .rows_for(
            entry.row_count,
            |w| {
                unwind_row(words.wrapping_add(w / ROW_INDEX_WORDS_PER_ROW))
                    .map(|slot| row_index_word(slot, w))
            },
            vaddr,
        )
        .ok_or(UnwindError::NoTableRow)?;
    let at = search::<MAX_TABLE_ROWS_LOG2, _>(
        rows,
        |i| unwind_row(first.wrapping_add(i)).map(|r| r.pc),
        vaddr,
    )
    .ok_or(UnwindError::NoTableRow)?;
    let row = unwind_row(first.wrapping_add(at)).ok_or(UnwindError::NoTableRow)?;
    if row.cfa_rule == CfaRule::NoInfo as u8 {
        return Err(UnwindError::NoTableRow);
    }
    Ok(*row)
}

/// One `bpf_loop` iteration: record the current frame, step to its caller.
/// Returns 1 to stop the loop.
#[inline(never)]
extern "C" fn walk_one(index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `walk_user_stack` passes its `WalkContext`, which outlives the
    // loop; the state and event are per-CPU values only this program on
    // this CPU uses, the mappings are read only (userspace replaces them
    // whole; the old value stays valid until the program ends).
    let (state, event, mappings, row_cache) = unsafe {
        let ctx = &*(ctx as *const WalkContext);
        let (Some(state), Some(event), Some(row_cache)) = (
            ctx.state.as_mut(),
            ctx.event.as_mut(),
            ctx.row_cache.as_mut(),
        ) else {
            return 1;
        };
        (state, event, ctx.mappings.as_ref(), row_cache)
    };
    if state.more == 0 {
        return 1;
    }
    let Some(slot) = event.user_stack.get_mut(index as usize) else {
        return 1;
    };
    if state.regs.pc == 0 {
        state.error = UnwindError::PcZero as u32;
        state.more = 0;
        return 1;
    }
    *slot = state.regs.pc;
    state.frames = index as u32 + 1;
    let mut interrupted = state.interrupted != 0;
    let mut unindexed = false;
    // A pc outside every indexed mapping is most often code mapped since
    // userspace read the maps (a JIT code heap grows with new anonymous
    // mappings): the frame-pointer rule, as for the JIT code already
    // indexed, instead of ending the walk; the sample is flagged so the
    // maps are read again.
    let outcome = next_frame(
        &mut state.regs,
        &mut interrupted,
        &mut |pc| match lookup(mappings, &mut state.recent_mappings, row_cache, pc) {
            Err(UnwindError::NoMapping) => {
                unindexed = true;
                Ok(None)
            }
            other => other,
        },
        &UserMemory,
    );
    if unindexed {
        state.unindexed = 1;
    }
    match outcome {
        Ok(true) => {
            state.interrupted = u32::from(interrupted);
            0
        }
        Ok(false) => {
            state.more = 0;
            1
        }
        Err(e) => {
            state.error = e as u32;
            state.more = 0;
            1
        }
    }
}

/// What a walk produced.
pub struct WalkResult {
    pub frames: u32,
    /// An [`UnwindError`] number, 0 for a clean end.
    pub error: u32,
    /// A pc was in no indexed mapping.
    pub unindexed: bool,
}

/// Walks the user stack of process `tgid`, whose index is `mappings`
/// ([`process_mappings`]), from `regs` into `EVENT_SCRATCH`'s user stack.
#[inline(always)]
pub fn walk_user_stack(
    tgid: u32,
    mappings: *const ProcessMappings,
    regs: UnwindRegs,
) -> Option<WalkResult> {
    let state = WALK_STATE.get_ptr_mut(0)?;
    let event = EVENT_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: a value of the map, valid until the program ends (see
    // `process_mappings`).
    let generation = unsafe { mappings.as_ref() }.map_or(0, |m| m.generation);
    let mut ctx = WalkContext {
        state,
        event,
        mappings,
        row_cache: ROW_CACHE.get_ptr_mut(0)?,
    };
    // The window holds another walk's stack, maybe of another process.
    let window = STACK_WINDOW.get_ptr_mut(0)?;
    // SAFETY: per-CPU values, only this program on this CPU uses them.
    unsafe {
        (*window).len = 0;
        // Field by field: the whole state would not fit the BPF stack.
        let s = &mut *state;
        if generation == 0 || s.tgid != tgid || s.generation != generation {
            s.recent_mappings.clear();
        }
        s.regs = regs;
        s.tgid = tgid;
        s.interrupted = 1;
        s.frames = 0;
        s.error = 0;
        s.more = 1;
        s.unindexed = 0;
        s.generation = generation;
        bpf_loop(
            MAX_USER_STACK_DEPTH as u32,
            walk_one as *mut c_void,
            (&raw mut ctx).cast::<c_void>(),
            0,
        );
        let state = &*state;
        let error = if state.more != 0 {
            UnwindError::TooDeep as u32
        } else {
            state.error
        };
        if error != 0
            && let Some(slot) = UNWIND_ERRORS.get_ptr_mut(error)
        {
            *slot += 1;
        }
        Some(WalkResult {
            frames: state.frames,
            error,
            unindexed: state.unindexed != 0,
        })
    }
}
