//! The driver: what `record` and the agent both run around the
//! [`Pipeline`](super::Pipeline). This file holds the options they share
//! ([`SamplingConfig`], checked from [`crate::cli::SamplingArgs`]).

use std::path::PathBuf;

use crate::{bpf::OffCpuConfig, cli::SamplingArgs, clr::session::ClrEventKinds};

/// Longest `--off-cpu-min` (the kernel side's keep rule takes up to 2^32 ns).
const MAX_OFF_CPU_MIN_MS: f64 = 4000.0;

/// An option the shared schema refuses; the message names the option.
#[derive(Debug, thiserror::Error)]
pub enum SamplingOptionError {
    #[error("--off-cpu-min must be more than 0 and at most {MAX_OFF_CPU_MIN_MS} ms")]
    OffCpuMin,
    #[error("--clr-events: {0}")]
    ClrEvents(String),
}

/// What `record` and the agent collect besides CPU samples, and how they
/// walk stacks: [`SamplingArgs`], checked.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingConfig {
    /// CLR events collected from .NET processes (none: no EventPipe
    /// session).
    pub clr_events: ClrEventKinds,
    /// Off-CPU intervals of the profiled threads, with their wakers.
    pub off_cpu: Option<OffCpuConfig>,
    /// A `wall/nanoseconds` sample type: CPU plus off-CPU time per thread
    /// (implies [`Self::off_cpu`]).
    pub wall: bool,
    /// Walk user stacks with `.eh_frame` unwind tables in the kernel.
    pub dwarf_unwind: bool,
    /// Kernel memory for unwind tables at most.
    pub unwind_table_memory_bytes: u64,
    /// Where unwind tables and this boot's kallsyms are kept between runs
    /// (`None`: nowhere).
    pub unwind_cache_dir: Option<PathBuf>,
}

impl SamplingConfig {
    /// Checks the shared options.
    pub fn from_args(args: SamplingArgs) -> Result<Self, SamplingOptionError> {
        let SamplingArgs {
            clr_events,
            no_clr_events,
            off_cpu,
            off_cpu_min,
            off_cpu_max_stacks,
            wall,
            frame_pointers_only,
            unwind_table_memory_mb,
            cache_dir,
            no_cache,
        } = args;
        if !(off_cpu_min.is_finite() && off_cpu_min > 0.0 && off_cpu_min <= MAX_OFF_CPU_MIN_MS) {
            return Err(SamplingOptionError::OffCpuMin);
        }
        let clr_events = if no_clr_events {
            ClrEventKinds::NONE
        } else {
            ClrEventKinds::parse(&clr_events).map_err(SamplingOptionError::ClrEvents)?
        };
        Ok(Self {
            clr_events,
            // --wall is CPU plus off-CPU time: it turns off-CPU on.
            off_cpu: (off_cpu || wall).then_some(OffCpuConfig {
                min_ns: (off_cpu_min * 1e6) as u64,
                max_stacks_per_cpu_second: off_cpu_max_stacks,
            }),
            wall,
            dwarf_unwind: !frame_pointers_only,
            unwind_table_memory_bytes: unwind_table_memory_mb << 20,
            unwind_cache_dir: (!no_cache).then_some(cache_dir),
        })
    }

    /// The sample types these options give the profile.
    pub fn layout(&self) -> crate::profile::layout::ValueLayout {
        crate::profile::layout::ValueLayout::new(
            self.off_cpu.is_some(),
            self.wall,
            self.clr_events.any(),
        )
    }
}
