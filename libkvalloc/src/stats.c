/*
 * stats.c — the stats query. Everything is derived from counters the hot paths already keep,
 * so asking costs O(orders + classes + arenas + thread caches) and the hot paths pay nothing
 * extra for it. Taken under every lock; the threads' own counters are read as they stand (exact
 * once those threads are quiet, an estimate while they run).
 */
#include "checked_mode.h"
#include "pool.h"
#include "tcache.h"

static kva_status get_stats_locked(kva_pool *pool, kva_stats *out);

kva_status kva_get_stats(kva_pool *pool, kva_stats *out) {
    if (!pool || !out) return kva_fail(KVA_ERR_INVALID, "pool or out is NULL");
    kva_pool_lock_all(pool);
    kva_status st = get_stats_locked(pool, out);
    kva_pool_unlock_all(pool);
    return st;
}

/* Slabs of each class over all arenas. */
static uint64_t class_slabs(const kva_slabs *sl, unsigned c) {
    uint64_t n = 0;
    for (unsigned a = 0; a < sl->narenas; a++) n += sl->arenas[a].classes[c].slabs;
    return n;
}

static kva_status get_stats_locked(kva_pool *pool, kva_stats *out) {
    const kva_buddy *buddy = &pool->buddy;
    const kva_slabs *sl = &pool->slabs;
    kva_stats st = {0};
    st.capacity = pool->capacity;
    st.min_block = (size_t)1 << buddy->min_shift;
    st.slab_chunk = (size_t)1 << sl->chunk_shift;
    /* The largest request that can succeed: a checked pool's two red zones come out of it. */
    st.max_alloc_size = pool->max_alloc_size - (pool->checked ? 2 * KVA_REDZONE : 0);
    st.num_orders = buddy->num_orders;
    for (unsigned k = 0; k < buddy->num_orders; k++) st.free_blocks[k] = buddy->free_count[k];
    st.bytes_free = (size_t)buddy->free_units << buddy->min_shift;
    st.largest_free = buddy->nonempty ? (size_t)1 << (kva_log2(buddy->nonempty) + buddy->min_shift) : 0;
    st.fragmentation = st.bytes_free ? 1.0 - (double)st.largest_free / (double)st.bytes_free : 0.0;

    size_t slab_object_bytes = 0, slab_capacity_bytes = 0, bitmap_bytes = 0;
    uint64_t retracted = __atomic_load_n(&pool->retracted_allocs, __ATOMIC_RELAXED);
    uint64_t allocs = pool->block_allocs, frees = pool->block_frees, live = allocs - frees;
    kva_tc_totals totals;
    kva_tc_totals_locked(&pool->caches, &totals);
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        const kva_class_geometry *g = &sl->geom[c];
        uint64_t slabs = class_slabs(sl, c);
        allocs += totals.allocs[c];
        frees += kva_tc_frees_made(&totals, c);
        /* While threads run, objects allocated and freed between the two passes of the totals
         * count as live: at most what the class's slabs hold, read under the locks. */
        uint64_t objects = kva_tc_live(&totals, c), room = slabs * g->nobj;
        if (objects > room) objects = room;
        live += objects;
        slab_object_bytes += (size_t)objects * g->size;
        slab_capacity_bytes += (size_t)slabs * g->nobj * g->size;
        bitmap_bytes += (size_t)slabs * kva_slot_words(g->l0_words, g->l1_words) * sizeof(uint64_t);
        st.cached_bytes += (size_t)totals.cached[c] * g->size;
    }
    st.arenas = sl->narenas;
    st.thread_caches = totals.caches;
    st.remote_frees = totals.remote_frees;
    st.slab_count = sl->live_slabs;
    st.slab_bytes = (size_t)sl->live_slabs << sl->chunk_shift;
    st.slab_free_bytes = slab_capacity_bytes - slab_object_bytes;
    size_t block_bytes = (size_t)buddy->used_units << buddy->min_shift;
    st.bytes_in_use = slab_object_bytes + (block_bytes - st.slab_bytes);
    /* A checked pool's withheld blocks (pool.h, quarantine) are allocated, their bytes in use,
     * but no caller received them: no live allocation, no allocation counted. */
    st.live_allocations = live - pool->quarantined;
    st.alloc_count = allocs - retracted - pool->quarantined;
    st.free_count = frees - retracted;
    st.alloc_failures = __atomic_load_n(&pool->alloc_failures, __ATOMIC_RELAXED);
    st.rejected_calls = __atomic_load_n(&pool->rejected_calls, __ATOMIC_RELAXED);
    st.page_kind = pool->region.page_kind;
    st.page_size = pool->region.page_size;
    if (sl->bitmaps_resident) bitmap_bytes = sl->bitmaps_bytes; /* faulted in at creation, all of them */
    size_t caches = totals.caches + (__atomic_load_n(&pool->caches.spare, __ATOMIC_RELAXED) != NULL);
    st.metadata_bytes = sizeof *pool + buddy->pages_bytes + sl->slabs_bytes + bitmap_bytes +
                        (size_t)sl->narenas * sizeof(kva_arena) + caches * sizeof(kva_tcache);
    st.numa_node = pool->region.numa_node;
    st.backend = (uint32_t)pool->region.backend;
    st.mapped_bytes = kva_region_mapped_bytes(&pool->region);
    st.pinned = pool->region.pinned != NULL;
    st.locked = pool->region.locked;
    if (st.bytes_in_use > pool->peak_bytes_in_use) pool->peak_bytes_in_use = st.bytes_in_use;
    st.peak_bytes_in_use = pool->peak_bytes_in_use;
    st.peak_block_bytes = (size_t)buddy->peak_used_units << buddy->min_shift;
    *out = st;
    return KVA_OK;
}

kva_status kva_reset_peaks(kva_pool *pool) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    kva_pool_lock_all(pool);
    pool->buddy.peak_used_units = pool->buddy.used_units;
    pool->peak_bytes_in_use = 0;
    kva_stats now; /* raises the peak of bytes_in_use to the figure as it stands */
    get_stats_locked(pool, &now);
    kva_pool_unlock_all(pool);
    return KVA_OK;
}

kva_status kva_get_class_stats(kva_pool *pool, unsigned index, kva_class_stats *out) {
    if (!pool || !out) return kva_fail(KVA_ERR_INVALID, "pool or out is NULL");
    if (index >= KVA_NUM_SIZE_CLASSES)
        return kva_fail(KVA_ERR_INVALID, "size class %u out of range (0..%d)", index, KVA_NUM_SIZE_CLASSES - 1);
    kva_pool_lock_all(pool);
    kva_tc_totals totals;
    kva_tc_totals_locked(&pool->caches, &totals);
    const kva_class_geometry *g = &pool->slabs.geom[index];
    *out = (kva_class_stats){.object_size = g->size,
                             .objects_per_slab = g->nobj,
                             .live_objects = kva_tc_live(&totals, index),
                             .slabs = class_slabs(&pool->slabs, index)};
    kva_pool_unlock_all(pool);
    return KVA_OK;
}
