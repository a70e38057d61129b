/*
 * test_external.c — pools over memory the caller owns (kva_config.external): the library
 * manages the range's blocks and never touches the range. The ranges here are reserved
 * PROT_NONE, so a single read or write of one by the library would be a SIGSEGV; the memory the
 * test itself reads and writes is made accessible first. Also: the alignment rule and the
 * largest block, the options that do not apply, the registry of ranges (no overlap), a CUDA
 * external range with no driver at all, and kva_check, the walk, the statistics and the
 * statistics segment over it.
 */
#include <stdint.h>
#include <sys/mman.h>

#include "check.h"
#include "pool_fingerprint.h"

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)

/* length bytes of inaccessible address space whose start is aligned to `align` but not to
 * 2 * align (so that the test knows the largest block exactly). */
static unsigned char *reserve_exact(size_t length, size_t align) {
    size_t span = length + 4 * align;
    unsigned char *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(raw != MAP_FAILED);
    uintptr_t at = ((uintptr_t)raw + 2 * align - 1) & ~(uintptr_t)(2 * align - 1);
    at += align; /* aligned to align, not to 2 * align */
    return (unsigned char *)at;
}

static kva_config external_config(void *base, size_t length) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.external = base;
    cfg.capacity = length;
    return cfg;
}

static int count_live(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    (void)offset, (void)size;
    if (kind == KVA_WALK_BLOCK || kind == KVA_WALK_SLAB_OBJECT) ++*(int *)ctx;
    return 0;
}

/* The library allocates over a range it must never touch. */
static void test_untouched_range(void) {
    size_t length = 32 * MiB, align = 2 * MiB;
    unsigned char *base = reserve_exact(length, align);
    kva_config cfg = external_config(base, length);
    cfg.name = "external-test";
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    void *got = NULL;
    CHECK_STATUS(kva_pool_base(pool, &got), KVA_OK);
    CHECK(got == base);

    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.page_kind == KVA_PAGE_KIND_EXTERNAL);
    CHECK(st.capacity == length && st.mapped_bytes == length);
    CHECK(st.max_alloc_size == align); /* the base's alignment caps the largest block */
    CHECK(st.backend == KVA_BACKEND_HOST && !st.locked && !st.pinned && st.numa_node == -1);

    void *small[64], *large[4];
    for (int i = 0; i < 64; i++) {
        CHECK_STATUS(kva_alloc(pool, 48 + (size_t)(i % 4) * 1000, &small[i]), KVA_OK);
        CHECK((unsigned char *)small[i] >= base && (unsigned char *)small[i] < base + length);
    }
    for (int i = 0; i < 4; i++) {
        CHECK_STATUS(kva_alloc(pool, align, &large[i]), KVA_OK);
        CHECK(((uintptr_t)large[i] & (align - 1)) == 0);
        CHECK((unsigned char *)large[i] + align <= base + length);
    }
    void *too_big = NULL;
    CHECK_STATUS(kva_alloc(pool, 2 * align, &too_big), KVA_ERR_INVALID);
    CHECK(too_big == NULL);
    void *exact = NULL;
    CHECK_STATUS(kva_alloc_exact(pool, 3 * 4096, &exact), KVA_OK);

    int live = 0;
    CHECK_STATUS(kva_walk(pool, count_live, &live), KVA_OK);
    CHECK(live == 64 + 4 + 1);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    CHECK(kva_stats_segment_name(pool) != NULL);
    CHECK_STATUS(kva_trim(pool), KVA_OK); /* nothing to give back: the range is the caller's */

    /* The caller reads and writes its blocks; the library did not need to. */
    REQUIRE(mprotect(large[0], align, PROT_READ | PROT_WRITE) == 0);
    memset(large[0], 0x5a, align);

    for (int i = 0; i < 64; i++) CHECK_STATUS(kva_free(pool, small[i]), KVA_OK);
    for (int i = 0; i < 4; i++) CHECK_STATUS(kva_free(pool, large[i]), KVA_OK);
    CHECK_STATUS(kva_free(pool, exact), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);

    /* Still mapped, with what the caller wrote: destroying the pool unmapped nothing. */
    CHECK(((unsigned char *)large[0])[0] == 0x5a && ((unsigned char *)large[0])[align - 1] == 0x5a);
}

/* A range aligned to 64 KiB only: the automatic slab chunk and the largest block follow it. */
static void test_small_alignment(void) {
    size_t length = 4 * MiB, align = 64 * KiB;
    unsigned char *base = reserve_exact(length, align);
    kva_config cfg = external_config(base, length);
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.max_alloc_size == align && st.slab_chunk == align);
    void *p = NULL;
    CHECK_STATUS(kva_alloc(pool, align, &p), KVA_OK);
    CHECK_STATUS(kva_alloc_aligned(pool, 4096, 2 * align, &p), KVA_ERR_INVALID);
    void *objects[256];
    for (int i = 0; i < 256; i++) CHECK_STATUS(kva_alloc(pool, 1000, &objects[i]), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);

    /* An explicit slab chunk beyond the base's alignment is refused. */
    cfg.slab_chunk = 2 * align;
    pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_INVALID);
    CHECK(pool == NULL);
}

static void expect_refused(kva_config cfg, const char *what) {
    kva_pool *pool = NULL;
    kva_status st = kva_pool_create(&cfg, &pool);
    if (st != KVA_ERR_INVALID || pool != NULL) {
        fprintf(stderr, "%s: expected KVA_ERR_INVALID, got %d (%s)\n", what, (int)st, kva_last_error());
        check_failures++;
        kva_pool_destroy(pool);
    }
}

static void test_refusals(void) {
    size_t length = 8 * MiB, align = 2 * MiB;
    unsigned char *base = reserve_exact(length, align);
    kva_config cfg = external_config(base, length);

    kva_config c = cfg;
    c.capacity = length - 100;
    expect_refused(c, "a length that is not a page multiple");
    c = cfg;
    c.external = base + 512;
    expect_refused(c, "a base that is not page aligned");
    c = cfg;
    c.external = base + 4096;
    c.capacity = length - 4096;
    expect_refused(c, "a base aligned to one page only (slabs need 64 KiB)");
    c = cfg;
    c.external = (void *)(UINTPTR_MAX & ~(uintptr_t)(align - 1));
    expect_refused(c, "a range that wraps around the address space");

    const char *options[] = {"pages", "prefault", "lock", "pin", "numa_node", "trim_watermark", "checked", "shared"};
    for (int i = 0; i < 8; i++) {
        c = cfg;
        switch (i) {
        case 0: c.pages = KVA_PAGES_SMALL; break;
        case 1: c.prefault = 1; break;
        case 2: c.lock = 1; break;
        case 3: c.pin = 1; break;
        case 4: c.numa_node = 0; break;
        case 5: c.trim_watermark = MiB; break;
        case 6: c.checked = 1; break;
        case 7: c.shared = 1; break;
        }
        kva_pool *pool = NULL;
        CHECK_STATUS(kva_pool_create(&c, &pool), KVA_ERR_INVALID);
        CHECK(pool == NULL);
        CHECK(strstr(kva_last_error(), options[i]) != NULL);
    }

    /* One range, one pool: every overlap is refused while the first pool lives. */
    kva_pool *first = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &first), KVA_OK);
    REQUIRE(first);
    void *block = NULL;
    CHECK_STATUS(kva_alloc(first, 4096, &block), KVA_OK);
    snapshot before = take(first);
    expect_refused(cfg, "the same range twice");
    c = cfg;
    c.external = base + length - align;
    c.capacity = 2 * align;
    expect_refused(c, "a range overlapping the end of a live one");
    c = cfg;
    c.external = base - align;
    c.capacity = 2 * align;
    expect_refused(c, "a range overlapping the start of a live one");
    c = cfg;
    c.external = base + align;
    c.capacity = align;
    expect_refused(c, "a range inside a live one");
    CHECK(unchanged(first, &before));

    /* A neighbour that only touches it is another range. */
    c = cfg;
    c.external = base + length;
    c.capacity = align;
    kva_pool *neighbour = NULL;
    CHECK_STATUS(kva_pool_create(&c, &neighbour), KVA_OK);
    kva_pool_destroy(neighbour);
    kva_pool_destroy(first);

    /* Destroyed, the range is free for a new pool. */
    kva_pool *again = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &again), KVA_OK);
    kva_pool_destroy(again);
}

/* Device memory the caller owns: no driver is loaded (none exists here, and the variable
 * points at nothing), and the addresses are managed all the same. */
static void test_cuda_external(void) {
    setenv("KVA_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
    size_t length = 32 * MiB, align = 4 * MiB;
    unsigned char *base = reserve_exact(length, align); /* stands for a device address range */
    kva_config cfg = external_config(base, length);
    cfg.backend = KVA_BACKEND_CUDA;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.backend == KVA_BACKEND_CUDA && st.page_kind == KVA_PAGE_KIND_EXTERNAL && st.mapped_bytes == length);
    void *p = NULL, *q = NULL;
    CHECK_STATUS(kva_alloc(pool, align, &p), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 100, &q), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_ERR_DOUBLE_FREE);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);

    /* Options of a CUDA pool that do not apply to a range it does not map. */
    cfg.prefault = 1;
    expect_refused(cfg, "prefault on a CUDA external range");
    cfg.prefault = 0;
    cfg.trim_watermark = MiB;
    expect_refused(cfg, "trim_watermark on a CUDA external range");
    unsetenv("KVA_CUDA_DRIVER");
}

/* A variable-size pool and a KV-style use over an external host range that the test reads and
 * writes: the blocks hold what was written. */
static void test_contents(void) {
    size_t length = 8 * MiB;
    unsigned char *base = mmap(NULL, length + 2 * MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(base != MAP_FAILED);
    unsigned char *aligned = (unsigned char *)(((uintptr_t)base + 2 * MiB - 1) & ~(uintptr_t)(2 * MiB - 1));
    memset(aligned, 0xa5, length);
    kva_config cfg = external_config(aligned, length);
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    /* Creating the pool wrote nothing into the range. */
    size_t changed = 0;
    for (size_t i = 0; i < length; i++) changed += aligned[i] != 0xa5;
    CHECK(changed == 0);
    void *blocks[16];
    for (int i = 0; i < 16; i++) {
        CHECK_STATUS(kva_alloc(pool, 64 * KiB, &blocks[i]), KVA_OK);
        memset(blocks[i], i, 64 * KiB);
    }
    for (int i = 0; i < 16; i++) CHECK(((unsigned char *)blocks[i])[64 * KiB - 1] == (unsigned char)i);
    for (int i = 0; i < 16; i += 2) CHECK_STATUS(kva_free(pool, blocks[i]), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    /* Freed and trimmed, the memory kept its contents: nothing was discarded. */
    CHECK(((unsigned char *)blocks[0])[0] == 0 && ((unsigned char *)blocks[2])[100] == 2);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
    CHECK(((unsigned char *)blocks[1])[7] == 1);
    munmap(base, length + 2 * MiB);
}

int main(void) {
    test_untouched_range();
    test_small_alignment();
    test_refusals();
    test_cuda_external();
    test_contents();
    return CHECK_DONE();
}
