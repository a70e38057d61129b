/*
 * config.h — validation of a kva_config into the derived geometry a pool is built from.
 */
#ifndef KVA_CONFIG_H
#define KVA_CONFIG_H

#include "internal.h"

/* The largest slab, and so the largest min_block (a slab is at least one block): a slab's
 * offsets stay below 2^32 (kva_div_exact). */
#define KVA_SLAB_CHUNK_MAX ((size_t)64 << 20)
#define KVA_MIN_BLOCK_MAX KVA_SLAB_CHUNK_MAX

typedef struct kva_geometry {
    size_t capacity;  /* bytes managed: config capacity rounded down to min_block */
    uint32_t nblocks; /* minimum blocks */
    unsigned min_shift;
    unsigned chunk_shift;
    /* buddy orders: log2(nblocks) + 1, fewer for an external range whose base is aligned to less
     * than the largest block that would fit (pool.h, P1) */
    unsigned num_orders;
} kva_geometry;

/* Checks every field of cfg; KVA_ERR_INVALID naming the first bad one, else fills *out. */
kva_status kva_config_validate(const kva_config *cfg, kva_geometry *out);

#endif
