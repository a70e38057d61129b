/*
 * lock.c — the slow ways of kva_lock (lock.h): the plain lock, revoking a bias, the threads'
 * flags and the membarrier registration that makes biasing possible.
 */
#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lock.h"

/* Spins of a waiter before it yields: about a microsecond, longer than any section the lock
 * guards takes when its holder runs. */
#define KVA_LOCK_SPINS 256

kva_lock_owner kva_lock_nobody = {.in = (const kva_lock *)&kva_lock_nobody}; /* never NULL: never enters */
__thread kva_lock_owner *kva_lock_me __attribute__((tls_model("initial-exec"))) = &kva_lock_nobody;

/* Flags of exited threads, for new threads to reuse: never freed, since a revoker may read a
 * flag at any time. */
static pthread_mutex_t free_owners_lock = PTHREAD_MUTEX_INITIALIZER;
static kva_lock_owner *free_owners;
static pthread_key_t owner_key;
static int owner_key_made;

/* 1 once the process is registered for private expedited membarrier, -1 if it cannot be. */
static int membarrier_state;

static void owner_exit(void *flag) {
    kva_lock_owner *owner = flag;
    kva_lock_me = &kva_lock_nobody;
    pthread_mutex_lock(&free_owners_lock);
    owner->next = free_owners;
    free_owners = owner;
    pthread_mutex_unlock(&free_owners_lock);
}

__attribute__((constructor)) static void make_owner_key(void) {
    owner_key_made = pthread_key_create(&owner_key, owner_exit) == 0;
}

kva_lock_owner *kva_lock_me_slow(void) {
    if (!owner_key_made) return NULL;
    pthread_mutex_lock(&free_owners_lock);
    kva_lock_owner *owner = free_owners;
    if (owner) free_owners = owner->next;
    pthread_mutex_unlock(&free_owners_lock);
    if (!owner) owner = aligned_alloc(sizeof *owner, sizeof *owner);
    if (!owner) return NULL;
    owner->next = NULL;
    __atomic_store_n(&owner->in, NULL, __ATOMIC_RELAXED);
    if (pthread_setspecific(owner_key, owner) != 0) {
        owner_exit(owner);
        return NULL;
    }
    return kva_lock_me = owner;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void backoff(unsigned spins) {
    if (spins < KVA_LOCK_SPINS) cpu_relax();
    else sched_yield();
}

static void take_held(kva_lock *lock) {
    for (unsigned spins = 0; __atomic_exchange_n(&lock->held, 1, __ATOMIC_ACQUIRE); spins++)
        while (__atomic_load_n(&lock->held, __ATOMIC_RELAXED)) backoff(spins++);
}

/* Whether biasing may be used: the registration is a system call, made by the first lock that
 * would bias (never on a fast path), once per process. */
static int membarrier_usable(void) {
    int state = __atomic_load_n(&membarrier_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        long ok = syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0);
        state = ok == 0 ? 1 : -1;
        __atomic_store_n(&membarrier_state, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}

int kva_lock_acquire_slow(kva_lock *lock, kva_lock_owner *me) {
    take_held(lock);
    kva_lock_owner *bias = __atomic_load_n(&lock->bias, __ATOMIC_RELAXED);
    if (bias != NULL && bias != me) {
        /* Revoke: clear the bias, fence every running thread, then wait for the biased thread
         * to leave if it got in before the fence (lock.h). */
        __atomic_store_n(&lock->bias, NULL, __ATOMIC_RELAXED);
        /* Without the fence mutual exclusion fails silently, so it is retried until the kernel
         * gives it: it can refuse for want of memory, or because this process is a child forked
         * after the registration (which then is made again). */
        for (unsigned tries = 0; syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0; tries++) {
            syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0);
            backoff(tries);
        }
        for (unsigned spins = 0; __atomic_load_n(&bias->in, __ATOMIC_ACQUIRE) == lock; spins++) backoff(spins);
        lock->revocations++;
        bias = NULL;
    }
    if (lock->streak_owner != me) {
        lock->streak_owner = me;
        lock->streak = 0;
    }
    if (++lock->streak >= KVA_LOCK_BIAS_STREAK && me != NULL && bias != me && membarrier_usable()) {
        /* Biased from the next acquisition on; this one holds the plain lock. */
        __atomic_store_n(&lock->bias, me, __ATOMIC_RELEASE);
        lock->streak = 0;
    }
    return KVA_LOCK_PLAIN;
}

void kva_lock_release_plain(kva_lock *lock) { __atomic_store_n(&lock->held, 0, __ATOMIC_RELEASE); }
