/*
 * test_threads.c — many threads on one pool: a transfer stress test in the manner of Larson and
 * mimalloc's test-stress, and double frees across threads.
 *
 *  - Each round starts THREADS new threads. A thread allocates mixed sizes (slab classes from
 *    16 B to 64 KiB, skewed small, and a few buddy blocks above 64 KiB), stamps each allocation
 *    with (id ^ cookie) at both ends and verifies the stamp when it frees it. A quarter of its
 *    allocations go into a shared array through an atomic exchange; whoever takes one out (the
 *    exchange that puts a new one in, or one that takes it) frees it. What a thread still holds
 *    at the end of its round, and what the shared array holds, survives into the next round and
 *    is freed by other threads, after the thread that allocated it has exited.
 *  - After every round (all threads joined): kva_check is OK, live_allocations is the number of
 *    allocations the test holds, bytes_in_use the sum of their usable sizes, no thread cache is
 *    left (thread_caches and cached_bytes back to what they were before any thread ran).
 *  - At the end everything is freed: nothing in use, every slab trimmed, kva_check OK.
 *  - Double frees: A allocates p, B frees it while A (whose cache held p's word) is alive, C's
 *    free of p is refused, so is A's, so is D's after A exited; a thread's free, free of one
 *    object through its own cache is refused too. A refused call changes nothing but
 *    rejected_calls.
 *
 * While the workers run, one more thread calls kva_get_stats, kva_check and kva_trim, and the
 * workers now and then kva_thread_flush.
 *
 * Usage: test_threads [THREADS [ROUNDS [SEED [OPS]]]]   (OPS: operations per thread per round)
 * The seed is printed; with THREADS = 1 the rounds run one thread at a time (no poller).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "kvalloc.h"
#include "thread_util.h"

#define MAX_THREADS 64
#define MAX_LOCAL 256 /* allocations one thread slot holds at most */
#define NSHARED 256   /* slots of the shared transfer array */

static kva_pool *pool;
static uint64_t seed;
static unsigned nthreads, nrounds;
static unsigned long ops_per_round;
static int concurrent_poll = 1;

/* What each thread slot holds between rounds; slot s is worked in round r by thread
 * (s - r) mod THREADS, a new thread each round. */
typedef struct slot {
    test_obj *items[MAX_LOCAL];
    size_t n;
    uint64_t allocs, frees, transfers, taken;
} slot;
static slot slots[MAX_THREADS];
static _Atomic(test_obj *) shared[NSHARED];

/* The request sizes: mostly small slab objects, the fixed KV classes (64 B, 4 KiB), some up to
 * 64 KiB, and about 1.5% buddy blocks of 64 KiB + 1 .. 2 MiB. */
static size_t random_size(uint64_t *rng) {
    uint64_t r = rng_next(rng) % 1000;
    if (r < 400) return rng_between(rng, 1, 128);
    if (r < 650) return rng_between(rng, 129, 1024);
    if (r < 800) return r & 1 ? 64 : 4096;
    if (r < 920) return rng_between(rng, 1025, 8192);
    if (r < 985) return rng_between(rng, 8193, KVA_SLAB_MAX_SIZE);
    return rng_between(rng, KVA_SLAB_MAX_SIZE + 1, (size_t)1 << rng_between(rng, 17, 21));
}

static test_obj *new_obj(uint64_t *rng, uint64_t id) {
    test_obj *o = malloc(sizeof *o);
    REQUIRE(o != NULL);
    o->size = random_size(rng);
    o->id = id;
    void *p = NULL;
    kva_status st;
    size_t alignment = 0;
    if (rng_next(rng) % 50 == 0) {
        alignment = (size_t)1 << rng_between(rng, 4, 12);
        st = kva_alloc_aligned(pool, o->size, alignment, &p);
    } else {
        st = kva_alloc(pool, o->size, &p);
    }
    if (st != KVA_OK) {
        kva_stats s = get_stats(pool);
        fprintf(stderr, "kva_alloc(%zu): %s (%s); bytes_in_use %zu, bytes_free %zu, largest_free %zu, slab_bytes %zu\n",
                o->size, kva_strerror(st), kva_last_error(), s.bytes_in_use, s.bytes_free, s.largest_free,
                s.slab_bytes);
        atomic_fetch_add(&thread_failures, 1);
        free(o);
        return NULL;
    }
    o->ptr = p;
    TCHECK(kva_usable_size(pool, p) >= o->size);
    if (alignment) TCHECK((uintptr_t)p % alignment == 0);
    test_stamp(o);
    return o;
}

typedef struct worker_arg {
    unsigned index, round;
} worker_arg;

static atomic_uint workers_running;
static atomic_ulong polls, checks_not_ok;

/* Beside the workers of a round: kva_get_stats, kva_check and kva_trim from yet another thread
 * while they run (a thread of its own, so that the main thread never holds a cache). kva_check
 * must not crash or race; while fast paths run it may see a word between two stores, so its
 * verdict is only counted here; the verdicts that count come after the round. */
static void *poller(void *unused) {
    (void)unused;
    const struct timespec pause = {0, 2 * 1000 * 1000};
    for (unsigned long i = 0; atomic_load(&workers_running) > 0; i++) {
        kva_stats st;
        TCHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
        TCHECK(st.bytes_in_use <= st.capacity && st.bytes_free <= st.capacity);
        if (i % 4 == 0 && kva_check(pool) != KVA_OK) atomic_fetch_add(&checks_not_ok, 1);
        if (i % 8 == 7) TCHECK_STATUS(kva_trim(pool), KVA_OK);
        atomic_fetch_add(&polls, 1);
        nanosleep(&pause, NULL);
    }
    return NULL;
}

static void *stress_worker(void *argp) {
    const worker_arg *arg = argp;
    slot *sl = &slots[(arg->index + arg->round) % nthreads];
    uint64_t rng = seed ^ (0x51ed27c4a3b1ull * (arg->round * MAX_THREADS + arg->index + 1));
    uint64_t next_id = ((uint64_t)arg->round << 40) | ((uint64_t)arg->index << 32);
    for (unsigned long op = 0; op < ops_per_round && atomic_load(&thread_failures) == 0; op++) {
        uint64_t r = rng_next(&rng) % 100;
        if (r < 50) {
            test_obj *o = new_obj(&rng, ++next_id);
            if (!o) break;
            sl->allocs++;
            if (rng_next(&rng) % 4 == 0) {
                /* Hand it over: the one it displaces is ours to free. */
                test_obj *old = atomic_exchange(&shared[rng_next(&rng) % NSHARED], o);
                sl->transfers++;
                if (old) {
                    test_obj_free(pool, old);
                    sl->frees++;
                    sl->taken++;
                }
            } else {
                if (sl->n == MAX_LOCAL) {
                    size_t i = (size_t)(rng_next(&rng) % sl->n);
                    test_obj_free(pool, sl->items[i]);
                    sl->frees++;
                    sl->items[i] = sl->items[--sl->n];
                }
                sl->items[sl->n++] = o;
            }
        } else if (r < 85) {
            if (sl->n == 0) continue;
            size_t i = (size_t)(rng_next(&rng) % sl->n);
            test_obj_free(pool, sl->items[i]);
            sl->frees++;
            sl->items[i] = sl->items[--sl->n];
        } else {
            test_obj *o = atomic_exchange(&shared[rng_next(&rng) % NSHARED], NULL);
            if (o) {
                test_obj_free(pool, o);
                sl->frees++;
                sl->taken++;
            }
        }
        if (rng_next(&rng) % 1000 == 0) TCHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    }
    atomic_fetch_sub(&workers_running, 1);
    return NULL;
}

/* Main thread, no worker running: the pool must account for exactly what the test holds. */
static void check_balance(const kva_stats *base, unsigned round) {
    CHECK_STATUS(kva_check(pool), KVA_OK);
    uint64_t held = 0;
    size_t bytes = 0;
    int stamps_ok = 1;
    for (unsigned s = 0; s < nthreads; s++)
        for (size_t i = 0; i < slots[s].n; i++) {
            held++;
            bytes += kva_usable_size(pool, slots[s].items[i]->ptr);
            stamps_ok &= test_stamp_intact(slots[s].items[i]);
        }
    for (unsigned i = 0; i < NSHARED; i++) {
        test_obj *o = atomic_load(&shared[i]);
        if (!o) continue;
        held++;
        bytes += kva_usable_size(pool, o->ptr);
        stamps_ok &= test_stamp_intact(o);
    }
    kva_stats st = get_stats(pool);
    if (st.live_allocations != held || st.bytes_in_use != bytes || !stamps_ok ||
        st.thread_caches != base->thread_caches || st.cached_bytes != base->cached_bytes) {
        fprintf(stderr,
                "round %u: pool says %" PRIu64 " live, %zu bytes in use, %u thread caches, %zu cached bytes; "
                "the test holds %" PRIu64 " allocations of %zu bytes (stamps %s), baseline %u caches, %zu cached\n",
                round, st.live_allocations, st.bytes_in_use, st.thread_caches, st.cached_bytes, held, bytes,
                stamps_ok ? "intact" : "OVERWRITTEN", base->thread_caches, base->cached_bytes);
        check_failures++;
    }
}

static void stress(void) {
    kva_stats base = get_stats(pool);
    pthread_t threads[MAX_THREADS], poll_thread;
    worker_arg args[MAX_THREADS];
    for (unsigned round = 0; round < nrounds && check_failures == 0; round++) {
        atomic_store(&workers_running, nthreads);
        for (unsigned t = 0; t < nthreads; t++) {
            args[t] = (worker_arg){.index = t, .round = round};
            REQUIRE(pthread_create(&threads[t], NULL, stress_worker, &args[t]) == 0);
        }
        if (concurrent_poll) REQUIRE(pthread_create(&poll_thread, NULL, poller, NULL) == 0);
        for (unsigned t = 0; t < nthreads; t++) REQUIRE(pthread_join(threads[t], NULL) == 0);
        if (concurrent_poll) REQUIRE(pthread_join(poll_thread, NULL) == 0);
        thread_failures_merge();
        check_balance(&base, round);
    }
    uint64_t allocs = 0, frees = 0, transfers = 0, taken = 0;
    for (unsigned s = 0; s < nthreads; s++) {
        allocs += slots[s].allocs;
        frees += slots[s].frees;
        transfers += slots[s].transfers;
        taken += slots[s].taken;
    }
    kva_stats st = get_stats(pool);
    printf("test_threads: %" PRIu64 " allocations, %" PRIu64 " frees, %" PRIu64 " handed over, %" PRIu64
           " taken by another; %" PRIu64 " remote frees, %u arenas; %lu polls beside the workers (%lu kva_check"
           " not OK while they ran)\n",
           allocs, frees, transfers, taken, st.remote_frees, st.arenas, atomic_load(&polls),
           atomic_load(&checks_not_ok));

    /* Free everything the test still holds, from the main thread. */
    for (unsigned s = 0; s < nthreads; s++)
        while (slots[s].n) test_obj_free(pool, slots[s].items[--slots[s].n]);
    for (unsigned i = 0; i < NSHARED; i++) {
        test_obj *o = atomic_exchange(&shared[i], NULL);
        if (o) test_obj_free(pool, o);
    }
    thread_failures_merge();
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    st = get_stats(pool);
    CHECK(st.bytes_in_use == 0);
    CHECK(st.live_allocations == 0);
    CHECK(st.cached_bytes == 0);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    st = get_stats(pool);
    CHECK(st.slab_count == 0);
    CHECK(st.bytes_free == st.capacity);
    CHECK_STATUS(kva_check(pool), KVA_OK);
}

/* ----------------------------------------------------------------------------- double frees */

/* Everything a refused call must leave alone. */
typedef struct pool_counts {
    uint64_t live, allocs, frees, rejected;
    size_t in_use, free_bytes, slab_bytes, slab_free, cached;
} pool_counts;

static pool_counts counts(void) {
    kva_stats s = get_stats(pool);
    return (pool_counts){s.live_allocations, s.alloc_count, s.free_count,      s.rejected_calls, s.bytes_in_use,
                         s.bytes_free,       s.slab_bytes,  s.slab_free_bytes, s.cached_bytes};
}

/* after is before with one more rejected call and nothing else changed. */
static int only_rejected(const pool_counts *before, const pool_counts *after) {
    pool_counts expect = *before;
    expect.rejected++;
    return memcmp(&expect, after, sizeof expect) == 0;
}

static void *df_victim; /* p: allocated by A */
static size_t df_size;

/* A: allocates p and a neighbour q of the same size (so A's cache holds the word of p), waits
 * while B frees p and C tries again, then frees p itself (refused) and q. */
static void *df_thread_a(void *unused) {
    (void)unused;
    void *q = NULL;
    TCHECK_STATUS(kva_alloc(pool, df_size, &df_victim), KVA_OK);
    TCHECK_STATUS(kva_alloc(pool, df_size, &q), KVA_OK);
    set_step(1);
    wait_step(2);
    pool_counts before = counts();
    TCHECK_STATUS(kva_free(pool, df_victim), KVA_ERR_DOUBLE_FREE);
    pool_counts after = counts();
    TCHECK(only_rejected(&before, &after));
    /* A's next allocations of the class must not hand out q, nor one object twice. */
    void *x = NULL, *y = NULL;
    TCHECK_STATUS(kva_alloc(pool, df_size, &x), KVA_OK);
    TCHECK_STATUS(kva_alloc(pool, df_size, &y), KVA_OK);
    TCHECK(x != y && x != q && y != q);
    TCHECK_STATUS(kva_free(pool, x), KVA_OK);
    TCHECK_STATUS(kva_free(pool, y), KVA_OK);
    TCHECK_STATUS(kva_free(pool, q), KVA_OK);
    return NULL;
}

static void *df_thread_b(void *unused) {
    (void)unused;
    TCHECK_STATUS(kva_free(pool, df_victim), KVA_OK);
    return NULL;
}

/* C (and D, after A exited): the second free from yet another thread. */
static void *df_thread_c(void *unused) {
    (void)unused;
    pool_counts before = counts();
    TCHECK_STATUS(kva_free(pool, df_victim), KVA_ERR_DOUBLE_FREE);
    pool_counts after = counts();
    TCHECK(only_rejected(&before, &after));
    TCHECK_STATUS(kva_check(pool), KVA_OK);
    TCHECK(kva_usable_size(pool, df_victim) == 0);
    return NULL;
}

static void double_free_across_threads(size_t size) {
    kva_stats base = get_stats(pool);
    df_size = size;
    set_step(0);
    pthread_t a;
    REQUIRE(pthread_create(&a, NULL, df_thread_a, NULL) == 0);
    wait_step(1);
    run_thread(df_thread_b, NULL); /* frees p while A holds its word: a remote free */
    run_thread(df_thread_c, NULL); /* refused, A still alive */
    set_step(2);                   /* A's own free of p: refused */
    REQUIRE(pthread_join(a, NULL) == 0);
    run_thread(df_thread_c, NULL); /* refused once more, A gone */
    thread_failures_merge();
    kva_stats st = get_stats(pool);
    CHECK(st.live_allocations == base.live_allocations);
    CHECK(st.bytes_in_use == base.bytes_in_use);
    CHECK(st.cached_bytes == base.cached_bytes);
    CHECK(st.thread_caches == base.thread_caches);
    CHECK(st.rejected_calls == base.rejected_calls + 3);
    CHECK_STATUS(kva_check(pool), KVA_OK);
}

/* alloc p, free p, free p in one thread: the second free finds p in the thread's own cache. */
static void *df_same_thread(void *sizep) {
    size_t size = *(const size_t *)sizep;
    void *p = NULL, *q = NULL;
    TCHECK_STATUS(kva_alloc(pool, size, &q), KVA_OK); /* keeps the word (or block) busy */
    TCHECK_STATUS(kva_alloc(pool, size, &p), KVA_OK);
    TCHECK_STATUS(kva_free(pool, p), KVA_OK);
    pool_counts before = counts();
    TCHECK_STATUS(kva_free(pool, p), KVA_ERR_DOUBLE_FREE);
    pool_counts after = counts();
    TCHECK(only_rejected(&before, &after));
    TCHECK_STATUS(kva_check(pool), KVA_OK);
    void *x = NULL, *y = NULL;
    TCHECK_STATUS(kva_alloc(pool, size, &x), KVA_OK);
    TCHECK_STATUS(kva_alloc(pool, size, &y), KVA_OK);
    TCHECK(x != y && x != q && y != q);
    TCHECK_STATUS(kva_free(pool, x), KVA_OK);
    TCHECK_STATUS(kva_free(pool, y), KVA_OK);
    TCHECK_STATUS(kva_free(pool, q), KVA_OK);
    TCHECK_STATUS(kva_free(pool, q), KVA_ERR_DOUBLE_FREE);
    return NULL;
}

static void double_frees(void) {
    static const size_t sizes[] = {16, 64, 100, 4096, 65536, (size_t)1 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        double_free_across_threads(sizes[i]);
        kva_stats base = get_stats(pool);
        run_thread(df_same_thread, (void *)&sizes[i]);
        thread_failures_merge();
        kva_stats st = get_stats(pool);
        CHECK(st.live_allocations == base.live_allocations && st.bytes_in_use == base.bytes_in_use);
        CHECK(st.thread_caches == base.thread_caches && st.cached_bytes == base.cached_bytes);
        CHECK(st.rejected_calls == base.rejected_calls + 2);
        CHECK_STATUS(kva_check(pool), KVA_OK);
    }
}

int main(int argc, char **argv) {
    nthreads = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 0) : 8;
    nrounds = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 0) : 20;
    seed = argc > 3 ? strtoull(argv[3], NULL, 0) : 20260611;
    ops_per_round = argc > 4 ? strtoul(argv[4], NULL, 0) : 4000;
    REQUIRE(nthreads >= 1 && nthreads <= MAX_THREADS);
    concurrent_poll = nthreads > 1; /* THREADS = 1: nothing runs beside the one worker */
    printf("test_threads: %u threads, %u rounds, %lu operations per thread and round, seed %" PRIu64
           " (replay: test_threads %u %u %" PRIu64 " %lu)\n",
           nthreads, nrounds, ops_per_round, seed, nthreads, nrounds, seed, ops_per_round);

    /* Room for every arena to hold a slab of every class and a spare, besides the live data:
     * slabs of 256 KiB, and no more than 16 arenas on a large machine. Small pages: the pool is
     * mostly address space, only the stamped pages are ever touched. */
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)1 << 30;
    cfg.slab_chunk = (size_t)256 << 10;
    cfg.pages = KVA_PAGES_SMALL;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    cfg.arenas = cpus > 16 ? 16 : 0;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    kva_stats st = get_stats(pool);
    CHECK(st.thread_caches == 0 && st.cached_bytes == 0 && st.live_allocations == 0);
    CHECK(st.arenas >= 1 && st.arenas <= KVA_MAX_ARENAS);

    double_frees();
    stress();

    kva_pool_destroy(pool);
    return CHECK_DONE();
}
