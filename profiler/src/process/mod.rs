//! The `/proc` model of a profiled process: its mappings, PID namespace,
//! container, whether it runs .NET and which version.
