/*
 * pool.h — the pool: a region, the buddy over it and the slabs over the buddy.
 *
 * Invariants beyond those of buddy.h and slab.h:
 *  P1  region.base is aligned to the largest block, so a block of order k is aligned to
 *      min_block << k in absolute addresses too.
 *  P2  capacity == buddy.nblocks << buddy.min_shift <= region.length.
 *  P3  block_allocs - block_frees == the number of USED buddy blocks.
 */
#ifndef KVA_POOL_H
#define KVA_POOL_H

#include "buddy.h"
#include "publish.h"
#include "region.h"
#include "segment.h"
#include "slab.h"

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
    uint64_t block_allocs;   /* buddy blocks handed out (slab objects count per class) */
    uint64_t block_frees;
    uint64_t alloc_failures;
    uint64_t rejected_calls;
    size_t max_alloc_size;
    kva_region region;
    kva_segment *segment;            /* NULL for an anonymous pool */
    kva_kv_publisher kv_publisher;   /* set by a KV cache built on this pool */
    kva_config config; /* as created; config.name points at name below */
    char name[KVA_NAME_MAX + 1];
};

#endif
