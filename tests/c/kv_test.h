/*
 * kv_test.h — small helpers shared by the KV-cache tests: a tiny geometry, and calls that
 * REQUIRE success so a test reads as the behaviour it checks.
 */
#ifndef KVA_KV_TEST_H
#define KVA_KV_TEST_H

#include <string.h>

#include "check.h"
#include "kvalloc.h"

#define SENTINEL_KV ((kva_kv *)0x5e5e5e5e)

/* 3 layers, 2 KV heads of dimension 4 in 2-byte elements: 96 bytes per token. */
static inline kva_kv_config small_config(uint32_t num_blocks, uint32_t block_tokens) {
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = 3;
    cfg.kv_heads = 2;
    cfg.head_dim = 4;
    cfg.dtype_bytes = 2;
    cfg.block_tokens = block_tokens;
    cfg.num_blocks = num_blocks;
    cfg.pages = KVA_PAGES_SMALL;
    return cfg;
}

static inline kva_kv *make_cache(const kva_kv_config *cfg) {
    kva_kv *kv = NULL;
    REQUIRE(kva_kv_create(cfg, NULL, &kv) == KVA_OK);
    return kv;
}

static inline kva_kv_stats stats(kva_kv *kv) {
    kva_kv_stats st;
    REQUIRE(kva_kv_get_stats(kv, &st) == KVA_OK);
    return st;
}

static inline size_t block_bytes(kva_kv *kv) {
    kva_kv_info info;
    REQUIRE(kva_kv_get_info(kv, &info) == KVA_OK);
    return info.block_bytes;
}

static inline uint32_t table_len(kva_kv *kv, kva_kv_seq seq) {
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, seq, &table, &len) == KVA_OK);
    return len;
}

/* Copies up to cap entries of the table into out; returns the table's length. */
static inline uint32_t copy_table(kva_kv *kv, kva_kv_seq seq, uint32_t *out, uint32_t cap) {
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, seq, &table, &len) == KVA_OK);
    memcpy(out, table, (len < cap ? len : cap) * sizeof *out);
    return len;
}

static inline kva_kv_seq alloc_keys(kva_kv *kv, uint32_t tokens, const uint64_t *keys, uint32_t nkeys, uint32_t ns,
                                    uint32_t priority, uint32_t *cached) {
    kva_kv_seq seq = 0;
    REQUIRE(kva_kv_seq_allocate(kv, tokens, keys, nkeys, NULL, 0, ns, priority, &seq, cached) == KVA_OK);
    return seq;
}

static inline kva_kv_seq alloc_plain(kva_kv *kv, uint32_t tokens) {
    return alloc_keys(kv, tokens, NULL, 0, 0, 0, NULL);
}

static inline int kva_is_pow2_test(uint64_t x) { return x && !(x & (x - 1)); }

#endif
