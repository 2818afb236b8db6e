// GcHeavy: THREADS threads (`gcheavy-N`) allocate without pause while each
// keeps LIVE_SLOTS live objects that it constantly replaces, so every
// collection has survivors to mark and compact; the main thread also
// induces a full collection every 100 ms, alternately blocking and
// background. xtask runs it with server and concurrent GC on
// (`System.GC.Server`, `System.GC.Concurrent` in its runtimeconfig), so the
// collections run on the runtime's own GC threads (`.NET Server GC`,
// `.NET BGC` on .NET 8), not on the allocating ones. Prints the number of
// collections per generation (`GC_COUNTS g0 g1 g2`) and `SERVER_GC True`.
//
// Usage: GcHeavy.dll [SECONDS=5] [THREADS=2] [LIVE_SLOTS=300000]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;

sealed class Node
{
    public Node Next;
    public long Value;
    public byte[] Payload;
}

static class GcHeavy
{
    static int liveSlots = 300000;
    static volatile bool stop;

    // Replaces one random live object and throws several away, so each
    // collection finds both survivors and garbage, and old objects point to
    // young ones (card marking work).
    [MethodImpl(MethodImplOptions.NoInlining)]
    static long Churn(Node[] live, ref ulong rng)
    {
        long sum = 0;
        for (int i = 0; i < 1000; i++)
        {
            rng = rng * 6364136223846793005UL + 1442695040888963407UL;
            int slot = (int)((rng >> 33) % (ulong)live.Length);
            var node = new Node { Value = i, Payload = new byte[16 + (int)(rng >> 58)] };
            node.Next = live[(slot + 1) % live.Length];
            live[slot] = node;
            var garbage = new Node { Value = i, Payload = new byte[2048] };
            sum += garbage.Payload.Length + node.Payload.Length;
        }
        return sum;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Worker(object state)
    {
        var result = (long[])state;
        var live = new Node[liveSlots];
        for (int i = 0; i < live.Length; i++)
            live[i] = new Node { Value = i, Payload = new byte[32] };
        ulong rng = (ulong)result.Length + 17;
        long sum = 0;
        while (!stop)
            sum += Churn(live, ref rng);
        result[0] = sum;
    }

    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5;
        int threads = args.Length > 1 ? int.Parse(args[1], CultureInfo.InvariantCulture) : 2;
        if (args.Length > 2) liveSlots = int.Parse(args[2], CultureInfo.InvariantCulture);
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        var workers = new Thread[threads];
        var results = new long[threads][];
        for (int i = 0; i < threads; i++)
        {
            results[i] = new long[1];
            workers[i] = new Thread(Worker) { Name = "gcheavy-" + i };
            workers[i].Start(results[i]);
        }
        Console.WriteLine("READY");
        Console.Out.Flush();
        // The allocation alone leaves the collections to the GC's budget
        // heuristics (server GC's gen0 budget is large: a few collections in
        // seconds). Induced ones, alternately blocking (run by the server GC
        // threads) and background (run by the background GC threads), make
        // both kinds of GC thread work through the whole run.
        var clock = Stopwatch.StartNew();
        for (int round = 0; clock.Elapsed.TotalSeconds < seconds; round++)
        {
            Thread.Sleep(100);
            GC.Collect(2, GCCollectionMode.Forced, round % 2 == 0);
        }
        stop = true;
        foreach (var w in workers)
            w.Join();
        Console.WriteLine("GC_COUNTS " + GC.CollectionCount(0) + " " + GC.CollectionCount(1) + " " + GC.CollectionCount(2));
        Console.WriteLine("SERVER_GC " + System.Runtime.GCSettings.IsServerGC);
        Console.Out.Flush();
        return 0;
    }
}
