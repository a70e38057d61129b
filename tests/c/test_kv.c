/*
 * test_kv.c — the KV-cache manager's behaviour, call by call: geometry and addresses in both
 * layouts, sequences, prefix hits by keys and by token ids, namespaces, eviction order,
 * priorities, pins, fork and copy on write, contiguous mode, threads. Bad input has its own
 * file (test_kv_bad_input.c); randomized runs are test_kv_random.c.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kv_test.h"

static void test_config_and_geometry(void) {
    kva_kv_config cfg;
    memset(&cfg, 0xab, sizeof cfg);
    kva_kv_config_init(&cfg);
    CHECK(cfg.layers == 0 && cfg.kv_heads == 0 && cfg.head_dim == 0 && cfg.num_blocks == 0);
    CHECK(cfg.dtype_bytes == 2 && cfg.block_tokens == 16 && cfg.capacity_bytes == 0);
    CHECK(cfg.mode == KVA_KV_PAGED && cfg.layout == KVA_KV_LAYOUT_LAYERS && cfg.pages == KVA_PAGES_THP);
    CHECK(cfg.max_context == 0 && cfg.hash_seed == 0);
    kva_kv_config_init(NULL); /* tolerated */

    cfg.layers = 32;
    cfg.kv_heads = 8;
    cfg.head_dim = 128;
    size_t bytes = 0;
    CHECK_STATUS(kva_kv_block_bytes(&cfg, &bytes), KVA_OK);
    CHECK(bytes == (size_t)2 * 32 * 8 * 128 * 2 * 16); /* 2 MiB: Llama-3-8B, fp16, 16 tokens */
    cfg.dtype_bytes = 1;
    cfg.block_tokens = 512;
    CHECK_STATUS(kva_kv_block_bytes(&cfg, &bytes), KVA_OK);
    CHECK(bytes == (size_t)2 * 32 * 8 * 128 * 512);
}

/* Every (block, layer, part) of both layouts is a distinct, writable run of part_bytes inside
 * the KV memory, and the addresses follow the documented formula. */
static void test_layouts(void) {
    for (int layout = KVA_KV_LAYOUT_BLOCKS; layout <= KVA_KV_LAYOUT_LAYERS; layout++) {
        kva_kv_config cfg = small_config(6, 4);
        cfg.layout = (kva_kv_layout)layout;
        kva_kv *kv = make_cache(&cfg);
        kva_kv_info info;
        CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
        CHECK(info.num_blocks == 6 && info.block_tokens == 4 && info.layers == 3);
        CHECK(info.slot_bytes == (size_t)2 * 4 * 2);
        CHECK(info.part_bytes == info.slot_bytes * 4);
        CHECK(info.token_bytes == info.slot_bytes * 2 * 3);
        CHECK(info.block_bytes == info.token_bytes * 4);
        CHECK(info.kv_bytes == info.block_bytes * 6);
        CHECK(info.pool != NULL && info.base != NULL);
        if (layout == KVA_KV_LAYOUT_BLOCKS) {
            CHECK(info.block_stride == info.block_bytes && info.layer_stride == 2 * info.part_bytes);
        } else {
            CHECK(info.block_stride == 2 * info.part_bytes && info.layer_stride == info.block_stride * 6);
        }
        unsigned char *base = info.base;
        unsigned parts = 6 * 3 * 2;
        for (uint32_t b = 0; b < 6; b++)
            for (uint32_t l = 0; l < 3; l++)
                for (int p = 0; p < 2; p++) {
                    void *at = NULL;
                    CHECK_STATUS(kva_kv_block_address(kv, b, l, (kva_kv_part)p, &at), KVA_OK);
                    unsigned char *u = at;
                    CHECK(u == base + b * info.block_stride + l * info.layer_stride + (size_t)p * info.part_bytes);
                    CHECK(u >= base && u + info.part_bytes <= base + info.kv_bytes);
                    memset(u, (int)((b * 3 + l) * 2 + (unsigned)p + 1), info.part_bytes);
                }
        /* Each byte was written by exactly one part: the memory holds each tag part_bytes times. */
        size_t tally[256] = {0};
        for (size_t i = 0; i < info.kv_bytes; i++) tally[base[i]]++;
        for (unsigned t = 1; t <= parts; t++) CHECK(tally[t] == info.part_bytes);
        CHECK(tally[0] == 0);
        CHECK_STATUS(kva_kv_check(kv), KVA_OK);
        kva_kv_destroy(kv);
    }
}

static void test_capacity_in_bytes_and_caller_pool(void) {
    kva_kv_config cfg = small_config(0, 4);
    size_t block;
    CHECK_STATUS(kva_kv_block_bytes(&cfg, &block), KVA_OK);
    cfg.capacity_bytes = block * 10 + block / 2; /* keeps 10 whole blocks */
    kva_kv *kv = make_cache(&cfg);
    kva_kv_stats st;
    CHECK_STATUS(kva_kv_get_stats(kv, &st), KVA_OK);
    CHECK(st.num_blocks == 10 && st.free_blocks == 10 && st.used_blocks == 0 && st.cached_blocks == 0);
    CHECK(st.block_metadata_bytes <= 64 * (size_t)st.num_blocks);
    kva_kv_destroy(kv);

    /* On a caller's pool: one exact allocation, returned at destruction. */
    kva_config pc;
    kva_config_init(&pc);
    pc.capacity = (size_t)4 << 20;
    pc.pages = KVA_PAGES_SMALL;
    kva_pool *pool = NULL;
    REQUIRE(kva_pool_create(&pc, &pool) == KVA_OK);
    cfg = small_config(100, 16);
    kv = NULL;
    CHECK_STATUS(kva_kv_create(&cfg, pool, &kv), KVA_OK);
    kva_stats ps;
    CHECK_STATUS(kva_get_stats(pool, &ps), KVA_OK);
    CHECK(ps.live_allocations == 1);
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    CHECK(info.pool == pool && kva_usable_size(pool, info.base) >= info.kv_bytes);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
    CHECK_STATUS(kva_get_stats(pool, &ps), KVA_OK);
    CHECK(ps.live_allocations == 0);

    /* A pool too small for the blocks: out of memory, the pool unchanged. */
    cfg = small_config(100000, 16);
    kv = SENTINEL_KV;
    CHECK_STATUS(kva_kv_create(&cfg, pool, &kv), KVA_ERR_NOMEM);
    CHECK(kv == SENTINEL_KV);
    CHECK_STATUS(kva_get_stats(pool, &ps), KVA_OK);
    CHECK(ps.live_allocations == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* A sequence takes ceil(tokens / block_tokens) blocks; appends take a new block only when the
 * last one is full; free returns unkeyed blocks to the free stack at once. */
static void test_allocate_append_free(void) {
    kva_kv_config cfg = small_config(16, 4);
    kva_kv *kv = make_cache(&cfg);
    kva_kv_seq seq = 0;
    uint32_t cached = 99;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 9, NULL, 0, NULL, 0, 0, 0, &seq, &cached), KVA_OK);
    CHECK(seq != 0 && cached == 0);
    CHECK(table_len(kv, seq) == 3);
    const uint32_t *table;
    uint32_t len;
    CHECK_STATUS(kva_kv_seq_block_table(kv, seq, &table, &len), KVA_OK);
    CHECK(len == 3 && table[0] == 0 && table[1] == 1 && table[2] == 2); /* the free stack pops 0, 1, 2 */
    kva_kv_copy copy;
    CHECK_STATUS(kva_kv_seq_append(kv, seq, 3, &copy), KVA_OK); /* 12 tokens: block 3 still holds them */
    CHECK(copy.tokens == 0 && copy.src_block == KVA_KV_NO_BLOCK && copy.dst_block == KVA_KV_NO_BLOCK);
    CHECK(table_len(kv, seq) == 3);
    CHECK_STATUS(kva_kv_seq_append(kv, seq, 1, &copy), KVA_OK); /* 13: a fourth block */
    CHECK(table_len(kv, seq) == 4);
    CHECK_STATUS(kva_kv_seq_append(kv, seq, 0, &copy), KVA_OK);
    CHECK_STATUS(kva_kv_seq_append(kv, seq, 8, &copy), KVA_OK); /* 21: six blocks */
    CHECK(table_len(kv, seq) == 6);
    kva_kv_seq_info si;
    CHECK_STATUS(kva_kv_seq_get_info(kv, seq, &si), KVA_OK);
    CHECK(si.num_tokens == 21 && si.num_blocks == 6 && si.cached_tokens == 0 && si.is_pin == 0);
    kva_kv_stats st = stats(kv);
    CHECK(st.used_blocks == 6 && st.free_blocks == 10 && st.sequences == 1 && st.appends == 4);
    CHECK(st.allocations == 1 && st.query_tokens == 9 && st.hit_tokens == 0);
    CHECK(st.bytes_in_use == 6 * block_bytes(kv));

    /* A sequence of 0 tokens is legal and grows from nothing. */
    kva_kv_seq empty;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 0, NULL, 0, NULL, 0, 0, 0, &empty, NULL), KVA_OK);
    CHECK_STATUS(kva_kv_seq_block_table(kv, empty, &table, &len), KVA_OK);
    CHECK(len == 0 && table != NULL);
    CHECK_STATUS(kva_kv_seq_append(kv, empty, 1, &copy), KVA_OK);
    CHECK(table_len(kv, empty) == 1);

    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, seq), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, empty), KVA_OK);
    st = stats(kv);
    CHECK(st.free_blocks == 16 && st.used_blocks == 0 && st.cached_blocks == 0 && st.sequences == 0 && st.frees == 2);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* Keys chain: a block hits only when every block before it hits too. */
static void test_prefix_hits_by_keys(void) {
    kva_kv_config cfg = small_config(32, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t a[] = {1, 2, 3}, b[] = {1, 2, 9}, c[] = {7, 2, 3};
    uint32_t cached;
    kva_kv_seq sa = alloc_keys(kv, 3 * 4 + 2, a, 3, 0, 0, &cached);
    CHECK(cached == 0);
    kva_kv_seq sb = alloc_keys(kv, 3 * 4, b, 3, 0, 0, &cached);
    CHECK(cached == 8);
    uint32_t ta[8], tb[8];
    CHECK(copy_table(kv, sa, ta, 8) == 4 && copy_table(kv, sb, tb, 8) == 3);
    CHECK(ta[0] == tb[0] && ta[1] == tb[1] && ta[2] != tb[2]);
    kva_kv_seq sc = alloc_keys(kv, 3 * 4, c, 3, 0, 0, &cached);
    CHECK(cached == 0); /* same content keys after the first block, different prefix */
    kva_kv_stats st = stats(kv);
    CHECK(st.hit_tokens == 8 && st.query_tokens == 14 + 12 + 12);
    CHECK(st.registered_blocks == 3 + 1 + 3);
    CHECK_STATUS(kva_kv_seq_free(kv, sa), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, sb), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, sc), KVA_OK);
    st = stats(kv);
    CHECK(st.cached_blocks == 7 && st.used_blocks == 0 && st.free_blocks == 32 - 7);

    /* Cached blocks come back on a hit; fewer keys than full blocks hits only those. */
    kva_kv_seq sd = alloc_keys(kv, 5 * 4, a, 2, 0, 0, &cached);
    CHECK(cached == 8);
    uint32_t td[8];
    CHECK(copy_table(kv, sd, td, 8) == 5 && td[0] == ta[0] && td[1] == ta[1]);
    st = stats(kv);
    CHECK(st.cached_blocks == 5 && st.used_blocks == 5);
    /* A full hit of all the blocks: cached_tokens may equal the request. */
    kva_kv_seq se = alloc_keys(kv, 3 * 4, a, 3, 0, 0, &cached);
    CHECK(cached == 12);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, sd), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, se), KVA_OK);
    kva_kv_destroy(kv);
}

static void test_prefix_hits_by_tokens(void) {
    kva_kv_config cfg = small_config(32, 4);
    kva_kv *kv = make_cache(&cfg);
    uint32_t prompt[14], other[14];
    for (uint32_t i = 0; i < 14; i++) prompt[i] = other[i] = 1000 + i;
    other[9] = 5; /* differs in the third block */
    uint32_t cached;
    kva_kv_seq s1, s2, s3, s4;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 14, NULL, 0, prompt, 14, 0, 0, &s1, &cached), KVA_OK);
    CHECK(cached == 0);
    CHECK(stats(kv).registered_blocks == 3); /* 14 tokens: three whole blocks hashed */
    CHECK_STATUS(kva_kv_seq_allocate(kv, 14, NULL, 0, other, 14, 0, 0, &s2, &cached), KVA_OK);
    CHECK(cached == 8);
    CHECK_STATUS(kva_kv_seq_allocate(kv, 20, NULL, 0, prompt, 14, 0, 0, &s3, &cached), KVA_OK);
    CHECK(cached == 12); /* fewer token ids than tokens: their whole blocks are looked up */
    /* Token ids and caller keys are different content even for equal numbers. */
    uint64_t keys[3] = {1000, 1001, 1002};
    CHECK_STATUS(kva_kv_seq_allocate(kv, 12, keys, 3, NULL, 0, 0, 0, &s4, &cached), KVA_OK);
    CHECK(cached == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv); /* with live sequences: destroy releases everything */
}

/* The same keys in two namespaces never share a block; the hash seed changes nothing visible. */
static void test_namespaces(void) {
    kva_kv_config cfg = small_config(32, 4);
    cfg.hash_seed = 0x1234567890abcdefull;
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {5, 6};
    uint32_t cached;
    kva_kv_seq s1 = alloc_keys(kv, 8, keys, 2, 1, 0, &cached);
    kva_kv_seq s2 = alloc_keys(kv, 8, keys, 2, 2, 0, &cached);
    CHECK(cached == 0);
    kva_kv_seq s3 = alloc_keys(kv, 8, keys, 2, 1, 0, &cached);
    CHECK(cached == 8);
    uint32_t t1[2], t2[2], t3[2];
    copy_table(kv, s1, t1, 2);
    copy_table(kv, s2, t2, 2);
    copy_table(kv, s3, t3, 2);
    CHECK(t1[0] != t2[0] && t1[1] != t2[1] && t1[0] == t3[0] && t1[1] == t3[1]);
    kva_kv_seq_info si;
    CHECK_STATUS(kva_kv_seq_get_info(kv, s2, &si), KVA_OK);
    CHECK(si.namespace_id == 2);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* Cached blocks go only when nothing is free; least recently released first; within one freed
 * sequence the tail before the head. */
static void test_eviction_order(void) {
    kva_kv_config cfg = small_config(8, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t a[] = {10, 11, 12}, b[] = {20, 21};
    uint32_t cached, ta[3], tb[2];
    kva_kv_seq sa = alloc_keys(kv, 12, a, 3, 0, 0, &cached);
    kva_kv_seq sb = alloc_keys(kv, 8, b, 2, 0, 0, &cached);
    copy_table(kv, sa, ta, 3);
    copy_table(kv, sb, tb, 2);
    CHECK_STATUS(kva_kv_seq_free(kv, sa), KVA_OK); /* LRU: a2 a1 a0 */
    CHECK_STATUS(kva_kv_seq_free(kv, sb), KVA_OK); /* LRU: a2 a1 a0 b1 b0 */
    kva_kv_stats st = stats(kv);
    CHECK(st.cached_blocks == 5 && st.free_blocks == 3 && st.evictions == 0);

    /* Four new blocks: three free ones, then a2 is evicted. */
    kva_kv_seq s = alloc_plain(kv, 16);
    uint32_t t[8];
    CHECK(copy_table(kv, s, t, 8) == 4);
    CHECK(t[3] == ta[2]);
    st = stats(kv);
    CHECK(st.evictions == 1 && st.cached_blocks == 4 && st.free_blocks == 0);
    /* a0 and a1 hit (and leave the LRU list); a2 needs a block again: b1, the oldest left. */
    kva_kv_seq probe = alloc_keys(kv, 12, a, 3, 0, 0, &cached);
    CHECK(cached == 8);
    uint32_t tp[3];
    copy_table(kv, probe, tp, 3);
    CHECK(tp[0] == ta[0] && tp[1] == ta[1] && tp[2] == tb[1]);
    CHECK(stats(kv).evictions == 2);
    CHECK_STATUS(kva_kv_seq_free(kv, probe), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, s), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* Lower priorities are evicted first, whatever their recency; a block shared with a higher
 * priority sequence takes the higher priority. */
static void test_priorities(void) {
    kva_kv_config cfg = small_config(6, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t hi[] = {1, 2}, lo[] = {3, 4};
    uint32_t cached, th[2], tl[2];
    kva_kv_seq sh = alloc_keys(kv, 8, hi, 2, 0, 5, &cached);
    kva_kv_seq sl = alloc_keys(kv, 8, lo, 2, 0, 1, &cached);
    copy_table(kv, sh, th, 2);
    copy_table(kv, sl, tl, 2);
    CHECK_STATUS(kva_kv_seq_free(kv, sh), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, sl), KVA_OK); /* the low one is the most recent */
    kva_kv_seq s = alloc_plain(kv, 4 * 4);         /* 2 free + 2 evicted */
    uint32_t t[4];
    copy_table(kv, s, t, 4);
    CHECK(t[2] == tl[1] && t[3] == tl[0]);
    CHECK_STATUS(kva_kv_seq_free(kv, s), KVA_OK);
    kva_kv_seq again = alloc_keys(kv, 8, hi, 2, 0, 0, &cached);
    CHECK(cached == 8);
    CHECK_STATUS(kva_kv_seq_free(kv, again), KVA_OK);

    /* Priorities out of range are refused. */
    kva_kv_seq bad = 0;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 4, NULL, 0, NULL, 0, 0, KVA_KV_PRIORITIES, &bad, NULL), KVA_ERR_INVALID);
    CHECK(bad == 0);

    /* A low-priority sequence that hits high-priority blocks leaves them high: released after a
     * priority-3 block, they still outlive it. */
    kva_kv_seq sm = alloc_keys(kv, 8, hi, 2, 0, 0, &cached);
    CHECK(cached == 8);
    uint64_t mid[] = {8};
    uint32_t tx[1], tf[4];
    kva_kv_seq sx = alloc_keys(kv, 4, mid, 1, 0, 3, &cached);
    copy_table(kv, sx, tx, 1);
    CHECK_STATUS(kva_kv_seq_free(kv, sx), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, sm), KVA_OK);
    kva_kv_seq fill = alloc_plain(kv, 4 * 4); /* 3 free blocks, then one eviction */
    copy_table(kv, fill, tf, 4);
    CHECK(tf[3] == tx[0]);
    CHECK_STATUS(kva_kv_seq_free(kv, fill), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* A pinned prefix is never evicted; unpinned, it is cached again. */
static void test_pins(void) {
    kva_kv_config cfg = small_config(6, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t sys[] = {42, 43, 44};
    uint32_t cached, pinned = 99;
    kva_kv_seq s = alloc_keys(kv, 12, sys, 3, 0, 0, &cached);
    CHECK_STATUS(kva_kv_seq_free(kv, s), KVA_OK);
    kva_kv_seq pin = 0;
    uint64_t longer[] = {42, 43, 44, 45};
    CHECK_STATUS(kva_kv_pin(kv, longer, 4, NULL, 0, 0, &pin, &pinned), KVA_OK);
    CHECK(pin != 0 && pinned == 12);
    kva_kv_stats st = stats(kv);
    CHECK(st.pins == 1 && st.sequences == 0 && st.used_blocks == 3 && st.cached_blocks == 0);
    CHECK(st.hit_tokens == 0); /* pins are not queries */
    kva_kv_seq_info si;
    CHECK_STATUS(kva_kv_seq_get_info(kv, pin, &si), KVA_OK);
    CHECK(si.is_pin == 1 && si.num_tokens == 12 && si.num_blocks == 3);

    /* Only 3 blocks are left for everyone else. */
    kva_kv_seq big = 0;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 16, NULL, 0, NULL, 0, 0, 0, &big, NULL), KVA_ERR_NOMEM);
    kva_kv_seq fits = alloc_plain(kv, 12);
    kva_kv_seq user = alloc_keys(kv, 12, sys, 3, 0, 0, &cached);
    CHECK(cached == 12);
    CHECK_STATUS(kva_kv_seq_free(kv, user), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, fits), KVA_OK);

    /* Pins and sequences are released by their own calls; pins do not grow or fork. */
    kva_kv_copy copy;
    kva_kv_seq child;
    CHECK_STATUS(kva_kv_seq_free(kv, pin), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_append(kv, pin, 1, &copy), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_fork(kv, pin, &child), KVA_ERR_INVALID);
    kva_kv_seq plain = alloc_plain(kv, 4);
    CHECK_STATUS(kva_kv_unpin(kv, plain), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_free(kv, plain), KVA_OK);
    CHECK_STATUS(kva_kv_unpin(kv, pin), KVA_OK);
    CHECK_STATUS(kva_kv_unpin(kv, pin), KVA_ERR_DOUBLE_FREE);
    st = stats(kv);
    CHECK(st.pins == 0 && st.cached_blocks == 3 && st.used_blocks == 0);

    /* A pin of nothing cached holds nothing. */
    uint64_t unknown[] = {77};
    CHECK_STATUS(kva_kv_pin(kv, unknown, 1, NULL, 0, 0, &pin, &pinned), KVA_OK);
    CHECK(pinned == 0);
    CHECK_STATUS(kva_kv_unpin(kv, pin), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* A fork shares every block; the first append into a shared partial block copies it. */
static void test_fork_and_copy_on_write(void) {
    kva_kv_config cfg = small_config(16, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {1, 2};
    uint32_t cached;
    kva_kv_seq parent = alloc_keys(kv, 10, keys, 2, 0, 3, &cached); /* blocks: full, full, 2 tokens */
    kva_kv_seq child = 0;
    CHECK_STATUS(kva_kv_seq_fork(kv, parent, &child), KVA_OK);
    CHECK(child != 0 && child != parent);
    uint32_t tp[4], tc[4];
    CHECK(copy_table(kv, parent, tp, 4) == 3 && copy_table(kv, child, tc, 4) == 3);
    CHECK(memcmp(tp, tc, sizeof(uint32_t) * 3) == 0);
    kva_kv_seq_info si;
    CHECK_STATUS(kva_kv_seq_get_info(kv, child, &si), KVA_OK);
    CHECK(si.num_tokens == 10 && si.priority == 3);
    kva_kv_stats st = stats(kv);
    CHECK(st.used_blocks == 3 && st.forks == 1 && st.sequences == 2);

    kva_kv_copy copy;
    CHECK_STATUS(kva_kv_seq_append(kv, child, 1, &copy), KVA_OK);
    CHECK(copy.src_block == tp[2] && copy.dst_block != tp[2] && copy.dst_block != KVA_KV_NO_BLOCK);
    CHECK(copy.tokens == 2 && copy.src == NULL && copy.dst == NULL);
    CHECK(copy_table(kv, child, tc, 4) == 3 && tc[2] == copy.dst_block && tc[0] == tp[0]);
    CHECK(stats(kv).cow_copies == 1);
    /* The parent is now the only holder of its last block: it writes in place. */
    CHECK_STATUS(kva_kv_seq_append(kv, parent, 1, &copy), KVA_OK);
    CHECK(copy.tokens == 0 && copy.src_block == KVA_KV_NO_BLOCK);
    CHECK(copy_table(kv, parent, tp, 4) == 3);

    /* A fork at a block boundary: the next append takes a fresh block, no copy. */
    kva_kv_seq full = alloc_plain(kv, 8), twin;
    CHECK_STATUS(kva_kv_seq_fork(kv, full, &twin), KVA_OK);
    CHECK_STATUS(kva_kv_seq_append(kv, twin, 1, &copy), KVA_OK);
    CHECK(copy.tokens == 0 && table_len(kv, twin) == 3);
    /* Appending zero tokens into a shared partial block copies nothing. */
    kva_kv_seq twin2;
    CHECK_STATUS(kva_kv_seq_fork(kv, twin, &twin2), KVA_OK);
    CHECK_STATUS(kva_kv_seq_append(kv, twin2, 0, &copy), KVA_OK);
    CHECK(copy.tokens == 0);
    CHECK(stats(kv).forks == 3 && stats(kv).cow_copies == 1);

    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, parent), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, child), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, full), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, twin), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, twin2), KVA_OK);
    st = stats(kv);
    CHECK(st.used_blocks == 0 && st.cached_blocks == 2 && st.free_blocks == 14);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

static void test_evict_call(void) {
    kva_kv_config cfg = small_config(8, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {1, 2, 3, 4};
    uint32_t cached, evicted = 99;
    kva_kv_seq s = alloc_keys(kv, 16, keys, 4, 0, 0, &cached);
    CHECK_STATUS(kva_kv_evict(kv, 10, &evicted), KVA_OK);
    CHECK(evicted == 0); /* all referenced */
    CHECK_STATUS(kva_kv_seq_free(kv, s), KVA_OK);
    CHECK_STATUS(kva_kv_evict(kv, 1, &evicted), KVA_OK);
    CHECK(evicted == 1);
    s = alloc_keys(kv, 16, keys, 4, 0, 0, &cached);
    CHECK(cached == 12); /* the tail went first */
    CHECK_STATUS(kva_kv_seq_free(kv, s), KVA_OK);
    CHECK_STATUS(kva_kv_evict(kv, UINT32_MAX, NULL), KVA_OK);
    kva_kv_stats st = stats(kv);
    CHECK(st.cached_blocks == 0 && st.free_blocks == 8 && st.registered_blocks == 0 && st.evictions == 5);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* Contiguous mode: power-of-two buckets, growth moves with a copy descriptor, the old buffer kept
 * until the next call on the sequence. */
static void test_contiguous(void) {
    kva_kv_config cfg = small_config(0, 16);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.capacity_bytes = (size_t)1 << 20;
    cfg.max_context = 1024;
    kva_kv *kv = make_cache(&cfg);
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    CHECK(info.mode == KVA_KV_CONTIGUOUS && info.max_context == 1024 && info.num_blocks == 0);
    CHECK(info.kv_bytes >= cfg.capacity_bytes);
    kva_kv_seq s = 0;
    uint32_t cached = 99;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 10, NULL, 0, NULL, 0, 0, 0, &s, &cached), KVA_OK);
    CHECK(cached == 0);
    kva_kv_seq_info si;
    CHECK_STATUS(kva_kv_seq_get_info(kv, s, &si), KVA_OK);
    CHECK(si.bucket_tokens == 64 && si.num_tokens == 10 && si.buffer != NULL);
    /* Fill each (layer, part) slice's tokens with a tag, grow, copy as an engine would. */
    unsigned char *old = si.buffer;
    for (uint32_t l = 0; l < info.layers; l++)
        for (uint32_t p = 0; p < 2; p++)
            memset(old + (2 * l + p) * (size_t)64 * info.slot_bytes, (int)(1 + 2 * l + p), 10 * info.slot_bytes);
    kva_kv_copy copy;
    CHECK_STATUS(kva_kv_seq_append(kv, s, 54, &copy), KVA_OK); /* 64: still fits */
    CHECK(copy.tokens == 0 && copy.src == NULL);
    CHECK_STATUS(kva_kv_seq_append(kv, s, 1, &copy), KVA_OK); /* 65: to 128 */
    CHECK(copy.src == old && copy.dst != NULL && copy.dst != old);
    CHECK(copy.tokens == 64 && copy.src_bucket == 64 && copy.dst_bucket == 128);
    CHECK(copy.src_block == KVA_KV_NO_BLOCK);
    unsigned char *src = copy.src, *dst = copy.dst;
    for (uint32_t l = 0; l < info.layers; l++)
        for (uint32_t p = 0; p < 2; p++)
            memcpy(dst + (2 * l + p) * (size_t)copy.dst_bucket * info.slot_bytes,
                   src + (2 * l + p) * (size_t)copy.src_bucket * info.slot_bytes, copy.tokens * info.slot_bytes);
    CHECK(kva_usable_size(info.pool, old) > 0); /* kept for the copy */
    CHECK_STATUS(kva_kv_seq_get_info(kv, s, &si), KVA_OK);
    CHECK(si.bucket_tokens == 128 && si.buffer == dst && si.num_tokens == 65);
    unsigned char *now = si.buffer;
    for (uint32_t l = 0; l < info.layers; l++)
        for (uint32_t p = 0; p < 2; p++)
            CHECK(now[(2 * l + p) * (size_t)128 * info.slot_bytes + 9 * info.slot_bytes] == 1 + 2 * l + p);
    kva_kv_stats st = stats(kv);
    CHECK(st.moves == 1 && st.moved_bytes == 64 * info.token_bytes && st.sequences == 1);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_kv_seq_append(kv, s, 1, &copy), KVA_OK);
    CHECK(kva_usable_size(info.pool, old) == 0);                      /* released at the next append */
    CHECK_STATUS(kva_kv_seq_append(kv, s, 1000 - 67, &copy), KVA_OK); /* straight to 1024 */
    CHECK(copy.dst_bucket == 1024);
    CHECK_STATUS(kva_kv_seq_append(kv, s, 100, &copy), KVA_ERR_INVALID); /* beyond max_context */

    /* Paged-only calls are refused. */
    const uint32_t *table;
    uint32_t len;
    kva_kv_seq child;
    void *address;
    uint64_t key = 1;
    kva_kv_seq other;
    CHECK_STATUS(kva_kv_seq_block_table(kv, s, &table, &len), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_fork(kv, s, &child), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_address(kv, 0, 0, KVA_KV_K, &address), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_allocate(kv, 64, &key, 1, NULL, 0, 0, 0, &other, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_allocate(kv, 2000, NULL, 0, NULL, 0, 0, 0, &other, NULL), KVA_ERR_INVALID);

    /* Fill the pool: out of memory, nothing changed. */
    kva_kv_seq many[64];
    int n = 0;
    kva_status got = KVA_OK;
    while (n < 64 && (got = kva_kv_seq_allocate(kv, 1024, NULL, 0, NULL, 0, 0, 0, &many[n], NULL)) == KVA_OK) n++;
    CHECK(got == KVA_ERR_NOMEM && n > 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    for (int i = 0; i < n; i++) CHECK_STATUS(kva_kv_seq_free(kv, many[i]), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, s), KVA_OK);
    st = stats(kv);
    CHECK(st.bytes_in_use == 0 && st.sequences == 0);
    kva_stats ps;
    CHECK_STATUS(kva_get_stats(info.pool, &ps), KVA_OK);
    CHECK(ps.live_allocations == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);

    /* Without max_context the pool's largest block decides. */
    cfg.max_context = 0;
    kv = make_cache(&cfg);
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    CHECK(kva_is_pow2_test(info.max_context) && info.max_context >= 64 &&
          (size_t)info.max_context * info.token_bytes <= ((size_t)1 << 20));
    kva_kv_destroy(kv);
}

/* Threads share one cache: every call is serialized by its lock. */
typedef struct thread_arg {
    kva_kv *kv;
    unsigned seed;
    int failures;
} thread_arg;

static void *worker(void *p) {
    thread_arg *arg = p;
    uint64_t rng = arg->seed;
    kva_kv_seq live[16] = {0};
    for (int i = 0; i < 20000; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        unsigned r = (unsigned)(rng >> 33);
        int slot = (int)(r % 16);
        if (live[slot]) {
            kva_kv_copy copy;
            if (r & 0x10000) {
                if (kva_kv_seq_free(arg->kv, live[slot]) != KVA_OK) arg->failures++;
                live[slot] = 0;
            } else if (kva_kv_seq_append(arg->kv, live[slot], r % 7, &copy) == KVA_ERR_INVALID) {
                arg->failures++;
            }
        } else {
            uint64_t keys[4] = {r % 3, r % 5, 1 + r % 2, 7};
            kva_status st = kva_kv_seq_allocate(arg->kv, 4 * 4 + r % 9, keys, 1 + r % 4, NULL, 0, r % 2, r % 8,
                                                &live[slot], NULL);
            if (st != KVA_OK && st != KVA_ERR_NOMEM) arg->failures++;
            if (st != KVA_OK) live[slot] = 0;
        }
    }
    for (int i = 0; i < 16; i++)
        if (live[i] && kva_kv_seq_free(arg->kv, live[i]) != KVA_OK) arg->failures++;
    return NULL;
}

static void test_threads(void) {
    kva_kv_config cfg = small_config(256, 4);
    kva_kv *kv = make_cache(&cfg);
    pthread_t threads[4];
    thread_arg args[4];
    for (int t = 0; t < 4; t++) {
        args[t] = (thread_arg){kv, (unsigned)t * 7919u + 1, 0};
        REQUIRE(pthread_create(&threads[t], NULL, worker, &args[t]) == 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(threads[t], NULL);
        CHECK(args[t].failures == 0);
    }
    kva_kv_stats st = stats(kv);
    CHECK(st.sequences == 0 && st.used_blocks == 0 && st.free_blocks + st.cached_blocks == 256);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* Peaks rise with the figures, stay when they fall, and start afresh at a reset. */
static void test_peaks_and_reset(void) {
    kva_kv_config cfg = small_config(16, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {1, 2, 3};
    kva_kv_seq a, b;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 12, keys, 3, NULL, 0, 0, 0, &a, NULL), KVA_OK);
    CHECK_STATUS(kva_kv_seq_allocate(kv, 20, NULL, 0, NULL, 0, 0, 0, &b, NULL), KVA_OK);
    kva_kv_stats st = stats(kv);
    CHECK(st.used_blocks == 8 && st.peak_used_blocks == 8 && st.peak_cached_blocks == 0);
    CHECK(st.peak_bytes_in_use == 8 * block_bytes(kv));
    CHECK_STATUS(kva_kv_seq_free(kv, b), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, a), KVA_OK); /* its 3 keyed blocks stay cached */
    st = stats(kv);
    CHECK(st.used_blocks == 0 && st.cached_blocks == 3);
    CHECK(st.peak_used_blocks == 8 && st.peak_cached_blocks == 3 && st.peak_bytes_in_use == 8 * block_bytes(kv));
    CHECK_STATUS(kva_kv_reset_peaks(NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_reset_peaks(kv), KVA_OK);
    st = stats(kv);
    CHECK(st.peak_used_blocks == 0 && st.peak_cached_blocks == 3 && st.peak_bytes_in_use == 0);
    CHECK_STATUS(kva_kv_seq_allocate(kv, 4, NULL, 0, NULL, 0, 0, 0, &a, NULL), KVA_OK);
    CHECK(stats(kv).peak_used_blocks == 1);
    CHECK_STATUS(kva_kv_seq_free(kv, a), KVA_OK);
    kva_kv_destroy(kv);

    /* Contiguous mode: the peak of the buffers' bytes. */
    cfg = small_config(0, 16);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.capacity_bytes = (size_t)1 << 20;
    cfg.max_context = 1024;
    kv = make_cache(&cfg);
    CHECK_STATUS(kva_kv_seq_allocate(kv, 100, NULL, 0, NULL, 0, 0, 0, &a, NULL), KVA_OK);
    size_t held = stats(kv).bytes_in_use;
    CHECK(held > 0 && stats(kv).peak_bytes_in_use == held);
    CHECK_STATUS(kva_kv_seq_free(kv, a), KVA_OK);
    CHECK(stats(kv).bytes_in_use == 0 && stats(kv).peak_bytes_in_use == held);
    CHECK_STATUS(kva_kv_reset_peaks(kv), KVA_OK);
    CHECK(stats(kv).peak_bytes_in_use == 0);
    kva_kv_destroy(kv);
}

/* With trace every call is timed, each under its kind; without, a sample of about one in
 * KVA_KV_CALL_SAMPLE_PERIOD of each kind, whatever the pattern of the calls. */
static void test_call_latency_kinds(void) {
    kva_kv_config cfg = small_config(64, 4);
    cfg.trace = 1;
    kva_kv *kv = make_cache(&cfg);
    kva_kv_seq seq;
    kva_kv_copy copy;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 4, NULL, 0, NULL, 0, 0, 0, &seq, NULL), KVA_OK);
    for (int i = 0; i < 3; i++) CHECK_STATUS(kva_kv_seq_append(kv, seq, 1, &copy), KVA_OK);
    uint32_t evicted;
    CHECK_STATUS(kva_kv_evict(kv, 1, &evicted), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, seq), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, seq), KVA_ERR_DOUBLE_FREE); /* refused calls are timed too */
    kva_kv_stats st = stats(kv);
    CHECK(st.call_sample_period == 1);
    CHECK(st.kind_timed_calls[KVA_KV_CALL_ALLOCATE] == 1 && st.kind_timed_calls[KVA_KV_CALL_APPEND] == 3);
    CHECK(st.kind_timed_calls[KVA_KV_CALL_FREE] == 2 && st.kind_timed_calls[KVA_KV_CALL_EVICT] == 1);
    CHECK(st.kind_timed_calls[KVA_KV_CALL_LOOKUP] == 0);
    uint64_t total = 0, in_buckets = 0, ns = 0;
    for (unsigned k = 0; k < KVA_KV_CALL_KINDS; k++) {
        uint64_t kind = 0;
        for (unsigned i = 0; i < KVA_KV_LATENCY_BUCKETS; i++) kind += st.kind_ns_log2[k][i];
        CHECK(kind == st.kind_timed_calls[k]);
        total += st.kind_timed_calls[k];
        ns += st.kind_timed_ns[k];
    }
    for (unsigned i = 0; i < KVA_KV_LATENCY_BUCKETS; i++) in_buckets += st.call_ns_log2[i];
    CHECK(st.timed_calls == total && in_buckets == total && st.timed_ns == ns);
    kva_kv_destroy(kv);

    cfg.trace = 0;
    kv = make_cache(&cfg);
    enum {
        ROUNDS = 20000
    };
    for (int i = 0; i < ROUNDS; i++) { /* allocate and free alternate: a period of 2 */
        CHECK_STATUS(kva_kv_seq_allocate(kv, 4, NULL, 0, NULL, 0, 0, 0, &seq, NULL), KVA_OK);
        CHECK_STATUS(kva_kv_seq_free(kv, seq), KVA_OK);
    }
    st = stats(kv);
    CHECK(st.call_sample_period == KVA_KV_CALL_SAMPLE_PERIOD);
    uint64_t expect = ROUNDS / KVA_KV_CALL_SAMPLE_PERIOD;
    for (unsigned k = KVA_KV_CALL_ALLOCATE; k <= KVA_KV_CALL_FREE; k += KVA_KV_CALL_FREE - KVA_KV_CALL_ALLOCATE)
        CHECK(st.kind_timed_calls[k] > expect / 2 && st.kind_timed_calls[k] < expect * 2);
    CHECK(st.kind_timed_calls[KVA_KV_CALL_APPEND] == 0);
    kva_kv_destroy(kv);
}

int main(void) {
    test_config_and_geometry();
    test_layouts();
    test_capacity_in_bytes_and_caller_pool();
    test_allocate_append_free();
    test_prefix_hits_by_keys();
    test_prefix_hits_by_tokens();
    test_namespaces();
    test_eviction_order();
    test_priorities();
    test_pins();
    test_fork_and_copy_on_write();
    test_evict_call();
    test_contiguous();
    test_threads();
    test_peaks_and_reset();
    test_call_latency_kinds();
    return CHECK_DONE();
}
