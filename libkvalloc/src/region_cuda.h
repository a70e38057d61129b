/*
 * region_cuda.h — the state of a CUDA region (region_cuda.c): host records of the granules of
 * one GPU's memory, mapped on demand. Shared with the region's checker (region_check.c), which
 * reads it against the buddy's blocks.
 *
 * Invariants (kva_region_check verifies them):
 *  R1  refs of a granule == the USED and SLAB buddy blocks that overlap it; 0 for a granule
 *      given back within its live block (released), which is then the only block over it.
 *  R2  UNMAPPED: no memory, refs 0. MAPPED: refs > 0. IDLE: mapped, refs 0.
 *  R3  The idle list holds exactly the IDLE granules, doubly linked, oldest at the head; idle
 *      counts them, mapped counts the MAPPED and IDLE ones.
 * A resident region (prefault) maps every granule at creation and keeps them all mapped for its
 * life; it keeps no references, and commit, decommit and trim do nothing. A shareable region
 * (kva_config.shared) is resident, with one allocation over the whole reservation so that one
 * exported descriptor describes all of it.
 */
#ifndef KVA_REGION_CUDA_H
#define KVA_REGION_CUDA_H

#include "cuda_driver.h"
#include "region.h"

enum {
    KVA_GRANULE_UNMAPPED = 0,
    KVA_GRANULE_MAPPED = 1,
    KVA_GRANULE_IDLE = 2
};

typedef struct kva_granule {
    CUmemGenericAllocationHandle handle; /* the physical memory, unless UNMAPPED */
    uint32_t refs;                       /* live blocks overlapping the granule */
    uint32_t prev, next;                 /* idle list links (IDLE only) */
    uint8_t state;
    uint8_t released; /* given back while its live block lives on (R1) */
    uint8_t reserved[2];
} kva_granule;

struct kva_cuda_region {
    kva_cuda_device dev;
    CUmemAllocationProp prop; /* of every granule: pinned device memory of dev */
    CUmemAccessDesc access;   /* read-write for dev */
    CUdeviceptr base;
    size_t reserved; /* bytes reserved at base: ngranules granules */
    unsigned shift;  /* log2 of the granularity */
    uint32_t ngranules;
    kva_granule *granules;
    size_t granules_bytes;
    uint32_t idle_head, idle_tail;
    uint32_t mapped, idle;
    size_t watermark; /* unmap idle granules above this many idle bytes; 0: never */
    int resident;
    /* shared (kva_config.shared): the whole reservation is one shareable allocation, mapped at
     * creation (the region is resident); its granule records stay UNMAPPED and unused */
    int shareable;
    CUmemGenericAllocationHandle whole;
};

/* A shared CUDA pool's memory imported into this process (kva_cuda_import_map, region.h):
 * the allocation's handle, mapped read-write for the device at an address reserved here. */
struct kva_cuda_import {
    kva_cuda_device dev;
    CUmemGenericAllocationHandle handle;
    CUdeviceptr base;
    size_t length;
};

/* A new descriptor of a shareable region's allocation (cuMemExportToShareableHandle). */
kva_status kva_cuda_region_export(kva_cuda_region *r, int *fd);

#endif
