/*
 * pool.c — the front door of a live pool: kva_alloc routes by size, kva_free finds the owner of
 * an address, and the calls around them (aligned and exact allocations, usable size, flush,
 * trim).
 *
 * Routing: sizes 1 .. KVA_SLAB_MAX_SIZE go to their slab class; larger ones to a buddy block.
 * To free, the address's chunk descriptor says whether it is a slab (one shift and one load);
 * otherwise the minimum block's record must be the head of a live buddy block.
 */
#include "checked_mode.h"
#include "kvalloc_stats.h"
#include "os.h"
#include "pool.h"

/* ---- observation: what a named pool's observer sees (pool.h) ------------------------------- */

/* A start time when this call is to be timed, UINT64_MAX otherwise. */
static uint64_t observe_start(const kva_pool *pool) { return pool->trace ? kva_os_monotonic_ns() : UINT64_MAX; }

/* Hands a checked call to the observer (every call when tracing; failed and rejected ones
 * always), and lets it publish when the thread's countdown says so. Returns st. */
static kva_status observe_end(kva_pool *pool, uint8_t op, kva_status st, const void *addr, uint64_t size,
                              uint64_t start) {
    const kva_pool_observer *ob = &pool->observer;
    if (kva_likely(!ob->due)) return st;
    if (kva_unlikely(pool->trace || st != KVA_OK)) {
        uint64_t latency = start == UINT64_MAX ? UINT64_MAX : kva_os_monotonic_ns() - start;
        uint64_t offset = addr ? (uint64_t)((uintptr_t)addr - (uintptr_t)pool->base) : UINT64_MAX;
        ob->record(ob->ctx, op, st, offset, size, latency);
    }
    /* In line, a countdown of the thread's own: a named pool's slow calls pay a decrement, and
     * call the observer only every KVA_POOL_TICK_EVERY of them. */
    if (kva_unlikely(kva_pool_tick(pool))) ob->due(ob->ctx);
    return st;
}

/* What observe_end does for a successful untraced call: the countdown. */
static void observe_tick(kva_pool *pool) {
    const kva_pool_observer *ob = &pool->observer;
    if (ob->due && kva_unlikely(kva_pool_tick(pool))) ob->due(ob->ctx);
}

/* ---- allocation ---------------------------------------------------------------------------- */

/* What a successful allocation hands out (for kva_assert): size bytes at ptr inside the pool,
 * aligned as asked. */
static inline int handed_out(const kva_pool *pool, const void *ptr, size_t size, size_t alignment) {
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
    return offset < pool->capacity && size <= pool->capacity - offset && (uintptr_t)ptr % alignment == 0;
}

static void count_failure(kva_pool *pool) { __atomic_fetch_add(&pool->alloc_failures, 1, __ATOMIC_RELAXED); }

static kva_tcache *this_thread_cache(kva_pool *pool) {
    kva_tcache *tc = kva_tc_get(&pool->caches);
    if (!tc) kva_fail(KVA_ERR_NOMEM, "no host memory for this thread's cache of the pool");
    return tc;
}

/* Free objects cached by this thread and empty spare slabs are free memory the buddy cannot
 * see: before a request fails for want of a block, they go back and the buddy is asked again.
 * Returns whether any slab went back. */
static int reclaim_spares(kva_pool *pool) {
    kva_tcache *tc = kva_tc_find(pool);
    if (tc) kva_tc_flush(&pool->caches, tc);
    return kva_slab_trim(&pool->slabs) > 0;
}

/* Backs the block just taken from the buddy at head (a single test for host memory). If the
 * memory cannot be had, the block goes back and the pool is as it was. Pool lock held. */
static kva_status commit_block(kva_pool *pool, uint32_t head) {
    uint64_t length = (uint64_t)kva_buddy_length(&pool->buddy.pages[head]) << pool->buddy.min_shift;
    kva_status st = kva_region_commit(&pool->region, (uint64_t)head << pool->buddy.min_shift, length);
    if (kva_likely(st == KVA_OK)) return KVA_OK;
    kva_buddy_free(&pool->buddy, head);
    if (st == KVA_ERR_NOMEM) count_failure(pool);
    return st;
}

/* Takes a block of the order (exact: only its first `units` minimum blocks) and backs it, under
 * the pool lock. KVA_NIL in *head when the buddy has none. */
static kva_status take_block(kva_pool *pool, unsigned order, uint32_t units, uint32_t *head) {
    pthread_mutex_lock(&pool->lock);
    *head = units ? kva_buddy_alloc_exact(&pool->buddy, order, units)
                  : kva_buddy_alloc(&pool->buddy, order, KVA_BLOCK_USED);
    kva_status st = KVA_OK;
    kva_assert_internal(*head == KVA_NIL || pool->buddy.pages[*head].state == KVA_BLOCK_USED);
    if (*head != KVA_NIL) {
        st = commit_block(pool, *head);
        if (st == KVA_OK) pool->block_allocs++;
        else *head = KVA_NIL;
    }
    pthread_mutex_unlock(&pool->lock);
    return st;
}

/* A buddy block for size bytes (size already validated against max_alloc_size); units > 0:
 * only the first units minimum blocks of it (kva_alloc_exact). */
static kva_status alloc_block_units(kva_pool *pool, size_t size, uint32_t units, void **out) {
    unsigned order = kva_buddy_order_for(&pool->buddy, size);
    uint32_t head;
    kva_status st = take_block(pool, order, units, &head);
    if (st == KVA_OK && head == KVA_NIL && reclaim_spares(pool)) st = take_block(pool, order, units, &head);
    if (st != KVA_OK) return st;
    if (head == KVA_NIL) {
        count_failure(pool);
        pthread_mutex_lock(&pool->lock);
        size_t free_bytes = (size_t)pool->buddy.free_units << pool->buddy.min_shift;
        pthread_mutex_unlock(&pool->lock);
        return kva_fail(KVA_ERR_NOMEM, "no free block of %zu bytes for a%s request of %zu (%zu bytes free)",
                        (size_t)1 << (order + pool->buddy.min_shift), units ? "n exact" : "", size, free_bytes);
    }
    *out = pool->base + ((size_t)head << pool->buddy.min_shift);
    return KVA_OK;
}

static kva_status alloc_block(kva_pool *pool, size_t size, void **out) { return alloc_block_units(pool, size, 0, out); }

/* An object of class c from this thread's cache; when no slab anywhere has one and no chunk is
 * left for a new slab, a buddy block serves the request so that it fails only if the pool as a
 * whole cannot hold it. */
static kva_status alloc_object(kva_pool *pool, unsigned c, size_t size, void **out) {
    kva_tcache *tc = this_thread_cache(pool);
    if (!tc) return KVA_ERR_NOMEM;
    uint64_t offset;
    if (kva_tc_alloc(&pool->caches, tc, c, &offset)) {
        *out = pool->base + offset;
        return KVA_OK;
    }
    return alloc_block(pool, size, out);
}

static kva_status alloc_any(kva_pool *pool, size_t size, void **out) {
    if (!out) return kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID, "out is NULL"));
    if (size == 0) return kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID, "size 0"));
    if (size > pool->max_alloc_size)
        return kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID,
                                              "size %zu exceeds the largest block this pool can "
                                              "hold (%zu)",
                                              size, pool->max_alloc_size));
    if (size <= KVA_SLAB_MAX_SIZE) return alloc_object(pool, kva_class_index(size), size, out);
    return alloc_block(pool, size, out);
}

/* ---- why a free is refused ---------------------------------------------------------------- */

/* Why a non-slab address cannot be freed: it lies in free memory or inside a live block. */
kva_status kva_pool_classify_bad_free(kva_pool *pool, const void *ptr, uint64_t offset) {
    uint32_t head = kva_buddy_block_of(&pool->buddy, (uint32_t)(offset >> pool->buddy.min_shift));
    if (head == KVA_NIL) return kva_fail(KVA_ERR_CORRUPT, "no block contains offset %llu", (unsigned long long)offset);
    uint64_t head_offset = (uint64_t)head << pool->buddy.min_shift;
    if (pool->buddy.pages[head].state == KVA_BLOCK_FREE)
        return kva_fail(KVA_ERR_DOUBLE_FREE, "%p (offset %llu) lies in a free block at offset %llu", ptr,
                        (unsigned long long)offset, (unsigned long long)head_offset);
    return kva_fail(KVA_ERR_BAD_POINTER, "%p (offset %llu) is inside the live block at offset %llu", ptr,
                    (unsigned long long)offset, (unsigned long long)head_offset);
}

/* Why a slab address that is no object's start cannot be freed: it lies inside a free object
 * (memory already free, as a buddy block's interior is) or inside a live one, or in the slack
 * after the last object. */
kva_status kva_pool_classify_slab_interior(kva_pool *pool, const void *ptr, uint64_t offset) {
    const kva_slabs *sl = &pool->slabs;
    unsigned c = kva_load(&sl->slabs[kva_slab_chunk(sl, offset)].cls);
    if (c < KVA_NUM_SIZE_CLASSES) {
        const kva_class_geometry *g = &sl->geom[c];
        uint64_t rel = offset & sl->chunk_mask, start = offset - rel % g->size;
        kva_object_ref ref;
        if (rel / g->size < g->nobj && kva_slab_locate(sl, start, &ref) && !kva_slab_is_live(sl, &ref))
            return kva_fail(KVA_ERR_DOUBLE_FREE, "%p lies inside slab object %p, which is free", ptr,
                            (void *)(pool->base + start));
    }
    return kva_fail(KVA_ERR_BAD_POINTER, "%p is not the start of a slab object", ptr);
}

kva_status kva_pool_refuse_inherited(void) {
    return kva_fail(KVA_ERR_BACKEND, "the pool's memory is shared with the process this one was forked from, "
                                     "whose allocator it is: a child neither allocates from it nor gives any "
                                     "of it back (kva_shared_attach maps the memory)");
}

static KVA_NOINLINE kva_status alloc_checked(kva_pool *pool, size_t size, void **out) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    uint64_t start = observe_start(pool);
    kva_status st = pool->inherited_shared ? kva_pool_refuse_inherited()
                    : pool->checked        ? kva_checked_alloc(pool, size, out, alloc_any)
                                           : alloc_any(pool, size, out);
    kva_assert(st != KVA_OK || handed_out(pool, *out, size, 1));
    return observe_end(pool, KVA_SHM_OP_ALLOC, st, st == KVA_OK ? *out : NULL, size, start);
}

/* The fast path's next step when the current word of class c is dry: the next owned word with
 * a free object, without the checked path's validation, which the fast path has done. It counts
 * as a slow call for publishing (observe_tick), so that a thread that cycles through its own
 * words still publishes. Anything more (a word from an arena) goes the checked way. */
static KVA_NOINLINE kva_status alloc_next_word(kva_pool *pool, kva_tcache *tc, unsigned c, size_t size, void **out) {
    if (kva_tc_next_word(&pool->caches, tc, c) && kva_tc_alloc_fast(tc, c, out)) {
        observe_tick(pool);
        return KVA_OK;
    }
    return alloc_checked(pool, size, out);
}

KVA_HOT_ENTRY kva_status kva_alloc(kva_pool *pool, size_t size, void **out) {
    /* Hot path: this thread's cache of the pool (never the case for a NULL pool, see
     * KVA_TC_NO_POOL), a valid small request and a current word with a free object. size - 1
     * wraps for 0, which then takes the checked path with everything else. */
    kva_tcache *tc = kva_tc_current;
    if (kva_likely(kva_load(&tc->pool) == pool && out != NULL && size - 1 < pool->fast_limit)) {
        unsigned c = kva_class_index(size);
        if (kva_likely(kva_tc_alloc_fast(tc, c, out))) {
            kva_assert_internal((uintptr_t)*out - (uintptr_t)pool->base < pool->capacity);
            return KVA_OK;
        }
        return alloc_next_word(pool, tc, c, size, out);
    }
    return alloc_checked(pool, size, out);
}

static kva_status alloc_aligned_any(kva_pool *pool, size_t size, size_t alignment, void **out) {
    if (!kva_is_pow2(alignment) || alignment > pool->max_alloc_size)
        return kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID, "alignment %zu is not a power of two up to %zu",
                                              alignment, pool->max_alloc_size));
    if (!out || size == 0 || size > pool->max_alloc_size) return alloc_any(pool, size, out);
    if (size <= KVA_SLAB_MAX_SIZE) {
        /* The smallest class at least as large whose size is a multiple of the alignment: slabs
         * start chunk-aligned, so each of its objects is aligned too. */
        for (unsigned c = kva_class_index(size); c < KVA_NUM_SIZE_CLASSES; c++)
            if (kva_class_size(c) % alignment == 0) return alloc_object(pool, c, kva_class_size(c), out);
    }
    size_t need = size > alignment ? size : alignment;
    if (need > pool->max_alloc_size)
        return kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID,
                                              "size %zu at alignment %zu exceeds the largest block "
                                              "(%zu)",
                                              size, alignment, pool->max_alloc_size));
    return alloc_block(pool, need, out);
}

kva_status kva_alloc_array(kva_pool *pool, size_t count, size_t size, void **out) {
    size_t bytes;
    if (__builtin_mul_overflow(count, size, &bytes)) {
        if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
        kva_status st = kva_pool_reject(
            pool, kva_fail(KVA_ERR_INVALID, "%zu elements of %zu bytes overflow a size", count, size));
        return observe_end(pool, KVA_SHM_OP_ALLOC, st, NULL, SIZE_MAX, UINT64_MAX);
    }
    return kva_alloc(pool, bytes, out);
}

/* A block whose start is a multiple of the red zone, so that what a checked pool hands out, a
 * red zone past it, is too: any alignment up to the red zone's then holds. */
static kva_status alloc_redzone_aligned(kva_pool *pool, size_t size, void **out) {
    return alloc_aligned_any(pool, size, KVA_REDZONE, out);
}

kva_status kva_alloc_aligned(kva_pool *pool, size_t size, size_t alignment, void **out) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    uint64_t start = observe_start(pool);
    kva_status st;
    if (pool->inherited_shared) st = kva_pool_refuse_inherited();
    else if (!pool->checked) st = alloc_aligned_any(pool, size, alignment, out);
    else if (kva_is_pow2(alignment) && alignment <= KVA_REDZONE)
        st = kva_checked_alloc(pool, size, out, alloc_redzone_aligned);
    else
        st = kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID, "a checked pool aligns to %d bytes at most, not %zu",
                                            KVA_REDZONE, alignment));
    kva_assert(st != KVA_OK || handed_out(pool, *out, size, alignment));
    return observe_end(pool, KVA_SHM_OP_ALLOC_ALIGNED, st, st == KVA_OK ? *out : NULL, size, start);
}

static kva_status alloc_exact_any(kva_pool *pool, size_t size, void **out) {
    if (!out || size == 0 || size > pool->max_alloc_size) return alloc_any(pool, size, out);
    size_t unit = (size_t)1 << pool->buddy.min_shift;
    return alloc_block_units(pool, size, (uint32_t)((size + unit - 1) / unit), out);
}

kva_status kva_alloc_exact(kva_pool *pool, size_t size, void **out) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    uint64_t start = observe_start(pool);
    kva_status st = pool->inherited_shared ? kva_pool_refuse_inherited()
                    : pool->checked        ? kva_checked_alloc(pool, size, out, alloc_exact_any)
                                           : alloc_exact_any(pool, size, out);
    kva_assert(st != KVA_OK ||
               handed_out(pool, *out, size, pool->checked ? KVA_REDZONE : (size_t)1 << pool->buddy.min_shift));
    return observe_end(pool, KVA_SHM_OP_ALLOC_EXACT, st, st == KVA_OK ? *out : NULL, size, start);
}

/* ---- free ---------------------------------------------------------------------------------- */

kva_status kva_pool_free_plain(kva_pool *pool, void *ptr) {
    if (!ptr) return kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID, "pointer is NULL"));
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
    if (offset >= pool->capacity)
        return kva_pool_reject(pool, kva_fail(KVA_ERR_BAD_POINTER, "%p is outside the pool [%p, %p)", ptr,
                                              (void *)pool->base, (void *)(pool->base + pool->capacity)));
    if (__atomic_load_n(&pool->slabs.slabs[kva_slab_chunk(&pool->slabs, offset)].cls, __ATOMIC_ACQUIRE) !=
        KVA_SLAB_NONE) {
        /* A thread's first free of the pool makes its cache only once the free is known to be
         * valid (a refused call changes nothing); with no memory for one, the object is freed
         * without a cache. */
        kva_tcache *tc = kva_tc_find(pool);
        kva_status st;
        if (tc) {
            st = kva_tc_free(&pool->caches, tc, offset);
        } else {
            kva_object_ref ref;
            if (!kva_slab_locate(&pool->slabs, offset, &ref)) st = KVA_ERR_BAD_POINTER;
            else if (!kva_slab_is_live(&pool->slabs, &ref)) st = KVA_ERR_DOUBLE_FREE;
            else if ((tc = kva_tc_get(&pool->caches))) st = kva_tc_free(&pool->caches, tc, offset);
            else st = kva_tc_free_uncached(&pool->caches, offset);
        }
        if (st == KVA_ERR_DOUBLE_FREE)
            return kva_pool_reject(pool, kva_fail(st, "slab object %p is already free", ptr));
        if (st != KVA_OK) return kva_pool_reject(pool, kva_pool_classify_slab_interior(pool, ptr, offset));
        return KVA_OK;
    }
    uint32_t index = (uint32_t)(offset >> pool->buddy.min_shift);
    int aligned = (offset & (((uint64_t)1 << pool->buddy.min_shift) - 1)) == 0;
    pthread_mutex_lock(&pool->lock);
    if (aligned && pool->buddy.pages[index].state == KVA_BLOCK_USED) {
        kva_region_decommit(&pool->region, offset,
                            (uint64_t)kva_buddy_length(&pool->buddy.pages[index]) << pool->buddy.min_shift);
        kva_buddy_free(&pool->buddy, index);
        pool->block_frees++;
        pthread_mutex_unlock(&pool->lock);
        return KVA_OK;
    }
    kva_status st = kva_pool_classify_bad_free(pool, ptr, offset);
    pthread_mutex_unlock(&pool->lock);
    return kva_pool_reject(pool, st);
}

static KVA_NOINLINE kva_status free_checked(kva_pool *pool, void *ptr) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    uint64_t start = observe_start(pool);
    kva_status st = pool->inherited_shared ? kva_pool_refuse_inherited()
                    : pool->checked        ? kva_checked_free(pool, ptr)
                                           : kva_pool_free_plain(pool, ptr);
    return observe_end(pool, KVA_SHM_OP_FREE, st, ptr, 0, start);
}

/* The free fast path's second step, out of line so that the first keeps to scratch registers:
 * a live slab object in any word this thread's cache owns. */
static KVA_NOINLINE kva_status free_owned(kva_pool *pool, kva_tcache *tc, void *ptr) {
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
    if (kva_likely(offset < pool->fast_capacity && kva_tc_free_fast(&pool->slabs, tc, (uintptr_t)pool->base, offset)))
        return KVA_OK;
    return free_checked(pool, ptr);
}

KVA_HOT_ENTRY kva_status kva_free(kva_pool *pool, void *ptr) {
    /* Hot path: a live slab object in the run of words around it that this thread's cache
     * owns and last freed into (its window), or else in any word the cache owns (free_owned).
     * Everything else, errors included, goes to free_checked, which starts over. Windows are
     * only ever opened by free_owned, so never in a pool whose fast paths are off
     * (fast_capacity 0). */
    kva_tcache *tc = kva_tc_current;
    if (kva_likely(kva_load(&tc->pool) == pool)) {
        if (kva_likely(kva_tc_free_window(tc, ptr))) return KVA_OK;
        return free_owned(pool, tc, ptr);
    }
    return free_checked(pool, ptr);
}

kva_status kva_thread_flush(kva_pool *pool) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    kva_tcache *tc = kva_tc_find(pool);
    if (tc) kva_tc_flush(&pool->caches, tc);
    return KVA_OK;
}

size_t kva_usable_size(kva_pool *pool, const void *ptr) {
    if (!pool || !ptr) return 0;
    return pool->checked ? kva_checked_usable_size(pool, ptr) : kva_pool_usable(pool, ptr);
}

size_t kva_pool_usable(kva_pool *pool, const void *ptr) {
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
    if (offset >= pool->capacity) return 0;
    const kva_slab *slab = &pool->slabs.slabs[kva_slab_chunk(&pool->slabs, offset)];
    if (__atomic_load_n(&slab->cls, __ATOMIC_ACQUIRE) != KVA_SLAB_NONE) {
        kva_object_ref ref;
        if (!kva_slab_locate(&pool->slabs, offset, &ref) || !kva_slab_is_live(&pool->slabs, &ref)) return 0;
        return pool->slabs.geom[ref.cls].size;
    }
    if (offset & (((uint64_t)1 << pool->buddy.min_shift) - 1)) return 0;
    pthread_mutex_lock(&pool->lock);
    const kva_page *page = &pool->buddy.pages[offset >> pool->buddy.min_shift];
    size_t usable = page->state == KVA_BLOCK_USED ? (size_t)page->next << pool->buddy.min_shift : 0;
    pthread_mutex_unlock(&pool->lock);
    return usable;
}

kva_status kva_trim(kva_pool *pool) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    if (pool->inherited_shared)
        return observe_end(pool, KVA_SHM_OP_TRIM, kva_pool_refuse_inherited(), NULL, 0, UINT64_MAX);
    kva_tcache *tc = kva_tc_find(pool);
    if (tc) kva_tc_flush(&pool->caches, tc);
    kva_slab_trim(&pool->slabs);
    pthread_mutex_lock(&pool->lock);
    kva_status st = kva_region_trim(&pool->region);
    kva_assert_expensive(kva_buddy_check(&pool->buddy, NULL) == KVA_OK);
    pthread_mutex_unlock(&pool->lock);
    return observe_end(pool, KVA_SHM_OP_TRIM, st, NULL, 0, UINT64_MAX);
}

kva_status kva_pool_base(kva_pool *pool, void **base) {
    if (!pool || !base) return kva_fail(KVA_ERR_INVALID, "pool or base is NULL");
    *base = pool->base;
    return KVA_OK;
}
