/*
 * test_region_faults.c — every operating-system call a host pool makes at creation is made to
 * fail in turn (os.h's kva_os_fail_nth): each failure gives a clear status, or a fallback that
 * still yields a sound pool, and never leaves a mapping behind.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "proc_self.h"
#include "kvalloc.h"
#include "os.h"
#include "pool.h"
#include "pool_range.h"

static kva_config config(kva_page_mode pages, int prefault, int node, int lock) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)8 << 20;
    cfg.pages = pages;
    cfg.prefault = prefault;
    cfg.numa_node = node;
    cfg.lock = lock;
    return cfg;
}

/* Fails the n-th OS call of creation for n = 1, 2, ... until creation makes fewer calls. */
static void sweep(const kva_config *cfg, const char *label) {
    long before = mapping_count();
    unsigned n;
    for (n = 1; n < 100; n++) {
        kva_pool *pool = NULL;
        kva_os_fail_nth(KVA_OS_ANY, n, ENOMEM);
        kva_status st = kva_pool_create(cfg, &pool);
        unsigned left = kva_os_fail_nth(KVA_OS_ANY, 0, 0);
        if (st == KVA_OK) {
            /* Either the failure came too late to be reached, or a fallback absorbed it (a page
             * size the kernel refused): the pool must be sound all the same. */
            CHECK_STATUS(kva_check(pool), KVA_OK);
            void *p;
            CHECK_STATUS(kva_alloc(pool, 1000, &p), KVA_OK);
            kva_pool_destroy(pool);
            if (left > 0) break;
        } else {
            CHECK(pool == NULL);
            CHECK(left == 0);
            CHECK(st == KVA_ERR_BACKEND || st == KVA_ERR_NOMEM);
            CHECK(kva_last_error()[0] != '\0');
        }
        if (MAPS_ARE_RELIABLE && mapping_count() != before) {
            fprintf(stderr, "%s: failing OS call %u leaked a mapping (%s)\n", label, n, kva_last_error());
            check_failures++;
            before = mapping_count();
        }
    }
    CHECK(n > 2 && n < 100);
}

/* Each kind of refusal, alone, with the status and the words it should give. */
static void refusal(kva_os_call call, const kva_config *cfg, kva_status expect, const char *words) {
    long before = mapping_count();
    kva_pool *pool = NULL;
    kva_os_fail_nth(call, 1, ENOMEM);
    kva_status st = kva_pool_create(cfg, &pool);
    CHECK(kva_os_fail_nth(KVA_OS_ANY, 0, 0) == 0);
    CHECK_STATUS(st, expect);
    if (st == KVA_OK) {
        kva_pool_destroy(pool);
    } else if (!strstr(kva_last_error(), words)) {
        fprintf(stderr, "expected \"%s\" in \"%s\"\n", words, kva_last_error());
        check_failures++;
    }
    CHECK(!MAPS_ARE_RELIABLE || mapping_count() == before); /* see proc_self.h */
}

static void test_each_refusal(void) {
    kva_config small = config(KVA_PAGES_SMALL, 0, -1, 0);
    /* A named pool whose statistics segment cannot be created: no pool, no segment left. */
    kva_config named = small;
    named.name = "faulty";
    refusal(KVA_OS_SHM, &named, KVA_ERR_BACKEND, "shm_open");
    char path[96];
    snprintf(path, sizeof path, "/dev/shm/kvalloc.%d.faulty", (int)getpid());
    CHECK(access(path, F_OK) != 0);
    refusal(KVA_OS_RESERVE, &small, KVA_ERR_BACKEND, "mmap reserve");
    refusal(KVA_OS_COMMIT, &small, KVA_ERR_BACKEND, "mmap of");
    refusal(KVA_OS_METADATA, &small, KVA_ERR_NOMEM, "metadata"); /* kva_pool_create's word for it */
    kva_config huge = config(KVA_PAGES_HUGETLB, 0, -1, 0);
    refusal(KVA_OS_COMMIT_HUGE, &huge, KVA_ERR_BACKEND, "MAP_HUGETLB");
    kva_config thp = config(KVA_PAGES_THP, 0, -1, 0);
    refusal(KVA_OS_ADVISE, &thp, KVA_ERR_BACKEND, "MADV_HUGEPAGE");
    kva_config prefault = config(KVA_PAGES_SMALL, 1, -1, 0);
    refusal(KVA_OS_POPULATE, &prefault, KVA_ERR_BACKEND, "MADV_POPULATE_WRITE");
    /* Without prefault, faulting the metadata in at creation is an optimisation: where the
     * kernel or a memory cgroup refuses it, the pool is made with its metadata lazy. */
    refusal(KVA_OS_POPULATE, &small, KVA_OK, "");
    kva_config bound = config(KVA_PAGES_SMALL, 0, 0, 0);
    refusal(KVA_OS_MBIND, &bound, KVA_ERR_BACKEND, "mbind");
    kva_config locked = config(KVA_PAGES_SMALL, 0, -1, 1);
    refusal(KVA_OS_LOCK, &locked, KVA_ERR_BACKEND, "mlock");
}

/* In auto mode a refused huge-page kind falls through to the next one. */
static void test_fallback_chain(void) {
    kva_config cfg = config(KVA_PAGES_AUTO, 0, -1, 0);
    kva_pool *pool = NULL;
    /* hugetlb refused (as on a machine with none reserved) and THP advice refused: base pages. */
    kva_os_fail_nth(KVA_OS_COMMIT_HUGE, 1, ENOMEM);
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    kva_os_fail_nth(KVA_OS_ANY, 0, 0);
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.page_kind == KVA_PAGE_KIND_THP || st.page_kind == KVA_PAGE_KIND_SMALL);
    kva_pool_destroy(pool);
    kva_os_fail_nth(KVA_OS_ADVISE, 1, EINVAL);
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    kva_os_fail_nth(KVA_OS_ANY, 0, 0);
    kva_get_stats(pool, &st);
    CHECK(st.page_kind == KVA_PAGE_KIND_SMALL || st.page_kind == KVA_PAGE_KIND_HUGETLB);
    kva_pool_destroy(pool);
}

/* Kernels before 5.14 answer MADV_POPULATE_WRITE with EINVAL (made so here by the hook): the
 * fallback must still fault in every base page, whatever backs the range, since a fault in a
 * transparent huge page range takes a base page when no huge page is free. */
static void test_populate_fallback(void) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), length = (size_t)4 << 20;
    /* A range on base pages: as in a THP pool that got none. */
    void *range = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(range != MAP_FAILED);
    madvise(range, length, MADV_NOHUGEPAGE);
    kva_os_fail_nth(KVA_OS_POPULATE, 1, EINVAL);
    CHECK_STATUS(kva_os_populate(range, length), KVA_OK);
    CHECK(kva_os_fail_nth(KVA_OS_ANY, 0, 0) == 0);
    CHECK(resident_pages(range, length) == length / page);
    munmap(range, length);

    /* Each populate of a prefault pool's creation in turn (the region, block records, bitmaps)
     * falls back: all of it is resident all the same, and the records creation had written
     * before populating them are as they were. */
    kva_config cfg = config(KVA_PAGES_AUTO, 1, -1, 0);
    for (unsigned n = 1;; n++) {
        kva_pool *pool = NULL;
        kva_os_fail_nth(KVA_OS_POPULATE, n, EINVAL);
        CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
        unsigned left = kva_os_fail_nth(KVA_OS_ANY, 0, 0);
        REQUIRE(pool);
        CHECK(resident_pages(pool->base, cfg.capacity) == cfg.capacity / page);
        size_t records = (pool->buddy.pages_bytes + page - 1) / page * page;
        size_t bitmaps = (pool->slabs.bitmaps_bytes + page - 1) / page * page;
        CHECK(resident_pages(pool->buddy.pages, records) == records / page);
        CHECK(resident_pages(pool->slabs.bitmaps, bitmaps) == bitmaps / page);
        CHECK_STATUS(kva_check(pool), KVA_OK);
        void *block;
        CHECK_STATUS(kva_alloc(pool, cfg.capacity / 2, &block), KVA_OK);
        CHECK_STATUS(kva_free(pool, block), KVA_OK);
        kva_pool_destroy(pool);
        if (left > 0) break; /* creation made fewer than n populate calls */
        CHECK(n < 10);
    }

    /* Memory a THP pool takes back for the KV trim (kva_pool_range_take) on a kernel whose huge
     * page faults fall back to base pages (MADV_NOHUGEPAGE here): every base page is resident. */
    kva_config thp = config(KVA_PAGES_THP, 0, -1, 0);
    kva_pool *pool = NULL;
    if (kva_pool_create(&thp, &pool) != KVA_OK) {
        fprintf(stderr, "test_populate_fallback: no THP pool here (%s), kva_pool_range_take not checked\n",
                kva_last_error());
        return;
    }
    void *block;
    CHECK_STATUS(kva_alloc(pool, length, &block), KVA_OK);
    REQUIRE(madvise(pool->base, thp.capacity, MADV_NOHUGEPAGE) == 0);
    kva_os_fail_nth(KVA_OS_POPULATE, 1, EINVAL);
    CHECK_STATUS(kva_pool_range_take(pool, block, length), KVA_OK);
    CHECK(kva_os_fail_nth(KVA_OS_ANY, 0, 0) == 0);
    CHECK(resident_pages(block, length) == length / page);
    kva_pool_destroy(pool);
}

/* A variable-size pool's range records are metadata too: no host memory for them is
 * KVA_ERR_NOMEM, as the header says (not KVA_ERR_BACKEND), with nothing left behind. */
static void test_varpool_metadata_nomem(void) {
    kva_config pc;
    kva_config_init(&pc);
    pc.capacity = (size_t)16 << 20;
    pc.pages = KVA_PAGES_SMALL;
    kva_pool *pool = NULL;
    REQUIRE(kva_pool_create(&pc, &pool) == KVA_OK);
    kva_var_config vc;
    kva_var_config_init(&vc);
    vc.capacity = (size_t)8 << 20;
    long before = mapping_count();
    kva_var *v = (kva_var *)0x1;
    kva_os_fail_nth(KVA_OS_METADATA, 1, ENOMEM);
    CHECK_STATUS(kva_var_create(&vc, pool, &v), KVA_ERR_NOMEM);
    CHECK(kva_os_fail_nth(KVA_OS_ANY, 0, 0) == 0);
    CHECK(v == (kva_var *)0x1);
    CHECK(!MAPS_ARE_RELIABLE || mapping_count() == before);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.live_allocations == 0); /* the range went back to the pool */
    CHECK_STATUS(kva_var_create(&vc, pool, &v), KVA_OK);
    kva_var_destroy(v);
    kva_pool_destroy(pool);
}

int main(void) {
    /* The first failures allocate what error reporting needs (and, under AddressSanitizer, the
     * allocator maps its regions): let that happen before mappings are counted. */
    kva_config warm = config(KVA_PAGES_SMALL, 0, 9999, 0);
    kva_pool *pool;
    kva_os_fail_nth(KVA_OS_RESERVE, 1, ENOMEM);
    kva_pool_create(&warm, &pool);
    warm.numa_node = -1;
    kva_pool_create(&warm, &pool);
    kva_os_fail_nth(KVA_OS_ANY, 0, 0);
    test_each_refusal();
    test_fallback_chain();
    test_populate_fallback();
    test_varpool_metadata_nomem();
    kva_config a = config(KVA_PAGES_SMALL, 0, -1, 0), b = config(KVA_PAGES_AUTO, 1, 0, 1),
               c = config(KVA_PAGES_AUTO, 0, -1, 0);
    sweep(&a, "small pages");
    sweep(&b, "auto, prefault, node 0, lock");
    sweep(&c, "auto");
    return CHECK_DONE();
}
