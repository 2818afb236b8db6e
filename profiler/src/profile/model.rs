//! The finished profile: an exporter-neutral model that the pprof, folded
//! and SVG writers read. Frames are interned once in [`Profile::frames`];
//! samples refer to them by index, leaf first, as pprof does.

use std::sync::Arc;

/// A raw sample from the kernel side, before symbolization.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawSample {
    /// CLOCK_MONOTONIC nanoseconds.
    pub time_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub cpu: u32,
    pub kind: clrbpf_common::SampleKind,
    /// Period (on-CPU) or interval (off-CPU) in nanoseconds.
    pub value: u64,
    pub thread_name: Arc<str>,
    /// Kernel addresses, leaf first.
    pub kernel_stack: Vec<u64>,
    /// User addresses, leaf first.
    pub user_stack: Vec<u64>,
    pub kernel_stack_truncated: bool,
    pub user_stack_truncated: bool,
    /// What only an off-CPU sample has: why and how long the thread was off.
    pub off_cpu: Option<OffCpuDetail>,
}

#[cfg(test)]
impl RawSample {
    /// A test's on-CPU sample of `pid`/`tid` ("worker", CPU 0) at `time_ns`,
    /// 1 µs long, with `user_stack` and no kernel frames.
    pub fn on_cpu(pid: u32, tid: u32, time_ns: u64, user_stack: Vec<u64>) -> Self {
        Self {
            time_ns,
            pid,
            tid,
            cpu: 0,
            kind: clrbpf_common::SampleKind::OnCpu,
            value: 1000,
            thread_name: "worker".into(),
            kernel_stack: Vec::new(),
            user_stack,
            kernel_stack_truncated: false,
            user_stack_truncated: false,
            off_cpu: None,
        }
    }
}

/// The off-CPU part of a [`RawSample`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffCpuDetail {
    /// The interval as measured; [`RawSample::value`] is its weight.
    pub interval_ns: u64,
    /// The system call the thread blocked in, `None` outside one.
    pub syscall: Option<u32>,
    /// Only in a waker record on its way to its off-CPU record: the thread
    /// it woke. 0 otherwise.
    pub woken_tid: u32,
    /// The thread running when the wakeup came, when it was recorded: the
    /// waker, unless [`Self::waker_kernel_stack`] shows an interrupt.
    pub waker: Option<Waker>,
    /// Kernel stack of the wakeup (leaf first), when recorded.
    pub waker_kernel_stack: Vec<u64>,
    /// The stack rate limit skipped this wait's stacks (a long wait, kept
    /// for its time).
    pub stack_not_taken: bool,
}

/// The thread that woke a blocked one, and its user stack (frame pointers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waker {
    pub pid: u32,
    pub tid: u32,
    pub thread_name: Arc<str>,
    /// Leaf first.
    pub user_stack: Vec<u64>,
}

/// Where a frame's code came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrameKind {
    Kernel,
    /// Native code from an ELF file (executable or shared library).
    Native,
    /// JIT-compiled or ReadyToRun .NET code.
    Managed,
    /// An address nothing could name.
    Unknown,
    /// A frame the profiler adds: a truncation marker, a grouping root.
    Synthetic,
}

/// The file (or pseudo-file) a frame's address belongs to: a pprof mapping.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    /// Path as the process sees it (`/usr/lib/.../libc.so.6`), or a pseudo
    /// name: `[kernel.kallsyms]`, `[jit]`, `[anon]`.
    pub path: Arc<str>,
    /// Hex GNU build id, when the file has one.
    pub build_id: Option<Arc<str>>,
    pub memory_start: u64,
    pub memory_limit: u64,
    pub file_offset: u64,
    /// Whether frames in this module carry function names.
    pub has_functions: bool,
}

/// One function of an inline chain at an address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InlinedFunction {
    pub name: Arc<str>,
    pub file: Option<Arc<str>>,
    pub line: u32,
}

/// A resolved stack frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    pub kind: FrameKind,
    /// Function name. Managed frames keep the runtime's full signature with
    /// the JIT tier removed; unnamed frames are `0x<address>` or
    /// `[module]`.
    pub name: Arc<str>,
    /// The name as the producer wrote it (mangled native name, managed name
    /// with its `[Tier]` suffix), when it differs from `name`.
    pub system_name: Option<Arc<str>>,
    /// JIT tier of a managed frame (`OptimizedTier1`, `QuickJitted`, `PreJIT`, ...).
    pub jit_tier: Option<Arc<str>>,
    pub module: Option<Arc<Module>>,
    /// Absolute address in the process (or kernel) address space.
    pub address: u64,
    pub file: Option<Arc<str>>,
    pub line: u32,
    /// Functions inlined at this address, innermost first; `name` is the
    /// outermost (the one that owns the code).
    pub inlined: Vec<InlinedFunction>,
}

impl Frame {
    /// A frame the profiler itself adds (a truncation marker, a root such as
    /// `Garbage Collector`).
    pub fn synthetic(name: &str) -> Self {
        Self {
            kind: FrameKind::Synthetic,
            name: name.into(),
            system_name: None,
            jit_tier: None,
            module: None,
            address: 0,
            file: None,
            line: 0,
            inlined: Vec::new(),
        }
    }
}

/// Index into [`Profile::frames`].
pub type FrameIndex = u32;

/// A label value: a string, or a number with an optional unit.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LabelValue {
    Str(Arc<str>),
    Num { value: i64, unit: Option<Arc<str>> },
}

/// A sample label, keyed by OpenTelemetry-style names (`process.pid`, ...).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Label {
    pub key: Arc<str>,
    pub value: LabelValue,
}

/// Most label keys [`label_key`] shares (they are clrbpf's own names, a
/// few dozen at most).
const MAX_SHARED_LABEL_KEYS: usize = 64;

/// The one allocation of label key `key` on this thread: each distinct
/// sample holds several labels, and a whole-host `record` holds every
/// distinct sample of its one window.
fn label_key(key: &str) -> Arc<str> {
    thread_local! {
        static KEYS: std::cell::RefCell<Vec<Arc<str>>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    KEYS.with_borrow_mut(|keys| {
        if let Some(shared) = keys.iter().find(|k| &***k == key) {
            return shared.clone();
        }
        let new: Arc<str> = key.into();
        if keys.len() < MAX_SHARED_LABEL_KEYS {
            keys.push(new.clone());
        }
        new
    })
}

impl Label {
    pub fn str(key: &str, value: impl Into<Arc<str>>) -> Self {
        Self {
            key: label_key(key),
            value: LabelValue::Str(value.into()),
        }
    }
    pub fn num(key: &str, value: i64) -> Self {
        Self {
            key: label_key(key),
            value: LabelValue::Num { value, unit: None },
        }
    }
}

/// Label keys. OpenTelemetry semantic-convention names.
pub mod label_keys {
    pub const PROCESS_PID: &str = "process.pid";
    pub const PROCESS_EXECUTABLE_NAME: &str = "process.executable.name";
    pub const THREAD_ID: &str = "thread.id";
    pub const THREAD_NAME: &str = "thread.name";
    pub const CONTAINER_ID: &str = "container.id";
    pub const K8S_POD_NAME: &str = "k8s.pod.name";
    pub const K8S_POD_UID: &str = "k8s.pod.uid";
    pub const K8S_NAMESPACE_NAME: &str = "k8s.namespace.name";
    pub const K8S_CONTAINER_NAME: &str = "k8s.container.name";
    pub const K8S_NODE_NAME: &str = "k8s.node.name";
    pub const SERVICE_NAME: &str = "service.name";
    /// Why an off-CPU sample's thread waited: `futex`, `sleep`, `io`,
    /// `page_fault`, `other`.
    pub const WAIT_KIND: &str = "wait.kind";
    pub const WAKER_PROCESS_PID: &str = "waker.process.pid";
    pub const WAKER_THREAD_ID: &str = "waker.thread.id";
    pub const WAKER_THREAD_NAME: &str = "waker.thread.name";
}

/// A (type, unit) pair: pprof's ValueType.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ValueType {
    pub r#type: Arc<str>,
    pub unit: Arc<str>,
}

impl ValueType {
    pub fn new(r#type: &str, unit: &str) -> Self {
        Self {
            r#type: r#type.into(),
            unit: unit.into(),
        }
    }
}

/// One aggregated sample: a stack, one value per [`Profile::sample_types`]
/// entry, and its labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileSample {
    /// Leaf first.
    pub stack: Vec<FrameIndex>,
    pub values: Vec<i64>,
    pub labels: Vec<Label>,
}

/// A finished profile, ready for any writer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Profile {
    pub sample_types: Vec<ValueType>,
    /// The sample type a viewer shows first (index into `sample_types`).
    pub default_sample_type: Option<usize>,
    pub period_type: Option<ValueType>,
    pub period: i64,
    /// Wall-clock start, nanoseconds since the Unix epoch.
    pub start_unix_ns: i64,
    pub duration_ns: i64,
    pub frames: Vec<Frame>,
    pub samples: Vec<ProfileSample>,
    /// Free-form notes, e.g. the producer and its version.
    pub comments: Vec<String>,
    /// The application profiled (`record -p`, `record -- COMMAND`): the
    /// first pprof mapping, which viewers show as the profile's program.
    pub main_module: Option<Arc<Module>>,
}
