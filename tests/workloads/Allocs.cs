// Allocs: allocates known types from known methods for SECONDS seconds at
// about RATE_MB megabytes a second: byte[2000] in AllocArrays, a small
// class (Allocs+Node, named Node by the runtime) in AllocNodes, and byte[100000] (large object heap)
// in AllocLarge, about 60/30/10 % of the bytes. It measures each method's
// bytes itself with GC.GetAllocatedBytesForCurrentThread around each call
// and prints them (BYTES_<Method>), the total (BYTES_TOTAL), the
// process's own count over the same time (GC.GetTotalAllocatedBytes,
// BYTES_PROCESS) and the rate (BYTES_PER_S): the ground truth for clrbpf's
// alloc_size/bytes. CPU_S is the CPU time the whole process (its GC and
// EventPipe threads too) spent over the same time: what a profiler costs it
// when the rate is held below what it can do. GC methods are called by reflection: mcs compiles
// against Mono's mscorlib, which lacks them.
//
// It lives LINGER_S after its figures (0: it exits at once, before any
// later counter value).
//
// Usage: Allocs.dll [START_DELAY_S=3] [SECONDS=6] [RATE_MB=40] [LINGER_S=1]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Reflection;
using System.Runtime.CompilerServices;
using System.Threading;

static class Allocs
{
    sealed class Node
    {
        public Node Next;
        public long A;
        public long B;
    }

    static object sink;
    static Func<long> threadBytes;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void AllocArrays(int n)
    {
        for (int i = 0; i < n; i++) sink = new byte[2000];
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void AllocNodes(int n)
    {
        Node last = null;
        for (int i = 0; i < n; i++) last = new Node { Next = (i & 63) == 0 ? null : last, A = i };
        sink = last;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void AllocLarge(int n)
    {
        for (int i = 0; i < n; i++) sink = new byte[100000];
    }

    static long Measure(Action<int> method, int n)
    {
        long before = threadBytes();
        method(n);
        return threadBytes() - before;
    }

    static int Main(string[] args)
    {
        double delay = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3;
        double seconds = args.Length > 1 ? double.Parse(args[1], CultureInfo.InvariantCulture) : 6;
        double rateMb = args.Length > 2 ? double.Parse(args[2], CultureInfo.InvariantCulture) : 40;
        double linger = args.Length > 3 ? double.Parse(args[3], CultureInfo.InvariantCulture) : 1;
        MethodInfo current = typeof(GC).GetMethod("GetAllocatedBytesForCurrentThread", Type.EmptyTypes);
        MethodInfo total = typeof(GC).GetMethod("GetTotalAllocatedBytes", new[] { typeof(bool) });
        threadBytes = (Func<long>)Delegate.CreateDelegate(typeof(Func<long>), current);
        Func<bool, long> processBytes = (Func<bool, long>)Delegate.CreateDelegate(typeof(Func<bool, long>), total);
        Action<int> arrays = AllocArrays, nodes = AllocNodes, large = AllocLarge;
        // Warm up (JIT) before the recording starts.
        Measure(arrays, 10); Measure(nodes, 10); Measure(large, 1);
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep((int)(delay * 1000));
        // One round: 600 KB of arrays, ~300 KB of nodes, 100 KB large.
        const int ArraysPerRound = 300, NodesPerRound = 7500, LargePerRound = 1;
        double roundsPerSecond = rateMb;
        long bArrays = 0, bNodes = 0, bLarge = 0;
        long processStart = processBytes(true);
        Process self = Process.GetCurrentProcess();
        TimeSpan cpuStart = self.TotalProcessorTime;
        var sw = Stopwatch.StartNew();
        long rounds = 0;
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            bArrays += Measure(arrays, ArraysPerRound);
            bNodes += Measure(nodes, NodesPerRound);
            bLarge += Measure(large, LargePerRound);
            rounds++;
            double ahead = rounds / roundsPerSecond - sw.Elapsed.TotalSeconds;
            if (ahead > 0.002) Thread.Sleep((int)(ahead * 1000));
        }
        double elapsed = sw.Elapsed.TotalSeconds;
        self.Refresh();
        double cpu = (self.TotalProcessorTime - cpuStart).TotalSeconds;
        long processEnd = processBytes(true);
        long sum = bArrays + bNodes + bLarge;
        Console.WriteLine("BYTES_Allocs.AllocArrays " + bArrays);
        Console.WriteLine("BYTES_Allocs.AllocNodes " + bNodes);
        Console.WriteLine("BYTES_Allocs.AllocLarge " + bLarge);
        Console.WriteLine("BYTES_TOTAL " + sum);
        Console.WriteLine("BYTES_PROCESS " + (processEnd - processStart));
        Console.WriteLine("BYTES_PER_S " + (long)(sum / elapsed));
        Console.WriteLine("LARGE_OBJECTS " + rounds * LargePerRound);
        Console.WriteLine("CPU_S " + cpu.ToString("F3", CultureInfo.InvariantCulture));
        Console.Out.Flush();
        Thread.Sleep((int)(linger * 1000));
        return 0;
    }
}
