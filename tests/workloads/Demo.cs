// Demo: a small order-processing pipeline for `cargo xtask demo`. Two
// worker threads repeatedly generate a batch of CSV order lines, parse them,
// hash the customer names, sort the orders and total them per customer, so
// the flame graph shows a few named managed methods with realistic shares,
// string and array allocations, and some GC work.
//
// Usage: Demo.dll [SECONDS=10]
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Text;
using System.Threading;

sealed class Order
{
    public int Id;
    public string Customer;
    public int Quantity;
    public decimal Price;
    public uint CustomerHash;
}

static class Demo
{
    static readonly string[] Customers =
    {
        "Contoso", "Fabrikam", "Northwind", "Tailspin", "Wingtip", "Adventure Works", "Litware", "Proseware",
    };

    [MethodImpl(MethodImplOptions.NoInlining)]
    static string[] Generate(Random random, int count)
    {
        var lines = new string[count];
        var builder = new StringBuilder();
        for (int i = 0; i < count; i++)
        {
            builder.Clear();
            builder.Append(i).Append(',')
                .Append(Customers[random.Next(Customers.Length)]).Append(',')
                .Append(random.Next(1, 50)).Append(',')
                .Append((random.Next(100, 100000) / 100.0).ToString(CultureInfo.InvariantCulture));
            lines[i] = builder.ToString();
        }
        return lines;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static Order Parse(string line)
    {
        string[] fields = line.Split(',');
        return new Order
        {
            Id = int.Parse(fields[0], CultureInfo.InvariantCulture),
            Customer = fields[1],
            Quantity = int.Parse(fields[2], CultureInfo.InvariantCulture),
            Price = decimal.Parse(fields[3], CultureInfo.InvariantCulture),
        };
    }

    // FNV-1a, repeated to make hashing a visible share of the profile.
    [MethodImpl(MethodImplOptions.NoInlining)]
    static uint Hash(string text)
    {
        uint hash = 2166136261;
        for (int round = 0; round < 64; round++)
            foreach (char c in text)
                hash = (hash ^ c) * 16777619;
        return hash;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Sort(Order[] orders)
    {
        Array.Sort(orders, (a, b) =>
        {
            int byHash = a.CustomerHash.CompareTo(b.CustomerHash);
            return byHash != 0 ? byHash : (b.Price * b.Quantity).CompareTo(a.Price * a.Quantity);
        });
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static Dictionary<string, decimal> Summarize(Order[] orders)
    {
        var totals = new Dictionary<string, decimal>();
        foreach (var order in orders)
        {
            decimal total;
            totals.TryGetValue(order.Customer, out total);
            totals[order.Customer] = total + order.Price * order.Quantity;
        }
        return totals;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void ProcessBatch(Random random, int size, long[] batches)
    {
        string[] lines = Generate(random, size);
        var orders = new Order[lines.Length];
        for (int i = 0; i < lines.Length; i++)
        {
            orders[i] = Parse(lines[i]);
            orders[i].CustomerHash = Hash(orders[i].Customer);
        }
        Sort(orders);
        Summarize(orders);
        batches[0]++;
    }

    static volatile bool stop;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Worker(object state)
    {
        var batches = (long[])state;
        var random = new Random(batches.GetHashCode());
        while (!stop)
            ProcessBatch(random, 2000, batches);
    }

    static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 10;
        Console.WriteLine("PID " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        var counters = new long[2][];
        var workers = new Thread[2];
        for (int i = 0; i < workers.Length; i++)
        {
            counters[i] = new long[1];
            workers[i] = new Thread(Worker) { Name = "demo-worker-" + i };
            workers[i].Start(counters[i]);
        }
        Console.WriteLine("READY");
        Console.Out.Flush();
        Thread.Sleep(TimeSpan.FromSeconds(seconds));
        stop = true;
        long total = 0;
        foreach (var w in workers)
            w.Join();
        foreach (var c in counters)
            total += c[0];
        Console.WriteLine("BATCHES " + total);
        return 0;
    }
}
