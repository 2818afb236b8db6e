// Dynamic: code with no metadata behind it, for the memory name path's
// dynamic methods. Before READY it makes and runs an LCG method
// (DynamicMethod "SquareLcg"), a reflection invoke stub (MethodInfo.Invoke
// of Twice, compiled by the runtime as `InvokeStub_Dynamic.Twice` after a
// few calls) and a P/Invoke IL stub (strlen with a marshalled string,
// `IL_STUB_PInvoke`); then it keeps calling them.
//
// Usage: Dynamic.dll [SECONDS=5]
using System;
using System.Diagnostics;
using System.Globalization;
using System.Reflection;
using System.Reflection.Emit;
using System.Runtime.InteropServices;

static class Dynamic
{
    [DllImport("libc", CharSet = CharSet.Ansi)]
    static extern IntPtr strlen(string s);

    public static int Twice(int x)
    {
        return x * 2;
    }

    static long Round(Func<int, int> square, MethodInfo twice)
    {
        long sum = 0;
        for (int i = 0; i < 100; i++)
        {
            sum += square(i);
            sum += (int)twice.Invoke(null, new object[] { i });
            sum += (long)strlen("dynamic");
        }
        return sum;
    }

    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        var method = new DynamicMethod("SquareLcg", typeof(int), new[] { typeof(int) });
        var il = method.GetILGenerator();
        il.Emit(OpCodes.Ldarg_0);
        il.Emit(OpCodes.Ldarg_0);
        il.Emit(OpCodes.Mul);
        il.Emit(OpCodes.Ret);
        var square = (Func<int, int>)method.CreateDelegate(typeof(Func<int, int>));
        MethodInfo twice = typeof(Dynamic).GetMethod("Twice");
        long sum = Round(square, twice);
        Console.WriteLine("READY");
        Console.Out.Flush();
        var clock = Stopwatch.StartNew();
        while (clock.Elapsed.TotalSeconds < seconds)
            sum += Round(square, twice);
        Console.WriteLine("SUM " + sum);
        return 0;
    }
}
