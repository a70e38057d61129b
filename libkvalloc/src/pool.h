/*
 * pool.h — the pool: a region, the buddy over it, the slabs over the buddy and the thread caches
 * over the slabs. pool.c routes the calls on a live pool (kva_alloc by size, kva_free by the
 * owner of the address), pool_make.c makes and destroys pools and keeps the list of live ones,
 * pool_range.c gives back and takes again the memory behind part of an allocation, and
 * checked_mode.c is the checked mode. kva_pool_create is publish.c's: it makes the pool here and,
 * for a named pool, the statistics above it.
 *
 * Invariants beyond those of buddy.h and slab.h:
 *  P1  region.base is aligned to the largest block, so a block of order k is aligned to
 *      min_block << k in absolute addresses too.
 *  P2  capacity == buddy.nblocks << buddy.min_shift <= region.length.
 *  P3  block_allocs - block_frees == the number of USED buddy blocks.
 *  P4  the slabs count 1 .. KVA_MAX_ARENAS arenas and one descriptor per chunk of the capacity
 *      (checked first: every lock taken and every walk relies on them; an arena count within
 *      those bounds is trusted, as the pool pointer is: nothing else records it).
 */
#ifndef KVA_POOL_H
#define KVA_POOL_H

#include <pthread.h>

#include "buddy.h"
#include "region.h"
#include "slab.h"
#include "tcache.h"

/* What watches a named pool: the stats layer installs it when it creates the pool (publish.c)
 * and the pool calls it from its slow paths, knowing nothing of what is behind it. An anonymous
 * pool has none (due NULL). */
typedef struct kva_pool_observer {
    /* A call to record (every call of a traced pool, failed and rejected ones always): its op
     * (KVA_SHM_OP_*), status, pool offset (UINT64_MAX: none), size and latency (UINT64_MAX: not
     * timed). */
    void (*record)(void *ctx, uint8_t op, kva_status status, uint64_t offset, uint64_t size, uint64_t latency_ns);
    /* Reads the clock and publishes when the pool's interval has passed: called from a thread's
     * slow calls on the pool when kva_pool_tick says so. */
    void (*due)(void *ctx);
    /* The pool is being destroyed. */
    void (*close)(void *ctx);
    void *ctx;
} kva_pool_observer;

struct kva_pool {
    /* Read on every call: kept together at the front. */
    unsigned char *base;
    size_t capacity;
    /* The fast paths take requests below fast_limit and frees below fast_capacity: normally
     * KVA_SLAB_MAX_SIZE and capacity, both 0 in a traced pool so that every call reaches the
     * checked path, which times and records it. The switch costs the fast paths nothing: they
     * compare with a field instead of a constant. */
    size_t fast_limit;
    size_t fast_capacity;
    int checked; /* kva_config.checked: see checked_mode.h */
    kva_slabs slabs;
    kva_buddy buddy;
    /* The pool lock: the buddy, the region, the block counters and slabs.live_slabs. Taken
     * inside an arena lock, never the other way round (arena.h). */
    pthread_mutex_t lock;
    uint64_t block_allocs; /* buddy blocks handed out (slab objects count per class) */
    uint64_t block_frees;
    uint64_t alloc_failures; /* atomic */
    uint64_t rejected_calls; /* atomic */
    /* Checked mode's quarantine (kva_checked_alloc), under the pool lock: the blocks in which an
     * allocation found a write after free. Each stays allocated with what was written into it,
     * is never handed out again, a free of it is a double free (its caller freed it once
     * already), and kva_check reports it (C2). The totals count it as an allocation nobody
     * received. */
    uint64_t *quarantine; /* the blocks' start offsets, in the order found */
    uint32_t quarantined, quarantine_room;
    /* atomic: the same blocks taken back instead, when there was no host memory to list them
     * (poisoned again and freed: each was counted as an allocation and a free that the caller
     * never saw, so the totals take both out again) */
    uint64_t retracted_allocs;
    size_t max_alloc_size;
    /* the highest bytes_in_use a stats query computed (stats.c), under every lock */
    size_t peak_bytes_in_use;
    /* metadata faulted in at creation within the process's share (pool_make.c); 0 with prefault */
    size_t populated_bytes;
    kva_region region;
    int trace; /* a named pool's kva_config.trace: every call is timed and recorded */
    /* This process is a child forked from the pool's owner, and the memory is shared with it
     * (kva_config.shared): the allocator here is a copy that would hand out and give back the
     * owner's bytes, so every call that would is refused (fork.c sets it, the slow paths read
     * it; the fast paths cannot reach the pool, fork.c says why). */
    int inherited_shared;
    uint64_t uid; /* unique in the process: a thread's countdown (kva_pool_tick) */
    kva_pool_observer observer;
    kva_tc_registry caches;                 /* the thread caches (tcache.h) */
    struct kva_pool *live_prev, *live_next; /* every live pool (kva_pools_first) */
    kva_config config;                      /* as created; config.name points at name below */
    char name[KVA_NAME_MAX + 1];
};

/* Why a call on a forked child's copy of a shared pool (inherited_shared) is refused:
 * KVA_ERR_BACKEND, the reason recorded (not bad input: no refused call is counted). */
kva_status kva_pool_refuse_inherited(void);

/* kva_pool_create without what is above the pool: the pool the config describes, anonymous
 * whatever its name (the caller installs an observer for a named one). Errors as
 * kva_pool_create's. */
kva_status kva_pool_make(const kva_config *cfg, kva_pool **out);

/* Installs a named pool's observer, before the pool is shared (but after kva_pool_make has listed
 * it among the live pools); its close runs at destruction. */
void kva_pool_observe(kva_pool *pool, const kva_pool_observer *observer);

/* Takes every lock of the pool in order (the registry, the arenas, the pool lock), so that only
 * the threads' own words move: kva_check, the stats and publishing read under it. */
void kva_pool_lock_all(kva_pool *pool);
void kva_pool_unlock_all(kva_pool *pool);

/* Every live pool, listed from its creation (kva_pool_make) until its destruction, for the fork
 * handlers (fork.c), which take every lock of every pool around a fork. kva_pools_lock holds
 * the list still, the first lock in the library's order (fork.c takes them all); under it the
 * list runs from kva_pools_first through live_next. */
void kva_pools_lock(void);
void kva_pools_unlock(void);
kva_pool *kva_pools_first(void);

/* Whether this slow-path call on pool should call its observer's due (the observer reads the
 * clock then, under a lock of its own): the thread's first call on the pool (so that a pool's
 * first slow call publishes, as an inspector expects), then every KVA_POOL_TICK_EVERY calls of
 * the thread on it. The countdowns are the thread's own, not the pool's (one all threads
 * decremented would be a cache line they all write), one per pool in KVA_POOL_TICK_SLOTS slots
 * picked by the pool's uid, so that a thread that alternates between pools still reads the
 * clock once per 64 calls of each (one countdown, reset to 1 at every switch, read it at every
 * call and took the lock with it). Pools that share a slot reset it in turn. Enough calls
 * between two reads that the reads cost nothing, few enough that even a pool making only a few
 * thousand slow calls a second publishes on time. */
#define KVA_POOL_TICK_EVERY 64
#define KVA_POOL_TICK_SLOTS 8
typedef struct kva_pool_ticker {
    uint64_t uid;
    unsigned countdown;
} kva_pool_ticker;
extern __thread kva_pool_ticker kva_pool_tickers[KVA_POOL_TICK_SLOTS];
KVA_INLINE int kva_pool_tick(const kva_pool *pool) {
    kva_pool_ticker *t = &kva_pool_tickers[pool->uid % KVA_POOL_TICK_SLOTS];
    if (kva_unlikely(t->uid != pool->uid)) {
        t->uid = pool->uid;
        t->countdown = 1;
    }
    if (kva_likely(--t->countdown)) return 0;
    t->countdown = KVA_POOL_TICK_EVERY;
    return 1;
}

/* ---- the routing's parts the checked mode builds on (pool.c, checked_mode.c) -------------- */

/* Counts a call refused for bad input; returns status. */
KVA_INLINE kva_status kva_pool_reject(kva_pool *pool, kva_status status) {
    __atomic_fetch_add(&pool->rejected_calls, 1, __ATOMIC_RELAXED);
    return status;
}

/* kva_free's work on an unchecked pool: the free of the slab object or the block at ptr, or why
 * not (counted as rejected). */
kva_status kva_pool_free_plain(kva_pool *pool, void *ptr);

/* The usable size of the allocation that starts at ptr (red zones included in a checked pool),
 * or 0 when none starts there. */
size_t kva_pool_usable(kva_pool *pool, const void *ptr);

/* Why a slab address that is no object's start cannot be freed (kva_fail's status). */
kva_status kva_pool_classify_slab_interior(kva_pool *pool, const void *ptr, uint64_t offset);

/* Why a non-slab address cannot be freed (kva_fail's status). Pool lock held. */
kva_status kva_pool_classify_bad_free(kva_pool *pool, const void *ptr, uint64_t offset);

/* kva_walk with the locks already held. */
kva_status kva_walk_locked(kva_pool *pool, kva_walk_fn fn, void *ctx);

#endif
