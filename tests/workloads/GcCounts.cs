// GcCounts: collections a test can count from outside. Idles WAIT seconds
// (a profiler attaches and its EventCounters take their baseline), prints
// `GC_BEFORE g0 g1 g2` (GC.CollectionCount of each generation), induces
// COLLECTIONS collections over about a second (every third of generation 2,
// every other of generation 1, the rest of generation 0), prints
// `GC_AFTER g0 g1 g2`, then idles IDLE seconds so the counters report it.
// With THROWS, it also throws and catches that many exceptions after the
// collections, and prints `EXCEPTIONS_BEFORE n` and `EXCEPTIONS_AFTER n`:
// every first-chance exception of the process, the runtime's own included.
//
// Usage: GcCounts.dll [WAIT=8] [COLLECTIONS=30] [IDLE=12] [THROWS=0]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Threading;

static class GcCounts
{
    static string Counts()
    {
        return GC.CollectionCount(0) + " " + GC.CollectionCount(1) + " " + GC.CollectionCount(2);
    }

    static int exceptions;

    static int Main(string[] args)
    {
        AppDomain.CurrentDomain.FirstChanceException += (s, e) => Interlocked.Increment(ref exceptions);
        double wait = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 8;
        int collections = args.Length > 1 ? int.Parse(args[1], CultureInfo.InvariantCulture) : 30;
        double idle = args.Length > 2 ? double.Parse(args[2], CultureInfo.InvariantCulture) : 12;
        int throws = args.Length > 3 ? int.Parse(args[3], CultureInfo.InvariantCulture) : 0;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep(TimeSpan.FromSeconds(wait));
        Console.WriteLine("GC_BEFORE " + Counts());
        Console.WriteLine("EXCEPTIONS_BEFORE " + Interlocked.CompareExchange(ref exceptions, 0, 0));
        Console.Out.Flush();
        for (int i = 0; i < collections; i++)
        {
            int generation = i % 3 == 0 ? 2 : i % 2 == 0 ? 1 : 0;
            GC.Collect(generation, GCCollectionMode.Forced, true);
            Thread.Sleep(30);
        }
        for (int i = 0; i < throws; i++)
        {
            try { throw new InvalidOperationException("counted"); } catch (InvalidOperationException) { }
        }
        Console.WriteLine("GC_AFTER " + Counts());
        Console.WriteLine("EXCEPTIONS_AFTER " + Interlocked.CompareExchange(ref exceptions, 0, 0));
        Console.Out.Flush();
        Thread.Sleep(TimeSpan.FromSeconds(idle));
        return 0;
    }
}
