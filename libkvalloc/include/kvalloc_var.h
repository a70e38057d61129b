/*
 * kvalloc_var.h — the variable-size pools of libkvalloc, public part. kvalloc.h includes it, so a
 * program includes either; every name is kva_var_*, and the statuses and the pool are kvalloc.h's.
 */
#ifndef KVALLOC_VAR_H
#define KVALLOC_VAR_H

#include "kvalloc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------ */
/* Variable-size pools                                                                        */
/* ------------------------------------------------------------------------------------------ */

/*
 * A variable-size pool hands out ranges of exactly the size asked for, rounded up to its
 * alignment (256 B by default, the GPU convention), from one contiguous region, under a policy
 * chosen at creation. Freed ranges merge with free neighbours at once. As in a kva_pool, every
 * boundary tag lives in host arrays beside the region: the managed memory is never touched, so
 * it may be GPU memory. The region is one kva_alloc_exact from a kva_pool, so a variable-size
 * pool manages any backing a pool has (host pages, THP, hugetlb, CUDA).
 *
 * Errors follow the pool's rules: a status from every call, a failed call changes nothing and
 * leaves its out-parameters untouched, kva_last_error() says why.
 *
 * Thread safety: every function may be called from any number of threads at once. Each
 * variable-size pool has one lock, held for the whole of kva_var_alloc, kva_var_free,
 * kva_var_usable_size, kva_var_get_stats and kva_var_check. It is biased to the thread that
 * keeps taking it: after 256 acquisitions in a row by one thread, that thread enters with plain
 * loads and stores, and another thread that then wants it pays one membarrier system call to
 * revoke the bias (a lock that changes hands all the time stays an atomic exchange and a store
 * per call); kva_var_base reads the region's start, fixed at creation, without
 * it. kva_var_destroy must not overlap any other call on the same pool (nor may one start after
 * it). The backing pool is called only at create and destroy, and other threads may use it
 * meanwhile.
 *
 * Fork: in a child forked from the creator of a variable-size pool over shared memory
 * (kva_config.shared), the pool is a copy over the creator's bytes: kva_var_alloc and
 * kva_var_free return KVA_ERR_BACKEND there; the queries answer (kvalloc.h, shared).
 */

typedef struct kva_var kva_var;

typedef enum kva_var_policy {
    KVA_VAR_TLSF = 0, /* two-level segregated fit: O(1) alloc and free, a good fit */
    /* lowest address that fits: O(free ranges) alloc; a free with no free neighbour walks back over
     * the ranges before it */
    KVA_VAR_FIRST_FIT = 1,
    /* smallest free range that fits (lowest address among equals): O(free ranges) alloc and free */
    KVA_VAR_BEST_FIT = 2,
    /* largest free range: O(free ranges) alloc and free (a split's remainder is reinserted in
     * length order) */
    KVA_VAR_WORST_FIT = 3
} kva_var_policy;

typedef struct kva_var_config {
    size_t capacity; /* bytes managed, rounded down to alignment. Default 64 MiB */
    /* every range's start and size are multiples of it: a power of two in [16 B, 1 GiB]. Default
     * 256. capacity / alignment < 2^31 */
    size_t alignment;
    kva_var_policy policy; /* default KVA_VAR_TLSF */
    /* pages of the pool created when none is given. Default THP; where this process gets no
     * transparent huge pages, THP means base pages here. That pool's blocks are 4 KiB, or larger
     * from 16 TiB up (a pool holds fewer than 2^32 blocks) */
    kva_page_mode pages;
} kva_var_config;

/* Fills every field of *cfg with its default. */
KVA_API void kva_var_config_init(kva_var_config *cfg);

/* Creates a variable-size pool over one kva_alloc_exact of cfg->capacity from backing; with
 * backing NULL it creates a host pool for itself (of the next power of two above the capacity;
 * the tail is never touched) and destroys it with the variable-size pool. Host metadata: 16 B
 * per alignment unit of address space, resident only where ranges start. Errors: KVA_ERR_INVALID
 * (config; or an alignment above 16 over a checked backing pool, whose allocations start 16 B
 * past a red zone), KVA_ERR_NOMEM (the backing pool cannot hold the capacity, or host memory),
 * KVA_ERR_BACKEND. */
KVA_API kva_status kva_var_create(const kva_var_config *cfg, kva_pool *backing, kva_var **out);

/* The config of a pool to back the variable-size pool cfg describes, for a caller that creates
 * that pool itself (to choose its backend, NUMA node or checking, say) and passes it to
 * kva_var_create. Start from kva_config_init and set those fields in *pool first; this sets
 * three: capacity, the power of two (at least 1 MiB) whose one block holds the range (the
 * capacity rounded down to the alignment), and the two red zones around it when pool->checked;
 * min_block, raised from pool->min_block where the pool would otherwise have 2^32 blocks or
 * more (from 16 TiB up with 4 KiB blocks); pages, cfg->pages for a host pool, except base pages
 * for KVA_PAGES_THP where this process gets no transparent huge pages (a CUDA pool's pages are
 * left as they are). The rest of cfg is kva_var_create's to check. Errors: KVA_ERR_INVALID
 * (NULL, an unknown page mode, a range no pool can hold: more than 2^57 bytes), *pool then
 * unchanged. */
KVA_API kva_status kva_var_backing_config(const kva_var_config *cfg, kva_config *pool);

/* Gives the region back to its pool (destroying the pool if it was created here). Outstanding
 * ranges become invalid. NULL is ignored. No other call on this pool may be running or start
 * afterwards. */
KVA_API void kva_var_destroy(kva_var *var);

/* Allocates size bytes, rounded up to the alignment. Errors: KVA_ERR_INVALID (NULL var or out,
 * size 0, size beyond the capacity), KVA_ERR_NOMEM (no free range holds it now). */
KVA_API kva_status kva_var_alloc(kva_var *var, size_t size, void **out);

/* Frees a range; no size is needed. Errors: KVA_ERR_INVALID (NULL var or ptr),
 * KVA_ERR_DOUBLE_FREE (ptr lies in free memory), KVA_ERR_BAD_POINTER (outside the region, or
 * inside a live range but not at its start). On error nothing changes. */
KVA_API kva_status kva_var_free(kva_var *var, void *ptr);

/* The usable size of a live range (its rounded size); 0 if ptr is not the start of one. */
KVA_API size_t kva_var_usable_size(kva_var *var, const void *ptr);

/* The start of the region. In a CUDA-backed pool it is a device address. */
KVA_API kva_status kva_var_base(kva_var *var, void **base);

typedef struct kva_var_stats {
    size_t capacity; /* bytes managed */
    size_t alignment;
    uint32_t policy; /* kva_var_policy */
    uint32_t reserved;
    size_t bytes_used;      /* rounded sizes of the live ranges */
    size_t bytes_requested; /* sizes asked for by the live ranges */
    size_t internal_waste;  /* bytes_used - bytes_requested: the alignment rounding */
    size_t bytes_free;
    size_t largest_free;  /* the largest free range */
    double fragmentation; /* 1 - largest_free / bytes_free (0 when nothing is free) */
    uint64_t free_ranges;
    uint64_t live_allocations;
    uint64_t alloc_count;    /* successful allocations since creation */
    uint64_t free_count;     /* successful frees since creation */
    uint64_t alloc_failures; /* allocations that returned KVA_ERR_NOMEM */
    uint64_t rejected_calls; /* calls that returned INVALID, DOUBLE_FREE or BAD_POINTER */
    size_t metadata_bytes;   /* host bytes of bookkeeping reserved (committed lazily) */
    /* the most bytes_used at once since creation or the last kva_var_reset_peaks */
    size_t peak_bytes_used;
} kva_var_stats;

/* A snapshot of the statistics. O(1) for best and worst fit; first fit walks its free list,
 * TLSF the list of its largest size class. */
KVA_API kva_status kva_var_get_stats(kva_var *var, kva_var_stats *out);

/* Starts peak_bytes_used afresh from bytes_used as it stands. KVA_ERR_INVALID for a NULL pool. */
KVA_API kva_status kva_var_reset_peaks(kva_var *var);

/* Walks every invariant of the metadata (see var_pool.h): KVA_OK or KVA_ERR_CORRUPT naming the
 * first one broken. O(capacity / alignment); not for hot paths. */
KVA_API kva_status kva_var_check(kva_var *var);

/* sizeof kva_var_config (which 1) and kva_var_stats (2) as built; 0 for another id. */
KVA_API size_t kva_var_struct_size(int which);

#ifdef __cplusplus
}
#endif

#endif /* KVALLOC_VAR_H */
