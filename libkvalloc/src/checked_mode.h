/*
 * checked_mode.h — the checked mode of a host pool (kva_config.checked): poison in every free byte,
 * red zones around every allocation. The one place the library writes into the memory it
 * manages, which is why it is a debugging mode for host memory only.
 *
 * Invariant C1 (kva_check verifies it): every byte of a checked pool that belongs to no live
 * allocation holds KVA_POISON_FREE.
 * C2: no block is withheld. An allocation that finds a write after free in the block it would
 * hand out withholds that block (pool.h, quarantine) and reports KVA_ERR_CORRUPT; from then on
 * kva_check reports C2, since the program wrote through a freed pointer.
 */
#ifndef KVA_CHECKED_MODE_H
#define KVA_CHECKED_MODE_H

#include "internal.h"

/* Bytes before each allocation (its first 8 keep the requested size, inverted); the back red
 * zone runs from the last requested byte to the end of the block, at least as long. */
#define KVA_REDZONE 16
#define KVA_POISON_FREE 0xDD    /* in every free byte */
#define KVA_POISON_REDZONE 0xFD /* in the red zones of live allocations */

/* Fills n bytes with the free poison. */
void kva_poison(unsigned char *p, size_t n);

/* Whether n bytes hold `pattern`; if not, *bad is the offset of the first that does not. */
int kva_holds(const unsigned char *p, size_t n, unsigned char pattern, size_t *bad);

/* The checked pool's allocation: `alloc` (an unchecked allocation of the pool's) takes a block
 * for size and both red zones, which must still hold the free poison (else the block is
 * withheld and the call fails, KVA_ERR_CORRUPT); the size goes into the front red zone and *out
 * past it. */
kva_status kva_checked_alloc(kva_pool *pool, size_t size, void **out, kva_status (*alloc)(kva_pool *, size_t, void **));

/* The checked pool's free: the red zones verified (KVA_ERR_CORRUPT, the memory freed all the
 * same, when a write ran into one), the block poisoned and freed. */
kva_status kva_checked_free(kva_pool *pool, void *ptr);

/* kva_usable_size on a checked pool: the size asked for, 0 for what is no live allocation. */
size_t kva_checked_usable_size(kva_pool *pool, const void *ptr);

#endif
