// DictHot: a hot method, DictHot.Churn, that spends its time in
// Dictionary<int,long> lookups and inserts, for the attach tests of
// JIT-compiled frameless leaves. The generic instantiation's code is
// JIT-compiled (not in CoreLib's ReadyToRun image) and re-jitted at tier 1
// within the first second; its FindValue and TryInsert run without an rbp
// frame, so a frame-pointer walk of a sample in them skips Churn and goes
// straight to Main. Main's thread is the process's first (its tid is the
// pid).
//
// Usage: DictHot.dll [SECONDS=10]
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

static class DictHot
{
    const int Keys = 1 << 15;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long Churn(Dictionary<int, long> map, int round)
    {
        long sum = 0;
        for (int i = 0; i < 4096; i++)
        {
            int key = (int)(((uint)i * 2654435761u + (uint)round) % Keys);
            long value;
            if (map.TryGetValue(key, out value))
                sum += value;
            // The indexer's setter is TryInsert (overwriting).
            map[key] = value + i;
        }
        return sum;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 10;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        var map = new Dictionary<int, long>();
        long sum = 0;
        int round = 0;
        var total = Stopwatch.StartNew();
        Console.WriteLine("READY");
        Console.Out.Flush();
        while (total.Elapsed.TotalSeconds < seconds)
        {
            sum += Churn(map, round++);
        }
        Console.WriteLine("ROUNDS " + round);
        Console.WriteLine("CHECKSUM " + sum);
        return 0;
    }
}
