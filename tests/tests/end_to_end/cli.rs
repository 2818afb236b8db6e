//! The argument rules of `record` and `agent` and the log output, through
//! the real binary: every refused invocation exits 2 with a message naming
//! the option and what to write instead, an accepted one gets past parsing,
//! a command that cannot run is refused before anything loads, and the logs
//! are JSON lines with `--log-format json` and free of colour codes on a
//! pipe. Only `json_logs_of_a_recording_are_json_lines` loads BPF programs
//! (one 1 s `record -a`); the rest end before anything is loaded.

use std::{
    ffi::OsStr,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use clrbpf_integration_tests::{BusyShell, Env, TempDir};

/// The exit code of a usage or configuration error.
const USAGE: i32 = 2;

/// A program that is not there: `record -- MISSING` is refused, which shows
/// that everything before `--` was accepted.
const MISSING: &str = "/no/such/clrbpf-test-command";

/// Runs the binary with `args` (and `envs`), without the caller's
/// `CLRBPF_*` settings, and returns what it printed.
fn clrbpf_with_env(env: &Env, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut command = Command::new(&env.clrbpf);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("CLRBPF_") {
            command.env_remove(key);
        }
    }
    command
        .args(args)
        .envs(envs.iter().map(|(k, v)| (OsStr::new(k), OsStr::new(v))))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command.output().expect("run clrbpf")
}

fn clrbpf(env: &Env, args: &[&str]) -> Output {
    clrbpf_with_env(env, args, &[])
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `args` exit 2, with a message that contains every one of `needles`, no
/// panic and no clap tip that would run `-1` as a command.
fn assert_refused(output: &Output, args: &[&str], needles: &[&str]) {
    let text = stderr(output);
    assert_eq!(
        output.status.code(),
        Some(USAGE),
        "{args:?} exits {:?}; stderr:\n{text}",
        output.status
    );
    for needle in needles {
        assert!(text.contains(needle), "{args:?}: no `{needle}` in:\n{text}");
    }
    assert!(
        !text.contains("panicked") && !text.contains("-- -1"),
        "{args:?}:\n{text}"
    );
}

fn refuse(env: &Env, args: &[&str], needles: &[&str]) {
    assert_refused(&clrbpf(env, args), args, needles);
}

/// `record ARGS -- MISSING`: the arguments were accepted, since what is
/// refused is the command.
fn accepted_by_record(env: &Env, args: &[&str]) {
    let mut all = vec!["record"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", MISSING]);
    refuse(env, &all, &["cannot run", MISSING]);
}

#[test]
fn negative_values_are_refused_by_name_and_never_run_as_a_command() {
    let env = Env::from_env();
    for (args, option) in [
        (&["record", "-d", "-1"][..], "--duration"),
        (&["record", "-F", "-1"], "--frequency"),
        (&["record", "-p", "-1"], "--pid"),
        (&["record", "--start-wait", "-5"], "--start-wait"),
        (
            &["record", "--exceptions-per-second", "-1"],
            "--exceptions-per-second",
        ),
        (
            &["record", "--memory-budget-mb", "-1"],
            "--memory-budget-mb",
        ),
        (
            &["record", "--off-cpu", "--off-cpu-min", "-1"],
            "--off-cpu-min",
        ),
        (&["agent", "--upload-interval", "-15"], "--upload-interval"),
        (&["agent", "--retention-size", "-1"], "--retention-size"),
        (&["agent", "--max-pull-seconds", "-1"], "--max-pull-seconds"),
        (&["agent", "-F", "-19"], "--frequency"),
    ] {
        refuse(&env, args, &[option]);
    }
    refuse(&env, &["record", "-d", "-1"], &["must not be negative"]);
    // Following clap's old tip runs nothing: `-1` is no command.
    refuse(&env, &["record", "-d", "--", "-1"], &["--duration"]);
    refuse(
        &env,
        &["record", "--", "-1"],
        &["`-1`", "options go before `--`"],
    );
    // --nice takes its negative values.
    accepted_by_record(&env, &["--nice", "-5"]);
}

#[test]
fn durations_take_seconds_units_and_fractions_in_record_and_agent() {
    let env = Env::from_env();
    for duration in ["30", "30s", "2m", "500ms", "2.5", "1m30s"] {
        accepted_by_record(&env, &["-a", "-d", duration]);
    }
    accepted_by_record(
        &env,
        &["--start-wait", "0", "--off-cpu", "--off-cpu-min", "500us"],
    );
    accepted_by_record(
        &env,
        &["--start-wait", "1m", "--wall", "--off-cpu-min", "2"],
    );
    for (bad, fix) in [
        ("0", "must be more than zero"),
        ("soon", "30s"),
        ("inf", "30s"),
        ("nan", "30s"),
        ("11y", "leave -d out"),
    ] {
        refuse(&env, &["record", "-d", bad], &["--duration", fix]);
    }
    refuse(
        &env,
        &["record", "--start-wait", "11m"],
        &["--start-wait", "from 0s to 10m"],
    );
    refuse(
        &env,
        &["record", "--off-cpu", "--off-cpu-min", "5s"],
        &["--off-cpu-min", "at most 4s"],
    );
    // The agent takes the same forms. Its configuration is checked before
    // anything loads: an unprotected pull endpoint is what is refused here,
    // so the durations before it were accepted.
    for interval in ["15", "15s", "1m", "1m30s"] {
        let args = [
            "agent",
            "--upload-interval",
            interval,
            "--grace-period",
            "30",
            "--retention",
            "2m",
            "--max-pull-seconds",
            "2m",
            "--enable-pull",
            "--listen",
            "0.0.0.0:7071",
        ];
        refuse(&env, &args, &["--http-token-file"]);
    }
    refuse(
        &env,
        &["agent", "--upload-interval", "2s"],
        &["--upload-interval", "from 5s to 5m"],
    );
    refuse(
        &env,
        &["agent", "--upload-interval", "7.5"],
        &["--upload-interval", "whole number of seconds"],
    );
}

#[test]
fn pid_lists_and_g_are_accepted() {
    let env = Env::from_env();
    accepted_by_record(&env, &["-g", "-a"]);
    // -p with a command is a conflict; a list is parsed before that.
    refuse(&env, &["record", "-p", "1,x"], &["--pid", "x"]);
    refuse(&env, &["record", "-p", "0"], &["--pid"]);
    refuse(&env, &["record", "-p", "1,,2"], &["--pid"]);
    // A list of pids that do not exist is refused after parsing, naming them.
    let output = clrbpf(
        &env,
        &[
            "record",
            "-g",
            "-p",
            "999999998,999999999",
            "-p",
            "999999997",
        ],
    );
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(USAGE), "{text}");
    assert!(
        !text.contains("--pid <PID>") && text.contains("99999999"),
        "the list was not parsed:\n{text}"
    );
    let help = String::from_utf8_lossy(&clrbpf(&env, &["record", "--help"]).stdout).into_owned();
    assert!(
        help.contains("-g") && help.contains("always recorded"),
        "{help}"
    );
}

#[test]
fn options_without_effect_or_in_conflict_are_refused() {
    let env = Env::from_env();
    for (args, named) in [
        (
            &["record", "--off-cpu-min", "2"][..],
            &["--off-cpu-min", "--off-cpu"][..],
        ),
        (
            &["record", "--off-cpu-max-stacks", "100"],
            &["--off-cpu-max-stacks", "--off-cpu"],
        ),
        (
            &["record", "--cache-dir", "/x", "--no-cache"],
            &["--no-cache", "--cache-dir"],
        ),
        (
            &[
                "record",
                "--frame-pointers-only",
                "--stack-copy-kib-per-second",
                "1",
            ],
            &["--frame-pointers-only", "--stack-copy-kib-per-second"],
        ),
        (
            &[
                "record",
                "--frame-pointers-only",
                "--unwind-table-memory-mb",
                "8",
            ],
            &["--frame-pointers-only", "--unwind-table-memory-mb"],
        ),
        (
            &["record", "--no-clr-events", "--exceptions-per-second", "5"],
            &["--no-clr-events", "--exceptions-per-second"],
        ),
        (
            &["record", "--no-clr-events", "--allocs-per-second", "5"],
            &["--no-clr-events"],
        ),
        (
            &["record", "--no-clr-events", "--alloc"],
            &["--no-clr-events", "--alloc"],
        ),
        (
            &["record", "--nice", "0", "--no-priority-boost"],
            &["--no-priority-boost", "--nice"],
        ),
        (&["record", "-q", "-v"], &["--quiet", "--verbose"]),
        (
            &["agent", "--off-cpu-min", "2"],
            &["--off-cpu-min", "--off-cpu"],
        ),
        (
            &["agent", "--cache-dir", "/x", "--no-cache"],
            &["--no-cache"],
        ),
    ] {
        refuse(&env, args, named);
    }
    // Defaults alone are no conflict, and --wall turns off-CPU on.
    accepted_by_record(
        &env,
        &["--no-cache", "--frame-pointers-only", "--no-clr-events"],
    );
    accepted_by_record(
        &env,
        &[
            "--wall",
            "--off-cpu-min",
            "2",
            "--off-cpu-max-stacks",
            "100",
        ],
    );
}

/// A command that cannot run is refused before anything is loaded: as a
/// user with no capabilities, the message is about the command, not about
/// privileges (those are checked first thing when loading), and it comes at
/// once, without the start wait.
#[test]
fn a_command_that_cannot_run_is_refused_before_anything_loads() {
    let env = Env::from_env();
    let started = Instant::now();
    for (program, needle) in [
        (MISSING, "no such executable file"),
        ("no-such-clrbpf-test-command", "not found on PATH"),
        ("/etc/passwd", "no such executable file"),
    ] {
        let args = [
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "--inh-caps",
            "-all",
            "--bounding-set",
            "-all",
            "--",
        ];
        let mut command = Command::new("setpriv");
        command
            .args(args)
            .arg(&env.clrbpf)
            .args([
                "--log-level",
                "debug",
                "record",
                "--start-wait",
                "10",
                "--",
                program,
            ])
            .stdin(Stdio::null());
        let output = command.output().expect("run setpriv");
        let shown = ["record", "--", program];
        assert_refused(&output, &shown, &["cannot run", program, needle]);
        let text = stderr(&output);
        assert!(
            !text.contains("CAP_BPF") && !text.contains("root"),
            "privileges were checked before the command:\n{text}"
        );
    }
    // Three refusals, none of which waited the 10 s start wait.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_bad_log_level_is_an_error_naming_the_accepted_levels() {
    let env = Env::from_env();
    for bad in ["bogus", "verbose", "warn,", "clrbpf=loud"] {
        refuse(
            &env,
            &["--log-level", bad, "ps"],
            &["--log-level", "off, error, warn, info, debug, trace"],
        );
    }
    for bad in ["verbose", "bogus"] {
        let output = clrbpf_with_env(&env, &["ps"], &[("CLRBPF_LOG", bad)]);
        assert_refused(&output, &["CLRBPF_LOG", bad], &["--log-level", "debug"]);
    }
    refuse(
        &env,
        &["--log-format", "xml", "ps"],
        &["--log-format", "text", "json"],
    );
    let output = clrbpf(&env, &["--log-level", "warn,clrbpf::agent=debug", "ps"]);
    assert!(output.status.success(), "{}", stderr(&output));
}

/// Every line of `text` is a JSON object with a level and a message or
/// fields; returns them.
fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {line}\nin:\n{text}"));
            assert!(
                value.get("level").is_some() && value.get("timestamp").is_some(),
                "no level or timestamp: {line}"
            );
            value
        })
        .collect()
}

#[test]
fn errors_in_json_mode_are_json_lines_and_text_has_no_colour_on_a_pipe() {
    let env = Env::from_env();
    let output = clrbpf(&env, &["--log-format", "json", "record", "--", MISSING]);
    assert_eq!(output.status.code(), Some(USAGE));
    let lines = json_lines(&stderr(&output));
    assert!(
        lines.iter().any(|line| {
            line["level"] == "ERROR" && line["error"].as_str().is_some_and(|e| e.contains(MISSING))
        }),
        "{lines:?}"
    );
    // Text on a pipe: no escape codes, in logs or in errors.
    let output = clrbpf(&env, &["--log-level", "trace", "record", "--", MISSING]);
    let text = stderr(&output);
    assert!(text.contains(MISSING), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape codes on a pipe:\n{text:?}"
    );
}

/// The one test here that loads BPF programs: a 1 s whole-host recording
/// with debug logs, all of them JSON lines.
#[test]
fn json_logs_of_a_recording_are_json_lines() {
    let env = Env::privileged();
    let _busy = BusyShell::start();
    let dir = TempDir::new("cli-json-logs");
    let out = dir.join("profile.pb.gz");
    let out = out.to_str().expect("utf-8 path");
    let output = clrbpf(
        &env,
        &[
            "--log-format",
            "json",
            "--log-level",
            "debug",
            "record",
            "-q",
            "-a",
            "-d",
            "1",
            "-o",
            out,
        ],
    );
    let text = stderr(&output);
    assert!(output.status.success(), "{text}");
    let lines = json_lines(&text);
    assert!(!lines.is_empty(), "no log line at debug");
    assert!(!text.contains('\u{1b}'), "{text:?}");
    assert!(
        lines.iter().any(|line| line["level"] == "DEBUG"),
        "{lines:?}"
    );
}
