//! Writers for a finished [`crate::profile::Profile`]: gzip pprof, folded
//! stacks and SVG flame graphs.
