/*
 * test_kv_engine_bad_input.c — bad input to the engine calls (content and engine keys, the
 * block calls, the batches, the events) returns its status, leaves every out-parameter as it
 * was and the cache exactly as it was: kv_state_hash (kv_test.h) equal before and after, and
 * kva_kv_check passing. A batch with one bad entry in the middle changes nothing for the good
 * entries before it either.
 */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kv_test.h"

#define BT 4u
#define SENTINEL_U32 0x5e5e5e5eu
#define SENTINEL_SEQ ((kva_kv_seq)0x5e5e5e5e5e5e5e5eull)

static kva_kv *kv;
static uint64_t before;

/* The call returns `status` and changes nothing. */
#define REFUSED(call, status)                   \
    do {                                        \
        CHECK_STATUS(call, status);             \
        CHECK(kv_state_hash(kv) == before);     \
        CHECK_STATUS(kva_kv_check(kv), KVA_OK); \
    } while (0)

static void test_configs(void) {
    kva_kv_config cfg = small_config(16, BT);
    kva_kv *out = SENTINEL_KV;
    cfg.max_key_bytes = KVA_KV_MAX_KEY_BYTES + 1;
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &out), KVA_ERR_INVALID);
    cfg = small_config(16, BT);
    cfg.event_capacity = (1u << 20) + 1;
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &out), KVA_ERR_INVALID);
    cfg = small_config(16, BT);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.max_key_bytes = 16;
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &out), KVA_ERR_INVALID);
    cfg.max_key_bytes = 0;
    cfg.event_capacity = 8;
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &out), KVA_ERR_INVALID);
    CHECK(out == SENTINEL_KV);
}

static void test_null_cache(void) {
    kva_kv_seq seq = SENTINEL_SEQ;
    uint32_t u = SENTINEL_U32, ids[1];
    uint64_t d;
    kva_kv_copy copy;
    kva_kv_event ev;
    CHECK_STATUS(kva_kv_seq_admit(NULL, 4, 0, 0, NULL, 0, &seq, &u), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_extend(NULL, 1, 1, NULL, 0, &copy), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_pin_content(NULL, 0, NULL, 0, &seq, &u), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_lookup(NULL, 0, NULL, 0, ids, &u), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_admit_many(NULL, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, &u), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_extend_many(NULL, 0, NULL, NULL, NULL, NULL, NULL, &u, &u), KVA_ERR_INVALID);
    kva_kv_step none = {0};
    CHECK_STATUS(kva_kv_seq_extend_step(NULL, &none, 0), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_free_many(NULL, 0, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_lookup_many(NULL, 0, NULL, NULL, NULL, NULL, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_take(NULL, 1, 0, ids), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_unref(NULL, ids, 0), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_ref(NULL, ids, 0), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_commit(NULL, 0, ids, 0, NULL, 16, NULL, 0, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_evict_blocks(NULL, ids, 0, &u), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_evict_keys(NULL, 0, NULL, 16, 0, &u), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_reset_prefix_cache(NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_take_events(NULL, &ev, 1, &u, &d), KVA_ERR_INVALID);
    CHECK(seq == SENTINEL_SEQ && u == SENTINEL_U32);
}

/* A cache with engine keys of up to 32 bytes, events, a keyed sequence (with a fork sharing
 * its partial block), a pin, blocks the engine holds (one registered), a cached block, a freed
 * sequence's stale handle and a few events pending. */
static kva_kv_seq keyed, forked, pinned, stale;
static uint32_t held[3], cached_block;
static uint8_t keys[4 * 32];

static void setup(void) {
    kva_kv_config cfg = small_config(24, BT);
    cfg.max_key_bytes = 32;
    cfg.event_capacity = 16;
    kv = make_cache(&cfg);
    for (uint32_t i = 0; i < sizeof keys; i++) keys[i] = (uint8_t)(i * 37 + 11);
    kva_kv_content c = bytes_content(keys, 32);
    keyed = admit(kv, 10, 1, &c, 2, NULL);
    REQUIRE(kva_kv_seq_fork(kv, keyed, &forked) == KVA_OK);
    REQUIRE(kva_kv_pin_content(kv, 1, &c, 2, &pinned, NULL) == KVA_OK);
    stale = admit(kv, 4, 1, &c, 0, NULL);
    REQUIRE(kva_kv_seq_free(kv, stale) == KVA_OK);
    REQUIRE(kva_kv_block_take(kv, 3, 0, held) == KVA_OK);
    REQUIRE(kva_kv_block_commit(kv, 2, held, 1, keys + 64, 32, NULL, 0, NULL) == KVA_OK);
    uint32_t cache_me;
    REQUIRE(kva_kv_block_take(kv, 1, 0, &cache_me) == KVA_OK);
    REQUIRE(kva_kv_block_commit(kv, 2, &cache_me, 1, keys + 96, 32, NULL, 0, NULL) == KVA_OK);
    REQUIRE(kva_kv_block_unref(kv, &cache_me, 1) == KVA_OK);
    cached_block = cache_me;
    REQUIRE(kva_kv_check(kv) == KVA_OK);
    before = kv_state_hash(kv);
}

static void test_content(void) {
    kva_kv_seq seq = SENTINEL_SEQ;
    uint32_t out = SENTINEL_U32, ids[8];
    uint32_t tokens[8] = {0};
    uint8_t long_keys[2 * 33] = {0};
    kva_kv_content c = bytes_content(keys, 32), zero = bytes_content(keys, 0), wide = bytes_content(long_keys, 33);
    kva_kv_content unknown = {.kind = 7, .tokens = tokens}, no_array = {.kind = KVA_KV_KEY_U64};
    kva_kv_content none = {.kind = KVA_KV_KEY_NONE}, toks = tokens_content(tokens);
    /* admission */
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, &zero, 1, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, &wide, 1, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, &unknown, 1, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, &no_array, 1, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, NULL, 1, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, &none, 1, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, &c, 3, &seq, &out), KVA_ERR_INVALID); /* 3 keys, 2 full blocks */
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, &toks, 9, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 8, 1, KVA_KV_PRIORITIES, &c, 2, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 8, 1, 0, &c, 2, NULL, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit(kv, 25 * BT, 1, 0, NULL, 0, &seq, &out), KVA_ERR_NOMEM);
    CHECK(seq == SENTINEL_SEQ && out == SENTINEL_U32);
    /* extension: the sequence is keyed by 32-byte keys; 10 + 2 tokens fill one block */
    kva_kv_copy copy;
    memset(&copy, 0x5e, sizeof copy);
    const kva_kv_copy untouched = copy;
    kva_kv_content short_keys = bytes_content(keys, 16), u = u64_content((const uint64_t *)keys);
    REFUSED(kva_kv_seq_extend(kv, keyed, 2, &short_keys, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend(kv, keyed, 2, &u, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend(kv, keyed, 2, &c, 2, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend(kv, keyed, 1, &c, 1, &copy), KVA_ERR_INVALID); /* fills none */
    REFUSED(kva_kv_seq_extend(kv, keyed, 2, NULL, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend(kv, pinned, 2, &c, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend(kv, stale, 2, &c, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend(kv, keyed, 2, &c, 1, NULL), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend(kv, forked, 80, &c, 20, &copy), KVA_ERR_NOMEM);
    CHECK(memcmp(&copy, &untouched, sizeof copy) == 0);
    /* pins and lookups */
    REFUSED(kva_kv_pin_content(kv, 1, &wide, 1, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_pin_content(kv, 1, &c, 2, NULL, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_lookup(kv, 1, &c, 2, ids, NULL), KVA_ERR_INVALID);
    REFUSED(kva_kv_lookup(kv, 1, &zero, 2, ids, &out), KVA_ERR_INVALID);
    CHECK(seq == SENTINEL_SEQ && out == SENTINEL_U32);
}

static uint32_t a_free_block(void) {
    for (uint32_t b = 0; b < kv->num_blocks; b++)
        if (kv->blocks[b].state == KV_FREE) return b;
    REQUIRE(!"a free block");
    return 0;
}

static void test_block_calls(void) {
    uint32_t ids[4] = {SENTINEL_U32, SENTINEL_U32, SENTINEL_U32, SENTINEL_U32}, out = SENTINEL_U32;
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, keyed, &table, &len) == KVA_OK);
    uint32_t in_table = table[0], free_block = a_free_block(), past = kv->num_blocks;
    /* take */
    REFUSED(kva_kv_block_take(kv, 2, 0, NULL), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_take(kv, 2, KVA_KV_PRIORITIES, ids), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_take(kv, 30, 0, ids), KVA_ERR_NOMEM);
    CHECK(ids[0] == SENTINEL_U32);
    /* unref: out of range, a double unref, a block only a sequence's table holds, a list whose
     * last entry is bad after good ones, a block listed more often than the engine holds it */
    uint32_t bad_last[] = {held[0], held[1], past}, twice[] = {held[1], held[1]};
    uint32_t seq_last[] = {held[0], in_table};
    REFUSED(kva_kv_block_unref(kv, &past, 1), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_unref(kv, &free_block, 1), KVA_ERR_DOUBLE_FREE);
    REFUSED(kva_kv_block_unref(kv, &in_table, 1), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_unref(kv, bad_last, 3), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_unref(kv, twice, 2), KVA_ERR_DOUBLE_FREE);
    REFUSED(kva_kv_block_unref(kv, seq_last, 2), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_unref(kv, NULL, 1), KVA_ERR_INVALID);
    /* ref: a free block holds nothing */
    uint32_t then_free[] = {held[0], free_block};
    REFUSED(kva_kv_block_ref(kv, &free_block, 1), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_ref(kv, then_free, 2), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_ref(kv, &past, 1), KVA_ERR_INVALID);
    /* commit: key lengths, blocks the engine does not hold alone, registered, listed twice */
    uint32_t reg[4] = {SENTINEL_U32, SENTINEL_U32, SENTINEL_U32, SENTINEL_U32};
    uint32_t pair[] = {held[1], held[2]}, dup[] = {held[1], held[1]}, with_past[] = {held[1], held[2], past};
    REFUSED(kva_kv_block_commit(kv, 2, pair, 2, keys, 0, NULL, 0, reg), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_commit(kv, 2, pair, 2, keys, 33, NULL, 0, reg), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_commit(kv, 2, pair, 2, NULL, 32, NULL, 0, reg), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_commit(kv, 2, &in_table, 1, keys, 32, NULL, 0, reg), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_commit(kv, 2, &held[0], 1, keys, 32, NULL, 0, reg), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_commit(kv, 2, &free_block, 1, keys, 32, NULL, 0, reg), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_commit(kv, 2, &cached_block, 1, keys, 32, NULL, 0, reg), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_commit(kv, 2, dup, 2, keys, 32, NULL, 0, reg), KVA_ERR_INVALID);
    REFUSED(kva_kv_block_commit(kv, 2, with_past, 3, keys, 32, NULL, 0, reg), KVA_ERR_INVALID);
    CHECK(reg[0] == SENTINEL_U32);
    /* eviction by block and by key */
    uint32_t evict_past[] = {cached_block, past};
    REFUSED(kva_kv_evict_blocks(kv, evict_past, 2, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_evict_blocks(kv, NULL, 2, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_evict_keys(kv, 2, keys, 0, 1, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_evict_keys(kv, 2, keys, 33, 1, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_evict_keys(kv, 2, NULL, 32, 1, &out), KVA_ERR_INVALID);
    CHECK(out == SENTINEL_U32);
}

static void test_events(void) {
    kva_kv_event buf[4];
    memset(buf, 0x5e, sizeof buf);
    uint32_t count = SENTINEL_U32;
    uint64_t dropped = 0x5e;
    REFUSED(kva_kv_take_events(kv, buf, 0, &count, &dropped), KVA_ERR_INVALID);
    REFUSED(kva_kv_take_events(kv, NULL, 4, &count, &dropped), KVA_ERR_INVALID);
    REFUSED(kva_kv_take_events(kv, buf, 4, NULL, &dropped), KVA_ERR_INVALID);
    REFUSED(kva_kv_take_events(kv, buf, 4, &count, NULL), KVA_ERR_INVALID);
    CHECK(count == SENTINEL_U32 && dropped == 0x5e && buf[0].kind == 0x5e5e5e5eu);
    kva_kv_config cfg = small_config(8, BT);
    kva_kv *quiet = make_cache(&cfg);
    CHECK_STATUS(kva_kv_take_events(quiet, buf, 4, &count, &dropped), KVA_ERR_INVALID);
    CHECK(count == SENTINEL_U32);
    kva_kv_destroy(quiet);
}

static void test_batches(void) {
    kva_kv_seq seqs[3] = {SENTINEL_SEQ, SENTINEL_SEQ, SENTINEL_SEQ};
    uint32_t done = SENTINEL_U32, cached[3] = {SENTINEL_U32, SENTINEL_U32, SENTINEL_U32};
    uint32_t num_tokens[3] = {8, 8, 8};
    uint8_t priorities[3] = {0, KVA_KV_PRIORITIES, 0};
    kva_kv_content c = bytes_content(keys, 32);
    uint64_t offsets[4] = {0, 2, 4, 6}, backwards[4] = {0, 2, 1, 6}, late[4] = {1, 2, 4, 6}, too_many[4] = {0, 2, 5, 6};
    /* admission: a bad request in the middle, bad offsets, missing arrays */
    REFUSED(kva_kv_seq_admit_many(kv, 3, num_tokens, NULL, priorities, &c, offsets, seqs, cached, &done),
            KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit_many(kv, 3, num_tokens, NULL, NULL, &c, backwards, seqs, cached, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit_many(kv, 3, num_tokens, NULL, NULL, &c, late, seqs, cached, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit_many(kv, 3, num_tokens, NULL, NULL, &c, too_many, seqs, cached, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit_many(kv, 3, num_tokens, NULL, NULL, &c, NULL, seqs, cached, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit_many(kv, 3, NULL, NULL, NULL, NULL, NULL, seqs, cached, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit_many(kv, 3, num_tokens, NULL, NULL, NULL, NULL, NULL, cached, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_admit_many(kv, 3, num_tokens, NULL, NULL, NULL, NULL, seqs, cached, NULL), KVA_ERR_INVALID);
    CHECK(seqs[0] == SENTINEL_SEQ && cached[0] == SENTINEL_U32 && done == SENTINEL_U32);
    /* extension: a bad handle in the middle (stale, never given, a pin, listed twice) */
    kva_kv_seq never = (kva_kv_seq)1 << 32 | 777;
    kva_kv_seq with_stale[] = {keyed, stale, forked}, with_never[] = {keyed, never, forked};
    kva_kv_seq with_pin[] = {keyed, pinned, forked}, with_twice[] = {keyed, forked, keyed};
    uint32_t grow[3] = {1, 1, 1}, copies_n = SENTINEL_U32;
    kva_kv_block_copy copies[3];
    memset(copies, 0x5e, sizeof copies);
    REFUSED(kva_kv_seq_extend_many(kv, 3, with_stale, grow, NULL, NULL, copies, &copies_n, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend_many(kv, 3, with_never, grow, NULL, NULL, copies, &copies_n, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend_many(kv, 3, with_pin, grow, NULL, NULL, copies, &copies_n, &done), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend_many(kv, 3, with_twice, grow, NULL, NULL, copies, &copies_n, &done), KVA_ERR_INVALID);
    /* the same through a step struct, whose results stay as they were */
    kva_kv_step step = {with_twice, grow, NULL, NULL, copies, SENTINEL_U32, SENTINEL_U32};
    REFUSED(kva_kv_seq_extend_step(kv, &step, 3), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_extend_step(kv, NULL, 3), KVA_ERR_INVALID);
    CHECK(step.num_copies == SENTINEL_U32 && step.done == SENTINEL_U32);
    /* ... or content the middle one cannot take: keyed (10 tokens) takes no key for 1 token,
     * forked needs one key for the 2 that fill its block */
    kva_kv_seq pair[] = {keyed, forked};
    uint32_t fill[2] = {2, 2};
    uint64_t one_each[3] = {0, 1, 2}, only_first[3] = {0, 1, 1};
    REFUSED(kva_kv_seq_extend_many(kv, 2, pair, grow, &c, one_each, copies, &copies_n, &done), KVA_ERR_INVALID);
    kva_kv_step pair_step = {pair, fill, &c, only_first, copies, 0, 0};
    CHECK_STATUS(kva_kv_seq_extend_step(kv, &pair_step, 2), KVA_OK);
    CHECK(pair_step.done == 2 && pair_step.num_copies == 1 && copies[0].request == 0); /* forked's chain broke */
    before = kv_state_hash(kv);
    REFUSED(kva_kv_seq_extend_many(kv, 2, pair, grow, NULL, NULL, NULL, &copies_n, &done), KVA_ERR_INVALID);
    /* free: a stale handle, one never given, a pin, a sequence listed twice; nothing is freed */
    REFUSED(kva_kv_seq_free_many(kv, 3, with_stale), KVA_ERR_DOUBLE_FREE);
    REFUSED(kva_kv_seq_free_many(kv, 3, with_never), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_free_many(kv, 3, with_pin), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_free_many(kv, 3, with_twice), KVA_ERR_DOUBLE_FREE);
    REFUSED(kva_kv_seq_free_many(kv, 3, NULL), KVA_ERR_INVALID);
    /* lookups */
    uint32_t hits[3] = {SENTINEL_U32, SENTINEL_U32, SENTINEL_U32};
    REFUSED(kva_kv_lookup_many(kv, 3, NULL, &c, offsets, NULL, NULL), KVA_ERR_INVALID);
    REFUSED(kva_kv_lookup_many(kv, 3, NULL, &c, NULL, hits, NULL), KVA_ERR_INVALID);
    REFUSED(kva_kv_lookup_many(kv, 3, NULL, NULL, offsets, hits, NULL), KVA_ERR_INVALID);
    REFUSED(kva_kv_lookup_many(kv, 3, NULL, &c, backwards, hits, NULL), KVA_ERR_INVALID);
    CHECK(hits[0] == SENTINEL_U32);
}

int main(void) {
    test_configs();
    test_null_cache();
    setup();
    test_content();
    test_block_calls();
    test_events();
    test_batches();
    kva_kv_stats st = stats(kv);
    CHECK(st.rejected_calls > 60);
    kva_kv_seq rest[] = {keyed, forked};
    CHECK_STATUS(kva_kv_seq_free_many(kv, 2, rest), KVA_OK);
    CHECK_STATUS(kva_kv_unpin(kv, pinned), KVA_OK);
    CHECK_STATUS(kva_kv_block_unref(kv, held, 3), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
    return CHECK_DONE();
}
