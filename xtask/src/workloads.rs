//! `cargo xtask workloads`: compiles the C# test programs in
//! `tests/workloads/*.cs` with Mono's `mcs` and lays them out to run on
//! CoreCLR: `bin/net8/<Name>.dll` and `bin/netcore31/<Name>.dll`, each next
//! to the `<Name>.runtimeconfig.json` that picks its runtime and sets the
//! runtime options the workload needs (server GC for `GcHeavy`).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::SystemTime,
};

use anyhow::Context as _;

use crate::cmd;

/// A runtime the workloads are laid out for: `bin/<dir>/`.
struct Target {
    dir: &'static str,
    tfm: &'static str,
    framework_version: &'static str,
    /// `configProperties` every workload gets on this runtime, as (name,
    /// JSON value).
    config_properties: &'static [(&'static str, &'static str)],
}

const TARGETS: [Target; 2] = [
    Target {
        dir: "net8",
        tfm: "net8.0",
        framework_version: "8.0.0",
        config_properties: &[],
    },
    // 3.1 knows no ICU of this distribution: invariant globalization.
    Target {
        dir: "netcore31",
        tfm: "netcoreapp3.1",
        framework_version: "3.1.0",
        config_properties: &[("System.Globalization.Invariant", "true")],
    },
];

/// `configProperties` a workload needs on every runtime, beyond its
/// target's, as (name, JSON value).
fn workload_config_properties(name: &str) -> &'static [(&'static str, &'static str)] {
    match name {
        // Collections on the runtime's own GC threads (`.NET Server GC`,
        // `.NET BGC`), the ones clrbpf groups under `Garbage Collector`.
        "GcHeavy" => &[
            ("System.GC.Server", "true"),
            ("System.GC.Concurrent", "true"),
        ],
        _ => &[],
    }
}

/// The `<Name>.runtimeconfig.json` of workload `name` on `target`.
fn runtimeconfig(target: &Target, name: &str) -> String {
    let properties: Vec<String> = target
        .config_properties
        .iter()
        .chain(workload_config_properties(name))
        .map(|(key, value)| format!("\"{key}\":{value}"))
        .collect();
    let config_properties = if properties.is_empty() {
        String::new()
    } else {
        format!(",\"configProperties\":{{{}}}", properties.join(","))
    };
    format!(
        r#"{{"runtimeOptions":{{"tfm":"{}","framework":{{"name":"Microsoft.NETCore.App","version":"{}"}}{config_properties}}}}}"#,
        target.tfm, target.framework_version
    )
}

/// Builds every workload whose `.cs` is newer than its outputs.
/// `src` is `tests/workloads`, outputs go to `src/bin`.
pub fn build(src: &Path) -> anyhow::Result<()> {
    let mut sources: Vec<PathBuf> = fs::read_dir(src)
        .with_context(|| format!("list {}", src.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "cs"))
        .collect();
    sources.sort();
    let bin = src.join("bin");
    let mut built = 0;
    for source in &sources {
        let name = source
            .file_stem()
            .and_then(|s| s.to_str())
            .with_context(|| format!("non UTF-8 file name {}", source.display()))?;
        let outputs: Vec<PathBuf> = TARGETS
            .iter()
            .flat_map(|t| {
                let dir = bin.join(t.dir);
                [
                    dir.join(format!("{name}.dll")),
                    dir.join(format!("{name}.runtimeconfig.json")),
                ]
            })
            .collect();
        if is_up_to_date(source, &outputs)? {
            // The assemblies are current; the runtime options may have
            // changed here since they were written.
            for target in &TARGETS {
                write_runtimeconfig(&bin.join(target.dir), name, target)?;
            }
            continue;
        }
        compile(source, name, &bin)?;
        built += 1;
    }
    println!(
        "workloads: {built} built, {} up to date, in {}",
        sources.len() - built,
        bin.display()
    );
    Ok(())
}

fn compile(source: &Path, name: &str, bin: &Path) -> anyhow::Result<()> {
    let [first, rest @ ..] = &TARGETS;
    let first_dir = bin.join(first.dir);
    fs::create_dir_all(&first_dir).with_context(|| format!("create {}", first_dir.display()))?;
    let dll = first_dir.join(format!("{name}.dll"));
    let mut out_arg = std::ffi::OsString::from("-out:");
    out_arg.push(&dll);
    cmd::run(
        Command::new("mcs")
            .args(["-optimize+", "-target:exe"])
            .arg(out_arg)
            .arg(source),
    )
    .with_context(|| format!("compile {}", source.display()))?;
    write_runtimeconfig(&first_dir, name, first)?;
    // The IL is runtime-neutral: the same assembly runs on every target.
    for target in rest {
        let dir = bin.join(target.dir);
        fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let copy = dir.join(format!("{name}.dll"));
        fs::copy(&dll, &copy)
            .with_context(|| format!("copy {} to {}", dll.display(), copy.display()))?;
        write_runtimeconfig(&dir, name, target)?;
    }
    Ok(())
}

/// Writes the workload's runtimeconfig unless it already says the same
/// (so an unchanged file keeps its time and the build stays up to date).
fn write_runtimeconfig(dir: &Path, name: &str, target: &Target) -> anyhow::Result<()> {
    let path = dir.join(format!("{name}.runtimeconfig.json"));
    let text = runtimeconfig(target, name);
    if fs::read_to_string(&path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    fs::write(&path, text).with_context(|| format!("write {}", path.display()))
}

/// True when every output exists and none is older than `source`.
fn is_up_to_date(source: &Path, outputs: &[PathBuf]) -> anyhow::Result<bool> {
    let source_time = modified(source)?.context("the source vanished")?;
    for output in outputs {
        match modified(output)? {
            Some(time) if time >= source_time => {}
            _ => return Ok(false),
        }
    }
    Ok(true)
}

fn modified(path: &Path) -> anyhow::Result<Option<SystemTime>> {
    match fs::metadata(path) {
        Ok(m) => Ok(Some(
            m.modified()
                .with_context(|| format!("mtime of {}", path.display()))?,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("stat {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimeconfigs_pick_the_runtime_and_the_workload_options() {
        let [net8, netcore31] = &TARGETS;
        assert_eq!(
            runtimeconfig(net8, "Hot"),
            r#"{"runtimeOptions":{"tfm":"net8.0","framework":{"name":"Microsoft.NETCore.App","version":"8.0.0"}}}"#
        );
        assert_eq!(
            runtimeconfig(netcore31, "Hot"),
            r#"{"runtimeOptions":{"tfm":"netcoreapp3.1","framework":{"name":"Microsoft.NETCore.App","version":"3.1.0"},"configProperties":{"System.Globalization.Invariant":true}}}"#
        );
        assert_eq!(
            runtimeconfig(net8, "GcHeavy"),
            r#"{"runtimeOptions":{"tfm":"net8.0","framework":{"name":"Microsoft.NETCore.App","version":"8.0.0"},"configProperties":{"System.GC.Server":true,"System.GC.Concurrent":true}}}"#
        );
        assert_eq!(
            runtimeconfig(netcore31, "GcHeavy"),
            r#"{"runtimeOptions":{"tfm":"netcoreapp3.1","framework":{"name":"Microsoft.NETCore.App","version":"3.1.0"},"configProperties":{"System.Globalization.Invariant":true,"System.GC.Server":true,"System.GC.Concurrent":true}}}"#
        );
    }

    #[test]
    fn outputs_older_than_the_source_or_missing_are_stale() {
        let dir = std::env::temp_dir().join(format!("xtask-workloads-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let old = dir.join("old.dll");
        let source = dir.join("App.cs");
        let new = dir.join("new.dll");
        fs::write(&old, b"").unwrap();
        let file = fs::File::options().write(true).open(&old).unwrap();
        file.set_modified(SystemTime::UNIX_EPOCH).unwrap();
        fs::write(&source, b"").unwrap();
        fs::write(&new, b"").unwrap();
        let fresh = is_up_to_date(&source, std::slice::from_ref(&new)).unwrap();
        let stale = is_up_to_date(&source, &[new.clone(), old]).unwrap();
        let missing = is_up_to_date(&source, &[new, dir.join("gone.dll")]).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        assert!(fresh);
        assert!(!stale);
        assert!(!missing);
    }
}
