/*
 * lock.h — a lock for short critical sections that one thread usually takes alone (a
 * variable-size pool driven by one worker), where an atomic read-modify-write per call would
 * cost more than the work it guards (about 3.5 ns each on the benchmark machine).
 *
 * Two ways in:
 *  - the plain lock `held`: an atomic exchange to take it (spinning, then yielding, when it is
 *    taken), a release store to give it back;
 *  - the bias: after KVA_LOCK_BIAS_STREAK plain acquisitions in a row by one thread, the lock is
 *    biased to that thread, which then enters with plain stores and loads only: it writes the
 *    lock's address into its own `in` flag (one per thread, kva_lock_owner), then checks the
 *    bias is still its own.
 * Another thread that wants the lock takes `held`, clears the bias, and runs the membarrier
 * system call (MEMBARRIER_CMD_PRIVATE_EXPEDITED), which puts a full memory barrier into every
 * running thread of the process; then it waits until the biased thread's flag no longer names
 * this lock. This is Dekker's protocol with the fence moved to the rare side (as in userspace
 * RCU and folly's asymmetric barriers): after the membarrier, either the biased thread's flag is
 * visible to the waiter, or its read of the bias, which follows the store to its flag, sees it
 * cleared and it backs off to the plain lock. So the common path has no fence and no locked
 * instruction, and the system call is paid once per change of hands between threads. Where
 * membarrier is unavailable the lock never biases; where the kernel refuses it after biasing
 * began, the revocation waits out the biased thread's store buffer instead, and biasing ends
 * (lock.c, fence_biased_thread).
 *
 * The flag is the thread's own, not the lock's: a thread that read a stale bias and backs off
 * clears only its own flag, never that of the thread the lock has been biased to since (a
 * shared flag let a backing-off thread clear a newly biased thread's, and ThreadSanitizer found
 * the overlap that followed). A thread inside one biased lock takes any other lock the plain
 * way, so nesting cannot make a revoker wait on a flag that names another lock. Flags are
 * recycled when their threads exit, never freed: a revoker may still read one.
 *
 * acquire returns a token that release takes back: which way the caller came in.
 */
#ifndef KVA_LOCK_H
#define KVA_LOCK_H

#include "internal.h"

/* Plain acquisitions in a row by one thread before the lock biases to it: a revocation costs a
 * system call (a few microseconds), so a lock that changes hands often must not bias. */
#define KVA_LOCK_BIAS_STREAK 256

typedef struct kva_lock kva_lock;

/* One per thread that has taken a kva_lock (a cache line each: revokers read it). */
typedef struct kva_lock_owner {
    const kva_lock *in;          /* the lock this thread is inside by its bias, or NULL */
    struct kva_lock_owner *next; /* on the free list once the thread has exited */
} __attribute__((aligned(64))) kva_lock_owner;

struct kva_lock {
    uint32_t held;        /* the plain lock */
    uint32_t streak;      /* under held: plain acquisitions in a row by streak_owner */
    kva_lock_owner *bias; /* the thread the lock is biased to, or NULL */
    kva_lock_owner *streak_owner;
    uint64_t revocations; /* under held: biases revoked (for the tests and the curious) */
};

/* (clang-format 14 would move a macro's brace initializer onto a line of its own) */
/* clang-format off */
#define KVA_LOCK_INIT {0, 0, NULL, NULL, 0}
/* clang-format on */

/* This thread's flag; &kva_lock_nobody until its first lock (kva_lock_me_slow makes it; it stays
 * &kva_lock_nobody if there is no memory for one, and then the thread always takes the plain
 * way). kva_lock_nobody's `in` is never NULL and no lock is ever biased to it, so the biased way
 * in needs no test of its own for a thread without a flag, and never writes the shared one. */
extern kva_lock_owner kva_lock_nobody;
extern __thread kva_lock_owner *kva_lock_me __attribute__((tls_model("initial-exec")));
kva_lock_owner *kva_lock_me_slow(void);

/* The list of exited threads' flags, for the fork handlers (fork.c): a thread making or
 * recycling a flag holds its lock for a moment, and a child forked then would inherit it held
 * and hang in its first lock. A leaf: nothing is taken under it. */
void kva_lock_flags_lock(void);
void kva_lock_flags_unlock(void);

/* The slow ways: the plain lock, revoking another thread's bias if need be. */
int kva_lock_acquire_slow(kva_lock *lock, kva_lock_owner *me);
void kva_lock_release_plain(kva_lock *lock);

enum {
    KVA_LOCK_PLAIN = 0,
    KVA_LOCK_BIASED = 1
};

/* The biased way in alone: this thread's flag when it entered by its bias (leave with
 * kva_lock_leave_biased), NULL when it must take the lock with kva_lock_acquire. A caller with a
 * separate slow path keeps no token and loads the thread-local flag once. */
KVA_INLINE kva_lock_owner *kva_lock_enter_biased(kva_lock *lock) {
    kva_lock_owner *me = kva_lock_me;
    if (me == NULL) __builtin_unreachable(); /* never (kva_lock_nobody): callers test only the result */
    /* The flag is set before the bias is read, once: the read after the store is the one
     * Dekker's protocol needs, and a read before it would only spare an unbiased lock's callers
     * a store and its undoing, on a path that goes on to an atomic exchange anyway. A flag
     * naming a lock not biased to its thread is never waited on: revokers read only the biased
     * thread's flag. */
    if (kva_likely(__atomic_load_n(&me->in, __ATOMIC_RELAXED) == NULL)) {
        __atomic_store_n(&me->in, lock, __ATOMIC_RELAXED);
        __atomic_signal_fence(__ATOMIC_SEQ_CST); /* the revoker's membarrier is the real fence */
        if (kva_likely(__atomic_load_n(&lock->bias, __ATOMIC_ACQUIRE) == me)) return me;
        __atomic_store_n(&me->in, NULL, __ATOMIC_RELEASE);
    }
    return NULL;
}

KVA_INLINE void kva_lock_leave_biased(kva_lock_owner *me) { __atomic_store_n(&me->in, NULL, __ATOMIC_RELEASE); }

/* The plain way in, for a caller whose kva_lock_enter_biased just failed (release with
 * kva_lock_release and the token it returns). */
KVA_INLINE int kva_lock_acquire_plain(kva_lock *lock) {
    kva_lock_owner *me = kva_lock_me;
    if (kva_unlikely(me == &kva_lock_nobody)) me = kva_lock_me_slow(); /* NULL: no flag */
    return kva_lock_acquire_slow(lock, me);
}

KVA_INLINE int kva_lock_acquire(kva_lock *lock) {
    if (kva_likely(kva_lock_enter_biased(lock) != NULL)) return KVA_LOCK_BIASED;
    return kva_lock_acquire_plain(lock);
}

KVA_INLINE void kva_lock_release(kva_lock *lock, int token) {
    if (kva_likely(token == KVA_LOCK_BIASED)) __atomic_store_n(&kva_lock_me->in, NULL, __ATOMIC_RELEASE);
    else kva_lock_release_plain(lock);
}

#endif
