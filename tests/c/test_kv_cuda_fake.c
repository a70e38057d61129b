/*
 * test_kv_cuda_fake.c — the KV-cache manager on GPU memory: a CUDA pool over the fake driver of
 * tests/fake_cuda (its path is argv[1]). The fake's device memory is reserved PROT_NONE on the
 * host, so a manager that wrote a byte of KV memory (a header, a free-list link) would crash
 * this test: every piece of its state must live in host metadata.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kv_test.h"

#define MiB ((size_t)1 << 20)

static kva_pool *cuda_pool(size_t capacity) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.backend = KVA_BACKEND_CUDA;
    kva_pool *pool = NULL;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    return pool;
}

static void test_paged_on_gpu_memory(kva_kv_layout layout) {
    kva_pool *pool = cuda_pool(64 * MiB);
    kva_kv_config cfg = small_config(128, 16);
    cfg.layout = layout;
    kva_kv *kv = NULL;
    CHECK_STATUS(kva_kv_create(&cfg, pool, &kv), KVA_OK);
    REQUIRE(kv != NULL);
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    void *base;
    CHECK_STATUS(kva_pool_base(pool, &base), KVA_OK);
    void *last;
    CHECK_STATUS(kva_kv_block_address(kv, 127, 2, KVA_KV_V, &last), KVA_OK);
    CHECK((unsigned char *)info.base >= (unsigned char *)base);
    CHECK((unsigned char *)last + info.part_bytes <= (unsigned char *)info.base + info.kv_bytes);

    /* Every kind of call, with eviction and copy on write, and never a touch of the memory. */
    uint64_t rng = 99;
    kva_kv_seq live[32] = {0};
    for (int op = 0; op < 20000; op++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t r = (uint32_t)(rng >> 33);
        kva_kv_seq *s = &live[r % 32];
        kva_kv_copy copy;
        if (!*s) {
            uint64_t keys[6] = {r % 5, r % 7, r % 3, 4, 5, 6};
            kva_status st = kva_kv_seq_allocate(kv, 16 * 6 + r % 40, keys, 1 + r % 6, NULL, 0, r % 2, r % 8, s, NULL);
            CHECK(st == KVA_OK || st == KVA_ERR_NOMEM);
            if (st != KVA_OK) *s = 0;
        } else if (r % 5 == 0) {
            kva_kv_seq *other = &live[(r / 7) % 32];
            if (!*other) CHECK_STATUS(kva_kv_seq_fork(kv, *s, other), KVA_OK);
        } else if (r % 5 < 3) {
            kva_status st = kva_kv_seq_append(kv, *s, 1 + r % 20, &copy);
            CHECK(st == KVA_OK || st == KVA_ERR_NOMEM);
        } else {
            CHECK_STATUS(kva_kv_seq_free(kv, *s), KVA_OK);
            *s = 0;
        }
        if (op % 1000 == 0) CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    }
    for (int i = 0; i < 32; i++)
        if (live[i]) CHECK_STATUS(kva_kv_seq_free(kv, live[i]), KVA_OK);
    CHECK(stats(kv).evictions > 0 && stats(kv).cow_copies > 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_kv_destroy(kv);
    kva_stats ps;
    CHECK_STATUS(kva_get_stats(pool, &ps), KVA_OK);
    CHECK(ps.live_allocations == 0);
    kva_pool_destroy(pool);
}

static void test_contiguous_on_gpu_memory(void) {
    kva_pool *pool = cuda_pool(64 * MiB);
    kva_kv_config cfg = small_config(0, 16);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.max_context = 4096;
    kva_kv *kv = NULL;
    CHECK_STATUS(kva_kv_create(&cfg, pool, &kv), KVA_OK);
    REQUIRE(kv != NULL);
    kva_kv_seq s[8];
    for (int i = 0; i < 8; i++) CHECK_STATUS(kva_kv_seq_allocate(kv, 100, NULL, 0, NULL, 0, 0, 0, &s[i], NULL), KVA_OK);
    kva_kv_copy copy;
    for (int step = 0; step < 40; step++)
        for (int i = 0; i < 8; i++) CHECK_STATUS(kva_kv_seq_append(kv, s[i], 50, &copy), KVA_OK);
    CHECK(stats(kv).moves == 8 * 5); /* 128 -> 256 -> 512 -> 1024 -> 2048 -> 4096 */
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    for (int i = 0; i < 8; i++) CHECK_STATUS(kva_kv_seq_free(kv, s[i]), KVA_OK);
    kva_kv_destroy(kv);
    kva_stats ps;
    CHECK_STATUS(kva_get_stats(pool, &ps), KVA_OK);
    CHECK(ps.live_allocations == 0);
    kva_pool_destroy(pool);
}

/* Compaction, then trim, gives back every whole granule of each layer's region above the last
 * block that holds data (the pool's mapped bytes drop by exactly those), and the cache maps
 * them again when it needs those blocks; every state in between checks clean. */
static size_t mapped(kva_pool *pool) {
    kva_stats st;
    REQUIRE(kva_get_stats(pool, &st) == KVA_OK);
    return st.mapped_bytes;
}

static void test_trim_gives_granules_back(void) {
    kva_pool *pool = cuda_pool(64 * MiB);
    /* 16,384 blocks of 512 B per layer region (3 layers): 8 MiB a region, 4 granules of 2 MiB. */
    kva_kv_config cfg = small_config(16384, 16);
    cfg.layout = KVA_KV_LAYOUT_LAYERS;
    kva_kv *kv = NULL;
    CHECK_STATUS(kva_kv_create(&cfg, pool, &kv), KVA_OK);
    REQUIRE(kv != NULL);
    enum {
        SEQS = 64,
        BLOCKS = 256
    };
    kva_kv_seq seqs[SEQS];
    for (int i = 0; i < SEQS; i++)
        CHECK_STATUS(kva_kv_seq_allocate(kv, BLOCKS * 16, NULL, 0, NULL, 0, 0, 0, &seqs[i], NULL), KVA_OK);
    size_t full = mapped(pool);
    uint32_t trimmed = 99;
    CHECK_STATUS(kva_kv_trim(kv, &trimmed), KVA_OK); /* nothing free at the top */
    CHECK(trimmed == 0 && mapped(pool) == full);
    for (int i = 0; i < SEQS; i += 2) CHECK_STATUS(kva_kv_seq_free(kv, seqs[i]), KVA_OK);
    CHECK_STATUS(kva_kv_trim(kv, &trimmed), KVA_OK); /* the top sequence is live: still nothing */
    CHECK(trimmed == 0);
    static kva_kv_move moves[16384];
    uint32_t count = 0;
    CHECK_STATUS(kva_kv_compact(kv, moves, 16384, &count), KVA_OK);
    CHECK(count > 0);
    CHECK_STATUS(kva_kv_trim(kv, &trimmed), KVA_OK);
    CHECK(trimmed == 8192 && stats(kv).trimmed_blocks == 8192 && stats(kv).free_blocks == 0);
    /* Blocks [8192, 16384) of each region are its upper 4 MiB: two granules in each of 3. */
    CHECK(mapped(pool) == full - 3 * 2 * 2 * MiB);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    /* The trimmed blocks count for capacity; taking them maps their granules again. */
    for (int i = 0; i < SEQS; i += 2)
        CHECK_STATUS(kva_kv_seq_allocate(kv, BLOCKS * 16, NULL, 0, NULL, 0, 0, 0, &seqs[i], NULL), KVA_OK);
    CHECK(stats(kv).trimmed_blocks == 0 && mapped(pool) == full);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    /* Trimmed again and destroyed while trimmed: the free of the KV memory forgets the granules
     * given back (each is released once; kva_check's R1 would say otherwise). */
    for (int i = 1; i < SEQS; i += 2) CHECK_STATUS(kva_kv_seq_free(kv, seqs[i]), KVA_OK);
    CHECK_STATUS(kva_kv_compact(kv, moves, 16384, &count), KVA_OK);
    CHECK_STATUS(kva_kv_trim(kv, &trimmed), KVA_OK);
    CHECK(trimmed == 8192 && mapped(pool) == full - 12 * MiB);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(mapped(pool) == 0);
    kva_pool_destroy(pool);
}

/* Layers of different shapes: each layer region has its own block stride, and the trim gives
 * back the granules above the data of each. */
static void test_trim_regions_of_different_shapes(void) {
    kva_pool *pool = cuda_pool(64 * MiB);
    /* 16,384 blocks of 16 tokens in 2-byte elements: a K/V layer of 2 x 4 (512 B a block, an 8
     * MiB region), an MLA layer of 16 (512 B, 8 MiB) and a K/V layer of 4 x 4 (1 KiB, 16 MiB). */
    static const kva_kv_group groups[] = {{.layers = 1, .parts = 2, .kv_heads = 2, .head_dim = 4},
                                          {.layers = 1, .parts = 1, .kv_heads = 1, .head_dim = 16},
                                          {.layers = 1, .parts = 2, .kv_heads = 4, .head_dim = 4}};
    kva_kv_config cfg = small_config(16384, 16);
    cfg.layers = cfg.kv_heads = cfg.head_dim = 0;
    cfg.groups = groups;
    cfg.num_groups = 3;
    kva_kv *kv = NULL;
    CHECK_STATUS(kva_kv_create(&cfg, pool, &kv), KVA_OK);
    REQUIRE(kv != NULL);
    kva_kv_layer layer;
    CHECK_STATUS(kva_kv_layer_info(kv, 2, &layer), KVA_OK);
    CHECK(layer.offset == 16 * MiB && layer.block_stride == 1024);
    kva_kv_seq seqs[64];
    for (int i = 0; i < 64; i++)
        CHECK_STATUS(kva_kv_seq_allocate(kv, 256 * 16, NULL, 0, NULL, 0, 0, 0, &seqs[i], NULL), KVA_OK);
    size_t full = mapped(pool);
    for (int i = 0; i < 64; i += 2) CHECK_STATUS(kva_kv_seq_free(kv, seqs[i]), KVA_OK);
    static kva_kv_move moves[16384];
    uint32_t count = 0, trimmed = 0;
    CHECK_STATUS(kva_kv_compact(kv, moves, 16384, &count), KVA_OK);
    CHECK_STATUS(kva_kv_trim(kv, &trimmed), KVA_OK);
    /* Blocks [8192, 16384): the upper 4, 4 and 8 MiB of the three regions. */
    CHECK(trimmed == 8192 && mapped(pool) == full - 16 * MiB);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    for (int i = 0; i < 64; i += 2)
        CHECK_STATUS(kva_kv_seq_allocate(kv, 256 * 16, NULL, 0, NULL, 0, 0, 0, &seqs[i], NULL), KVA_OK);
    CHECK(stats(kv).trimmed_blocks == 0 && mapped(pool) == full);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* When the trimmed blocks' memory cannot be had (the driver out of memory), a call that cached
 * blocks can serve evicts them as before any trim; one they cannot serve fails with nothing
 * changed. A call takes back only the units of the blocks it lacks, not every trimmed block. */
static void (*fake_fail)(const char *function, unsigned long nth, int code);
static void (*fake_disarm)(void);
static void (*fake_granularity)(size_t bytes);

static void test_trim_then_no_device_memory(void) {
    fake_granularity(64 * 1024); /* 128 blocks of 512 B per granule and region */
    kva_pool *pool = cuda_pool(64 * MiB);
    kva_kv_config cfg = small_config(16384, 16);
    kva_kv *kv = NULL;
    CHECK_STATUS(kva_kv_create(&cfg, pool, &kv), KVA_OK);
    REQUIRE(kv != NULL);
    enum {
        SEQS = 64,
        BLOCKS = 256
    };
    static uint64_t keys[SEQS][BLOCKS];
    kva_kv_seq seqs[SEQS];
    for (int i = 0; i < SEQS; i++) {
        for (int k = 0; k < BLOCKS; k++) keys[i][k] = (uint64_t)i * 1000 + (uint64_t)k + 1;
        CHECK_STATUS(kva_kv_seq_allocate(kv, BLOCKS * 16, keys[i], BLOCKS, NULL, 0, 0, 0, &seqs[i], NULL), KVA_OK);
    }
    for (int i = 0; i < SEQS; i += 2) CHECK_STATUS(kva_kv_seq_free(kv, seqs[i]), KVA_OK); /* 8,192 cached */
    uint32_t evicted, count, trimmed;
    CHECK_STATUS(kva_kv_evict(kv, 4096, &evicted), KVA_OK); /* 4,096 free, 4,096 cached */
    static kva_kv_move moves[16384];
    CHECK_STATUS(kva_kv_compact(kv, moves, 16384, &count), KVA_OK);
    CHECK_STATUS(kva_kv_trim(kv, &trimmed), KVA_OK);
    CHECK(trimmed == 4096 && stats(kv).cached_blocks == 4096 && stats(kv).free_blocks == 0);
    /* One block: one granule per region taken back, not the 4,096 blocks' 32. */
    size_t before = mapped(pool);
    kva_kv_seq one;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 16, NULL, 0, NULL, 0, 0, 0, &one, NULL), KVA_OK);
    CHECK(mapped(pool) - before == 3 * 64 * 1024 && stats(kv).trimmed_blocks == 4095);
    CHECK_STATUS(kva_kv_seq_free(kv, one), KVA_OK);
    /* Out of device memory: a request the cached blocks cover evicts them instead. */
    kva_kv_stats now = stats(kv);
    fake_fail("cuMemCreate", 1, 2 /* CUDA_ERROR_OUT_OF_MEMORY */);
    CHECK_STATUS(kva_kv_seq_allocate(kv, (now.free_blocks + 300) * 16, NULL, 0, NULL, 0, 0, 0, &one, NULL), KVA_OK);
    fake_disarm();
    CHECK(stats(kv).evictions == now.evictions + 300 && stats(kv).trimmed_blocks == now.trimmed_blocks);
    CHECK_STATUS(kva_kv_seq_free(kv, one), KVA_OK);
    /* A request only the trimmed blocks could complete: refused, nothing changed. */
    now = stats(kv);
    fake_fail("cuMemCreate", 1, 2);
    CHECK_STATUS(
        kva_kv_seq_allocate(kv, (now.free_blocks + now.cached_blocks + 1) * 16, NULL, 0, NULL, 0, 0, 0, &one, NULL),
        KVA_ERR_NOMEM);
    fake_disarm();
    kva_kv_stats after = stats(kv);
    CHECK(after.free_blocks == now.free_blocks && after.cached_blocks == now.cached_blocks &&
          after.trimmed_blocks == now.trimmed_blocks && after.used_blocks == now.used_blocks &&
          after.evictions == now.evictions);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_kv_destroy(kv);
    kva_pool_destroy(pool);
    fake_granularity(2 * MiB);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s path/to/libfakecuda.so\n", argv[0]);
        return 2;
    }
    setenv("KVA_CUDA_DRIVER", argv[1], 1);
    void *fake = dlopen(argv[1], RTLD_NOW);
    REQUIRE(fake != NULL);
    *(void **)&fake_fail = dlsym(fake, "fake_cuda_fail");
    *(void **)&fake_disarm = dlsym(fake, "fake_cuda_disarm");
    *(void **)&fake_granularity = dlsym(fake, "fake_cuda_set_granularity");
    REQUIRE(fake_fail && fake_disarm && fake_granularity);
    test_paged_on_gpu_memory(KVA_KV_LAYOUT_LAYERS);
    test_paged_on_gpu_memory(KVA_KV_LAYOUT_BLOCKS);
    test_contiguous_on_gpu_memory();
    test_trim_gives_granules_back();
    test_trim_regions_of_different_shapes();
    test_trim_then_no_device_memory();
    return CHECK_DONE();
}
