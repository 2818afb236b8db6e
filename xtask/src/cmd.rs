//! Running the external programs the tasks are made of (cargo, rustup,
//! apt-get, pip, mcs, go) with one uniform way of echoing them and of
//! turning a failure into an error that names the command.

use std::{
    ffi::OsStr,
    fmt::Write as _,
    process::{Command, Output, Stdio},
};

use anyhow::{Context as _, bail};

/// The command line as a user would type it, for logs and error messages.
pub fn display(cmd: &Command) -> String {
    let mut line = String::new();
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            let _ = write!(line, "{}={} ", key.to_string_lossy(), quote(value));
        }
    }
    line.push_str(&quote(cmd.get_program()));
    for arg in cmd.get_args() {
        line.push(' ');
        line.push_str(&quote(arg));
    }
    line
}

fn quote(word: &OsStr) -> String {
    let word = word.to_string_lossy();
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:+,@%".contains(c));
    if plain {
        word.into_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Runs `cmd` with inherited stdio, echoing it first; fails unless it exits 0.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let line = display(cmd);
    println!("$ {line}");
    let status = cmd
        .status()
        .with_context(|| format!("start `{line}` (is it installed and on PATH?)"))?;
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` quietly and returns its stdout; fails unless it exits 0.
pub fn output(cmd: &mut Command) -> anyhow::Result<String> {
    let line = display(cmd);
    let Output {
        status,
        stdout,
        stderr,
    } = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("start `{line}` (is it installed and on PATH?)"))?;
    if !status.success() {
        bail!(
            "`{line}` failed ({status}): {}",
            String::from_utf8_lossy(&stderr).trim()
        );
    }
    String::from_utf8(stdout).with_context(|| format!("`{line}` printed non UTF-8 output"))
}

/// Runs `cmd` quietly; `None` when it cannot start or exits non-zero. For
/// probes such as `bpf-linker --version` where failure means "not installed".
pub fn probe(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8(out.stdout).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_quotes_only_what_a_shell_would_split() {
        let mut cmd = Command::new("cargo");
        cmd.args(["test", "--", "it's here", ""])
            .env("RUSTFLAGS", "-L /x -C a=b");
        assert_eq!(
            display(&cmd),
            r"RUSTFLAGS='-L /x -C a=b' cargo test -- 'it'\''s here' ''"
        );
    }
}
