// CpuBound: the benchmark's workload. N threads run the same fixed unit of
// CPU work in a loop; the program counts the units it completes and prints
// its own throughput, `OPS_PER_SEC <float>`, so the profiler's cost shows as
// a loss of throughput measured by the workload itself.
//
// Usage: CpuBound.dll [SECONDS=5] [THREADS=processor count]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;

static class CpuBound
{
    static volatile bool stop;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong Work(ulong x)
    {
        for (int i = 0; i < 50000; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Worker(object state)
    {
        var counter = (long[])state;
        ulong x = (ulong)counter.Length;
        long ops = 0;
        while (!stop)
        {
            x = Work(x);
            ops++;
        }
        counter[0] = ops;
        counter[1] = (long)(x & 1);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5;
        int threads = args.Length > 1 ? int.Parse(args[1], CultureInfo.InvariantCulture) : Environment.ProcessorCount;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        // Compile Work before the clock starts.
        Work(1);
        var counters = new long[threads][];
        var workers = new Thread[threads];
        for (int i = 0; i < threads; i++)
        {
            counters[i] = new long[2];
            workers[i] = new Thread(Worker) { Name = "cpubound-" + i };
        }
        var clock = Stopwatch.StartNew();
        for (int i = 0; i < threads; i++)
            workers[i].Start(counters[i]);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep(TimeSpan.FromSeconds(seconds));
        stop = true;
        foreach (var w in workers)
            w.Join();
        double elapsed = clock.Elapsed.TotalSeconds;
        long total = 0;
        foreach (var c in counters)
            total += c[0];
        Console.WriteLine("THREADS " + threads);
        Console.WriteLine("OPS " + total);
        Console.WriteLine("ELAPSED " + elapsed.ToString("F4", CultureInfo.InvariantCulture));
        Console.WriteLine("OPS_PER_SEC " + (total / elapsed).ToString("F1", CultureInfo.InvariantCulture));
        return 0;
    }
}
