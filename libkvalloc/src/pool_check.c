/*
 * pool_check.c — kva_check: walks every invariant stated in buddy.h, slab.h, pool.h and
 * checked_mode.h and names the first one broken: the buddy's (buddy_check.c), each slab's and
 * each arena list's (slab_check.c), each thread cache's (tcache_check.c), then what adds up
 * across them (S5, the owner entries of S6, P1-P4, C1-C2) and the region's (region_check.c).
 * O(capacity / min_block + slab bitmap words); never on a hot path.
 */
#include <stdlib.h>

#include "checked_mode.h"
#include "pool.h"
#include "region_check.h"
#include "tcache.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

/* S6: the caches' side (kva_tc_check_caches), and the owner entries of all slabs number
 * exactly the words the caches list. */
static kva_status check_caches(const kva_pool *pool, uint64_t owned_entries) {
    uint64_t listed = 0;
    kva_status st = kva_tc_check_caches(&pool->caches, &listed);
    if (st != KVA_OK) return st;
    if (listed != owned_entries)
        return BROKEN("S6: %llu words carry an owner but the thread caches list %llu",
                      (unsigned long long)owned_entries, (unsigned long long)listed);
    return KVA_OK;
}

static kva_status check_slabs(const kva_pool *pool, const kva_tc_totals *totals) {
    const kva_slabs *sl = &pool->slabs;
    uint64_t live[KVA_NUM_SIZE_CLASSES] = {0}, in_caches[KVA_NUM_SIZE_CLASSES] = {0}, owned = 0;
    uint32_t total = 0;
    size_t cells = (size_t)sl->narenas * KVA_NUM_SIZE_CLASSES;
    uint64_t *per_arena = calloc(2 * cells, sizeof *per_arena), *flagged = per_arena + cells;
    if (!per_arena) return kva_fail(KVA_ERR_NOMEM, "no host memory to check the slabs");
    kva_status st = KVA_OK;
    for (uint32_t s = 0; s < sl->nchunks && st == KVA_OK; s++) {
        const kva_slab *slab = &sl->slabs[s];
        uint64_t in_cache = 0;
        st = kva_slab_check(sl, s, &in_cache, &owned);
        if (st != KVA_OK || slab->cls == KVA_SLAB_NONE) continue;
        in_caches[slab->cls] += in_cache;
        live[slab->cls] += slab->inuse;
        size_t cell = (size_t)slab->arena * KVA_NUM_SIZE_CLASSES + slab->cls;
        per_arena[cell]++;
        flagged[cell] += slab->listed;
        total++;
    }
    for (unsigned a = 0; a < sl->narenas && st == KVA_OK; a++) {
        for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES && st == KVA_OK; c++) {
            size_t cell = (size_t)a * KVA_NUM_SIZE_CLASSES + c;
            uint64_t listed;
            st = kva_slab_check_list(sl, a, c, &listed);
            if (st != KVA_OK) break;
            if (listed != flagged[cell])
                st = BROKEN("S3: arena %u's partial list of class %u holds %llu slabs but %llu are flagged listed", a,
                            c, (unsigned long long)listed, (unsigned long long)flagged[cell]);
            else if (sl->arenas[a].classes[c].slabs != per_arena[cell])
                st = BROKEN("S5: arena %u counts %u slabs of class %u; %llu exist", a, sl->arenas[a].classes[c].slabs,
                            c, (unsigned long long)per_arena[cell]);
        }
    }
    free(per_arena);
    if (st != KVA_OK) return st;
    if (total != sl->live_slabs) return BROKEN("S5: %u slabs exist, the counter says %u", total, sl->live_slabs);
    if (totals->foreign_caches) return KVA_OK; /* S5 and S6 need the other threads' caches still */
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++)
        if (totals->allocs[c] - totals->frees[c] != live[c] - in_caches[c])
            return BROKEN("S5: class %u counts %llu live objects; its slabs hold %llu", c,
                          (unsigned long long)(totals->allocs[c] - totals->frees[c]),
                          (unsigned long long)(live[c] - in_caches[c]));
    return check_caches(pool, owned);
}

typedef struct poison_check {
    const unsigned char *base;
    uint64_t bad_at; /* UINT64_MAX while every free byte holds the poison */
} poison_check;

static int check_free_range(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    poison_check *pc = ctx;
    size_t bad;
    if ((kind == KVA_WALK_FREE || kind == KVA_WALK_SLAB_FREE) &&
        !kva_holds(pc->base + offset, size, KVA_POISON_FREE, &bad)) {
        pc->bad_at = offset + bad;
        return 1;
    }
    return 0;
}

static kva_status check_locked(kva_pool *pool);

/* Every lock, so that nothing but the threads' own words moves while the invariants are read.
 * The counts that locking and every walk below rely on are checked first: the arenas (whose
 * locks are taken) and the slab descriptors (one per chunk of the capacity). */
kva_status kva_check(kva_pool *pool) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    const kva_slabs *sl = &pool->slabs;
    if (sl->narenas == 0 || sl->narenas > KVA_MAX_ARENAS)
        return BROKEN("P4: the pool counts %u arenas, not 1 .. %d", sl->narenas, KVA_MAX_ARENAS);
    uint64_t bytes = (uint64_t)pool->buddy.nblocks << pool->buddy.min_shift; /* P2 checks capacity against it */
    if (sl->chunk_shift >= 64 || sl->nchunks != (bytes + ((uint64_t)1 << sl->chunk_shift) - 1) >> sl->chunk_shift)
        return BROKEN("P4: the pool counts %u slab descriptors for %llu bytes in chunks of 2^%u", sl->nchunks,
                      (unsigned long long)bytes, sl->chunk_shift);
    kva_pool_lock_all(pool);
    kva_status st = check_locked(pool);
    kva_pool_unlock_all(pool);
    return st;
}

static kva_status check_locked(kva_pool *pool) {
    if (pool->capacity != (size_t)pool->buddy.nblocks << pool->buddy.min_shift || pool->capacity > pool->region.length)
        return BROKEN("P2: capacity %zu disagrees with %u blocks or the %zu-byte region", pool->capacity,
                      pool->buddy.nblocks, pool->region.length);
    if ((uintptr_t)pool->base & (pool->max_alloc_size - 1))
        return BROKEN("P1: base %p is not aligned to the largest block (%zu)", (void *)pool->base,
                      pool->max_alloc_size);
    uint64_t used_blocks = 0;
    kva_status st = kva_buddy_check(&pool->buddy, &used_blocks);
    if (st != KVA_OK) return st;
    kva_tc_totals totals;
    kva_tc_totals_locked(&pool->caches, &totals);
    st = check_slabs(pool, &totals);
    if (st != KVA_OK) return st;
    if (pool->checked) {
        poison_check pc = {.base = pool->base, .bad_at = UINT64_MAX};
        kva_walk_locked(pool, check_free_range, &pc);
        if (pc.bad_at != UINT64_MAX)
            return BROKEN("C1: byte %llu of the pool is free but was written after it was freed",
                          (unsigned long long)pc.bad_at);
        if (pool->quarantined)
            return BROKEN("C2: %u blocks are withheld, each written after it was freed (the first at byte %llu)",
                          pool->quarantined, (unsigned long long)pool->quarantine[0]);
    }
    if (pool->block_allocs - pool->block_frees != used_blocks)
        return BROKEN("P3: %llu block allocations less %llu frees, but %llu blocks are live",
                      (unsigned long long)pool->block_allocs, (unsigned long long)pool->block_frees,
                      (unsigned long long)used_blocks);
    return kva_region_check(&pool->region, &pool->buddy);
}
