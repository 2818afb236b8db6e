using System;
using System.Threading;

namespace Demo
{
    class TooHotException : Exception { public TooHotException(string m) : base(m) {} }

    static class Worker
    {
        static readonly object Gate = new object();
        static long total;

        static long Spin(long n)
        {
            long s = 0;
            for (long i = 0; i < n; i++) s += i ^ (s >> 3);
            return s;
        }

        static void Contend()
        {
            while (true)
            {
                lock (Gate)
                {
                    total += Spin(200000);
                    Thread.Sleep(20);
                }
                Thread.Sleep(1);
            }
        }

        static void Thrower()
        {
            int i = 0;
            while (true)
            {
                try
                {
                    if (i % 3 == 0) throw new InvalidOperationException("bad state " + i);
                    else if (i % 3 == 1) throw new TooHotException("too hot " + i);
                    else throw new ArgumentException("bad arg");
                }
                catch (Exception) {}
                i++;
                Thread.Sleep(100);
            }
        }

        static void Main(string[] args)
        {
            Console.WriteLine(System.Diagnostics.Process.GetCurrentProcess().Id);
            for (int t = 0; t < 3; t++) new Thread(Contend) { IsBackground = true }.Start();
            new Thread(Thrower) { IsBackground = true }.Start();
            Thread.Sleep(int.Parse(args.Length > 0 ? args[0] : "60") * 1000);
        }
    }
}
