// Ratio: one thread alternating between HotA and HotB, about 3:1 in CPU
// time. The test compares the profile's HotA share with the share this
// program measures itself (the thread's CPU time around each call, from
// clock_gettime(CLOCK_THREAD_CPUTIME_ID)), printed at the end as
// `RATIO_A 0.7512`. CPU time, not wall time: on a loaded host a Stopwatch
// split moved from 0.73 to 0.77 while the CPU split stayed at 0.73.
//
// Each call's length is drawn at random (HotA 3-4 units, HotB 1-1.33): with
// fixed lengths a round took 0.534 ms and the 2.004 ms sampling period at
// 499 Hz was 3.75 rounds, so the samples fell on four phases of the round
// that drifted slowly, and a 5 s profile missed the split by 3-5 points.
//
// Usage: Ratio.dll [SECONDS=5]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;

static class Ratio
{
    const int Unit = 100000;

    [StructLayout(LayoutKind.Sequential)]
    struct Timespec
    {
        public long Sec;
        public long Nsec;
    }

    const int CLOCK_THREAD_CPUTIME_ID = 3;

    [DllImport("libc")]
    static extern int clock_gettime(int clock, out Timespec time);

    /// This thread's CPU time in nanoseconds.
    static long ThreadCpuNanos()
    {
        Timespec time;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, out time);
        return time.Sec * 1000000000L + time.Nsec;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong HotA(ulong x, int n)
    {
        for (int i = 0; i < n; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong HotB(ulong x, int n)
    {
        for (int i = 0; i < n; i++)
            x = x * 6364136223846793005UL + 1442695040888963407UL;
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        ulong x = 1;
        // xorshift64 draws the call lengths.
        ulong draw = 88172645463325252UL;
        long inA = 0, inB = 0, rounds = 0;
        var total = Stopwatch.StartNew();
        Console.WriteLine("READY");
        Console.Out.Flush();
        while (total.Elapsed.TotalSeconds < seconds)
        {
            draw ^= draw << 13;
            draw ^= draw >> 7;
            draw ^= draw << 17;
            int lengthA = 3 * Unit + (int)(draw % Unit);
            int lengthB = Unit + (int)((draw >> 32) % (Unit / 3));
            long t0 = ThreadCpuNanos();
            x = HotA(x, lengthA);
            long t1 = ThreadCpuNanos();
            x = HotB(x, lengthB);
            long t2 = ThreadCpuNanos();
            inA += t1 - t0;
            inB += t2 - t1;
            rounds++;
        }
        double ratioA = inA / (double)(inA + inB);
        Console.WriteLine("ROUNDS " + rounds);
        Console.WriteLine("SECONDS_A " + (inA / 1e9).ToString("F4", CultureInfo.InvariantCulture));
        Console.WriteLine("SECONDS_B " + (inB / 1e9).ToString("F4", CultureInfo.InvariantCulture));
        Console.WriteLine("RATIO_A " + ratioA.ToString("F4", CultureInfo.InvariantCulture));
        Console.WriteLine("CHECKSUM " + x);
        return 0;
    }
}
