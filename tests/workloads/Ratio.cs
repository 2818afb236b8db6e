// Ratio: one thread alternating between HotA and HotB, about 3:1 in CPU
// time. The test compares the profile's HotA share with the share this
// program measures itself (Stopwatch around each call), printed at the end as
// `RATIO_A 0.7512`. Calls are short (~0.1 ms / ~0.3 ms), far below the 2 ms
// sampling period at 499 Hz, so the alternation cannot alias with it.
//
// Usage: Ratio.dll [SECONDS=5]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

static class Ratio
{
    const int Unit = 100000;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong HotA(ulong x)
    {
        for (int i = 0; i < 3 * Unit; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong HotB(ulong x)
    {
        for (int i = 0; i < Unit; i++)
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
        long inA = 0, inB = 0, rounds = 0;
        var total = Stopwatch.StartNew();
        Console.WriteLine("READY");
        Console.Out.Flush();
        while (total.Elapsed.TotalSeconds < seconds)
        {
            long t0 = Stopwatch.GetTimestamp();
            x = HotA(x);
            long t1 = Stopwatch.GetTimestamp();
            x = HotB(x);
            long t2 = Stopwatch.GetTimestamp();
            inA += t1 - t0;
            inB += t2 - t1;
            rounds++;
        }
        double ratioA = inA / (double)(inA + inB);
        Console.WriteLine("ROUNDS " + rounds);
        Console.WriteLine("SECONDS_A " + (inA / (double)Stopwatch.Frequency).ToString("F4", CultureInfo.InvariantCulture));
        Console.WriteLine("SECONDS_B " + (inB / (double)Stopwatch.Frequency).ToString("F4", CultureInfo.InvariantCulture));
        Console.WriteLine("RATIO_A " + ratioA.ToString("F4", CultureInfo.InvariantCulture));
        Console.WriteLine("CHECKSUM " + x);
        return 0;
    }
}
