//! The short name of a managed method, as .NET users read it in Visual
//! Studio, PerfView or dotnet-trace: `Namespace.Type.Method`, from the full
//! name the runtime writes in perf maps and jitdumps
//! (`int64 [Hot] Hot::Spin(int64)`) or that `clrbpf_parse::events` spells
//! the same way from a MethodLoad event (`int64 Hot::Spin(int64)`). Part of
//! the `symbolize/` stage: [`super::managed::ManagedSymbol`] keeps both
//! forms, the frame shows the short one and the pprof `system_name` the
//! full one.
//!
//! The runtime's form (`MethodDesc::GetFullMethodInfo` via
//! `PerfMap::LogMethod`, the same text on .NET Core 3.1 and .NET 8) is
//! `[instance ]RETURN [ASSEMBLY] TYPE::METHOD(PARAMETERS)`:
//! 1. the `::` outside any bracket separates the type from the method; the
//!    return type, assembly and parameters never hold one;
//! 2. the type is the word before it (after the last blank outside
//!    brackets): nested types are already joined with `+`, generic
//!    instantiations kept as written (`List`1[System.__Canon]`);
//! 3. the method runs to the `(` of the parameter list, outside brackets
//!    (compiler-generated names such as `<Main>b__0_0` hold `<>`).
//!
//! A name without that shape (a runtime stub such as
//! `stub<3> AllocateTemporaryEntryPoints<PRECODE_STUB>`, or a hostile
//! name with unbalanced brackets) has no short form: the full name stays.

/// Where a full runtime method name splits, when it has the usual shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MethodName<'a> {
    /// `Namespace.Outer+Inner`, generic arguments included.
    pub type_name: &'a str,
    /// `Method`, `.ctor`, `<Main>b__0_0`.
    pub method: &'a str,
}

impl MethodName<'_> {
    /// `Namespace.Type.Method`.
    pub fn short(&self) -> String {
        let mut short = String::with_capacity(self.type_name.len() + 1 + self.method.len());
        short.push_str(self.type_name);
        short.push('.');
        short.push_str(self.method);
        short
    }
}

/// Splits a full runtime method name (without its `[Tier]` suffix) into
/// its type and method; `None` when it does not have the runtime's shape.
pub fn parse_method_name(full: &str) -> Option<MethodName<'_>> {
    let bytes = full.as_bytes();
    let mut depth = 0usize;
    let mut word_start = 0;
    let mut separator = None;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'[' | b'<' | b'(' => depth += 1,
            b']' | b'>' | b')' => depth = depth.checked_sub(1)?,
            b' ' if depth == 0 => word_start = i + 1,
            b':' if depth == 0 && bytes.get(i + 1) == Some(&b':') => {
                separator = Some(i);
                break;
            }
            _ => {}
        }
    }
    let separator = separator?;
    let type_name = &full[word_start..separator];
    let rest = &full[separator + 2..];
    let mut depth = 0usize;
    let mut method_end = rest.len();
    for (i, b) in rest.bytes().enumerate() {
        match b {
            b'(' if depth == 0 => {
                method_end = i;
                break;
            }
            b'[' | b'<' | b'(' => depth += 1,
            b']' | b'>' | b')' => depth = depth.checked_sub(1)?,
            _ => {}
        }
    }
    let method = &rest[..method_end];
    let well_formed = |part: &str| !part.is_empty() && !part.contains([' ', ':']);
    (well_formed(type_name) && well_formed(method)).then_some(MethodName { type_name, method })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbolize::managed::{assembly_of, split_tier};

    /// Real lines (the text after address and size) of the perf maps of
    /// .NET 8.0 and .NET Core 3.1 (`testdata/*.perf.map` of `profiler-parse/src/nettrace`,
    /// and `tests/workloads`-style programs run with perf maps enabled),
    /// and MethodLoad names as `clrbpf_parse::events::method_display_name` spells
    /// them: (line, short name, assembly).
    const CASES: &[(&str, &str, Option<&str>)] = &[
        // .NET 8
        (
            "int64 [Hot] Hot::Spin(int64)[OptimizedTier1]",
            "Hot.Spin",
            Some("Hot"),
        ),
        (
            "void [App] Demo.Worker::Main(string[])[QuickJitted]",
            "Demo.Worker.Main",
            Some("App"),
        ),
        (
            "void [App] Demo.Worker::.cctor()[QuickJitted]",
            "Demo.Worker..cctor",
            Some("App"),
        ),
        (
            "instance void [App] Demo.TooHotException::.ctor(string)[QuickJitted]",
            "Demo.TooHotException..ctor",
            Some("App"),
        ),
        (
            "instance !1& [System.Private.CoreLib] System.Collections.Generic.Dictionary`2[System.__Canon,System.__Canon]::FindValue(!0)[InstrumentedTierOptimized]",
            "System.Collections.Generic.Dictionary`2[System.__Canon,System.__Canon].FindValue",
            Some("System.Private.CoreLib"),
        ),
        (
            "instance int32 [System.Private.CoreLib] System.Collections.Generic.NonRandomizedStringEqualityComparer+OrdinalComparer::GetHashCode(string)[InstrumentedTierOptimized]",
            "System.Collections.Generic.NonRandomizedStringEqualityComparer+OrdinalComparer.GetHashCode",
            Some("System.Private.CoreLib"),
        ),
        (
            "instance string [System.Private.CoreLib] System.Span`1[System.Char]::ToString()[InstrumentedTierOptimized]",
            "System.Span`1[System.Char].ToString",
            Some("System.Private.CoreLib"),
        ),
        (
            "string [System.Private.CoreLib] System.Number::<UInt32ToDecStrForKnownSmallNumber>g__CreateAndCacheString|70_0(uint32)[InstrumentedTierOptimized]",
            "System.Number.<UInt32ToDecStrForKnownSmallNumber>g__CreateAndCacheString|70_0",
            Some("System.Private.CoreLib"),
        ),
        (
            "object [System.Private.CoreLib] dynamicClass::InvokeStub_EventAttribute.set_Level(object,System.Span`1 /* MT: 0x7f302e5a3de0 */<object>)[Optimized]",
            "dynamicClass.InvokeStub_EventAttribute.set_Level",
            Some("System.Private.CoreLib"),
        ),
        (
            "valuetype System.Buffers.OperationStatus [System.Private.CoreLib] System.Text.Unicode.Utf8Utility::TranscodeToUtf8(char*,int32,uint8*,int32,char*&,uint8*&)[InstrumentedTierOptimized]",
            "System.Text.Unicode.Utf8Utility.TranscodeToUtf8",
            Some("System.Private.CoreLib"),
        ),
        (
            "native uint [System.Private.CoreLib] System.Text.Ascii::NarrowUtf16ToAscii(char*,uint8*,native uint)[InstrumentedTierOptimized]",
            "System.Text.Ascii.NarrowUtf16ToAscii",
            Some("System.Private.CoreLib"),
        ),
        (
            "instance !0 [Names] Shop.Orders.Outer+Box`1[System.Int32]::Get()[QuickJitted]",
            "Shop.Orders.Outer+Box`1[System.Int32].Get",
            Some("Names"),
        ),
        (
            "int64 [Names] Shop.Orders.Outer+Inner::M(int64)[OptimizedTier1OSR]",
            "Shop.Orders.Outer+Inner.M",
            Some("Names"),
        ),
        (
            "int32 [Names] Shop.Orders.Program::<Main>m__0(string)[QuickJitted]",
            "Shop.Orders.Program.<Main>m__0",
            Some("Names"),
        ),
        (
            "int64 [Names] Shop.Orders.Program::Work(class [mscorlib]System.Collections.Generic.List`1<!!0>)[QuickJitted]",
            "Shop.Orders.Program.Work",
            Some("Names"),
        ),
        (
            "instance void [System.Linq] System.Linq.Enumerable+SelectListIterator`2[System.__Canon,System.Int32]::.ctor(class [System.Collections]System.Collections.Generic.List`1<!0>,class [System.Runtime]System.Func`2<!0,!1>)[QuickJitted]",
            "System.Linq.Enumerable+SelectListIterator`2[System.__Canon,System.Int32]..ctor",
            Some("System.Linq"),
        ),
        (
            "class [System.Runtime]System.Collections.Generic.IEnumerable`1<!!1> [System.Linq] System.Linq.Enumerable::Select(class [System.Runtime]System.Collections.Generic.IEnumerable`1<!!0>,class [System.Runtime]System.Func`2<!!0,!!1>)[QuickJitted]",
            "System.Linq.Enumerable.Select",
            Some("System.Linq"),
        ),
        (
            "instance void [System.Private.CoreLib] System.Threading.ManualResetEventSlim::Wait(int32)[PreJIT]",
            "System.Threading.ManualResetEventSlim.Wait",
            Some("System.Private.CoreLib"),
        ),
        (
            "instance void [System.Private.CoreLib] System.Collections.Generic.List`1[System.__Canon]::Add(!0)[OptimizedTier1]",
            "System.Collections.Generic.List`1[System.__Canon].Add",
            Some("System.Private.CoreLib"),
        ),
        // .NET Core 3.1
        (
            "valuetype System.Runtime.Intrinsics.Vector128`1<int16> [System.Private.CoreLib] System.Runtime.Intrinsics.Vector128::CreateScalarUnsafe(int16)[QuickJitted]",
            "System.Runtime.Intrinsics.Vector128.CreateScalarUnsafe",
            Some("System.Private.CoreLib"),
        ),
        (
            "bool [System.Private.CoreLib] System.Runtime.Intrinsics.X86.Sse41::get_IsSupported()[QuickJitted]",
            "System.Runtime.Intrinsics.X86.Sse41.get_IsSupported",
            Some("System.Private.CoreLib"),
        ),
        (
            "class [System.Runtime]Microsoft.Win32.SafeHandles.SafeFileHandle [System.Console] dynamicClass::IL_STUB_PInvoke(class [System.Runtime]Microsoft.Win32.SafeHandles.SafeFileHandle)[Optimized]",
            "dynamicClass.IL_STUB_PInvoke",
            Some("System.Console"),
        ),
        (
            "int32 [System.Console] dynamicClass::IL_STUB_PInvoke(class [System.Runtime]Microsoft.Win32.SafeHandles.SafeFileHandle,valuetype Interop/Sys/FileStatus&)[Optimized]",
            "dynamicClass.IL_STUB_PInvoke",
            Some("System.Console"),
        ),
        (
            "int64 [Names] Shop.Orders.Outer+Inner::M(int64)[Optimized]",
            "Shop.Orders.Outer+Inner.M",
            Some("Names"),
        ),
        (
            "string [System.Private.CoreLib] System.Number::FormatInt32(int32,valuetype System.ReadOnlySpan`1<char>,class System.IFormatProvider)[OptimizedTier1]",
            "System.Number.FormatInt32",
            Some("System.Private.CoreLib"),
        ),
        // MethodLoad events (no assembly in the name)
        (
            "int64 Demo.Worker::Spin(int64)[OptimizedTier1]",
            "Demo.Worker.Spin",
            None,
        ),
        (
            "instance void Demo.Outer+Inner::.ctor()[QuickJitted]",
            "Demo.Outer+Inner..ctor",
            None,
        ),
        // Stubs: no short form.
        (
            "stub<12> AllocateTemporaryEntryPoints<PRECODE_STUB>",
            "stub<12> AllocateTemporaryEntryPoints<PRECODE_STUB>",
            None,
        ),
        (
            "stub<5> GenerateResolveStub<GenerateResolveStub>",
            "stub<5> GenerateResolveStub<GenerateResolveStub>",
            None,
        ),
        (
            "stub<1> AllocateTemporaryEntryPoints<PRECODE_FIXUP>",
            "stub<1> AllocateTemporaryEntryPoints<PRECODE_FIXUP>",
            None,
        ),
    ];

    fn short_of(raw: &str) -> String {
        let (full, _) = split_tier(raw);
        parse_method_name(full).map_or_else(|| full.to_owned(), |name| name.short())
    }

    #[test]
    fn real_runtime_names_get_their_short_form_and_assembly() {
        for &(raw, short, assembly) in CASES {
            assert_eq!(short_of(raw), short, "{raw}");
            assert_eq!(assembly_of(split_tier(raw).0), assembly, "{raw}");
        }
    }

    #[test]
    fn every_line_of_the_recorded_perf_maps_parses() {
        for (runtime, map) in [
            (
                "net8",
                include_str!("../../../profiler-parse/src/nettrace/testdata/net8.perf.map"),
            ),
            (
                "netcore31",
                include_str!("../../../profiler-parse/src/nettrace/testdata/netcore31.perf.map"),
            ),
        ] {
            for line in map.lines() {
                let raw = line.splitn(3, ' ').nth(2).expect("address size name");
                if raw.starts_with("stub<") {
                    continue;
                }
                let (full, _) = split_tier(raw);
                let name = parse_method_name(full)
                    .unwrap_or_else(|| panic!("{runtime}: no short form of {raw}"));
                assert!(full.contains(&format!("{}::{}(", name.type_name, name.method)));
            }
        }
    }

    /// Frames name generic types in the runtime's form, the one the
    /// allocation ticks of `clrbpf_parse::allocations` name the allocated
    /// type in (`List`1[System.Int32]`, as .NET 8 writes both), so an
    /// allocation's leaf frame sits on the frames of its type's methods
    /// (code shared by reference types shows `System.__Canon` there).
    #[test]
    fn generic_type_names_read_as_the_allocation_ticks_name_them() {
        for (tick_name, perf_map_line) in [
            (
                "System.Collections.Generic.List`1[System.Int32]",
                "instance void [System.Private.CoreLib] System.Collections.Generic.List`1[System.Int32]::.ctor(int32)[Optimized]",
            ),
            (
                "System.Collections.Generic.Dictionary`2[System.Int32,System.Int64]",
                "instance void [System.Private.CoreLib] System.Collections.Generic.Dictionary`2[System.Int32,System.Int64]::.ctor(int32)[QuickJitted]",
            ),
        ] {
            let frame = parse_method_name(perf_map_line).expect("the runtime's shape");
            assert_eq!(frame.type_name, tick_name);
        }
    }

    #[test]
    fn odd_names_keep_their_full_form() {
        for odd in [
            "",
            "::",
            "Type::",
            "::Method()",
            "void X::M(int32))",
            "void [A] X>::M()",
            "no separator at all",
            "void [A] X::M(int32",
            "a::b::c",
        ] {
            let parsed = parse_method_name(odd);
            assert!(
                parsed.is_none_or(|name| !name.type_name.is_empty() && !name.method.is_empty()),
                "{odd:?}: {parsed:?}"
            );
        }
        assert_eq!(
            parse_method_name("void X::M(int32))"),
            Some(MethodName {
                type_name: "X",
                method: "M"
            })
        );
        assert_eq!(parse_method_name("void [A] X>::M()"), None);
        assert_eq!(parse_method_name("a::b::c"), None);
    }
}
