/*
 * test_kv_groups.c — caches whose layers differ in shape (kva_kv_config.groups): K/V layers of
 * different head counts beside an MLA layer of one latent vector per token. Every part of every
 * layer of every block is where kva_kv_layer_info says, the parts tile the KV memory exactly in
 * both layouts, a part a layer lacks is refused, bad groups change nothing, and trimming the
 * layers' regions of different strides gives back and takes back their memory.
 */
#include "kv_test.h"

/* 2 K/V layers of 2 x 4, 1 MLA layer of 12, 2 K/V layers of 1 x 8, in 2-byte elements. */
static const kva_kv_group HYBRID[] = {
    {.layers = 2, .parts = 2, .kv_heads = 2, .head_dim = 4},
    {.layers = 1, .parts = 1, .kv_heads = 1, .head_dim = 12},
    {.layers = 2, .parts = 2, .kv_heads = 1, .head_dim = 8},
};
#define HYBRID_LAYERS 5

static kva_kv_config hybrid_config(uint32_t num_blocks, kva_kv_layout layout) {
    kva_kv_config cfg = small_config(num_blocks, 4);
    cfg.layers = cfg.kv_heads = cfg.head_dim = 0;
    cfg.groups = HYBRID;
    cfg.num_groups = 3;
    cfg.layout = layout;
    return cfg;
}

static void test_parts_tile_the_memory(kva_kv_layout layout) {
    kva_kv_config cfg = hybrid_config(6, layout);
    size_t block;
    CHECK_STATUS(kva_kv_block_bytes(&cfg, &block), KVA_OK);
    CHECK(block == 4 * (2 * 2 * 2 * 4 * 2 + 1 * 12 * 2 + 2 * 2 * 8 * 2));
    kva_kv *kv = make_cache(&cfg);
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    CHECK(info.layers == HYBRID_LAYERS && info.block_bytes == block && info.kv_bytes == 6 * block);
    /* No one shape: the uniform fields are 0 (the blocks layout keeps its one block stride). */
    CHECK(info.kv_heads == 0 && info.head_dim == 0 && info.part_bytes == 0 && info.layer_stride == 0);
    CHECK(info.block_stride == (layout == KVA_KV_LAYOUT_BLOCKS ? block : 0));
    unsigned char *base = info.base;
    memset(base, 0, info.kv_bytes);
    static const uint32_t group_of[HYBRID_LAYERS] = {0, 0, 1, 2, 2};
    unsigned tag = 0;
    size_t covered = 0;
    for (uint32_t l = 0; l < HYBRID_LAYERS; l++) {
        kva_kv_layer layer;
        CHECK_STATUS(kva_kv_layer_info(kv, l, &layer), KVA_OK);
        const kva_kv_group *g = &HYBRID[group_of[l]];
        CHECK(layer.group == group_of[l] && layer.parts == g->parts && layer.kv_heads == g->kv_heads);
        CHECK(layer.head_dim == g->head_dim && layer.slot_bytes == (size_t)g->kv_heads * g->head_dim * 2);
        CHECK(layer.part_bytes == layer.slot_bytes * 4);
        for (uint32_t b = 0; b < 6; b++)
            for (uint32_t p = 0; p < 2; p++) {
                void *at = NULL;
                if (p >= layer.parts) { /* the MLA layer has no V */
                    CHECK_STATUS(kva_kv_block_address(kv, b, l, KVA_KV_V, &at), KVA_ERR_INVALID);
                    CHECK(at == NULL);
                    continue;
                }
                CHECK_STATUS(kva_kv_block_address(kv, b, l, (kva_kv_part)p, &at), KVA_OK);
                unsigned char *u = at;
                CHECK(u == base + layer.offset + b * layer.block_stride + p * layer.part_bytes);
                CHECK(u >= base && u + layer.part_bytes <= base + info.kv_bytes);
                for (size_t i = 0; i < layer.part_bytes; i++) CHECK(u[i] == 0); /* no overlap */
                memset(u, (int)++tag, layer.part_bytes);
                covered += layer.part_bytes;
            }
    }
    CHECK(covered == info.kv_bytes); /* and no gap */
    kva_kv_layer layer;
    CHECK_STATUS(kva_kv_layer_info(kv, HYBRID_LAYERS, &layer), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

static void test_one_mla_group_is_uniform(void) {
    kva_kv_group mla = {.layers = 3, .parts = 1, .kv_heads = 1, .head_dim = 576};
    kva_kv_config cfg = small_config(8, 16);
    cfg.layers = cfg.kv_heads = cfg.head_dim = 0;
    cfg.groups = &mla;
    cfg.num_groups = 1;
    kva_kv *kv = make_cache(&cfg);
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    CHECK(info.kv_heads == 1 && info.head_dim == 576 && info.slot_bytes == 1152);
    CHECK(info.part_bytes == 1152 * 16 && info.block_bytes == 3 * info.part_bytes);
    CHECK(info.block_stride == info.part_bytes && info.layer_stride == info.part_bytes * 8);
    void *k = NULL, *v = NULL;
    CHECK_STATUS(kva_kv_block_address(kv, 5, 2, KVA_KV_K, &k), KVA_OK);
    CHECK((unsigned char *)k == (unsigned char *)info.base + 2 * info.layer_stride + 5 * info.block_stride);
    CHECK_STATUS(kva_kv_block_address(kv, 5, 2, KVA_KV_V, &v), KVA_ERR_INVALID);
    kva_kv_layer layer;
    CHECK_STATUS(kva_kv_layer_info(kv, 2, &layer), KVA_OK);
    CHECK(layer.parts == 1 && layer.offset == 2 * info.layer_stride && layer.block_stride == info.block_stride);
    kva_kv_destroy(kv);
}

static void test_bad_groups_are_refused(void) {
    kva_kv_group bad[KVA_KV_MAX_GROUPS + 1];
    for (unsigned i = 0; i <= KVA_KV_MAX_GROUPS; i++)
        bad[i] = (kva_kv_group){.layers = 1, .parts = 2, .kv_heads = 1, .head_dim = 8};
    kva_kv *kv = SENTINEL_KV;
    size_t bytes = 7;
    kva_kv_config cfg = hybrid_config(4, KVA_KV_LAYOUT_LAYERS);
    cfg.layers = 3; /* both ways at once */
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &kv), KVA_ERR_INVALID);
    cfg = hybrid_config(4, KVA_KV_LAYOUT_LAYERS);
    cfg.num_groups = 0; /* an array without a count */
    CHECK_STATUS(kva_kv_block_bytes(&cfg, &bytes), KVA_ERR_INVALID);
    cfg = hybrid_config(4, KVA_KV_LAYOUT_LAYERS);
    cfg.groups = NULL; /* a count without an array */
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &kv), KVA_ERR_INVALID);
    cfg = hybrid_config(4, KVA_KV_LAYOUT_LAYERS);
    cfg.groups = bad;
    cfg.num_groups = KVA_KV_MAX_GROUPS + 1;
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &kv), KVA_ERR_INVALID);
    bad[1].parts = 3;
    cfg.num_groups = 2;
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &kv), KVA_ERR_INVALID);
    bad[1].parts = 2;
    bad[1].head_dim = 0;
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &kv), KVA_ERR_INVALID);
    bad[1].head_dim = 8;
    bad[0].layers = KVA_KV_MAX_LAYERS; /* with group 1's layer, one too many */
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &kv), KVA_ERR_INVALID);
    bad[0].layers = 1;
    bad[0].head_dim = UINT32_MAX; /* bytes per block overflow */
    bad[0].kv_heads = UINT32_MAX;
    CHECK_STATUS(kva_kv_block_bytes(&cfg, &bytes), KVA_ERR_INVALID);
    cfg = hybrid_config(0, KVA_KV_LAYOUT_LAYERS);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.capacity_bytes = 1 << 20;
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &kv), KVA_ERR_INVALID);
    CHECK(kv == SENTINEL_KV && bytes == 7);
}

/* Compaction and trim over regions of different block strides: every unit given back is taken
 * back when the blocks are needed again, and the cache stays consistent. */
static void test_trim_regions_of_different_strides(void) {
    kva_kv_config cfg = hybrid_config(2048, KVA_KV_LAYOUT_LAYERS);
    kva_kv *kv = make_cache(&cfg);
    kva_kv_seq seqs[64];
    for (int i = 0; i < 64; i++)
        CHECK_STATUS(kva_kv_seq_allocate(kv, 4 * 32, NULL, 0, NULL, 0, 0, 0, &seqs[i], NULL), KVA_OK);
    for (int i = 0; i < 64; i += 2) CHECK_STATUS(kva_kv_seq_free(kv, seqs[i]), KVA_OK);
    uint32_t count = 0, trimmed = 0;
    static kva_kv_move moves[2048];
    CHECK_STATUS(kva_kv_compact(kv, moves, 2048, &count), KVA_OK);
    CHECK_STATUS(kva_kv_trim(kv, &trimmed), KVA_OK);
    CHECK(trimmed > 0 && stats(kv).trimmed_blocks == trimmed);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_seq all;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 4 * (2048 - 32 * 32), NULL, 0, NULL, 0, 0, 0, &all, NULL), KVA_OK);
    CHECK(stats(kv).trimmed_blocks == 0 && stats(kv).free_blocks == 0);
    /* Every block's every part is memory again: write all of it. */
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    memset(info.base, 0xab, info.kv_bytes);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* A named cache publishes: the heap map paints each layer's region by its own block stride
 * (kva_kv_info's uniform strides are 0 here). */
static void test_named_cache_publishes(kva_kv_layout layout) {
    kva_kv_config cfg = hybrid_config(4096, layout);
    cfg.name = layout == KVA_KV_LAYOUT_LAYERS ? "kvgroups-layers" : "kvgroups-blocks";
    kva_kv *kv = make_cache(&cfg);
    kva_kv_seq seq;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 4 * 1000, NULL, 0, NULL, 0, 0, 0, &seq, NULL), KVA_OK);
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    CHECK_STATUS(kva_stats_publish(info.pool), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, seq), KVA_OK);
    CHECK_STATUS(kva_stats_publish(info.pool), KVA_OK);
    kva_kv_destroy(kv);
}

int main(void) {
    test_parts_tile_the_memory(KVA_KV_LAYOUT_LAYERS);
    test_parts_tile_the_memory(KVA_KV_LAYOUT_BLOCKS);
    test_one_mla_group_is_uniform();
    test_bad_groups_are_refused();
    test_trim_regions_of_different_strides();
    test_named_cache_publishes(KVA_KV_LAYOUT_LAYERS);
    test_named_cache_publishes(KVA_KV_LAYOUT_BLOCKS);
    return CHECK_DONE();
}
