/*
 * check.c — kva_check: walks every invariant stated in buddy.h, slab.h and pool.h and names the
 * first one broken. O(capacity / min_block + slab bitmap words); never on a hot path.
 */
#include "checked.h"
#include "pool.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

static kva_status check_tiling(const kva_buddy *b, uint64_t *free_units, uint64_t *used_units,
                               uint64_t *free_heads, uint64_t *used_blocks) {
    uint32_t index = 0;
    while (index < b->nblocks) {
        const kva_page *page = &b->pages[index];
        if (page->state == KVA_BLOCK_NONE || page->state > KVA_BLOCK_SLAB)
            return BROKEN("B1: minimum block %u should head a block but has state %u", index, page->state);
        if (page->order >= b->num_orders)
            return BROKEN("B1: block %u has order %u, beyond the %u orders", index, page->order, b->num_orders);
        uint32_t size = kva_buddy_length(page);
        if (index & (((uint32_t)1 << page->order) - 1))
            return BROKEN("B2: block %u of order %u is misaligned", index, page->order);
        if (size == 0 || size > (uint32_t)1 << page->order)
            return BROKEN("B1: block %u of order %u has length %u", index, page->order, size);
        if (size > b->nblocks - index) return BROKEN("B1: block %u of order %u runs past the end", index, page->order);
        for (uint32_t inner = index + 1; inner < index + size; inner++)
            if (b->pages[inner].state != KVA_BLOCK_NONE)
                return BROKEN("B1: minimum block %u inside block %u has state %u", inner, index, b->pages[inner].state);
        if (page->state == KVA_BLOCK_FREE) {
            *free_units += size;
            (*free_heads)++;
            uint32_t mate = index ^ size;
            if (page->order + 1u < b->num_orders && mate <= b->nblocks - size &&
                b->pages[mate].state == KVA_BLOCK_FREE && b->pages[mate].order == page->order)
                return BROKEN("B5: free buddies %u and %u of order %u were not merged", index, mate, page->order);
        } else {
            *used_units += size;
            *used_blocks += page->state == KVA_BLOCK_USED;
        }
        index += size;
    }
    return KVA_OK;
}

static kva_status check_free_lists(const kva_buddy *b, uint64_t free_heads) {
    uint64_t listed = 0;
    for (unsigned k = 0; k < KVA_MAX_ORDERS; k++) {
        int nonempty = (b->nonempty >> k) & 1;
        if (nonempty != (b->free_head[k] != KVA_NIL))
            return BROKEN("B4: nonempty bit %u is %d but free list %u is %s", k, nonempty, k,
                          b->free_head[k] == KVA_NIL ? "empty" : "not empty");
        uint64_t count = 0;
        uint32_t prev = KVA_NIL;
        for (uint32_t at = b->free_head[k]; at != KVA_NIL; at = b->pages[at].next) {
            if (at >= b->nblocks) return BROKEN("B3: free list %u links to %u, past the end", k, at);
            const kva_page *page = &b->pages[at];
            if (page->state != KVA_BLOCK_FREE || page->order != k)
                return BROKEN("B3: block %u on free list %u has state %u order %u", at, k, page->state, page->order);
            if (page->prev != prev) return BROKEN("B3: block %u on free list %u has a wrong prev link", at, k);
            if (++count > b->free_count[k])
                return BROKEN("B3: free list %u is longer than its count %llu", k,
                              (unsigned long long)b->free_count[k]);
            prev = at;
        }
        if (count != b->free_count[k])
            return BROKEN("B3: free list %u holds %llu blocks, its count says %llu", k, (unsigned long long)count,
                          (unsigned long long)b->free_count[k]);
        listed += count;
    }
    if (listed != free_heads)
        return BROKEN("B3: %llu free blocks in the heap but %llu on the free lists", (unsigned long long)free_heads,
                      (unsigned long long)listed);
    return KVA_OK;
}

static kva_status check_buddy(const kva_buddy *b, uint64_t *used_blocks) {
    uint64_t free_units = 0, used_units = 0, free_heads = 0;
    kva_status st = check_tiling(b, &free_units, &used_units, &free_heads, used_blocks);
    if (st != KVA_OK) return st;
    st = check_free_lists(b, free_heads);
    if (st != KVA_OK) return st;
    if (free_units != b->free_units || used_units != b->used_units)
        return BROKEN("B6: counted %llu free and %llu used minimum blocks, the counters say %llu and %llu",
                      (unsigned long long)free_units, (unsigned long long)used_units,
                      (unsigned long long)b->free_units, (unsigned long long)b->used_units);
    return KVA_OK;
}

static kva_status check_bitmap(const kva_slabs *sl, uint32_t s, const kva_size_class *cls) {
    const kva_slab *slab = &sl->slabs[s];
    const uint64_t *l1 = kva_slab_bitmap(sl, s), *l0 = l1 + cls->l1_words;
    uint64_t free_bits = 0;
    for (uint32_t w = 0; w < cls->l0_words; w++) {
        free_bits += (uint64_t)__builtin_popcountll(l0[w]);
        int listed = (l1[w >> 6] >> (w & 63)) & 1, claimed = &l0[w] == cls->cur_l0;
        if ((l0[w] != 0 && !claimed) != listed)
            return BROKEN("S2: slab %u l1 bit %u disagrees with its l0 word", s, w);
    }
    uint32_t tail = cls->nobj % 64;
    if (tail && (l0[cls->l0_words - 1] >> tail))
        return BROKEN("S2: slab %u marks objects past its %u objects free", s, cls->nobj);
    for (uint32_t w = 0; w < cls->l1_words; w++)
        if ((l1[w] != 0) != ((slab->l2 >> w) & 1)) return BROKEN("S2: slab %u l2 bit %u disagrees with its l1 word", s, w);
    if (cls->l1_words < 64 && (slab->l2 >> cls->l1_words))
        return BROKEN("S2: slab %u l2 has bits past its %u l1 words", s, cls->l1_words);
    uint64_t claimed_free = cls->cur_slab == s ? (uint64_t)__builtin_popcountll(*cls->cur_l0) : 0;
    if (free_bits != cls->nobj - slab->inuse + claimed_free)
        return BROKEN("S2: slab %u has %llu free objects in its bitmap but %u of %u in use", s,
                      (unsigned long long)free_bits, slab->inuse, cls->nobj);
    return KVA_OK;
}

/* S6 first: the other slab checks read through each class's current-word pointer. */
static kva_status check_claims(const kva_slabs *sl) {
    if (sl->no_word != 0) return BROKEN("S6: the no_word sentinel was written");
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        const kva_size_class *cls = &sl->classes[c];
        int ok = cls->cur_slab == KVA_NIL
                     ? cls->cur_l0 == &sl->no_word
                     : cls->cur_slab < sl->nchunks && sl->slabs[cls->cur_slab].cls == c &&
                           cls->cur_word < cls->l0_words &&
                           cls->cur_l0 == kva_slab_bitmap(sl, cls->cur_slab) + cls->l1_words + cls->cur_word &&
                           cls->cur_offset == ((uint64_t)cls->cur_slab << sl->chunk_shift) +
                                                  (uint64_t)cls->cur_word * 64 * cls->size;
        if (!ok)
            return BROKEN("S6: class %u's current word (slab %u, word %u) is not one of its own", c, cls->cur_slab,
                          cls->cur_word);
    }
    return KVA_OK;
}

static kva_status check_slabs(const kva_pool *pool) {
    const kva_slabs *sl = &pool->slabs;
    const kva_buddy *b = &pool->buddy;
    uint64_t live[KVA_NUM_SIZE_CLASSES] = {0}, slabs[KVA_NUM_SIZE_CLASSES] = {0}, listed[KVA_NUM_SIZE_CLASSES] = {0};
    uint32_t empties[KVA_NUM_SIZE_CLASSES] = {0}, total = 0;
    kva_status claims = check_claims(sl);
    if (claims != KVA_OK) return claims;
    for (uint32_t s = 0; s < sl->nchunks; s++) {
        const kva_slab *slab = &sl->slabs[s];
        uint64_t head = (uint64_t)s << sl->chunk_order;
        int is_slab_block = head < b->nblocks && b->pages[head].state == KVA_BLOCK_SLAB;
        if ((slab->cls != KVA_SLAB_NONE) != is_slab_block)
            return BROKEN("S1: chunk %u descriptor says %s but its buddy block says %s", s,
                          slab->cls == KVA_SLAB_NONE ? "no slab" : "slab", is_slab_block ? "slab" : "no slab");
        if (slab->cls == KVA_SLAB_NONE) continue;
        if (slab->cls >= KVA_NUM_SIZE_CLASSES) return BROKEN("S1: slab %u has class %u", s, slab->cls);
        if (b->pages[head].order != sl->chunk_order)
            return BROKEN("S1: slab %u sits in a block of order %u, not %u", s, b->pages[head].order, sl->chunk_order);
        const kva_size_class *cls = &sl->classes[slab->cls];
        if (slab->l0 != kva_slab_bitmap(sl, s) + cls->l1_words)
            return BROKEN("S1: slab %u's l0 pointer is not inside its own bitmap slot", s);
        if (slab->inuse > cls->nobj) return BROKEN("S2: slab %u has %u of %u objects in use", s, slab->inuse, cls->nobj);
        kva_status st = check_bitmap(sl, s, cls);
        if (st != KVA_OK) return st;
        live[slab->cls] += slab->inuse;
        slabs[slab->cls]++;
        total++;
        if (slab->inuse == 0) {
            empties[slab->cls]++;
            if (cls->empty_slab != s)
                return BROKEN("S4: slab %u of class %u is empty but the class's spare is %u", s, slab->cls, cls->empty_slab);
        }
    }
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        const kva_size_class *cls = &sl->classes[c];
        uint32_t prev = KVA_NIL;
        for (uint32_t at = cls->partial_head; at != KVA_NIL; at = sl->slabs[at].next) {
            if (at >= sl->nchunks || sl->slabs[at].cls != c)
                return BROKEN("S3: partial list of class %u links to %u, not a slab of that class", c, at);
            if (sl->slabs[at].prev != prev) return BROKEN("S3: slab %u on class %u's list has a wrong prev link", at, c);
            if (!sl->slabs[at].listed) return BROKEN("S3: slab %u is on class %u's list but not flagged listed", at, c);
            if (++listed[c] > slabs[c]) return BROKEN("S3: class %u's partial list loops", c);
            prev = at;
        }
        if (cls->partial_tail != prev)
            return BROKEN("S3: class %u's partial tail is %u, the list ends at %u", c, cls->partial_tail, prev);
        if (empties[c] > 1) return BROKEN("S4: class %u keeps %u empty slabs", c, empties[c]);
        if (cls->empty_slab != KVA_NIL && (cls->empty_slab >= sl->nchunks || sl->slabs[cls->empty_slab].cls != c))
            return BROKEN("S4: class %u names spare %u, which is not one of its slabs", c, cls->empty_slab);
        uint64_t cached = cls->cur_slab != KVA_NIL ? (uint64_t)__builtin_popcountll(*cls->cur_l0) : 0;
        if (cls->allocs - cls->frees != live[c] - cached || cls->slabs != slabs[c])
            return BROKEN("S5: class %u counts %llu live in %u slabs; the slabs hold %llu in %llu", c,
                          (unsigned long long)(cls->allocs - cls->frees), cls->slabs, (unsigned long long)live[c],
                          (unsigned long long)slabs[c]);
    }
    /* The listed flags must match list membership exactly, and every slab with a free object
     * must be listed. */
    for (uint32_t s = 0; s < sl->nchunks; s++) {
        const kva_slab *slab = &sl->slabs[s];
        if (slab->cls == KVA_SLAB_NONE) continue;
        if (slab->inuse < sl->classes[slab->cls].nobj && !slab->listed)
            return BROKEN("S3: slab %u has free objects but is on no partial list", s);
        if (slab->listed) {
            if (listed[slab->cls] == 0) return BROKEN("S3: slab %u is flagged listed but is on no list", s);
            listed[slab->cls]--;
        }
    }
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++)
        if (listed[c]) return BROKEN("S3: class %u's partial list holds a slab not flagged listed", c);
    if (total != sl->live_slabs) return BROKEN("S5: %u slabs exist, the counter says %u", total, sl->live_slabs);
    return KVA_OK;
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

kva_status kva_check(kva_pool *pool) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    if (pool->capacity != (size_t)pool->buddy.nblocks << pool->buddy.min_shift || pool->capacity > pool->region.length)
        return BROKEN("P2: capacity %zu disagrees with %u blocks or the %zu-byte region", pool->capacity,
                      pool->buddy.nblocks, pool->region.length);
    if ((uintptr_t)pool->base & (pool->max_alloc_size - 1))
        return BROKEN("P1: base %p is not aligned to the largest block (%zu)", (void *)pool->base, pool->max_alloc_size);
    uint64_t used_blocks = 0;
    kva_status st = check_buddy(&pool->buddy, &used_blocks);
    if (st != KVA_OK) return st;
    st = check_slabs(pool);
    if (st != KVA_OK) return st;
    if (pool->checked) {
        poison_check pc = {.base = pool->base, .bad_at = UINT64_MAX};
        kva_walk(pool, check_free_range, &pc);
        if (pc.bad_at != UINT64_MAX)
            return BROKEN("C1: byte %llu of the pool is free but was written after it was freed",
                          (unsigned long long)pc.bad_at);
    }
    if (pool->block_allocs - pool->block_frees != used_blocks)
        return BROKEN("P3: %llu block allocations less %llu frees, but %llu blocks are live",
                      (unsigned long long)pool->block_allocs, (unsigned long long)pool->block_frees,
                      (unsigned long long)used_blocks);
    return kva_region_check(&pool->region, &pool->buddy);
}
