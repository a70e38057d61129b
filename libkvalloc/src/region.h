/*
 * region.h — the backing memory of a pool: one contiguous, aligned range of host memory.
 *
 * The page-size fallback chain lives here: hugetlb 2 MiB pages, then transparent huge pages,
 * then base pages. The region records which one it got so the stats can report it.
 */
#ifndef KVA_REGION_H
#define KVA_REGION_H

#include "internal.h"

typedef struct kva_region {
    unsigned char *base;      /* aligned start of the managed memory */
    size_t length;            /* bytes mapped at base (>= the pool capacity) */
    kva_page_kind page_kind;  /* what backs it */
    size_t page_size;         /* bytes per page of that kind */
} kva_region;

/* Maps at least length bytes aligned to alignment with the given page mode; with prefault the
 * page faults are taken now. On failure nothing stays mapped and *out is untouched. */
kva_status kva_region_map(size_t length, size_t alignment, kva_page_mode mode, int prefault,
                          kva_region *out);

void kva_region_unmap(kva_region *region);

#endif
