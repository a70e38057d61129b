/*
 * walk.c — the heap walk: every range of the pool in address order, live or free. The ranges
 * tile [0, capacity) exactly, which is what lets a debugger or the inspector draw a heap map.
 */
#include "pool.h"

typedef struct walker {
    kva_walk_fn fn;
    void *ctx;
    uint64_t free_start, free_size; /* a pending run of free slab objects */
} walker;

static int flush_free_run(walker *w) {
    if (w->free_size == 0) return 0;
    uint64_t size = w->free_size;
    w->free_size = 0;
    return w->fn(w->free_start, size, KVA_WALK_SLAB_FREE, w->ctx);
}

static void add_free(walker *w, uint64_t offset, uint64_t size) {
    if (w->free_size == 0) w->free_start = offset;
    w->free_size += size;
}

/* An object is free when its bit is set in its word or in the word's remote frees (passed to
 * the owning thread, not merged yet). Objects cached by threads are free ones. */
static int walk_slab(const kva_pool *pool, uint32_t s, walker *w) {
    const kva_slabs *sl = &pool->slabs;
    const kva_slab *slab = &sl->slabs[s];
    const kva_class_geometry *cls = &sl->geom[slab->cls];
    const uint64_t *l0 = slab->l0, *remote = kva_slab_remote(slab, cls);
    uint64_t base = (uint64_t)s << sl->chunk_shift;
    for (uint32_t object = 0; object < cls->nobj; object++) {
        uint64_t offset = base + (uint64_t)object * cls->size;
        if ((kva_load(&l0[object >> 6]) | kva_load(&remote[object >> 6])) >> (object & 63) & 1) {
            add_free(w, offset, cls->size);
        } else if (flush_free_run(w) || w->fn(offset, cls->size, KVA_WALK_SLAB_OBJECT, w->ctx)) {
            return 1;
        }
    }
    /* The slack after the last object counts as free space of the slab. */
    uint64_t used = (uint64_t)cls->nobj * cls->size, chunk = (uint64_t)1 << sl->chunk_shift;
    if (used < chunk) add_free(w, base + used, chunk - used);
    return flush_free_run(w);
}

/* A slab block the walk can read: a whole chunk whose descriptor names a class and that class's
 * place in its own bitmap slot. */
static int slab_is_walkable(const kva_pool *pool, uint32_t index) {
    const kva_slabs *sl = &pool->slabs;
    uint32_t s = index >> sl->chunk_order;
    if (index & (((uint32_t)1 << sl->chunk_order) - 1) || s >= sl->nchunks) return 0;
    const kva_slab *slab = &sl->slabs[s];
    return slab->cls < KVA_NUM_SIZE_CLASSES && slab->l0 == kva_slab_bitmap(sl, s) + sl->geom[slab->cls].l1_words;
}

kva_status kva_walk(kva_pool *pool, kva_walk_fn fn, void *ctx) {
    if (!pool || !fn) return kva_fail(KVA_ERR_INVALID, "pool or callback is NULL");
    kva_pool_lock_all(pool);
    kva_status st = kva_walk_locked(pool, fn, ctx);
    kva_pool_unlock_all(pool);
    return st;
}

kva_status kva_walk_locked(kva_pool *pool, kva_walk_fn fn, void *ctx) {
    const kva_buddy *buddy = &pool->buddy;
    walker w = {.fn = fn, .ctx = ctx};
    for (uint32_t index = 0; index < buddy->nblocks;) {
        const kva_page *page = &buddy->pages[index];
        uint32_t length = kva_buddy_length(page);
        /* What the walk itself relies on, checked before it is used (the rest is kva_check's):
         * a head that moves the walk forward within the pool, and a slab whose class and
         * bitmap are its own. */
        if (page->order >= buddy->num_orders || length == 0 || length > (uint32_t)1 << page->order ||
            length > buddy->nblocks - index || (page->state == KVA_BLOCK_SLAB && !slab_is_walkable(pool, index)))
            return kva_fail(KVA_ERR_CORRUPT, "minimum block %u does not head a sound block; run kva_check", index);
        uint64_t offset = (uint64_t)index << buddy->min_shift;
        uint64_t size = (uint64_t)length << buddy->min_shift;
        int stop = 0;
        switch (page->state) {
        case KVA_BLOCK_FREE: stop = fn(offset, size, KVA_WALK_FREE, ctx); break;
        case KVA_BLOCK_USED: stop = fn(offset, size, KVA_WALK_BLOCK, ctx); break;
        case KVA_BLOCK_SLAB: stop = walk_slab(pool, index >> pool->slabs.chunk_order, &w); break;
        default: return kva_fail(KVA_ERR_CORRUPT, "minimum block %u is not a block head; run kva_check", index);
        }
        if (stop) break;
        index += length;
    }
    return KVA_OK;
}
