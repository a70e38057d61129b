/*
 * test_region.c — the backing memory: the huge-page fallback chain reports what it really got
 * (checked against the kernel's own view in /proc/self/smaps), prefault really takes the page
 * faults (checked with mincore), failures leave no mapping behind, and the base is aligned.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "proc_self.h"
#include "kvalloc.h"
#include "pool.h"






static kva_pool *create(kva_page_mode mode, size_t capacity, int prefault, kva_status expect) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.pages = mode;
    cfg.prefault = prefault;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), expect);
    return pool;
}

static void test_hugetlb(void) {
    size_t capacity = (size_t)8 << 20;
    long free_huge = meminfo_value("HugePages_Free");
    unsigned long maps_before = large_mapped_bytes(capacity);
    if (free_huge >= 4) {
        kva_pool *pool = create(KVA_PAGES_HUGETLB, capacity, 0, KVA_OK);
        kva_stats st;
        kva_get_stats(pool, &st);
        CHECK(st.page_kind == KVA_PAGE_KIND_HUGETLB && st.page_size == (size_t)2 << 20);
        kva_pool_destroy(pool);
    } else {
        /* No hugetlb pages reserved on this machine: forcing them is a backend error that says
         * why, and nothing stays mapped. */
        for (int i = 0; i < 20; i++) CHECK(create(KVA_PAGES_HUGETLB, capacity, 0, KVA_ERR_BACKEND) == NULL);
        CHECK(strstr(kva_last_error(), "MAP_HUGETLB") != NULL);
    }
    CHECK(!MAPS_ARE_RELIABLE || large_mapped_bytes(capacity) == maps_before);
}

static void test_auto_chain(void) {
    kva_pool *pool = create(KVA_PAGES_AUTO, (size_t)8 << 20, 0, KVA_OK);
    kva_stats st;
    kva_get_stats(pool, &st);
    kva_page_kind expected = meminfo_value("HugePages_Free") >= 4 ? KVA_PAGE_KIND_HUGETLB
                             : thp_available()                    ? KVA_PAGE_KIND_THP
                                                                  : KVA_PAGE_KIND_SMALL;
    CHECK(st.page_kind == expected);
    kva_pool_destroy(pool);
}

static void test_thp_and_small(void) {
    void *base;
    char flags[512];
    if (thp_available()) {
        kva_pool *pool = create(KVA_PAGES_THP, (size_t)8 << 20, 0, KVA_OK);
        kva_pool_base(pool, &base);
        REQUIRE(vm_flags_of(base, flags, sizeof flags));
        CHECK(strstr(flags, " hg") != NULL); /* the kernel recorded MADV_HUGEPAGE */
        kva_pool_destroy(pool);
    } else {
        CHECK(create(KVA_PAGES_THP, (size_t)8 << 20, 0, KVA_ERR_BACKEND) == NULL);
    }
    kva_pool *pool = create(KVA_PAGES_SMALL, (size_t)8 << 20, 0, KVA_OK);
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.page_kind == KVA_PAGE_KIND_SMALL && st.page_size == (size_t)sysconf(_SC_PAGESIZE));
    kva_pool_base(pool, &base);
    REQUIRE(vm_flags_of(base, flags, sizeof flags));
    CHECK(strstr(flags, " hg") == NULL);
    kva_pool_destroy(pool);
}

static void test_prefault(void) {
    size_t capacity = (size_t)16 << 20, pages = capacity / (size_t)sysconf(_SC_PAGESIZE);
    void *base;
    kva_pool *lazy = create(KVA_PAGES_SMALL, capacity, 0, KVA_OK);
    kva_pool_base(lazy, &base);
    CHECK(resident_pages(base, capacity) == 0);
    kva_pool_destroy(lazy);
    kva_pool *eager = create(KVA_PAGES_SMALL, capacity, 1, KVA_OK);
    kva_pool_base(eager, &base);
    CHECK(resident_pages(base, capacity) == pages);
    /* The metadata too: the first calls must not fault on block records or bitmaps. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t records = (eager->buddy.pages_bytes + page - 1) / page * page;
    size_t bitmaps = (eager->slabs.bitmaps_bytes + page - 1) / page * page;
    CHECK(resident_pages(eager->buddy.pages, records) == records / page);
    CHECK(resident_pages(eager->slabs.bitmaps, bitmaps) == bitmaps / page);
    kva_pool_destroy(eager);
}

/* The base is aligned to the largest block, so blocks are aligned to their size in absolute
 * addresses; a destroyed pool leaves no mapping behind. */
static void test_alignment_and_cleanup(void) {
    unsigned long maps_before = large_mapped_bytes((size_t)4 << 20);
    size_t capacities[] = {(size_t)4 << 20, (size_t)96 << 20, ((size_t)1 << 30) + 4096};
    for (size_t i = 0; i < 3; i++) {
        kva_pool *pool = create(KVA_PAGES_SMALL, capacities[i], 0, KVA_OK);
        void *base;
        kva_stats st;
        kva_pool_base(pool, &base);
        kva_get_stats(pool, &st);
        CHECK((uintptr_t)base % st.max_alloc_size == 0);
        kva_pool_destroy(pool);
        unsigned char probe;
        CHECK(mincore(base, 4096, &probe) != 0); /* nothing is mapped where the region was */
    }
    CHECK(!MAPS_ARE_RELIABLE || large_mapped_bytes((size_t)4 << 20) == maps_before);
}

/* A pool larger than the machine's memory: its pages are committed as they are touched, so a
 * pool sized for the worst case (a KV cache) must not be refused up front. */
static void test_pool_larger_than_memory(void) {
    size_t total = (size_t)meminfo_value("MemTotal") * 1024;
    size_t capacity = (size_t)1 << 30;
    while (capacity < 2 * total) capacity *= 2;
    kva_pool *pool = create(KVA_PAGES_THP, capacity, 0, KVA_OK);
    REQUIRE(pool);
    void *half;
    CHECK_STATUS(kva_alloc(pool, capacity / 2, &half), KVA_OK);
    CHECK_STATUS(kva_free(pool, half), KVA_OK);
    kva_pool_destroy(pool);
}

int main(void) {
    test_hugetlb();
    test_auto_chain();
    test_thp_and_small();
    test_prefault();
    test_alignment_and_cleanup();
    test_pool_larger_than_memory();
    return CHECK_DONE();
}
