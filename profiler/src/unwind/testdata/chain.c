/*
 * A known native call chain for clrbpf's unwinder replay tests:
 * main -> a -> b -> c, built by build-chain.sh with -O2 -fomit-frame-pointer
 * so only .eh_frame can unwind it. The mode (argv[1]) says where the stack
 * is captured:
 *   0: c blocks in pause()           (leaf in libc, no frame pointers)
 *   1: c spins                       (leaf in c itself)
 *   2: c signals itself; the handler blocks in pause()
 *      (pause <- on_signal <- __restore_rt <- kill <- c <- b <- a <- main)
 * "ready" is written to stdout just before the capture point.
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile unsigned long sink;
static int mode;

static void ready(void) {
    static const char msg[] = "ready\n";
    if (write(1, msg, sizeof msg - 1) < 0)
        _exit(3);
}

static void on_signal(int sig) {
    (void)sig;
    ready();
    for (;;)
        pause();
}

__attribute__((noinline)) unsigned long c(unsigned long x) {
    /* Locals keep the frame (and so the CFA offset) non-trivial. */
    volatile char buf[200];
    memset((char *)buf, (int)x, sizeof buf);
    switch (mode) {
    case 0:
        ready();
        pause();
        break;
    case 1:
        ready();
        for (;;)
            sink += x;
    default:
        kill(getpid(), SIGUSR1);
        break;
    }
    return x + buf[3] + sink;
}

__attribute__((noinline)) unsigned long b(unsigned long x) {
    unsigned long r = c(x * 3 + 1);
    sink += r;
    return r ^ x;
}

__attribute__((noinline)) unsigned long a(unsigned long x) {
    unsigned long r = b(x + 7);
    sink += r;
    return r * 5;
}

int main(int argc, char **argv) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGUSR1, &sa, NULL);
    mode = argc > 1 ? atoi(argv[1]) : 0;
    return (int)a((unsigned long)argc);
}
