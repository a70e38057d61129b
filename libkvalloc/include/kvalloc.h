/*
 * kvalloc.h — the one public header of libkvalloc.
 *
 * libkvalloc manages one contiguous region of memory (the "pool") for the KV cache of an LLM
 * inference engine. Large requests are served by a buddy allocator in power-of-two blocks;
 * small ones (16 B .. 64 KiB) by slabs carved from buddy chunks.
 *
 * Design rules a caller can rely on:
 *  - No metadata is ever written into the managed memory. All bookkeeping lives in host-side
 *    arrays beside the pool, so the same code can manage memory the CPU cannot touch.
 *  - Every entry point returns a kva_status. The library never aborts and never prints.
 *    A call that fails leaves the pool exactly as it was and leaves every out-parameter
 *    untouched; kva_last_error() then describes the failure in words.
 *  - Once a pool exists, allocation and free make no system call and take no lock.
 *
 * Thread safety: a pool is not yet safe for concurrent use; callers serialize access to one
 * pool (different pools are independent). Per-CPU arenas and thread caches lift this.
 */
#ifndef KVALLOC_H
#define KVALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVA_BUILDING_LIBRARY)
#define KVA_API __attribute__((visibility("default")))
#else
#define KVA_API
#endif

#define KVA_VERSION_MAJOR 0
#define KVA_VERSION_MINOR 1
#define KVA_VERSION_PATCH 0

/* ------------------------------------------------------------------------------------------ */
/* Statuses                                                                                   */
/* ------------------------------------------------------------------------------------------ */

typedef enum kva_status {
    KVA_OK = 0,
    KVA_ERR_NOMEM = 1,       /* not enough free memory in the pool right now */
    KVA_ERR_INVALID = 2,     /* bad argument or config: NULL pool, size 0, size the pool can
                                never hold, min_block not a power of two, ... */
    KVA_ERR_DOUBLE_FREE = 3, /* the address lies in memory that is already free */
    KVA_ERR_BAD_POINTER = 4, /* not an address this pool handed out: outside the pool, or
                                inside a live allocation but not at its start */
    KVA_ERR_BACKEND = 5,     /* the backing memory could not be obtained (mmap, hugetlb, ...) */
    KVA_ERR_CORRUPT = 6      /* kva_check found a broken invariant; see kva_last_error() */
} kva_status;

/* A static, human-readable name for a status ("out of memory", ...). Never NULL. */
KVA_API const char *kva_strerror(kva_status status);

/* Details of the most recent failed call made by this thread (for example which invariant
 * kva_check found broken, or which mmap flag the kernel refused). Empty string if none.
 * The text stays valid until this thread's next failing call. */
KVA_API const char *kva_last_error(void);

/* ------------------------------------------------------------------------------------------ */
/* Configuration                                                                              */
/* ------------------------------------------------------------------------------------------ */

/* How the host region is backed. */
typedef enum kva_page_mode {
    KVA_PAGES_AUTO = 0,    /* try 2 MiB hugetlb, then transparent huge pages, then 4 KiB */
    KVA_PAGES_HUGETLB = 1, /* hugetlb 2 MiB pages only; KVA_ERR_BACKEND if none are available */
    KVA_PAGES_THP = 2,     /* normal mapping advised MADV_HUGEPAGE */
    KVA_PAGES_SMALL = 3    /* normal pages, no advice */
} kva_page_mode;

/* Which page size actually backs a pool (reported in kva_stats.page_kind). */
typedef enum kva_page_kind {
    KVA_PAGE_KIND_HUGETLB = 1,
    KVA_PAGE_KIND_THP = 2,
    KVA_PAGE_KIND_SMALL = 3
} kva_page_kind;

#define KVA_NAME_MAX 63 /* longest pool name, bytes; names use [A-Za-z0-9_.-] */

typedef struct kva_config {
    size_t capacity;     /* bytes managed. Not rounded up; a tail smaller than min_block is
                            left unused. Default 64 MiB. */
    size_t min_block;    /* smallest buddy block, a power of two in [256 B, 1 GiB].
                            Default 4 KiB. */
    size_t slab_chunk;   /* bytes of one slab, taken from the buddy: a power of two in
                            [64 KiB, 64 MiB] and at least min_block. Default 0: automatic,
                            2 MiB, or less in a pool under 64 MiB (capacity / 32, at least
                            64 KiB) so that a small pool still holds slabs of many classes. */
    const char *name;    /* optional pool name (copied); NULL for an anonymous pool. A named
                            pool publishes live statistics in shared memory (kvalloc_stats.h) */
    kva_page_mode pages; /* default KVA_PAGES_AUTO */
    int prefault;        /* nonzero: take every first-touch page fault at creation */
    int trace;           /* nonzero (named pools): time every call and record it in the trace
                            ring. Off by default: then only failed and rejected calls are
                            recorded, and the fast paths cost nothing extra */
    unsigned publish_interval_ms; /* named pools: at most this long between publishes while the
                                     pool is used (default 200); see kva_stats_publish */
} kva_config;

/* Fills every field of *cfg with its default. */
KVA_API void kva_config_init(kva_config *cfg);

/* ------------------------------------------------------------------------------------------ */
/* Version and ABI                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* "MAJOR.MINOR.PATCH" of the library actually loaded. */
KVA_API const char *kva_version(void);

typedef enum kva_struct_id {
    KVA_STRUCT_CONFIG = 1,
    KVA_STRUCT_STATS = 2,
    KVA_STRUCT_CLASS_STATS = 3
} kva_struct_id;

/* sizeof the public struct as this library was built, 0 for an unknown id: a binding that
 * mirrors the structs checks them before the first call, instead of corrupting memory when it
 * loads a library of another version. */
KVA_API size_t kva_struct_size(kva_struct_id which);

/* ------------------------------------------------------------------------------------------ */
/* Pools                                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef struct kva_pool kva_pool;

/* Validates cfg, maps the region and builds the metadata. On failure *out is untouched. */
KVA_API kva_status kva_pool_create(const kva_config *cfg, kva_pool **out);

/* Unmaps the region and releases all metadata. Outstanding allocations become invalid.
 * NULL is accepted and ignored. */
KVA_API void kva_pool_destroy(kva_pool *pool);

/* Allocates size bytes. Sizes up to KVA_SLAB_MAX_SIZE come from slabs and are aligned to the
 * largest power of two dividing their size class (at least 16 B for sizes above 48 B, at
 * least 4 B for all); larger sizes get a buddy block aligned to its own power-of-two size.
 * Errors: KVA_ERR_INVALID (NULL pool or out, size 0, size larger than the largest block this
 * pool can ever hold), KVA_ERR_NOMEM (fits in principle, not now). */
KVA_API kva_status kva_alloc(kva_pool *pool, size_t size, void **out);

/* As kva_alloc, with the address a multiple of alignment (a power of two no larger than the
 * largest block, kva_stats.max_alloc_size). */
KVA_API kva_status kva_alloc_aligned(kva_pool *pool, size_t size, size_t alignment, void **out);

/* A contiguous range of size bytes rounded up only to min_block (not to a power of two): the
 * buddy block that holds it is split and the unused tail is free at once (Linux's
 * alloc_pages_exact). For large regions whose size is not a power of two, such as one layer of a
 * KV cache. The start is aligned to the power of two above size. Freed with kva_free; its usable
 * size is the rounded size. Errors as kva_alloc. */
KVA_API kva_status kva_alloc_exact(kva_pool *pool, size_t size, void **out);

/* Frees an allocation; no size is needed. Errors: KVA_ERR_INVALID (NULL pool or ptr),
 * KVA_ERR_DOUBLE_FREE, KVA_ERR_BAD_POINTER. On error nothing changes. */
KVA_API kva_status kva_free(kva_pool *pool, void *ptr);

/* The usable size of a live allocation (its size class or block size); 0 if ptr is not the
 * start of a live allocation of this pool. */
KVA_API size_t kva_usable_size(kva_pool *pool, const void *ptr);

/* Returns every empty slab to the buddy, including the one spare each size class keeps. */
KVA_API kva_status kva_trim(kva_pool *pool);

/* Walks every invariant of the pool's metadata. KVA_OK, or KVA_ERR_CORRUPT with the first
 * broken invariant named in kva_last_error(). Cost grows with the pool; not for hot paths. */
KVA_API kva_status kva_check(kva_pool *pool);

/* The start of the managed region (offset 0). Useful to turn addresses into offsets. */
KVA_API kva_status kva_pool_base(kva_pool *pool, void **base);

/* ------------------------------------------------------------------------------------------ */
/* Statistics                                                                                 */
/* ------------------------------------------------------------------------------------------ */

#define KVA_MAX_ORDERS 48    /* buddy orders 0 .. KVA_MAX_ORDERS-1 (block = min_block << order) */
#define KVA_NUM_SIZE_CLASSES 49
#define KVA_SLAB_MIN_SIZE 16
#define KVA_SLAB_MAX_SIZE 65536

typedef struct kva_stats {
    size_t capacity;           /* bytes managed (config capacity rounded down to min_block) */
    size_t min_block;
    size_t slab_chunk;
    size_t max_alloc_size;     /* the largest request that can ever succeed */
    size_t bytes_in_use;       /* usable bytes of live allocations (class or block sizes) */
    size_t bytes_free;         /* bytes in free buddy blocks */
    size_t slab_bytes;         /* bytes of buddy chunks currently held by slabs */
    size_t slab_free_bytes;    /* free object space inside those slabs */
    size_t largest_free;       /* the largest free buddy block */
    double fragmentation;      /* 1 - largest_free / bytes_free (0 when nothing is free) */
    uint32_t num_orders;       /* orders in use: 0 .. num_orders-1 */
    uint64_t free_blocks[KVA_MAX_ORDERS]; /* free buddy blocks per order */
    uint64_t live_allocations;
    uint64_t alloc_count;      /* successful allocations since creation */
    uint64_t free_count;       /* successful frees since creation */
    uint64_t alloc_failures;   /* allocations that returned KVA_ERR_NOMEM */
    uint64_t rejected_calls;   /* calls that returned INVALID, DOUBLE_FREE or BAD_POINTER */
    uint64_t slab_count;       /* live slabs */
    kva_page_kind page_kind;   /* what actually backs the region */
    size_t page_size;          /* its page size in bytes */
    size_t metadata_bytes;     /* host bytes of bookkeeping in use (resident part) */
} kva_stats;

KVA_API kva_status kva_get_stats(kva_pool *pool, kva_stats *out);

/* Publishes the pool's state to its shared-memory segment now (named pools; a no-op for an
 * anonymous pool). Publishing also happens by itself from the pool's slow paths, at most every
 * publish_interval_ms; an engine whose calls all take fast paths calls this now and then (for
 * example once per scheduler step) to keep the inspector current. */
KVA_API kva_status kva_stats_publish(kva_pool *pool);

/* The shared-memory name of a named pool's segment ("/kvalloc.<pid>.<name>"), or NULL. */
KVA_API const char *kva_stats_segment_name(kva_pool *pool);

/* Per size class figures. */
typedef struct kva_class_stats {
    uint32_t object_size;
    uint32_t objects_per_slab;
    uint64_t live_objects;
    uint64_t slabs;
} kva_class_stats;

/* The object size of size class index (0 .. KVA_NUM_SIZE_CLASSES-1); 0 if out of range. */
KVA_API size_t kva_size_class_size(unsigned index);
/* The size class a request of size bytes falls in; -1 if size is 0 or above
 * KVA_SLAB_MAX_SIZE. */
KVA_API int kva_size_class_of(size_t size);
KVA_API kva_status kva_get_class_stats(kva_pool *pool, unsigned index, kva_class_stats *out);

/* ------------------------------------------------------------------------------------------ */
/* Heap walk                                                                                  */
/* ------------------------------------------------------------------------------------------ */

typedef enum kva_walk_kind {
    KVA_WALK_FREE = 0,        /* a free buddy block */
    KVA_WALK_BLOCK = 1,       /* a live buddy allocation */
    KVA_WALK_SLAB_OBJECT = 2, /* a live slab object */
    KVA_WALK_SLAB_FREE = 3    /* a run of free objects inside a slab */
} kva_walk_kind;

/* Called once per region of the heap in address order; offset and size are in bytes from the
 * pool base. Return nonzero to stop the walk early. */
typedef int (*kva_walk_fn)(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx);

/* Visits every live allocation and every free range. The pool must not change during the
 * walk (the callback must not allocate or free in it). */
KVA_API kva_status kva_walk(kva_pool *pool, kva_walk_fn fn, void *ctx);

#ifdef __cplusplus
}
#endif

#endif /* KVALLOC_H */
