/*
 * region.h — the backing memory of a pool: one contiguous range of addresses, aligned, either
 * host memory (region_host.c: private, or a shared memory object another process can map), the
 * memory of one GPU (region_cuda.c), or a range of either that the caller owns
 * (region_external.c: created and destroyed without touching the range, and no commit, decommit
 * or trim does anything to it).
 *
 * The pool sees one interface whatever backs it:
 *   create     reserves the whole range; host memory is backed at once (the page-size fallback
 *              chain hugetlb 2 MiB, transparent huge pages, base pages; NUMA binding; mlock;
 *              registration with the CUDA driver), device memory on demand;
 *   commit     makes [offset, offset + length) usable before a block in it is handed out;
 *   decommit   says the block is free again (the memory behind it may go back later);
 *   trim       gives back the memory no block uses;
 *   destroy    releases everything, whatever is still allocated.
 * For host memory commit and decommit are a single test. The pool calls them only from its slow
 * paths: when the buddy hands out or takes back a USED block, and when a slab is made or
 * released; never per slab object. Nothing here ever reads or writes the managed memory except
 * the host backend's prefault.
 */
#ifndef KVA_REGION_H
#define KVA_REGION_H

#include "internal.h"

typedef struct kva_cuda_region kva_cuda_region;
typedef struct kva_cuda_device kva_cuda_device;

typedef struct kva_region {
    unsigned char *base; /* aligned start of the managed memory (a device address for CUDA) */
    size_t length;       /* bytes of address space at base (>= the pool capacity) */
    kva_backend backend;
    kva_page_kind page_kind; /* what backs it */
    size_t page_size;        /* bytes per page of that kind; the mapping granularity for CUDA */
    int numa_node;           /* host: the node the range is bound to, -1 if none */
    int locked;              /* host: mlocked */
    kva_cuda_device *pinned; /* host: the GPU whose driver registered the range, or NULL */
    kva_cuda_region *device; /* CUDA: the mapping state; NULL for host memory */
    /* a range the caller owns: its entry in the process's registry of external ranges; NULL
     * otherwise */
    struct kva_external_range *external;
    int shared_fd; /* host: the shared memory object's descriptor, -1 for private memory */
} kva_region;

/* Reserves at least length bytes aligned to alignment and backs them as cfg says (backend,
 * pages, prefault, numa_node, lock, pin, device). On failure nothing is left reserved, mapped,
 * registered or retained, and *out is untouched. */
kva_status kva_region_create(const kva_config *cfg, size_t length, size_t alignment, kva_region *out);
void kva_region_destroy(kva_region *region);

kva_status kva_region_host_create(const kva_config *cfg, size_t length, size_t alignment, kva_region *out);
void kva_region_host_destroy(kva_region *region);
/* [cfg->external, + length): checked against the other live external ranges and registered;
 * KVA_ERR_INVALID if it overlaps one. Nothing in the range is touched. */
kva_status kva_region_external_create(const kva_config *cfg, size_t length, size_t alignment, kva_region *out);
void kva_region_external_destroy(kva_region *region);
/* The registry's lock, a leaf taken around fork (fork.c). */
void kva_external_registry_lock(void);
void kva_external_registry_unlock(void);
/* The lock of the CUDA imports' list (pool_shared.c), taken around fork (fork.c): it is held
 * across the driver's import, so it comes before the driver's loading lock. */
void kva_shared_imports_lock(void);
void kva_shared_imports_unlock(void);
kva_status kva_region_cuda_create(const kva_config *cfg, size_t length, size_t alignment, kva_region *out);
void kva_region_cuda_destroy(kva_region *region);

kva_status kva_cuda_region_commit(kva_cuda_region *device, uint64_t offset, uint64_t length);
void kva_cuda_region_decommit(kva_cuda_region *device, uint64_t offset, uint64_t length);
/* Whole granules [offset, offset + length) inside one live block: given back (their reference
 * dropped, marked released so that R1 and the block's eventual decommit know), and taken again
 * (mapped, reference restored). See pool_range.h. */
kva_status kva_cuda_region_release(kva_cuda_region *device, uint64_t offset, uint64_t length);
kva_status kva_cuda_region_take(kva_cuda_region *device, uint64_t offset, uint64_t length);
kva_status kva_cuda_region_trim(kva_cuda_region *device);
size_t kva_cuda_region_mapped_bytes(const kva_cuda_region *device);

/* KVA_OK, or (device memory only) KVA_ERR_NOMEM when the GPU has no memory left and
 * KVA_ERR_BACKEND when the driver refuses; then nothing changed. */
static inline kva_status kva_region_commit(kva_region *region, uint64_t offset, uint64_t length) {
    return kva_likely(region->device == NULL) ? KVA_OK : kva_cuda_region_commit(region->device, offset, length);
}

static inline void kva_region_decommit(kva_region *region, uint64_t offset, uint64_t length) {
    if (region->device) kva_cuda_region_decommit(region->device, offset, length);
}

/* A new descriptor (close on exec) of a shared region's memory for another process: a dup of
 * the host region's memfd, or the CUDA region's allocation exported as a POSIX file descriptor.
 * KVA_ERR_INVALID for a region that is not shared; KVA_ERR_BACKEND if dup or the driver
 * refused. */
kva_status kva_region_share(kva_region *region, int *fd);

/* Another process's shared CUDA region imported here: the allocation fd describes, its first
 * length bytes (a positive multiple of device's granularity) mapped read-write at *base.
 * KVA_ERR_INVALID for such a length or a descriptor the driver does not take;
 * KVA_ERR_BACKEND for no driver or a refused reservation or mapping. On failure nothing is left
 * imported, reserved or retained. */
typedef struct kva_cuda_import kva_cuda_import;
kva_status kva_cuda_import_map(int device, int fd, size_t length, void **base, kva_cuda_import **out);
void kva_cuda_import_unmap(kva_cuda_import *imp);

/* Gives back the memory no block uses (device memory: unmaps and releases the granules no live
 * block touches). KVA_ERR_BACKEND if the driver refused; what it did release stays released. */
kva_status kva_region_trim(kva_region *region);

/* Bytes backed by memory now: the whole range for host memory, the mapped granules for CUDA. */
size_t kva_region_mapped_bytes(const kva_region *region);

#endif
