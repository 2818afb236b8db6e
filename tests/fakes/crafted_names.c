/* A process that poses as .NET 8 and makes the memory path's caches grow
 * (issue 33, defects 5 and 6): its runtime's structures are well formed,
 * so every lookup succeeds and what it finds is cached.
 *
 * It maps a libcoreclr.so (built beside it, under a shared framework path
 * with a CoreLib file) whose exported g_dacTable points at a
 * RangeSectionMap whose entries all lead to one fragment: a code heap of
 * 32-byte code blocks, each with its code header, RealCodeHeader,
 * MethodDesc and MethodDescChunk, and a nibble map that places them all.
 * Its threads spin with rbp at chains of 127 frames whose return
 * addresses are in those blocks.
 *
 *   images DLL DIR  16 methods, each of its own module in an image of its
 *                   own: DIR/ImageN.dll, a copy of DLL (any IL assembly)
 *                   whose CLI header claims 64 MiB of metadata, a sparse
 *                   file that costs nothing on disk. A second thread's
 *                   frames alternate between two more, DIR/ThrashA.dll and
 *                   DIR/ThrashB.dll, mapped executable, whose 20 MiB of
 *                   metadata are over an image's share of the assembly
 *                   cache (a ReadyToRun image to the profiler).
 *   names           65,536 dynamic methods (LCG), each with a name of 511
 *                   bytes that are not UTF-8 (3x once made UTF-8); the
 *                   chains are rewritten every millisecond, so that the
 *                   samples reach every block.
 *
 * Usage: crafted_names SECONDS FRAMEWORK_DIR images DLL DIR | names.
 * Prints PID and READY. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FRAMES 127
#define THREADS 2
#define BLOCK 32
/* Blocks start past the spinning threads' stubs. */
#define FIRST_BLOCK 4096
#define IMAGES 16
#define IMAGE_METADATA (64u << 20)
#define THRASH_METADATA (20u << 20)
#define NAMES 65536
#define NAME_BYTES 511

static uint8_t *heap;
static size_t blocks;
static uint64_t *chains[THREADS];
static uint64_t thrash[2];

static void *zeroed(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    return p;
}

static uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* Writes `path`: the assembly `dll` whose metadata directory claims
 * `metadata` bytes, its section grown to hold them (sparse). */
static void write_image(const uint8_t *dll, size_t len, const char *path, uint32_t metadata) {
    uint8_t *copy = malloc(len);
    memcpy(copy, dll, len);
    uint32_t pe = u32_at(copy + 0x3c);
    unsigned sections = copy[pe + 6] | copy[pe + 7] << 8;
    unsigned optional_size = copy[pe + 20] | copy[pe + 21] << 8;
    uint8_t *optional = copy + pe + 24;
    uint8_t *directories = optional + ((optional[0] | optional[1] << 8) == 0x20b ? 112 : 96);
    uint32_t cli = u32_at(directories + 8 * 14);
    uint8_t *table = optional + optional_size;
    for (unsigned i = 0; i < sections; i++) {
        uint8_t *s = table + 40 * i;
        uint32_t va = u32_at(s + 12), raw = u32_at(s + 16), offset = u32_at(s + 20);
        if (cli < va || cli >= va + raw)
            continue;
        uint8_t *header = copy + offset + (cli - va);
        uint32_t root = u32_at(header + 8);
        put_u32(header + 12, metadata);
        uint32_t grown = root - va + metadata;
        put_u32(s + 8, grown);
        put_u32(s + 16, grown);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || write(fd, copy, len) != (ssize_t)len || ftruncate(fd, offset + grown) != 0) {
            perror(path);
            exit(1);
        }
        close(fd);
        free(copy);
        return;
    }
    fprintf(stderr, "%s: no section holds the CLI header\n", path);
    exit(1);
}

/* Maps the whole file at `path` with `prot`. */
static uint8_t *map_file(const char *path, int prot) {
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(path);
        exit(1);
    }
    uint8_t *p = mmap(NULL, st.st_size, prot, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
        perror(path);
        exit(1);
    }
    close(fd);
    return p;
}

static uint8_t *read_file(const char *path, size_t *len) {
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(path);
        exit(1);
    }
    uint8_t *data = malloc(st.st_size);
    if (read(fd, data, st.st_size) != st.st_size) {
        perror(path);
        exit(1);
    }
    close(fd);
    *len = st.st_size;
    return data;
}

static uint64_t block_start(size_t i) { return (uint64_t)heap + FIRST_BLOCK + i * BLOCK; }

/* Block `i`'s method: MethodDescChunk at 0 (MethodTable `method_table`),
 * MethodDesc at 0x18 (token 0x06000001, `classification`, the dynamic
 * name pointer at MethodDesc + 0x18), RealCodeHeader at 0x40. */
static void put_method(size_t i, uint64_t method_table, uint16_t classification, const char *name) {
    uint8_t *record = zeroed(128);
    uint64_t *words = (uint64_t *)record;
    uint8_t *md = record + 0x18;
    words[0] = method_table;
    md[0] = 1; /* token remainder: 0x06000001 */
    md[6] = classification;
    words[6] = (uint64_t)name;       /* md + 0x18 */
    words[11] = (uint64_t)md;        /* RealCodeHeader (0x40) + 0x18 */
    uint64_t header = (uint64_t)(record + 0x40);
    memcpy((void *)(block_start(i) - 8), &header, 8);
}

/* The RangeSectionMap, the code heap's HeapList and its nibble map. */
static uint64_t code_range_map(void) {
    size_t bytes = FIRST_BLOCK + blocks * BLOCK;
    uint32_t *nibbles = zeroed(bytes / BLOCK / 8 * 4 + 4096);
    /* One block starts at each bucket: nibble 1 in each. */
    for (size_t d = FIRST_BLOCK / BLOCK / 8; d < bytes / BLOCK / 8; d++)
        nibbles[d] = 0x11111111u;
    uint64_t *heap_list = zeroed(64);
    heap_list[2] = (uint64_t)heap;
    heap_list[3] = (uint64_t)heap + bytes;
    heap_list[4] = (uint64_t)heap;
    heap_list[5] = (uint64_t)nibbles;
    uint64_t *section = zeroed(64);
    section[0] = (uint64_t)heap;
    section[1] = (uint64_t)heap + bytes;
    section[2] = 2; /* RangeSection.Flags: code heap */
    section[5] = (uint64_t)heap_list;
    uint64_t *fragment = zeroed(32);
    fragment[1] = (uint64_t)heap;
    fragment[2] = (uint64_t)heap + bytes;
    fragment[3] = (uint64_t)section;
    uint64_t next = (uint64_t)fragment;
    for (int level = 0; level < 5; level++) {
        uint64_t *node = zeroed(256 * 8);
        for (int i = 0; i < 256; i++)
            node[i] = next;
        next = (uint64_t)node;
    }
    return next;
}

static void *spin(void *arg) {
    long t = (long)arg;
    /* The stub: mov rbp, chain; jmp $ (never returns). */
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

/* Return addresses of thread `t`'s chain: `images` cycles over the
 * blocks (thread 0) or alternates between the two thrash images (thread
 * 1); `names` picks blocks at random. */
static void rewrite(int t, int images, uint64_t *state) {
    uint64_t *chain = chains[t];
    for (int i = 0; i < FRAMES; i++) {
        uint64_t pc;
        if (images && t == 1)
            pc = thrash[i % 2];
        else if (images)
            pc = block_start(i % blocks) + 8;
        else
            pc = block_start(next_random(state) % blocks) + 8;
        chain[i * 2 + 1] = pc;
    }
}

static void load_runtime(const char *framework) {
    char path[4096];
    /* Looked up, not linked: a copy relocation would leave the library's
     * own g_dacTable, the one clrbpf reads, zero. */
    snprintf(path, sizeof path, "%s/libcoreclr.so", framework);
    void *runtime = dlopen(path, RTLD_NOW);
    uint64_t *g_dacTable = runtime ? dlsym(runtime, "g_dacTable") : NULL;
    if (!g_dacTable) {
        fprintf(stderr, "no g_dacTable in %s: %s\n", path, dlerror());
        exit(1);
    }
    snprintf(path, sizeof path, "%s/System.Private.CoreLib.dll", framework);
    int fd = open(path, O_RDONLY);
    if (fd < 0 || mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, fd, 0) == MAP_FAILED) {
        perror("map CoreLib");
        exit(1);
    }
    g_dacTable[0] = code_range_map();
}

static void images_attack(const char *dll_path, const char *dir) {
    size_t len;
    uint8_t *dll = read_file(dll_path, &len);
    char path[4096];
    for (size_t i = 0; i < IMAGES; i++) {
        snprintf(path, sizeof path, "%s/Image%zu.dll", dir, i);
        write_image(dll, len, path, IMAGE_METADATA);
        uint8_t *image = map_file(path, PROT_READ);
        /* Module::m_pSimpleName (0x108) points into the image. */
        uint64_t *module = zeroed(0x110);
        module[0x108 / 8] = (uint64_t)image + 0x200;
        uint64_t *method_table = zeroed(0x20);
        method_table[3] = (uint64_t)module;
        put_method(i, (uint64_t)method_table, 0, NULL);
    }
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/Thrash%c.dll", dir, 'A' + i);
        write_image(dll, len, path, THRASH_METADATA);
        thrash[i] = (uint64_t)map_file(path, PROT_READ | PROT_EXEC) + 0x1100;
    }
}

static void names_attack(void) {
    char *names = zeroed((size_t)NAMES * (NAME_BYTES + 1));
    for (size_t i = 0; i < NAMES; i++) {
        char *name = names + i * (NAME_BYTES + 1);
        int prefix = snprintf(name, NAME_BYTES, "M%05zx", i);
        memset(name + prefix, 0xff, NAME_BYTES - prefix);
        put_method(i, 0, 7, name); /* mcDynamic */
    }
}

int main(int argc, char **argv) {
    int images = argc >= 6 && strcmp(argv[3], "images") == 0;
    if (!images && !(argc >= 4 && strcmp(argv[3], "names") == 0)) {
        fprintf(stderr, "usage: %s SECONDS FRAMEWORK_DIR images DLL DIR | names\n", argv[0]);
        return 2;
    }
    int seconds = atoi(argv[1]);
    blocks = images ? IMAGES : NAMES;
    heap = mmap(NULL, FIRST_BLOCK + blocks * BLOCK, PROT_READ | PROT_WRITE | PROT_EXEC,
                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (heap == MAP_FAILED) {
        perror("mmap heap");
        return 1;
    }
    if (images)
        images_attack(argv[4], argv[5]);
    else
        names_attack();
    load_runtime(argv[2]);

    uint64_t state = 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    for (long t = 0; t < THREADS; t++) {
        uint64_t *chain = zeroed((FRAMES * 2 + 2) * 8);
        for (int i = 0; i < FRAMES; i++)
            chain[i * 2] = i + 1 < FRAMES ? (uint64_t)&chain[(i + 1) * 2] : 0;
        chains[t] = chain;
        rewrite(t, images, &state);
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
        if (!images)
            for (int t = 0; t < THREADS; t++)
                rewrite(t, 0, &state);
        nanosleep(&ms, NULL);
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while (now.tv_sec - start.tv_sec < seconds);
    return 0;
}
