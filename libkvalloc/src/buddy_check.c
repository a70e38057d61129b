/*
 * buddy_check.c — the buddy's invariants (buddy.h, B1-B6), walked: kva_check's first part, and
 * what an expensive assertion runs after a split or a merge. O(nblocks).
 */
#include "buddy.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

static kva_status check_tiling(const kva_buddy *b, uint64_t *free_units, uint64_t *used_units, uint64_t *free_heads,
                               uint64_t *used_blocks) {
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

kva_status kva_buddy_check(const kva_buddy *b, uint64_t *used_blocks) {
    uint64_t free_units = 0, used_units = 0, free_heads = 0, used = 0;
    kva_status st = check_tiling(b, &free_units, &used_units, &free_heads, &used);
    if (st != KVA_OK) return st;
    st = check_free_lists(b, free_heads);
    if (st != KVA_OK) return st;
    if (free_units != b->free_units || used_units != b->used_units)
        return BROKEN("B6: counted %llu free and %llu used minimum blocks, the counters say %llu and %llu",
                      (unsigned long long)free_units, (unsigned long long)used_units, (unsigned long long)b->free_units,
                      (unsigned long long)b->used_units);
    if (b->peak_used_units < b->used_units)
        return BROKEN("B7: the peak of %llu used minimum blocks is below the %llu used now",
                      (unsigned long long)b->peak_used_units, (unsigned long long)b->used_units);
    if (used_blocks) *used_blocks = used;
    return KVA_OK;
}
