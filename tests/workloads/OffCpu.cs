// OffCpu: three threads for off-CPU profiling. Sleeper loops in
// Thread.Sleep(SLEEP_MS) (OffCpu.SleepLoop), Waiter waits on a
// ManualResetEventSlim that Setter sets every SET_MS (OffCpu.WaitLoop), and
// Burner spins (OffCpu.Burn). Each blocking call is timed with Stopwatch and
// the totals printed at the end (SLEPT_NS, WAITED_NS): the ground truth for
// clrbpf's off_cpu/nanoseconds.
//
// Usage: OffCpu.dll [START_DELAY_S=2] [SECONDS=4] [SLEEP_MS=20] [SET_MS=30]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;

static class OffCpu
{
    static volatile bool stop;
    static long sleptTicks;
    static long waitedTicks;
    static long spins;
    static readonly ManualResetEventSlim Signal = new ManualResetEventSlim(false, 0);

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void SleepLoop(int sleepMs)
    {
        while (!stop)
        {
            long t0 = Stopwatch.GetTimestamp();
            Thread.Sleep(sleepMs);
            sleptTicks += Stopwatch.GetTimestamp() - t0;
        }
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WaitLoop()
    {
        while (!stop)
        {
            long t0 = Stopwatch.GetTimestamp();
            // The no-argument overload, a small wrapper that, called this
            // often, the JIT re-compiles at tier 1 without a frame pointer:
            // its caller stays on the stacks through the rows clrbpf makes
            // from its prologue.
            Signal.Wait();
            waitedTicks += Stopwatch.GetTimestamp() - t0;
            Signal.Reset();
        }
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void SetLoop(int setMs)
    {
        while (!stop)
        {
            Thread.Sleep(setMs);
            Signal.Set();
        }
        Signal.Set();
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Burn()
    {
        long n = 0;
        while (!stop)
            n++;
        spins = n;
    }

    static int Main(string[] args)
    {
        double delay = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 2;
        double seconds = args.Length > 1 ? double.Parse(args[1], CultureInfo.InvariantCulture) : 4;
        int sleepMs = args.Length > 2 ? int.Parse(args[2]) : 20;
        int setMs = args.Length > 3 ? int.Parse(args[3]) : 30;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep((int)(delay * 1000));
        var threads = new[]
        {
            new Thread(() => SleepLoop(sleepMs)) { Name = "Sleeper" },
            new Thread(WaitLoop) { Name = "Waiter" },
            new Thread(() => SetLoop(setMs)) { Name = "Setter" },
            new Thread(Burn) { Name = "Burner" },
        };
        foreach (var t in threads)
            t.Start();
        Thread.Sleep((int)(seconds * 1000));
        stop = true;
        foreach (var t in threads)
            t.Join();
        double nsPerTick = 1e9 / Stopwatch.Frequency;
        Console.WriteLine("SLEPT_NS " + (long)(sleptTicks * nsPerTick));
        Console.WriteLine("WAITED_NS " + (long)(waitedTicks * nsPerTick));
        Console.WriteLine("SPINS " + spins);
        Console.Out.Flush();
        return 0;
    }
}
