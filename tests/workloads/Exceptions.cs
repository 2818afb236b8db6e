// Exceptions: throws and catches three exception types at very different
// rates (default 20000 InvalidOperationException, 300 ArgumentException,
// 1 TimeoutException), spread evenly, and prints the exact counts
// (THROWN_<Type>), the ground truth for clrbpf's exceptions/count.
//
// Usage: Exceptions.dll [START_DELAY_S=3] [FREQUENT=20000] [SOMETIMES=300] [ONCE=1]
//                       [FREQUENT_MESSAGE=frequent] [IGNORED] [LINGER_S=1] [SPREAD_S=0]
// SPREAD_S > 0 paces the throws over about that many seconds (a pause
// after each 1% of them); 0 throws as fast as it can.
// It lives LINGER_S after its last throw: the runtime's exception counter
// must write a value after it for a profiler whose events were off to see
// it (the agent reads the counter every 5 s).
// At its exit it prints THROWN_OTHER: the first-chance exceptions of other
// types the process saw over its life (the runtime throws some of its own:
// .NET Core 3.1's working-set counter reads /proc/PID/task/TID/stat of
// threads that may have exited), which the runtime's counter counts too.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.ExceptionServices;
using System.Threading;

static class Exceptions
{
    static string frequentMessage = "frequent";

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void ThrowFrequent(int i) { throw new InvalidOperationException(frequentMessage + " " + (i % 10)); }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void ThrowSometimes(int i) { throw new ArgumentException("sometimes"); }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void ThrowOnce() { throw new TimeoutException("once"); }

    static long others;

    static void CountOthers(object sender, FirstChanceExceptionEventArgs e)
    {
        Type t = e.Exception.GetType();
        if (t == typeof(InvalidOperationException) || t == typeof(ArgumentException) || t == typeof(TimeoutException))
            return;
        Interlocked.Increment(ref others);
        Console.Error.WriteLine("OTHER_EXCEPTION " + t.FullName + ": " + e.Exception.Message);
    }

    static int Main(string[] args)
    {
        AppDomain.CurrentDomain.FirstChanceException += CountOthers;
        double delay = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3;
        int frequent = args.Length > 1 ? int.Parse(args[1]) : 20000;
        int sometimes = args.Length > 2 ? int.Parse(args[2]) : 300;
        int once = args.Length > 3 ? int.Parse(args[3]) : 1;
        if (args.Length > 4) frequentMessage = args[4];
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep((int)(delay * 1000));
        double spread = args.Length > 7 ? double.Parse(args[7], CultureInfo.InvariantCulture) : 0;
        long nFrequent = 0, nSometimes = 0, nOnce = 0;
        var sw = Stopwatch.StartNew();
        int step = Math.Max(1, frequent / 100);
        for (int i = 0; i < frequent; i++)
        {
            if (spread > 0 && i % step == 0)
            {
                int ahead = (int)((double)i / frequent * spread * 1000 - sw.ElapsedMilliseconds);
                if (ahead > 0) Thread.Sleep(ahead);
            }
            try { ThrowFrequent(i); } catch (InvalidOperationException) { nFrequent++; }
            if (sometimes > 0 && (long)i * sometimes / frequent != (long)(i + 1) * sometimes / frequent)
            {
                try { ThrowSometimes(i); } catch (ArgumentException) { nSometimes++; }
            }
            if (i == frequent / 2)
            {
                for (int k = 0; k < once; k++)
                {
                    try { ThrowOnce(); } catch (TimeoutException) { nOnce++; }
                }
            }
        }
        Console.WriteLine("THROWN_System.InvalidOperationException " + nFrequent);
        Console.WriteLine("THROWN_System.ArgumentException " + nSometimes);
        Console.WriteLine("THROWN_System.TimeoutException " + nOnce);
        Console.WriteLine("THROWS_PER_S " + (long)((nFrequent + nSometimes + nOnce) / sw.Elapsed.TotalSeconds));
        Console.Out.Flush();
        double linger = args.Length > 6 ? double.Parse(args[6], CultureInfo.InvariantCulture) : 1;
        Thread.Sleep((int)(linger * 1000));
        Console.WriteLine("THROWN_OTHER " + Interlocked.Read(ref others));
        Console.Out.Flush();
        return 0;
    }
}
