//! One profiled process as the pipeline tracks it: who it is (executable,
//! container, pod: its labels), its mappings (for native frames, read again
//! when an address falls in none of them), and the runtime found in it,
//! behind the runtime seam ([`crate::runtime`]): the runtime's loader looks
//! at every read of the mappings until it recognises its runtime, then the
//! instance keeps up with the process. A process is learnt once, when its
//! first sample arrives, and restored at the end.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use super::selection::{ProcessFilter, ProcessKey};
use crate::{
    clr::instance::DotnetLoader,
    process::{
        ProcFs,
        maps::{Mapping, MappingTable},
        threads::ThreadIds,
    },
    profile::Frame,
    runtime::{ProcessContext, RuntimeInstance, RuntimeLoader},
    symbolize::{
        native::{FileKey, MappedFile, NativeSymbolizer},
        stack::ProcessCode,
    },
};

/// How often a process's mappings are re-read at most when an address is
/// not covered by the ones we have.
const MAPS_REFRESH_EVERY: Duration = Duration::from_millis(200);
/// The same for a process whose mappings did not fit the memory budget:
/// its file is large (the kernel takes tens of ms per 16 MiB of it) and
/// addresses in what was left out would ask for it again at every sample.
const OVER_BUDGET_MAPS_REFRESH_EVERY: Duration = Duration::from_secs(10);

/// The runtimes the pipeline recognises in a process: .NET.
pub(super) type Loader = DotnetLoader;

/// The runtime of a process: looked for until found, unless the process
/// is outside the selection.
enum RuntimeSlot<L: RuntimeLoader> {
    Looking(L),
    Found(L::Instance),
    /// Outside the agent's selection: its runtime is asked nothing (no perf
    /// map turned on, no EventPipe session, no `dotnet_*` series).
    LeftAlone,
}

/// What we know of one profiled process.
pub(super) struct TrackedProcess {
    pub(super) pid: u32,
    /// When it started (`/proc/PID/stat` field 22, clock ticks after boot),
    /// read when it was learnt: with the pid, who it is. Another process
    /// under the same pid (its exit event lost) has another start time.
    pub(super) start_time_ticks: Option<u64>,
    /// Another process was found under the pid, and this one's exit was
    /// queued at that one's start.
    pub(super) successor_seen: bool,
    pub(super) exe_name: Arc<str>,
    pub(super) container_id: Option<Arc<str>>,
    /// Pod and container names (k8s/), looked up once.
    pub(super) pod: Option<Arc<crate::k8s::PodLabels>>,
    pub(super) mappings: MappingTable,
    pub(super) maps_read_at: Option<Instant>,
    /// Started by the command clrbpf launched, in clrbpf's own mount and
    /// PID namespaces: what its runtime writes is ours to remove.
    pub(super) launched_here: bool,
    pub(super) warnings: Vec<String>,
    /// Its threads by the ids its runtime's events carry.
    pub(super) threads: ThreadIds,
    /// Its samples are wanted ([`super::selection`]); decided when learnt.
    pub(super) selected: bool,
    runtime: RuntimeSlot<Loader>,
}

/// The executable name of a process whose `/proc` entry could not be read
/// (it exited first): `pid-PID`. The agent names no series after it.
pub fn unknown_exe_name(pid: u32) -> String {
    format!("pid-{pid}")
}

impl TrackedProcess {
    /// Learns process `pid`: its labels, whether `selection` wants it, its
    /// mappings and, when it is wanted, its runtime.
    pub(super) fn discover(
        procfs: &ProcFs,
        pid: u32,
        native: &mut NativeSymbolizer,
        loader: Loader,
        selection: Option<&dyn ProcessFilter>,
    ) -> Self {
        let info = procfs.process_info(pid).ok();
        let threads = ThreadIds::new(info.as_ref().is_some_and(|i| i.ns_pid != pid));
        let launched_here = info.as_ref().is_some_and(|i| i.ns_pid == pid)
            && is_descendant_of_self(procfs, pid)
            && same_mount_namespace(pid);
        let exe_name: Arc<str> = info
            .as_ref()
            .map_or_else(|| unknown_exe_name(pid), |i| i.exe_name.clone())
            .into();
        let container_id = info
            .as_ref()
            .and_then(|i| i.container_id.clone())
            .map(Arc::from);
        let pod = info.as_ref().and_then(|i| {
            crate::k8s::PodMetadata::global()
                .labels_for(i.container_id.as_deref(), i.pod_uid.as_deref())
        });
        let mut process = Self {
            pid,
            start_time_ticks: info.as_ref().map(|i| i.start_time_ticks),
            successor_seen: false,
            exe_name,
            container_id,
            pod,
            mappings: MappingTable::default(),
            maps_read_at: None,
            launched_here,
            warnings: Vec::new(),
            threads,
            selected: true,
            runtime: RuntimeSlot::Looking(loader),
        };
        process.selected = selection.is_none_or(|filter| filter.selects(&ProcessKey::of(&process)));
        if !process.selected {
            process.runtime = RuntimeSlot::LeftAlone;
        }
        process.refresh_maps(procfs, native);
        process
    }

    /// The runtime found in the process, if any.
    pub(super) fn runtime(&self) -> Option<&<Loader as RuntimeLoader>::Instance> {
        match &self.runtime {
            RuntimeSlot::Found(instance) => Some(instance),
            RuntimeSlot::Looking(_) | RuntimeSlot::LeftAlone => None,
        }
    }

    pub(super) fn runtime_mut(&mut self) -> Option<&mut <Loader as RuntimeLoader>::Instance> {
        match &mut self.runtime {
            RuntimeSlot::Found(instance) => Some(instance),
            RuntimeSlot::Looking(_) | RuntimeSlot::LeftAlone => None,
        }
    }

    /// Reads the runtime's name sources again (see
    /// [`RuntimeInstance::refresh_names`]).
    pub(super) fn refresh_names(&mut self, force: bool) {
        if let Some(runtime) = self.runtime_mut() {
            runtime.refresh_names(force);
        }
    }

    pub(super) fn refresh_maps(&mut self, procfs: &ProcFs, native: &mut NativeSymbolizer) {
        let every = if self.mappings.stats().over_budget() {
            OVER_BUDGET_MAPS_REFRESH_EVERY
        } else {
            MAPS_REFRESH_EVERY
        };
        if self.maps_read_at.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        self.maps_read_at = Some(Instant::now());
        // The old table's bytes go back to the budget's pool while the new
        // one is read (and charged); it is kept if the process is gone.
        let uncharged = self.mappings.uncharge();
        let Ok(mappings) = procfs.maps(self.pid) else {
            self.mappings.recharge(uncharged);
            return;
        };
        self.mappings = mappings;
        let stats = self.mappings.stats();
        if stats.over_budget() {
            let (pid, kept) = (self.pid, self.mappings.len());
            let message = || {
                format!(
                    "pid {pid}: its /proc/PID/maps is over the memory budget ({kept} mappings kept, {} dropped{}): frames in the rest are unnamed",
                    stats.dropped,
                    if stats.truncated {
                        ", file read in part"
                    } else {
                        ""
                    }
                )
            };
            if crate::memory_budget::warn_once(pid, crate::memory_budget::OverBudget::Maps, message)
            {
                self.warnings.push(message());
            }
        }
        self.sync_runtime(procfs);
        // Open every executable file now, while the process is alive.
        for m in self.mappings.iter() {
            if let Some(mapped) = mapped_file(self.pid, m) {
                native.prepare(&mapped);
            }
        }
    }

    /// Hands the mappings just read to the runtime's loader until it
    /// recognises its runtime (a process is often first seen before it
    /// maps libcoreclr.so: the `dotnet` host loads it late), then to the
    /// instance.
    fn sync_runtime(&mut self, procfs: &ProcFs) {
        let process = ProcessContext {
            procfs,
            pid: self.pid,
            launched_here: self.launched_here,
        };
        if let RuntimeSlot::Looking(loader) = &self.runtime
            && let Some(instance) = loader.load(&process, &self.mappings)
        {
            self.runtime = RuntimeSlot::Found(instance);
        }
        if let RuntimeSlot::Found(instance) = &mut self.runtime {
            instance.sync_mappings(&self.mappings);
        }
    }

    /// The process replaced its image: its mappings (and, if it had no
    /// .NET runtime, whether it has one now) are read again at its next
    /// sample.
    /// Whether the process under this pid now is not the one learnt: its
    /// start time differs (its exit event was lost and the pid reused).
    /// A process gone, or one whose start time was never read, is not
    /// reported here (the vanished check retires the first).
    pub(super) fn pid_reused(&self, procfs: &ProcFs) -> bool {
        let Some(learnt) = self.start_time_ticks else {
            return false;
        };
        procfs
            .start_time_ticks(self.pid)
            .is_ok_and(|now| now != learnt)
    }

    /// When the process under this pid now started, on the samples'
    /// clock, if it is not the one learnt ([`Self::pid_reused`]).
    pub(super) fn successor_start_ns(&self, procfs: &ProcFs) -> Option<u64> {
        let learnt = self.start_time_ticks?;
        let now = procfs.start_time_ticks(self.pid).ok()?;
        (now != learnt).then(|| crate::profile::boot_ticks_to_monotonic_ns(now))
    }

    pub(super) fn exec_seen(&mut self) {
        self.maps_read_at = None;
    }

    pub(super) fn mapping_for(&self, addr: u64) -> Option<&Mapping> {
        self.mappings.find(addr)
    }
}

impl ProcessCode for TrackedProcess {
    fn runtime_frame(&self, lookup: u64, addr: u64, time_ns: u64) -> Option<Arc<Frame>> {
        self.runtime()?.frame(lookup, addr, time_ns)
    }

    fn has_runtime(&self) -> bool {
        self.runtime().is_some_and(RuntimeInstance::names_code)
    }

    fn mapped_file(
        &mut self,
        addr: u64,
        procfs: &ProcFs,
        native: &mut NativeSymbolizer,
    ) -> Option<MappedFile<'_>> {
        if self.mapping_for(addr).is_none() {
            self.refresh_maps(procfs, native);
        }
        mapped_file(self.pid, self.mapping_for(addr)?)
    }
}

fn mapped_file(pid: u32, m: &Mapping) -> Option<MappedFile<'_>> {
    if !m.is_executable() || m.is_anonymous() || m.inode == 0 {
        return None;
    }
    let path = m.file_path()?;
    Some(MappedFile {
        pid,
        start: m.start,
        end: m.end,
        offset: m.offset,
        key: FileKey {
            dev_major: m.dev_major,
            dev_minor: m.dev_minor,
            inode: m.inode,
        },
        path,
    })
}

/// Whether `pid` descends from this process (the launched command's tree).
fn is_descendant_of_self(procfs: &ProcFs, pid: u32) -> bool {
    let me = std::process::id();
    let mut current = pid;
    // Bounded: a process tree deeper than this is not ours to clean up.
    for _ in 0..64 {
        match procfs.process_info(current) {
            Ok(info) if info.ppid == me => return true,
            Ok(info) if info.ppid > 1 => current = info.ppid,
            _ => return false,
        }
    }
    false
}

fn same_mount_namespace(pid: u32) -> bool {
    let ns = |p: &str| {
        std::fs::metadata(p)
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .ok()
    };
    let theirs = ns(&format!("/proc/{pid}/ns/mnt"));
    theirs.is_some() && theirs == ns("/proc/self/ns/mnt")
}
