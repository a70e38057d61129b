/*
 * pool.c — the front door: create and destroy, kva_alloc routes by size, kva_free finds the
 * owner of an address.
 *
 * Routing: sizes 1 .. KVA_SLAB_MAX_SIZE go to their slab class; larger ones to a buddy block.
 * To free, the address's chunk descriptor says whether it is a slab (one shift and one load);
 * otherwise the minimum block's record must be the head of a live buddy block.
 */
#include <stdlib.h>
#include <string.h>

#include "checked.h"
#include "config.h"
#include "fork.h"
#include "numa.h"
#include "os.h"
#include "pool.h"
#include "pool_range.h"
#include "tcache.h"

void kva_pool_destroy(kva_pool *pool) {
    if (!pool) return;
    kva_fork_untrack(pool);
    kva_tc_registry_fini(&pool->caches);
    free(pool->quarantine);
    kva_segment_close(pool->segment);
    kva_slabs_fini(&pool->slabs);
    kva_buddy_fini(&pool->buddy);
    kva_region_destroy(&pool->region);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->publish_lock);
    free(pool);
}

/* Per-arena NUMA placement (arena.h): for a host pool that chose no node itself, on a machine
 * with several nodes, unless everything was touched at creation (prefault) or the chunks are
 * smaller than the hugetlb pages mbind would have to split. A thread on CPU c uses arena
 * c % narenas: each arena takes the node of the first CPU this process may run on that maps to
 * it (so that under taskset or numactl the arenas follow the CPUs actually used). */
static void place_arenas(kva_pool *pool, const kva_config *cfg) {
    if (cfg->backend != KVA_BACKEND_HOST || cfg->numa_node >= 0 || cfg->prefault) return;
    if (pool->region.page_kind == KVA_PAGE_KIND_HUGETLB && (pool->slabs.chunk_mask + 1) % KVA_HUGE_PAGE_SIZE) return;
    if (!kva_numa_arenas_wanted()) return;
    unsigned cpus[1024], count = kva_arena_allowed_cpus(cpus, 1024), n = pool->slabs.narenas;
    for (unsigned i = 0; i < count; i++) {
        kva_arena *arena = &pool->slabs.arenas[cpus[i] % n];
        if (arena->node < 0) arena->node = kva_numa_node_of_cpu(cpus[i]);
    }
}

/* A pool's metadata may fault in at creation up to this share of the machine's memory. */
#define METADATA_POPULATE_SHARE 16

/* The kernel commits the metadata mappings as they are first touched, and a first touch on an
 * allocation or free path is a page fault there (a microsecond or more; several in a virtual
 * machine): a fresh pool's block records and bitmaps would take one in every few dozen of its
 * first tens of thousands of calls. So they are faulted in here, whatever the config says of
 * the managed memory, and no call on the pool takes a fault in them. Up to a share of physical
 * memory, so that a pool whose metadata is of the order of memory (lazy commitment is what lets
 * one be made at all) does not meet the OOM killer here: first the records every block
 * allocation reaches (12 bytes per minimum block: 0.3% of the capacity at 4 KiB blocks), then
 * the slab bitmaps (2% at 2 MiB chunks), each only if it fits; beyond that they stay lazy. With
 * prefault, which promises no faults at all, all of it whatever its size. The slab descriptors
 * need nothing: kva_slabs_init has written every one. After the region, whose refusal when it
 * is more than memory can back comes before any of this is touched. */
static kva_status populate_metadata(kva_pool *pool, int prefault) {
    size_t budget = prefault ? SIZE_MAX : kva_os_physical_memory() / METADATA_POPULATE_SHARE;
    size_t records = pool->buddy.pages_bytes + pool->slabs.slabs_bytes;
    if (records > budget) return KVA_OK;
    kva_status st = kva_os_populate(pool->buddy.pages, pool->buddy.pages_bytes);
    if (st == KVA_OK && pool->slabs.bitmaps_bytes <= budget - records) {
        st = kva_os_populate(pool->slabs.bitmaps, pool->slabs.bitmaps_bytes);
        pool->slabs.bitmaps_resident = st == KVA_OK;
    }
    /* Without prefault, populating is an optimisation: where the kernel (or a memory cgroup
     * below the machine's memory) will not commit the metadata now, the pages the populate
     * did not reach stay lazy, as they would be beyond the share, and the pool is made. */
    return prefault ? st : KVA_OK;
}

kva_status kva_pool_create(const kva_config *cfg, kva_pool **out) {
    kva_geometry geo;
    kva_status st = kva_config_validate(cfg, &geo);
    if (st != KVA_OK) return st;
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");

    kva_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return kva_fail(KVA_ERR_NOMEM, "no host memory for the pool descriptor");
    pool->capacity = geo.capacity;
    pool->config = *cfg;
    pool->config.name = NULL;
    if (cfg->name) {
        memcpy(pool->name, cfg->name, strlen(cfg->name) + 1);
        pool->config.name = pool->name;
    }

    pthread_mutex_init(&pool->lock, NULL);
    pthread_mutex_init(&pool->publish_lock, NULL);
    st = kva_buddy_init(&pool->buddy, geo.nblocks, geo.min_shift);
    if (st != KVA_OK) goto fail_pool;
    pool->max_alloc_size = (size_t)1 << (geo.min_shift + pool->buddy.num_orders - 1);
    size_t chunk = (size_t)1 << geo.chunk_shift;
    size_t alignment = pool->max_alloc_size > chunk ? pool->max_alloc_size : chunk;
    /* The region before the slab descriptors: kva_slabs_init writes every one of them (64 bytes
     * per chunk, a gigabyte for a 1 TiB pool of 64 KiB chunks), so a region the kernel will
     * not reserve is refused before any of that is written. */
    st = kva_region_create(cfg, geo.capacity, alignment, &pool->region);
    if (st != KVA_OK) goto fail_buddy;
    unsigned arenas = cfg->arenas ? cfg->arenas : kva_arena_default_count();
    st = kva_slabs_init(&pool->slabs, &pool->buddy, geo.capacity, geo.chunk_shift, arenas);
    if (st != KVA_OK) goto fail_region;
    pool->slabs.region = &pool->region;
    pool->slabs.pool_lock = &pool->lock;
    st = populate_metadata(pool, cfg->prefault);
    if (st != KVA_OK) goto fail_slabs;
    pool->base = pool->region.base;
    place_arenas(pool, cfg);
    pool->fast_limit = KVA_SLAB_MAX_SIZE;
    pool->fast_capacity = pool->capacity;
    if (cfg->checked) {
        /* Every free byte holds the poison from the start (invariant C1). */
        kva_poison(pool->base, pool->capacity);
        pool->checked = 1;
        pool->fast_limit = pool->fast_capacity = 0;
    }
    if (cfg->name) {
        kva_segment_geometry sg = {.nblocks = geo.nblocks, .nchunks = pool->slabs.nchunks, .narenas = arenas};
        st = kva_segment_open(cfg->name, &sg, cfg->trace, cfg->publish_interval_ms, &pool->segment);
        if (st != KVA_OK) goto fail_slabs;
        if (cfg->trace) pool->fast_limit = pool->fast_capacity = 0;
        kva_publish(pool, 1);
    }
    kva_tc_registry_init(&pool->caches, pool, &pool->slabs, pool->base);
    kva_fork_track(pool);
    *out = pool;
    return KVA_OK;

fail_slabs:
    kva_slabs_fini(&pool->slabs);
fail_region:
    kva_region_destroy(&pool->region);
fail_buddy:
    kva_buddy_fini(&pool->buddy);
fail_pool:
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->publish_lock);
    free(pool);
    return st;
}

void kva_pool_lock_all(kva_pool *pool) {
    kva_tc_registry_lock();
    for (unsigned a = 0; a < pool->slabs.narenas; a++) pthread_mutex_lock(&pool->slabs.arenas[a].lock);
    pthread_mutex_lock(&pool->lock);
}

void kva_pool_unlock_all(kva_pool *pool) {
    pthread_mutex_unlock(&pool->lock);
    for (unsigned a = pool->slabs.narenas; a-- > 0;) pthread_mutex_unlock(&pool->slabs.arenas[a].lock);
    kva_tc_registry_unlock();
}

/* ---- observation: the trace ring, latency histograms and periodic publishing --------------- */

/* A start time when this call is to be timed, UINT64_MAX otherwise. */
static uint64_t observe_start(const kva_pool *pool) {
    return pool->segment && pool->segment->trace_all ? kva_os_monotonic_ns() : UINT64_MAX;
}

/* Records a checked call (every call when tracing; failed and rejected ones always) and
 * publishes when the interval has passed. Returns st. */
static kva_status observe_end(kva_pool *pool, uint8_t op, kva_status st, const void *addr, uint64_t size,
                              uint64_t start) {
    kva_segment *seg = pool->segment;
    if (kva_likely(!seg) || seg->inherited) return st;
    if (kva_unlikely(seg->trace_all || st != KVA_OK)) {
        uint64_t latency = start == UINT64_MAX ? UINT64_MAX : kva_os_monotonic_ns() - start;
        uint64_t offset = addr ? (uint64_t)((uintptr_t)addr - (uintptr_t)pool->base) : UINT64_MAX;
        pthread_mutex_lock(&pool->publish_lock);
        kva_segment_record(seg, op, st, offset, size, latency);
        pthread_mutex_unlock(&pool->publish_lock);
    }
    /* In line, a countdown of the thread's own: a named pool's slow calls pay a decrement, and
     * take the publish lock only to read the clock every KVA_SEGMENT_CHECK_EVERY of them. */
    if (kva_unlikely(kva_segment_tick(seg))) kva_publish_due(pool);
    return st;
}

/* What observe_end does for a successful untraced call: the publish countdown. */
static void observe_tick(kva_pool *pool) {
    kva_segment *seg = pool->segment;
    if (seg && !seg->inherited && kva_unlikely(kva_segment_tick(seg))) kva_publish_due(pool);
}

/* ---- allocation ---------------------------------------------------------------------------- */

static kva_status reject(kva_pool *pool, kva_status status) {
    __atomic_fetch_add(&pool->rejected_calls, 1, __ATOMIC_RELAXED);
    return status;
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
    *head = units ? kva_buddy_alloc_exact(&pool->buddy, order, units) : kva_buddy_alloc(&pool->buddy, order, KVA_BLOCK_USED);
    kva_status st = KVA_OK;
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
    if (!out) return reject(pool, kva_fail(KVA_ERR_INVALID, "out is NULL"));
    if (size == 0) return reject(pool, kva_fail(KVA_ERR_INVALID, "size 0"));
    if (size > pool->max_alloc_size)
        return reject(pool, kva_fail(KVA_ERR_INVALID, "size %zu exceeds the largest block this pool can hold (%zu)",
                                     size, pool->max_alloc_size));
    if (size <= KVA_SLAB_MAX_SIZE) return alloc_object(pool, kva_class_index(size), size, out);
    return alloc_block(pool, size, out);
}

/* ---- why a free is refused ---------------------------------------------------------------- */

/* Why a non-slab address cannot be freed: it lies in free memory or inside a live block. Pool
 * lock held. */
static kva_status classify_bad_free(kva_pool *pool, const void *ptr, uint64_t offset) {
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
static kva_status classify_slab_interior(kva_pool *pool, const void *ptr, uint64_t offset) {
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

/* ---- checked mode (checked.h): red zones, poison verified on the way out and in ------------ */

static kva_status free_any(kva_pool *pool, void *ptr);
static size_t usable_size(kva_pool *pool, const void *ptr);

/* The allocation behind a checked pool's pointer starts a red zone earlier. */
static unsigned char *guarded_start(const void *ptr) { return (unsigned char *)ptr - KVA_REDZONE; }

/* The size asked for, which the front red zone keeps inverted (checked_alloc). */
static uint64_t stored_size(const unsigned char *start) {
    uint64_t stored;
    memcpy(&stored, start, sizeof stored);
    return ~stored;
}

/* Lists the block at start in the quarantine: 0 when there is no host memory for the entry. */
static int quarantine_add(kva_pool *pool, const unsigned char *start) {
    pthread_mutex_lock(&pool->lock);
    int listed = 1;
    if (pool->quarantined == pool->quarantine_room) {
        uint32_t room = pool->quarantine_room ? 2 * pool->quarantine_room : 8;
        uint64_t *grown = room > pool->quarantine_room ? realloc(pool->quarantine, room * sizeof *grown) : NULL;
        if (grown) {
            pool->quarantine = grown;
            pool->quarantine_room = room;
        } else {
            listed = 0;
        }
    }
    if (listed) pool->quarantine[pool->quarantined++] = (uint64_t)(start - pool->base);
    pthread_mutex_unlock(&pool->lock);
    return listed;
}

/* Whether the block at start is withheld. A scan: the quarantine holds one entry per write
 * after free found, a bug each, not a number that grows with the pool's use. */
static int quarantined(kva_pool *pool, const unsigned char *start) {
    uint64_t offset = (uint64_t)(start - pool->base);
    pthread_mutex_lock(&pool->lock);
    int found = 0;
    for (uint32_t i = 0; i < pool->quarantined && !found; i++) found = pool->quarantine[i] == offset;
    pthread_mutex_unlock(&pool->lock);
    return found;
}

static kva_status checked_alloc(kva_pool *pool, size_t size, void **out,
                                kva_status (*alloc)(kva_pool *, size_t, void **)) {
    if (!out || size == 0) return alloc(pool, size, out);
    if (size > pool->max_alloc_size - 2 * KVA_REDZONE)
        return reject(pool, kva_fail(KVA_ERR_INVALID, "size %zu and its two red zones exceed the largest block (%zu)",
                                     size, pool->max_alloc_size));
    void *got;
    kva_status st = alloc(pool, size + 2 * KVA_REDZONE, &got);
    if (st != KVA_OK) return st;
    unsigned char *start = got;
    size_t usable = usable_size(pool, start), bad;
    if (!kva_holds(start, usable, KVA_POISON_FREE, &bad)) {
        /* Nothing is handed out. The block is withheld as it is, so that what was written
         * stays for a debugger, kva_check keeps reporting it, and the stale pointer that
         * wrote it can never reach a live object; with no memory to list it, it is cleaned
         * and freed instead. */
        uint64_t at = (uint64_t)(start + bad - pool->base);
        if (!quarantine_add(pool, start)) {
            kva_poison(start, usable);
            free_any(pool, start);
            __atomic_fetch_add(&pool->retracted_allocs, 1, __ATOMIC_RELAXED);
        }
        return kva_fail(KVA_ERR_CORRUPT,
                        "write after free: byte %llu of the pool, in freed memory, was changed (the block at %llu is "
                        "withheld)", (unsigned long long)at, (unsigned long long)(start - pool->base));
    }
    /* The front red zone keeps the requested size (inverted, so an overwrite shows), which puts
     * the back red zone right after the last requested byte: the block's slack is red zone too. */
    uint64_t stored = ~(uint64_t)size;
    memcpy(start, &stored, sizeof stored);
    memset(start + sizeof stored, KVA_POISON_REDZONE, KVA_REDZONE - sizeof stored);
    memset(start + KVA_REDZONE + size, KVA_POISON_REDZONE, usable - KVA_REDZONE - size);
    *out = start + KVA_REDZONE;
    return KVA_OK;
}

/* Why ptr, inside the pool but no checked allocation's start, cannot be freed, judged by ptr
 * itself: the address a red zone before it belongs to something else (the end of a freed
 * block before a live one, the red zone of a live object after a free one). Changes nothing. */
static kva_status classify_not_an_allocation(kva_pool *pool, const void *ptr, uint64_t offset) {
    if (__atomic_load_n(&pool->slabs.slabs[kva_slab_chunk(&pool->slabs, offset)].cls, __ATOMIC_ACQUIRE) !=
        KVA_SLAB_NONE)
        return classify_slab_interior(pool, ptr, offset);
    pthread_mutex_lock(&pool->lock);
    kva_status st = classify_bad_free(pool, ptr, offset);
    pthread_mutex_unlock(&pool->lock);
    return st;
}

static kva_status checked_free(kva_pool *pool, void *ptr) {
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
    if (!ptr || offset >= pool->capacity) return free_any(pool, ptr);
    if (offset < KVA_REDZONE) /* every allocation of a checked pool starts past a red zone */
        return reject(pool, kva_fail(KVA_ERR_BAD_POINTER, "%p is not an allocation: in a checked pool they start %d "
                                                          "bytes into their block", ptr, KVA_REDZONE));
    unsigned char *start = guarded_start(ptr);
    if (quarantined(pool, start))
        return reject(pool, kva_fail(KVA_ERR_DOUBLE_FREE, "%p was freed already, then written after that free (the "
                                                          "block is withheld)", ptr));
    size_t usable = usable_size(pool, start), bad;
    if (usable == 0) return reject(pool, classify_not_an_allocation(pool, ptr, offset));
    const char *overrun = NULL;
    uint64_t size = stored_size(start);
    if (size > usable - 2 * KVA_REDZONE ||
        !kva_holds(start + sizeof size, KVA_REDZONE - sizeof size, KVA_POISON_REDZONE, &bad))
        overrun = "before its start";
    else if (!kva_holds(start + KVA_REDZONE + size, usable - KVA_REDZONE - size, KVA_POISON_REDZONE, &bad))
        overrun = "past its end";
    kva_poison(start, usable);
    kva_status st = free_any(pool, start);
    if (st == KVA_OK && overrun)
        return kva_fail(KVA_ERR_CORRUPT, "%p: a write %s ran into the red zone (the memory is freed)", ptr, overrun);
    return st;
}

static KVA_NOINLINE kva_status alloc_checked(kva_pool *pool, size_t size, void **out) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    uint64_t start = observe_start(pool);
    kva_status st = pool->checked ? checked_alloc(pool, size, out, alloc_any) : alloc_any(pool, size, out);
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
        if (kva_likely(kva_tc_alloc_fast(tc, c, out))) return KVA_OK;
        return alloc_next_word(pool, tc, c, size, out);
    }
    return alloc_checked(pool, size, out);
}

static kva_status alloc_aligned_any(kva_pool *pool, size_t size, size_t alignment, void **out) {
    if (!kva_is_pow2(alignment) || alignment > pool->max_alloc_size)
        return reject(pool, kva_fail(KVA_ERR_INVALID, "alignment %zu is not a power of two up to %zu",
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
        return reject(pool, kva_fail(KVA_ERR_INVALID, "size %zu at alignment %zu exceeds the largest block (%zu)",
                                     size, alignment, pool->max_alloc_size));
    return alloc_block(pool, need, out);
}

kva_status kva_alloc_array(kva_pool *pool, size_t count, size_t size, void **out) {
    size_t bytes;
    if (__builtin_mul_overflow(count, size, &bytes)) {
        if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
        kva_status st = reject(pool, kva_fail(KVA_ERR_INVALID, "%zu elements of %zu bytes overflow a size", count, size));
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
    if (!pool->checked) st = alloc_aligned_any(pool, size, alignment, out);
    else if (kva_is_pow2(alignment) && alignment <= KVA_REDZONE) st = checked_alloc(pool, size, out, alloc_redzone_aligned);
    else st = reject(pool, kva_fail(KVA_ERR_INVALID, "a checked pool aligns to %d bytes at most, not %zu", KVA_REDZONE, alignment));
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
    kva_status st = pool->checked ? checked_alloc(pool, size, out, alloc_exact_any) : alloc_exact_any(pool, size, out);
    return observe_end(pool, KVA_SHM_OP_ALLOC_EXACT, st, st == KVA_OK ? *out : NULL, size, start);
}

/* ---- free ---------------------------------------------------------------------------------- */

static kva_status free_any(kva_pool *pool, void *ptr) {
    if (!ptr) return reject(pool, kva_fail(KVA_ERR_INVALID, "pointer is NULL"));
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
    if (offset >= pool->capacity)
        return reject(pool, kva_fail(KVA_ERR_BAD_POINTER, "%p is outside the pool [%p, %p)", ptr,
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
        if (st == KVA_ERR_DOUBLE_FREE) return reject(pool, kva_fail(st, "slab object %p is already free", ptr));
        if (st != KVA_OK) return reject(pool, classify_slab_interior(pool, ptr, offset));
        return KVA_OK;
    }
    uint32_t index = (uint32_t)(offset >> pool->buddy.min_shift);
    int aligned = (offset & (((uint64_t)1 << pool->buddy.min_shift) - 1)) == 0;
    pthread_mutex_lock(&pool->lock);
    if (aligned && pool->buddy.pages[index].state == KVA_BLOCK_USED) {
        kva_region_decommit(&pool->region, offset, (uint64_t)kva_buddy_length(&pool->buddy.pages[index])
                                                       << pool->buddy.min_shift);
        kva_buddy_free(&pool->buddy, index);
        pool->block_frees++;
        pthread_mutex_unlock(&pool->lock);
        return KVA_OK;
    }
    kva_status st = classify_bad_free(pool, ptr, offset);
    pthread_mutex_unlock(&pool->lock);
    return reject(pool, st);
}

static KVA_NOINLINE kva_status free_checked(kva_pool *pool, void *ptr) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    uint64_t start = observe_start(pool);
    kva_status st = pool->checked ? checked_free(pool, ptr) : free_any(pool, ptr);
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
    if (pool->checked) {
        /* In integers first: a foreign pointer's arithmetic could overflow. */
        uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
        if (offset < KVA_REDZONE || offset >= pool->capacity) return 0;
        const unsigned char *start = pool->base + (offset - KVA_REDZONE);
        size_t usable = usable_size(pool, start);
        if (!usable || quarantined(pool, start)) return 0;
        /* What may be written: the requested size, kept in the front red zone; past it begins
         * the back red zone (a corrupted front one cannot say more than the block holds). */
        uint64_t size = stored_size(start);
        return size < usable - 2 * KVA_REDZONE ? (size_t)size : usable - 2 * KVA_REDZONE;
    }
    return usable_size(pool, ptr);
}

/* The usable size of the allocation that starts at ptr, red zones included in a checked pool. */
static size_t usable_size(kva_pool *pool, const void *ptr) {
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
    kva_tcache *tc = kva_tc_find(pool);
    if (tc) kva_tc_flush(&pool->caches, tc);
    kva_slab_trim(&pool->slabs);
    pthread_mutex_lock(&pool->lock);
    kva_status st = kva_region_trim(&pool->region);
    pthread_mutex_unlock(&pool->lock);
    return observe_end(pool, KVA_SHM_OP_TRIM, st, NULL, 0, UINT64_MAX);
}

kva_status kva_pool_base(kva_pool *pool, void **base) {
    if (!pool || !base) return kva_fail(KVA_ERR_INVALID, "pool or base is NULL");
    *base = pool->base;
    return KVA_OK;
}

/* ---- ranges of a live allocation (pool_range.h) ------------------------------------------- */

size_t kva_pool_range_unit(kva_pool *pool) {
    /* Prefaulted memory was promised to stay; locked or pinned host memory cannot be discarded;
     * a checked pool's free bytes must keep their poison; hugetlb pages were reserved up front
     * on purpose, and a discarded one may not come back (the reservation is not restored on
     * every kernel: a later touch would be a SIGBUS, not an error). */
    if (pool->config.prefault || pool->region.locked || pool->region.pinned || pool->checked ||
        pool->region.page_kind == KVA_PAGE_KIND_HUGETLB)
        return 0;
    return pool->region.page_size;
}

kva_status kva_pool_range_release(kva_pool *pool, void *start, size_t length) {
    if (length == 0) return KVA_OK;
    uint64_t offset = (uint64_t)((unsigned char *)start - pool->base);
    pthread_mutex_lock(&pool->lock);
    kva_status st = KVA_OK;
    if (pool->region.device) {
        /* Its granules' references drop to 0 and they are unmapped and released now. */
        st = kva_cuda_region_release(pool->region.device, offset, length);
    } else {
        st = kva_os_discard(start, length);
    }
    pthread_mutex_unlock(&pool->lock);
    return st;
}

kva_status kva_pool_range_take(kva_pool *pool, void *start, size_t length) {
    if (length == 0) return KVA_OK;
    /* Host pages are faulted in now, so that a shortage is this call's error rather than a
     * later page fault's. */
    if (!pool->region.device) return kva_os_populate(start, length);
    pthread_mutex_lock(&pool->lock);
    kva_status st = kva_cuda_region_take(pool->region.device, (uint64_t)((unsigned char *)start - pool->base), length);
    pthread_mutex_unlock(&pool->lock);
    return st;
}
