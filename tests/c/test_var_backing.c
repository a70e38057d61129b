/*
 * test_var_backing.c — kva_var_backing_config: the pool it describes holds the variable-size
 * pool's range (red zones included for a checked pool), keeps its block count in 32 bits, takes
 * base pages where transparent huge pages are denied, and bad input changes nothing.
 */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "os.h"

static kva_var_config var_config(size_t capacity, size_t alignment) {
    kva_var_config cfg;
    kva_var_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.alignment = alignment;
    return cfg;
}

static kva_config backing(const kva_var_config *cfg, int checked) {
    kva_config pool;
    kva_config_init(&pool);
    pool.checked = checked;
    CHECK_STATUS(kva_var_backing_config(cfg, &pool), KVA_OK);
    return pool;
}

static void test_sizes(void) {
    size_t MiB = (size_t)1 << 20;
    kva_var_config cfg = var_config(4 * MiB, 256);
    CHECK(backing(&cfg, 0).capacity == 4 * MiB);
    cfg = var_config(3 * MiB + 100, 4096);
    CHECK(backing(&cfg, 0).capacity == 4 * MiB);
    cfg = var_config(MiB + 100, 256); /* rounded down to the alignment first: exactly 1 MiB */
    CHECK(backing(&cfg, 0).capacity == MiB);
    cfg = var_config(4096, 256); /* never below 1 MiB */
    CHECK(backing(&cfg, 0).capacity == MiB);
    /* A checked pool's red zones need room beyond a power-of-two range. */
    cfg = var_config(MiB, 16);
    CHECK(backing(&cfg, 1).capacity == 2 * MiB);
    /* The defaults of every other field are kept. */
    kva_config pool = backing(&cfg, 0), defaults;
    kva_config_init(&defaults);
    CHECK(pool.min_block == defaults.min_block && pool.slab_chunk == defaults.slab_chunk);
    CHECK(pool.backend == defaults.backend && pool.numa_node == defaults.numa_node && !pool.checked);
}

static void test_block_indices_stay_32_bit(void) {
    /* 16 TiB in 4 KiB blocks is 2^32 blocks, one too many: 8 KiB blocks. */
    kva_var_config cfg = var_config((size_t)1 << 44, (size_t)1 << 30);
    kva_config pool = backing(&cfg, 0);
    CHECK(pool.capacity == (size_t)1 << 44 && pool.min_block == 8192);
    cfg = var_config(((size_t)1 << 44) - 4096, 4096);
    pool = backing(&cfg, 0);
    CHECK(pool.capacity == (size_t)1 << 44 && pool.min_block == 8192);
    cfg = var_config((size_t)1 << 43, 4096);
    CHECK(backing(&cfg, 0).min_block == 4096);
    cfg = var_config((size_t)1 << 57, (size_t)1 << 30); /* the largest pool: 2^31 blocks of 64 MiB */
    pool = backing(&cfg, 0);
    CHECK(pool.capacity == (size_t)1 << 57 && pool.min_block == (size_t)64 << 20);
    /* A larger block the caller set stays. */
    cfg = var_config((size_t)1 << 43, 4096);
    kva_config_init(&pool);
    pool.min_block = 65536;
    CHECK_STATUS(kva_var_backing_config(&cfg, &pool), KVA_OK);
    CHECK(pool.min_block == 65536);
}

static void test_pages(void) {
    kva_var_config cfg = var_config((size_t)1 << 20, 256);
    kva_page_mode thp = kva_os_thp_unavailable() ? KVA_PAGES_SMALL : KVA_PAGES_THP;
    CHECK(backing(&cfg, 0).pages == thp); /* the default, KVA_PAGES_THP */
    cfg.pages = KVA_PAGES_SMALL;
    CHECK(backing(&cfg, 0).pages == KVA_PAGES_SMALL);
    cfg.pages = KVA_PAGES_HUGETLB; /* named, not a preference: kva_pool_create uses or refuses it */
    CHECK(backing(&cfg, 0).pages == KVA_PAGES_HUGETLB);
    /* A CUDA pool takes only KVA_PAGES_AUTO: its pages are left alone. */
    kva_config pool;
    kva_config_init(&pool);
    pool.backend = KVA_BACKEND_CUDA;
    cfg.pages = KVA_PAGES_THP;
    CHECK_STATUS(kva_var_backing_config(&cfg, &pool), KVA_OK);
    CHECK(pool.pages == KVA_PAGES_AUTO);
}

static void test_bad_input_changes_nothing(void) {
    kva_config pool, before;
    kva_config_init(&pool);
    pool.name = "untouched";
    before = pool;
    kva_var_config cfg = var_config(((size_t)1 << 63) + 4096, 4096); /* no power of two above */
    CHECK_STATUS(kva_var_backing_config(&cfg, &pool), KVA_ERR_INVALID);
    CHECK(strstr(kva_last_error(), "capacity 9223372036854779904") != NULL);
    cfg = var_config(((size_t)1 << 63) + 1, 256); /* 2^63 after rounding: too many blocks */
    CHECK_STATUS(kva_var_backing_config(&cfg, &pool), KVA_ERR_INVALID);
    CHECK(strstr(kva_last_error(), "capacity 9223372036854775809 is more than a pool") != NULL);
    cfg = var_config((size_t)1 << 58, 4096); /* 2^32 blocks of 64 MiB, the largest */
    CHECK_STATUS(kva_var_backing_config(&cfg, &pool), KVA_ERR_INVALID);
    cfg = var_config(SIZE_MAX - 8, 16); /* the red zones would wrap */
    pool.checked = 1;
    before.checked = 1;
    CHECK_STATUS(kva_var_backing_config(&cfg, &pool), KVA_ERR_INVALID);
    cfg = var_config((size_t)1 << 20, 256);
    cfg.pages = (kva_page_mode)7;
    CHECK_STATUS(kva_var_backing_config(&cfg, &pool), KVA_ERR_INVALID);
    CHECK(memcmp(&pool, &before, sizeof pool) == 0);
    CHECK_STATUS(kva_var_backing_config(NULL, &pool), KVA_ERR_INVALID);
    CHECK_STATUS(kva_var_backing_config(&cfg, NULL), KVA_ERR_INVALID);
}

/* The pool described is one kva_var_create takes: plain, and checked with 16 B alignment at a
 * power-of-two capacity (whose red zones need the next power of two). */
static void test_the_pool_backs_the_var_pool(int checked) {
    kva_var_config cfg = var_config((size_t)1 << 20, checked ? 16 : 256);
    cfg.pages = KVA_PAGES_SMALL;
    kva_config pc = backing(&cfg, checked);
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&pc, &pool), KVA_OK);
    REQUIRE(pool != NULL);
    kva_var *var = NULL;
    CHECK_STATUS(kva_var_create(&cfg, pool, &var), KVA_OK);
    REQUIRE(var != NULL);
    void *p;
    CHECK_STATUS(kva_var_alloc(var, (size_t)1 << 20, &p), KVA_OK);
    CHECK_STATUS(kva_var_free(var, p), KVA_OK);
    CHECK_STATUS(kva_var_check(var), KVA_OK);
    kva_var_destroy(var);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

int main(void) {
    test_sizes();
    test_block_indices_stay_32_bit();
    test_pages();
    test_bad_input_changes_nothing();
    test_the_pool_backs_the_var_pool(0);
    test_the_pool_backs_the_var_pool(1);
    return CHECK_DONE();
}
