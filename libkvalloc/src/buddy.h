/*
 * buddy.h — power-of-two blocks over the minimum-block indices [0, nblocks).
 *
 * Metadata is out of band: one 12-byte record per minimum block (the kernel's struct page
 * array is the model), indexed by offset >> min_shift. The managed memory is never touched.
 *
 * Invariants (kva_check verifies each):
 *  B1  The heads tile [0, nblocks): walking head -> head + length from 0 visits every block
 *      exactly once and ends at nblocks. A head is the record of a block's first minimum block;
 *      every other record is KVA_BLOCK_NONE. A free block's length is 1 << order; a USED or
 *      SLAB block's length is in its `next` field, at most 1 << order (an exact allocation
 *      keeps the front of its power-of-two block and has given the tail back).
 *  B2  A block of order k starts at an index that is a multiple of 1 << k.
 *  B3  A FREE block of order k is on free list k and on no other; list k is doubly linked
 *      (next->prev == self) and holds exactly free_count[k] blocks.
 *  B4  Bit k of nonempty is set iff free list k is not empty.
 *  B5  No two free buddies of the same order coexist: freeing always merges as far as it can.
 *  B6  free_units and used_units equal the minimum blocks in FREE and in USED/SLAB blocks.
 *  B7  peak_used_units >= used_units.
 */
#ifndef KVA_BUDDY_H
#define KVA_BUDDY_H

#include "internal.h"

enum {
    KVA_BLOCK_NONE = 0, /* not a head: inside some larger block */
    KVA_BLOCK_FREE = 1,
    KVA_BLOCK_USED = 2, /* handed out by kva_alloc */
    KVA_BLOCK_SLAB = 3  /* a slab chunk, owned by the slab layer */
};

typedef struct kva_page {
    uint32_t prev; /* free-list link, meaningful while state == KVA_BLOCK_FREE */
    uint32_t next; /* FREE: free-list link; USED or SLAB: the length in minimum blocks */
    uint8_t state;
    uint8_t order;
    uint16_t reserved;
} kva_page;

typedef struct kva_buddy {
    kva_page *pages;
    uint32_t nblocks;    /* minimum blocks managed */
    unsigned min_shift;  /* log2(min_block) */
    unsigned num_orders; /* orders 0 .. num_orders-1 exist */
    uint64_t nonempty;   /* bit k: free list k is not empty */
    uint32_t free_head[KVA_MAX_ORDERS];
    uint64_t free_count[KVA_MAX_ORDERS];
    uint64_t free_units; /* minimum blocks in free blocks */
    uint64_t used_units; /* minimum blocks in USED and SLAB blocks */
    /* the most used_units after any allocation since creation or kva_reset_peaks (B7) */
    uint64_t peak_used_units;
    size_t pages_bytes; /* size of the pages mapping */
} kva_buddy;

/* Builds the metadata for nblocks minimum blocks (>= 1, < 2^32) with orders 0 .. num_orders-1
 * (1 <= num_orders <= log2(nblocks) + 1: fewer where the region's base is aligned to less than
 * the largest block that would fit), and covers them with maximal aligned free blocks. */
kva_status kva_buddy_init(kva_buddy *buddy, uint32_t nblocks, unsigned min_shift, unsigned num_orders);
void kva_buddy_fini(kva_buddy *buddy);

/* Takes a block of the given order, marks its head with state (USED or SLAB) and returns its
 * head index, or KVA_NIL if no free block of that order or above exists. */
uint32_t kva_buddy_alloc(kva_buddy *buddy, unsigned order, uint8_t state);

/* As kva_buddy_alloc(order, USED), then keeps only the first `units` minimum blocks
 * (1 <= units <= 1 << order) and frees the rest at once. */
uint32_t kva_buddy_alloc_exact(kva_buddy *buddy, unsigned order, uint32_t units);

/* Returns the block headed at index (state USED or SLAB, checked by the caller), merging it
 * with free buddies as far as possible. */
void kva_buddy_free(kva_buddy *buddy, uint32_t index);

/* The length of a block in minimum blocks. */
KVA_INLINE uint32_t kva_buddy_length(const kva_page *page) {
    return page->state == KVA_BLOCK_FREE ? (uint32_t)1 << page->order : page->next;
}

/* The head of the block containing minimum block index (index < nblocks). O(num_orders); for
 * error paths and introspection, not for the hot path. */
uint32_t kva_buddy_block_of(const kva_buddy *buddy, uint32_t index);

/* Walks B1-B6 (buddy_check.c): KVA_OK, or KVA_ERR_CORRUPT naming the first one broken. With
 * used_blocks, counts the USED blocks there (kva_check's P3). The caller holds the pool lock. */
kva_status kva_buddy_check(const kva_buddy *buddy, uint64_t *used_blocks);

/* The smallest order whose block holds size bytes; num_orders if none does. */
KVA_INLINE unsigned kva_buddy_order_for(const kva_buddy *buddy, size_t size) {
    size_t blocks = (size + ((size_t)1 << buddy->min_shift) - 1) >> buddy->min_shift;
    unsigned order = blocks <= 1 ? 0 : kva_log2(blocks - 1) + 1;
    return order < buddy->num_orders ? order : buddy->num_orders;
}

#endif
