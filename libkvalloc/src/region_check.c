/*
 * region_check.c — kva_check's part for the region: a CUDA region's own invariants and that
 * each granule's reference count matches the live blocks of the buddy over it (R1 .. R3,
 * region_cuda.h). Host memory keeps no state to check.
 */
#include "region_check.h"
#include "region_cuda.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

static kva_status check_granule(const kva_cuda_region *r, uint32_t g, uint32_t expected) {
    const kva_granule *gr = &r->granules[g];
    if (gr->released) {
        if (expected != 1)
            return BROKEN("R1: granule %u was given back within a block but %u live blocks overlap it", g, expected);
        expected = 0;
    }
    if (gr->refs != expected)
        return BROKEN("R1: granule %u has %u references but %u live blocks overlap it", g, gr->refs, expected);
    int state_ok = gr->state == KVA_GRANULE_UNMAPPED ? gr->refs == 0
                   : gr->state == KVA_GRANULE_MAPPED ? gr->refs > 0
                   : gr->state == KVA_GRANULE_IDLE   ? gr->refs == 0
                                                     : 0;
    if (!state_ok) return BROKEN("R2: granule %u is in state %u with %u references", g, gr->state, gr->refs);
    return KVA_OK;
}

static kva_status check_refs(const kva_cuda_region *r, const kva_buddy *buddy) {
    /* Blocks come in address order, so each granule's count is complete once a block starts
     * past it. */
    uint32_t cur = 0, count = 0;
    kva_status st = KVA_OK;
    for (uint32_t index = 0; index < buddy->nblocks && st == KVA_OK;) {
        const kva_page *page = &buddy->pages[index];
        uint32_t length = kva_buddy_length(page);
        if (page->state == KVA_BLOCK_USED || page->state == KVA_BLOCK_SLAB) {
            uint64_t start = (uint64_t)index << buddy->min_shift, end = (uint64_t)(index + length) << buddy->min_shift;
            uint32_t a = (uint32_t)(start >> r->shift), b = (uint32_t)((end - 1) >> r->shift);
            for (; cur < a && st == KVA_OK; cur++, count = 0) st = check_granule(r, cur, count);
            count++;
            for (; cur < b && st == KVA_OK; cur++, count = 1) st = check_granule(r, cur, count);
        }
        index += length ? length : 1;
    }
    for (; cur < r->ngranules && st == KVA_OK; cur++, count = 0) st = check_granule(r, cur, count);
    return st;
}

static kva_status check_lists(const kva_cuda_region *r) {
    uint32_t listed = 0, prev = KVA_NIL, idle = 0, mapped = 0;
    for (uint32_t g = r->idle_head; g != KVA_NIL; g = r->granules[g].next) {
        if (g >= r->ngranules) return BROKEN("R3: the idle list links to granule %u, past the end", g);
        if (r->granules[g].state != KVA_GRANULE_IDLE)
            return BROKEN("R3: granule %u is on the idle list but not idle", g);
        if (r->granules[g].prev != prev) return BROKEN("R3: granule %u on the idle list has a wrong prev link", g);
        if (++listed > r->ngranules) return BROKEN("R3: the idle list loops");
        prev = g;
    }
    if (r->idle_tail != prev) return BROKEN("R3: the idle list's tail is %u, the list ends at %u", r->idle_tail, prev);
    for (uint32_t g = 0; g < r->ngranules; g++) {
        idle += r->granules[g].state == KVA_GRANULE_IDLE;
        mapped += r->granules[g].state != KVA_GRANULE_UNMAPPED;
    }
    if (listed != idle || idle != r->idle || mapped != r->mapped)
        return BROKEN("R3: %u granules idle and %u mapped, %u on the idle list, the counters say %u and %u", idle,
                      mapped, listed, r->idle, r->mapped);
    return KVA_OK;
}

kva_status kva_region_check(const kva_region *region, const kva_buddy *buddy) {
    const kva_cuda_region *r = region->device;
    if (!r) return KVA_OK;
    if (r->resident) {
        if (r->mapped != r->ngranules)
            return BROKEN("R2: a resident region maps %u of its %u granules", r->mapped, r->ngranules);
        return KVA_OK;
    }
    kva_status st = check_lists(r);
    return st == KVA_OK ? check_refs(r, buddy) : st;
}
