// This file exists to enable the library target, which lets `profiler` name
// this crate as a build-dependency so cargo rebuilds it when it changes.
#![no_std]
