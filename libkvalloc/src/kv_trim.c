/*
 * kv_trim.c — kva_kv_trim: after compaction has gathered the free blocks at the top ids, the
 * memory behind them goes back to the pool's backing (CUDA granules unmapped and released,
 * host pages discarded), and comes back when the cache needs those blocks again.
 *
 * Blocks [backed_blocks, num_blocks) are TRIMMED: free, off the free stack, without memory.
 * In every region of the KV memory (one for the blocks layout, one per layer for the layers
 * layout; each holds block b at region + b * block_stride) the memory given back is the whole
 * units (kva_pool_range_unit) lying entirely above the last backed block:
 *     [roundup(region + backed * stride), rounddown(region end)).
 * A trim from backed o down to n releases exactly the units that set gains,
 *     [roundup(region + n * stride), min(roundup(region + o * stride), rounddown(region end))),
 * and taking the memory back takes exactly the set, so every unit is released once and taken
 * once, and a unit shared with a backed block (or with the next region) is never released.
 */
#include "kv_cache.h"
#include "pool_range.h"

static size_t round_up(size_t x, size_t unit) { return (x + unit - 1) / unit * unit; }
static size_t round_down(size_t x, size_t unit) { return x / unit * unit; }

static unsigned regions(const kva_kv *kv) { return kv->info.layout == KVA_KV_LAYOUT_LAYERS ? kv->info.layers : 1; }

/* The units of region r released when the backed blocks go from `to` down to `from` (see the
 * top), as offsets from the KV memory's start; start == end when there are none. Region r is
 * layer r's in the layers layout (each layer has its own block stride when layers differ in
 * shape), the whole memory in the blocks layout. */
static void unit_span(const kva_kv *kv, unsigned r, size_t unit, uint32_t from, uint32_t to, size_t *start,
                      size_t *end) {
    uintptr_t mem = (uintptr_t)kv->memory, stride = kv->info.block_bytes, offset = 0;
    if (kv->info.layout == KVA_KV_LAYOUT_LAYERS) {
        kva_kv_layer layer;
        kv_layer_geometry(kv, r, &layer);
        stride = layer.block_stride;
        offset = layer.offset;
    }
    uintptr_t rs = mem + offset, re = rs + (uintptr_t)kv->num_blocks * stride;
    uintptr_t lo = round_up(rs + (uintptr_t)from * stride, unit), cap = round_down(re, unit);
    uintptr_t hi = to == kv->num_blocks ? cap : round_up(rs + (uintptr_t)to * stride, unit);
    if (hi > cap) hi = cap;
    if (hi < lo) hi = lo;
    *start = lo - mem;
    *end = hi - mem;
}

/* Backs the memory of blocks [backed_blocks, to) again, in every region; on failure none is. */
static kva_status take_ranges(kva_kv *kv, uint32_t to) {
    size_t unit = kva_pool_range_unit(kv->pool);
    uint32_t from = kv->backed_blocks;
    if (!unit) return KVA_OK;
    for (unsigned r = 0; r < regions(kv); r++) {
        size_t start, end;
        unit_span(kv, r, unit, from, to, &start, &end);
        kva_status st = kva_pool_range_take(kv->pool, kv->memory + start, end - start);
        if (st != KVA_OK) {
            for (unsigned back = 0; back < r; back++) { /* nothing changed: give back what was taken */
                unit_span(kv, back, unit, from, to, &start, &end);
                kva_pool_range_release(kv->pool, kv->memory + start, end - start);
            }
            return st;
        }
    }
    return KVA_OK;
}

kva_status kv_ensure_backed(kva_kv *kv, uint32_t need, uint32_t evictable) {
    if (need <= kv->free_count || kv->backed_blocks == kv->num_blocks) return KVA_OK;
    /* Only as many blocks as the call lacks (their units rounded up by unit_span), not all. */
    uint32_t from = kv->backed_blocks, lacking = need - kv->free_count, trimmed = kv->num_blocks - from;
    uint32_t to = from + (lacking < trimmed ? lacking : trimmed);
    kva_status st = take_ranges(kv, to);
    if (st != KVA_OK) {
        /* The memory cannot be had: cached blocks may still serve the call by eviction, as
         * they would have before any trim. */
        if (need <= kv->free_count + evictable) return KVA_OK;
        kv->counters.alloc_failures++;
        return st;
    }
    /* Below the free blocks with memory: those are taken first. */
    for (uint32_t b = from; b < to; b++) {
        kva_kv_block *blk = &kv->blocks[b];
        *blk = (kva_kv_block){.hash_next = KVA_NIL, .next = KVA_NIL, .state = KV_FREE};
        if (kv->free_count == 0) kv->free_top = b;
        else kv->blocks[kv->free_bottom].next = b;
        kv->free_bottom = b;
        kv->free_count++;
    }
    kv->backed_blocks = to;
    return KVA_OK;
}

static kva_status trim_locked(kva_kv *kv, uint32_t *trimmed) {
    if (kv->info.mode != KVA_KV_PAGED)
        return kv_reject(kv, kva_fail(KVA_ERR_INVALID, "trimming needs paged mode; this cache is contiguous"));
    size_t unit = kva_pool_range_unit(kv->pool);
    /* The new top: above the highest block that is not free. */
    uint32_t top = kv->backed_blocks;
    while (top > 0 && kv->blocks[top - 1].state == KV_FREE) top--;
    uint32_t old = kv->backed_blocks;
    if (top < old && unit) {
        for (unsigned r = 0; r < regions(kv); r++) {
            size_t start, end;
            unit_span(kv, r, unit, top, old, &start, &end);
            /* A refusal (the driver would not unmap) leaves the memory mapped and the blocks
             * trimmed all the same: the next take maps what is missing. */
            kva_pool_range_release(kv->pool, kv->memory + start, end - start);
        }
    }
    if (top < old) {
        /* The free stack keeps its order, less the blocks now trimmed. */
        uint32_t *link = &kv->free_top, last = KVA_NIL;
        for (uint32_t b = kv->free_top; b != KVA_NIL; b = kv->blocks[b].next) {
            if (b >= top) continue;
            *link = b;
            link = &kv->blocks[b].next;
            last = b;
        }
        *link = KVA_NIL;
        kv->free_bottom = last;
        for (uint32_t b = top; b < old; b++) kv->blocks[b].state = KV_TRIMMED;
        kv->free_count -= old - top;
        kv->backed_blocks = top;
    }
    if (trimmed) *trimmed = kv->num_blocks - kv->backed_blocks;
    return KVA_OK;
}

kva_status kva_kv_trim(kva_kv *kv, uint32_t *trimmed) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK) st = trim_locked(kv, trimmed);
    kv_unlock(kv);
    return st;
}
