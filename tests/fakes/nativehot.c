/* The C library of tests/workloads/NativeHot.cs. Built with -g, its debug
 * info split off and the library stripped by tests/tests/end_to_end/native_debug_files.rs.
 * The hot functions are static (in no dynamic symbol table): only the debug
 * file names them. Frame pointers kept so every unwinder walks through. */
#include <stdint.h>

static __attribute__((noinline)) uint64_t nativehot_mix_inner(uint64_t x)
{
    for (int i = 0; i < 64; i++)
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    __asm__ volatile("" : "+r"(x));
    return x;
}

static __attribute__((noinline)) uint64_t nativehot_mix_outer(uint64_t x, int rounds)
{
    for (int i = 0; i < rounds; i++)
        x = nativehot_mix_inner(x ^ (uint64_t)i);
    __asm__ volatile("" : "+r"(x));
    return x;
}

uint64_t nativehot_spin(uint64_t x, int rounds)
{
    return nativehot_mix_outer(x, rounds / 64);
}
