/*
 * buddy.c — the buddy allocator over minimum-block indices. See buddy.h for the invariants.
 */
#include "buddy.h"
#include "os.h"

static void list_push(kva_buddy *buddy, uint32_t index, unsigned order) {
    kva_assert_internal(order < buddy->num_orders && index < buddy->nblocks &&
                        (index & (((uint32_t)1 << order) - 1)) == 0); /* B2 */
    kva_page *page = &buddy->pages[index];
    uint32_t head = buddy->free_head[order];
    page->state = KVA_BLOCK_FREE;
    page->order = (uint8_t)order;
    page->prev = KVA_NIL;
    page->next = head;
    if (head != KVA_NIL) buddy->pages[head].prev = index;
    buddy->free_head[order] = index;
    buddy->free_count[order]++;
    buddy->nonempty |= (uint64_t)1 << order;
}

static void list_unlink(kva_buddy *buddy, uint32_t index, unsigned order) {
    kva_page *page = &buddy->pages[index];
    kva_assert_internal(page->state == KVA_BLOCK_FREE && page->order == order && buddy->free_count[order] > 0);
    kva_assert_internal(page->prev == KVA_NIL ? buddy->free_head[order] == index
                                              : buddy->pages[page->prev].next == index);
    kva_assert_internal(page->next == KVA_NIL || buddy->pages[page->next].prev == index);
    if (page->prev != KVA_NIL) buddy->pages[page->prev].next = page->next;
    else buddy->free_head[order] = page->next;
    if (page->next != KVA_NIL) buddy->pages[page->next].prev = page->prev;
    if (--buddy->free_count[order] == 0) buddy->nonempty &= ~((uint64_t)1 << order);
}

kva_status kva_buddy_init(kva_buddy *buddy, uint32_t nblocks, unsigned min_shift, unsigned num_orders) {
    size_t bytes = (size_t)nblocks * sizeof(kva_page);
    void *pages;
    kva_status st = kva_os_map_metadata(bytes, &pages);
    if (st != KVA_OK) return st;
    *buddy = (kva_buddy){.pages = pages, .nblocks = nblocks, .min_shift = min_shift, .pages_bytes = bytes};
    buddy->num_orders = num_orders;
    for (unsigned k = 0; k < KVA_MAX_ORDERS; k++) buddy->free_head[k] = KVA_NIL;
    /* Any capacity, not only powers of two: cover [0, nblocks) with the largest blocks that are
     * aligned to their own size, fit, and are of an order below num_orders. The mapping is zero, so every other record is NONE. */
    uint32_t at = 0;
    while (at < nblocks) {
        unsigned fit = kva_log2(nblocks - at);
        unsigned align = at == 0 ? fit : kva_ctz64(at);
        unsigned order = fit < align ? fit : align;
        if (order >= num_orders) order = num_orders - 1;
        list_push(buddy, at, order);
        at += (uint32_t)1 << order;
    }
    buddy->free_units = nblocks;
    return KVA_OK;
}

void kva_buddy_fini(kva_buddy *buddy) {
    kva_os_unmap(buddy->pages, buddy->pages_bytes);
    buddy->pages = NULL;
}

uint32_t kva_buddy_alloc(kva_buddy *buddy, unsigned order, uint8_t state) {
    kva_assert_internal(order < buddy->num_orders && (state == KVA_BLOCK_USED || state == KVA_BLOCK_SLAB));
    uint64_t candidates = buddy->nonempty & (~(uint64_t)0 << order);
    if (kva_unlikely(candidates == 0)) return KVA_NIL;
    unsigned have = kva_ctz64(candidates), found = have;
    uint32_t index = buddy->free_head[have];
    list_unlink(buddy, index, have);
    /* Split down to the order asked for; the upper halves go back on their lists. */
    while (have > order) {
        have--;
        list_push(buddy, index + ((uint32_t)1 << have), have);
    }
    kva_page *page = &buddy->pages[index];
    page->state = state;
    page->order = (uint8_t)order;
    page->next = (uint32_t)1 << order;
    uint64_t units = (uint64_t)1 << order;
    buddy->free_units -= units;
    buddy->used_units += units;
    if (buddy->used_units > buddy->peak_used_units) buddy->peak_used_units = buddy->used_units;
    kva_assert_expensive(found == order || kva_buddy_check(buddy, NULL) == KVA_OK); /* after a split */
    return index;
}

static void free_any_block(kva_buddy *buddy, uint32_t index);

/* Frees [at, end) as the largest aligned blocks that fit, each merging as far as it can. */
static void free_range(kva_buddy *buddy, uint32_t at, uint32_t end) {
    while (at < end) {
        unsigned fit = kva_log2(end - at), align = kva_ctz64(at | ((uint64_t)1 << 63));
        unsigned order = fit < align ? fit : align;
        kva_page *page = &buddy->pages[at];
        page->state = KVA_BLOCK_USED;
        page->order = (uint8_t)order;
        page->next = (uint32_t)1 << order;
        free_any_block(buddy, at);
        at += (uint32_t)1 << order;
    }
}

uint32_t kva_buddy_alloc_exact(kva_buddy *buddy, unsigned order, uint32_t units) {
    /* The peak counts only what is kept: not the whole block for the moment before its tail is
     * back. */
    uint64_t peak = buddy->peak_used_units;
    uint32_t index = kva_buddy_alloc(buddy, order, KVA_BLOCK_USED);
    if (index == KVA_NIL) return KVA_NIL;
    uint32_t end = index + ((uint32_t)1 << order);
    kva_assert_internal(units >= 1 && units <= (uint32_t)1 << order);
    buddy->pages[index].next = units;
    free_range(buddy, index + units, end);
    buddy->peak_used_units = peak > buddy->used_units ? peak : buddy->used_units;
    kva_assert_expensive(kva_buddy_check(buddy, NULL) == KVA_OK);
    return index;
}

/* kva_buddy_free's work, which free_range does for each piece of a range (the tiling is whole
 * again only once the range is). */
static void free_any_block(kva_buddy *buddy, uint32_t index) {
    kva_page *pages = buddy->pages;
    unsigned order = pages[index].order;
    uint32_t length = pages[index].next;
    if (length != (uint32_t)1 << order) {
        /* An exact allocation: not a buddy block, so free it as the blocks it is made of. */
        free_range(buddy, index, index + length);
        return;
    }
    uint64_t units = (uint64_t)1 << order;
    buddy->used_units -= units;
    buddy->free_units += units;
    while (order + 1 < buddy->num_orders) {
        uint32_t size = (uint32_t)1 << order;
        uint32_t mate = index ^ size;
        /* The mate may stick out past nblocks when the capacity is not a power of two. */
        if (mate > buddy->nblocks - size) break;
        if (pages[mate].state != KVA_BLOCK_FREE || pages[mate].order != order) break;
        list_unlink(buddy, mate, order);
        uint32_t merged = index < mate ? index : mate;
        pages[index ^ mate ^ merged].state = KVA_BLOCK_NONE; /* the upper head is absorbed */
        index = merged;
        order++;
    }
    list_push(buddy, index, order);
}

void kva_buddy_free(kva_buddy *buddy, uint32_t index) {
    kva_assert_internal(index < buddy->nblocks &&
                        (buddy->pages[index].state == KVA_BLOCK_USED || buddy->pages[index].state == KVA_BLOCK_SLAB));
    free_any_block(buddy, index);
    kva_assert_expensive(kva_buddy_check(buddy, NULL) == KVA_OK); /* after its merges */
}

uint32_t kva_buddy_block_of(const kva_buddy *buddy, uint32_t index) {
    /* Blocks are aligned to their size, so the containing head is index with some low bits
     * cleared: try each order's candidate from the smallest up. */
    for (unsigned k = 0; k < buddy->num_orders; k++) {
        uint32_t head = index & ~(((uint32_t)1 << k) - 1);
        const kva_page *page = &buddy->pages[head];
        if (page->state != KVA_BLOCK_NONE && index - head < kva_buddy_length(page)) return head;
    }
    return KVA_NIL; /* only reachable when the metadata is corrupt */
}
