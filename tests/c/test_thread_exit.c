/*
 * test_thread_exit.c — what a thread leaves behind when it exits: nothing.
 *
 *  - N threads each allocate and free many objects of several classes, so their caches hold
 *    free words, and every other thread hands a few live objects to the main thread. While they
 *    are parked at a barrier the pool counts their caches (thread_caches, cached_bytes) and still
 *    passes kva_check; once they have exited, no cache is left, no cached byte, and bytes in use
 *    are exactly the handed-over objects. Freed and trimmed, the pool is as it was created. Twice.
 *  - Many short-lived threads, one after another: the count of caches never grows.
 *  - A pool destroyed while a thread that used it is alive; a new pool (likely at the same
 *    address) created before that thread exits; the thread keeps using a third pool, then exits:
 *    no crash, no leak (LeakSanitizer in the sanitizer build), the other pools intact.
 *  - One thread on two pools: flushing one leaves the other's cache alone; its exit empties both.
 *
 * Usage: test_thread_exit [THREADS]
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvalloc.h"
#include "thread_util.h"

#define MAX_THREADS 64
#define KEEP 3    /* live objects an odd-numbered thread hands over */
#define CHURN 400 /* objects per class each thread allocates and frees */

static const size_t churn_sizes[] = {16, 48, 64, 100, 512, 4096, 20000};
#define NCHURN (sizeof churn_sizes / sizeof *churn_sizes)

static kva_config pool_config(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)256 << 20;
    cfg.slab_chunk = (size_t)256 << 10;
    cfg.pages = KVA_PAGES_SMALL;
    return cfg;
}

static kva_pool *new_pool(void) {
    kva_config cfg = pool_config();
    kva_pool *p = NULL;
    REQUIRE(kva_pool_create(&cfg, &p) == KVA_OK);
    return p;
}

/* Allocates and frees CHURN objects of every churn size, interleaved, freeing in an order
 * other than the allocation order; leaves the thread's cache holding free words. */
static void churn(kva_pool *pool, uint64_t *rng) {
    static _Thread_local void *ptrs[CHURN * NCHURN];
    size_t n = 0;
    for (size_t i = 0; i < CHURN; i++)
        for (size_t c = 0; c < NCHURN; c++) {
            TCHECK_STATUS(kva_alloc(pool, churn_sizes[c], &ptrs[n]), KVA_OK);
            memset(ptrs[n], 0x5a, 8);
            n++;
        }
    for (size_t i = n; i > 1; i--) { /* shuffle */
        size_t j = (size_t)(rng_next(rng) % i);
        void *t = ptrs[i - 1];
        ptrs[i - 1] = ptrs[j];
        ptrs[j] = t;
    }
    for (size_t i = 0; i < n; i++) TCHECK_STATUS(kva_free(pool, ptrs[i]), KVA_OK);
}

/* ------------------------------------------------------------------------------ exit leak */

static kva_pool *pool;
static unsigned nthreads;
static pthread_barrier_t parked, released;
static void *handed[MAX_THREADS][KEEP]; /* written by thread t before the barrier */

static void *leak_worker(void *argp) {
    unsigned t = (unsigned)(uintptr_t)argp;
    uint64_t rng = 0x1234567ull + t;
    churn(pool, &rng);
    /* Then a few more, so the cache's current words surely hold free objects; odd threads keep
     * KEEP of them for the main thread. */
    for (size_t c = 0; c < NCHURN; c++) {
        void *p = NULL;
        TCHECK_STATUS(kva_alloc(pool, churn_sizes[c], &p), KVA_OK);
        if ((t & 1) && c < KEEP) {
            memset(p, (int)t, 8);
            handed[t][c] = p;
        } else {
            TCHECK_STATUS(kva_free(pool, p), KVA_OK);
        }
    }
    pthread_barrier_wait(&parked);
    pthread_barrier_wait(&released);
    return NULL;
}

static void exit_leak(unsigned cycle) {
    kva_stats base = get_stats(pool);
    memset(handed, 0, sizeof handed);
    pthread_t threads[MAX_THREADS];
    REQUIRE(pthread_barrier_init(&parked, NULL, nthreads + 1) == 0);
    REQUIRE(pthread_barrier_init(&released, NULL, nthreads + 1) == 0);
    for (unsigned t = 0; t < nthreads; t++)
        REQUIRE(pthread_create(&threads[t], NULL, leak_worker, (void *)(uintptr_t)t) == 0);
    pthread_barrier_wait(&parked);

    /* All alive, parked, each with a cache. */
    uint64_t kept = 0;
    size_t kept_bytes = 0;
    for (unsigned t = 0; t < nthreads; t++)
        for (unsigned k = 0; k < KEEP; k++)
            if (handed[t][k]) {
                kept++;
                kept_bytes += kva_usable_size(pool, handed[t][k]);
            }
    kva_stats st = get_stats(pool);
    if (!(st.thread_caches >= base.thread_caches + nthreads && st.cached_bytes > 0)) {
        fprintf(stderr, "cycle %u, %u threads parked: thread_caches %u (baseline %u), cached_bytes %zu\n", cycle,
                nthreads, st.thread_caches, base.thread_caches, st.cached_bytes);
        check_failures++;
    }
    CHECK(st.live_allocations == base.live_allocations + kept);
    CHECK(st.bytes_in_use == base.bytes_in_use + kept_bytes);
    CHECK(st.cached_bytes <= st.slab_free_bytes);
    CHECK_STATUS(kva_check(pool), KVA_OK);

    pthread_barrier_wait(&released);
    for (unsigned t = 0; t < nthreads; t++) REQUIRE(pthread_join(threads[t], NULL) == 0);
    pthread_barrier_destroy(&parked);
    pthread_barrier_destroy(&released);
    thread_failures_merge();

    /* All exited: their caches are gone. The main thread has not allocated yet in this cycle;
     * whatever it cached before was flushed below in the previous one. */
    st = get_stats(pool);
    if (st.thread_caches != base.thread_caches || st.cached_bytes != 0) {
        fprintf(stderr, "cycle %u, threads exited: thread_caches %u (baseline %u), cached_bytes %zu\n", cycle,
                st.thread_caches, base.thread_caches, st.cached_bytes);
        check_failures++;
    }
    CHECK(st.live_allocations == base.live_allocations + kept);
    CHECK(st.bytes_in_use == base.bytes_in_use + kept_bytes);
    CHECK_STATUS(kva_check(pool), KVA_OK);

    for (unsigned t = 0; t < nthreads; t++)
        for (unsigned k = 0; k < KEEP; k++)
            if (handed[t][k]) {
                unsigned char *p = handed[t][k];
                CHECK(p[0] == (unsigned char)t && p[7] == (unsigned char)t);
                CHECK_STATUS(kva_free(pool, p), KVA_OK);
            }
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    st = get_stats(pool);
    CHECK(st.cached_bytes == 0);
    CHECK(st.live_allocations == base.live_allocations && st.bytes_in_use == base.bytes_in_use);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    st = get_stats(pool);
    CHECK(st.slab_count == 0);
    CHECK(st.bytes_free == st.capacity);
    CHECK(st.bytes_in_use == 0 && st.live_allocations == 0 && st.cached_bytes == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
}

/* ----------------------------------------------------------------------- short-lived threads */

static void *short_worker(void *argp) {
    uint64_t rng = (uint64_t)(uintptr_t)argp;
    void *p[8];
    for (int i = 0; i < 8; i++) TCHECK_STATUS(kva_alloc(pool, rng_between(&rng, 1, 8192), &p[i]), KVA_OK);
    for (int i = 0; i < 8; i++) TCHECK_STATUS(kva_free(pool, p[i]), KVA_OK);
    return NULL;
}

static void short_lived(void) {
    kva_stats base = get_stats(pool);
    for (uintptr_t i = 0; i < 64; i++) {
        run_thread(short_worker, (void *)(i + 1));
        kva_stats st = get_stats(pool);
        if (st.thread_caches != base.thread_caches || st.cached_bytes != base.cached_bytes ||
            st.live_allocations != base.live_allocations) {
            fprintf(stderr,
                    "short-lived thread %u: thread_caches %u, cached %zu, live %" PRIu64 " (baseline %u, %zu, %" PRIu64
                    ")\n",
                    (unsigned)i, st.thread_caches, st.cached_bytes, st.live_allocations, base.thread_caches,
                    base.cached_bytes, base.live_allocations);
            check_failures++;
            break;
        }
    }
    thread_failures_merge();
    CHECK_STATUS(kva_check(pool), KVA_OK);
}

/* ------------------------------------------------------------------ a pool destroyed first */

static kva_pool *doomed, *survivor;
static void *survivor_kept;

/* Uses doomed and survivor; keeps one object of each live; lives on while the main thread
 * destroys doomed and creates another pool; then works on survivor again and exits. */
static void *outliving_worker(void *unused) {
    (void)unused;
    uint64_t rng = 77;
    void *in_doomed = NULL;
    churn(doomed, &rng);
    churn(survivor, &rng);
    TCHECK_STATUS(kva_alloc(doomed, 64, &in_doomed), KVA_OK);
    TCHECK_STATUS(kva_alloc(survivor, 64, &survivor_kept), KVA_OK);
    set_step(1);
    wait_step(2); /* doomed is gone now, its memory with it: in_doomed must not be touched */
    churn(survivor, &rng);
    return NULL;
}

static void pool_destroyed_first(void) {
    doomed = new_pool();
    survivor = new_pool();
    set_step(0);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, outliving_worker, NULL) == 0);
    wait_step(1);
    kva_pool *old_address = doomed;
    kva_pool_destroy(doomed);
    doomed = NULL;
    /* Likely at the address of the one just destroyed: a stale cache of the thread must not be
     * mistaken for a cache of this pool. */
    kva_pool *fresh = new_pool();
    printf("test_thread_exit: new pool %s the destroyed one's address\n", fresh == old_address ? "at" : "not at");
    set_step(2);
    REQUIRE(pthread_join(t, NULL) == 0);
    thread_failures_merge();

    kva_stats st = get_stats(fresh);
    CHECK(st.thread_caches == 0 && st.cached_bytes == 0 && st.live_allocations == 0);
    CHECK(st.bytes_free == st.capacity && st.slab_count == 0);
    CHECK_STATUS(kva_check(fresh), KVA_OK);
    kva_pool_destroy(fresh);

    st = get_stats(survivor);
    CHECK(st.thread_caches == 0 && st.cached_bytes == 0);
    CHECK(st.live_allocations == 1 && st.bytes_in_use == kva_usable_size(survivor, survivor_kept));
    CHECK_STATUS(kva_check(survivor), KVA_OK);
    CHECK_STATUS(kva_free(survivor, survivor_kept), KVA_OK);
    CHECK_STATUS(kva_trim(survivor), KVA_OK);
    st = get_stats(survivor);
    CHECK(st.live_allocations == 0 && st.bytes_free == st.capacity && st.cached_bytes == 0);
    CHECK_STATUS(kva_check(survivor), KVA_OK);
    kva_pool_destroy(survivor);
    survivor = NULL;
}

/* A thread that is alive when its pool is destroyed and never calls the library again. */
static void *idle_after_use(void *unused) {
    (void)unused;
    uint64_t rng = 99;
    churn(doomed, &rng);
    set_step(1);
    wait_step(2);
    return NULL;
}

static void pool_destroyed_idle_thread(void) {
    doomed = new_pool();
    set_step(0);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, idle_after_use, NULL) == 0);
    wait_step(1);
    kva_pool_destroy(doomed);
    doomed = NULL;
    set_step(2);
    REQUIRE(pthread_join(t, NULL) == 0);
    thread_failures_merge();
}

/* ----------------------------------------------------------------------------- two pools */

static kva_pool *pool_a, *pool_b;
static void *kept_a, *kept_b;

static void *two_pool_worker(void *unused) {
    (void)unused;
    uint64_t rng = 4242;
    churn(pool_a, &rng);
    churn(pool_b, &rng);
    TCHECK_STATUS(kva_alloc(pool_a, 100, &kept_a), KVA_OK);
    TCHECK_STATUS(kva_alloc(pool_b, 100, &kept_b), KVA_OK);
    set_step(1);
    wait_step(2);
    TCHECK_STATUS(kva_thread_flush(pool_a), KVA_OK); /* a only */
    set_step(3);
    wait_step(4);
    return NULL;
}

static void two_pools(void) {
    pool_a = new_pool();
    pool_b = new_pool();
    set_step(0);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, two_pool_worker, NULL) == 0);
    wait_step(1);
    kva_stats a = get_stats(pool_a), b = get_stats(pool_b);
    CHECK(a.thread_caches >= 1 && a.cached_bytes > 0);
    CHECK(b.thread_caches >= 1 && b.cached_bytes > 0);
    CHECK(a.live_allocations == 1 && b.live_allocations == 1);
    set_step(2);
    wait_step(3);
    a = get_stats(pool_a);
    b = get_stats(pool_b);
    CHECK(a.cached_bytes == 0);
    CHECK(b.cached_bytes > 0); /* the flush of pool a left pool b's cache alone */
    CHECK(a.live_allocations == 1 && b.live_allocations == 1);
    CHECK_STATUS(kva_check(pool_a), KVA_OK);
    CHECK_STATUS(kva_check(pool_b), KVA_OK);
    set_step(4);
    REQUIRE(pthread_join(t, NULL) == 0);
    thread_failures_merge();
    a = get_stats(pool_a);
    b = get_stats(pool_b);
    CHECK(a.thread_caches == 0 && a.cached_bytes == 0);
    CHECK(b.thread_caches == 0 && b.cached_bytes == 0);
    CHECK(a.bytes_in_use == kva_usable_size(pool_a, kept_a) && b.bytes_in_use == kva_usable_size(pool_b, kept_b));
    CHECK_STATUS(kva_free(pool_a, kept_a), KVA_OK);
    CHECK_STATUS(kva_free(pool_b, kept_b), KVA_OK);
    CHECK_STATUS(kva_check(pool_a), KVA_OK);
    CHECK_STATUS(kva_check(pool_b), KVA_OK);
    /* Destroyed while the main thread holds a cache of each: its exit must not touch them. */
    kva_pool_destroy(pool_a);
    kva_pool_destroy(pool_b);
}

int main(int argc, char **argv) {
    nthreads = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 0) : 8;
    REQUIRE(nthreads >= 1 && nthreads <= MAX_THREADS);
    printf("test_thread_exit: %u threads\n", nthreads);

    pool = new_pool();
    kva_stats st = get_stats(pool);
    CHECK(st.thread_caches == 0 && st.cached_bytes == 0);
    CHECK(st.slab_count == 0 && st.bytes_free == st.capacity);
    for (unsigned cycle = 0; cycle < 2; cycle++) exit_leak(cycle);
    short_lived();
    kva_pool_destroy(pool);

    pool_destroyed_first();
    pool_destroyed_idle_thread();
    two_pools();
    return CHECK_DONE();
}
