//! Names from the memory path: the JIT memory reader the .NET instance
//! ([`crate::clr::instance`]) asks, through the
//! [`name_sources::JitMemoryNames`] hook, when its perf map, events and
//! ReadyToRun images have no name for an address ([`jit_memory_reader`]
//! makes it). [`JitMemoryNames`] turns the [`ManagedCode`] the
//! [`ClrMemoryReader`] finds into a [`CodeName`], naming methods from their
//! image's ECMA-335 metadata ([`ClrMetadata`], read once per image file,
//! from the file mapped under the path the runtime names:
//! [`crate::process::mapped_file`]) and the rest by kind.
//!
//! Addresses inside file-backed mappings (native libraries, ReadyToRun
//! images) are left to the other name sources without a single read of
//! target memory: only anonymous executable memory, where the runtime
//! puts JIT code and stubs, or memory not seen mapped yet, is walked.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use super::{
    AttachError, ClrMemoryReader, ManagedCode, MemoryNameError,
    charged_cache::{ChargedCache, capped_name},
    target::ProcessMemory,
};
use crate::{
    clr::name_sources::{self, CodeName, JitMemoryContext},
    process::{
        Mapping, MappingTable, ProcFs,
        mapped_file::{MappedFileRef, open_mapped},
    },
    symbolize::ready_to_run::{AssemblyCache, HeldMetadata},
};

/// Images whose metadata is kept per process.
const MAX_IMAGES: usize = 1024;
/// Names kept per process before the cache starts over (their bytes are
/// charged to the memory budget, see [`super::charged_cache`]).
const MAX_NAMES: usize = 65_536;

/// A method: its image's path in the target and its MethodDef token.
type MethodKey = (Arc<str>, u32);

/// How many frames the memory path named and why it did not name others.
#[derive(Debug, Default)]
pub struct MemoryNameCounts {
    pub named: AtomicU64,
    /// The walk found a method but its image has no readable metadata.
    pub no_metadata: AtomicU64,
    /// The walk failed (unreadable or inconsistent memory).
    pub failed: AtomicU64,
}

/// The memory name source of one process; see the module doc.
pub struct JitMemoryNames {
    reader: ClrMemoryReader<ProcessMemory>,
    procfs: ProcFs,
    pid: u32,
    /// A mapping of each file mapped, by path: an image the runtime's
    /// memory names is read only as the file mapped under that path
    /// ([`crate::process::mapped_file`]), never opened by the path.
    mapped: HashMap<Arc<str>, Mapping>,
    /// `(start, end)` of file-backed mappings, sorted: never walked.
    files: Vec<(u64, u64)>,
    images: Mutex<HashMap<Arc<str>, Option<Arc<HeldMetadata>>>>,
    names: Mutex<ChargedCache<MethodKey, CodeName>>,
    /// Reads metadata shared with every process (CoreLib's is MiBs); `None`:
    /// this reader's own copies.
    shared: Option<AssemblyCache>,
    pub counts: MemoryNameCounts,
    /// The JIT methods handed to the unwinder ([`super::code_heap_scan`]).
    code_scan: super::code_heap_scan::CodeHeapScan,
}

impl JitMemoryNames {
    /// The memory path for process `pid`, or why it cannot be used.
    pub fn attach(procfs: &ProcFs, pid: u32, mappings: &MappingTable) -> Result<Self, AttachError> {
        let reader = ClrMemoryReader::attach(procfs, pid, mappings)?;
        let mut names = Self {
            reader,
            procfs: procfs.clone(),
            pid,
            mapped: HashMap::new(),
            files: Vec::new(),
            images: Mutex::new(HashMap::new()),
            names: Mutex::new(ChargedCache::new(MAX_NAMES)),
            shared: None,
            counts: MemoryNameCounts::default(),
            code_scan: Default::default(),
        };
        names.sync_mappings(mappings);
        Ok(names)
    }

    /// Holds the images' metadata in `assemblies`, once for every process
    /// mapping the same file, instead of a copy of its own.
    pub fn sharing_metadata(mut self, assemblies: AssemblyCache) -> Self {
        self.shared = Some(assemblies);
        self
    }

    /// The .NET major version whose layout the reader uses.
    pub fn major(&self) -> u32 {
        self.reader.layout().major
    }

    pub fn sync_mappings(&mut self, mappings: &MappingTable) {
        self.reader.sync_mappings(mappings);
        self.files = mappings
            .iter()
            .filter(|m| m.file_path().is_some())
            .map(|m| (m.start, m.end))
            .collect();
        self.files.sort_unstable();
        self.mapped.clear();
        for m in mappings.iter() {
            if let Some(path) = m.path.as_ref().filter(|_| m.file_path().is_some()) {
                self.mapped.entry(path.clone()).or_insert_with(|| m.clone());
            }
        }
    }

    fn in_file(&self, addr: u64) -> bool {
        let at = self.files.partition_point(|&(start, _)| start <= addr);
        at.checked_sub(1)
            .and_then(|i| self.files.get(i))
            .is_some_and(|&(_, end)| addr < end)
    }

    /// The name of the code at `lookup`; `None` when the runtime's memory
    /// does not name it.
    pub fn code_name(&self, lookup: u64) -> Option<CodeName> {
        if self.in_file(lookup) {
            return None;
        }
        let code = match self.reader.code_at(lookup) {
            Ok(code) => code?,
            // Counted by the budget, said in the warning.
            Err(MemoryNameError::Refused(_)) => return None,
            Err(e) => {
                self.counts.failed.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(lookup, "memory path: {e}");
                return None;
            }
        };
        let name = match code {
            ManagedCode::Method { image, token, .. } => self.method_name(image?, token)?,
            ManagedCode::Dynamic { name } => plain_name(dynamic_method_name(name.as_deref())),
            ManagedCode::Stub { kind } => plain_name(format!("[stub: {kind}]")),
            // Named from the image file by the ReadyToRun path.
            ManagedCode::ReadyToRun { .. } => return None,
        };
        self.counts.named.fetch_add(1, Ordering::Relaxed);
        Some(name)
    }

    fn method_name(&self, image: Arc<str>, token: u32) -> Option<CodeName> {
        let key = (image, token);
        if let Some(name) = self.names.lock().ok()?.get(&key) {
            return Some(name.clone());
        }
        let Some(metadata) = self.metadata(&key.0) else {
            self.counts.no_metadata.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let Some(method) = metadata.method_name(token) else {
            self.counts.no_metadata.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let name = CodeName {
            assembly: metadata.assembly_name().map(Arc::from),
            ..plain_name(capped_name(method))
        };
        let heap_bytes = name.name.len() + name.assembly.as_ref().map_or(0, |a| a.len());
        let mut names = self.names.lock().ok()?;
        names.insert(self.pid, key, name.clone(), heap_bytes as u64);
        Some(name)
    }

    /// The metadata of the image at `path` (in the target's root), read
    /// once; `None` (also remembered) when it has none.
    fn metadata(&self, path: &Arc<str>) -> Option<Arc<HeldMetadata>> {
        let mut images = self.images.lock().ok()?;
        if let Some(known) = images.get(path) {
            return known.clone();
        }
        let mapping = self.mapped.get(path)?;
        let read = open_mapped(&self.procfs, self.pid, &MappedFileRef::from(mapping))
            .inspect_err(|e| tracing::debug!(pid = self.pid, "memory path: {e}"))
            .ok()
            .map(|file| match &self.shared {
                Some(shared) => shared.shared_metadata(&file),
                None => HeldMetadata::read(&file).map(Arc::new),
            })
            .and_then(|read| match read {
                Ok(metadata) => Some(metadata),
                Err(e) => {
                    tracing::debug!(path = &**path, "memory path: no metadata: {e}");
                    None
                }
            });
        if images.len() >= MAX_IMAGES {
            images.clear();
        }
        images.insert(path.clone(), read.clone());
        read
    }
}

/// The type that holds LCG methods and IL stubs, as the runtime names it
/// in perf maps and stack traces (`dynamicClass::IL_STUB_PInvoke`).
const DYNAMIC_CLASS: &str = "dynamicClass";

/// A dynamic method's frame name: `dynamicClass.Name` as the perf map says
/// it, so a frame is named alike whichever source names it; its kind when
/// the runtime keeps no name (or it is empty).
fn dynamic_method_name(name: Option<&str>) -> String {
    match name.filter(|n| !n.is_empty()) {
        Some(name) => format!("{DYNAMIC_CLASS}.{name}"),
        None => "[dynamic method]".to_string(),
    }
}

fn plain_name(name: String) -> CodeName {
    CodeName {
        name: name.into(),
        system_name: None,
        assembly: None,
        // The tier needs the code version walk, not done yet.
        jit_tier: None,
    }
}

impl name_sources::JitMemoryNames for JitMemoryNames {
    fn sync_mappings(&mut self, mappings: &MappingTable) {
        JitMemoryNames::sync_mappings(self, mappings);
    }

    fn name(&self, lookup: u64, _time_ns: u64) -> Option<CodeName> {
        // Memory is read now: the name is the code's as of now.
        self.code_name(lookup)
    }

    fn take_new_code(&mut self) -> Vec<crate::unwind::jit_code::JitMethod> {
        super::code_heap_scan::take_new_code(&self.reader, &mut self.code_scan)
    }

    fn problems(&self) -> Option<String> {
        let failed = self.counts.failed.load(Ordering::Relaxed);
        let named = self.counts.named.load(Ordering::Relaxed);
        let refused = self.reader.budget.refused.load(Ordering::Relaxed);
        let (times_aside, _) = self.reader.budget.put_aside();
        let refused = match (refused, times_aside) {
            (0, _) => String::new(),
            (n, 0) => format!(", {n} not made: over its naming budget"),
            (n, aside) => format!(
                ", {n} not made: over its naming budget, or put aside ({aside} times) as every lookup failed"
            ),
        };
        (failed > 0 && named == 0).then(|| {
            format!("no JIT frame named from the runtime's memory ({failed} lookups failed{refused})")
        }).or_else(|| (!refused.is_empty()).then(|| {
            format!("some JIT frames not named from the runtime's memory ({named} named, {failed} lookups failed{refused})")
        }))
    }
}

/// Why a process has no memory path; names nothing, says why once.
struct NoMemoryNames(String);

impl name_sources::JitMemoryNames for NoMemoryNames {
    fn sync_mappings(&mut self, _: &MappingTable) {}

    fn name(&self, _: u64, _: u64) -> Option<CodeName> {
        None
    }

    fn problems(&self) -> Option<String> {
        Some(self.0.clone())
    }
}

/// The [`name_sources::JitMemoryFactory`] of the memory path.
pub fn jit_memory_reader(
    context: &JitMemoryContext<'_>,
) -> Option<Box<dyn name_sources::JitMemoryNames>> {
    let JitMemoryContext {
        procfs,
        pid,
        mappings,
        assemblies,
        ..
    } = *context;
    Some(match JitMemoryNames::attach(procfs, pid, mappings) {
        Ok(names) => Box::new(names.sharing_metadata(assemblies.clone())),
        Err(e) => {
            tracing::debug!(pid, "no JIT names from memory: {e}");
            Box::new(NoMemoryNames(format!(
                "the runtime's memory cannot name them: {e}"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_methods_are_named_as_the_perf_map_names_them() {
        assert_eq!(
            dynamic_method_name(Some("InvokeStub_EventAttribute.set_Level")),
            "dynamicClass.InvokeStub_EventAttribute.set_Level"
        );
        assert_eq!(
            dynamic_method_name(Some("IL_STUB_PInvoke")),
            "dynamicClass.IL_STUB_PInvoke"
        );
        assert_eq!(dynamic_method_name(None), "[dynamic method]");
        assert_eq!(dynamic_method_name(Some("")), "[dynamic method]");
    }
}
