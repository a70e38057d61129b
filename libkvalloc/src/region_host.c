/*
 * region_host.c — host memory for a pool, with the huge-page fallback chain.
 */
#include "os.h"
#include "region.h"

static size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

/* Commits the reserved range [base, base+length) with one page kind. */
static kva_status commit_kind(unsigned char *base, size_t length, kva_page_kind kind) {
    switch (kind) {
    case KVA_PAGE_KIND_HUGETLB: return kva_os_commit(base, length, 1);
    case KVA_PAGE_KIND_THP: {
        kva_status st = kva_os_commit(base, length, 0);
        return st == KVA_OK ? kva_os_advise_thp(base, length) : st;
    }
    case KVA_PAGE_KIND_SMALL: return kva_os_commit(base, length, 0);
    }
    return kva_fail(KVA_ERR_INVALID, "unknown page kind %d", (int)kind);
}

kva_status kva_region_map(size_t length, size_t alignment, kva_page_mode mode, int prefault,
                          kva_region *out) {
    static const kva_page_kind chain[] = {KVA_PAGE_KIND_HUGETLB, KVA_PAGE_KIND_THP, KVA_PAGE_KIND_SMALL};
    size_t first = 0, last = 2;
    switch (mode) {
    case KVA_PAGES_AUTO: break;
    case KVA_PAGES_HUGETLB: first = last = 0; break;
    case KVA_PAGES_THP: first = last = 1; break;
    case KVA_PAGES_SMALL: first = last = 2; break;
    default: return kva_fail(KVA_ERR_INVALID, "unknown page mode %d", (int)mode);
    }

    /* Whole huge pages are mapped even when the capacity is not a multiple of 2 MiB; the pool
     * still manages exactly its capacity. */
    size_t mapped = round_up(length, KVA_HUGE_PAGE_SIZE);
    if (alignment < KVA_HUGE_PAGE_SIZE) alignment = KVA_HUGE_PAGE_SIZE;
    kva_status st = KVA_OK;
    for (size_t i = first; i <= last; i++) {
        /* A fresh reservation per attempt: a failed MAP_FIXED may already have discarded part
         * of the range it was meant to replace, so a reservation is never reused after one. */
        void *reserved;
        st = kva_os_reserve(mapped, alignment, &reserved);
        if (st != KVA_OK) return st;
        st = commit_kind(reserved, mapped, chain[i]);
        size_t page_size = chain[i] == KVA_PAGE_KIND_SMALL ? kva_os_page_size() : KVA_HUGE_PAGE_SIZE;
        if (st == KVA_OK && prefault) st = kva_os_populate(reserved, mapped, page_size);
        if (st != KVA_OK) {
            kva_os_unmap(reserved, mapped);
            continue;
        }
        out->base = reserved;
        out->length = mapped;
        out->page_kind = chain[i];
        out->page_size = page_size;
        return KVA_OK;
    }
    return st;
}

void kva_region_unmap(kva_region *region) {
    kva_os_unmap(region->base, region->length);
    region->base = NULL;
    region->length = 0;
}
