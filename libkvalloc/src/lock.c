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
#include "os.h"

/* Spins of a waiter before it yields: about a microsecond, longer than any section the lock
 * guards takes when its holder runs. */
#define KVA_LOCK_SPINS 256

/* How long a revocation waits for the biased thread's stores to drain when the kernel refuses
 * membarrier (fence_biased_thread): a thousand times longer than a store buffer takes. */
#define KVA_LOCK_DRAIN_NS 1000000

kva_lock_owner kva_lock_nobody = {.in = (const kva_lock *)&kva_lock_nobody}; /* never NULL: never enters */
__thread kva_lock_owner *kva_lock_me __attribute__((tls_model("initial-exec"))) = &kva_lock_nobody;

/* Flags of exited threads, for new threads to reuse: never freed, since a revoker may read a
 * flag at any time. */
static pthread_mutex_t free_owners_lock = PTHREAD_MUTEX_INITIALIZER;
static kva_lock_owner *free_owners;
static pthread_key_t owner_key;
static int owner_key_made;

/* 1 once the process is registered for private expedited membarrier, -1 if it cannot be or the
 * kernel has since refused the fence (fence_biased_thread): then no lock biases. */
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

/* The fence a revocation puts into the biased thread, after clearing the bias: membarrier
 * (lock.h). The kernel can still refuse it after the registration succeeded: for want of
 * memory, in a child forked after the registration on kernels that do not carry it over (it is
 * made again then), or for good, under a seccomp filter installed after the process started.
 * Retrying forever hung the revoker in that last case. So a second refusal ends biasing in this
 * process (no lock biases again, so no later revocation needs the call), and this revocation
 * does without it: after a full fence of its own it waits KVA_LOCK_DRAIN_NS before reading the
 * biased thread's flag. The only way that flag's store could be missed is by still sitting in
 * its thread's store buffer, and stores leave it in nanoseconds (an interrupt, a context switch
 * or a VM exit on that CPU drains it at once); the thread's read of the bias, after its store,
 * then sees the cleared bias whenever the store was not seen. Checked by a test under a seccomp
 * filter (test_lock). */
static void fence_biased_thread(void) {
    if (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0) return;
    if (syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0 &&
        syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0)
        return;
    __atomic_store_n(&membarrier_state, -1, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (uint64_t start = kva_os_monotonic_ns(); kva_os_monotonic_ns() - start < KVA_LOCK_DRAIN_NS;) cpu_relax();
}

int kva_lock_acquire_slow(kva_lock *lock, kva_lock_owner *me) {
    take_held(lock);
    kva_lock_owner *bias = __atomic_load_n(&lock->bias, __ATOMIC_RELAXED);
    if (bias != NULL && bias != me) {
        /* Revoke: clear the bias, fence every running thread, then wait for the biased thread
         * to leave if it got in before the fence (lock.h). */
        __atomic_store_n(&lock->bias, NULL, __ATOMIC_RELAXED);
        fence_biased_thread();
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

void kva_lock_flags_lock(void) { pthread_mutex_lock(&free_owners_lock); }
void kva_lock_flags_unlock(void) { pthread_mutex_unlock(&free_owners_lock); }
