/*
 * publish.c — a named pool's publisher (publish.h): kva_pool_create, which gives a named pool
 * its publisher, and the copy of the pool's state into its statistics segment.
 *
 * Cost: the summary, classes, arenas and KV sections are O(orders + classes): those run from
 * slow paths at most once per publish interval. The heap map and the slab strips are
 * O(blocks in the tiling + live slabs x strip cells), a fraction of a millisecond on a large,
 * busy pool: from slow paths they are refreshed at most once a second, and every time the engine
 * asks (kva_stats_publish).
 */
#include <stdlib.h>
#include <string.h>

#include "os.h"
#include "pool.h"
#include "publish.h"

static void publish_summary(kva_pool *pool, kva_shm_summary *out) {
    kva_stats st;
    kva_get_stats(pool, &st);
    *out = (kva_shm_summary){.capacity = st.capacity,
                             .min_block = st.min_block,
                             .slab_chunk = st.slab_chunk,
                             .max_alloc_size = st.max_alloc_size,
                             .bytes_in_use = st.bytes_in_use,
                             .bytes_free = st.bytes_free,
                             .slab_bytes = st.slab_bytes,
                             .slab_free_bytes = st.slab_free_bytes,
                             .largest_free = st.largest_free,
                             .live_allocations = st.live_allocations,
                             .alloc_count = st.alloc_count,
                             .free_count = st.free_count,
                             .alloc_failures = st.alloc_failures,
                             .rejected_calls = st.rejected_calls,
                             .slab_count = st.slab_count,
                             .metadata_bytes = st.metadata_bytes,
                             .page_size = st.page_size,
                             .page_kind = (uint32_t)st.page_kind,
                             .num_orders = st.num_orders,
                             .fragmentation = st.fragmentation,
                             .publish_interval_ms = out->publish_interval_ms,
                             .backend = st.backend,
                             .numa_node = st.numa_node,
                             .flags = (st.locked ? 1u : 0u) | (st.pinned ? 2u : 0u),
                             .mapped_bytes = st.mapped_bytes,
                             .peak_block_bytes = st.peak_block_bytes,
                             .peak_bytes_in_use = st.peak_bytes_in_use};
    /* Unusable free space index (Gorman): the share of free memory in blocks smaller than 2^k. */
    uint64_t usable = 0;
    for (int k = (int)st.num_orders - 1; k >= 0; k--) {
        out->free_blocks[k] = st.free_blocks[k];
        usable += st.free_blocks[k] * (st.min_block << k);
        out->unusable_index[k] = st.bytes_free ? 1.0 - (double)usable / (double)st.bytes_free : 0.0;
    }
}

/* Each cell gets the state that covers most of it and the share of it in use. */
static void publish_heapmap(kva_pool *pool, kva_segment *seg) {
    const kva_buddy *b = &pool->buddy;
    uint32_t per = seg->heapmap->cell_blocks, cells = seg->heapmap->cells;
    seg->heapmap->cell_bytes = (uint64_t)per << b->min_shift;
    /* Per cell: blocks free, in buddy allocations, in slabs. */
    uint32_t counts[3] = {0};
    uint32_t cell = 0, in_cell = 0;
    for (uint32_t index = 0; index < b->nblocks;) {
        const kva_page *page = &b->pages[index];
        uint32_t length = kva_buddy_length(page);
        int kind = page->state == KVA_BLOCK_FREE ? 0 : page->state == KVA_BLOCK_USED ? 1 : 2;
        for (uint32_t left = length; left;) {
            uint32_t take = per - in_cell < left ? per - in_cell : left;
            counts[kind] += take;
            in_cell += take;
            left -= take;
            if (in_cell == per || index + length - left == b->nblocks) {
                uint32_t used = counts[1] + counts[2];
                uint8_t state = counts[0] == in_cell     ? KVA_SHM_CELL_FREE
                                : counts[0] > 0          ? KVA_SHM_CELL_MIXED
                                : counts[1] >= counts[2] ? KVA_SHM_CELL_BLOCK
                                                         : KVA_SHM_CELL_SLAB;
                if (cell < cells) {
                    seg->cell_state[cell] = state;
                    seg->cell_fill[cell] = (uint8_t)(255u * used / in_cell);
                }
                cell++;
                in_cell = 0;
                memset(counts, 0, sizeof counts);
            }
        }
        index += length;
    }
}

static void publish_classes(kva_pool *pool, kva_segment *seg) {
    kva_shm_class *out = (kva_shm_class *)(seg->classes + 1);
    const kva_slabs *sl = &pool->slabs;
    kva_tc_totals totals;
    kva_tc_totals_locked(&pool->caches, &totals);
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        uint64_t slabs = 0;
        for (unsigned a = 0; a < sl->narenas; a++) slabs += sl->arenas[a].classes[c].slabs;
        out[c] = (kva_shm_class){.object_size = sl->geom[c].size,
                                 .objects_per_slab = sl->geom[c].nobj,
                                 .live_objects = kva_tc_live(&totals, c),
                                 .slabs = slabs,
                                 .allocs = totals.allocs[c],
                                 .frees = kva_tc_frees_made(&totals, c)};
    }
}

static void publish_arenas(kva_pool *pool, kva_segment *seg) {
    kva_shm_arena *out = (kva_shm_arena *)(seg->arenas + 1);
    const kva_slabs *sl = &pool->slabs;
    for (unsigned a = 0; a < sl->narenas && a < seg->arenas->count; a++) {
        const kva_arena *arena = &sl->arenas[a];
        kva_shm_arena entry = {.word_claims = arena->claims, .numa_node = arena->node};
        for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
            entry.slabs += arena->classes[c].slabs;
            entry.spare_slabs += arena->classes[c].empty_slab != KVA_NIL;
        }
        entry.slab_bytes = entry.slabs << sl->chunk_shift;
        out[a] = entry;
    }
}

/* Free objects among [first, last) of a slab (free in l0, or passed to the word's owner and not
 * merged yet), a word at a time. Objects in threads' caches are free ones. */
static uint64_t count_free(const uint64_t *l0, const uint64_t *remote, uint64_t first, uint64_t last) {
    uint64_t count = 0;
    while (first < last) {
        uint64_t word = first >> 6, lo = first & 63, hi = last - (word << 6) < 64 ? last - (word << 6) : 64;
        uint64_t mask = (hi == 64 ? ~(uint64_t)0 : (((uint64_t)1 << hi) - 1)) & (~(uint64_t)0 << lo);
        count += (uint64_t)__builtin_popcountll((kva_load(&l0[word]) | kva_load(&remote[word])) & mask);
        first = (word << 6) + hi;
    }
    return count;
}

/* Each slab's occupancy as KVA_SHM_STRIP_CELLS cells: the in-use share of each cell's objects. */
static void publish_slabs(kva_pool *pool, kva_segment *seg) {
    const kva_slabs *sl = &pool->slabs;
    kva_shm_slab *out = (kva_shm_slab *)(seg->slabs + 1);
    uint32_t n = 0;
    for (uint32_t s = 0; s < sl->nchunks && n < seg->slabs->capacity; s++) {
        const kva_slab *slab = &sl->slabs[s];
        if (slab->cls == KVA_SLAB_NONE) continue;
        const kva_class_geometry *cls = &sl->geom[slab->cls];
        kva_shm_slab *o = &out[n++];
        uint64_t free_objects = count_free(slab->l0, kva_slab_remote(slab, cls), 0, cls->nobj);
        *o = (kva_shm_slab){.chunk = s,
                            .size_class = slab->cls,
                            .inuse = (uint32_t)(cls->nobj - free_objects),
                            .objects = cls->nobj};
        for (uint32_t cell = 0; cell < KVA_SHM_STRIP_CELLS; cell++) {
            uint64_t first = (uint64_t)cls->nobj * cell / KVA_SHM_STRIP_CELLS;
            uint64_t last = (uint64_t)cls->nobj * (cell + 1) / KVA_SHM_STRIP_CELLS;
            uint64_t live = (last - first) - count_free(slab->l0, kva_slab_remote(slab, cls), first, last);
            o->strip[cell] = (uint8_t)(last > first ? 255u * live / (last - first) : 0);
        }
    }
    seg->slabs->count = n;
}

/* Writes the pool's segment under the sequence lock (the publisher's lock held): the cheap
 * sections always, the heap map and slab strips too when full is set. */
static void publish(kva_publisher *pub, int full) {
    kva_pool *pool = pub->pool;
    kva_segment *seg = pub->segment;
    if (seg->inherited) return;
    kva_segment_begin(seg);
    publish_summary(pool, seg->summary);
    kva_pool_lock_all(pool);
    publish_classes(pool, seg);
    publish_arenas(pool, seg);
    if (full) {
        publish_heapmap(pool, seg);
        publish_slabs(pool, seg);
    }
    kva_pool_unlock_all(pool);
    if (pub->kv.publish) {
        kva_kv_publish_to to = {.kv = seg->kv,
                                .namespaces = seg->kv_namespaces,
                                .sequences = full ? seg->kv_sequences : NULL,
                                .map = full ? seg->heapmap : NULL,
                                .state = seg->cell_state,
                                .fill = seg->cell_fill};
        pub->kv.publish(pub->kv.ctx, &to);
    } else {
        /* No cache: the KV sections say so (their layout fields, set at creation, stay). */
        memset(seg->kv, 0, sizeof *seg->kv);
        seg->kv_namespaces->count = 0;
        kva_shm_kv_sequences *sq = seg->kv_sequences;
        sq->count = 0;
        sq->live_sequences = sq->live_pins = sq->longest_tokens = sq->longest_handle = 0;
    }
    seg->header->heartbeat_ns = kva_os_realtime_ns();
    seg->header->publish_count++;
    kva_segment_end(seg);
}

/* Reads the clock under the publisher's lock and publishes what the interval says is due. */
static void publish_due(kva_publisher *pub) {
    pthread_mutex_lock(&pub->lock);
    int due = kva_segment_clock_due(pub->segment);
    if (due) publish(pub, due == 2);
    pthread_mutex_unlock(&pub->lock);
}

kva_publisher *kva_publisher_of(const kva_pool *pool) { return pool->observer.ctx; }

void kva_publish_tick(kva_pool *pool) {
    kva_publisher *pub = kva_publisher_of(pool);
    if (pub && kva_pool_tick(pool)) publish_due(pub);
}

/* Under the publisher's lock: a publish on another thread must see the whole hook or none, and
 * must not call a detached one (its KV cache may be gone). */
int kva_pool_attach_kv(kva_pool *pool, const kva_kv_publisher *publisher) {
    kva_publisher *pub = kva_publisher_of(pool);
    if (!pub) return 0;
    pthread_mutex_lock(&pub->lock);
    int free_section = pub->kv.publish == NULL;
    if (free_section) pub->kv = *publisher;
    pthread_mutex_unlock(&pub->lock);
    return free_section;
}

void kva_pool_detach_kv(kva_pool *pool, const void *ctx) {
    kva_publisher *pub = kva_publisher_of(pool);
    if (!pub) return;
    pthread_mutex_lock(&pub->lock);
    if (pub->kv.ctx == ctx) memset(&pub->kv, 0, sizeof pub->kv);
    pthread_mutex_unlock(&pub->lock);
}

kva_status kva_stats_publish(kva_pool *pool) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    kva_publisher *pub = kva_publisher_of(pool);
    if (!pub) return KVA_OK;
    pthread_mutex_lock(&pub->lock);
    publish(pub, 1);
    pthread_mutex_unlock(&pub->lock);
    return KVA_OK;
}

const char *kva_stats_segment_name(kva_pool *pool) {
    kva_publisher *pub = pool ? kva_publisher_of(pool) : NULL;
    return pub ? pub->segment->name : NULL;
}

/* ---- the publisher as the pool's observer ------------------------------------------------- */

static void observe_record(void *ctx, uint8_t op, kva_status status, uint64_t offset, uint64_t size,
                           uint64_t latency_ns) {
    kva_publisher *pub = ctx;
    if (pub->segment->inherited) return;
    pthread_mutex_lock(&pub->lock);
    kva_segment_record(pub->segment, op, status, offset, size, latency_ns);
    pthread_mutex_unlock(&pub->lock);
}

static void observe_due(void *ctx) {
    kva_publisher *pub = ctx;
    if (!pub->segment->inherited) publish_due(pub);
}

static void observe_close(void *ctx) {
    kva_publisher *pub = ctx;
    kva_segment_close(pub->segment);
    pthread_mutex_destroy(&pub->lock);
    free(pub);
}

/* A named pool's publisher: its segment opened, installed as the pool's observer, and the first
 * publish made, so that an inspector finds the pool as soon as it exists. */
static kva_status open_publisher(kva_pool *pool, const kva_config *cfg) {
    kva_publisher *pub = calloc(1, sizeof *pub);
    if (!pub) return kva_fail(KVA_ERR_NOMEM, "no host memory for the pool's publisher");
    kva_segment_geometry sg = {.nblocks = pool->buddy.nblocks,
                               .nchunks = pool->slabs.nchunks,
                               .narenas = pool->slabs.narenas};
    kva_status st = kva_segment_open(cfg->name, &sg, cfg->trace, cfg->publish_interval_ms, &pub->segment);
    if (st != KVA_OK) {
        free(pub);
        return st;
    }
    pub->pool = pool;
    pthread_mutex_init(&pub->lock, NULL);
    kva_pool_observe(
        pool, &(kva_pool_observer){.record = observe_record, .due = observe_due, .close = observe_close, .ctx = pub});
    publish(pub, 1);
    return KVA_OK;
}

kva_status kva_pool_create(const kva_config *cfg, kva_pool **out) {
    kva_pool *pool;
    kva_status st = kva_pool_make(cfg, out ? &pool : NULL);
    if (st != KVA_OK) return st;
    if (cfg->name && (st = open_publisher(pool, cfg)) != KVA_OK) {
        kva_pool_destroy(pool);
        return st;
    }
    *out = pool;
    return KVA_OK;
}
