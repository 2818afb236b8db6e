//! The command line's rules, checked with clap's `try_parse_from`.

#[test]
fn a_bad_sink_url_is_never_echoed_with_its_credentials() {
    for bad in [
        "http://user:s3cret@ho st:4040/?token=t0ken",
        "ftp://user:s3cret@host/?token=t0ken",
        "http://user:s3cret@host:4040/push?token=t0ken",
    ] {
        for flag in ["--pyroscope-url", "--otlp-url"] {
            let error = Cli::try_parse_from(["clrbpf", "agent", flag, bad])
                .expect_err("a bad URL is refused");
            let text = error.to_string();
            assert!(
                !text.contains("s3cret") && !text.contains("t0ken") && !text.contains("user"),
                "{text}"
            );
            assert!(text.contains("[redacted]") && text.contains(flag), "{text}");
        }
    }
}

use clap::CommandFactory;

use super::*;

#[test]
fn cli_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn record_parses_perf_like_arguments() {
    let cli = Cli::try_parse_from([
        "clrbpf", "record", "-p", "1", "-p", "2", "-F", "499", "-d", "2.5", "-o", "x.svg", "--",
        "dotnet", "a.dll",
    ])
    .expect("valid arguments");
    let Command::Record(args) = cli.command else {
        panic!("not record")
    };
    assert_eq!(args.pids, vec![1, 2]);
    assert_eq!(args.frequency, 499);
    assert_eq!(args.duration, Some(std::time::Duration::from_millis(2500)));
    assert_eq!(
        args.command,
        vec![OsString::from("dotnet"), OsString::from("a.dll")]
    );
    assert_eq!(args.frame_names, FrameNames::Short);
    assert!(Cli::try_parse_from(["clrbpf", "record", "-F", "0"]).is_err());
    let cli = Cli::try_parse_from(["clrbpf", "record", "--frame-names", "full"])
        .expect("valid arguments");
    let Command::Record(args) = cli.command else {
        panic!("not record")
    };
    assert_eq!(args.frame_names, FrameNames::Full);
}

fn agent(args: &[&str]) -> Result<AgentArgs, clap::Error> {
    let cli = Cli::try_parse_from(["clrbpf", "agent"].iter().chain(args))?;
    match cli.command {
        Command::Agent(args) => Ok(*args),
        _ => panic!("not agent"),
    }
}

fn agent_error(args: &[&str]) -> String {
    agent(args).expect_err("refused").to_string()
}

#[test]
fn agent_defaults() {
    let args = agent(&[]).expect("defaults");
    assert_eq!(args.frequency, 19);
    assert_eq!(args.upload_interval, std::time::Duration::from_secs(15));
    assert_eq!(
        args.runtime_counters_interval,
        std::time::Duration::from_secs(5)
    );
    assert_eq!(args.grace_period, std::time::Duration::from_secs(10));
    assert_eq!(args.retention, std::time::Duration::from_secs(24 * 3600));
    assert_eq!(args.retention_size, 1 << 30);
    assert_eq!(args.listen, "127.0.0.1:7071".parse().unwrap());
    assert_eq!(args.max_pull_seconds, 60);
    assert_eq!(args.max_services, 256);
    assert!(!args.enable_pull && args.http_token_file.is_none());
    assert!(args.pyroscope_url.is_none() && args.otlp_url.is_none());
}

#[test]
fn agent_parses_durations_sizes_urls_and_selections() {
    let args = agent(&[
        "--upload-interval",
        "1m",
        "--grace-period",
        "500ms",
        "--retention",
        "2h",
        "--retention-size",
        "500MB",
        "--pyroscope-url",
        "https://profiles.example.com/",
        "--otlp-url",
        "http://collector:4318",
        "--exe",
        "dotnet",
        "--container-id",
        "containerd://0123456789ABcdef",
        "--k8s-namespace",
        "shop",
        "-F",
        "49",
    ])
    .expect("valid");
    assert_eq!(args.upload_interval, std::time::Duration::from_secs(60));
    assert_eq!(args.grace_period, std::time::Duration::from_millis(500));
    assert_eq!(args.retention_size, 500_000_000);
    assert_eq!(
        args.pyroscope_url.as_deref(),
        Some("https://profiles.example.com")
    );
    assert_eq!(args.otlp_url.as_deref(), Some("http://collector:4318"));
    assert_eq!(args.container_ids, ["0123456789abcdef"]);
    assert_eq!(args.k8s_namespaces, ["shop"]);
    assert_eq!(args.frequency, 49);
}

#[test]
fn static_labels_are_key_value_pairs_clrbpf_does_not_set_itself() {
    let args =
        agent(&["--label", "cluster=prod-eu", "--label", "environment=a=b"]).expect("labels");
    assert_eq!(
        args.labels,
        [
            ("cluster".to_owned(), "prod-eu".to_owned()),
            ("environment".to_owned(), "a=b".to_owned())
        ]
    );
    for bad in [
        "cluster",
        "=x",
        "Cluster=x",
        "service_name=x",
        "k8s.pod.name=x",
        "pod=x",
        "x=",
    ] {
        let message = agent_error(&["--label", bad]);
        assert!(message.contains("--label"), "{bad}: {message}");
    }
    let twice = agent(&["--label", "a=1", "--label", "a=2"]).expect("parses");
    let error = crate::agent::config::AgentConfig::from_args(twice, None).expect_err("twice");
    assert!(error.to_string().contains("twice"), "{error}");
}

#[test]
fn malformed_agent_config_is_refused_naming_the_option() {
    for (args, option) in [
        (&["--upload-interval", "4s"][..], "--upload-interval"),
        (&["--upload-interval", "6m"], "--upload-interval"),
        (&["--upload-interval", "15x"], "--upload-interval"),
        (
            &["--runtime-counters-interval", "500ms"],
            "--runtime-counters-interval",
        ),
        (
            &["--runtime-counters-interval", "2m"],
            "--runtime-counters-interval",
        ),
        (&["--upload-interval", "5500ms"], "--upload-interval"),
        (&["--grace-period", "0s"], "--grace-period"),
        (&["--retention", "soon"], "--retention"),
        (&["--retention-size", "12XB"], "--retention-size"),
        (&["--pyroscope-url", "ftp://x"], "--pyroscope-url"),
        (&["--otlp-url", "not a url"], "--otlp-url"),
        (&["--container-id", "xyz"], "--container-id"),
        (&["--container-id", "0123456789a"], "--container-id"),
        (&["--k8s-namespace", "Shop_1"], "--k8s-namespace"),
        (&["--listen", "localhost"], "--listen"),
        (&["--max-pull-seconds", "0"], "--max-pull-seconds"),
        (&["--http-token-file", "/t"], "--enable-pull"),
        (&["-F", "0"], "--frequency"),
        (&["--pyroscope-tenant-id", "t"], "--pyroscope-url"),
    ] {
        let message = agent_error(args);
        assert!(message.contains(option), "{args:?}: {message}");
    }
    assert_eq!(parse_size("2GiB"), Ok(2 << 30));
    assert!(parse_size("0").is_err());
    assert!(parse_size("99999999999999999999GB").is_err());
}

fn record(args: &[&str]) -> Result<RecordArgs, clap::Error> {
    let cli = Cli::try_parse_from(["clrbpf", "record"].iter().chain(args))?;
    match cli.command {
        Command::Record(args) => Ok(*args),
        _ => panic!("not record"),
    }
}

fn record_error(args: &[&str]) -> String {
    record(args).expect_err("refused").to_string()
}

#[test]
fn durations_take_plain_seconds_units_and_fractions_everywhere() {
    use std::time::Duration;
    for (text, expected) in [
        ("30", Duration::from_secs(30)),
        ("30s", Duration::from_secs(30)),
        ("2m", Duration::from_secs(120)),
        ("500ms", Duration::from_millis(500)),
        ("2.5", Duration::from_millis(2500)),
        ("1m30s", Duration::from_secs(90)),
    ] {
        let args = record(&["-d", text]).expect("a duration");
        assert_eq!(args.duration, Some(expected), "-d {text}");
    }
    let args = agent(&[
        "--upload-interval",
        "15",
        "--grace-period",
        "30",
        "--retention",
        "2",
    ])
    .expect("plain seconds");
    assert_eq!(args.upload_interval, Duration::from_secs(15));
    assert_eq!(args.grace_period, Duration::from_secs(30));
    assert_eq!(args.retention, Duration::from_secs(2));
    let args = agent(&[
        "--max-pull-seconds",
        "2m",
        "--runtime-counters-interval",
        "10",
    ])
    .expect("units");
    assert_eq!(args.max_pull_seconds, 120);
    assert_eq!(args.runtime_counters_interval, Duration::from_secs(10));
    let args = record(&["--start-wait", "0", "--off-cpu", "--off-cpu-min", "500us"]).expect("zero");
    assert_eq!(args.start_wait, Duration::ZERO);
    assert_eq!(args.sampling.off_cpu_min, Duration::from_micros(500));
    let args = record(&["--start-wait", "1m", "--wall", "--off-cpu-min", "2"]).expect("ms");
    assert_eq!(args.start_wait, Duration::from_secs(60));
    // A plain --off-cpu-min is milliseconds, as before.
    assert_eq!(args.sampling.off_cpu_min, Duration::from_millis(2));
    for bad in ["0", "soon", "inf", "nan", "11y"] {
        let message = record_error(&["-d", bad]);
        assert!(message.contains("--duration"), "-d {bad}: {message}");
    }
    assert!(record_error(&["--start-wait", "11m"]).contains("from 0s to 10m"));
    assert!(record_error(&["--off-cpu", "--off-cpu-min", "5s"]).contains("at most 4s"));
}

#[test]
fn negative_numbers_are_refused_by_name_and_never_taken_for_a_command() {
    for (args, option) in [
        (&["-d", "-1"][..], "--duration"),
        (&["-F", "-1"], "--frequency"),
        (&["-p", "-1"], "--pid"),
        (&["--start-wait", "-5"], "--start-wait"),
        (
            &["--exceptions-per-second", "-1"],
            "--exceptions-per-second",
        ),
        (&["--memory-budget-mb", "-1"], "--memory-budget-mb"),
        (&["--off-cpu", "--off-cpu-min", "-1"], "--off-cpu-min"),
    ] {
        let message = record_error(args);
        assert!(
            message.contains(option) && !message.contains("-- -1"),
            "{args:?}: {message}"
        );
        assert_eq!(record(args).expect_err("refused").exit_code(), 2);
    }
    for (args, option) in [
        (&["--upload-interval", "-15"][..], "--upload-interval"),
        (&["--retention-size", "-1"], "--retention-size"),
        (&["--max-pull-seconds", "-1"], "--max-pull-seconds"),
        (&["-F", "-19"], "--frequency"),
    ] {
        let message = agent_error(args);
        assert!(message.contains(option), "{args:?}: {message}");
    }
    assert!(record_error(&["-d", "-1"]).contains("must not be negative"));
    // --nice still takes its negative values.
    assert_eq!(record(&["--nice", "-5"]).expect("nice").nice, -5);
}

#[test]
fn pids_take_a_list_and_g_is_accepted() {
    let args = record(&["-p", "1,2", "-p", "3", "-g"]).expect("a list");
    assert_eq!(args.pids, [1, 2, 3]);
    assert!(args.call_graph);
    assert!(record_error(&["-p", "1,x"]).contains("--pid"));
    assert!(record_error(&["-p", "0"]).contains("--pid"));
    let help = Cli::command()
        .find_subcommand_mut("record")
        .expect("record")
        .render_long_help()
        .to_string();
    assert!(
        help.contains("-g") && help.contains("always recorded"),
        "{help}"
    );
}

#[test]
fn options_without_effect_or_in_conflict_are_refused() {
    for (args, named) in [
        (&["--off-cpu-min", "2"][..], "--off-cpu-min"),
        (&["--off-cpu-max-stacks", "100"], "--off-cpu-max-stacks"),
        (&["--cache-dir", "/x", "--no-cache"], "--no-cache"),
        (
            &["--frame-pointers-only", "--stack-copy-kib-per-second", "1"],
            "--frame-pointers-only",
        ),
        (
            &["--frame-pointers-only", "--unwind-table-memory-mb", "8"],
            "--frame-pointers-only",
        ),
        (
            &["--no-clr-events", "--exceptions-per-second", "5"],
            "--no-clr-events",
        ),
        (
            &["--no-clr-events", "--allocs-per-second", "5"],
            "--no-clr-events",
        ),
        (&["--no-clr-events", "--alloc"], "--no-clr-events"),
        (
            &["--nice", "0", "--no-priority-boost"],
            "--no-priority-boost",
        ),
        (&["-q", "-v"], "--quiet"),
    ] {
        let message = record_error(args);
        assert!(message.contains(named), "{args:?}: {message}");
    }
    assert!(agent_error(&["--off-cpu-min", "2"]).contains("--off-cpu-min"));
    assert!(agent_error(&["--cache-dir", "/x", "--no-cache"]).contains("--no-cache"));
    // Their defaults alone are no conflict, and --wall turns off-CPU on.
    record(&["--no-cache", "--frame-pointers-only", "--no-clr-events"]).expect("defaults");
    record(&[
        "--wall",
        "--off-cpu-min",
        "2",
        "--off-cpu-max-stacks",
        "100",
    ])
    .expect("wall");
    record(&["--off-cpu", "--wall", "--off-cpu-min", "2"]).expect("both");
}

#[test]
fn a_bad_log_level_is_refused_naming_the_accepted_values() {
    for good in [
        "warn",
        "DEBUG",
        "off",
        "warn,clrbpf::pipeline::driver=debug",
        "warn,clrbpf::table_times=info",
    ] {
        let cli = Cli::try_parse_from(["clrbpf", "--log-level", good, "ps"]).expect(good);
        assert_eq!(cli.log_level, good);
        tracing_subscriber::EnvFilter::try_new(&cli.log_level).expect("EnvFilter takes it");
    }
    for bad in [
        "bogus",
        "verbose",
        "",
        "warn,",
        "clrbpf=loud",
        "=info",
        "a b=info",
    ] {
        let message = Cli::try_parse_from(["clrbpf", "ps", "--log-level", bad])
            .expect_err(bad)
            .to_string();
        assert!(
            message.contains("--log-level")
                && message.contains("off, error, warn, info, debug, trace"),
            "{bad}: {message}"
        );
    }
    let cli = Cli::try_parse_from(["clrbpf", "--log-format", "json", "ps"]).expect("json");
    assert_eq!(cli.log_format, LogFormat::Json);
    let message = Cli::try_parse_from(["clrbpf", "--log-format", "xml", "ps"])
        .expect_err("xml")
        .to_string();
    assert!(
        message.contains("text") && message.contains("json"),
        "{message}"
    );
}

#[test]
fn short_help_shows_the_basics_and_long_help_the_knobs_and_examples() {
    let mut command = Cli::command();
    // Built, as at parse time, so the global options reach the subcommand.
    command.build();
    let record = command.find_subcommand_mut("record").expect("record");
    let short = record.render_help().to_string();
    let long = record.render_long_help().to_string();
    for basic in [
        "--pid",
        "--all-cpus",
        "--frequency",
        "--duration",
        "--output",
        "--off-cpu",
    ] {
        assert!(short.contains(basic), "-h lacks {basic}:\n{short}");
    }
    for knob in [
        "--unwind-table-memory-mb",
        "--nice",
        "--start-wait",
        "--cache-dir",
    ] {
        assert!(!short.contains(knob), "-h shows {knob}:\n{short}");
        assert!(long.contains(knob), "--help lacks {knob}");
    }
    assert!(
        short.lines().count() < 60,
        "-h is {} lines:\n{short}",
        short.lines().count()
    );
    for heading in [
        "What to collect:",
        "Output:",
        "Tuning:",
        "Global options:",
        "Examples:",
    ] {
        assert!(long.contains(heading), "--help lacks {heading}");
    }
    assert!(long.contains("docs/record.md") && short.contains("--help"));
    let position = |text: &str| long.find(text).expect(text);
    assert!(position("--pid") < position("Tuning:") && position("Tuning:") < position("Examples:"));
}
