// Frameless: user methods that reach the kernel through thin framework
// overloads that ReadyToRun compiles without a frame pointer, so a
// frame-pointer walk loses the user method (issue 13). Each thread is one
// user method:
// - Frameless.WaitMres blocks in ManualResetEventSlim.Wait(int),
// - Frameless.WaitSemaphore in SemaphoreSlim.Wait(int),
// - Frameless.WaitTask in Task.Wait(int),
//   each a timed wait of WAIT_MS that never completes early, called too
//   rarely for the framework's code to be re-jitted;
// - Frameless.WaitMresOften blocks in ManualResetEventSlim.Wait(), a
//   wrapper of Wait(int, CancellationToken), a few hundred times a second
//   (a setter thread sets the event every 2 ms). The main thread calls
//   Wait() on a set event for a while first, so the runtime re-jits it at
//   tier 1 before the threads start: JIT-compiled code without a frame
//   (`push rax; ...; call; add rsp, 8; ret`), not ReadyToRun code;
// - Frameless.BurnUnderTaskWait waits with Task.Wait() (a wrapper of
//   Wait(int, CancellationToken)) for a task its scheduler never queues, so
//   the wait runs it inline: Frameless.Spin burns CPU until the end under
//   the wait's frames.
// Each thread prints `TID name tid` first. The waits are timed with
// Stopwatch and printed at the end (WAITED_NS).
//
// With IDLE_S, the process first idles that long after READY (nothing
// compiled, only sleeping threads), so the warm-up's tier-1 Wait() is code
// compiled after an idle spell.
//
// Usage: Frameless.dll [START_DELAY_S=2] [SECONDS=4] [WAIT_MS=300] [IDLE_S=0]
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;
using System.Threading.Tasks;

static class Frameless
{
    static volatile bool stop;
    static long waitedTicks;
    static long spins;
    static readonly ManualResetEventSlim Never = new ManualResetEventSlim(false);
    static readonly SemaphoreSlim Empty = new SemaphoreSlim(0);
    static readonly TaskCompletionSource<int> Pending = new TaskCompletionSource<int>();
    static readonly ManualResetEventSlim Often = new ManualResetEventSlim(false);
    static volatile bool oftenDone;

    [DllImport("libc")]
    static extern int gettid();

    /// Prints `TID name tid`: .NET Core 3.1 does not name native threads.
    static void Announce(string name)
    {
        Console.WriteLine("TID " + name + " " + gettid());
        Console.Out.Flush();
    }

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

    /// Not optimized, so never replaced on the stack (OSR) while it loops.
    [MethodImpl(MethodImplOptions.NoInlining | MethodImplOptions.NoOptimization)]
    static void WaitMresOften()
    {
        while (!stop)
        {
            Often.Wait();
            Often.Reset();
        }
        oftenDone = true;
    }

    static void SetOften()
    {
        while (!oftenDone)
        {
            Thread.Sleep(2);
            Often.Set();
        }
    }

    /// Calls Often.Wait() on a set event for `seconds`: past the runtime's
    /// tiering delay, 30 calls get it re-jitted at tier 1.
    static void WarmUpWait(double seconds)
    {
        Often.Set();
        var clock = Stopwatch.StartNew();
        while (clock.Elapsed.TotalSeconds < seconds)
        {
            Often.Wait();
            Thread.Sleep(1);
        }
        Often.Reset();
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void BurnUnderTaskWait()
    {
        var task = new Task(Spin);
        task.Start(new InlineScheduler());
        task.Wait();
    }

    /// Not optimized, so never tiered: a Tier0 loop would be replaced on
    /// the stack (OSR), and how OSR frames unwind is not this workload's
    /// matter.
    [MethodImpl(MethodImplOptions.NoInlining | MethodImplOptions.NoOptimization)]
    static void Spin()
    {
        long n = 0;
        while (!stop)
            n++;
        spins = n;
    }

    /// Queues nothing, so Task.Wait() runs the task inline on the waiting
    /// thread, under the wait's frames.
    sealed class InlineScheduler : TaskScheduler
    {
        protected override void QueueTask(Task task) { }

        protected override bool TryExecuteTaskInline(Task task, bool taskWasPreviouslyQueued)
        {
            return TryExecuteTask(task);
        }

        protected override IEnumerable<Task> GetScheduledTasks() { return new Task[0]; }
    }

    static int Main(string[] args)
    {
        double delay = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 2;
        double seconds = args.Length > 1 ? double.Parse(args[1], CultureInfo.InvariantCulture) : 4;
        int waitMs = args.Length > 2 ? int.Parse(args[2]) : 300;
        double idle = args.Length > 3 ? double.Parse(args[3], CultureInfo.InvariantCulture) : 0;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep((int)(idle * 1000));
        var warmUp = Stopwatch.StartNew();
        WarmUpWait(Math.Min(1.5, delay / 2));
        Thread.Sleep(Math.Max(0, (int)(delay * 1000 - warmUp.ElapsedMilliseconds)));
        var threads = new[]
        {
            new Thread(() => { Announce("often"); WaitMresOften(); }) { Name = "often" },
            new Thread(SetOften) { Name = "setter" },
            new Thread(() => { Announce("mres"); WaitMres(waitMs); }) { Name = "mres" },
            new Thread(() => { Announce("semaphore"); WaitSemaphore(waitMs); }) { Name = "semaphore" },
            new Thread(() => { Announce("task"); WaitTask(waitMs); }) { Name = "task" },
            new Thread(() => { Announce("burn"); BurnUnderTaskWait(); }) { Name = "burn" },
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
        Console.WriteLine("SPINS " + spins);
        return 0;
    }
}
