/*
 * test_api.c — the normal behaviour of every public function: routing, sizes, alignment,
 * capacities that are not powers of two, stats, trim, and the heap walk.
 */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kvalloc.h"

static kva_pool *make_pool(size_t capacity, size_t min_block) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.min_block = min_block;
    cfg.slab_chunk = (size_t)2 << 20; /* the tests below count in 2 MiB slabs */
    cfg.pages = KVA_PAGES_SMALL;
    kva_pool *pool = NULL;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    return pool;
}

static void test_defaults(void) {
    kva_config cfg;
    memset(&cfg, 0xab, sizeof cfg);
    kva_config_init(&cfg);
    CHECK(cfg.capacity == (size_t)64 << 20);
    CHECK(cfg.min_block == 4096);
    CHECK(cfg.slab_chunk == 0); /* automatic */
    CHECK(cfg.name == NULL);
    CHECK(cfg.pages == KVA_PAGES_AUTO);
    CHECK(cfg.prefault == 0);
    kva_config_init(NULL); /* tolerated */
}

static void test_strerror(void) {
    for (int s = KVA_OK; s <= KVA_ERR_CORRUPT; s++) {
        const char *text = kva_strerror((kva_status)s);
        CHECK(text && *text && strcmp(text, "unknown status") != 0);
    }
    CHECK(strcmp(kva_strerror((kva_status)99), "unknown status") == 0);
}

/* Small sizes come from slabs, large ones are buddy blocks of the next power of two. */
static void test_routing_and_sizes(void) {
    kva_pool *pool = make_pool((size_t)64 << 20, 4096);
    void *base;
    CHECK_STATUS(kva_pool_base(pool, &base), KVA_OK);
    size_t sizes[] = {1, 16, 17, 64, 100, 4096, 5000, 65536, 65537, 1 << 20, (3 << 20) + 1};
    void *ptrs[sizeof sizes / sizeof *sizes];
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        CHECK_STATUS(kva_alloc(pool, sizes[i], &ptrs[i]), KVA_OK);
        size_t usable = kva_usable_size(pool, ptrs[i]);
        CHECK(usable >= sizes[i]);
        if (sizes[i] <= KVA_SLAB_MAX_SIZE) {
            CHECK(usable == kva_size_class_size((unsigned)kva_size_class_of(sizes[i])));
        } else {
            size_t block = 4096;
            while (block < sizes[i]) block *= 2;
            CHECK(usable == block);
            CHECK(((uintptr_t)ptrs[i] - (uintptr_t)base) % block == 0);
            CHECK((uintptr_t)ptrs[i] % block == 0); /* absolute alignment too */
        }
        CHECK((unsigned char *)ptrs[i] >= (unsigned char *)base &&
              (unsigned char *)ptrs[i] + sizes[i] <= (unsigned char *)base + ((size_t)64 << 20));
        memset(ptrs[i], (int)i, sizes[i]); /* host memory is writable */
    }
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.live_allocations == sizeof sizes / sizeof *sizes);
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) CHECK_STATUS(kva_free(pool, ptrs[i]), KVA_OK);
    CHECK(kva_usable_size(pool, ptrs[0]) == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* Objects of the 16 B class are 16-aligned; a 64 B request gives 64-aligned objects. */
static void test_slab_alignment(void) {
    kva_pool *pool = make_pool((size_t)32 << 20, 4096);
    for (int i = 0; i < 100; i++) {
        void *p;
        CHECK_STATUS(kva_alloc(pool, 64, &p), KVA_OK);
        CHECK((uintptr_t)p % 64 == 0);
        CHECK_STATUS(kva_alloc(pool, 48, &p), KVA_OK);
        CHECK((uintptr_t)p % 16 == 0);
    }
    /* What kva_alloc's comment promises, for every slab size: the largest power of two dividing
     * the class, at least 16 B above 56 B and at least 4 B for all. */
    for (size_t size = 1; size <= KVA_SLAB_MAX_SIZE; size += size < 1024 ? 1 : 61) {
        void *q[2]; /* two neighbours: where the class is not a multiple of 16, one of them is not */
        for (int k = 0; k < 2; k++) {
            CHECK_STATUS(kva_alloc(pool, size, &q[k]), KVA_OK);
            size_t usable = kva_usable_size(pool, q[k]), promised = usable & -usable;
            uintptr_t at = (uintptr_t)q[k];
            if (at % promised != 0 || (size > 56 && at % 16 != 0) || at % 4 != 0) {
                fprintf(stderr, "size %zu: %p is not aligned as promised\n", size, q[k]);
                check_failures++;
            }
        }
        for (int k = 0; k < 2; k++) CHECK_STATUS(kva_free(pool, q[k]), KVA_OK);
    }
    size_t aligns[] = {16, 64, 256, 4096, 65536, 1 << 20};
    for (size_t i = 0; i < sizeof aligns / sizeof *aligns; i++) {
        void *p;
        CHECK_STATUS(kva_alloc_aligned(pool, 20, aligns[i], &p), KVA_OK);
        CHECK((uintptr_t)p % aligns[i] == 0);
        CHECK(kva_usable_size(pool, p) >= 20);
        CHECK_STATUS(kva_free(pool, p), KVA_OK);
    }
    void *p = (void *)0x1;
    CHECK_STATUS(kva_alloc_aligned(pool, 20, 24, &p), KVA_ERR_INVALID);
    CHECK(p == (void *)0x1);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* Any capacity, not rounded up: 5 MiB + 3 blocks of 64 KiB + a few stray bytes is covered by
 * maximal aligned blocks (4 MiB, 1 MiB, 128 KiB, 64 KiB) and every byte of it can be handed out. */
static void test_odd_capacity(void) {
    size_t block = 65536, capacity = ((size_t)5 << 20) + 3 * block + 100;
    kva_pool *pool = make_pool(capacity, block);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.capacity == ((size_t)5 << 20) + 3 * block);
    CHECK(st.bytes_free == st.capacity);
    CHECK(st.largest_free == (size_t)4 << 20);
    CHECK(st.max_alloc_size == (size_t)4 << 20);
    CHECK(st.num_orders == 7);
    CHECK(st.free_blocks[6] == 1 && st.free_blocks[4] == 1 && st.free_blocks[1] == 1 && st.free_blocks[0] == 1);
    void *blocks[64];
    size_t n = 0;
    while (n < 64 && kva_alloc(pool, block + 1, &blocks[n]) == KVA_OK) n++; /* 128 KiB blocks */
    CHECK(n == (((size_t)5 << 20) + 2 * block) / (2 * block));
    void *last;
    CHECK_STATUS(kva_alloc(pool, 2 * block, &last), KVA_ERR_NOMEM);
    /* 64 KiB is a slab class, but no chunk is left for a slab: the last 64 KiB block serves it. */
    CHECK_STATUS(kva_alloc(pool, block, &last), KVA_OK);
    CHECK(kva_usable_size(pool, last) == block);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.bytes_free == 0 && st.largest_free == 0 && st.fragmentation == 0.0);
    CHECK(st.bytes_in_use == st.capacity);
    CHECK(st.alloc_failures == 2); /* the one that ended the loop and the one after it */
    CHECK_STATUS(kva_check(pool), KVA_OK);
    for (size_t i = 0; i < n; i++) CHECK_STATUS(kva_free(pool, blocks[i]), KVA_OK);
    CHECK_STATUS(kva_free(pool, last), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.bytes_free == st.capacity && st.largest_free == (size_t)4 << 20);
    CHECK(st.free_blocks[6] == 1 && st.free_blocks[4] == 1 && st.free_blocks[1] == 1 && st.free_blocks[0] == 1);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* Fragmentation is 1 - largest free / total free, and the per-order counts follow. */
static void test_fragmentation_stats(void) {
    kva_pool *pool = make_pool((size_t)1 << 20, 4096);
    void *p[16];
    int n = 0;
    while (kva_alloc(pool, 65537, &p[n]) == KVA_OK) n++; /* 128 KiB blocks: 8 of them */
    CHECK(n == 8);
    for (int i = 0; i < n; i += 2) CHECK_STATUS(kva_free(pool, p[i]), KVA_OK);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.bytes_free == (size_t)512 << 10);
    CHECK(st.largest_free == (size_t)128 << 10);
    CHECK(st.free_blocks[5] == 4);
    CHECK(st.fragmentation > 0.74 && st.fragmentation < 0.76);
    CHECK(st.bytes_in_use == (size_t)512 << 10);
    kva_pool_destroy(pool);
}

/* One spare slab per class survives emptying; trim returns it. */
static void test_spare_and_trim(void) {
    kva_pool *pool = make_pool((size_t)16 << 20, 4096);
    void *objs[1000];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 1000; i++) CHECK_STATUS(kva_alloc(pool, 64, &objs[i]), KVA_OK);
        for (int i = 0; i < 1000; i++) CHECK_STATUS(kva_free(pool, objs[i]), KVA_OK);
    }
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.slab_count == 1);
    CHECK(st.bytes_in_use == 0);
    CHECK(st.slab_bytes == (size_t)2 << 20 && st.slab_free_bytes == (size_t)2 << 20);
    kva_class_stats cs;
    CHECK_STATUS(kva_get_class_stats(pool, (unsigned)kva_size_class_of(64), &cs), KVA_OK);
    CHECK(cs.object_size == 64 && cs.objects_per_slab == (2u << 20) / 64 && cs.slabs == 1 && cs.live_objects == 0);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.slab_count == 0 && st.bytes_free == st.capacity && st.fragmentation == 0.0);
    CHECK_STATUS(kva_check(pool), KVA_OK);

    /* Two slabs of one class that both empty: one stays as the spare, one goes back. */
    size_t per_slab = (2u << 20) / 4096;
    void **many = malloc(sizeof(void *) * per_slab * 2);
    for (size_t i = 0; i < per_slab * 2; i++) CHECK_STATUS(kva_alloc(pool, 4096, &many[i]), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.slab_count == 2);
    for (size_t i = 0; i < per_slab * 2; i++) CHECK_STATUS(kva_free(pool, many[i]), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    /* The first slab to empty stays as the spare; the second holds the class's current word,
     * which allocation keeps working in. Nothing else is retained, and trim returns both. */
    CHECK(st.slab_count == 2 && st.bytes_in_use == 0);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.slab_count == 0 && st.bytes_free == st.capacity);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    free(many);
    kva_pool_destroy(pool);
}

/* When no chunk is left for a new slab, a small request is served by a buddy block instead of
 * failing while memory is free. */
static void test_no_false_oom(void) {
    kva_pool *pool = make_pool((size_t)2 << 20, 4096); /* exactly one chunk */
    void *big, *small;
    CHECK_STATUS(kva_alloc(pool, (size_t)1 << 20, &big), KVA_OK); /* the chunk is now split */
    CHECK_STATUS(kva_alloc(pool, 64, &small), KVA_OK);
    CHECK(kva_usable_size(pool, small) == 4096);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_free(pool, small), KVA_OK);
    CHECK_STATUS(kva_free(pool, big), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* Exact allocations give their tail back at once and take no more than they asked for. */
static void test_exact(void) {
    kva_pool *pool = make_pool((size_t)64 << 20, 4096);
    void *a, *b, *c;
    size_t three_mib = (size_t)3 << 20;
    CHECK_STATUS(kva_alloc_exact(pool, three_mib - 100, &a), KVA_OK);
    CHECK(kva_usable_size(pool, a) == three_mib);
    CHECK((uintptr_t)a % ((size_t)4 << 20) == 0);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.bytes_in_use == three_mib && st.bytes_free == ((size_t)64 << 20) - three_mib);
    /* The freed tail is the 1 MiB right after it. */
    CHECK_STATUS(kva_alloc(pool, (size_t)1 << 20, &b), KVA_OK);
    CHECK((char *)b == (char *)a + three_mib);
    CHECK_STATUS(kva_free(pool, (char *)a + 4096), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, (char *)a + three_mib - 4096), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_alloc_exact(pool, 4096 * 5, &c), KVA_OK); /* 5 blocks out of 8 */
    CHECK(kva_usable_size(pool, c) == 4096 * 5);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_free(pool, a), KVA_OK);
    CHECK_STATUS(kva_free(pool, a), KVA_ERR_DOUBLE_FREE);
    CHECK_STATUS(kva_free(pool, b), KVA_OK);
    CHECK_STATUS(kva_free(pool, c), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.bytes_free == st.capacity && st.largest_free == st.capacity && st.live_allocations == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    void *out = (void *)0x1;
    CHECK_STATUS(kva_alloc_exact(pool, 0, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_exact(pool, ((size_t)64 << 20) + 1, &out), KVA_ERR_INVALID);
    CHECK(out == (void *)0x1);
    kva_pool_destroy(pool);
}

/* The automatic slab size: 2 MiB from 64 MiB up, capacity / 32 below, never under 64 KiB. */
static void test_auto_slab_chunk(void) {
    size_t capacities[] = {(size_t)1 << 30, (size_t)64 << 20, (size_t)16 << 20, (size_t)1 << 20, 300 << 10};
    size_t expected[] = {(size_t)2 << 20, (size_t)2 << 20, (size_t)512 << 10, 64 << 10, 64 << 10};
    for (size_t i = 0; i < 5; i++) {
        kva_config cfg;
        kva_config_init(&cfg);
        cfg.capacity = capacities[i];
        cfg.pages = KVA_PAGES_SMALL;
        kva_pool *pool;
        REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
        kva_stats st;
        kva_get_stats(pool, &st);
        CHECK(st.slab_chunk == expected[i]);
        kva_pool_destroy(pool);
    }
}

/* Spare slabs of many classes may hold every chunk; a request that needs a block then gets the
 * spares back instead of failing while the pool is all but empty. */
static void test_spares_do_not_cause_oom(void) {
    kva_pool *pool = make_pool((size_t)16 << 20, 4096); /* 8 chunks of 2 MiB */
    for (unsigned c = 0; c < 8; c++) {
        void *p;
        CHECK_STATUS(kva_alloc(pool, kva_size_class_size(c * 4 + 4), &p), KVA_OK);
        CHECK_STATUS(kva_free(pool, p), KVA_OK); /* each class keeps its slab as a spare */
    }
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.slab_count == 8 && st.bytes_free == 0 && st.bytes_in_use == 0);
    void *big, *small;
    CHECK_STATUS(kva_alloc(pool, (size_t)8 << 20, &big), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 645, &small), KVA_OK); /* a ninth class */
    CHECK(kva_usable_size(pool, small) == 768);         /* a slab object, not a whole block */
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

typedef struct walk_total {
    uint64_t next_offset, live, free_bytes, objects;
    int gap;
} walk_total;

static int visit(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    walk_total *t = ctx;
    if (offset != t->next_offset) t->gap = 1;
    t->next_offset = offset + size;
    if (kind == KVA_WALK_FREE || kind == KVA_WALK_SLAB_FREE) t->free_bytes += size;
    else t->live += size;
    t->objects += kind == KVA_WALK_SLAB_OBJECT;
    return 0;
}

static int stop_early(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    (void)offset, (void)size, (void)kind;
    return ++*(int *)ctx == 3;
}

/* The walk tiles the pool exactly and its live bytes match the stats. */
static void test_walk(void) {
    kva_pool *pool = make_pool(((size_t)6 << 20) + 8192, 4096);
    void *p;
    for (int i = 0; i < 50; i++) CHECK_STATUS(kva_alloc(pool, 64, &p), KVA_OK);
    for (int i = 0; i < 5; i++) CHECK_STATUS(kva_alloc(pool, 3000, &p), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 100000, &p), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 300000, &p), KVA_OK);
    walk_total t = {0};
    CHECK_STATUS(kva_walk(pool, visit, &t), KVA_OK);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(!t.gap);
    CHECK(t.next_offset == st.capacity);
    CHECK(t.live == st.bytes_in_use);
    CHECK(t.objects == 55);
    int calls = 0;
    CHECK_STATUS(kva_walk(pool, stop_early, &calls), KVA_OK);
    CHECK(calls == 3);
    CHECK_STATUS(kva_walk(pool, NULL, NULL), KVA_ERR_INVALID);
    kva_pool_destroy(pool);
}

/* A named pool keeps a copy of its name; min_block and slab_chunk other than the defaults work. */
static void test_config_variants(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    char name[] = "kv-cache.0";
    cfg.name = name;
    cfg.capacity = (size_t)32 << 20;
    cfg.min_block = 65536;
    cfg.slab_chunk = (size_t)1 << 20;
    cfg.pages = KVA_PAGES_THP;
    kva_pool *pool;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    name[0] = 'X';
    void *small, *large;
    CHECK_STATUS(kva_alloc(pool, 16, &small), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 70000, &large), KVA_OK);
    CHECK(kva_usable_size(pool, large) == 131072);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.min_block == 65536 && st.slab_chunk == (size_t)1 << 20);
    CHECK(st.page_kind == KVA_PAGE_KIND_THP && st.page_size == (size_t)2 << 20);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);

    /* The largest min_block: the automatic slab is one block. */
    kva_config_init(&cfg);
    cfg.capacity = (size_t)256 << 20;
    cfg.min_block = (size_t)64 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 64, &small), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 70000, &large), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.min_block == (size_t)64 << 20 && st.slab_chunk == (size_t)64 << 20);
    CHECK_STATUS(kva_free(pool, small), KVA_OK);
    CHECK_STATUS(kva_free(pool, large), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* kva_stats' peaks: the buddy's exact, bytes in use as the stats queries saw it; a reset starts
 * both from the figures as they stand. */
static void test_peaks(void) {
    kva_pool *pool = make_pool((size_t)16 << 20, 4096);
    kva_stats st;
    void *big, *exact;
    CHECK_STATUS(kva_alloc(pool, (size_t)1 << 20, &big), KVA_OK);
    CHECK_STATUS(kva_alloc_exact(pool, 3 * 4096, &exact), KVA_OK); /* keeps 3 blocks of its 4 */
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    size_t held = ((size_t)1 << 20) + 3 * 4096;
    CHECK(st.peak_block_bytes == held && st.peak_bytes_in_use == held && st.bytes_in_use == held);
    CHECK_STATUS(kva_free(pool, big), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.bytes_in_use == 3 * 4096 && st.peak_block_bytes == held && st.peak_bytes_in_use == held);
    CHECK_STATUS(kva_reset_peaks(NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_reset_peaks(pool), KVA_OK);
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.peak_block_bytes == 3 * 4096 && st.peak_bytes_in_use == 3 * 4096);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_free(pool, exact), KVA_OK);
    kva_pool_destroy(pool);
}

int main(void) {
    test_defaults();
    test_strerror();
    test_routing_and_sizes();
    test_slab_alignment();
    test_odd_capacity();
    test_fragmentation_stats();
    test_spare_and_trim();
    test_no_false_oom();
    test_exact();
    test_auto_slab_chunk();
    test_spares_do_not_cause_oom();
    test_walk();
    test_config_variants();
    test_peaks();
    return CHECK_DONE();
}
