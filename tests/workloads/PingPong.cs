// PingPong: two threads hand a token back and forth through two
// AutoResetEvents for SECONDS, so every handoff blocks one thread and wakes
// the other: a context-switch-heavy load for the off-CPU benchmark. Prints
// HANDOFFS_PER_SEC, the figure a profiler's overhead lowers.
//
// Usage: PingPong.dll [SECONDS=5]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Threading;

static class PingPong
{
    static volatile bool stop;

    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5;
        var ping = new AutoResetEvent(false);
        var pong = new AutoResetEvent(false);
        var partner = new Thread(() =>
        {
            while (true)
            {
                ping.WaitOne();
                if (stop)
                    break;
                pong.Set();
            }
        }) { Name = "Pong" };
        partner.Start();
        long handoffs = 0;
        var sw = Stopwatch.StartNew();
        var limit = TimeSpan.FromSeconds(seconds);
        while (sw.Elapsed < limit)
        {
            ping.Set();
            pong.WaitOne();
            handoffs++;
        }
        sw.Stop();
        stop = true;
        ping.Set();
        partner.Join();
        Console.WriteLine("HANDOFFS_PER_SEC " + (handoffs / sw.Elapsed.TotalSeconds).ToString("F0", CultureInfo.InvariantCulture));
        return 0;
    }
}
