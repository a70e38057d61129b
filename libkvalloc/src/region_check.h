/*
 * region_check.h — kva_check's part for the region (region_check.c), which reads the region
 * against the buddy over it.
 */
#ifndef KVA_REGION_CHECK_H
#define KVA_REGION_CHECK_H

#include "buddy.h"
#include "region.h"

/* The region's own invariants and that each granule's reference count matches the live blocks
 * of the buddy over it. KVA_OK or KVA_ERR_CORRUPT. */
kva_status kva_region_check(const kva_region *region, const kva_buddy *buddy);

#endif
