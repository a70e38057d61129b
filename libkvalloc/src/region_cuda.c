/*
 * region_cuda.c — the memory of one GPU for a pool, through the CUDA driver's virtual memory
 * management.
 *
 * The whole capacity is one range of device addresses reserved at creation
 * (cuMemAddressReserve). Physical memory is made and mapped into it on demand, one granule at a
 * time (the device's allocation granularity, typically 2 MiB): cuMemCreate, cuMemMap,
 * cuMemSetAccess. A granule no live block touches stays mapped ("idle") until kva_trim, or until
 * the idle bytes pass the pool's trim_watermark, unmaps it (cuMemUnmap, cuMemRelease), oldest
 * idle first. The state is host arrays only (region_cuda.h, with its invariants); the device
 * memory is never read or written here.
 */
#include <stdio.h>
#include <stdlib.h>

#include "os.h"
#include "region_cuda.h"

static CUdeviceptr granule_address(const kva_cuda_region *r, uint32_t g) {
    return r->base + ((CUdeviceptr)g << r->shift);
}

static size_t granule_size(const kva_cuda_region *r) { return (size_t)1 << r->shift; }

static void idle_push(kva_cuda_region *r, uint32_t g) {
    kva_granule *gr = &r->granules[g];
    gr->state = KVA_GRANULE_IDLE;
    gr->next = KVA_NIL;
    gr->prev = r->idle_tail;
    if (r->idle_tail != KVA_NIL) r->granules[r->idle_tail].next = g;
    else r->idle_head = g;
    r->idle_tail = g;
    r->idle++;
}

static void idle_unlink(kva_cuda_region *r, uint32_t g) {
    kva_granule *gr = &r->granules[g];
    if (gr->prev != KVA_NIL) r->granules[gr->prev].next = gr->next;
    else r->idle_head = gr->next;
    if (gr->next != KVA_NIL) r->granules[gr->next].prev = gr->prev;
    else r->idle_tail = gr->prev;
    r->idle--;
}

/* Backs granule g (UNMAPPED) with new memory; it becomes MAPPED with no reference yet. The
 * context is current. On failure nothing is left behind. */
static kva_status map_granule(kva_cuda_region *r, uint32_t g) {
    const kva_cuda_driver *d = r->dev.driver;
    CUdeviceptr va = granule_address(r, g);
    size_t size = granule_size(r);
    CUmemGenericAllocationHandle handle;
    CUresult res = d->cuMemCreate(&handle, size, &r->prop, 0);
    if (res != CUDA_SUCCESS)
        return kva_cuda_fail(d, res, "cuMemCreate of %zu bytes on CUDA device %d", size, r->dev.ordinal);
    res = d->cuMemMap(va, size, 0, handle, 0);
    if (res == CUDA_SUCCESS) {
        res = d->cuMemSetAccess(va, size, &r->access, 1);
        if (res == CUDA_SUCCESS) {
            r->granules[g].handle = handle;
            r->granules[g].state = KVA_GRANULE_MAPPED;
            r->mapped++;
            return KVA_OK;
        }
        kva_status st = kva_cuda_fail(d, res, "cuMemSetAccess of %zu bytes at %#llx", size, va);
        d->cuMemUnmap(va, size);
        d->cuMemRelease(handle);
        return st;
    }
    kva_status st = kva_cuda_fail(d, res, "cuMemMap of %zu bytes at %#llx", size, va);
    d->cuMemRelease(handle);
    return st;
}

/* Gives granule g's memory back (the context is current). On failure it stays as it was. */
static kva_status unmap_granule(kva_cuda_region *r, uint32_t g) {
    const kva_cuda_driver *d = r->dev.driver;
    kva_granule *gr = &r->granules[g];
    CUresult res = d->cuMemUnmap(granule_address(r, g), granule_size(r));
    if (res != CUDA_SUCCESS)
        return kva_cuda_fail(d, res, "cuMemUnmap of %zu bytes at %#llx", granule_size(r), granule_address(r, g));
    if (gr->state == KVA_GRANULE_IDLE) idle_unlink(r, g);
    gr->state = KVA_GRANULE_UNMAPPED;
    r->mapped--;
    /* Unmapped, the memory is already unreachable; a refusal here leaks it but changes nothing
     * the pool can see, so it is reported and the granule counts as unmapped. */
    res = d->cuMemRelease(gr->handle);
    if (res != CUDA_SUCCESS) return kva_cuda_fail(d, res, "cuMemRelease of granule %u", g);
    return KVA_OK;
}

/* Unmaps the idle granules outside [first, last] (the context is current); whether any went. */
static int reclaim_idle(kva_cuda_region *r, uint32_t first, uint32_t last) {
    uint32_t before = r->mapped;
    for (uint32_t g = r->idle_head; g != KVA_NIL;) {
        uint32_t next = r->granules[g].next;
        if ((g < first || g > last) && unmap_granule(r, g) != KVA_OK) break;
        g = next;
    }
    return r->mapped != before;
}

kva_status kva_cuda_region_commit(kva_cuda_region *r, uint64_t offset, uint64_t length) {
    if (r->resident) return KVA_OK;
    uint32_t first = (uint32_t)(offset >> r->shift), last = (uint32_t)((offset + length - 1) >> r->shift);
    kva_status st = KVA_OK;
    int entered = 0;
    uint32_t g;
    for (g = first; g <= last && st == KVA_OK; g++) {
        if (r->granules[g].state != KVA_GRANULE_UNMAPPED) continue;
        if (!entered) {
            st = kva_cuda_enter(&r->dev);
            if (st != KVA_OK) break;
            entered = 1;
        }
        st = map_granule(r, g);
        /* Idle granules are free memory the GPU cannot use while they stay mapped: before the
         * request fails for want of memory, they go back and the driver is asked again. */
        if (st == KVA_ERR_NOMEM && reclaim_idle(r, first, last)) st = map_granule(r, g);
    }
    if (st != KVA_OK) {
        /* This call's own mappings are the MAPPED granules of the range with no reference. One
         * the driver will not unmap stays as an idle granule; the failure reported is the first. */
        char why[256];
        snprintf(why, sizeof why, "%s", kva_last_error());
        int quiet = 1;
        for (uint32_t h = first; h <= last; h++) {
            kva_granule *gr = &r->granules[h];
            if (gr->state != KVA_GRANULE_MAPPED || gr->refs != 0 || unmap_granule(r, h) == KVA_OK) continue;
            quiet = 0;
            if (gr->state == KVA_GRANULE_MAPPED) idle_push(r, h);
        }
        if (entered) kva_cuda_leave(&r->dev);
        return quiet ? st : kva_fail(st, "%s", why);
    }
    if (entered) kva_cuda_leave(&r->dev);
    for (g = first; g <= last; g++) {
        kva_granule *gr = &r->granules[g];
        if (gr->state == KVA_GRANULE_IDLE) {
            idle_unlink(r, g);
            gr->state = KVA_GRANULE_MAPPED;
        }
        gr->refs++;
    }
    return KVA_OK;
}

/* Unmaps idle granules, oldest first, until at most keep bytes are idle. */
static kva_status trim_to(kva_cuda_region *r, size_t keep) {
    if (((size_t)r->idle << r->shift) <= keep) return KVA_OK;
    kva_status st = kva_cuda_enter(&r->dev);
    if (st != KVA_OK) return st;
    while (st == KVA_OK && ((size_t)r->idle << r->shift) > keep) st = unmap_granule(r, r->idle_head);
    kva_cuda_leave(&r->dev);
    return st;
}

void kva_cuda_region_decommit(kva_cuda_region *r, uint64_t offset, uint64_t length) {
    if (r->resident) return;
    uint32_t first = (uint32_t)(offset >> r->shift), last = (uint32_t)((offset + length - 1) >> r->shift);
    for (uint32_t g = first; g <= last; g++) {
        kva_granule *gr = &r->granules[g];
        /* A granule given back within its block (kva_cuda_region_release) has no reference of
         * that block's left: the block's free only forgets it was given back. */
        if (gr->released) gr->released = 0;
        else if (--gr->refs == 0) idle_push(r, g);
    }
    /* The free that got here has succeeded whatever happens next; a refusal to unmap leaves the
     * granules idle for the next trim. */
    if (r->watermark) trim_to(r, r->watermark);
}

kva_status kva_cuda_region_release(kva_cuda_region *r, uint64_t offset, uint64_t length) {
    if (r->resident || length == 0) return KVA_OK;
    uint32_t first = (uint32_t)(offset >> r->shift), last = (uint32_t)((offset + length - 1) >> r->shift);
    for (uint32_t g = first; g <= last; g++) {
        kva_granule *gr = &r->granules[g];
        if (gr->released) continue;
        gr->released = 1;
        if (--gr->refs == 0) idle_push(r, g);
    }
    /* These granules, and no other idle one (trim_watermark keeps deciding those), are
     * unmapped and released now. A refusal leaves them idle for the next trim. */
    kva_status st = kva_cuda_enter(&r->dev);
    if (st != KVA_OK) return st;
    for (uint32_t g = first; g <= last && st == KVA_OK; g++)
        if (r->granules[g].state == KVA_GRANULE_IDLE) st = unmap_granule(r, g);
    kva_cuda_leave(&r->dev);
    return st;
}

kva_status kva_cuda_region_take(kva_cuda_region *r, uint64_t offset, uint64_t length) {
    if (r->resident || length == 0) return KVA_OK;
    kva_status st = kva_cuda_region_commit(r, offset, length);
    if (st != KVA_OK) return st;
    uint32_t first = (uint32_t)(offset >> r->shift), last = (uint32_t)((offset + length - 1) >> r->shift);
    for (uint32_t g = first; g <= last; g++) r->granules[g].released = 0;
    return KVA_OK;
}

kva_status kva_cuda_region_trim(kva_cuda_region *r) {
    if (r->resident) return KVA_OK;
    /* An out-of-memory from the driver while it unmaps (or pushes the context) is a refusal to
     * unmap, not a pool out of memory: kva_trim documents KVA_ERR_BACKEND for it (the message
     * still names the driver's error). Seen when the fault injection of test_cuda_fake landed on
     * a trim: which driver call a countdown hits depends on the arena a thread's CPU picks. */
    kva_status st = trim_to(r, 0);
    return st == KVA_ERR_NOMEM ? KVA_ERR_BACKEND : st;
}

size_t kva_cuda_region_mapped_bytes(const kva_cuda_region *r) { return (size_t)r->mapped << r->shift; }

/* Unmaps every granule and frees the reservation: the region's end, so it goes on past every
 * refusal. A granule the driver will not unmap still has its handle released (the driver frees
 * the memory at its last unmap); the reservation is then freed if it can be. The last refusal
 * to unmap or release stays in kva_last_error for a caller that looks. */
static void release_all(kva_cuda_region *r) {
    const kva_cuda_driver *d = r->dev.driver;
    if (r->shareable && r->mapped) {
        d->cuMemUnmap(r->base, r->reserved);
        d->cuMemRelease(r->whole);
        r->mapped = 0;
    }
    for (uint32_t g = 0; g < r->ngranules && r->mapped; g++) {
        kva_granule *gr = &r->granules[g];
        if (gr->state == KVA_GRANULE_UNMAPPED || unmap_granule(r, g) == KVA_OK || gr->state == KVA_GRANULE_UNMAPPED)
            continue;
        d->cuMemRelease(gr->handle); /* unmap refused: the handle goes all the same */
    }
    d->cuMemAddressFree(r->base, r->reserved);
}

/* A shareable region's one allocation over the whole reservation, mapped (the context is
 * current). On failure nothing is left behind. */
static kva_status map_whole(kva_cuda_region *r) {
    const kva_cuda_driver *d = r->dev.driver;
    CUresult res = d->cuMemCreate(&r->whole, r->reserved, &r->prop, 0);
    if (res != CUDA_SUCCESS)
        return kva_cuda_fail(d, res, "cuMemCreate of %zu shareable bytes on CUDA device %d", r->reserved,
                             r->dev.ordinal);
    res = d->cuMemMap(r->base, r->reserved, 0, r->whole, 0);
    if (res == CUDA_SUCCESS) {
        res = d->cuMemSetAccess(r->base, r->reserved, &r->access, 1);
        if (res == CUDA_SUCCESS) {
            r->mapped = r->ngranules;
            return KVA_OK;
        }
        d->cuMemUnmap(r->base, r->reserved);
    }
    kva_status st = kva_cuda_fail(d, res, "mapping the %zu-byte shareable allocation", r->reserved);
    d->cuMemRelease(r->whole);
    return st;
}

/* The reservation, the granule records and, for a resident region, every granule's memory. */
static kva_status reserve(kva_cuda_region *r, size_t length, size_t alignment, int prefault) {
    const kva_cuda_driver *d = r->dev.driver;
    size_t granularity = 0;
    CUresult res = d->cuMemGetAllocationGranularity(&granularity, &r->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (res != CUDA_SUCCESS)
        return kva_cuda_fail(d, res, "cuMemGetAllocationGranularity of CUDA device %d", r->dev.ordinal);
    if (!kva_is_pow2(granularity))
        return kva_fail(KVA_ERR_BACKEND, "CUDA device %d reports a granularity of %zu bytes, not a power of two",
                        r->dev.ordinal, granularity);
    r->shift = kva_log2(granularity);
    size_t ngranules = (length + granularity - 1) >> r->shift;
    if (ngranules >= KVA_NIL)
        return kva_fail(KVA_ERR_INVALID, "capacity %zu is %zu granules of %zu bytes; at most %u fit", length, ngranules,
                        granularity, KVA_NIL - 1);
    r->ngranules = (uint32_t)ngranules;
    r->reserved = ngranules << r->shift;
    if (alignment < granularity) alignment = granularity;
    res = d->cuMemAddressReserve(&r->base, r->reserved, alignment, 0, 0);
    if (res != CUDA_SUCCESS) {
        kva_status st = kva_cuda_fail(d, res, "cuMemAddressReserve of %zu bytes aligned to %zu", r->reserved,
                                      alignment);
        return st == KVA_ERR_NOMEM ? KVA_ERR_BACKEND : st;
    }
    kva_status st = KVA_OK;
    if (r->base & (alignment - 1))
        st = kva_fail(KVA_ERR_BACKEND, "cuMemAddressReserve returned %#llx, not aligned to %zu", r->base, alignment);
    r->granules_bytes = (size_t)r->ngranules * sizeof(kva_granule);
    void *records = NULL;
    if (st == KVA_OK) st = kva_os_map_metadata(r->granules_bytes, &records);
    /* Faulted in now (24 bytes per granule, 0.001% of the capacity), as the pool's own records
     * are (pool.c, populate_metadata): every block allocation reaches those of its granules. */
    if (st == KVA_OK && (st = kva_os_populate(records, r->granules_bytes)) != KVA_OK)
        kva_os_unmap(records, r->granules_bytes);
    if (st != KVA_OK) {
        d->cuMemAddressFree(r->base, r->reserved);
        return st;
    }
    r->granules = records;
    r->idle_head = r->idle_tail = KVA_NIL;
    if (r->shareable) st = map_whole(r);
    for (uint32_t g = 0; prefault && !r->shareable && g < r->ngranules && st == KVA_OK; g++) st = map_granule(r, g);
    if (st != KVA_OK) {
        release_all(r);
        kva_os_unmap(r->granules, r->granules_bytes);
        return st;
    }
    r->resident = prefault || r->shareable;
    return KVA_OK;
}

/* What a shared region asks of the driver: the export and import entry points and POSIX file
 * descriptor handles; GPUDirect RDMA on the allocation where the device offers it with VMM. */
static kva_status shareable_prop(kva_cuda_region *r) {
    const kva_cuda_driver *d = r->dev.driver;
    if (!d->cuMemExportToShareableHandle || !d->cuMemImportFromShareableHandle)
        return kva_fail(KVA_ERR_BACKEND, "the CUDA driver %s has no shareable allocation handles", d->path);
    int fd_handles = 0, rdma = 0;
    CUresult res = d->cuDeviceGetAttribute(&fd_handles, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                           r->dev.device);
    if (res != CUDA_SUCCESS)
        return kva_cuda_fail(d, res, "cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)");
    if (!fd_handles)
        return kva_fail(KVA_ERR_BACKEND, "CUDA device %d does not share memory by POSIX file descriptor",
                        r->dev.ordinal);
    /* Not offered is no error: the memory is shared all the same, without RDMA registration. */
    if (d->cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, r->dev.device) !=
        CUDA_SUCCESS)
        rdma = 0;
    r->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    r->prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
    r->shareable = 1;
    return KVA_OK;
}

kva_status kva_cuda_region_export(kva_cuda_region *r, int *fd) {
    const kva_cuda_driver *d = r->dev.driver;
    kva_status st = kva_cuda_enter(&r->dev);
    if (st != KVA_OK) return st;
    int exported = -1;
    CUresult res = d->cuMemExportToShareableHandle(&exported, r->whole, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    kva_cuda_leave(&r->dev);
    if (res != CUDA_SUCCESS) return kva_cuda_fail(d, res, "cuMemExportToShareableHandle");
    *fd = exported;
    return KVA_OK;
}

kva_status kva_cuda_import_map(int device, int fd, size_t length, void **base, kva_cuda_import **out) {
    kva_cuda_import imp = {.length = length};
    kva_status st = kva_cuda_device_open(device, 1, &imp.dev);
    if (st != KVA_OK) return st;
    const kva_cuda_driver *d = imp.dev.driver;
    if (!d->cuMemImportFromShareableHandle) {
        kva_cuda_device_close(&imp.dev);
        return kva_fail(KVA_ERR_BACKEND, "the CUDA driver %s has no shareable allocation handles", d->path);
    }
    st = kva_cuda_enter(&imp.dev);
    if (st != KVA_OK) {
        kva_cuda_device_close(&imp.dev);
        return st;
    }
    CUmemLocation here = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device};
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                .location = here};
    CUmemAccessDesc access = {.location = here, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    size_t granularity = 0;
    CUresult res = d->cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    int stage = 0; /* how far it got: 1 imported, 2 reserved, 3 mapped */
    if (res != CUDA_SUCCESS) {
        st = kva_cuda_fail(d, res, "cuMemGetAllocationGranularity of CUDA device %d", device);
    } else if (length == 0 || !kva_is_pow2(granularity) || length % granularity) {
        st = kva_fail(KVA_ERR_INVALID, "length %zu is not a positive multiple of the %zu-byte granularity", length,
                      granularity);
    } else if ((res = d->cuMemImportFromShareableHandle(&imp.handle, (void *)(intptr_t)fd,
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) != CUDA_SUCCESS) {
        st = kva_cuda_fail(d, res, "descriptor %d is not a shareable CUDA allocation this driver takes", fd);
        st = KVA_ERR_INVALID;
    } else if (stage = 1, (res = d->cuMemAddressReserve(&imp.base, length, granularity, 0, 0)) != CUDA_SUCCESS) {
        st = kva_cuda_fail(d, res, "cuMemAddressReserve of %zu bytes", length);
        st = KVA_ERR_BACKEND;
    } else if (stage = 2, (res = d->cuMemMap(imp.base, length, 0, imp.handle, 0)) != CUDA_SUCCESS) {
        st = kva_cuda_fail(d, res, "cuMemMap of %zu bytes of the imported allocation", length);
        st = KVA_ERR_BACKEND;
    } else if (stage = 3, (res = d->cuMemSetAccess(imp.base, length, &access, 1)) != CUDA_SUCCESS) {
        st = kva_cuda_fail(d, res, "cuMemSetAccess of the imported allocation");
        st = KVA_ERR_BACKEND;
    } else {
        stage = 4;
    }
    if (stage < 4) {
        if (stage >= 3) d->cuMemUnmap(imp.base, length);
        if (stage >= 2) d->cuMemAddressFree(imp.base, length);
        if (stage >= 1) d->cuMemRelease(imp.handle);
    }
    kva_cuda_import *record = NULL;
    if (st == KVA_OK && !(record = malloc(sizeof *record))) {
        d->cuMemUnmap(imp.base, length);
        d->cuMemAddressFree(imp.base, length);
        d->cuMemRelease(imp.handle);
        st = kva_fail(KVA_ERR_NOMEM, "no host memory for the import record");
    }
    kva_cuda_leave(&imp.dev);
    if (st != KVA_OK) {
        kva_cuda_device_close(&imp.dev);
        return st;
    }
    *record = imp;
    *base = (void *)(uintptr_t)imp.base;
    *out = record;
    return KVA_OK;
}

void kva_cuda_import_unmap(kva_cuda_import *imp) {
    const kva_cuda_driver *d = imp->dev.driver;
    if (!kva_cuda_inherited(&imp->dev)) {
        int entered = kva_cuda_enter(&imp->dev) == KVA_OK;
        d->cuMemUnmap(imp->base, imp->length);
        d->cuMemAddressFree(imp->base, imp->length);
        d->cuMemRelease(imp->handle);
        if (entered) kva_cuda_leave(&imp->dev);
    }
    kva_cuda_device_close(&imp->dev);
    free(imp);
}

kva_status kva_region_cuda_create(const kva_config *cfg, size_t length, size_t alignment, kva_region *out) {
    kva_cuda_region *r = calloc(1, sizeof *r);
    if (!r) return kva_fail(KVA_ERR_NOMEM, "no host memory for the CUDA region record");
    kva_status st = kva_cuda_device_open(cfg->device, 1, &r->dev);
    if (st != KVA_OK) {
        free(r);
        return st;
    }
    CUmemLocation here = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cfg->device};
    r->prop = (CUmemAllocationProp){.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                    .requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE,
                                    .location = here};
    r->access = (CUmemAccessDesc){.location = here, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    r->watermark = cfg->trim_watermark;
    st = cfg->shared ? shareable_prop(r) : KVA_OK;
    if (st == KVA_OK) st = kva_cuda_enter(&r->dev);
    if (st == KVA_OK) {
        st = reserve(r, length, alignment, cfg->prefault);
        kva_cuda_leave(&r->dev);
    }
    if (st != KVA_OK) {
        kva_cuda_device_close(&r->dev);
        free(r);
        return st;
    }
    *out = (kva_region){.base = (unsigned char *)(uintptr_t)r->base,
                        .length = r->reserved,
                        .backend = KVA_BACKEND_CUDA,
                        .page_kind = KVA_PAGE_KIND_DEVICE,
                        .page_size = granule_size(r),
                        .numa_node = -1,
                        .device = r,
                        .shared_fd = -1};
    return KVA_OK;
}

void kva_region_cuda_destroy(kva_region *region) {
    kva_cuda_region *r = region->device;
    /* Without the context (a push refused, say at process teardown) the calls are made all the
     * same: those that need none still give the memory back, the others fail harmlessly. In a
     * forked child none is made: the device memory is the parent's (kva_cuda_inherited). */
    if (!kva_cuda_inherited(&r->dev)) {
        int entered = kva_cuda_enter(&r->dev) == KVA_OK;
        release_all(r);
        if (entered) kva_cuda_leave(&r->dev);
    }
    kva_os_unmap(r->granules, r->granules_bytes);
    kva_cuda_device_close(&r->dev);
    free(r);
    region->device = NULL;
    region->base = NULL;
    region->length = 0;
}
