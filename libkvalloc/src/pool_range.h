/*
 * pool_range.h — giving back, and taking again, the memory behind part of a live allocation:
 * what the KV cache's trim does with the free tail of its memory after compaction.
 *
 * Work is in whole units of kva_pool_range_unit: CUDA granules (unmapped and released to the
 * driver, mapped again on demand) or host pages (discarded: the kernel takes them back and a
 * later touch gets zeroed ones; in a shared pool the object's pages are freed, for every process
 * that maps them). A pool whose memory must stay put (a prefaulted CUDA pool, a
 * locked or pinned host region) has unit 0: nothing is given back.
 */
#ifndef KVA_POOL_RANGE_H
#define KVA_POOL_RANGE_H

#include <stddef.h>

#include "internal.h"

/* The unit ranges must be aligned to, or 0 if this pool gives nothing back. */
size_t kva_pool_range_unit(kva_pool *pool);

/* [start, start + length), unit aligned, inside one live allocation: its memory goes back.
 * The allocation may be freed with ranges given back: its free forgets them. */
kva_status kva_pool_range_release(kva_pool *pool, void *start, size_t length);

/* Whether the pool's memory is host memory shared with other processes (kva_config.shared): a
 * child forked from its owner then holds a copy of the owner's allocator over the owner's bytes,
 * and a cache over the pool a copy of the owner's cache (kv_lock_to_change). */
int kva_pool_range_shared(const kva_pool *pool);

/* The memory of a range given back earlier is backed again. Fails (KVA_ERR_NOMEM or
 * KVA_ERR_BACKEND from the driver) with the range still given back. */
kva_status kva_pool_range_take(kva_pool *pool, void *start, size_t length);

#endif
