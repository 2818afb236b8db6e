//! The .NET side of one profiled process, as the pipeline tracks it: its
//! mappings (for native frames), whether it runs a CoreCLR and which, its
//! managed symbols (perf map and jitdump, or MethodLoad events), the perf
//! maps clrbpf turned on in it and its EventPipe session. A process is
//! learnt once, when its first sample arrives, and restored at the end.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    clr::{
        collector::{ClrCollector, ClrSettings},
        ipc::{PerfMapAttach, PerfMapAttachOutcome, PerfMapUnsupported},
    },
    process::{
        ProcFs,
        dotnet::DotnetRuntime,
        maps::{Mapping, MappingTable},
    },
    profile::Module,
    symbolize::{
        managed::{FileStatus, ManagedSymbolBudget, ManagedSymbols, RefreshStats},
        native::{FileKey, MappedFile, NativeSymbolizer},
    },
    unwind::jit_code::JitMethod,
};

/// A perf map attach running on its own thread.
pub(super) type AttachJob =
    std::thread::JoinHandle<Result<PerfMapAttachOutcome, crate::clr::ipc::IpcError>>;

/// How often a process's perf map / jitdump are re-read at most (only the
/// bytes added since the last read). It is also how late a method's unwind
/// rows can be after it was compiled (see `JIT_REBUILD_EVERY`).
const MANAGED_REFRESH_EVERY: Duration = Duration::from_millis(100);
/// How often a process's perf map / jitdump are read for new JIT code even
/// when none of its samples is due: a method compiled while the process is
/// idle needs its unwind rows before the samples that run it.
const JIT_CODE_REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How often a process's mappings are re-read at most when an address is
/// not covered by the ones we have.
const MAPS_REFRESH_EVERY: Duration = Duration::from_millis(200);
/// The same for a process whose mappings did not fit the memory budget:
/// its file is large (the kernel takes tens of ms per 16 MiB of it) and
/// addresses in what was left out would ask for it again at every sample.
const OVER_BUDGET_MAPS_REFRESH_EVERY: Duration = Duration::from_secs(10);

/// What we know of one profiled process.
pub(super) struct TrackedProcess {
    pub(super) pid: u32,
    pub(super) exe_name: Arc<str>,
    pub(super) container_id: Option<Arc<str>>,
    /// Pod and container names (k8s/), looked up once.
    pub(super) pod: Option<Arc<crate::k8s::PodLabels>>,
    pub(super) mappings: MappingTable,
    pub(super) maps_read_at: Option<Instant>,
    pub(super) managed: Option<ManagedSymbols>,
    pub(super) managed_read_at: Option<Instant>,
    pub(super) perf_map: Option<PerfMapAttach>,
    /// The budget every process's managed symbols share.
    pub(super) managed_budget: ManagedSymbolBudget,
    /// The perf map attach under way on its own thread, with the runtime
    /// version seen in the mappings.
    pub(super) attach_job: Option<(AttachJob, Option<String>)>,
    /// Started by the command clrbpf launched, in clrbpf's own mount and
    /// PID namespaces: its perf files are ours to remove.
    pub(super) launched_here: bool,
    /// Whether to ask the runtime for perf maps once it is seen.
    pub(super) attach: bool,
    pub(super) warnings: Vec<String>,
    pub(super) jit_module: Arc<Module>,
    pub(super) clr: Option<ClrCollector>,
    /// The session slot of the memory budget `clr` holds.
    pub(super) clr_slot: Option<crate::memory_budget::SessionSlot>,
    pub(super) clr_settings: ClrSettings,
    /// CLR events arrived since the perf map was last read.
    pub(super) clr_symbols_stale: bool,
    /// Name methods from the session's MethodLoad events (no perf map).
    pub(super) methods_from_events: bool,
    /// When `libcoreclr.so` was first seen mapped, while the runtime has
    /// not started yet ([`DotnetRuntime::started`]): it is looked at again
    /// on every tick until it has.
    pub(super) runtime_starting_since: Option<Instant>,
    /// Times the perf maps clrbpf turned on were turned on again after
    /// their files vanished ([`Self::reenable_if_files_vanished`]).
    pub(super) perf_maps_reenabled: u32,
    pub(super) perf_maps_reenabled_at: Option<Instant>,
}

/// How long a runtime that maps no `System.Private.CoreLib.dll` (a
/// single-file app keeps it in its bundle) is given to start before it is
/// talked to anyway.
const RUNTIME_START_GRACE: Duration = Duration::from_secs(2);

/// The executable name of a process whose `/proc` entry could not be read
/// (it exited first): `pid-PID`. The agent names no series after it.
pub fn unknown_exe_name(pid: u32) -> String {
    format!("pid-{pid}")
}

impl TrackedProcess {
    pub(super) fn discover(
        procfs: &ProcFs,
        pid: u32,
        native: &mut NativeSymbolizer,
        attach: bool,
        clr_settings: ClrSettings,
        managed_budget: ManagedSymbolBudget,
    ) -> Self {
        let info = procfs.process_info(pid).ok();
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
            exe_name,
            container_id,
            pod,
            mappings: MappingTable::default(),
            maps_read_at: None,
            managed: None,
            managed_read_at: None,
            perf_map: None,
            managed_budget,
            attach_job: None,
            launched_here,
            attach,
            warnings: Vec::new(),
            jit_module: Arc::new(Module {
                path: "[jit]".into(),
                build_id: None,
                memory_start: 0,
                memory_limit: 0,
                file_offset: 0,
                has_functions: true,
            }),
            clr: None,
            clr_slot: None,
            clr_settings,
            clr_symbols_stale: false,
            methods_from_events: false,
            runtime_starting_since: None,
            perf_maps_reenabled: 0,
            perf_maps_reenabled_at: None,
        };
        process.refresh_maps(procfs, native);
        process
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
        // A process is often first seen before it maps libcoreclr.so (the
        // `dotnet` host loads it late), so the runtime is looked for at
        // every refresh until found.
        if self.managed.is_none() {
            self.detect_runtime(procfs);
        }
        // Open every executable file now, while the process is alive.
        for m in self.mappings.iter() {
            if let Some(mapped) = mapped_file(self.pid, m) {
                native.prepare(&mapped);
            }
        }
    }

    fn detect_runtime(&mut self, procfs: &ProcFs) {
        let Some(runtime) = DotnetRuntime::detect(&self.mappings) else {
            return;
        };
        let pid = self.pid;
        // A runtime asked for perf maps (or a session) before its startup
        // has set them up can crash: wait until it has started.
        let since = *self.runtime_starting_since.get_or_insert_with(Instant::now);
        if !runtime.started && since.elapsed() < RUNTIME_START_GRACE {
            tracing::debug!(pid, "the .NET runtime is still starting");
            return;
        }
        self.runtime_starting_since = None;
        tracing::debug!(pid, version = ?runtime.version, "found a .NET runtime");
        self.managed = Some(ManagedSymbols::with_budget(pid, &self.managed_budget));
        // Runtimes before .NET 8 cannot be asked for perf maps: a process we
        // did not start gets its JIT frames named from method rundown and
        // MethodLoad events.
        self.methods_from_events =
            self.attach && !self.launched_here && runtime.major().is_some_and(|m| m < 8);
        let settings = self.clr_settings;
        let slot = settings
            .kinds
            .any()
            .then(crate::memory_budget::SessionSlot::take);
        if slot.as_ref().is_some_and(Option::is_none) {
            let message = || {
                format!(
                    "pid {pid}: no CLR events: the memory budget's {} EventPipe sessions are all in use (raise --memory-budget-mb)",
                    crate::memory_budget::current().max_sessions()
                )
            };
            if crate::memory_budget::warn_once(
                pid,
                crate::memory_budget::OverBudget::Sessions,
                message,
            ) {
                self.warnings.push(message());
            }
        }
        if let Some(Some(slot)) = slot {
            self.clr_slot = Some(slot);
            self.clr = Some(
                ClrCollector::new(
                    pid,
                    settings.kinds,
                    runtime.major(),
                    self.methods_from_events,
                )
                .with_runtime_metrics(settings.counters_interval_sec)
                .with_exception_budget(settings.exceptions_per_second),
            );
        }
        if !self.attach {
            return;
        }
        // The runtime may be slow, stopped or hostile (a process that maps
        // a file named libcoreclr.so and never answers): ask from a thread
        // of its own, bounded by the client's deadline, and take the answer
        // on a later tick ([`Self::poll_attach`]).
        let procfs = procfs.clone();
        let job = std::thread::Builder::new()
            .name(format!("clrbpf-attach-{pid}"))
            .spawn(move || {
                crate::process::priority::enter_background_thread();
                PerfMapAttach::attach(&procfs, pid)
            });
        match job {
            Ok(job) => self.attach_job = Some((job, runtime.version)),
            Err(e) => self.warnings.push(format!(
                "pid {pid}: could not start the perf map attach: {e}"
            )),
        }
    }

    /// Takes the outcome of the perf map attach once it is there.
    pub(super) fn poll_attach(&mut self) {
        if !self
            .attach_job
            .as_ref()
            .is_some_and(|(job, _)| job.is_finished())
        {
            return;
        }
        let Some((job, version)) = self.attach_job.take() else {
            return;
        };
        let pid = self.pid;
        let Ok(outcome) = job.join() else {
            self.warnings
                .push(format!("pid {pid}: the perf map attach thread failed"));
            return;
        };
        match outcome {
            Ok(PerfMapAttachOutcome::Enabled(handle)) => self.perf_map = Some(*handle),
            Ok(PerfMapAttachOutcome::AlreadyEnabled { .. }) => {}
            Ok(PerfMapAttachOutcome::Unsupported(PerfMapUnsupported::BeforeNet8 { .. }))
                if self.methods_from_events && self.clr.is_some() =>
            {
                tracing::debug!(
                    pid,
                    "no EnablePerfMap before .NET 8: naming methods by rundown"
                );
            }
            Ok(PerfMapAttachOutcome::Unsupported(PerfMapUnsupported::BeforeNet8 { .. })) => {
                let version = version.as_deref().unwrap_or("before 8");
                self.warnings.push(format!(
                    "pid {pid} runs .NET {version}, which cannot turn perf maps on at run time: its JIT frames are named only if it was started with DOTNET_PerfMapEnabled=1 (COMPlus_PerfMapEnabled=1 before .NET 5)"
                ));
            }
            Ok(PerfMapAttachOutcome::Unsupported(other)) => {
                self.warnings.push(format!("pid {pid}: {other}"))
            }
            Err(e) => self
                .warnings
                .push(format!("pid {pid}: could not turn on perf maps: {e}")),
        }
    }

    /// At the process's or the run's end: an attach still under way is
    /// reported and handed back, for the caller to let it finish and undo
    /// what it did ([`super::perf_maps::PerfMapKeeper::abandon`]).
    pub(super) fn abandon_attach(&mut self) -> Option<AttachJob> {
        self.poll_attach();
        let (job, _) = self.attach_job.take()?;
        self.warnings.push(format!(
            "pid {}: its runtime had not answered EnablePerfMap when the recording ended: its JIT frames may be unnamed",
            self.pid
        ));
        Some(job)
    }

    pub(super) fn refresh_managed(&mut self, force: bool) {
        let Some(managed) = self.managed.as_mut() else {
            return;
        };
        if !force
            && self
                .managed_read_at
                .is_some_and(|t| t.elapsed() < MANAGED_REFRESH_EVERY)
        {
            return;
        }
        self.managed_read_at = Some(Instant::now());
        let stats = managed.refresh(crate::profile::monotonic_ns());
        tracing::debug!(
            pid = self.pid,
            ?stats,
            symbols = managed.len(),
            "read perf map and jitdump"
        );
        self.reenable_if_files_vanished(&stats);
    }

    /// The perf maps clrbpf turned on are there for the whole recording
    /// (the runtime creates the jitdump before it answers EnablePerfMap and
    /// never removes it): a missing jitdump means another recorder attached
    /// to the same process turned them off and removed the files (a second
    /// clrbpf ending; the runtime keeps one perf map state per process).
    /// Left so, no method would be named again for the rest of the
    /// recording, and a read made before the files came back would find
    /// nothing at all. Turned off and on again from a thread (the runtime
    /// replays every method into new files), a few times at most.
    fn reenable_if_files_vanished(&mut self, stats: &RefreshStats) {
        let last = (
            self.perf_maps_reenabled,
            self.perf_maps_reenabled_at.map(|t| t.elapsed()),
        );
        // A process that exited has no files to read either: nothing vanished.
        let alive = std::path::Path::new(&format!("/proc/{}/root", self.pid)).exists();
        if !alive || !perf_files_vanished(stats, self.perf_map.is_some(), last) {
            return;
        }
        let Some(mut handle) = self.perf_map.take() else {
            return;
        };
        self.perf_maps_reenabled += 1;
        self.perf_maps_reenabled_at = Some(Instant::now());
        let pid = self.pid;
        tracing::debug!(pid, "perf files vanished: turning perf maps on again");
        if self.perf_maps_reenabled == 1 {
            self.warnings.push(format!(
                "pid {pid}: its perf files were gone after clrbpf turned perf maps on (removed by another recorder attached to it?): turned on again; methods compiled in between may be unnamed"
            ));
        }
        let job = std::thread::Builder::new()
            .name(format!("clrbpf-attach-{pid}"))
            .spawn(move || {
                crate::process::priority::enter_background_thread();
                // The handle is kept whatever the answer: it is what removes
                // the files clrbpf made the runtime write when the
                // recording ends (a process that exited meanwhile cannot
                // answer, and its files must still go).
                if let Err(error) = handle.reenable() {
                    tracing::debug!(pid, %error, "perf maps not turned on again");
                }
                Ok(PerfMapAttachOutcome::Enabled(Box::new(handle)))
            });
        match job {
            Ok(job) => self.attach_job = Some((job, None)),
            Err(e) => self
                .warnings
                .push(format!("pid {pid}: could not turn perf maps on again: {e}")),
        }
    }

    /// The methods compiled since the last call, and how many more were
    /// dropped (see [`ManagedSymbols::take_new_code`]). The
    /// perf map and jitdump are read first if they were not for
    /// [`JIT_CODE_REFRESH_EVERY`] (unless the symbol budget dropped the
    /// process's tables: reading them again is for its samples to ask).
    pub(super) fn take_new_jit_code(&mut self) -> (Vec<JitMethod>, u64) {
        let Some(managed) = self.managed.as_ref() else {
            return (Vec::new(), 0);
        };
        if !managed.is_evicted()
            && self
                .managed_read_at
                .is_none_or(|t| t.elapsed() >= JIT_CODE_REFRESH_EVERY)
        {
            self.refresh_managed(true);
        }
        self.managed
            .as_mut()
            .map_or((Vec::new(), 0), ManagedSymbols::take_new_code)
    }

    /// Starts or drains this process's EventPipe session.
    pub(super) fn poll_clr(&mut self, procfs: &ProcFs) {
        let Some(clr) = self.clr.as_mut() else {
            return;
        };
        let mut managed = self.managed.as_mut().filter(|_| self.methods_from_events);
        let taken = clr.poll(procfs, &mut |method, time_ns| {
            if let Some(managed) = managed.as_deref_mut() {
                add_event_method(managed, method, time_ns);
            }
        });
        // Event stacks are symbolized later, maybe after the process
        // exited: read its perf map while it is there, once more after the
        // last events (the rate limit may have skipped the read they need).
        self.clr_symbols_stale |= taken > 0;
        if self.clr_symbols_stale
            && self
                .managed_read_at
                .is_none_or(|t| t.elapsed() >= MANAGED_REFRESH_EVERY)
        {
            self.clr_symbols_stale = false;
            self.refresh_managed(true);
        }
    }

    /// Stops this process's EventPipe session, if any, waiting for its
    /// last events until `until` at most.
    pub(super) fn stop_clr(&mut self, until: Instant) {
        let Some(clr) = self.clr.as_mut() else {
            return;
        };
        let mut managed = self.managed.as_mut().filter(|_| self.methods_from_events);
        clr.stop(until, &mut |method, time_ns| {
            if let Some(managed) = managed.as_deref_mut() {
                add_event_method(managed, method, time_ns);
            }
        });
    }

    /// The process replaced its image: its mappings (and, if it had no
    /// .NET runtime, whether it has one now) are read again at its next
    /// sample.
    pub(super) fn exec_seen(&mut self) {
        self.maps_read_at = None;
    }

    pub(super) fn mapping_for(&self, addr: u64) -> Option<&Mapping> {
        self.mappings.find(addr)
    }
}

/// How many times the perf maps of one process are turned on again, and
/// how far apart at least: each time, the runtime replays every method.
const MAX_PERF_MAP_REENABLES: u32 = 3;
const PERF_MAP_REENABLE_EVERY: Duration = Duration::from_secs(5);

/// Whether a refresh found the files of perf maps clrbpf turned on (`ours`)
/// gone: the jitdump (always written with type All) is missing. `last` is
/// how many times they were turned on again so far and how long ago the
/// last was: bounded, so a runtime that cannot write its files is not
/// asked again and again.
fn perf_files_vanished(stats: &RefreshStats, ours: bool, last: (u32, Option<Duration>)) -> bool {
    let (done, since) = last;
    ours && stats.jitdump.status == FileStatus::Missing
        && done < MAX_PERF_MAP_REENABLES
        && since.is_none_or(|since| since >= PERF_MAP_REENABLE_EVERY)
}

/// Names a method from a MethodLoad or rundown event, as a perf map line
/// would (so frames look the same whichever source named them).
fn add_event_method(
    managed: &mut ManagedSymbols,
    method: &crate::clr::events::MethodLoad,
    time_ns: u64,
) {
    use crate::clr::events::MethodEventKind;
    let valid_from = match method.kind {
        MethodEventKind::Load => time_ns,
        // Rundown describes code that existed before the session.
        MethodEventKind::RundownStart | MethodEventKind::RundownEnd => 0,
        MethodEventKind::Unload => return,
    };
    let raw = format!(
        "{}[{}]",
        method.display_name(),
        method.tier().perf_map_name()
    );
    managed.insert_method(method.start, u64::from(method.size), &raw, valid_from);
}

pub(super) fn mapped_file(pid: u32, m: &Mapping) -> Option<MappedFile<'_>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbolize::managed::FileRefresh;

    fn jitdump(status: FileStatus) -> RefreshStats {
        RefreshStats {
            jitdump: FileRefresh {
                status,
                ..FileRefresh::default()
            },
            ..RefreshStats::default()
        }
    }

    #[test]
    fn perf_maps_are_turned_on_again_only_when_ours_and_gone() {
        let gone = jitdump(FileStatus::Missing);
        assert!(perf_files_vanished(&gone, true, (0, None)));
        // Not turned on by clrbpf (set by the environment, or not .NET 8).
        assert!(!perf_files_vanished(&gone, false, (0, None)));
        // A runtime that cannot write them is not asked again and again.
        let long_ago = Some(PERF_MAP_REENABLE_EVERY);
        assert!(perf_files_vanished(&gone, true, (1, long_ago)));
        assert!(!perf_files_vanished(
            &gone,
            true,
            (1, Some(Duration::from_secs(1)))
        ));
        assert!(!perf_files_vanished(
            &gone,
            true,
            (MAX_PERF_MAP_REENABLES, long_ago)
        ));
        for status in [
            FileStatus::Read,
            FileStatus::Stale,
            FileStatus::Failed,
            FileStatus::Stopped,
        ] {
            assert!(
                !perf_files_vanished(&jitdump(status), true, (0, None)),
                "{status:?}"
            );
        }
    }
}
