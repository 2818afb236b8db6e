//! Frames named by the memory path: what the .NET instance
//! ([`crate::clr::instance`]) asks when its perf map or events have no name
//! for an address. [`JitMemoryNames`] turns the [`ManagedCode`] the
//! [`ClrMemoryReader`] finds into a [`Frame`], naming methods from their
//! image's ECMA-335 metadata ([`ClrMetadata`], read once per image file
//! through the target's root) and the rest by kind.
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

use super::{AttachError, ClrMemoryReader, ManagedCode, target::ProcessMemory};
use crate::{
    process::{MappingTable, ProcFs, root::TargetRoot},
    profile::{Frame, FrameKind, Module},
    symbolize::clr_metadata::ClrMetadata,
};

/// Images whose metadata is kept per process.
const MAX_IMAGES: usize = 1024;
/// Names kept per process before the cache starts over.
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
    root: Option<TargetRoot>,
    /// `(start, end)` of file-backed mappings, sorted: never walked.
    files: Vec<(u64, u64)>,
    images: Mutex<HashMap<Arc<str>, Option<Arc<ClrMetadata>>>>,
    names: Mutex<HashMap<MethodKey, Arc<Frame>>>,
    module: Arc<Module>,
    pub counts: MemoryNameCounts,
}

impl JitMemoryNames {
    /// The memory path for process `pid`, or why it cannot be used.
    pub fn attach(
        procfs: &ProcFs,
        pid: u32,
        mappings: &MappingTable,
        module: Arc<Module>,
    ) -> Result<Self, AttachError> {
        let reader = ClrMemoryReader::attach(procfs, pid, mappings)?;
        let mut names = Self {
            reader,
            root: TargetRoot::open(procfs, pid).ok(),
            files: Vec::new(),
            images: Mutex::new(HashMap::new()),
            names: Mutex::new(HashMap::new()),
            module,
            counts: MemoryNameCounts::default(),
        };
        names.sync_mappings(mappings);
        Ok(names)
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
    }

    fn in_file(&self, addr: u64) -> bool {
        let at = self.files.partition_point(|&(start, _)| start <= addr);
        at.checked_sub(1)
            .and_then(|i| self.files.get(i))
            .is_some_and(|&(_, end)| addr < end)
    }

    /// The frame of the code at `lookup`, reported at `addr`; `None` when
    /// the runtime's memory does not name it.
    pub fn frame(&self, lookup: u64, addr: u64) -> Option<Arc<Frame>> {
        if self.in_file(lookup) {
            return None;
        }
        let code = match self.reader.code_at(lookup) {
            Ok(code) => code?,
            Err(e) => {
                self.counts.failed.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(lookup, "memory path: {e}");
                return None;
            }
        };
        let frame = match code {
            ManagedCode::Method { image, token, .. } => self.method_frame(image?, token, addr)?,
            ManagedCode::Dynamic { name } => {
                let name = match name {
                    Some(name) => format!("[dynamic method] {name}"),
                    None => "[dynamic method]".to_string(),
                };
                Arc::new(self.frame_named(name.into(), None, addr))
            }
            ManagedCode::Stub { kind } => {
                Arc::new(self.frame_named(format!("[stub: {kind}]").into(), None, addr))
            }
            // Named from the image file by the ReadyToRun path.
            ManagedCode::ReadyToRun { .. } => return None,
        };
        self.counts.named.fetch_add(1, Ordering::Relaxed);
        Some(frame)
    }

    fn method_frame(&self, image: Arc<str>, token: u32, addr: u64) -> Option<Arc<Frame>> {
        let key = (image, token);
        if let Some(frame) = self.names.lock().ok()?.get(&key) {
            return Some(Arc::new(Frame {
                address: addr,
                ..(**frame).clone()
            }));
        }
        let Some(metadata) = self.metadata(&key.0) else {
            self.counts.no_metadata.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let Some(name) = metadata.method_name(token) else {
            self.counts.no_metadata.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let assembly = metadata.assembly_name().map(Arc::from);
        let frame = Arc::new(self.frame_named(name.into(), assembly, addr));
        let mut names = self.names.lock().ok()?;
        if names.len() >= MAX_NAMES {
            names.clear();
        }
        names.insert(key, frame.clone());
        Some(frame)
    }

    /// The metadata of the image at `path` (in the target's root), read
    /// once; `None` (also remembered) when it has none.
    fn metadata(&self, path: &Arc<str>) -> Option<Arc<ClrMetadata>> {
        let mut images = self.images.lock().ok()?;
        if let Some(known) = images.get(path) {
            return known.clone();
        }
        let read = self
            .root
            .as_ref()
            .and_then(|root| root.open_file(&**path).ok())
            .and_then(|file| match ClrMetadata::read(&file) {
                Ok(metadata) => Some(Arc::new(metadata)),
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

    fn frame_named(&self, name: Arc<str>, file: Option<Arc<str>>, addr: u64) -> Frame {
        Frame {
            kind: FrameKind::Managed,
            name,
            system_name: None,
            // The tier needs the code version walk, not done yet.
            jit_tier: None,
            module: Some(self.module.clone()),
            address: addr,
            file,
            line: 0,
            inlined: Vec::new(),
        }
    }
}
