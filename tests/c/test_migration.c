/*
 * test_migration.c — threads that migrate between CPUs at the worst moment.
 *
 * The CPU test hook (cpu.h) replaces the CPU a slow path reads with a fake one, and runs a
 * callback between reading it and locking that CPU's arena, the window in which a real
 * migration strikes. Here each thread has its own fake CPU, and the callback moves it, most of
 * the time, to another one, including ids beyond the arena count: so a thread's next slow path
 * runs on another arena than its last, and the arena it locks is often not its CPU's any more.
 *
 *  - THREADS threads on a pool of 4 arenas allocate and free thousands of objects of many
 *    classes (so words are claimed and given back all the time), hand some to each other to
 *    free, and keep a few. Afterwards: kva_check OK, stats balance with what the test holds, no
 *    cache left, the hook ran, and more than one arena handed out words.
 *  - One thread on a pool of 3 arenas with fake CPUs all >= 3 (up to UINT_MAX): they wrap.
 *
 * Usage: test_migration [THREADS [ROUNDS]]
 */
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu.h"
#include "kvalloc.h"
#include "pool.h"
#include "thread_util.h"

#define MAX_THREADS 64
#define NSHARED 128
#define KEEP 4
#define FAKE_CPUS 11 /* fake ids 0 .. 10 over 4 arenas: some wrap */

/* ----------------------------------------------------------------------------------- the hook */

typedef struct hook_state {
    atomic_ulong reads, flips;
} hook_state;
static hook_state hook;

static _Thread_local unsigned my_cpu;
static _Thread_local uint64_t my_rng;

static unsigned fake_cpu(void *ctx) {
    hook_state *h = ctx;
    if (h != &hook) { /* the context given at installation, unchanged */
        fprintf(stderr, "fake_cpu: ctx %p, expected %p\n", ctx, (void *)&hook);
        atomic_fetch_add(&thread_failures, 1);
        return 0;
    }
    atomic_fetch_add(&h->reads, 1);
    return my_cpu;
}

/* The migration: three times in four, to another fake CPU. (Not always, so an implementation
 * that re-reads the CPU after locking and retries would still get through.) */
static void migrate(void *ctx) {
    hook_state *h = ctx;
    if (my_rng == 0) my_rng = (uint64_t)(uintptr_t)&my_rng; /* a thread the test did not seed */
    if (rng_next(&my_rng) % 4 == 0) return;
    my_cpu = (my_cpu + 1 + (unsigned)(rng_next(&my_rng) % (FAKE_CPUS - 1))) % FAKE_CPUS;
    atomic_fetch_add(&h->flips, 1);
}

/* --------------------------------------------------------------------------- many threads */

static kva_pool *pool;
static unsigned nthreads, nrounds;
static _Atomic(test_obj *) shared[NSHARED];
static test_obj *kept[MAX_THREADS][KEEP];

typedef struct class_plan {
    size_t size;
    unsigned count; /* per thread per round */
} class_plan;

/* Thousands of the small classes: dozens of words claimed and given back per class and round. */
static const class_plan plan[] = {
    {16, 3000}, {48, 2000}, {64, 3000}, {128, 2000}, {512, 1500}, {2048, 600}, {4096, 800}, {16384, 150}, {65536, 60},
};
#define NPLAN (sizeof plan / sizeof *plan)

static void *migrating_worker(void *argp) {
    unsigned t = (unsigned)(uintptr_t)argp;
    my_cpu = t % FAKE_CPUS;
    my_rng = 0xabcdef12345ull * (t + 1);
    size_t total = 0;
    for (size_t c = 0; c < NPLAN; c++) total += plan[c].count;
    test_obj **objs = malloc(total * sizeof *objs);
    REQUIRE(objs != NULL);
    uint64_t next_id = (uint64_t)t << 40;
    for (unsigned round = 0; round < nrounds; round++) {
        /* Allocate the classes interleaved, as an engine would. */
        size_t n = 0;
        unsigned most = 0;
        for (size_t c = 0; c < NPLAN; c++) most = plan[c].count > most ? plan[c].count : most;
        for (unsigned i = 0; i < most; i++)
            for (size_t c = 0; c < NPLAN; c++) {
                if (i >= plan[c].count) continue;
                test_obj *o = malloc(sizeof *o);
                REQUIRE(o != NULL);
                o->size = plan[c].size - (rng_next(&my_rng) % 8); /* not always the class size */
                o->id = ++next_id;
                void *p = NULL;
                kva_status st = kva_alloc(pool, o->size, &p);
                if (st != KVA_OK) {
                    TCHECK_STATUS(st, KVA_OK);
                    free(o);
                    continue;
                }
                o->ptr = p;
                test_stamp(o);
                objs[n++] = o;
            }
        for (size_t i = n; i > 1; i--) { /* free in random order */
            size_t j = (size_t)(rng_next(&my_rng) % i);
            test_obj *x = objs[i - 1];
            objs[i - 1] = objs[j];
            objs[j] = x;
        }
        for (size_t i = 0; i < n; i++) {
            test_obj *o = objs[i];
            if (rng_next(&my_rng) % 8 == 0) /* to another thread: it frees the one it displaces */
                o = atomic_exchange(&shared[rng_next(&my_rng) % NSHARED], o);
            if (o) test_obj_free(pool, o);
        }
        if (round % 2) TCHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    }
    free(objs);
    for (unsigned k = 0; k < KEEP; k++) {
        test_obj *o = malloc(sizeof *o);
        REQUIRE(o != NULL);
        o->size = plan[k].size;
        o->id = ++next_id;
        void *p = NULL;
        TCHECK_STATUS(kva_alloc(pool, o->size, &p), KVA_OK);
        if (!p) {
            free(o);
            continue;
        }
        o->ptr = p;
        test_stamp(o);
        kept[t][k] = o;
    }
    return NULL;
}

static void print_arenas(const char *what) {
    printf("test_migration: %s: %u arenas, claims", what, pool->slabs.narenas);
    for (unsigned i = 0; i < pool->slabs.narenas; i++) printf(" %" PRIu64, (uint64_t)pool->slabs.arenas[i].claims);
    printf("\n");
}

static unsigned arenas_with_claims(void) {
    unsigned used = 0;
    for (unsigned i = 0; i < pool->slabs.narenas; i++) used += pool->slabs.arenas[i].claims > 0;
    return used;
}

static void many_threads(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)512 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.arenas = 4;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    kva_stats base = get_stats(pool);
    CHECK(base.arenas == 4);
    CHECK(pool->slabs.narenas == 4);

    kva_cpu_test_hook(fake_cpu, migrate, &hook);
    pthread_t threads[MAX_THREADS];
    for (unsigned t = 0; t < nthreads; t++)
        REQUIRE(pthread_create(&threads[t], NULL, migrating_worker, (void *)(uintptr_t)t) == 0);
    for (unsigned t = 0; t < nthreads; t++) REQUIRE(pthread_join(threads[t], NULL) == 0);
    kva_cpu_test_hook(NULL, NULL, NULL);
    thread_failures_merge();

    unsigned long reads = atomic_load(&hook.reads), flips = atomic_load(&hook.flips);
    printf("test_migration: %u threads x %u rounds, %lu CPU reads through the hook, %lu migrations\n", nthreads,
           nrounds, reads, flips);
    print_arenas("after the threads");
    CHECK(reads > 0 && flips > 0);
    CHECK(arenas_with_claims() > 1);

    CHECK_STATUS(kva_check(pool), KVA_OK);
    uint64_t held = 0;
    size_t bytes = 0;
    for (unsigned t = 0; t < nthreads; t++)
        for (unsigned k = 0; k < KEEP; k++)
            if (kept[t][k]) {
                held++;
                bytes += kva_usable_size(pool, kept[t][k]->ptr);
            }
    for (unsigned i = 0; i < NSHARED; i++) {
        test_obj *o = atomic_load(&shared[i]);
        if (o) {
            held++;
            bytes += kva_usable_size(pool, o->ptr);
        }
    }
    kva_stats st = get_stats(pool);
    if (st.live_allocations != held || st.bytes_in_use != bytes || st.thread_caches != base.thread_caches ||
        st.cached_bytes != 0) {
        fprintf(stderr,
                "pool says %" PRIu64 " live, %zu bytes in use, %u thread caches, %zu cached; the test holds %" PRIu64
                " of %zu bytes\n",
                st.live_allocations, st.bytes_in_use, st.thread_caches, st.cached_bytes, held, bytes);
        check_failures++;
    }

    for (unsigned t = 0; t < nthreads; t++)
        for (unsigned k = 0; k < KEEP; k++)
            if (kept[t][k]) test_obj_free(pool, kept[t][k]);
    for (unsigned i = 0; i < NSHARED; i++) {
        test_obj *o = atomic_exchange(&shared[i], NULL);
        if (o) test_obj_free(pool, o);
    }
    thread_failures_merge();
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    st = get_stats(pool);
    CHECK(st.live_allocations == 0 && st.bytes_in_use == 0 && st.cached_bytes == 0);
    CHECK(st.slab_count == 0 && st.bytes_free == st.capacity);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
    pool = NULL;
}

/* -------------------------------------------------------------------- CPU ids beyond the arenas */

static const unsigned big_cpus[] = {
    3, 4, 5, 7, 255, 256, 257, 1000, 65535, UINT_MAX, UINT_MAX - 1, 2 * KVA_MAX_ARENAS + 1, 1u << 31,
};
#define NBIG (sizeof big_cpus / sizeof *big_cpus)
static unsigned big_index;

static unsigned big_cpu(void *ctx) {
    (void)ctx;
    return big_cpus[big_index % NBIG];
}

static void next_big(void *ctx) {
    (void)ctx;
    big_index++;
}

static void *wrapping_worker(void *unused) {
    (void)unused;
    static const size_t sizes[] = {16, 64, 256, 4096};
    enum {
        N = 1000
    };
    static void *ptrs[N];
    for (unsigned round = 0; round < 8; round++) {
        for (size_t c = 0; c < sizeof sizes / sizeof *sizes; c++) {
            for (unsigned i = 0; i < N; i++) TCHECK_STATUS(kva_alloc(pool, sizes[c], &ptrs[i]), KVA_OK);
            for (unsigned i = 0; i < N; i++) TCHECK_STATUS(kva_free(pool, ptrs[i]), KVA_OK);
        }
        TCHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    }
    return NULL;
}

static void wrapping_cpu_ids(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)64 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.arenas = 3; /* not a power of two: a mask in place of a modulo would show */
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    CHECK(pool->slabs.narenas == 3);
    big_index = 0;
    kva_cpu_test_hook(big_cpu, next_big, NULL);
    run_thread(wrapping_worker, NULL); /* one thread at a time: big_index needs no atomics */
    kva_cpu_test_hook(NULL, NULL, NULL);
    thread_failures_merge();
    printf("test_migration: %u slow paths through the wrapping hook\n", big_index);
    print_arenas("wrapping CPU ids");
    CHECK(big_index > 0);
    CHECK(arenas_with_claims() > 1);
    kva_stats st = get_stats(pool);
    CHECK(st.live_allocations == 0 && st.bytes_in_use == 0 && st.cached_bytes == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    st = get_stats(pool);
    CHECK(st.slab_count == 0 && st.bytes_free == st.capacity);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
    pool = NULL;
}

int main(int argc, char **argv) {
    nthreads = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 0) : 4;
    nrounds = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 0) : 3;
    REQUIRE(nthreads >= 1 && nthreads <= MAX_THREADS);
    many_threads();
    wrapping_cpu_ids();
    return CHECK_DONE();
}
