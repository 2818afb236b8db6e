/* A process that poses as .NET 8 and makes every frame expensive to name
 * from its memory, and the name fail (issue 33, defect 3).
 *
 * It maps a libcoreclr.so (built beside it, under a shared framework path
 * with a CoreLib file) whose exported g_dacTable points at a crafted
 * RangeSectionMap: every entry of all five levels leads to one fragment
 * that covers a 64 MiB anonymous executable "code heap" whose nibble map is
 * all zeros. Naming a PC in it walks the map, the fragment, the section and
 * the heap list, then the nibble map backwards over 8192 DWORDs (128 reads
 * of 256 bytes) and fails: 64 fragments are followed first, about 200
 * process_vm_readv calls a frame.
 *
 * Its spinning threads run code in that heap with rbp at a chain of 127
 * frames whose return addresses, all in the heap, a thread rewrites every
 * millisecond: every sample is a new 128-frame stack of failing lookups.
 *
 * With `list` (a runtime under a 7.0 path), slot 0 is instead a .NET 7
 * RangeSection list that loops on itself: a lookup follows it to the walk's
 * bound, 4096 sections of 3 reads each, and fails.
 *
 * Usage: crafted_code_heap SECONDS FRAMEWORK_DIR map|list, the directory
 * holding libcoreclr.so and System.Private.CoreLib.dll. Prints PID and
 * READY. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define HEAP_SIZE (64ul << 20)
#define FRAMES 127
#define THREADS 2

static uint8_t *heap;
static uint64_t *chains[THREADS];

static uint64_t *words(size_t n) {
    void *p = mmap(NULL, n * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    return p;
}

static void *spin(void *arg) {
    long t = (long)arg;
    /* Enter the heap's stub: mov rbp, chain; jmp $ (never returns). */
    void (*code)(void) = (void (*)(void))(heap + t * 64);
    code();
    return NULL;
}

static uint64_t next_random(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

static void rewrite(uint64_t *chain, uint64_t *state) {
    for (int i = 0; i < FRAMES; i++) {
        uint64_t offset = 4096 + next_random(state) % (HEAP_SIZE - 8192);
        chain[i * 2 + 1] = (uint64_t)heap + (offset & ~3ul);
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s SECONDS FRAMEWORK_DIR map|list\n", argv[0]);
        return 2;
    }
    int seconds = atoi(argv[1]);
    char path[4096];
    /* Looked up, not linked: a copy relocation would leave the library's
     * own g_dacTable, the one clrbpf reads, zero. */
    snprintf(path, sizeof path, "%s/libcoreclr.so", argv[2]);
    void *runtime = dlopen(path, RTLD_NOW);
    uint64_t *g_dacTable = runtime ? dlsym(runtime, "g_dacTable") : NULL;
    if (!g_dacTable) {
        fprintf(stderr, "no g_dacTable in %s: %s\n", path, dlerror());
        return 1;
    }
    snprintf(path, sizeof path, "%s/System.Private.CoreLib.dll", argv[2]);
    int fd = open(path, O_RDONLY);
    if (fd < 0 || mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, fd, 0) == MAP_FAILED) {
        perror("map CoreLib");
        return 1;
    }
    heap = mmap(NULL, HEAP_SIZE, PROT_READ | PROT_WRITE | PROT_EXEC,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    uint8_t *nibbles = mmap(NULL, HEAP_SIZE / 64, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (heap == MAP_FAILED || nibbles == MAP_FAILED) {
        perror("mmap heap");
        return 1;
    }
    /* HeapList: startAddress 0x10, endAddress 0x18, mapBase 0x20, pHdrMap 0x28. */
    uint64_t *heap_list = words(8);
    heap_list[2] = (uint64_t)heap;
    heap_list[3] = (uint64_t)heap + HEAP_SIZE;
    heap_list[4] = (uint64_t)heap;
    heap_list[5] = (uint64_t)nibbles;
    /* RangeSection: begin, end, flags (0x10: code heap), pHeapList (0x28). */
    uint64_t *section = words(8);
    section[0] = (uint64_t)heap;
    section[1] = (uint64_t)heap + HEAP_SIZE;
    section[2] = 2;
    section[5] = (uint64_t)heap_list;
    uint64_t *fragment = words(4);
    fragment[1] = (uint64_t)heap;
    fragment[2] = (uint64_t)heap + HEAP_SIZE;
    fragment[3] = (uint64_t)section;
    /* 63 empty fragments before it: the longest list a lookup follows. */
    for (int i = 0; i < 63; i++) {
        uint64_t *empty = words(4);
        empty[0] = (uint64_t)fragment;
        fragment = empty;
    }
    uint64_t *next = fragment;
    for (int level = 0; level < 5; level++) {
        uint64_t *node = words(256);
        for (int i = 0; i < 256; i++)
            node[i] = (uint64_t)next;
        next = node;
    }
    g_dacTable[0] = (uint64_t)next;
    if (strcmp(argv[3], "list") == 0) {
        /* .NET 6/7: slot 0 is the address of the RangeSection list's head;
         * one empty section whose next (0x18) is itself. */
        uint64_t *head = words(1);
        uint64_t *looped = words(8);
        looped[3] = (uint64_t)looped;
        head[0] = (uint64_t)looped;
        g_dacTable[0] = (uint64_t)head;
    }

    uint64_t state = 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    for (long t = 0; t < THREADS; t++) {
        uint64_t *chain = words(FRAMES * 2 + 2);
        for (int i = 0; i < FRAMES; i++)
            chain[i * 2] = i + 1 < FRAMES ? (uint64_t)&chain[(i + 1) * 2] : 0;
        rewrite(chain, &state);
        chains[t] = chain;
        uint8_t *stub = heap + t * 64;
        stub[0] = 0x48;
        stub[1] = 0xbd; /* mov rbp, imm64 */
        memcpy(stub + 2, &chain, 8);
        stub[10] = 0xeb;
        stub[11] = 0xfe; /* jmp $ */
    }
    for (long t = 0; t < THREADS; t++) {
        pthread_t thread;
        pthread_create(&thread, NULL, spin, (void *)t);
    }
    printf("PID %d\nREADY\n", getpid());
    fflush(stdout);
    struct timespec start, now, ms = {0, 1000000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    do {
        for (int t = 0; t < THREADS; t++)
            rewrite(chains[t], &state);
        nanosleep(&ms, NULL);
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while (now.tv_sec - start.tv_sec < seconds);
    return 0;
}
