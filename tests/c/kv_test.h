/*
 * kv_test.h — small helpers shared by the KV-cache tests: a tiny geometry, and calls that
 * REQUIRE success so a test reads as the behaviour it checks.
 */
#ifndef KVA_KV_TEST_H
#define KVA_KV_TEST_H

#include <string.h>

#include "check.h"
#include "kv_cache.h"
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

/* Content of each kind, for kva_kv_seq_admit and the calls that take content. */
static inline kva_kv_content tokens_content(const uint32_t *tokens) {
    return (kva_kv_content){.kind = KVA_KV_KEY_TOKENS, .tokens = tokens};
}
static inline kva_kv_content u64_content(const uint64_t *keys) {
    return (kva_kv_content){.kind = KVA_KV_KEY_U64, .keys = keys};
}
static inline kva_kv_content bytes_content(const uint8_t *keys, uint32_t key_len) {
    return (kva_kv_content){.kind = KVA_KV_KEY_BYTES, .key_len = key_len, .key_bytes = keys};
}

static inline kva_kv_seq admit(kva_kv *kv, uint32_t tokens, uint64_t ns, const kva_kv_content *content, uint32_t count,
                               uint32_t *cached) {
    kva_kv_seq seq = 0;
    REQUIRE(kva_kv_seq_admit(kv, tokens, ns, 0, content, count, &seq, cached) == KVA_OK);
    return seq;
}

/* FNV-1a over bytes, for the state fingerprint below. */
static inline uint64_t kv_hash_bytes(uint64_t h, const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 0x100000001b3ull;
    return h;
}

/* Everything a KV call may change, read from the cache's internals (kv_cache.h): block records,
 * the prefix table, the engine's references and key bytes, the free stack and LRU lists, every
 * sequence slot's visible state and table, the event ring, the counters (less the two that
 * count refusals). A refused call leaves it equal. It skips what a refused call may keep for
 * later: a grown slot array, a table's or a partial buffer's capacity, a batch's listing stamps. */
static inline uint64_t kv_state_hash(const kva_kv *kv) {
    uint64_t h = 0xcbf29ce484222325ull;
    if (kv->info.mode == KVA_KV_PAGED) {
        h = kv_hash_bytes(h, kv->blocks, (size_t)kv->num_blocks * sizeof *kv->blocks);
        h = kv_hash_bytes(h, kv->buckets, ((size_t)kv->bucket_mask + 1) * sizeof *kv->buckets);
        h = kv_hash_bytes(h, kv->loose, (size_t)kv->num_blocks * sizeof *kv->loose);
        for (uint32_t b = 0; b < kv->num_blocks; b++)
            if (kv->blocks[b].registered && kv->blocks[b].key_len)
                h = kv_hash_bytes(h, kv_key_store(kv, b), kv->blocks[b].key_len);
        h = kv_hash_bytes(h, kv->lru_ids, (size_t)kv->lru_used * KV_LRU_SEG * sizeof *kv->lru_ids);
        h = kv_hash_bytes(h, kv->lru_segs, (size_t)kv->lru_used * sizeof *kv->lru_segs);
        if (kv->pins_touched) h = kv_hash_bytes(h, kv->pin_refs, (size_t)kv->num_blocks * sizeof *kv->pin_refs);
    }
    /* The namespace table, its memo aside (a lookup may move it without changing a figure). */
    h = kv_hash_bytes(h, kv->ns.rows, sizeof kv->ns.rows);
    h = kv_hash_bytes(h, &kv->ns.assigned, sizeof kv->ns.assigned);
    h = kv_hash_bytes(h, &kv->pinned_count, sizeof kv->pinned_count);
    uint32_t lists[] = {kv->free_top,     kv->free_bottom,      kv->free_count,    kv->used_count,
                        kv->cached_count, kv->registered_count, kv->backed_blocks, kv->lru_nonempty,
                        kv->lru_used,     kv->lru_free,         kv->seq_slots,     kv->free_slot,
                        kv->live_seqs,    kv->live_pins,        kv->event_head,    kv->event_count};
    h = kv_hash_bytes(h, lists, sizeof lists);
    h = kv_hash_bytes(h, kv->lru_head, sizeof kv->lru_head);
    h = kv_hash_bytes(h, kv->lru_tail, sizeof kv->lru_tail);
    h = kv_hash_bytes(h, kv->lru_count, sizeof kv->lru_count);
    h = kv_hash_bytes(h, &kv->loose_refs, sizeof kv->loose_refs);
    h = kv_hash_bytes(h, &kv->events_dropped, sizeof kv->events_dropped);
    for (uint32_t i = 0; i < kv->event_count; i++)
        h = kv_hash_bytes(h, &kv->events[(kv->event_head + i) % kv->event_capacity], sizeof(kva_kv_event));
    for (uint32_t s = 0; s < kv->seq_slots; s++) {
        const kva_kv_seqrec *r = &kv->seqs[s];
        uint32_t words[] = {r->live,    r->generation, r->next_free,
                            r->is_pin,  r->priority,   r->key_kind,
                            r->key_len, r->has_last,   r->live ? r->ns_slot : 0u};
        h = kv_hash_bytes(h, words, sizeof words);
        if (!r->live) continue;
        uint32_t figures[] = {r->len, r->num_tokens, r->cached_tokens, r->bucket_tokens};
        h = kv_hash_bytes(h, figures, sizeof figures);
        h = kv_hash_bytes(h, &r->ns, sizeof r->ns);
        h = kv_hash_bytes(h, &r->chain, sizeof r->chain);
        h = kv_hash_bytes(h, r->last_key, sizeof r->last_key);
        if (r->table) h = kv_hash_bytes(h, r->table, (size_t)r->len * sizeof *r->table);
        if (r->key_kind == KVA_KV_KEY_TOKENS)
            h = kv_hash_bytes(h, r->partial, (size_t)(r->num_tokens % kv->block_tokens) * sizeof *r->partial);
    }
    kva_kv_counters c = kv->counters;
    c.rejected_calls = c.alloc_failures = 0;
    return kv_hash_bytes(h, &c, sizeof c);
}

#endif
