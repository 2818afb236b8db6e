// Idle: an idle service, as most pods of a node are most of the time. Three
// threads sleep in Idle.Nap (Thread.Sleep of SLEEP_MS) and the main thread
// waits; it exits after SECONDS. It prints its PID, then READY once its
// threads run.
// The node-scale test and bench start dozens of them beside the agent.
//
// Usage: Idle.dll [SECONDS=600] [SLEEP_MS=1000]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;

static class Idle
{
    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Nap(int sleepMs)
    {
        while (true)
        {
            Thread.Sleep(sleepMs);
        }
    }

    static int Arg(string[] args, int i, int fallback)
    {
        return args.Length > i ? int.Parse(args[i], CultureInfo.InvariantCulture) : fallback;
    }

    static void Main(string[] args)
    {
        int seconds = Arg(args, 0, 600);
        int sleepMs = Arg(args, 1, 1000);
        for (int i = 0; i < 3; i++)
        {
            var t = new Thread(() => Nap(sleepMs)) { IsBackground = true, Name = "idle-" + i };
            t.Start();
        }
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Thread.Sleep(TimeSpan.FromSeconds(seconds));
    }
}
