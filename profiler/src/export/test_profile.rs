//! A small hand-made [`Profile`] shared by the writers' tests: kernel,
//! native (with an inline chain), managed (one method in two JIT tiers),
//! unsymbolized and synthetic frames, and hostile names.

use std::sync::Arc;

use crate::profile::{
    Frame, FrameKind, InlinedFunction, Label, LabelValue, Module, Profile, ProfileSample,
    ValueType, label_keys,
};

pub(crate) const KERNEL_LEAF: u32 = 0;
pub(crate) const KERNEL_ENTRY: u32 = 1;
pub(crate) const LIBC_WRITE: u32 = 2;
pub(crate) const SPIN_TIER1: u32 = 3;
pub(crate) const SPIN_QUICK: u32 = 4;
pub(crate) const MAIN: u32 = 5;
pub(crate) const CORECLR_UNKNOWN: u32 = 6;
pub(crate) const TRUNCATED: u32 = 7;
pub(crate) const HOSTILE: u32 = 8;

pub(crate) const SPIN: &str = "int64 [Hot] Hot::Spin(int64)";
pub(crate) const SPIN_TIER1_SYSTEM: &str = "int64 [Hot] Hot::Spin(int64)[OptimizedTier1]";
pub(crate) const SPIN_QUICK_SYSTEM: &str = "int64 [Hot] Hot::Spin(int64)[QuickJitted]";
pub(crate) const MAIN_NAME: &str = "void [App] App::Main(string[])";
/// The names the symbolizer gives those methods ([`crate::symbolize::method_name`]).
pub(crate) const SPIN_SHORT: &str = "Hot.Spin";
pub(crate) const MAIN_SHORT: &str = "App.Main";

fn module(path: &str, start: u64, limit: u64, has_functions: bool) -> Arc<Module> {
    Arc::new(Module {
        path: path.into(),
        build_id: None,
        memory_start: start,
        memory_limit: limit,
        file_offset: 0,
        has_functions,
    })
}

fn frame(kind: FrameKind, name: &str, module: Option<&Arc<Module>>, address: u64) -> Frame {
    Frame {
        kind,
        name: name.into(),
        system_name: None,
        jit_tier: None,
        module: module.cloned(),
        address,
        file: None,
        line: 0,
        inlined: Vec::new(),
    }
}

fn labels(pid: i64, exe: Option<&str>, tid: i64) -> Vec<Label> {
    let mut labels = vec![Label::num(label_keys::PROCESS_PID, pid)];
    if let Some(exe) = exe {
        labels.push(Label::str(label_keys::PROCESS_EXECUTABLE_NAME, exe));
    }
    labels.push(Label::num(label_keys::THREAD_ID, tid));
    labels
}

/// The shared test profile. Sample types `[samples/count, cpu/nanoseconds]`.
pub(crate) fn profile() -> Profile {
    let kernel = module(
        "[kernel.kallsyms]",
        0xffff_ffff_8100_0000,
        0xffff_ffff_8200_0000,
        true,
    );
    let libc = Arc::new(Module {
        path: "/usr/lib/x86_64-linux-gnu/libc.so.6".into(),
        build_id: Some("c4bd5b2aee7fd2b6dc15b64a4f7a3ba2e8b8a8e1".into()),
        memory_start: 0x7f00_0000_0000,
        memory_limit: 0x7f00_0010_0000,
        file_offset: 0x28000,
        has_functions: true,
    });
    let jit = module("[jit]", 0x7f36_8400_0000, 0x7f36_8500_0000, true);
    let coreclr = module(
        "/usr/share/dotnet/shared/Microsoft.NETCore.App/8.0.4/libcoreclr.so",
        0x7f40_0000_0000,
        0x7f40_0040_0000,
        false,
    );

    let mut libc_write = frame(
        FrameKind::Native,
        "__GI___libc_write",
        Some(&libc),
        0x7f00_0000_1000,
    );
    libc_write.file = Some("../sysdeps/unix/sysv/linux/write.c".into());
    libc_write.line = 26;
    libc_write.inlined = vec![InlinedFunction {
        name: "__write_nocancel".into(),
        file: Some("write_nocancel.c".into()),
        line: 10,
    }];

    let mut spin_tier1 = frame(FrameKind::Managed, SPIN_SHORT, Some(&jit), 0x7f36_84c1_2170);
    spin_tier1.system_name = Some(SPIN_TIER1_SYSTEM.into());
    spin_tier1.jit_tier = Some("OptimizedTier1".into());
    spin_tier1.file = Some("Hot".into());
    let mut spin_quick = frame(FrameKind::Managed, SPIN_SHORT, Some(&jit), 0x7f36_84b0_0100);
    spin_quick.system_name = Some(SPIN_QUICK_SYSTEM.into());
    spin_quick.jit_tier = Some("QuickJitted".into());
    spin_quick.file = Some("Hot".into());
    let mut main = frame(FrameKind::Managed, MAIN_SHORT, Some(&jit), 0x7f36_84a0_0010);
    main.system_name = Some(MAIN_NAME.into());
    main.file = Some("App".into());

    let frames = vec![
        frame(
            FrameKind::Kernel,
            "do_syscall_64",
            Some(&kernel),
            0xffff_ffff_8100_0100,
        ),
        frame(
            FrameKind::Kernel,
            "entry_SYSCALL_64",
            Some(&kernel),
            0xffff_ffff_8100_0200,
        ),
        libc_write,
        spin_tier1,
        spin_quick,
        main,
        frame(
            FrameKind::Unknown,
            "libcoreclr.so+0x1234",
            Some(&coreclr),
            0x7f40_0000_1234,
        ),
        Frame::synthetic("[truncated]"),
        frame(
            FrameKind::Native,
            "evil;name\nwith\r\tcontrols",
            Some(&libc),
            0x7f00_0000_2000,
        ),
    ];

    let mut s0_labels = labels(42, Some("dotnet"), 43);
    s0_labels.push(Label::str(label_keys::THREAD_NAME, ".NET TP Worker"));
    let mut s2_labels = labels(7, Some("my;app\n"), 7);
    s2_labels.push(Label {
        key: "lock.wait".into(),
        value: LabelValue::Num {
            value: 5,
            unit: Some("milliseconds".into()),
        },
    });
    let samples = vec![
        ProfileSample {
            stack: vec![KERNEL_LEAF, KERNEL_ENTRY, LIBC_WRITE, SPIN_TIER1, MAIN],
            values: vec![2, 20_000_000],
            labels: s0_labels,
        },
        ProfileSample {
            stack: vec![SPIN_QUICK, MAIN],
            values: vec![1, 10_000_000],
            labels: labels(42, Some("dotnet"), 44),
        },
        ProfileSample {
            stack: vec![HOSTILE, CORECLR_UNKNOWN, TRUNCATED],
            values: vec![1, 10_000_000],
            labels: s2_labels,
        },
        ProfileSample {
            stack: vec![SPIN_TIER1, MAIN],
            values: vec![3, 30_000_000],
            labels: labels(42, Some("dotnet"), 43),
        },
        ProfileSample {
            stack: vec![MAIN],
            values: vec![1, 10_000_000],
            labels: labels(99, None, 99),
        },
    ];

    Profile {
        sample_types: vec![
            ValueType::new("samples", "count"),
            ValueType::new("cpu", "nanoseconds"),
        ],
        default_sample_type: Some(1),
        period_type: Some(ValueType::new("cpu", "nanoseconds")),
        period: 10_101_010,
        start_unix_ns: 1_700_000_000_000_000_000,
        duration_ns: 5_000_000_000,
        frames,
        samples,
        comments: vec!["clrbpf test".to_owned()],
        main_module: None,
    }
}
