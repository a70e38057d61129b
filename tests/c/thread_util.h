/*
 * thread_util.h — what the multi-threaded tests share: a checking macro safe to call from any
 * thread, a per-thread random generator, stamped allocations, and a step counter that runs
 * threads one after another in a fixed order.
 *
 * CHECK from check.h increments a plain int: fine in the main thread, a data race in workers.
 * Workers use TCHECK / TCHECK_STATUS, which count into an atomic; thread_failures_merge() adds
 * that count to check_failures once every worker is joined.
 */
#ifndef KVA_TEST_THREAD_UTIL_H
#define KVA_TEST_THREAD_UTIL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"
#include "kvalloc.h"

#define KVA_TU_UNUSED static __attribute__((unused))

static atomic_int thread_failures;

#define TCHECK(cond)                                                                 \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            atomic_fetch_add(&thread_failures, 1);                                   \
        }                                                                            \
    } while (0)

#define TCHECK_STATUS(expr, expected)                                                                   \
    do {                                                                                                \
        kva_status tcheck_got_ = (expr);                                                                \
        if (tcheck_got_ != (expected)) {                                                                \
            fprintf(stderr, "%s:%d: %s returned %d (%s: %s), expected %d\n", __FILE__, __LINE__, #expr, \
                    (int)tcheck_got_, kva_strerror(tcheck_got_), kva_last_error(), (int)(expected));    \
            atomic_fetch_add(&thread_failures, 1);                                                      \
        }                                                                                               \
    } while (0)

/* Call in the main thread with no worker running. */
KVA_TU_UNUSED void thread_failures_merge(void) { check_failures += atomic_exchange(&thread_failures, 0); }

/* splitmix64 on a caller-owned state: each thread has its own. */
KVA_TU_UNUSED uint64_t rng_next(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

KVA_TU_UNUSED size_t rng_between(uint64_t *state, size_t lo, size_t hi) {
    return lo + (size_t)(rng_next(state) % (hi - lo + 1));
}

/* One allocation the test holds. The record lives in malloc memory, never in the pool. */
typedef struct test_obj {
    unsigned char *ptr;
    size_t size; /* requested */
    uint64_t id;
} test_obj;

static const uint64_t test_cookie = 0x6b7661636f6f6b69ull;

KVA_TU_UNUSED unsigned char test_mark_byte(const test_obj *o, size_t i) {
    return (unsigned char)((o->id ^ test_cookie) >> (8 * (i % 8)));
}

/* Under 16 bytes the whole allocation is stamped byte by byte; otherwise its first and last 8
 * bytes hold id ^ cookie. */
KVA_TU_UNUSED void test_stamp(const test_obj *o) {
    if (o->size < 16) {
        for (size_t i = 0; i < o->size; i++) o->ptr[i] = test_mark_byte(o, i);
        return;
    }
    for (size_t i = 0; i < 8; i++) o->ptr[i] = o->ptr[o->size - 8 + i] = test_mark_byte(o, i);
}

KVA_TU_UNUSED int test_stamp_intact(const test_obj *o) {
    if (o->size < 16) {
        for (size_t i = 0; i < o->size; i++)
            if (o->ptr[i] != test_mark_byte(o, i)) return 0;
        return 1;
    }
    for (size_t i = 0; i < 8; i++)
        if (o->ptr[i] != test_mark_byte(o, i) || o->ptr[o->size - 8 + i] != test_mark_byte(o, i)) return 0;
    return 1;
}

/* Verifies the stamp, frees, and releases the record. 0 on any failure (already reported). */
KVA_TU_UNUSED int test_obj_free(kva_pool *pool, test_obj *o) {
    int ok = 1;
    if (!test_stamp_intact(o)) {
        fprintf(stderr, "allocation %#llx (%zu bytes at %p, usable %zu) was overwritten\n", (unsigned long long)o->id,
                o->size, (void *)o->ptr, kva_usable_size(pool, o->ptr));
        atomic_fetch_add(&thread_failures, 1);
        ok = 0;
    }
    kva_status st = kva_free(pool, o->ptr);
    if (st != KVA_OK) {
        fprintf(stderr, "kva_free(%p) of allocation %#llx: %s (%s)\n", (void *)o->ptr, (unsigned long long)o->id,
                kva_strerror(st), kva_last_error());
        atomic_fetch_add(&thread_failures, 1);
        ok = 0;
    }
    free(o);
    return ok;
}

/* A step counter: wait_step(s) blocks until some thread has called set_step(s) (or a later
 * step). Runs threads in a fixed interleaving, with the happens-before edges ThreadSanitizer
 * needs between them. */
static pthread_mutex_t step_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t step_cond = PTHREAD_COND_INITIALIZER;
static int step_now;

KVA_TU_UNUSED void set_step(int s) {
    pthread_mutex_lock(&step_lock);
    step_now = s;
    pthread_cond_broadcast(&step_cond);
    pthread_mutex_unlock(&step_lock);
}

KVA_TU_UNUSED void wait_step(int s) {
    pthread_mutex_lock(&step_lock);
    while (step_now < s) pthread_cond_wait(&step_cond, &step_lock);
    pthread_mutex_unlock(&step_lock);
}

/* Creates a thread and joins it: the calls in fn run on a thread of their own, which has exited
 * (its thread caches flushed by the library's key destructor) when this returns. */
KVA_TU_UNUSED void run_thread(void *(*fn)(void *), void *arg) {
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, fn, arg) == 0);
    REQUIRE(pthread_join(t, NULL) == 0);
}

KVA_TU_UNUSED kva_stats get_stats(kva_pool *pool) {
    kva_stats st;
    kva_status s = kva_get_stats(pool, &st);
    if (s != KVA_OK) {
        fprintf(stderr, "kva_get_stats: %s (%s)\n", kva_strerror(s), kva_last_error());
        exit(1);
    }
    return st;
}

#endif
