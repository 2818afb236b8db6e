//! Frame names as .NET users read them (issue 13, part 4): `go tool pprof`
//! on a real profile of a launched .NET 8 and .NET Core 3.1 workload shows
//! `Type.Method` names, whole managed stacks, and the application as the
//! profile's `File:`; `--frame-names full` brings the runtime's signatures
//! back in every format.

use std::time::Duration;

use clrbpf_integration_tests::{
    Env, Runtime, TempDir, assert_success, go_pprof, parse_folded, read_profile, run_clrbpf, string,
};

const TIMEOUT: Duration = Duration::from_secs(120);

/// `clrbpf record FLAGS -o DIR/NAME -- dotnet Hot.dll 3`; returns the
/// output path.
fn record_hot(
    env: &Env,
    dir: &TempDir,
    runtime: Runtime,
    name: &str,
    flags: &[&str],
) -> std::path::PathBuf {
    let output_path = dir.join(name);
    let mut args: Vec<String> = ["record", "-F", "499"]
        .iter()
        .chain(flags)
        .map(|s| (*s).to_owned())
        .collect();
    args.extend(["-o".to_owned(), output_path.to_string_lossy().into_owned()]);
    args.push("--".to_owned());
    args.extend(env.workload_command(runtime, "Hot", &["3"]));
    let output = run_clrbpf(env, &args, dir.path(), TIMEOUT);
    assert_success(&output);
    output_path
}

/// The blocks of `go tool pprof -traces`, each a list of frame names, leaf
/// first.
fn traces(report: &str) -> Vec<Vec<String>> {
    report
        .split("-----------+")
        .skip(1)
        .map(|block| {
            block
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let line = line.trim();
                    // The first line of a trace starts with its value.
                    let name = match line.split_once(char::is_whitespace) {
                        Some((value, rest))
                            if value.ends_with('s')
                                && value.starts_with(|c: char| c.is_ascii_digit()) =>
                        {
                            rest.trim()
                        }
                        _ => line,
                    };
                    (!name.is_empty() && !name.starts_with("bytes:")).then(|| name.to_owned())
                })
                .collect()
        })
        .collect()
}

#[test]
fn go_tool_pprof_shows_short_names_whole_stacks_and_the_application() {
    let env = Env::privileged();
    for runtime in [Runtime::Net8, Runtime::NetCore31] {
        let dir = TempDir::new("names");
        let path = record_hot(&env, &dir, runtime, "p.pb.gz", &[]);

        let top = go_pprof(&path, "-top");
        assert!(
            top.lines()
                .any(|line| line.trim_end().ends_with(" Hot.Spin")),
            "{runtime:?}: -top does not list Hot.Spin:\n{top}"
        );
        assert!(
            !top.contains("Hot::"),
            "{runtime:?}: a full name in -top:\n{top}"
        );
        assert!(
            top.lines().any(|line| line.trim() == "File: Hot.dll"),
            "{runtime:?}: the File: line does not name the application:\n{top}"
        );

        let report = go_pprof(&path, "-traces");
        let whole = traces(&report).iter().any(|trace| {
            let spin = trace.iter().position(|f| f == "Hot.Spin");
            let main = trace.iter().position(|f| f == "Hot.Main");
            matches!((spin, main), (Some(s), Some(m)) if s < m)
        });
        assert!(
            whole,
            "{runtime:?}: no trace from Hot.Spin to Hot.Main:\n{report}"
        );

        // The function keeps the signature and the assembly.
        let profile = read_profile(&path);
        let spin = profile
            .function
            .iter()
            .find(|f| string(&profile, f.name) == "Hot.Spin")
            .unwrap_or_else(|| panic!("{runtime:?}: no Hot.Spin function"));
        let system_name = string(&profile, spin.system_name);
        assert!(
            system_name.starts_with("uint64 [Hot] Hot::Spin(uint64)"),
            "{runtime:?}: system_name {system_name}"
        );
        assert_eq!(string(&profile, spin.filename), "Hot");
        let app = &profile.mapping[0];
        assert!(
            string(&profile, app.filename).ends_with("/Hot.dll"),
            "{runtime:?}: first mapping {}",
            string(&profile, app.filename)
        );
        assert!(
            app.memory_limit > app.memory_start,
            "{runtime:?}: Hot.dll is mapped"
        );
        // Native files are placed where they were mapped.
        let libc = profile
            .mapping
            .iter()
            .find(|m| string(&profile, m.filename).contains("libc.so"))
            .unwrap_or_else(|| panic!("{runtime:?}: no libc mapping"));
        assert!(libc.memory_limit > libc.memory_start && libc.build_id != 0);
    }
}

#[test]
fn frame_names_full_keeps_the_signatures_in_folded_stacks() {
    let env = Env::privileged();
    let dir = TempDir::new("names-full");
    let path = record_hot(
        &env,
        &dir,
        Runtime::Net8,
        "p.folded",
        &["--frame-names", "full"],
    );
    let text = std::fs::read_to_string(&path).expect("read the folded stacks");
    let stacks = parse_folded(&text);
    let frames = || stacks.iter().flat_map(|(frames, _)| frames.iter());
    assert!(
        frames().any(|f| f.contains("Hot::Spin(uint64)")),
        "no full name in:\n{text}"
    );
    assert!(
        !frames().any(|f| f.contains("Hot.Spin")),
        "a short name in:\n{text}"
    );
}
