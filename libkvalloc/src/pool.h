/*
 * pool.h — the pool: a region, the buddy over it and the slabs over the buddy.
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
#include "publish.h"
#include "region.h"
#include "segment.h"
#include "slab.h"
#include "tcache.h"

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
    int checked;                     /* kva_config.checked: see checked.h */
    kva_slabs slabs;
    kva_buddy buddy;
    /* The pool lock: the buddy, the region, the block counters and slabs.live_slabs. Taken
     * inside an arena lock, never the other way round (arena.h). */
    pthread_mutex_t lock;
    uint64_t block_allocs;   /* buddy blocks handed out (slab objects count per class) */
    uint64_t block_frees;
    uint64_t alloc_failures; /* atomic */
    uint64_t rejected_calls; /* atomic */
    /* Checked mode's quarantine (checked_alloc), under the pool lock: the blocks in which an
     * allocation found a write after free. Each stays allocated with what was written into it,
     * is never handed out again, a free of it is a double free (its caller freed it once
     * already), and kva_check reports it (C2). The totals count it as an allocation nobody
     * received. */
    uint64_t *quarantine;            /* the blocks' start offsets, in the order found */
    uint32_t quarantined, quarantine_room;
    /* atomic: the same blocks taken back instead, when there was no host memory to list them
     * (poisoned again and freed: each was counted as an allocation and a free that the caller
     * never saw, so the totals take both out again) */
    uint64_t retracted_allocs;
    size_t max_alloc_size;
    kva_region region;
    kva_segment *segment;            /* NULL for an anonymous pool */
    /* The segment's writers (trace records, publishing) and the KV publisher hook. Taken before
     * any other lock. */
    pthread_mutex_t publish_lock;
    kva_kv_publisher kv_publisher;   /* set by a KV cache built on this pool */
    kva_tc_registry caches; /* the thread caches (tcache.h) */
    struct kva_pool *fork_prev, *fork_next; /* every live pool (fork.c) */
    kva_config config; /* as created; config.name points at name below */
    char name[KVA_NAME_MAX + 1];
};

/* Takes every lock of the pool in order (the registry, the arenas, the pool lock), so that only
 * the threads' own words move: kva_check, the stats and publishing read under it. */
void kva_pool_lock_all(kva_pool *pool);
void kva_pool_unlock_all(kva_pool *pool);

/* kva_walk with the locks already held. */
kva_status kva_walk_locked(kva_pool *pool, kva_walk_fn fn, void *ctx);

#endif
