// Frameless: user methods that reach the kernel through thin framework
// overloads that ReadyToRun compiles without a frame pointer, so a
// frame-pointer walk loses the user method (issue 13). Each thread is one
// user method:
// - Frameless.WaitMres blocks in ManualResetEventSlim.Wait(int),
// - Frameless.WaitSemaphore in SemaphoreSlim.Wait(int),
// - Frameless.WaitTask in Task.Wait(int),
//   each a timed wait of WAIT_MS that never completes early, called too
//   rarely for the framework's code to be re-jitted.
// The waits are timed with Stopwatch and printed at the end (WAITED_NS).
//
// Usage: Frameless.dll [START_DELAY_S=2] [SECONDS=4] [WAIT_MS=300]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;
using System.Threading.Tasks;

static class Frameless
{
    static volatile bool stop;
    static long waitedTicks;
    static readonly ManualResetEventSlim Never = new ManualResetEventSlim(false);
    static readonly SemaphoreSlim Empty = new SemaphoreSlim(0);
    static readonly TaskCompletionSource<int> Pending = new TaskCompletionSource<int>();

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitMres(int waitMs)
    {
        while (!stop)
        {
            long t0 = Stopwatch.GetTimestamp();
            Never.Wait(waitMs);
            Interlocked.Add(ref waitedTicks, Stopwatch.GetTimestamp() - t0);
        }
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitSemaphore(int waitMs)
    {
        while (!stop)
        {
            long t0 = Stopwatch.GetTimestamp();
            Empty.Wait(waitMs);
            Interlocked.Add(ref waitedTicks, Stopwatch.GetTimestamp() - t0);
        }
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitTask(int waitMs)
    {
        while (!stop)
        {
            long t0 = Stopwatch.GetTimestamp();
            Pending.Task.Wait(waitMs);
            Interlocked.Add(ref waitedTicks, Stopwatch.GetTimestamp() - t0);
        }
    }

    static int Main(string[] args)
    {
        double delay = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 2;
        double seconds = args.Length > 1 ? double.Parse(args[1], CultureInfo.InvariantCulture) : 4;
        int waitMs = args.Length > 2 ? int.Parse(args[2]) : 300;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep((int)(delay * 1000));
        var threads = new[]
        {
            new Thread(() => WaitMres(waitMs)) { Name = "mres" },
            new Thread(() => WaitSemaphore(waitMs)) { Name = "semaphore" },
            new Thread(() => WaitTask(waitMs)) { Name = "task" },
        };
        foreach (var t in threads)
            t.Start();
        Console.WriteLine("STARTED");
        Console.Out.Flush();
        Thread.Sleep((int)(seconds * 1000));
        stop = true;
        foreach (var t in threads)
            t.Join();
        Console.WriteLine("WAITED_NS " + (long)(waitedTicks * (1e9 / Stopwatch.Frequency)));
        return 0;
    }
}
