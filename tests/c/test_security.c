/*
 * test_security.c — the cases the well-known allocator security suites try, on slab objects
 * (two classes), buddy blocks and exact ranges. Each is caught with a clear status and leaves
 * the pool exactly as it was (heap walk and stats unchanged, kva_check passing):
 * double free; interleaved double free (p, q, p); delayed double free (p, then 1,000
 * allocation and free cycles, then p); free of p + 1; free of a far pointer; an impossible
 * request; a count x size overflow. (Through thread caches too, once pools have them.)
 */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kvalloc.h"
#include "pool_fingerprint.h"

typedef kva_status (*alloc_fn)(kva_pool *, size_t, void **);

typedef struct kind {
    const char *name;
    size_t size;
    alloc_fn alloc;
} kind;

static kva_status exact(kva_pool *pool, size_t size, void **out) { return kva_alloc_exact(pool, size, out); }

static void expect_refused(kva_pool *pool, void *ptr, kva_status expected, const char *what, const char *kind_name) {
    snapshot before = take(pool);
    kva_status got = kva_free(pool, ptr);
    if (got != expected || !unchanged(pool, &before)) {
        fprintf(stderr, "%s, %s: status %d (expected %d), pool %s\n", kind_name, what, got, expected,
                unchanged(pool, &before) ? "unchanged" : "CHANGED");
        check_failures++;
    }
}

static void run_cases(kva_pool *pool, const kind *k) {
    void *p, *q, *keep;
    REQUIRE(k->alloc(pool, k->size, &keep) == KVA_OK); /* something live beside, so nothing merges away */

    REQUIRE(k->alloc(pool, k->size, &p) == KVA_OK);
    REQUIRE(kva_free(pool, p) == KVA_OK);
    expect_refused(pool, p, KVA_ERR_DOUBLE_FREE, "double free", k->name);

    REQUIRE(k->alloc(pool, k->size, &p) == KVA_OK);
    REQUIRE(k->alloc(pool, k->size, &q) == KVA_OK);
    REQUIRE(kva_free(pool, p) == KVA_OK);
    REQUIRE(kva_free(pool, q) == KVA_OK);
    expect_refused(pool, p, KVA_ERR_DOUBLE_FREE, "interleaved double free (p, q, p)", k->name);

    REQUIRE(k->alloc(pool, k->size, &p) == KVA_OK);
    REQUIRE(kva_free(pool, p) == KVA_OK);
    for (int i = 0; i < 1000; i++) { /* p's memory may be handed out and freed again meanwhile */
        void *t;
        REQUIRE(k->alloc(pool, k->size, &t) == KVA_OK);
        REQUIRE(kva_free(pool, t) == KVA_OK);
    }
    expect_refused(pool, p, KVA_ERR_DOUBLE_FREE, "delayed double free", k->name);

    REQUIRE(k->alloc(pool, k->size, &p) == KVA_OK);
    expect_refused(pool, (char *)p + 1, KVA_ERR_BAD_POINTER, "free of p + 1", k->name);
    expect_refused(pool, (char *)p + ((size_t)1 << 40), KVA_ERR_BAD_POINTER, "free of a far pointer", k->name);
    int on_stack;
    expect_refused(pool, &on_stack, KVA_ERR_BAD_POINTER, "free of a stack address", k->name);
    REQUIRE(kva_free(pool, p) == KVA_OK);
    REQUIRE(kva_free(pool, keep) == KVA_OK);
}

static void test_requests(kva_pool *pool) {
    snapshot before = take(pool);
    void *out = (void *)0x1;
    CHECK_STATUS(kva_alloc(pool, SIZE_MAX, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc(pool, SIZE_MAX / 2 + 1, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_exact(pool, SIZE_MAX, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_aligned(pool, SIZE_MAX, 64, &out), KVA_ERR_INVALID);
    /* count x size overflows: refused before anything else, however small each factor looks. */
    CHECK_STATUS(kva_alloc_array(pool, SIZE_MAX / 2 + 1, 2, &out), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_array(pool, (size_t)1 << 33, (size_t)1 << 31, &out), KVA_ERR_INVALID);
    CHECK(strstr(kva_last_error(), "overflow") != NULL);
    CHECK(out == (void *)0x1);
    CHECK(unchanged(pool, &before));
    /* ... and a product that fits is an ordinary allocation. */
    CHECK_STATUS(kva_alloc_array(pool, 16, 64, &out), KVA_OK);
    CHECK(kva_usable_size(pool, out) == 1024);
    CHECK_STATUS(kva_free(pool, out), KVA_OK);
    CHECK_STATUS(kva_alloc_array(NULL, SIZE_MAX, 2, &out), KVA_ERR_INVALID);
}

int main(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)64 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    kva_pool *pool;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    const kind kinds[] = {
        {"64 B slab object", 64, kva_alloc},
        {"4 KiB slab object", 4096, kva_alloc},
        {"1 MiB buddy block", (size_t)1 << 20, kva_alloc},
        {"3 MiB exact range", (size_t)3 << 20, exact},
    };
    for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) run_cases(pool, &kinds[i]);
    test_requests(pool);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.live_allocations == 0);
    kva_pool_destroy(pool);
    return CHECK_DONE();
}
