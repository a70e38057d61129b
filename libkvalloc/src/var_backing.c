/*
 * var_backing.c — the pool to back a variable-size pool, for a caller that makes that pool
 * itself (to pick its backend, NUMA node or checking): how large, in which blocks, on which
 * pages (kva_var_backing_config). The sizes are those kva_var_create gives the pool it makes
 * when it is given none (var_pool.c, create_own_pool).
 */
#include <stdint.h>

#include "checked_mode.h"
#include "config.h"
#include "internal.h"
#include "os.h"

/* The smallest backing pool: a variable-size pool of a few KiB still gets a pool of the size
 * the slab layer is tuned for. */
#define SMALLEST_BACKING ((size_t)1 << 20)

kva_status kva_var_backing_config(const kva_var_config *cfg, kva_config *pool) {
    if (!cfg || !pool) return kva_fail(KVA_ERR_INVALID, "config is NULL");
    if ((unsigned)cfg->pages > KVA_PAGES_SMALL)
        return kva_fail(KVA_ERR_INVALID, "unknown page mode %d", (int)cfg->pages);
    /* The range kva_var_create takes: the capacity rounded down to the alignment (an alignment
     * that is no power of two is kva_var_create's to refuse). */
    size_t bytes = cfg->capacity;
    if (kva_is_pow2(cfg->alignment)) bytes &= ~(cfg->alignment - 1);
    /* A checked pool puts a red zone before and after the range, inside the same block. */
    size_t red_zones = pool->checked ? 2 * (size_t)KVA_REDZONE : 0;
    if (bytes > SIZE_MAX - red_zones)
        return kva_fail(KVA_ERR_INVALID, "capacity %zu is more than a pool can hold", cfg->capacity);
    size_t need = bytes + red_zones;
    /* One buddy block holds the range: the next power of two. Only the range is ever touched,
     * so with transparent huge pages or base pages the rest is address space. */
    size_t capacity = SMALLEST_BACKING;
    while (capacity < need) {
        if (capacity > SIZE_MAX / 2)
            return kva_fail(KVA_ERR_INVALID, "capacity %zu is more than a pool can hold", cfg->capacity);
        capacity <<= 1;
    }
    /* Larger blocks where the pool's u32 block indices need them (from 16 TiB up with 4 KiB
     * blocks): the caller asked for a range, not for this pool's block size. From 2^58 bytes
     * up, even the largest blocks number 2^32: no pool holds the range. */
    size_t min_block = pool->min_block;
    if (kva_is_pow2(min_block)) {
        while ((capacity >> kva_log2(min_block)) >= KVA_NIL && min_block < KVA_MIN_BLOCK_MAX) min_block <<= 1;
        if ((capacity >> kva_log2(min_block)) >= KVA_NIL)
            return kva_fail(KVA_ERR_INVALID, "capacity %zu is more than a pool can hold", cfg->capacity);
    }
    /* Transparent huge pages are a preference here: where this process gets none, base pages.
     * A CUDA pool keeps its pages as they are (it takes only KVA_PAGES_AUTO). */
    kva_page_mode pages = pool->pages;
    if (pool->backend == KVA_BACKEND_HOST) {
        pages = cfg->pages;
        if (pages == KVA_PAGES_THP && kva_os_thp_unavailable()) pages = KVA_PAGES_SMALL;
    }
    pool->capacity = capacity;
    pool->min_block = min_block;
    pool->pages = pages;
    return KVA_OK;
}
