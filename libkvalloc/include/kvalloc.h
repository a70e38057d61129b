/*
 * kvalloc.h — the public header of libkvalloc. The KV-cache manager's part is kvalloc_kv.h and the
 * variable-size pools' is kvalloc_var.h; it includes both.
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
 *    untouched; kva_last_error() then describes the failure in words. (One call says so where
 *    it differs: kva_kv_compact's sizing answer comes with KVA_ERR_NOMEM.)
 *  - Once a host pool exists, allocation and free make no system call (a lock waited for,
 *    on a slow path, is one exception: a futex wait; on a host with several NUMA nodes, an
 *    arena's slab growth binds a chunk to the arena's node the first time, one mbind per chunk
 *    and node, is the other). A CUDA pool calls the driver only
 *    from its slow paths: to map device memory when a block or a new slab first needs it, and
 *    to unmap it (kva_trim, trim_watermark).
 *
 * Thread safety: every entry point may be called from any number of threads at once, except
 * kva_pool_destroy, which must not overlap any other call on the same pool. The
 * allocation and free fast paths touch only the calling thread's cache (bitmap words of slab
 * objects it owns, see kva_thread_flush): no lock, no atomic read-modify-write, no cache line
 * another core writes. Slow paths (once per up to 64 objects) lock one per-CPU arena; buddy
 * blocks and slab growth lock the pool. The KV manager and variable-size pools serialize their
 * calls with a lock of their own. A process may fork while other threads use a pool: the child
 * finds every pool lock free (what the other threads' caches held stays theirs). CUDA does not
 * survive fork: in a child, a CUDA pool or a pinned host pool of the parent makes no driver
 * call; what needs one (mapping or unmapping device memory) returns KVA_ERR_BACKEND, and
 * destroying it frees only what is the child's; a new CUDA or pinned pool is refused
 * (KVA_ERR_BACKEND) once an ancestor has loaded the driver. A shared host pool (kva_config.shared)
 * of the parent hands out and gives back nothing in the child (KVA_ERR_BACKEND): its memory is
 * the parent's.
 * Freeing one object from two threads at the same moment is the caller's race, and the one bad
 * input not always refused: both calls may return KVA_OK; the object is free once, counted
 * once, and never handed out twice (docs/reliability.md, "Known limits", says what is left).
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
    KVA_ERR_NOMEM = 1, /* not enough free memory in the pool right now */
    /* bad argument or config: NULL pool, size 0, size the pool can never hold, min_block not a
     * power of two, ... */
    KVA_ERR_INVALID = 2,
    KVA_ERR_DOUBLE_FREE = 3, /* the address lies in memory that is already free */
    /* not an address this pool handed out: outside the pool, or inside a live allocation but not at
     * its start */
    KVA_ERR_BAD_POINTER = 4,
    KVA_ERR_BACKEND = 5, /* the backing memory could not be obtained (mmap, hugetlb, ...) */
    KVA_ERR_CORRUPT = 6  /* kva_check found a broken invariant; see kva_last_error() */
} kva_status;

/* A static, human-readable name for a status ("out of memory", ...). Never NULL. */
KVA_API const char *kva_strerror(kva_status status);

/* Details of the most recent failure this thread met (for example which invariant kva_check
 * found broken, or which mmap flag the kernel refused); empty string if none. Read it after a
 * call returned a status other than KVA_OK: like errno, a successful call does not clear it,
 * and one that recovered from a failed step (hugetlb refused, so transparent huge pages) leaves
 * that step's text. The text stays valid until this thread's next failure. */
KVA_API const char *kva_last_error(void);

/* ------------------------------------------------------------------------------------------ */
/* Configuration                                                                              */
/* ------------------------------------------------------------------------------------------ */

/* How the host region is backed. */
typedef enum kva_page_mode {
    KVA_PAGES_AUTO = 0,    /* try 2 MiB hugetlb, then transparent huge pages, then 4 KiB */
    KVA_PAGES_HUGETLB = 1, /* hugetlb 2 MiB pages only; KVA_ERR_BACKEND if none are available */
    /* normal mapping advised MADV_HUGEPAGE; KVA_ERR_BACKEND if this process gets no transparent
     * huge pages (sysfs enabled "never", prctl PR_SET_THP_DISABLE) */
    KVA_PAGES_THP = 2,
    KVA_PAGES_SMALL = 3 /* normal pages, no advice */
} kva_page_mode;

/* Which page size actually backs a pool (reported in kva_stats.page_kind). */
typedef enum kva_page_kind {
    KVA_PAGE_KIND_HUGETLB = 1,
    KVA_PAGE_KIND_THP = 2,
    KVA_PAGE_KIND_SMALL = 3,
    KVA_PAGE_KIND_DEVICE = 4, /* GPU memory (a CUDA pool); page_size is the mapping granularity */
    /* memory the caller owns (kva_config.external), host or device memory as the backend says;
     * page_size is the base page size the range was checked against */
    KVA_PAGE_KIND_EXTERNAL = 5
} kva_page_kind;

/* Where a pool's memory lives. */
typedef enum kva_backend {
    KVA_BACKEND_HOST = 0, /* host memory, mapped at creation */
    /* the memory of one GPU, through the CUDA driver's virtual memory management: the whole
     * capacity is a reserved range of device addresses, and physical memory is mapped into it on
     * demand in the device's allocation granularity (typically 2 MiB). The driver (libcuda.so.1, or
     * the library named by $KVA_CUDA_DRIVER) is loaded at run time: nothing of CUDA is needed to
     * build or for host pools. Addresses handed out are device addresses; the CPU must not touch
     * them, and the library never does. */
    KVA_BACKEND_CUDA = 1
} kva_backend;

/* How a host region is bound to its NUMA node. */
typedef enum kva_numa_policy {
    KVA_NUMA_BIND = 0,     /* pages only from that node (MPOL_BIND) */
    KVA_NUMA_PREFERRED = 1 /* pages from that node while it has free memory (MPOL_PREFERRED) */
} kva_numa_policy;

#define KVA_NAME_MAX 63 /* longest pool name, bytes; names use [A-Za-z0-9_.-] */

typedef struct kva_config {
    /* bytes managed. Not rounded up; a tail smaller than min_block is left unused. Default 64 MiB. */
    size_t capacity;
    /* smallest buddy block, a power of two in [256 B, 64 MiB] (a slab is at least one block).
     * Default 4 KiB. */
    size_t min_block;
    /* bytes of one slab, taken from the buddy: a power of two in [64 KiB, 64 MiB] and at least
     * min_block. Default 0: automatic, 2 MiB, or less in a pool under 64 MiB (capacity / 32, at
     * least 64 KiB) so that a small pool still holds slabs of many classes. A slab holds at most
     * 2^18 objects, so above 4 MiB the classes below slab_chunk / 2^18 bytes fill only part of
     * their slabs (16 B objects use 4 MiB of a 64 MiB slab; the rest stays in slab_bytes, neither
     * in use nor free). */
    size_t slab_chunk;
    /* optional pool name (copied); NULL for an anonymous pool. A named pool publishes live
     * statistics in shared memory (kvalloc_stats.h), so two live pools of one process cannot share
     * a name: the second is refused (KVA_ERR_INVALID) */
    const char *name;
    kva_page_mode pages; /* default KVA_PAGES_AUTO */
    /* nonzero: take every first-touch page fault at creation, the managed memory's and all of the
     * metadata's (kva_pool_create says how much of the metadata is faulted in without it) */
    int prefault;
    /* nonzero (named pools): time every call and record it in the trace ring. Off by default: then
     * only failed and rejected calls are recorded, and the fast paths cost nothing extra */
    int trace;
    /* named pools: the pool publishes its statistics on its own from its slow paths, at most this
     * often (default 200 ms); calls that stay on the fast paths never publish, so an engine also
     * calls kva_stats_publish now and then */
    unsigned publish_interval_ms;
    /* The backing memory. A field that does not apply to the backend (numa_node, lock, pin or
     * pages other than AUTO for CUDA; trim_watermark for host) is refused with KVA_ERR_INVALID. */
    kva_backend backend; /* default KVA_BACKEND_HOST */
    int device;          /* CUDA pools and pin: the GPU ordinal. Default 0 */
    /* host: bind the region to this NUMA node before any page is touched; KVA_ERR_INVALID if this
     * process cannot use the node. -1 (default): no policy, the kernel's first-touch placement */
    int numa_node;
    kva_numa_policy numa_policy; /* default KVA_NUMA_BIND */
    /* host: mlock the region, so every page is resident and never swapped (RLIMIT_MEMLOCK applies
     * to the capacity rounded up to whole pages: 4 KiB, or 2 MiB for hugetlb) */
    int lock;
    /* host: register the region with the CUDA driver (cuMemHostRegister) as page-locked memory that
     * copies to and from the GPU at full speed, an offload tier; KVA_ERR_BACKEND saying why if no
     * driver or GPU is there */
    int pin;
    /* CUDA: when more than this many bytes are mapped but used by no block, the free that passed it
     * unmaps the least recently idle granules down to it. 0 (default): only kva_trim unmaps. With
     * prefault everything stays mapped: prefault maps the whole capacity at creation for the pool's
     * life. Set, a kva_free may unmap device memory at once: free only what no queued kernel still
     * uses (as for kva_trim and kva_kv_trim, synchronize first) */
    size_t trim_watermark;
    /* host, for debugging: every free byte of the pool holds a poison pattern (the whole region is
     * written at creation); an allocation checks its memory is still poisoned and reports a write
     * after free (KVA_ERR_CORRUPT, and hands out nothing: the block is withheld as it is, never
     * handed out again, a free of it is a double free, and kva_check reports it from then on);
     * every allocation is given a 16-byte red zone before it and one from its last requested byte
     * to the end of its block, checked at free (KVA_ERR_CORRUPT naming the overrun; the memory is
     * freed all the same). kva_check also verifies the poison. Every call takes the checked path;
     * alignments above 16 are refused. Default 0 */
    int checked;
    /* per-CPU arenas the slabs are spread over, 1 .. KVA_MAX_ARENAS; a thread's slow paths use the
     * arena of the CPU it runs on. Default 0: one per CPU this process may run on */
    unsigned arenas;
    /* Memory the caller owns: the pool manages the blocks of [external, external + capacity), host
     * memory or (backend CUDA) device memory, with all its metadata beside it as always, and never
     * maps, unmaps, trims, discards, populates, binds, locks, registers, writes or frees that
     * range: it stays the caller's, and must outlive the pool. No driver is loaded for a CUDA
     * external pool. The rules (each refusal is KVA_ERR_INVALID, and nothing changes):
     *  - capacity (the range's length) is a multiple of the base page size, and the range does not
     *    wrap around the address space;
     *  - external is a multiple of the slab chunk, so at least of 64 KiB: with the automatic
     *    slab_chunk the chunk shrinks to the range's alignment (down to 64 KiB). The largest block
     *    is the largest power of two that divides external (and fits the capacity), so that every
     *    block is aligned to its size in absolute addresses as in any pool: a 2 MiB-aligned range
     *    hands out blocks of at most 2 MiB (kva_stats.max_alloc_size says it);
     *  - pages (other than AUTO), prefault, lock, pin, numa_node, trim_watermark, checked and
     *    shared do not apply;
     *  - the range overlaps no other live external pool's range in this process (the library
     *    keeps a registry of them; a range of memory is one pool's).
     * kva_stats reports page_kind KVA_PAGE_KIND_EXTERNAL and mapped_bytes the whole range.
     * Default NULL: the library maps the memory itself */
    void *external;
    /* Memory another process can map. Host: the region is a shared memory object (a memfd,
     * sealed against growing and shrinking) instead of private memory, with the same page
     * choices (hugetlb memfd, transparent huge pages where
     * /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them, base pages), NUMA binding,
     * prefault, lock and pin. CUDA: the whole capacity is one allocation made shareable by POSIX
     * file descriptor (and GPUDirect RDMA capable where the device reports
     * CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED), mapped at creation and for the
     * pool's life as with prefault; KVA_ERR_BACKEND where the driver or device cannot share.
     * kva_pool_shared_fd exports a descriptor, which another process passes to
     * kva_shared_attach (host) or kva_shared_attach_cuda to map the same memory at its own
     * address: the blocks are the same at the same offsets. Allocation stays with the owning
     * process (the metadata is its own); attached processes read and write the contents of
     * blocks the owner told them about, by offset. A child forked from the owner inherits the
     * memory and a copy of the allocator: there every call that would hand out or give back the
     * memory (allocations, frees, kva_trim), and every call that would change a KV cache or a
     * variable-size pool over the pool, returns KVA_ERR_BACKEND, fast paths included, while
     * reading it and the figures works; the child maps the memory
     * with kva_shared_attach to use blocks by offset (docs/reliability.md, "Fork and shared
     * pools"). Not with external. Default 0 */
    int shared;
} kva_config;

#define KVA_MAX_ARENAS 256

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

/* Validates cfg, maps the region and builds the metadata. The metadata is faulted in at
 * creation, so that no call on the pool takes a page fault in it: the block records, then the
 * slab bitmaps, each while it fits in what is left of one share of the process's pools
 * together: 1/16 of the memory the process could still commit (the least of the kernel's
 * MemAvailable, the room under its memory cgroup's limit and physical memory); all of it with
 * prefault. Beyond that share metadata is committed as it is first used, so that a pool larger
 * than memory, or many pools, can still be made. At the defaults that is 2.26 % of the capacity resident
 * from creation (kva_stats.metadata_bytes), and 7-9 ms of the creation per GiB of capacity.
 * Without prefault, metadata the kernel (or a memory cgroup) will not commit now stays lazy and
 * the pool is made all the same. On failure *out is untouched and nothing is left mapped,
 * reserved or registered. Errors: KVA_ERR_INVALID (the config, a NUMA
 * node this process cannot use, a GPU ordinal that does not exist; an external range that breaks
 * its rules or overlaps another live pool's, kva_config.external), KVA_ERR_NOMEM (host memory
 * for the metadata; for prefault, lock or pin, host memory the kernel cannot back: such a pool is
 * counted by its overcommit accounting at once, where a pool touched lazily is not; GPU memory
 * for prefault), KVA_ERR_BACKEND (mmap, hugetlb, mbind, mlock; for a shared pool memfd_create,
 * ftruncate, the seals or the shared mapping; for CUDA: no driver, no GPU, a driver call
 * refused), each explained by kva_last_error(). An external pool maps, reserves and registers
 * nothing: its metadata is all it makes. */
KVA_API kva_status kva_pool_create(const kva_config *cfg, kva_pool **out);

/* Unmaps the region and releases all metadata. Outstanding allocations become invalid. An
 * external range is left as it is (still the caller's, with what was written in it) and free for
 * a new pool; a shared pool's memory stays with the processes that attached it until they
 * detach. NULL is accepted and ignored. No other call on this pool may be running or start afterwards;
 * other threads' caches of it are freed when those threads next look one up, or exit. */
KVA_API void kva_pool_destroy(kva_pool *pool);

/* Allocates size bytes. Sizes up to KVA_SLAB_MAX_SIZE come from slabs and are aligned to the
 * largest power of two dividing their size class (at least 16 B for sizes above 56 B, at
 * least 4 B for all); larger sizes get a buddy block aligned to its own power-of-two size.
 * Errors: KVA_ERR_INVALID (NULL pool or out, size 0, size larger than the largest block this
 * pool can ever hold), KVA_ERR_NOMEM (fits in principle, not now), KVA_ERR_BACKEND (a CUDA
 * pool whose driver refused to map the memory), KVA_ERR_CORRUPT (a checked pool found a write
 * after free in the memory it would hand out, and hands out nothing; kva_config.checked says
 * what becomes of that block). */
KVA_API kva_status kva_alloc(kva_pool *pool, size_t size, void **out);

/* As kva_alloc, with the address a multiple of alignment (a power of two no larger than the
 * largest block, kva_stats.max_alloc_size). */
KVA_API kva_status kva_alloc_aligned(kva_pool *pool, size_t size, size_t alignment, void **out);

/* An array of count elements of size bytes each (the calloc shape, without the zeroing: the
 * memory may be device memory). KVA_ERR_INVALID when count * size overflows, before anything
 * else happens; otherwise as kva_alloc(pool, count * size, out). */
KVA_API kva_status kva_alloc_array(kva_pool *pool, size_t count, size_t size, void **out);

/* A contiguous range of size bytes rounded up only to min_block (not to a power of two): the
 * buddy block that holds it is split and the unused tail is free at once (Linux's
 * alloc_pages_exact). For large regions whose size is not a power of two, such as one layer of a
 * KV cache. The start is aligned to the power of two above size (in a checked pool, 16 B past
 * that: the red zone comes first). Freed with kva_free; its usable size is the rounded size.
 * Errors as kva_alloc. */
KVA_API kva_status kva_alloc_exact(kva_pool *pool, size_t size, void **out);

/* Frees an allocation; no size is needed. Errors: KVA_ERR_INVALID (NULL pool or ptr),
 * KVA_ERR_DOUBLE_FREE, KVA_ERR_BAD_POINTER: on these nothing changes. In a checked pool,
 * KVA_ERR_CORRUPT when a red zone was overwritten: the memory is freed all the same. */
KVA_API kva_status kva_free(kva_pool *pool, void *ptr);

/* Returns the calling thread's cached free objects of this pool to their arenas, so that other
 * threads and large requests can use their memory. A thread's exit does this by itself, and so
 * does kva_trim for the thread that calls it; a thread that goes idle for long calls it.
 * What a cache may hold: per size class, words of up to 64 objects spanning at most 128 KiB, or
 * 4 words where that is more (32 words of 64 B objects; 4 words from 512 B up, e.g. 8 MiB of
 * 64 KiB objects), while the thread allocates that class; 1 word while it only frees it
 * (kva_stats.cached_bytes says how much is held). An allocation that finds no memory first flushes its own thread's cache and every
 * arena's spare slabs; what other threads' caches hold stays theirs until they allocate, free,
 * flush or exit. KVA_ERR_INVALID for a NULL pool. */
KVA_API kva_status kva_thread_flush(kva_pool *pool);

/* The usable size of a live allocation (its size class or block size; in a checked pool the
 * size asked for, since the red zone starts right after it); 0 if ptr is not the start of a
 * live allocation of this pool. */
KVA_API size_t kva_usable_size(kva_pool *pool, const void *ptr);

/* Returns every empty slab to the buddy, including the one spare each size class keeps; then,
 * in a CUDA pool, unmaps and releases every granule of device memory no live block touches:
 * kernels that may still use freed blocks must have finished (the device synchronized).
 * KVA_ERR_BACKEND if the driver refused to unmap (what it did unmap stays unmapped);
 * KVA_ERR_INVALID for a NULL pool. */
KVA_API kva_status kva_trim(kva_pool *pool);

/* Walks every invariant of the pool's metadata. KVA_OK, or KVA_ERR_CORRUPT with the first
 * broken invariant named in kva_last_error(); KVA_ERR_INVALID for a NULL pool, KVA_ERR_NOMEM if
 * there is no host memory for the walk's scratch. Cost grows with the pool; not for hot paths. */
KVA_API kva_status kva_check(kva_pool *pool);

/* The start of the managed region (offset 0). Useful to turn addresses into offsets. In a CUDA
 * pool it is a device address. KVA_ERR_INVALID for a NULL pool or base. */
KVA_API kva_status kva_pool_base(kva_pool *pool, void **base);

/* ------------------------------------------------------------------------------------------ */
/* Memory shared with other processes (kva_config.shared)                                      */
/* ------------------------------------------------------------------------------------------ */

/* A new descriptor (close on exec) of a shared pool's memory, for another process: send it over
 * a Unix socket (SCM_RIGHTS) or let a child inherit it; the caller closes it. For a host pool it
 * is the memory object, sealed (F_SEAL_GROW, F_SEAL_SHRINK, F_SEAL_SEAL): whoever holds the
 * descriptor can read and write the pool's memory but can never shrink it under the pool (a
 * SIGBUS in the owner) or grow it; the other process passes it to kva_shared_attach. For a CUDA
 * pool it is the allocation exported by the driver (cuMemExportToShareableHandle, a POSIX file
 * descriptor), for kva_shared_attach_cuda. Errors: KVA_ERR_INVALID (NULL pool or fd, a pool that
 * is not shared), KVA_ERR_BACKEND (no descriptor left: dup refused; the driver refused the
 * export, or the pool is a forked child's copy). */
KVA_API kva_status kva_pool_shared_fd(kva_pool *pool, int *fd);

/* A shared pool's memory mapped in this process. */
typedef struct kva_shared_map kva_shared_map;

/* Maps the shared pool memory that fd (from kva_pool_shared_fd, in this process or another)
 * describes, read-write, at an address of this process's choosing. The map is memory only: it
 * takes no part in the owner's allocator (its metadata stays in the owning process, which alone
 * allocates and frees); offset o of the owner's pool is kva_shared_base + o here. The fd is not
 * taken over: the caller may close it once this returns. The memory stays mapped, whatever the
 * owner does, until kva_shared_detach. Errors: KVA_ERR_INVALID (NULL out, a negative fd, or a
 * descriptor that is not a kvalloc shared pool: not a memfd this library made, or not sealed as
 * it seals them; nothing is mapped), KVA_ERR_BACKEND (fstat or mmap refused), KVA_ERR_NOMEM (no
 * host memory for the map record). */
KVA_API kva_status kva_shared_attach(int fd, kva_shared_map **out);

/* As kva_shared_attach, for a shared CUDA pool (kva_config.shared with KVA_BACKEND_CUDA): fd is
 * the allocation's exported handle (kva_pool_shared_fd in the owner), imported with the driver
 * and mapped read-write for GPU `device` at a device address of this process; length is the
 * owner's kva_stats.mapped_bytes (the whole allocation). The caller may close fd once this
 * returns. One allocation is imported at most once per process at a time. Errors:
 * KVA_ERR_INVALID (NULL out, a negative fd or device, a descriptor that is not open, one this
 * process imported already and has not detached, a length that is no positive multiple of the
 * device's granularity, a descriptor the driver does not take as a shareable allocation: nothing
 * is imported), KVA_ERR_BACKEND (no driver or GPU, no shareable handles in the driver, the
 * reservation or the mapping refused), KVA_ERR_NOMEM (host memory for the record). */
KVA_API kva_status kva_shared_attach_cuda(int device, int fd, size_t length, kva_shared_map **out);

/* The map's start (the owner's offset 0) and its length in bytes (the owner's region, at least
 * its capacity). NULL / 0 for a NULL map. */
KVA_API void *kva_shared_base(const kva_shared_map *map);
KVA_API size_t kva_shared_length(const kva_shared_map *map);

/* Unmaps and frees the map. NULL is accepted and ignored. */
KVA_API void kva_shared_detach(kva_shared_map *map);

/* ------------------------------------------------------------------------------------------ */
/* Statistics                                                                                 */
/* ------------------------------------------------------------------------------------------ */

#define KVA_MAX_ORDERS 48 /* buddy orders 0 .. KVA_MAX_ORDERS-1 (block = min_block << order) */
#define KVA_NUM_SIZE_CLASSES 49
#define KVA_SLAB_MIN_SIZE 16
#define KVA_SLAB_MAX_SIZE 65536

typedef struct kva_stats {
    size_t capacity; /* bytes managed (config capacity rounded down to min_block) */
    size_t min_block;
    size_t slab_chunk;
    size_t max_alloc_size; /* the largest request that can ever succeed */
    size_t bytes_in_use;   /* usable bytes of live allocations (class or block sizes) */
    size_t bytes_free;     /* bytes in free buddy blocks */
    size_t slab_bytes;     /* bytes of buddy chunks currently held by slabs */
    /* free object space inside those slabs (the slack past a slab's last object is in neither
     * figure) */
    size_t slab_free_bytes;
    size_t largest_free;                  /* the largest free buddy block */
    double fragmentation;                 /* 1 - largest_free / bytes_free (0 when nothing is free) */
    uint32_t num_orders;                  /* orders in use: 0 .. num_orders-1 */
    uint64_t free_blocks[KVA_MAX_ORDERS]; /* free buddy blocks per order */
    uint64_t live_allocations;
    uint64_t alloc_count;    /* successful allocations since creation */
    uint64_t free_count;     /* successful frees since creation */
    uint64_t alloc_failures; /* allocations that returned KVA_ERR_NOMEM */
    uint64_t rejected_calls; /* calls that returned INVALID, DOUBLE_FREE or BAD_POINTER */
    uint64_t slab_count;     /* live slabs */
    kva_page_kind page_kind; /* what actually backs the region */
    size_t page_size;        /* its page size in bytes */
    size_t metadata_bytes;   /* host bytes of bookkeeping in use (resident part) */
    int32_t numa_node;       /* the NUMA node the region is bound to; -1 if none */
    uint32_t backend;        /* kva_backend */
    /* bytes backed by memory now: in a CUDA pool the mapped granules (live blocks plus idle
     * granules not yet trimmed), in a host pool the whole mapped region */
    size_t mapped_bytes;
    int pinned;             /* host: registered with the CUDA driver (config pin) */
    int locked;             /* host: mlocked (config lock) */
    uint32_t arenas;        /* per-CPU arenas */
    uint32_t thread_caches; /* threads that hold a cache of this pool now */
    /* free object bytes held in threads' caches (part of slab_free_bytes: usable by those threads
     * only until they flush, exit or trim) */
    size_t cached_bytes;
    /* frees of objects whose word another thread's cache held, passed to that thread without a lock */
    uint64_t remote_frees;
    /* Peaks since creation or the last kva_reset_peaks (current/peak/total as in rmm and torch).
     * peak_block_bytes is exact: the most bytes in live buddy blocks at once (allocations and
     * slabs' chunks; capacity - bytes_free at its lowest), raised by every buddy allocation under
     * the pool lock. Slab objects are counted by each thread alone, with no shared write on the
     * fast path, so no exact peak of bytes_in_use exists: peak_bytes_in_use is the highest
     * bytes_in_use computed by kva_get_stats or a named pool's publish (at least every
     * publish_interval_ms while the pool is busy), a lower bound of the true peak, and at most
     * peak_block_bytes. With no slab objects live, as in a pool holding one KV cache, the two
     * agree. */
    size_t peak_block_bytes;
    size_t peak_bytes_in_use;
} kva_stats;

/* KVA_ERR_INVALID for a NULL pool or out. */
KVA_API kva_status kva_get_stats(kva_pool *pool, kva_stats *out);

/* Starts the peaks of kva_stats afresh from the figures as they stand now (torch's
 * reset_peak_memory_stats). KVA_ERR_INVALID for a NULL pool. */
KVA_API kva_status kva_reset_peaks(kva_pool *pool);

/* Publishes the pool's state to its shared-memory segment now (named pools; a no-op for an
 * anonymous pool, and in a process forked from the pool's creator, since the segment describes
 * the creator's pool and belongs to it). Publishing also happens by itself from the pool's slow paths, at most every
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
/* The figures of size class index. KVA_ERR_INVALID for a NULL pool or out, or an index of no
 * class. */
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

/* Visits every live allocation and every free range. The walk holds the pool's locks, so the
 * callback must not call into the pool; other threads' slow paths wait for the walk to end, and
 * objects their caches allocate or free meanwhile may show either way. KVA_ERR_INVALID for a
 * NULL pool or fn; KVA_ERR_CORRUPT if the metadata is broken (kva_check names how). */
KVA_API kva_status kva_walk(kva_pool *pool, kva_walk_fn fn, void *ctx);

/* The KV-cache manager (kva_kv_*): kvalloc_kv.h, included here. */
#include "kvalloc_kv.h"

/* Variable-size pools (kva_var_*): kvalloc_var.h, included here. */
#include "kvalloc_var.h"

#ifdef __cplusplus
}
#endif

#endif /* KVALLOC_H */
