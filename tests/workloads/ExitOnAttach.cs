// ExitOnAttach: spins until a profiler turns its perf map on
// (/tmp/perf-PID.map appears), then exits at once: the app's exit races
// the runtime's answer to EnablePerfMap and the profiler's clean-up.
//
// Usage: ExitOnAttach.dll [MAX_SECONDS=10]
using System;
using System.Diagnostics;
using System.Globalization;
using System.IO;
using System.Runtime.CompilerServices;

static class ExitOnAttach
{
    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong Spin(ulong x)
    {
        for (int i = 0; i < 20000; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
        return x;
    }

    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 10;
        int pid = Process.GetCurrentProcess().Id;
        Console.WriteLine("PID " + pid);
        Console.WriteLine("READY");
        Console.Out.Flush();
        string map = "/tmp/perf-" + pid + ".map";
        var total = Stopwatch.StartNew();
        ulong x = 1;
        while (total.Elapsed.TotalSeconds < seconds)
        {
            x = Spin(x);
            if (File.Exists(map))
            {
                Console.WriteLine("ATTACHED " + total.ElapsedMilliseconds);
                Console.Out.Flush();
                return x == 0 ? 1 : 0;
            }
        }
        Console.WriteLine("NOT_ATTACHED");
        return 0;
    }
}
