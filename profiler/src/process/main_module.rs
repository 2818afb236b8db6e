//! The application a profile is about, as its first pprof mapping: viewers
//! show the first mapping as the profile's program (`go tool pprof` prints
//! `File: <its name>`). Read from `/proc` for the process `record -p PID`
//! or `record -- COMMAND` profiles; the whole host has no such file.
//!
//! 1. A `dotnet` host running `dotnet [options] App.dll`: the entry
//!    assembly, `App.dll`, is the application a .NET user names; the host
//!    is the same `dotnet` for every app. Its path is resolved as the
//!    process sees it (relative to its working directory).
//! 2. Anything else (an apphost `./App`, a native program): the executable.
//! 3. Where the file is mapped (the executable's code segment, else its
//!    lowest mapping), the mapping gives the range and offset; an assembly
//!    the runtime has not mapped yet (a command just started) keeps only its
//!    path. An ELF executable's GNU build id is read from the file mapped
//!    ([`super::mapped_file`]), so the mapping is the one the native
//!    symbolizer gives its frames.

use std::{path::Path, sync::Arc};

use super::{ProcFs, maps::Mapping};
use crate::profile::Module;

/// The file of the application `cmdline` runs: the entry assembly of a
/// `dotnet` host (`None` when `exe_name` is no `dotnet` host or no
/// argument is an assembly).
pub fn entry_assembly<'a>(exe_name: &str, cmdline: &'a [String]) -> Option<&'a str> {
    if exe_name != "dotnet" {
        return None;
    }
    cmdline
        .iter()
        .skip(1)
        .map(String::as_str)
        .find(|arg| !arg.starts_with('-') && has_assembly_extension(arg))
}

fn has_assembly_extension(arg: &str) -> bool {
    let lower = arg.to_ascii_lowercase();
    (lower.ends_with(".dll") || lower.ends_with(".exe")) && lower.len() > 4
}

/// The mapping that stands for `path` among `mappings`: its executable
/// mapping, else its lowest one.
pub fn mapping_of<'a>(mappings: &'a [Mapping], path: &str) -> Option<&'a Mapping> {
    let of_file = || mappings.iter().filter(move |m| m.file_path() == Some(path));
    of_file()
        .find(|m| m.is_executable())
        .or_else(|| of_file().min_by_key(|m| m.start))
}

/// The application's module, without a build id: its path as the process
/// sees it, placed where `mappings` map it.
pub fn main_module_of(
    exe_path: &str,
    exe_name: &str,
    cmdline: &[String],
    cwd: Option<&str>,
    mappings: &[Mapping],
) -> Module {
    let path = match entry_assembly(exe_name, cmdline) {
        Some(assembly) if assembly.starts_with('/') => assembly.to_owned(),
        Some(assembly) => {
            let by_name = Path::new(assembly).file_name().and_then(|n| n.to_str());
            // The runtime maps the assembly by its full path; prefer that
            // spelling when it is already mapped.
            let mapped = by_name.and_then(|name| {
                mappings
                    .iter()
                    .filter_map(Mapping::file_path)
                    .find(|p| Path::new(p).file_name().and_then(|n| n.to_str()) == Some(name))
            });
            match (mapped, cwd) {
                (Some(mapped), _) => mapped.to_owned(),
                (None, Some(cwd)) => Path::new(cwd).join(assembly).to_string_lossy().into(),
                (None, None) => assembly.to_owned(),
            }
        }
        None => exe_path.to_owned(),
    };
    let (memory_start, memory_limit, file_offset) =
        mapping_of(mappings, &path).map_or((0, 0, 0), |m| (m.start, m.end, m.offset));
    Module {
        path: path.into(),
        build_id: None,
        memory_start,
        memory_limit,
        file_offset,
        has_functions: true,
    }
}

/// The application module of `pid`, read from `/proc`; `None` when the
/// process is gone.
pub fn main_module(procfs: &ProcFs, pid: u32) -> Option<Arc<Module>> {
    let info = procfs.process_info(pid).ok()?;
    let maps = procfs.maps(pid).ok()?;
    let exe = std::fs::read_link(procfs.pid_path(pid, "exe")).ok()?;
    let exe = exe.to_str()?;
    let cwd = std::fs::read_link(procfs.pid_path(pid, "cwd")).ok();
    let mut module = main_module_of(
        exe,
        &info.exe_name,
        &info.cmdline,
        cwd.as_deref().and_then(Path::to_str),
        maps.mappings(),
    );
    let mapping = maps
        .iter()
        .find(|m| m.start == module.memory_start && m.end == module.memory_limit);
    let file = mapping
        .filter(|_| !module.path.ends_with(".dll"))
        .and_then(|m| super::mapped_file::open_mapped(procfs, pid, &m.into()).ok());
    if let Some(file) = file {
        // The exact file mapped, never a device or a path swapped since.
        let fd_path = super::root::fd_path(std::os::fd::AsFd::as_fd(&file));
        module.build_id = blazesym::helper::read_elf_build_id(&fd_path)
            .ok()
            .flatten()
            .map(|id| {
                id.iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
                    .into()
            });
    }
    Some(Arc::new(module))
}

/// Whether `path` is the `dotnet` host itself, which stands for the
/// application only when no argument names an assembly.
fn is_dotnet_host(path: &str) -> bool {
    Path::new(path).file_name().and_then(|n| n.to_str()) == Some("dotnet")
}

/// Most times [`ApplicationModule::poll`] reads `/proc` for a file not
/// mapped yet (once per recording tick): a few seconds.
const MAX_POLLS: u32 = 100;

/// The application module of one process over a recording: read when the
/// recording starts and again until the file is mapped (the runtime maps
/// the entry assembly some milliseconds after a launched command starts),
/// kept once the process is gone.
#[derive(Debug, Default)]
pub struct ApplicationModule {
    pid: Option<u32>,
    module: Option<Arc<Module>>,
    polls: u32,
}

impl ApplicationModule {
    /// The application of `pid` (`None`: the whole host, no application).
    pub fn new(procfs: &ProcFs, pid: Option<u32>) -> Self {
        let mut application = Self {
            pid,
            module: None,
            polls: 0,
        };
        application.poll(procfs);
        application
    }

    /// Reads the module again while it is not mapped yet.
    pub fn poll(&mut self, procfs: &ProcFs) {
        let Some(pid) = self.pid else {
            return;
        };
        // A `dotnet` host read without its assembly was read mid-exec (its
        // exe already the host, its arguments not yet readable): read again.
        let settled = self
            .module
            .as_ref()
            .is_some_and(|m| m.memory_limit != 0 && !is_dotnet_host(&m.path));
        if settled || self.polls >= MAX_POLLS {
            return;
        }
        self.polls += 1;
        if let Some(module) = main_module(procfs, pid) {
            self.module = Some(module);
        }
    }

    /// The module last read.
    pub fn finish(self) -> Option<Arc<Module>> {
        self.module
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::maps::parse_maps_line;

    fn args(line: &str) -> Vec<String> {
        line.split(' ').map(str::to_owned).collect()
    }

    #[test]
    fn the_entry_assembly_of_a_dotnet_host() {
        let cases = [
            ("dotnet", "dotnet App.dll", Some("App.dll")),
            (
                "dotnet",
                "dotnet exec --roll-forward Major bin/App.dll 3",
                Some("bin/App.dll"),
            ),
            (
                "dotnet",
                "/usr/bin/dotnet /srv/Api.DLL --urls x",
                Some("/srv/Api.DLL"),
            ),
            ("dotnet", "dotnet run", None),
            ("dotnet", "dotnet .dll", None),
            ("App", "./App App.dll", None),
            ("python3", "python3 x.dll", None),
        ];
        for (exe, cmdline, expected) in cases {
            assert_eq!(entry_assembly(exe, &args(cmdline)), expected, "{cmdline}");
        }
    }

    #[test]
    fn the_module_is_the_assembly_where_it_is_mapped() {
        let maps: Vec<Mapping> = [
            "55d0a0000000-55d0a0010000 r--p 00000000 08:01 11 /usr/share/dotnet/dotnet",
            "55d0a0010000-55d0a0020000 r-xp 00010000 08:01 11 /usr/share/dotnet/dotnet",
            "7f10a0000000-7f10a0002000 r--s 00000000 08:01 22 /home/u/app/App.dll",
            "7f10a0002000-7f10a0004000 r--s 00002000 08:01 22 /home/u/app/App.dll",
        ]
        .iter()
        .map(|line| parse_maps_line(line).expect("a maps line"))
        .collect();
        let module = main_module_of(
            "/usr/share/dotnet/dotnet",
            "dotnet",
            &args("dotnet App.dll"),
            Some("/home/u/app"),
            &maps,
        );
        assert_eq!(&*module.path, "/home/u/app/App.dll");
        assert_eq!(
            (module.memory_start, module.memory_limit, module.file_offset),
            (0x7f10_a000_0000, 0x7f10_a000_2000, 0)
        );
        // Not mapped yet: the path as the process would open it.
        let early = main_module_of(
            "/usr/share/dotnet/dotnet",
            "dotnet",
            &args("dotnet bin/App.dll"),
            Some("/home/u"),
            &maps[..2],
        );
        assert_eq!(&*early.path, "/home/u/bin/App.dll");
        assert_eq!(early.memory_limit, 0);
        // A native program: its code segment.
        let native = main_module_of(
            "/usr/share/dotnet/dotnet",
            "dotnet",
            &args("dotnet --info"),
            None,
            &maps,
        );
        assert_eq!(&*native.path, "/usr/share/dotnet/dotnet");
        assert_eq!(
            (native.memory_start, native.file_offset),
            (0x55d0_a001_0000, 0x10000)
        );
    }

    #[test]
    fn only_the_dotnet_host_itself_is_read_again() {
        assert!(is_dotnet_host("/usr/share/dotnet/dotnet"));
        assert!(!is_dotnet_host("/srv/app/App.dll"));
        assert!(!is_dotnet_host("/srv/app/dotnet-app"));
    }

    #[test]
    fn this_test_binary_is_its_own_main_module() {
        let module = main_module(&ProcFs::default(), std::process::id()).expect("we run");
        let exe = std::env::current_exe().expect("own path");
        assert_eq!(Path::new(&*module.path), exe);
        assert!(module.memory_limit > module.memory_start);
        assert!(module.build_id.is_some(), "rustc links a GNU build id");
        let procfs = ProcFs::default();
        let mut application = ApplicationModule::new(&procfs, Some(std::process::id()));
        application.poll(&procfs);
        assert_eq!(application.polls, 1, "mapped at once: read once");
        assert_eq!(application.finish(), Some(module));
        assert_eq!(ApplicationModule::new(&procfs, None).finish(), None);
    }
}
