//! Is a process .NET, which version, and what its environment tells the
//! profiler about its runtime settings.
//!
//! Detection reads the mappings: CoreCLR lives in `libcoreclr.so`, and a
//! framework-dependent app loads it from the shared framework directory
//! `.../shared/Microsoft.NETCore.App/<version>/`, which names the version.
//! A self-contained app carries `libcoreclr.so` next to itself (version
//! unknown from the path); a single-file app links the runtime into its
//! executable and shows no runtime mapping at all; for both, the diagnostic
//! IPC (`ProcessInfo2`) gives the version (see `clr::ipc`).
//!
//! The environment decides where the runtime writes perf maps and whether
//! it already does ([`DotnetEnvironment`]).

use clrbpf_parse::version::version_major;

use super::{Environ, MappingTable, ProcError, ProcFs};

/// Directory of the shared framework, followed by the version directory.
const SHARED_FRAMEWORK_DIR: &str = "Microsoft.NETCore.App/";
const LIBCORECLR: &str = "libcoreclr.so";
/// The runtime's core library, mapped late in its startup.
const CORELIB: &str = "System.Private.CoreLib.dll";
/// The runtime reads its settings with either prefix; `DOTNET_` wins.
const ENV_PREFIXES: [&str; 2] = ["DOTNET_", "COMPlus_"];
/// `DOTNET_PerfMapEnabled`: 0 off, 1 perf map + jitdump, 2 jitdump, 3 perf map.
const PERF_MAP_ENABLED: &str = "PerfMapEnabled";
/// `DOTNET_PerfMapJitDumpPath`: directory of the perf map and jitdump files.
const PERF_MAP_JITDUMP_PATH: &str = "PerfMapJitDumpPath";
/// `DOTNET_EnableDiagnostics=0` removes the diagnostic socket.
const ENABLE_DIAGNOSTICS: &str = "EnableDiagnostics";
const TMPDIR: &str = "TMPDIR";
const DEFAULT_TMPDIR: &str = "/tmp";

/// The .NET runtime found in a process's mappings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DotnetRuntime {
    /// `"8.0.4"`, from the shared framework directory; `None` for
    /// self-contained and single-file apps.
    pub version: Option<String>,
    /// Path of the mapped `libcoreclr.so` in the process's mount namespace
    /// (reach it through `/proc/PID/root`); `None` when only a framework
    /// file was mapped.
    pub libcoreclr_path: Option<String>,
    /// Whether `System.Private.CoreLib.dll` is mapped: the runtime maps it
    /// once its startup has created the app domain and initialized the
    /// perf map, so it may be talked to. An `EnablePerfMap` that arrives
    /// earlier crashes .NET 8 and 9 (dotnet/runtime#122472, #123438).
    pub started: bool,
}

impl DotnetRuntime {
    /// Looks for CoreCLR in the executable mappings: a file named
    /// `libcoreclr.so`, or any file under `Microsoft.NETCore.App/<version>/`.
    /// Only code the process runs counts: a profiler or a backup tool that
    /// maps `libcoreclr.so` to read it is not .NET.
    pub fn detect(maps: &MappingTable) -> Option<Self> {
        let mut runtime = Self::detect_from_paths(
            maps.iter()
                .filter(|m| m.is_executable())
                .filter_map(|m| m.file_path()),
        )?;
        runtime.started = maps
            .iter()
            .filter_map(|m| m.file_path())
            .any(|path| path.rsplit('/').next() == Some(CORELIB));
        Some(runtime)
    }

    /// [`DotnetRuntime::detect`] over mapped file paths.
    pub fn detect_from_paths<'a>(paths: impl IntoIterator<Item = &'a str>) -> Option<Self> {
        let mut found: Option<Self> = None;
        let mut started = false;
        for path in paths {
            let file_name = path.rsplit('/').next();
            started |= file_name == Some(CORELIB);
            let is_coreclr = file_name == Some(LIBCORECLR);
            let version = shared_framework_version(path);
            if !is_coreclr && version.is_none() {
                continue;
            }
            let runtime = found.get_or_insert(Self {
                version: None,
                libcoreclr_path: None,
                started: false,
            });
            if is_coreclr && runtime.libcoreclr_path.is_none() {
                runtime.libcoreclr_path = Some(path.to_string());
                // libcoreclr's own directory is the authoritative version.
                if version.is_some() {
                    runtime.version = version;
                    continue;
                }
            }
            if runtime.version.is_none() {
                runtime.version = version;
            }
        }
        if let Some(runtime) = found.as_mut() {
            runtime.started = started;
        }
        found
    }

    /// The major version (8 for "8.0.4"), if the version is known.
    pub fn major(&self) -> Option<u32> {
        self.version.as_deref().and_then(version_major)
    }
}

/// The version directory after `Microsoft.NETCore.App/` in a path, if it
/// looks like a version (digits first, then digits, dots, letters, `-`, `+`).
fn shared_framework_version(path: &str) -> Option<String> {
    let (_, after) = path.rsplit_once(SHARED_FRAMEWORK_DIR)?;
    let (version, _) = after.split_once('/')?;
    let plausible = version.len() <= 64
        && version.starts_with(|c: char| c.is_ascii_digit())
        && version
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+'));
    plausible.then(|| version.to_string())
}

/// The runtime settings of a process that the profiler cares about, read
/// from its environment at exec. The default is an empty environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DotnetEnvironment {
    /// `TMPDIR` if set to an absolute path, else `/tmp`: where the runtime
    /// creates its diagnostic socket.
    pub tmpdir: String,
    /// `DOTNET_PerfMapEnabled` (or `COMPlus_`), parsed as the runtime does
    /// (hexadecimal); `None` if unset or unparsable (the runtime then uses 0).
    pub perf_map_enabled: Option<u32>,
    /// `DOTNET_PerfMapJitDumpPath`, if set.
    pub perf_map_jitdump_path: Option<String>,
    /// `DOTNET_EnableDiagnostics` is set to 0.
    pub diagnostics_disabled: bool,
}

impl Default for DotnetEnvironment {
    fn default() -> Self {
        Self::from_environ(&Environ::default())
    }
}

impl DotnetEnvironment {
    /// Reads `/proc/PID/environ`.
    pub fn read(procfs: &ProcFs, pid: u32) -> Result<Self, ProcError> {
        Ok(Self::from_environ(&procfs.environ(pid)?))
    }

    /// Extracts the settings from an environment.
    pub fn from_environ(environ: &Environ) -> Self {
        let clr = |name: &str| {
            ENV_PREFIXES
                .iter()
                .find_map(|prefix| environ.var(&format!("{prefix}{name}")))
        };
        let tmpdir = environ
            .var(TMPDIR)
            .filter(|dir| dir.starts_with('/'))
            .unwrap_or_else(|| DEFAULT_TMPDIR.to_string());
        Self {
            tmpdir,
            perf_map_enabled: clr(PERF_MAP_ENABLED).as_deref().and_then(parse_clr_dword),
            perf_map_jitdump_path: clr(PERF_MAP_JITDUMP_PATH).filter(|p| !p.is_empty()),
            diagnostics_disabled: clr(ENABLE_DIAGNOSTICS).as_deref().and_then(parse_clr_dword)
                == Some(0),
        }
    }

    /// The process writes perf maps by itself (the setting is non-zero).
    pub fn perf_map_enabled(&self) -> bool {
        self.perf_map_enabled.is_some_and(|v| v != 0)
    }

    /// Directories (as the target sees them) where its runtime may write
    /// `perf-<nspid>.map` and `jit-<nspid>.dump`: `DOTNET_PerfMapJitDumpPath`
    /// when set; otherwise .NET 8 uses the temp directory (`TMPDIR`) and
    /// .NET 9+ uses `/tmp`, so both are candidates.
    pub fn perf_map_dirs(&self) -> Vec<String> {
        if let Some(dir) = &self.perf_map_jitdump_path {
            return vec![dir.clone()];
        }
        let mut dirs = vec![DEFAULT_TMPDIR.to_string()];
        if self.tmpdir.trim_end_matches('/') != DEFAULT_TMPDIR {
            dirs.push(self.tmpdir.clone());
        }
        dirs
    }
}

/// Parses a CLR DWORD setting like `CLRConfig` does: hexadecimal, with an
/// optional `0x` prefix.
fn parse_clr_dword(value: &str) -> Option<u32> {
    let value = value.trim();
    let digits = value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"))
        .unwrap_or(value);
    if digits.is_empty() {
        return None;
    }
    u32::from_str_radix(digits, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_framework_dependent_runtime() {
        let maps = MappingTable::parse(
            "\
1000-2000 r-xp 0 fe:00 1 /usr/share/dotnet/dotnet
3000-4000 r--p 0 fe:00 2 /usr/share/dotnet/shared/Microsoft.NETCore.App/8.0.4/System.Private.CoreLib.dll
5000-6000 r-xp 0 fe:00 3 /usr/share/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so
7000-8000 r-xp 0 00:01 4 /memfd:doublemapper (deleted)
"
            .as_bytes(),
        )
        .expect("parse");
        let runtime = DotnetRuntime::detect(&maps).expect("dotnet");
        assert_eq!(runtime.version.as_deref(), Some("8.0.4"));
        assert!(runtime.started, "CoreLib is mapped");
        assert_eq!(
            runtime.libcoreclr_path.as_deref(),
            Some("/usr/share/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so")
        );
        assert_eq!(runtime.major(), Some(8));
    }

    #[test]
    fn a_process_that_only_reads_libcoreclr_is_not_dotnet() {
        let maps = MappingTable::parse(
            "\
1000-2000 r-xp 0 fe:00 1 /usr/bin/clrbpf
3000-4000 r--p 0 fe:00 3 /usr/share/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so
"
            .as_bytes(),
        )
        .expect("parse");
        assert_eq!(DotnetRuntime::detect(&maps), None);
    }

    #[test]
    fn detects_self_contained_and_framework_only() {
        let runtime = DotnetRuntime::detect_from_paths(["/app/libcoreclr.so"]).expect("dotnet");
        assert_eq!(runtime.version, None);
        assert!(
            !runtime.started,
            "libcoreclr.so without CoreLib: still starting"
        );
        let runtime = DotnetRuntime::detect_from_paths([
            "/app/System.Private.CoreLib.dll",
            "/app/libcoreclr.so",
        ])
        .expect("dotnet");
        assert!(runtime.started);
        assert_eq!(runtime.major(), None);
        assert_eq!(
            runtime.libcoreclr_path.as_deref(),
            Some("/app/libcoreclr.so")
        );

        let runtime = DotnetRuntime::detect_from_paths([
            "/x/shared/Microsoft.NETCore.App/3.1.23/libclrjit.so",
        ])
        .expect("dotnet");
        assert_eq!(
            (runtime.version.as_deref(), runtime.libcoreclr_path),
            (Some("3.1.23"), None)
        );

        // A deleted libcoreclr still counts (file_path strips the suffix).
        let maps = MappingTable::parse(
            "1-2 r-xp 0 0:0 1 /d/shared/Microsoft.NETCore.App/9.0.0-rc.1/libcoreclr.so (deleted)\n"
                .as_bytes(),
        )
        .expect("parse");
        let runtime = DotnetRuntime::detect(&maps).expect("dotnet");
        assert_eq!(runtime.major(), Some(9));
    }

    #[test]
    fn libcoreclr_directory_wins_over_other_framework_files() {
        let runtime = DotnetRuntime::detect_from_paths([
            "/a/shared/Microsoft.NETCore.App/6.0.1/System.Runtime.dll",
            "/b/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so",
        ])
        .expect("dotnet");
        assert_eq!(runtime.version.as_deref(), Some("8.0.4"));
    }

    #[test]
    fn not_dotnet() {
        assert_eq!(DotnetRuntime::detect(&MappingTable::default()), None);
        assert_eq!(
            DotnetRuntime::detect_from_paths([
                "/usr/lib/libcoreclr.so.bak",
                "/usr/lib/x86_64-linux-gnu/libc.so.6",
                "/evil/Microsoft.NETCore.App/../../etc/x",
                "/evil/Microsoft.NETCore.App/notaversion/x",
                "/evil/Microsoft.NETCore.App/8.0.4",
            ]),
            None
        );
    }

    #[test]
    fn environment_settings() {
        let env = DotnetEnvironment::from_environ(&Environ::from_bytes(
            &b"TMPDIR=/var/tmp/\0COMPlus_PerfMapEnabled=1\0DOTNET_PerfMapEnabled=0\0DOTNET_EnableDiagnostics=0\0"[..],
        ));
        assert_eq!(env.tmpdir, "/var/tmp/");
        // DOTNET_ wins over COMPlus_.
        assert_eq!(env.perf_map_enabled, Some(0));
        assert!(!env.perf_map_enabled());
        assert!(env.diagnostics_disabled);
        assert_eq!(
            env.perf_map_dirs(),
            vec!["/tmp".to_string(), "/var/tmp/".to_string()]
        );

        let env = DotnetEnvironment::from_environ(&Environ::from_bytes(
            &b"TMPDIR=relative\0COMPlus_PerfMapEnabled=0x3\0DOTNET_PerfMapJitDumpPath=/perf\0"[..],
        ));
        assert_eq!(env.tmpdir, "/tmp");
        assert_eq!(env.perf_map_enabled, Some(3));
        assert!(env.perf_map_enabled());
        assert!(!env.diagnostics_disabled);
        assert_eq!(env.perf_map_dirs(), vec!["/perf".to_string()]);

        let env = DotnetEnvironment::default();
        assert_eq!(env.tmpdir, "/tmp");
        assert_eq!(env.perf_map_enabled, None);
        assert_eq!(env.perf_map_dirs(), vec!["/tmp".to_string()]);
    }

    #[test]
    fn clr_dwords_are_hex() {
        assert_eq!(parse_clr_dword("10"), Some(16));
        assert_eq!(parse_clr_dword(" 0x1f "), Some(31));
        assert_eq!(parse_clr_dword("yes"), None);
        assert_eq!(parse_clr_dword(""), None);
        assert_eq!(parse_clr_dword("0x"), None);
        assert_eq!(parse_clr_dword("100000000"), None);
    }
}
