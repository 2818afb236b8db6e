//! `cargo xtask workloads`: compiles the C# test programs in
//! `tests/workloads/*.cs` with Mono's `mcs` and lays them out to run on
//! CoreCLR: `bin/net8/<Name>.dll` and `bin/netcore31/<Name>.dll`, each next
//! to the `<Name>.runtimeconfig.json` that picks its runtime.

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
    runtimeconfig: &'static str,
}

const TARGETS: [Target; 2] = [
    Target {
        dir: "net8",
        runtimeconfig: r#"{"runtimeOptions":{"tfm":"net8.0","framework":{"name":"Microsoft.NETCore.App","version":"8.0.0"}}}"#,
    },
    // 3.1 knows no ICU of this distribution: invariant globalization.
    Target {
        dir: "netcore31",
        runtimeconfig: r#"{"runtimeOptions":{"tfm":"netcoreapp3.1","framework":{"name":"Microsoft.NETCore.App","version":"3.1.0"},"configProperties":{"System.Globalization.Invariant":true}}}"#,
    },
];

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

fn write_runtimeconfig(dir: &Path, name: &str, target: &Target) -> anyhow::Result<()> {
    let path = dir.join(format!("{name}.runtimeconfig.json"));
    fs::write(&path, target.runtimeconfig).with_context(|| format!("write {}", path.display()))
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
