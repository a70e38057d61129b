/*
 * test_bad_input.c — every kind of bad input returns its own status, leaves *out untouched and
 * leaves the pool exactly as it was (same stats, same heap walk, kva_check passing).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvalloc.h"
#include "pool_fingerprint.h"

static kva_pool *make_pool(size_t capacity) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.slab_chunk = (size_t)2 << 20; /* the slack case below counts in 2 MiB slabs */
    cfg.pages = KVA_PAGES_SMALL;
    kva_pool *pool = NULL;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    return pool;
}

#define SENTINEL ((void *)0x5e5e5e5e)

static void test_bad_configs(void) {
    kva_config base;
    kva_config_init(&base);
    base.pages = KVA_PAGES_SMALL;
    struct {
        const char *what;
        kva_config cfg;
    } cases[13];
    int n = 0;
    for (int i = 0; i < 13; i++) cases[i].cfg = base;
    cases[n].what = "min_block not a power of two", cases[n++].cfg.min_block = 3000;
    cases[n].what = "min_block 0", cases[n++].cfg.min_block = 0;
    cases[n].what = "min_block too small", cases[n++].cfg.min_block = 128;
    cases[n].what = "min_block too large", (cases[n].cfg.capacity = (size_t)4 << 30),
    cases[n++].cfg.min_block = (size_t)128 << 20;
    cases[n].what = "capacity below one block", cases[n++].cfg.capacity = 4095;
    cases[n].what = "capacity 0", cases[n++].cfg.capacity = 0;
    cases[n].what = "slab_chunk not a power of two", cases[n++].cfg.slab_chunk = 3 << 20;
    cases[n].what = "slab_chunk below min_block", (cases[n].cfg.min_block = 1 << 20), cases[n++].cfg.slab_chunk = 65536;
    cases[n].what = "slab_chunk too large", cases[n++].cfg.slab_chunk = (size_t)128 << 20;
    cases[n].what = "bad page mode", cases[n++].cfg.pages = (kva_page_mode)9;
    cases[n].what = "name with a slash", cases[n++].cfg.name = "a/b";
    cases[n].what = "empty name", cases[n++].cfg.name = "";
    cases[n].what = "too many blocks", (cases[n].cfg.min_block = 256), cases[n++].cfg.capacity = (size_t)1 << 40;
    for (int i = 0; i < n; i++) {
        kva_pool *pool = SENTINEL;
        kva_status st = kva_pool_create(&cases[i].cfg, &pool);
        if (st != KVA_ERR_INVALID || pool != SENTINEL) {
            fprintf(stderr, "config case '%s': status %d, pool %p\n", cases[i].what, st, (void *)pool);
            check_failures++;
        }
        CHECK(strlen(kva_last_error()) > 0);
    }
    kva_pool *pool = SENTINEL;
    CHECK_STATUS(kva_pool_create(NULL, &pool), KVA_ERR_INVALID);
    CHECK(pool == SENTINEL);
    CHECK_STATUS(kva_pool_create(&base, NULL), KVA_ERR_INVALID);
    char long_name[KVA_NAME_MAX + 2];
    memset(long_name, 'a', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = 0;
    base.name = long_name;
    CHECK_STATUS(kva_pool_create(&base, &pool), KVA_ERR_INVALID);
    long_name[KVA_NAME_MAX] = 0; /* exactly the longest allowed */
    CHECK_STATUS(kva_pool_create(&base, &pool), KVA_OK);
    kva_pool_destroy(pool);
    kva_pool_destroy(NULL);
}

static void test_null_and_sizes(void) {
    kva_pool *pool = make_pool((size_t)8 << 20);
    void *keep;
    CHECK_STATUS(kva_alloc(pool, 64, &keep), KVA_OK);
    snapshot before = take(pool);
    void *out = SENTINEL;
    CHECK_STATUS(kva_alloc(NULL, 64, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc(pool, 64, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc(pool, 0, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc(pool, ((size_t)8 << 20) + 1, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc(pool, SIZE_MAX, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_aligned(pool, 64, 3, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_aligned(pool, 64, (size_t)16 << 20, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_aligned(pool, 0, 64, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_aligned(NULL, 64, 64, &out), KVA_ERR_INVALID);
    CHECK(out == SENTINEL);
    CHECK_STATUS(kva_free(NULL, keep), KVA_ERR_INVALID);
    CHECK_STATUS(kva_free(pool, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_check(NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_trim(NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_get_stats(NULL, &before.stats), KVA_ERR_INVALID);
    CHECK_STATUS(kva_get_stats(pool, NULL), KVA_ERR_INVALID);
    kva_class_stats cs;
    CHECK_STATUS(kva_get_class_stats(pool, KVA_NUM_SIZE_CLASSES, &cs), KVA_ERR_INVALID);
    CHECK_STATUS(kva_pool_base(NULL, &out), KVA_ERR_INVALID);
    CHECK(kva_usable_size(NULL, keep) == 0);
    CHECK(unchanged(pool, &before));
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.rejected_calls == 8); /* the alloc and free calls that had a pool to count them in */
    CHECK(st.alloc_failures == 0);
    kva_pool_destroy(pool);
}

/* Double frees of slab objects and buddy blocks, plain, interleaved (p, q, p) and after the
 * memory was merged into a larger free block. */
static void test_double_free(void) {
    kva_pool *pool = make_pool((size_t)16 << 20);
    size_t sizes[] = {64, 4096, 65536, 1 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        void *keep, *p, *q;
        CHECK_STATUS(kva_alloc(pool, sizes[i], &keep), KVA_OK);
        CHECK_STATUS(kva_alloc(pool, sizes[i], &p), KVA_OK);
        CHECK_STATUS(kva_alloc(pool, sizes[i], &q), KVA_OK);
        CHECK_STATUS(kva_free(pool, p), KVA_OK);
        snapshot before = take(pool);
        CHECK_STATUS(kva_free(pool, p), KVA_ERR_DOUBLE_FREE);
        CHECK(unchanged(pool, &before));
        CHECK_STATUS(kva_free(pool, q), KVA_OK);
        before = take(pool);
        CHECK_STATUS(kva_free(pool, p), KVA_ERR_DOUBLE_FREE); /* p, q, p */
        CHECK_STATUS(kva_free(pool, q), KVA_ERR_DOUBLE_FREE);
        CHECK(unchanged(pool, &before));
        CHECK_STATUS(kva_free(pool, keep), KVA_OK);
    }
    /* Everything freed and merged back: a stale block pointer still reads as a double free. */
    void *big;
    CHECK_STATUS(kva_alloc(pool, (size_t)4 << 20, &big), KVA_OK);
    CHECK_STATUS(kva_free(pool, big), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    snapshot before = take(pool);
    CHECK_STATUS(kva_free(pool, big), KVA_ERR_DOUBLE_FREE);
    CHECK_STATUS(kva_free(pool, (char *)big + 4096), KVA_ERR_DOUBLE_FREE);
    CHECK(unchanged(pool, &before));
    kva_pool_destroy(pool);
}

/* Interior pointers, pointers from malloc, the stack, another pool, and the pool's own slack. */
static void test_bad_pointers(void) {
    kva_pool *pool = make_pool(((size_t)8 << 20) + 4096 + 100);
    kva_pool *other = make_pool((size_t)8 << 20);
    void *obj, *block, *foreign;
    CHECK_STATUS(kva_alloc(pool, 64, &obj), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 100000, &block), KVA_OK);
    CHECK_STATUS(kva_alloc(other, 64, &foreign), KVA_OK);
    snapshot before = take(pool);
    int on_stack = 0;
    void *heap = malloc(64);
    void *base;
    kva_pool_base(pool, &base);
    CHECK_STATUS(kva_free(pool, (char *)obj + 1), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, (char *)obj + 16), KVA_ERR_BAD_POINTER); /* inside a 64 B object */
    CHECK_STATUS(kva_free(pool, (char *)block + 1), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, (char *)block + 4096), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, heap), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, &on_stack), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, foreign), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, (char *)base - 1), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, (char *)base + ((size_t)8 << 20) + 4096), KVA_ERR_BAD_POINTER); /* slack */
    CHECK_STATUS(kva_free(pool, (void *)(uintptr_t)-16), KVA_ERR_BAD_POINTER);
    /* The slack at the end of a slab, past its last object: 2 MiB / 48 B leaves 32 bytes. */
    void *odd;
    CHECK_STATUS(kva_alloc(pool, 48, &odd), KVA_OK);
    before = take(pool);
    uintptr_t chunk = ((uintptr_t)odd - (uintptr_t)base) & ~(uintptr_t)((2 << 20) - 1);
    CHECK_STATUS(kva_free(pool, (char *)base + chunk + (2 << 20) - 32), KVA_ERR_BAD_POINTER);
    /* Inside a free object is memory already free, as inside a free buddy block: a double free
     * (of the object, or of something in it); inside its live neighbour, a bad pointer. */
    void *neighbour;
    CHECK_STATUS(kva_alloc(pool, 48, &neighbour), KVA_OK);
    CHECK_STATUS(kva_free(pool, odd), KVA_OK);
    before = take(pool);
    CHECK_STATUS(kva_free(pool, (char *)odd + 8), KVA_ERR_DOUBLE_FREE);
    CHECK(strstr(kva_last_error(), "which is free") != NULL);
    CHECK_STATUS(kva_free(pool, (char *)neighbour + 8), KVA_ERR_BAD_POINTER);
    CHECK(unchanged(pool, &before));
    CHECK_STATUS(kva_free(pool, neighbour), KVA_OK);
    before = take(pool);
    CHECK(kva_usable_size(pool, (char *)obj + 1) == 0);
    CHECK(kva_usable_size(pool, heap) == 0);
    CHECK(unchanged(pool, &before));
    CHECK(kva_usable_size(pool, obj) == 64);
    free(heap);
    CHECK_STATUS(kva_check(other), KVA_OK);
    kva_pool_destroy(other);
    kva_pool_destroy(pool);
}

/* Out of memory changes nothing, and the pool recovers once memory is freed. */
static void test_exhaustion(void) {
    kva_pool *pool = make_pool((size_t)4 << 20);
    void *a, *b, *out = SENTINEL;
    CHECK_STATUS(kva_alloc(pool, (size_t)2 << 20, &a), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, (size_t)1 << 20, &b), KVA_OK);
    snapshot before = take(pool);
    CHECK_STATUS(kva_alloc(pool, (size_t)2 << 20, &out), KVA_ERR_NOMEM);
    CHECK(out == SENTINEL);
    before.stats.alloc_failures++;
    CHECK(unchanged(pool, &before));
    CHECK_STATUS(kva_free(pool, a), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, (size_t)2 << 20, &out), KVA_OK);
    kva_pool_destroy(pool);
}

int main(void) {
    test_bad_configs();
    test_null_and_sizes();
    test_double_free();
    test_bad_pointers();
    test_exhaustion();
    return CHECK_DONE();
}
