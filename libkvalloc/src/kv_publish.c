/*
 * kv_publish.c — a KV cache in its pool's statistics segment: its counters in the KV section and
 * its blocks' states (pinned, referenced, kept only by the prefix cache, free) painted into the
 * heap map,
 * so that kvalloc top shows the KV cache, not just one large allocation.
 *
 * Threads. The pool calls the hook (publish_cb) from kva_publish, on whatever thread publishes:
 *  - the cache's own call, at its end (kv_publish_due, the cache's lock held by this thread and
 *    its state consistent): kv_self_publishing names the cache, and the hook reads it as is;
 *  - a pool call made in the middle of a cache call (contiguous mode: kva_alloc_exact under the
 *    cache's lock, whose slow path publishes): the lock is held by this very thread, in the
 *    middle of a change; trylock fails and the hook leaves the section as it was;
 *  - any other thread (kva_stats_publish, another user's slow path on a shared pool): trylock;
 *    when the lock is busy the section keeps its last contents and is published again next time.
 * The hook never blocks on the cache's lock, so a thread holding pool locks in kva_publish and a
 * thread holding the cache's lock and waiting for pool locks cannot deadlock. It makes no pool
 * call either (the pool's base was read at attach).
 */
#include <stdlib.h>
#include <string.h>

#include "kv_cache.h"
#include "publish.h"

/* The cache whose kv_publish_due this thread is running, or NULL. Per thread: it says "this
 * thread holds that cache's lock, at the end of a call", which no other thread may assume. */
static _Thread_local const kva_kv *kv_self_publishing;

/* The states of blocks first..last, as one heap-map cell: the in-use kind most of the sampled
 * blocks are (pinned, used and not pinned, cached; a tie goes to the first of these, the order
 * the KV bar draws them), free only when none of them is in use, and the share not free
 * (kvalloc_stats.h, KVA_SHM_CELL_*). Pin counts are read only while some block is pinned. */
static void paint_cell(const kva_kv *kv, uint32_t first, uint32_t last, uint8_t *state, uint8_t *fill) {
    uint32_t used = 0, cached = 0, pinned = 0, n = last - first + 1;
    /* A cell may cover many small blocks: look at 64 of them at most, evenly spread. */
    uint32_t step = n > 64 ? n / 64 : 1, seen = 0;
    if (!kv->pinned_count) {
        for (uint32_t b = first; b <= last; b += step, seen++) {
            used += kv->blocks[b].state == KV_USED;
            cached += kv->blocks[b].state == KV_CACHED;
        }
    } else {
        for (uint32_t b = first; b <= last; b += step, seen++) {
            uint8_t st = kv->blocks[b].state;
            cached += st == KV_CACHED;
            if (st == KV_USED) /* only a used block can be pinned (K11) */
                used++, pinned += kv->pin_refs[b] != 0;
        }
    }
    uint32_t unpinned = used - pinned;
    *state = pinned && pinned >= unpinned && pinned >= cached ? KVA_SHM_CELL_KV_PINNED
             : unpinned && unpinned >= cached                 ? KVA_SHM_CELL_KV_USED
             : cached                                         ? KVA_SHM_CELL_KV_CACHED
                                                              : KVA_SHM_CELL_FREE;
    *fill = (uint8_t)(255u * (used + cached) / seen);
}

/* The cells [*first, *first + return) the paged KV memory covers. */
static uint32_t covered_cells(const kva_kv *kv, const kva_shm_heapmap *map, uint64_t *first) {
    uint64_t start = kv->memory_offset, end = start + kv->info.kv_bytes;
    *first = start / map->cell_bytes;
    uint64_t last = (end + map->cell_bytes - 1) / map->cell_bytes;
    if (last > map->cells) last = map->cells;
    return last > *first ? (uint32_t)(last - *first) : 0;
}

/* Paints every cell the paged KV memory covers, and keeps a copy of them for the publishes that
 * cannot paint (restore_paint). The block a byte belongs to follows from the layout's strides:
 * blocks then layers, or layers then blocks, each layer's region with its own block stride
 * (kv_layer_geometry; the regions follow each other in layer order, and so do the cells). */
static void paint(kva_kv *kv, const kva_shm_heapmap *map, uint8_t *state, uint8_t *fill) {
    if (!map->cell_bytes) return;
    const kva_kv_info *g = &kv->info;
    uint64_t start = kv->memory_offset, bytes = g->kv_bytes;
    int by_layer = g->layout == KVA_KV_LAYOUT_LAYERS;
    uint32_t region = 0;
    kva_kv_layer layer;
    kv_layer_geometry(kv, 0, &layer);
    for (uint64_t cell = start / map->cell_bytes; cell < map->cells && cell * map->cell_bytes < start + bytes; cell++) {
        uint64_t lo = cell * map->cell_bytes > start ? cell * map->cell_bytes - start : 0;
        uint64_t hi = (cell + 1) * map->cell_bytes - start;
        if (hi > bytes) hi = bytes;
        uint64_t first, last;
        if (!by_layer) {
            first = lo / g->block_stride;
            last = (hi - 1) / g->block_stride;
        } else {
            while (region + 1 < g->layers && lo >= layer.offset + (uint64_t)g->num_blocks * layer.block_stride)
                kv_layer_geometry(kv, ++region, &layer);
            if (hi <= layer.offset + (uint64_t)g->num_blocks * layer.block_stride) {
                first = (lo - layer.offset) / layer.block_stride;
                last = (hi - 1 - layer.offset) / layer.block_stride;
            } else {
                first = 0; /* the cell spans a layer boundary: it shows every block */
                last = g->num_blocks - 1;
            }
        }
        if (last >= kv->num_blocks) last = kv->num_blocks - 1;
        paint_cell(kv, (uint32_t)first, (uint32_t)last, &state[cell], &fill[cell]);
    }
    uint64_t first;
    uint32_t n = covered_cells(kv, map, &first);
    if (!kv->painted || kv->painted_first != first || kv->painted_cells != n) {
        free(kv->painted);
        kv->painted = malloc(2 * (size_t)n); /* none: the next busy publish shows plain blocks */
        kv->painted_first = first;
        kv->painted_cells = kv->painted ? n : 0;
    }
    if (kv->painted) {
        memcpy(kv->painted, state + first, n);
        memcpy(kv->painted + n, fill + first, n);
    }
}

/* A full publish repainted the map from the buddy, where the KV memory is one allocation, and
 * the cache's lock is busy: the cells get back what they showed at the last paint (the lock's
 * holder is changing the blocks; the next publish paints them afresh). */
static void restore_paint(const kva_kv *kv, const kva_shm_heapmap *map, uint8_t *state, uint8_t *fill) {
    uint64_t first;
    if (!kv->painted || !map->cell_bytes || covered_cells(kv, map, &first) != kv->painted_cells ||
        first != kv->painted_first)
        return;
    memcpy(state + first, kv->painted, kv->painted_cells);
    memcpy(fill + first, kv->painted + kv->painted_cells, kv->painted_cells);
}

/* The namespace rows with any count, tracked ones in slot order, then the other row: at most
 * KVA_SHM_KV_NAMESPACE_ROWS, the room the section was made with. */
static void publish_namespaces(const kva_kv *kv, kva_shm_kv_namespaces *out) {
    _Static_assert(KVA_SHM_KV_NAMESPACE_SLOTS == KVA_KV_NAMESPACE_SLOTS, "the segment has a row per slot");
    kva_shm_kv_namespace *rows = (kva_shm_kv_namespace *)(out + 1);
    uint32_t n = 0;
    for (uint32_t s = 0; s <= KV_NS_OTHER && n < out->capacity; s++) {
        const kv_ns_row *r = &kv->ns.rows[s];
        if ((r->live[0] | r->live[1] | r->blocks | r->registered) == 0) continue;
        rows[n++] = (kva_shm_kv_namespace){.namespace_id = s == KV_NS_OTHER ? 0 : r->ns,
                                           .flags = s == KV_NS_OTHER ? KVA_SHM_KV_NS_OTHER : 0,
                                           .sequences = r->live[0],
                                           .pins = r->live[1],
                                           .blocks = r->blocks,
                                           .registered_blocks = r->registered};
    }
    out->count = n;
}

/* Whether slot a's sequence comes before slot b's in the section: a sequence before a pin (the
 * list is the sequences', pins fill the room they leave: a few long pins, such as a system
 * prompt per tenant, would otherwise hide every request), then more tokens, then the lower slot
 * (a stable order between publishes). */
static int longer(const kva_kv *kv, uint32_t a, uint32_t b) {
    const kva_kv_seqrec *ra = &kv->seqs[a], *rb = &kv->seqs[b];
    if (ra->is_pin != rb->is_pin) return rb->is_pin;
    return ra->num_tokens > rb->num_tokens || (ra->num_tokens == rb->num_tokens && a < b);
}

/* At a full publish: the longest live sequences, then the longest pins in the room they leave,
 * by one walk over the slots keeping the top KVA_SHM_KV_SEQ_ENTRIES in order (insertion into a
 * 16-entry list): O(slots), never O(blocks); each entry then copies at most
 * KVA_SHM_KV_SEQ_TABLE ids of its table. */
static void publish_sequences(const kva_kv *kv, kva_shm_kv_sequences *out) {
    uint32_t top[KVA_SHM_KV_SEQ_ENTRIES],
        n = 0, room = out->capacity < KVA_SHM_KV_SEQ_ENTRIES ? out->capacity : KVA_SHM_KV_SEQ_ENTRIES;
    uint64_t longest_tokens = 0, longest_handle = 0;
    uint32_t longest_slot = KVA_NIL;
    for (uint32_t s = 0; s < kv->seq_slots; s++) {
        const kva_kv_seqrec *rec = &kv->seqs[s];
        if (!rec->live) continue;
        if (!rec->is_pin && (longest_slot == KVA_NIL || longer(kv, s, longest_slot))) longest_slot = s;
        if (room == 0 || (n == room && !longer(kv, s, top[n - 1]))) continue;
        uint32_t at = n < room ? n++ : n - 1;
        while (at > 0 && longer(kv, s, top[at - 1])) {
            top[at] = top[at - 1];
            at--;
        }
        top[at] = s;
    }
    if (longest_slot != KVA_NIL) {
        longest_tokens = kv->seqs[longest_slot].num_tokens;
        longest_handle = kv_handle(kv, longest_slot, kv->seqs[longest_slot].generation);
    }
    uint32_t table_room = out->table_capacity < KVA_SHM_KV_SEQ_TABLE ? out->table_capacity : KVA_SHM_KV_SEQ_TABLE;
    kva_shm_kv_sequence *entries = (kva_shm_kv_sequence *)(out + 1);
    for (uint32_t i = 0; i < n; i++) {
        const kva_kv_seqrec *rec = &kv->seqs[top[i]];
        kva_shm_kv_sequence *e = &entries[i];
        uint32_t len = rec->len < table_room ? rec->len : table_room;
        e->handle = kv_handle(kv, top[i], rec->generation);
        e->namespace_id = rec->ns;
        e->num_tokens = rec->num_tokens;
        e->cached_tokens = rec->cached_tokens;
        e->blocks = rec->len;
        e->priority = rec->priority;
        e->flags = rec->is_pin ? KVA_SHM_KV_SEQ_PIN : 0;
        e->table_len = len;
        if (len) memcpy(e->table, rec->table, (size_t)len * sizeof *e->table);
    }
    out->count = n;
    out->live_sequences = kv->live_seqs;
    out->live_pins = kv->live_pins;
    out->longest_tokens = longest_tokens;
    out->longest_handle = longest_handle;
}

static void publish_cb(void *ctx, const kva_kv_publish_to *to) {
    kva_kv *kv = ctx;
    kva_shm_kv *out = to->kv;
    const kva_shm_heapmap *map = to->map;
    uint8_t *state = to->state, *fill = to->fill;
    /* From the end of the cache's own call on this thread the lock is held already; from
     * anywhere else it is taken if free, else this publish keeps the section it had. */
    int took = 0;
    if (kv_self_publishing != kv) {
        if (pthread_mutex_trylock(&kv->lock) != 0) {
            if (map && kv->info.mode == KVA_KV_PAGED) restore_paint(kv, map, state, fill);
            return;
        }
        took = 1;
    }
    const kva_kv_counters *c = &kv->counters;
    *out = (kva_shm_kv){.present = 1,
                        .block_tokens = kv->info.mode == KVA_KV_PAGED ? kv->block_tokens : 1,
                        .total_blocks = kv->num_blocks,
                        /* Trimmed blocks are free ones (without memory for now). */
                        .free_blocks = kv->free_count +
                                       (kv->info.mode == KVA_KV_PAGED ? kv->num_blocks - kv->backed_blocks : 0),
                        .used_blocks = kv->used_count,
                        .cached_blocks = kv->cached_count,
                        .hit_tokens = c->hit_tokens,
                        .query_tokens = c->query_tokens,
                        .evictions = c->evictions,
                        .cow_copies = c->cow_copies,
                        .forks = c->forks,
                        .live_sequences = kv->live_seqs,
                        .block_bytes = kv->info.mode == KVA_KV_PAGED ? kv->info.block_bytes : kv->info.token_bytes,
                        .peak_used_blocks = kv->peak_used,
                        .peak_cached_blocks = kv->peak_cached,
                        .call_sample_period = kv->sample_period,
                        .call_kinds = KVA_SHM_KV_CALL_KINDS};
    if (kv->info.mode == KVA_KV_PAGED) {
        out->bytes_in_use = (uint64_t)kv->used_count * kv->info.block_bytes;
        out->peak_bytes_in_use = (uint64_t)kv->peak_used * kv->info.block_bytes;
    } else {
        out->bytes_in_use = kv->contig_bytes;
        out->peak_bytes_in_use = kv->peak_contig_bytes;
    }
    _Static_assert(KVA_SHM_KV_CALL_KINDS == KVA_KV_CALL_KINDS && KVA_SHM_LATENCY_BUCKETS == KVA_KV_LATENCY_BUCKETS,
                   "the segment's KV latency arrays are the cache's");
    memcpy(out->call_timed, kv->kind_timed_calls, sizeof out->call_timed);
    memcpy(out->call_ns, kv->kind_timed_ns, sizeof out->call_ns);
    memcpy(out->call_ns_log2, kv->kind_ns_log2, sizeof out->call_ns_log2);
    out->pinned_blocks = kv->pinned_count;
    out->readmit_hit_tokens = c->readmit_hit_tokens;
    out->readmit_query_tokens = c->readmit_query_tokens;
    publish_namespaces(kv, to->namespaces);
    if (to->sequences) publish_sequences(kv, to->sequences);
    if (map && kv->info.mode == KVA_KV_PAGED && kv->num_blocks) paint(kv, map, state, fill);
    if (took) pthread_mutex_unlock(&kv->lock);
}

void kv_publish_attach(kva_kv *kv) {
    if (!kva_stats_segment_name(kv->pool)) return;
    void *base;
    if (kv->memory && kva_pool_base(kv->pool, &base) == KVA_OK)
        kv->memory_offset = (uint64_t)(kv->memory - (unsigned char *)base);
    kva_kv_publisher publisher = {.publish = publish_cb, .ctx = kv};
    if (!kva_pool_attach_kv(kv->pool, &publisher)) return; /* another cache's section */
    kv->publishing = 1;
    /* The cache is not shared yet: its lock is free, and the hook takes it. */
    kva_stats_publish(kv->pool);
}

void kv_publish_detach(kva_kv *kv) {
    if (!kv->publishing) return;
    kva_pool_detach_kv(kv->pool, kv);
    kv->publishing = 0;
    free(kv->painted); /* no publish reaches the cache any more */
    kv->painted = NULL;
    if (!kv->owns_pool) kva_stats_publish(kv->pool); /* the pool lives on: say the cache is gone */
}

void kv_publish_due(kva_kv *kv) {
    kv_self_publishing = kv;
    kva_publish_tick(kv->pool);
    kv_self_publishing = NULL;
}
