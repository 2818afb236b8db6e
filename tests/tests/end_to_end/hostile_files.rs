//! Files a target maps, built to hurt a root profiler (issue 33, defects 2
//! and 4), against the release binary with the real BPF programs; the
//! attackers are unprivileged fakes (`fakes/hostile_files.py`, uid 65534):
//!
//! - a sparse 12 KiB `libcoreclr.so` whose `.dynsym` claims 4 GiB, in a
//!   file of 1 TiB apparent size: `record -a` reads none of it (refused
//!   and counted), ends on time and stays small;
//! - a mapped `libcoreclr.so` whose directory is swapped, after the
//!   mapping, for a symlink to a root-only directory holding a file of the
//!   same name and a FIFO: nothing in that directory is opened (inotify
//!   sees every open, and an open of the FIFO would block), since the file
//!   read is the one mapped (`/proc/PID/map_files`).

use std::{
    ffi::OsString,
    os::unix::fs::{PermissionsExt as _, chown},
    path::Path,
    time::Duration,
};

use clrbpf_integration_tests::{
    Env, Measured, TempDir, attackers, file_watch::FileWatch, run_measured,
};

/// The attackers' uid.
const USER: u32 = 65534;
const MIB: u64 = 1 << 20;

/// `clrbpf record -a -d SECONDS -o OUT`, measured ([`run_measured`]);
/// it must succeed.
fn record_all(env: &Env, seconds: &str, out: &Path, timeout: Duration) -> Measured {
    let args: Vec<OsString> = vec![
        "record".into(),
        "-a".into(),
        "-d".into(),
        seconds.into(),
        "-o".into(),
        out.into(),
    ];
    let run = run_measured(env, &args, timeout);
    assert!(run.status.success(), "clrbpf failed: {}", run.stderr);
    run
}

/// The counts of the summary's "target files refused" line, 0 without one.
fn refused(stderr: &str) -> (u64, u64, u64) {
    let Some(line) = stderr
        .lines()
        .find(|l| l.starts_with("clrbpf: target files refused: "))
    else {
        return (0, 0, 0);
    };
    let n = |word: &str| clrbpf_integration_tests::number_before(line, word);
    (
        n(" not regular"),
        n(" swapped since"),
        n(" libcoreclr.so over"),
    )
}

#[test]
fn a_sparse_libcoreclr_with_a_4_gib_dynsym_is_refused_unread() {
    let env = Env::privileged();
    let dir = TempDir::new("hostile-files-sparse");
    let work = attackers::attacker_dir(&dir, "sparse");
    let fake = attackers::hostile_files(&["sparse".into(), work.into_os_string(), "60".into()]);
    let run = record_all(&env, "10", &dir.join("out.pb.gz"), Duration::from_secs(40));
    assert!(
        run.took < Duration::from_secs(15),
        "record -a -d 10 took {:?} beside the fake",
        run.took
    );
    assert!(
        run.peak_rss < 300 * MIB,
        "peaked at {} MiB beside a 4 GiB .dynsym",
        run.peak_rss / MIB
    );
    let (_, _, images) = refused(&run.stderr);
    assert!(
        images >= 1,
        "the fake's libcoreclr.so was not refused:\n{}",
        run.stderr
    );
    drop(fake);
}

#[test]
fn a_directory_swapped_after_the_mapping_leads_root_nowhere() {
    let env = Env::privileged();
    let dir = TempDir::new("hostile-files-swap");
    let work = attackers::attacker_dir(&dir, "attacker");
    let real = work.join("real");
    std::fs::create_dir_all(&real).expect("mkdir");
    chown(&real, Some(USER), Some(USER)).expect("chown");
    // Any ELF file the attacker can map, under the runtime's name.
    std::fs::copy("/bin/true", real.join("libcoreclr.so")).expect("copy");
    chown(real.join("libcoreclr.so"), Some(USER), Some(USER)).expect("chown");
    // Root's own directory: a file of the same name, and a FIFO an open
    // would block on.
    let secret = dir.join("secret");
    std::fs::create_dir_all(&secret).expect("mkdir");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    std::fs::copy("/bin/true", secret.join("libcoreclr.so")).expect("copy");
    let fifo = std::ffi::CString::new(secret.join("X.dll").into_os_string().into_encoded_bytes())
        .expect("path");
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");
    let watch = FileWatch::new(&secret, libc::IN_OPEN | libc::IN_ACCESS);
    let fake = attackers::hostile_files(&[
        "swap".into(),
        work.into_os_string(),
        secret.into_os_string(),
        "60".into(),
    ]);
    assert!(
        std::fs::symlink_metadata(&real)
            .expect("stat")
            .file_type()
            .is_symlink(),
        "the fake did not swap its directory"
    );
    let run = record_all(&env, "4", &dir.join("out.pb.gz"), Duration::from_secs(40));
    assert!(run.took < Duration::from_secs(15), "took {:?}", run.took);
    assert!(
        watch.take().is_empty(),
        "something under the root-only directory was opened:\n{}",
        run.stderr
    );
    drop(fake);
}
