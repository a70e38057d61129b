/*
 * test_checked.c — the checked mode (kva_config.checked): a write after free is reported by the
 * next allocation of that memory and by kva_check; a write past either end of an allocation is
 * reported at its free; all on slab objects, buddy blocks and exact ranges.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "kvalloc.h"

typedef kva_status (*alloc_fn)(kva_pool *, size_t, void **);

static kva_status exact(kva_pool *pool, size_t size, void **out) { return kva_alloc_exact(pool, size, out); }

static kva_pool *make_checked(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)16 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.checked = 1;
    kva_pool *pool;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    return pool;
}

static void run(alloc_fn alloc, size_t size, const char *what) {
    kva_pool *pool = make_checked();
    unsigned char *p;
    /* Clean use: the whole requested size is writable and freeing it is quiet. */
    REQUIRE(alloc(pool, size, (void **)&p) == KVA_OK);
    CHECK((uintptr_t)p % 16 == 0);
    CHECK(kva_usable_size(pool, p) == size); /* past it is red zone: writable is what was asked */
    memset(p, 0x5a, kva_usable_size(pool, p));
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);

    /* A pointer into the red zone before an allocation is none: refused, nothing changed. */
    REQUIRE(alloc(pool, size, (void **)&p) == KVA_OK);
    kva_stats before, after;
    kva_get_stats(pool, &before);
    for (int back = 1; back <= 16; back++) CHECK_STATUS(kva_free(pool, p - back), KVA_ERR_BAD_POINTER);
    kva_get_stats(pool, &after);
    CHECK(after.live_allocations == before.live_allocations && after.bytes_in_use == before.bytes_in_use);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);

    /* Writes past the end and before the start. */
    REQUIRE(alloc(pool, size, (void **)&p) == KVA_OK);
    p[size] = 0;
    CHECK_STATUS(kva_free(pool, p), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "past its end") != NULL);
    REQUIRE(alloc(pool, size, (void **)&p) == KVA_OK);
    p[-1] = 0;
    CHECK_STATUS(kva_free(pool, p), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "before its start") != NULL);
    kva_stats stats;
    kva_get_stats(pool, &stats);
    CHECK(stats.live_allocations == 0); /* freed all the same */
    CHECK_STATUS(kva_check(pool), KVA_OK);

    /* The usual faults keep their statuses. */
    REQUIRE(alloc(pool, size, (void **)&p) == KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_ERR_DOUBLE_FREE);
    REQUIRE(alloc(pool, size, (void **)&p) == KVA_OK);
    CHECK_STATUS(kva_free(pool, p + 1), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);

    /* A write after free: kva_check finds it, and so does the allocation that gets the memory,
     * which withholds that block. Poisoned again and freed, it would let kva_check pass after it
     * and the next allocation hand out the very block the stale pointer writes to. */
    REQUIRE(alloc(pool, size, (void **)&p) == KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    p[size / 2] = 1;
    CHECK_STATUS(kva_check(pool), KVA_ERR_CORRUPT);
    CHECK(strncmp(kva_last_error(), "C1:", 3) == 0);
    unsigned char *again = (unsigned char *)0x1;
    kva_stats counted;
    kva_get_stats(pool, &counted);
    kva_status st = alloc(pool, size, (void **)&again);
    if (st != KVA_ERR_CORRUPT || again != (unsigned char *)0x1 || !strstr(kva_last_error(), "write after free")) {
        fprintf(stderr, "%s: write after free not reported by the next allocation (%d: %s)\n", what, st,
                kva_last_error());
        check_failures++;
    }
    CHECK(p[size / 2] == 1); /* what was written is still there */
    CHECK_STATUS(kva_check(pool), KVA_ERR_CORRUPT);
    CHECK(strncmp(kva_last_error(), "C2: 1 blocks are withheld", 25) == 0);
    kva_get_stats(pool, &stats);
    /* Nobody received it: no live allocation, none counted, no free either. */
    CHECK(stats.live_allocations == 0);
    CHECK(stats.alloc_count == counted.alloc_count && stats.free_count == counted.free_count);
    CHECK(stats.bytes_in_use > 0); /* the withheld block's */
    CHECK(kva_usable_size(pool, p) == 0);
    CHECK_STATUS(kva_free(pool, p), KVA_ERR_DOUBLE_FREE); /* the stale pointer frees nothing */
    CHECK(strstr(kva_last_error(), "withheld") != NULL);
    void *next;
    CHECK_STATUS(alloc(pool, size, &next), KVA_OK);
    CHECK(next != p);
    CHECK_STATUS(kva_free(pool, next), KVA_OK);
    kva_get_stats(pool, &stats);
    CHECK(stats.live_allocations == 0);
    kva_pool_destroy(pool);
}

/* A pointer that is no allocation's start is judged by itself, not by the address a red zone
 * before it, which belongs to something else: the first byte of a live block after a free one
 * was called a double free ("lies in a free block"), a pointer into a free block after a live
 * one a bad pointer, and the red zone of a live slab object after a free one a double free. */
static void test_a_bad_pointer_is_judged_by_itself(void) {
    kva_pool *pool = make_checked();
    unsigned char *a, *b, *c, *d;
    REQUIRE(kva_alloc(pool, (size_t)1 << 20, (void **)&a) == KVA_OK);
    REQUIRE(kva_alloc(pool, (size_t)1 << 20, (void **)&b) == KVA_OK);
    REQUIRE(kva_alloc(pool, (size_t)1 << 20, (void **)&c) == KVA_OK);
    REQUIRE(kva_alloc(pool, (size_t)1 << 20, (void **)&d) == KVA_OK);
    REQUIRE(b - a == 2 << 20 && d - c == 2 << 20);
    CHECK_STATUS(kva_free(pool, a), KVA_OK);
    CHECK_STATUS(kva_free(pool, b - 16), KVA_ERR_BAD_POINTER); /* b's block's first byte */
    CHECK_STATUS(kva_free(pool, d), KVA_OK);
    CHECK_STATUS(kva_free(pool, d - 16 + 4), KVA_ERR_DOUBLE_FREE); /* inside d's free block */
    CHECK_STATUS(kva_free(pool, d - 16), KVA_ERR_DOUBLE_FREE);
    unsigned char *o[3];
    for (int i = 0; i < 3; i++) REQUIRE(kva_alloc(pool, 32, (void **)&o[i]) == KVA_OK);
    REQUIRE(o[2] - o[1] == 64 && o[1] - o[0] == 64); /* 32 B + two red zones: 64 B objects */
    CHECK_STATUS(kva_free(pool, o[1]), KVA_OK);
    CHECK_STATUS(kva_free(pool, o[2] - 16), KVA_ERR_BAD_POINTER); /* o[2]'s front red zone */
    CHECK_STATUS(kva_free(pool, o[2] - 8), KVA_ERR_BAD_POINTER);
    CHECK_STATUS(kva_free(pool, o[1] + 8), KVA_ERR_DOUBLE_FREE); /* inside the free o[1] */
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.live_allocations == 4);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    /* Foreign pointers below the pool: no size, and no pointer arithmetic that overflows
     * (UBSan stopped the test at kva_usable_size((void *)8)). */
    CHECK(kva_usable_size(pool, (void *)8) == 0);
    CHECK(kva_usable_size(pool, (void *)(uintptr_t)16) == 0);
    CHECK(kva_usable_size(pool, (void *)UINTPTR_MAX) == 0);
    CHECK_STATUS(kva_free(pool, (void *)8), KVA_ERR_BAD_POINTER);
    kva_pool_destroy(pool);
}

int main(void) {
    test_a_bad_pointer_is_judged_by_itself();
    run(kva_alloc, 64, "64 B slab object");
    run(kva_alloc, 4000, "4 KiB slab object");
    run(kva_alloc, (size_t)1 << 20, "1 MiB buddy block");
    run(exact, (size_t)3 << 20, "3 MiB exact range");

    kva_pool *pool = make_checked();
    void *p = (void *)0x1;
    CHECK_STATUS(kva_alloc_aligned(pool, 64, 64, &p), KVA_ERR_INVALID);
    CHECK_STATUS(kva_alloc_aligned(pool, 64, 16, &p), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    /* Alignments up to the red zone hold for every size, also where size + red zones falls in
     * a class that is not a multiple of 16 (40 B, 56 B): two neighbours of each. */
    for (size_t size = 1; size <= 200; size++)
        for (size_t alignment = 1; alignment <= 16; alignment *= 2) {
            void *q[2];
            for (int k = 0; k < 2; k++) {
                CHECK_STATUS(kva_alloc_aligned(pool, size, alignment, &q[k]), KVA_OK);
                if ((uintptr_t)q[k] % alignment) {
                    fprintf(stderr, "size %zu: %p is not %zu-aligned\n", size, q[k], alignment);
                    check_failures++;
                }
            }
            for (int k = 0; k < 2; k++) CHECK_STATUS(kva_free(pool, q[k]), KVA_OK);
        }
    /* The largest request that can succeed is the one the statistics give, red zones counted. */
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK_STATUS(kva_alloc(pool, st.max_alloc_size, &p), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    void *untouched = (void *)0x1;
    CHECK_STATUS(kva_alloc(pool, st.max_alloc_size + 1, &untouched), KVA_ERR_INVALID);
    CHECK(untouched == (void *)0x1);
    char said[64];
    snprintf(said, sizeof said, "size %zu ", st.max_alloc_size + 1);
    CHECK(strstr(kva_last_error(), said) != NULL); /* the size the caller asked for */
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);

    kva_config cfg;
    kva_config_init(&cfg);
    cfg.backend = KVA_BACKEND_CUDA;
    cfg.checked = 1;
    kva_pool *none = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &none), KVA_ERR_INVALID);
    CHECK(none == NULL);
    return CHECK_DONE();
}
