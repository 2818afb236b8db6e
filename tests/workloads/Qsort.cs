// Qsort: managed code calling glibc's qsort through P/Invoke with a managed
// comparer, for the DWARF unwinding test. A sample in the comparer has, from
// the leaf: the comparer (JIT, frame pointers) -> the reverse P/Invoke stub
// -> glibc's msort_with_tmp/qsort (no frame pointers: only .eh_frame gets
// through) -> the P/Invoke stub -> Qsort::SortMany (JIT) -> Main.
//
// Usage: Qsort.dll [SECONDS=5]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;

static class Qsort
{
    [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
    delegate int Comparer(IntPtr a, IntPtr b);

    [DllImport("libc", CallingConvention = CallingConvention.Cdecl)]
    static extern void qsort(IntPtr data, UIntPtr count, UIntPtr size, Comparer compare);

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int CompareInts(IntPtr a, IntPtr b)
    {
        int x = Marshal.ReadInt32(a), y = Marshal.ReadInt32(b);
        return x < y ? -1 : (x > y ? 1 : 0);
    }

    // Refills the array and sorts it until the time is up; returns the sorts done.
    [MethodImpl(MethodImplOptions.NoInlining)]
    static long SortMany(IntPtr data, int n, Comparer compare, double seconds)
    {
        var rng = new Random(7);
        var total = Stopwatch.StartNew();
        long sorts = 0;
        while (total.Elapsed.TotalSeconds < seconds)
        {
            for (int i = 0; i < n; i++)
                Marshal.WriteInt32(data, i * 4, rng.Next());
            qsort(data, (UIntPtr)n, (UIntPtr)4, compare);
            sorts++;
        }
        return sorts;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        Comparer compare = CompareInts;
        int n = 100000;
        IntPtr data = Marshal.AllocHGlobal(n * 4);
        Console.WriteLine("READY");
        Console.Out.Flush();
        long sorts = SortMany(data, n, compare, seconds);
        GC.KeepAlive(compare);
        Marshal.FreeHGlobal(data);
        Console.WriteLine("SORTS " + sorts);
        return 0;
    }
}
