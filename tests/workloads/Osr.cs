// Osr: a method whose long loop runs in its OSR version. Osr.Loop is
// entered once per call and loops for seconds, so the runtime compiles an
// OSR method for its loop and jumps into it from a patchpoint of the
// tier-0 code, which stays on the stack beneath it. A "warm" thread runs
// the loop first, under Osr.WarmUp, so the OSR code exists (and clrbpf has
// its rows) before the "osr" thread starts, after START_DELAY_S: its calls
// jump into the same OSR code at once. The CPU samples of the "osr" thread
// in Osr.Loop should all hold its caller, Osr.Caller.
//
// Usage: Osr.dll [START_DELAY_S=6] [SECONDS=4]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;

static class Osr
{
    [DllImport("libc")]
    static extern int gettid();

    static void Announce(string name)
    {
        Console.WriteLine("TID " + name + " " + gettid());
        Console.Out.Flush();
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long Loop(double seconds)
    {
        var clock = Stopwatch.StartNew();
        long sum = 0;
        for (long n = 0; ; n++)
        {
            for (int i = 0; i < 100000; i++)
                sum += i ^ n;
            if (clock.Elapsed.TotalSeconds >= seconds)
                break;
        }
        return sum;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long Caller(double seconds)
    {
        return Loop(seconds) + 1;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long WarmUp(double seconds)
    {
        return Loop(seconds) - 1;
    }

    static int Main(string[] args)
    {
        double delay = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 6;
        double seconds = args.Length > 1 ? double.Parse(args[1], CultureInfo.InvariantCulture) : 4;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Console.Out.Flush();
        long result = 0;
        var warm = new Thread(() => { Announce("warm"); result += WarmUp(0.5); });
        warm.Start();
        warm.Join();
        Thread.Sleep((int)(delay * 1000));
        var osr = new Thread(() => { Announce("osr"); result += Caller(seconds); });
        osr.Start();
        osr.Join();
        Console.WriteLine("RESULT " + result);
        Console.Out.Flush();
        return 0;
    }
}
