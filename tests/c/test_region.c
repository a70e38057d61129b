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
#include "kvalloc.h"
#include "pool.h"

static long meminfo_value(const char *key) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    long value = -1;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && line[n] == ':') value = strtol(line + n + 1, NULL, 10);
    fclose(f);
    return value;
}

/* Whether the kernel grants transparent huge pages to a range advised MADV_HUGEPAGE. */
static int thp_available(void) {
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return 0;
    char line[128] = {0};
    int ok = fgets(line, sizeof line, f) && !strstr(line, "[never]");
    fclose(f);
    return ok;
}

/* The VmFlags line of the mapping that contains addr, from /proc/self/smaps. */
static int vm_flags_of(const void *addr, char *flags, size_t len) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return 0;
    char line[512];
    int inside = 0, found = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            inside = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
        } else if (inside && strncmp(line, "VmFlags:", 8) == 0) {
            snprintf(flags, len, "%s", line + 8);
            found = 1;
            break;
        }
    }
    fclose(f);
    return found;
}

/* Bytes mapped by this process in mappings of at least `min_size` bytes, from /proc/self/maps:
 * a pool's region is the only mapping that large the tests make. Under AddressSanitizer the
 * figure means nothing (its shadow mappings, terabytes of them, split and move as it works), so
 * there these checks fall back to what can be checked by address; the normal build, which CI
 * runs too, checks the whole process. */
#if defined(__SANITIZE_ADDRESS__)
#define MAPS_ARE_RELIABLE 0
#else
#define MAPS_ARE_RELIABLE 1
#endif
static unsigned long large_mapped_bytes(unsigned long min_size) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return 0;
    char line[512];
    unsigned long total = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && hi - lo >= min_size) total += hi - lo;
    }
    fclose(f);
    return total;
}

static size_t resident_pages(void *base, size_t length) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), n = length / page, count = 0;
    unsigned char *vec = malloc(n);
    REQUIRE(vec && mincore(base, length, vec) == 0);
    for (size_t i = 0; i < n; i++) count += vec[i] & 1;
    free(vec);
    return count;
}

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

int main(void) {
    test_hugetlb();
    test_auto_chain();
    test_thp_and_small();
    test_prefault();
    test_alignment_and_cleanup();
    return CHECK_DONE();
}
