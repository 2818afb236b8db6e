// NativeHot: a loop calling into a C library of the test's own through
// P/Invoke (libnativehot.so, found through LD_LIBRARY_PATH), for the native
// debug-file tests. The library's hot functions are static, so once it is
// stripped only its debug file names them.
//
// Usage: NativeHot.dll [SECONDS=5]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;

static class NativeHot
{
    [DllImport("nativehot")]
    static extern ulong nativehot_spin(ulong x, int rounds);

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong CallNative(ulong x)
    {
        return nativehot_spin(x, 200000);
    }

    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        ulong x = 1;
        long calls = 0;
        var total = Stopwatch.StartNew();
        x = CallNative(x);
        Console.WriteLine("READY");
        Console.Out.Flush();
        while (total.Elapsed.TotalSeconds < seconds)
        {
            x = CallNative(x);
            calls++;
        }
        Console.WriteLine("CALLS " + calls);
        Console.WriteLine("CHECKSUM " + x);
        return 0;
    }
}
