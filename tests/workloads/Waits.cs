// Waits: threads that block in user methods through the five BCL wait APIs
// with timed waits that never complete early, for recordings attached to a
// process already running (issue 25: a `record -p` must keep the user
// method from the first wait on). Each thread is one user method:
// - Waits.WaitMres: ManualResetEventSlim.Wait(int),
// - Waits.WaitSemaphore: SemaphoreSlim.Wait(int),
// - Waits.WaitTask: Task.Wait(int),
// - Waits.WaitTake: BlockingCollection<int>.TryTake(out int, int),
// - Waits.WaitJoin: Thread.Join(int), of a thread that never ends.
// Each thread first calls its API with 1 ms timeouts for WARM_UP_S, so the
// framework's wait methods are re-jitted at tier 1 before READY, as in an
// app that has run for a while: thin overloads such as
// ManualResetEventSlim.Wait(int) are then JIT-compiled code without a frame
// pointer (ReadyToRun code without one before), and a frame-pointer walk
// of a thread blocked in them skips the user method.
// Each thread prints `TID name tid` first; `READY` follows them all.
//
// Usage: Waits.dll [SECONDS=60] [WAIT_MS=300] [WARM_UP_S=1.5]
using System;
using System.Collections.Concurrent;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;
using System.Threading.Tasks;

static class Waits
{
    static volatile bool stop;
    static readonly ManualResetEventSlim Never = new ManualResetEventSlim(false);
    static readonly SemaphoreSlim Empty = new SemaphoreSlim(0);
    static readonly TaskCompletionSource<int> Pending = new TaskCompletionSource<int>();
    static readonly BlockingCollection<int> Nothing = new BlockingCollection<int>();
    static readonly ManualResetEvent Forever = new ManualResetEvent(false);
    static int started;
    static double warmUpSeconds;

    /// Calls `wait` (a 1 ms wait) for warmUpSeconds: hundreds of calls,
    /// past the runtime's tiering delay, get the framework's code on its
    /// path re-jitted at tier 1.
    static void WarmUp(Action wait)
    {
        var clock = Stopwatch.StartNew();
        while (clock.Elapsed.TotalSeconds < warmUpSeconds)
            wait();
    }

    [DllImport("libc")]
    static extern int gettid();

    /// Prints `TID name tid`: .NET Core 3.1 does not name native threads.
    static void Announce(string name)
    {
        lock (Never)
        {
            Console.WriteLine("TID " + name + " " + gettid());
            Console.Out.Flush();
        }
    }

    static void Warmed()
    {
        Interlocked.Increment(ref started);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitMres(int waitMs)
    {
        while (!stop)
            Never.Wait(waitMs);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitSemaphore(int waitMs)
    {
        while (!stop)
            Empty.Wait(waitMs);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitTask(int waitMs)
    {
        while (!stop)
            Pending.Task.Wait(waitMs);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitTake(int waitMs)
    {
        int item;
        while (!stop)
            Nothing.TryTake(out item, waitMs);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitJoin(Thread never, int waitMs)
    {
        while (!stop)
            never.Join(waitMs);
    }

    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 60;
        int waitMs = args.Length > 1 ? int.Parse(args[1]) : 300;
        warmUpSeconds = args.Length > 2 ? double.Parse(args[2], CultureInfo.InvariantCulture) : 1.5;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        var never = new Thread(() => Forever.WaitOne()) { Name = "never", IsBackground = true };
        never.Start();
        var threads = new[]
        {
            new Thread(() => {
                Announce("mres"); WarmUp(() => Never.Wait(1)); Warmed(); WaitMres(waitMs);
            }) { Name = "mres" },
            new Thread(() => {
                Announce("semaphore"); WarmUp(() => Empty.Wait(1)); Warmed(); WaitSemaphore(waitMs);
            }) { Name = "semaphore" },
            new Thread(() => {
                Announce("task"); WarmUp(() => Pending.Task.Wait(1)); Warmed(); WaitTask(waitMs);
            }) { Name = "task" },
            new Thread(() => {
                Announce("take"); int item; WarmUp(() => Nothing.TryTake(out item, 1)); Warmed(); WaitTake(waitMs);
            }) { Name = "take" },
            new Thread(() => {
                Announce("join"); WarmUp(() => never.Join(1)); Warmed(); WaitJoin(never, waitMs);
            }) { Name = "join" },
        };
        foreach (var t in threads)
            t.Start();
        while (Volatile.Read(ref started) < threads.Length)
            Thread.Sleep(1);
        // The tier-1 code is compiled in the background and installed for
        // the next calls.
        Thread.Sleep(1000);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep((int)(seconds * 1000));
        stop = true;
        foreach (var t in threads)
            t.Join();
        Forever.Set();
        return 0;
    }
}
