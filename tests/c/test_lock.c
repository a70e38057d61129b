/*
 * test_lock.c — kva_lock (lock.h), the biased lock of the variable-size pools: mutual exclusion
 * holds through every way in and every change of hands. Threads add to a plain counter (and
 * check a canary nobody else may see change) under the lock, in long runs that let the lock bias
 * to one of them and in short alternating ones that make the others revoke it.
 */
#include <pthread.h>
#include <sched.h>

#include "check.h"
#include "lock.h"

#define THREADS 4

static kva_lock lock = KVA_LOCK_INIT;
static uint64_t counter;     /* only under the lock */
static uint64_t canary;      /* only under the lock: set, checked, cleared */
static int biased_seen;      /* some acquisition came in biased */
static int overlaps;         /* a section saw another one's canary */

typedef struct worker {
    unsigned id;
    unsigned runs, run_length;
} worker;

static void *work(void *arg) {
    const worker *w = arg;
    for (unsigned run = 0; run < w->runs; run++) {
        for (unsigned i = 0; i < w->run_length; i++) {
            int token = kva_lock_acquire(&lock);
            if (token == KVA_LOCK_BIASED) __atomic_store_n(&biased_seen, 1, __ATOMIC_RELAXED);
            if (canary != 0) __atomic_add_fetch(&overlaps, 1, __ATOMIC_RELAXED);
            canary = w->id + 1;
            counter++;
            if (canary != w->id + 1) __atomic_add_fetch(&overlaps, 1, __ATOMIC_RELAXED);
            canary = 0;
            kva_lock_release(&lock, token);
        }
        sched_yield(); /* let another thread take the lock, and revoke a bias */
    }
    return NULL;
}

static void run(unsigned runs, unsigned run_length) {
    pthread_t threads[THREADS];
    worker workers[THREADS];
    uint64_t before = counter;
    for (unsigned t = 0; t < THREADS; t++) {
        workers[t] = (worker){.id = t, .runs = runs, .run_length = run_length};
        REQUIRE(pthread_create(&threads[t], NULL, work, &workers[t]) == 0);
    }
    for (unsigned t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
    CHECK(counter - before == (uint64_t)THREADS * runs * run_length);
    CHECK(overlaps == 0);
}

int main(void) {
    /* One thread alone: the lock biases to it after KVA_LOCK_BIAS_STREAK acquisitions. */
    for (unsigned i = 0; i < 2 * KVA_LOCK_BIAS_STREAK; i++) {
        int token = kva_lock_acquire(&lock);
        counter++;
        kva_lock_release(&lock, token);
        if (i == 2 * KVA_LOCK_BIAS_STREAK - 1) CHECK(token == KVA_LOCK_BIASED);
    }
    CHECK(lock.bias != 0);
    /* Long runs: biases form and are revoked as the threads take turns. */
    run(40, 4 * KVA_LOCK_BIAS_STREAK);
    /* Short runs: the lock changes hands all the time. */
    run(2000, 3);
    printf("test_lock: %llu sections, %llu revocations, biased acquisitions %s\n", (unsigned long long)counter,
           (unsigned long long)lock.revocations, biased_seen ? "seen" : "not seen");
    CHECK(biased_seen);
    CHECK(lock.revocations > 0);
    return CHECK_DONE();
}
