// Metadata test assembly for symbolize/clr_metadata (built by build-names.sh
// with mcs): namespaces, nested and generic types, constructors, lambdas.
using System;
using System.Collections.Generic;

namespace Shop.Orders
{
    public class Program
    {
        public static int Main(string[] args)
        {
            Func<string, int> len = s => s.Length;
            return len("x") + new Outer.Inner().M(1) + (int)Work(new List<int>());
        }

        public static long Work<T>(List<T> items) { return items.Count; }
    }

    public class Outer
    {
        public class Inner
        {
            public int M(long x) { return (int)x; }

            public class Deepest
            {
                public void Deep() { }
            }
        }

        public class Box<T>
        {
            private T value = default(T);
            public T Get() { return value; }
        }
    }
}

public class NoNamespace
{
    public static void Run() { }
}
