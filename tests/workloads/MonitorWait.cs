// MonitorWait: one thread holds a lock forever, another blocks taking it
// (`Waiter.TakeLock`, called by `Waiter.Run`) and prints `TID waiter N`
// (its kernel thread id) just before: a .NET thread parked in
// `Monitor.Enter` for the stack-replay tests. Runs until killed.
//
// Usage: MonitorWait.dll
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;

static class MonitorWait
{
    public static readonly object Gate = new object();

    static void Main()
    {
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        var held = new ManualResetEvent(false);
        var owner = new Thread(() => { lock (Gate) { held.Set(); Thread.Sleep(Timeout.Infinite); } });
        owner.IsBackground = true;
        owner.Start();
        held.WaitOne();
        Console.WriteLine("READY");
        Console.Out.Flush();
        var waiter = new Thread(Waiter.Run);
        waiter.Start();
        waiter.Join();
    }
}

static class Waiter
{
    [DllImport("libc")] static extern int gettid();

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Run()
    {
        Console.WriteLine("TID waiter " + gettid());
        Console.Out.Flush();
        TakeLock();
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void TakeLock()
    {
        lock (MonitorWait.Gate) { Console.WriteLine("never"); }
    }
}
