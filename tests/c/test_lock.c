/*
 * test_lock.c — kva_lock (lock.h), the biased lock of the variable-size pools: mutual exclusion
 * holds through every way in and every change of hands. Threads add to a plain counter (and
 * check a canary nobody else may see change) under the lock, in long runs that let the lock bias
 * to one of them and in short alternating ones that make the others revoke it.
 */
#include <errno.h>
#include <linux/filter.h>
#include <linux/membarrier.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "child.h"
#include "lock.h"
#include "os.h"

#define THREADS 4

static kva_lock lock = KVA_LOCK_INIT;
static uint64_t counter; /* only under the lock */
static uint64_t canary;  /* only under the lock: set, checked, cleared */
static int biased_seen;  /* some acquisition came in biased */
static int overlaps;     /* a section saw another one's canary */

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

static void pause_ms(long ms) {
    struct timespec pause = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&pause, NULL);
}

/* ---- fork while another thread holds the flags' list ------------------------------------- */

static int flags_held, flags_released;

static void *hold_flags(void *arg) {
    (void)arg;
    kva_lock_flags_lock();
    __atomic_store_n(&flags_held, 1, __ATOMIC_RELEASE);
    /* Long enough for the main thread to reach fork: a fork that does not wait for the list
     * (the handlers did not take it) happens while it is held. */
    pause_ms(100);
    kva_lock_flags_unlock();
    __atomic_store_n(&flags_released, 1, __ATOMIC_RELEASE);
    return NULL;
}

static int first_lock_in_child(void) {
    hang_guard("the child's first lock", HANG_GUARD_SECONDS); /* it hangs if it inherited the list's lock held */
    kva_lock fresh = KVA_LOCK_INIT;
    int token = kva_lock_acquire(&fresh); /* this thread's first lock: it makes its flag */
    kva_lock_release(&fresh, token);
    return kva_lock_me != &kva_lock_nobody && kva_os_fork_depth() == 1 ? 0 : 1;
}

/* A thread making or recycling its flag holds the flags' list lock for a moment; a fork then
 * must wait for it (fork.c), or the child's first lock waits forever. Run before this thread
 * has a flag of its own, so that the child's first lock makes one. */
static void fork_while_flags_held(void) {
    REQUIRE(kva_lock_me == &kva_lock_nobody);
    /* Detached: the child, which has no such thread, must not count it as one never joined
     * (ThreadSanitizer reports that at exit). */
    pthread_attr_t detached;
    pthread_attr_init(&detached);
    pthread_attr_setdetachstate(&detached, PTHREAD_CREATE_DETACHED);
    pthread_t holder;
    REQUIRE(pthread_create(&holder, &detached, hold_flags, NULL) == 0);
    pthread_attr_destroy(&detached);
    while (!__atomic_load_n(&flags_held, __ATOMIC_ACQUIRE)) sched_yield();
    in_child(first_lock_in_child, "fork while the flags' list is held");
    while (!__atomic_load_n(&flags_released, __ATOMIC_ACQUIRE)) sched_yield();
}

/* ---- revocation once the kernel refuses membarrier --------------------------------------- */

static kva_lock revoked = KVA_LOCK_INIT;
static int bias_made, bias_may_go;

static void *take_bias(void *arg) {
    (void)arg;
    for (unsigned i = 0; i < 2 * KVA_LOCK_BIAS_STREAK; i++) kva_lock_release(&revoked, kva_lock_acquire(&revoked));
    __atomic_store_n(&bias_made, 1, __ATOMIC_RELEASE);
    /* Alive, its flag its own, until the main thread has revoked the bias. */
    while (!__atomic_load_n(&bias_may_go, __ATOMIC_ACQUIRE)) sched_yield();
    return NULL;
}

/* Makes membarrier fail with EPERM from now on, as a sandbox set up after start-up does. */
static int refuse_membarrier(void) {
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_membarrier, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog program = {sizeof filter / sizeof filter[0], filter};
    return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

/* The revoker retried membarrier forever when the kernel refused it after the registration:
 * the first call on the pool from another thread hung. Now the revocation completes without
 * it and the lock never biases again. */
static int revoke_without_membarrier(void) {
    hang_guard("the revocation without membarrier", HANG_GUARD_SECONDS);
    pthread_t holder;
    REQUIRE(pthread_create(&holder, NULL, take_bias, NULL) == 0);
    while (!__atomic_load_n(&bias_made, __ATOMIC_ACQUIRE)) sched_yield();
    if (revoked.bias == NULL) {
        printf("test_lock: skipped the refused-membarrier case: the lock never biased (no membarrier here)\n");
        _exit(77);
    }
    if (!refuse_membarrier()) {
        printf("test_lock: skipped the refused-membarrier case: no seccomp filter can be installed here\n");
        _exit(77);
    }
    CHECK(syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0);
    int token = kva_lock_acquire(&revoked);
    CHECK(token == KVA_LOCK_PLAIN);
    CHECK(revoked.bias == NULL);
    CHECK(revoked.revocations == 1);
    kva_lock_release(&revoked, token);
    __atomic_store_n(&bias_may_go, 1, __ATOMIC_RELEASE);
    pthread_join(holder, NULL);
    /* Biasing has ended: a thread alone keeps taking the plain way, and threads taking turns
     * still exclude each other. */
    for (unsigned i = 0; i < 2 * KVA_LOCK_BIAS_STREAK; i++) {
        token = kva_lock_acquire(&revoked);
        CHECK(token == KVA_LOCK_PLAIN);
        kva_lock_release(&revoked, token);
    }
    CHECK(revoked.bias == NULL);
    run(20, 2 * KVA_LOCK_BIAS_STREAK);
    CHECK(!biased_seen);
    return check_failures ? 1 : 0;
}

int main(void) {
    /* The child that makes threads first, while this process has one thread: ThreadSanitizer
     * refuses new threads in a child forked from several (the flags' holder may still be
     * leaving when the next fork comes). */
    in_child(revoke_without_membarrier, "revocation with membarrier refused");
    fork_while_flags_held();

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
