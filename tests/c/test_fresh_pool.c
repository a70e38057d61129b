/*
 * test_fresh_pool.c — a new pool's first calls take no page fault. Its host metadata (block
 * records, slab bitmaps, a CUDA pool's granule records) and the first calling thread's cache are
 * faulted in when the pool is made, so the first allocation runs as the millionth does: the
 * minor faults getrusage counts across the first allocations and frees of a fresh pool of each
 * kind must be 0. A count, not a time.
 *
 * Each pool is made in a child process of its own, whose heap, stack and pool are all new. What
 * the test itself writes during the count (its arrays, its stack) is touched before it starts.
 * Under AddressSanitizer or ThreadSanitizer every access also reads shadow memory the kernel
 * commits on first touch, so there the calls are made and checked but their faults not counted.
 * A KV cache is not among the kinds: its sequences' block tables grow on the process heap, a
 * few faults in thousands of sequences, which are the KV manager's and not the pool's.
 *
 * argv[1]: the fake CUDA driver (tests/fake_cuda), for the CUDA pool.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <inttypes.h>

#include "check.h"
#include "child.h"
#include "kvalloc.h"
#include "os.h"
#include "size_class.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FAULTS_ARE_COUNTABLE 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FAULTS_ARE_COUNTABLE 0
#endif
#endif
#ifndef FAULTS_ARE_COUNTABLE
#define FAULTS_ARE_COUNTABLE 1
#endif

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

/* Small objects: SMALL_OBJECTS live at the end of each round, cycling through every size class,
 * then freed in a scrambled order. Large blocks: each allocation of 1 .. 64 MiB (at most a
 * sixteenth of the pool) replaces a random one of LARGE_LIVE live blocks, as in issue #20, with
 * at most half the pool live. */
#define SMALL_OBJECTS 2000
#define SMALL_ROUNDS 2
#define LARGE_CALLS 20000
/* Faults the kernel may add on its own to a phase on a busy machine: a page moved by memory
 * compaction, or collapsed into a huge page, faults once at its next touch (1 in about 30 runs
 * here under load). Metadata committed on first touch takes hundreds per phase. */
#define KERNEL_FAULTS 2
#define LARGE_LIVE 16

static const char *fake_cuda;
static void *objects[SMALL_OBJECTS];

struct large_set {
    void *block[LARGE_LIVE];
    size_t size[LARGE_LIVE];
    size_t live; /* bytes */
};
static struct large_set set;

static long minor_faults(void) {
    struct rusage u;
    REQUIRE(getrusage(RUSAGE_SELF, &u) == 0);
    return u.ru_minflt;
}

/* Commits the stack the calls below may reach, so that none of its first touches is counted. */
static __attribute__((noinline)) void touch_stack(void) {
    volatile unsigned char frame[256 << 10];
    for (size_t i = 0; i < sizeof frame; i += 1024) frame[i] = 0;
}

/* Each kind runs in a forked child, whose stack pages above the current frame are still shared
 * with the parent: the first store into one (a spilled local of the caller, wherever the
 * randomized stack top puts a page boundary) is a copy-on-write fault. A store of what each of
 * those pages holds (an atomic add of zero) copies them all now. The stores land wherever a page
 * starts, in a live frame's AddressSanitizer red zone too (1 run in 30 under ASan): they
 * change no byte, so the function is left uninstrumented. */
static __attribute__((noinline, no_sanitize_address)) void unshare_stack_above(void) {
    FILE *maps = fopen("/proc/self/maps", "r");
    REQUIRE(maps != NULL);
    char line[512];
    uintptr_t start = 0, end = 0;
    while (fgets(line, sizeof line, maps))
        if (strstr(line, "[stack]") && sscanf(line, "%" SCNxPTR "-%" SCNxPTR, &start, &end) == 2) break;
    fclose(maps);
    REQUIRE(end != 0);
    unsigned char here;
    for (uintptr_t page = (uintptr_t)&here & ~(uintptr_t)4095; page < end; page += 4096)
        __atomic_fetch_add((unsigned char *)page, 0, __ATOMIC_RELAXED);
}

/* Every size class, SMALL_OBJECTS at a time, freed in a scrambled order. */
static void small_objects(kva_pool *pool) {
    for (int round = 0; round < SMALL_ROUNDS; round++) {
        for (unsigned i = 0; i < SMALL_OBJECTS; i++)
            CHECK_STATUS(kva_alloc(pool, kva_class_size(i % KVA_NUM_SIZE_CLASSES), &objects[i]), KVA_OK);
        for (unsigned i = 0; i < SMALL_OBJECTS; i++)
            CHECK_STATUS(kva_free(pool, objects[(i * 7919u) % SMALL_OBJECTS]), KVA_OK);
    }
}

static void release(kva_pool *pool, unsigned i) {
    CHECK_STATUS(kva_free(pool, set.block[i]), KVA_OK);
    set.block[i] = NULL;
    set.live -= set.size[i];
}

/* Frees a random live block; 0 if there is none. */
static int release_any(kva_pool *pool, unsigned *seed) {
    if (set.live == 0) return 0;
    unsigned i = (unsigned)rand_r(seed) % LARGE_LIVE;
    while (!set.block[i]) i = (i + 1) % LARGE_LIVE;
    release(pool, i);
    return 1;
}

/* A request the buddy cannot place for fragmentation frees another block and is made again. */
static void large_blocks(kva_pool *pool, size_t capacity, unsigned calls) {
    unsigned seed = 20;
    for (unsigned n = 0; n < calls; n++) {
        unsigned slot = (unsigned)rand_r(&seed) % LARGE_LIVE;
        size_t size = MiB << (rand_r(&seed) % 7);
        while (size > capacity / 16) size /= 2;
        if (set.block[slot]) release(pool, slot);
        while (set.live + size > capacity / 2) release_any(pool, &seed);
        kva_status st;
        while ((st = kva_alloc(pool, size, &set.block[slot])) == KVA_ERR_NOMEM && release_any(pool, &seed)) {
        }
        CHECK_STATUS(st, KVA_OK);
        if (st != KVA_OK) set.block[slot] = NULL;
        set.size[slot] = size;
        set.live += st == KVA_OK ? size : 0;
    }
    for (unsigned i = 0; i < LARGE_LIVE; i++)
        if (set.block[i]) release(pool, i);
}

/* Makes the pool, then counts the faults of its first calls: small objects of every class, then
 * large_calls large blocks, each with its frees. prepare, when given, runs between the two,
 * uncounted. */
static int count_first_calls(const char *kind, kva_config *cfg, void (*prepare)(kva_pool *), unsigned large_calls) {
    memset(objects, 0, sizeof objects);
    memset(&set, 0, sizeof set);
    touch_stack();
    unshare_stack_above();
    kva_pool *pool = NULL;
    kva_status st = kva_pool_create(cfg, &pool);
    CHECK_STATUS(st, KVA_OK);
    if (st != KVA_OK) return 1;
    if (prepare) prepare(pool);
    long before = minor_faults();
    small_objects(pool);
    long small = minor_faults() - before;
    large_blocks(pool, cfg->capacity, large_calls);
    long large = minor_faults() - before - small;
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_stats stats;
    CHECK_STATUS(kva_get_stats(pool, &stats), KVA_OK);
    CHECK(stats.live_allocations == 0);
    kva_pool_destroy(pool);
    if (FAULTS_ARE_COUNTABLE && (small > KERNEL_FAULTS || large > KERNEL_FAULTS)) {
        fprintf(stderr,
                "test_fresh_pool: %s: %ld minor faults in the first %d small-object calls, %ld in the %u "
                "large-block allocations after them and their frees; expected at most %d\n",
                kind, small, 2 * SMALL_OBJECTS * SMALL_ROUNDS, large, large_calls, KERNEL_FAULTS);
        check_failures++;
    }
    return check_failures ? 1 : 0;
}

static kva_config host_config(size_t capacity) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    return cfg;
}

static int host_default(void) {
    kva_config cfg = host_config(2 * GiB);
    return count_first_calls("host pool, default config", &cfg, NULL, LARGE_CALLS);
}

static int host_small_pages(void) {
    kva_config cfg = host_config(GiB);
    cfg.pages = KVA_PAGES_SMALL;
    return count_first_calls("host pool of base pages", &cfg, NULL, LARGE_CALLS);
}

/* Named: the pool publishes its statistics from the allocation paths, here every millisecond. */
static int host_named(void) {
    kva_config cfg = host_config(GiB);
    cfg.name = "fresh";
    cfg.publish_interval_ms = 1;
    return count_first_calls("named host pool", &cfg, NULL, LARGE_CALLS);
}

static int host_prefault(void) {
    kva_config cfg = host_config(256 * MiB);
    cfg.prefault = 1;
    return count_first_calls("prefaulted host pool", &cfg, NULL, LARGE_CALLS);
}

/* Checked mode writes its red zones and poison into the managed memory, which it poisons whole
 * at creation, so that memory takes no first-touch fault either. Fewer large blocks: each
 * allocation reads the whole block to verify its poison. */
static int host_checked(void) {
    kva_config cfg = host_config(256 * MiB);
    cfg.checked = 1;
    return count_first_calls("checked host pool", &cfg, NULL, 200);
}

/* Maps every granule (one block of the whole capacity, freed: its granules stay mapped, idle,
 * since the watermark is 0), so that the counted calls make no driver call; a real driver's
 * mapping is a system call, and the fake's bookkeeping grows on the heap. The block records
 * below that block and the bitmaps are as new as the pool's. */
static void map_every_granule(kva_pool *pool) {
    kva_stats stats;
    REQUIRE(kva_get_stats(pool, &stats) == KVA_OK);
    void *all;
    REQUIRE(kva_alloc(pool, stats.capacity, &all) == KVA_OK);
    REQUIRE(kva_free(pool, all) == KVA_OK);
}

static int cuda_pool(void) {
    setenv("KVA_CUDA_DRIVER", fake_cuda, 1);
    kva_config cfg = host_config(512 * MiB);
    cfg.backend = KVA_BACKEND_CUDA;
    return count_first_calls("CUDA pool (fake driver)", &cfg, map_every_granule, LARGE_CALLS);
}

static size_t resident_bytes(void) {
    FILE *statm = fopen("/proc/self/statm", "r");
    REQUIRE(statm != NULL);
    unsigned long pages = 0, resident = 0;
    REQUIRE(fscanf(statm, "%lu %lu", &pages, &resident) == 2);
    fclose(statm);
    return (size_t)resident * (size_t)sysconf(_SC_PAGESIZE);
}

/* What creation faults in is one share of the memory the process could still commit for all
 * its pools together: pools made one after another, each within the share alone, stop being
 * populated once the share is spent, and start again when their memory is given back. */
static int pools_share_one_budget(void) {
    size_t share = kva_os_available_memory() / 16;
    REQUIRE(share > 0);
    enum {
        POOLS = 12
    };
    kva_pool *pools[POOLS];
    kva_config cfg = host_config(8 * GiB); /* about 194 MiB of metadata, records and bitmaps */
    size_t before = resident_bytes();
    for (int i = 0; i < POOLS; i++) CHECK_STATUS(kva_pool_create(&cfg, &pools[i]), KVA_OK);
    size_t grown = resident_bytes() - before;
    if (FAULTS_ARE_COUNTABLE && grown > share + 64 * MiB) {
        fprintf(stderr, "test_fresh_pool: %d pools faulted in %zu MiB at creation, over the share of %zu MiB\n", POOLS,
                grown / MiB, share / MiB);
        check_failures++;
    }
    for (int i = 0; i < POOLS; i++) kva_pool_destroy(pools[i]);
    kva_pool *again;
    CHECK_STATUS(kva_pool_create(&cfg, &again), KVA_OK);
    kva_stats stats;
    CHECK_STATUS(kva_get_stats(again, &stats), KVA_OK);
    /* The share is free again: the new pool's bitmaps are resident, counted whole. */
    CHECK(!FAULTS_ARE_COUNTABLE || 194 * MiB > share || stats.metadata_bytes > 150 * MiB);
    kva_pool_destroy(again);
    return check_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    fake_cuda = argc > 1 ? argv[1] : NULL;
    if (!FAULTS_ARE_COUNTABLE)
        printf("test_fresh_pool: under a sanitizer, whose shadow memory faults too: faults not counted\n");
    in_child(host_default, "host_default");
    in_child(host_small_pages, "host_small_pages");
    in_child(host_named, "host_named");
    in_child(host_prefault, "host_prefault");
    in_child(host_checked, "host_checked");
    in_child(pools_share_one_budget, "pools_share_one_budget");
    if (fake_cuda) in_child(cuda_pool, "cuda_pool");
    else printf("test_fresh_pool: no fake CUDA driver given, the CUDA pool is not checked\n");
    return CHECK_DONE();
}
