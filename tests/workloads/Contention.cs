// Contention: THREADS threads take one lock ROUNDS times each and hold it
// HOLD_MS; each thread measures how long it waited to get the lock, and the
// total is printed (WAITED_NS), the ground truth for clrbpf's
// delay/nanoseconds. The waiting happens in Contention.WaitForGate.
//
// Usage: Contention.dll [START_DELAY_S=3] [THREADS=4] [HOLD_MS=20] [ROUNDS=25]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;

static class Contention
{
    static readonly object Gate = new object();
    static long waitedTicks;
    static long acquisitions;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitForGate(int holdMs)
    {
        var sw = Stopwatch.StartNew();
        lock (Gate)
        {
            sw.Stop();
            Interlocked.Add(ref waitedTicks, sw.ElapsedTicks);
            Interlocked.Increment(ref acquisitions);
            Thread.Sleep(holdMs);
        }
    }

    static void Worker(int holdMs, int rounds)
    {
        for (int i = 0; i < rounds; i++)
            WaitForGate(holdMs);
    }

    static int Main(string[] args)
    {
        double delay = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3;
        int threads = args.Length > 1 ? int.Parse(args[1]) : 4;
        int holdMs = args.Length > 2 ? int.Parse(args[2]) : 20;
        int rounds = args.Length > 3 ? int.Parse(args[3]) : 25;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep((int)(delay * 1000));
        var workers = new Thread[threads];
        for (int t = 0; t < threads; t++)
        {
            workers[t] = new Thread(() => Worker(holdMs, rounds));
            workers[t].Start();
        }
        foreach (var w in workers)
            w.Join();
        long ns = (long)(waitedTicks * (1e9 / Stopwatch.Frequency));
        Console.WriteLine("WAITED_NS " + ns);
        Console.WriteLine("ACQUISITIONS " + acquisitions);
        Console.Out.Flush();
        // Let the profiler read the last events before the process goes.
        Thread.Sleep(1000);
        return 0;
    }
}
