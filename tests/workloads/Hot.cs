// Hot: a loop calling Hot.Spin, for the attach, whole-host, child and
// format tests. Each call is short (~0.2 ms), so Spin is called thousands of
// times a second and tiered up (JIT-compiled again, optimized) within the
// first second: by the time a profiler attaches, its code is long compiled.
//
// Usage: Hot.dll [SECONDS=5]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

static class Hot
{
    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong Spin(ulong x)
    {
        for (int i = 0; i < 200000; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        ulong x = 1;
        long spins = 0;
        var total = Stopwatch.StartNew();
        Console.WriteLine("READY");
        Console.Out.Flush();
        while (total.Elapsed.TotalSeconds < seconds)
        {
            x = Spin(x);
            spins++;
        }
        Console.WriteLine("SPINS " + spins);
        Console.WriteLine("CHECKSUM " + x);
        return 0;
    }
}
