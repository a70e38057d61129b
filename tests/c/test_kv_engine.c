/*
 * test_kv_engine.c — what an engine plugging into the KV manager relies on, call by call: its own
 * keys stored exactly (never aliasing, whatever their fingerprint), 64-bit namespaces compared
 * exactly, blocks filled during decode committed so a later request hits them, the block calls
 * over the same store as the sequences, the batch calls, and the events, in order, with the
 * drops counted. kva_kv_check runs after every step that changes the cache.
 */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kv_test.h"

#define BT 4u

static void checked(kva_kv *kv) { CHECK_STATUS(kva_kv_check(kv), KVA_OK); }

/* A key of len bytes derived from seed, as an engine's hash would be. */
static void make_key(uint8_t *out, uint32_t len, uint64_t seed) {
    for (uint32_t i = 0; i < len; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        out[i] = (uint8_t)(seed >> 56);
    }
}

static kva_kv_config engine_config(uint32_t blocks, uint32_t key_bytes, uint32_t events) {
    kva_kv_config cfg = small_config(blocks, BT);
    cfg.max_key_bytes = key_bytes;
    cfg.event_capacity = events;
    return cfg;
}

static const uint32_t *table_of(kva_kv *kv, kva_kv_seq seq) {
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, seq, &table, &len) == KVA_OK);
    return table;
}

/* ---- the engine's own keys and 64-bit namespaces ------------------------------------------------ */

static void test_engine_keys(void) {
    kva_kv_config cfg = engine_config(32, 32, 0);
    kva_kv *kv = make_cache(&cfg);
    uint8_t keys[3 * 32];
    make_key(keys, sizeof keys, 1);
    kva_kv_content c = bytes_content(keys, 32);
    const uint64_t ns = (uint64_t)1 << 40 | 5, same_low = (uint64_t)2 << 40 | 5;
    uint32_t cached = 99;
    kva_kv_seq a = admit(kv, 13, ns, &c, 3, &cached);
    CHECK(cached == 0 && stats(kv).registered_blocks == 3);
    kva_kv_seq b = admit(kv, 12, ns, &c, 3, &cached);
    CHECK(cached == 12 && memcmp(table_of(kv, a), table_of(kv, b), 3 * sizeof(uint32_t)) == 0);
    kva_kv_seq_info si;
    REQUIRE(kva_kv_seq_get_info(kv, b, &si) == KVA_OK);
    CHECK(si.namespace_id == 5 && si.namespace_hi == 1u << 8);
    /* The namespace is all 64 bits: the same low half in another namespace misses. */
    kva_kv_seq other_ns = admit(kv, 4, same_low, &c, 1, &cached);
    CHECK(cached == 0);
    /* A key that is a prefix of a stored one, or differs in its last byte, is another key. */
    kva_kv_content short_keys = bytes_content(keys, 16);
    kva_kv_seq prefix = admit(kv, 4, ns, &short_keys, 1, &cached);
    CHECK(cached == 0);
    uint8_t changed[32];
    memcpy(changed, keys, 32);
    changed[31] ^= 1;
    kva_kv_content changed_key = bytes_content(changed, 32);
    kva_kv_seq last_byte = admit(kv, 4, ns, &changed_key, 1, &cached);
    CHECK(cached == 0);
    checked(kv);

    /* Equality is the bytes, not the fingerprint: a key whose fingerprint is that of a stored
     * key but whose bytes or length differ is not found. */
    uint32_t b0 = table_of(kv, a)[0];
    kv_ident forged = {kv->blocks[b0].key, ns, changed, 32};
    CHECK(kv_prefix_find(kv, &forged) == KVA_NIL);
    forged = (kv_ident){kv->blocks[b0].key, ns, keys, 31};
    CHECK(kv_prefix_find(kv, &forged) == KVA_NIL);
    forged = (kv_ident){kv->blocks[b0].key, ns, keys, 32};
    CHECK(kv_prefix_find(kv, &forged) == b0);

    /* Lookups change nothing and say what an admission would hit. */
    uint64_t before = kv_state_hash(kv);
    uint32_t ids[3] = {0}, hits = 99;
    CHECK_STATUS(kva_kv_lookup(kv, ns, &c, 3, ids, &hits), KVA_OK);
    CHECK(hits == 3 && memcmp(ids, table_of(kv, a), sizeof ids) == 0);
    CHECK_STATUS(kva_kv_lookup(kv, same_low, &c, 3, NULL, &hits), KVA_OK);
    CHECK(hits == 1); /* the one block other_ns registered there */
    CHECK(kv_state_hash(kv) == before);

    /* The u32 calls are the u64 ones with the namespace widened. */
    uint64_t caller[2] = {11, 12};
    kva_kv_seq old = alloc_keys(kv, 8, caller, 2, 7, 0, NULL);
    kva_kv_content u = u64_content(caller);
    kva_kv_seq widened = admit(kv, 8, 7, &u, 2, &cached);
    CHECK(cached == 8);
    kva_kv_seq pin;
    uint32_t pinned;
    CHECK_STATUS(kva_kv_pin_content(kv, ns, &c, 3, &pin, &pinned), KVA_OK);
    CHECK(pinned == 12);
    checked(kv);
    kva_kv_seq all[] = {a, b, other_ns, prefix, last_byte, old, widened};
    CHECK_STATUS(kva_kv_seq_free_many(kv, 7, all), KVA_OK);
    CHECK_STATUS(kva_kv_unpin(kv, pin), KVA_OK);
    checked(kv);
    kva_kv_destroy(kv);
}

/* ---- blocks filled during decode go into the prefix cache ---------------------------------------- */

/* One turn: a prompt of 6 tokens, 5 decoded tokens in one extension (filling block 1), freed;
 * then turn two, whose prompt is turn one's 11 tokens and more, hits both full blocks. */
static void decode_turns(kva_kv_key_kind kind) {
    kva_kv_config cfg = engine_config(32, 16, 0);
    kva_kv *kv = make_cache(&cfg);
    uint32_t tokens[12];
    for (uint32_t i = 0; i < 12; i++) tokens[i] = 100 + i;
    uint64_t keys[3] = {7, 8, 9};
    uint8_t bytes[3 * 16];
    make_key(bytes, sizeof bytes, 3);
    kva_kv_content c = kind == KVA_KV_KEY_TOKENS ? tokens_content(tokens)
                       : kind == KVA_KV_KEY_U64  ? u64_content(keys)
                                                 : bytes_content(bytes, 16);
    uint32_t given = kind == KVA_KV_KEY_TOKENS ? 6 : 1, cached;
    kva_kv_seq turn1 = admit(kv, 6, 9, &c, given, &cached);
    CHECK(stats(kv).registered_blocks == 1);
    kva_kv_content more = c;
    uint32_t appended = kind == KVA_KV_KEY_TOKENS ? 5 : 1;
    if (kind == KVA_KV_KEY_TOKENS) more.tokens = tokens + 6;
    else if (kind == KVA_KV_KEY_U64) more.keys = keys + 1;
    else more.key_bytes = bytes + 16;
    kva_kv_copy copy;
    CHECK_STATUS(kva_kv_seq_extend(kv, turn1, 5, &more, appended, &copy), KVA_OK);
    CHECK(copy.tokens == 0 && stats(kv).registered_blocks == 2);
    uint32_t decoded_block = table_of(kv, turn1)[1];
    checked(kv);
    CHECK_STATUS(kva_kv_seq_free(kv, turn1), KVA_OK);
    CHECK(stats(kv).cached_blocks == 2);
    kva_kv_seq turn2 = admit(kv, 12, 9, &c, kind == KVA_KV_KEY_TOKENS ? 12 : 3, &cached);
    CHECK(cached == 8 && table_of(kv, turn2)[1] == decoded_block);
    checked(kv);
    CHECK_STATUS(kva_kv_seq_free(kv, turn2), KVA_OK);
    kva_kv_destroy(kv);
}

/* A sequence whose extension says nothing of its new tokens stops keeping its chain; a fork
 * keeps its parent's, and its copy on write is committed, not the shared block. */
static void test_chains(void) {
    kva_kv_config cfg = engine_config(32, 0, 0);
    kva_kv *kv = make_cache(&cfg);
    uint32_t tokens[16];
    for (uint32_t i = 0; i < 16; i++) tokens[i] = 500 + i;
    kva_kv_content c = tokens_content(tokens);
    kva_kv_seq s = admit(kv, 6, 0, &c, 6, NULL);
    kva_kv_copy copy;
    CHECK_STATUS(kva_kv_seq_append(kv, s, 1, &copy), KVA_OK); /* the chain breaks here */
    kva_kv_content rest = tokens_content(tokens + 7);
    CHECK_STATUS(kva_kv_seq_extend(kv, s, 2, &rest, 2, &copy), KVA_OK); /* not read */
    CHECK(stats(kv).registered_blocks == 1);
    checked(kv);

    /* The same prompt, forked: parent and child fill block 1 with different tokens. */
    kva_kv_seq parent = admit(kv, 6, 1, &c, 6, NULL), child;
    REQUIRE(kva_kv_seq_fork(kv, parent, &child) == KVA_OK);
    uint32_t shared = table_of(kv, parent)[1], theirs[2] = {900, 901};
    kva_kv_content child_tokens = tokens_content(theirs), parent_tokens = tokens_content(tokens + 6);
    CHECK_STATUS(kva_kv_seq_extend(kv, child, 2, &child_tokens, 2, &copy), KVA_OK);
    CHECK(copy.src_block == shared && copy.tokens == 2 && copy.dst_block == table_of(kv, child)[1]);
    CHECK(stats(kv).registered_blocks == 3 && kv->blocks[copy.dst_block].registered && !kv->blocks[shared].registered);
    CHECK_STATUS(kva_kv_seq_extend(kv, parent, 2, &parent_tokens, 2, &copy), KVA_OK);
    CHECK(copy.tokens == 0 && kv->blocks[shared].registered && stats(kv).registered_blocks == 4);
    /* A third fill with the child's tokens is a duplicate: it stays unregistered. */
    kva_kv_seq third = admit(kv, 6, 1, &c, 6, NULL);
    CHECK_STATUS(kva_kv_seq_extend(kv, third, 2, &child_tokens, 2, &copy), KVA_OK);
    CHECK(!kv->blocks[table_of(kv, third)[1]].registered && stats(kv).registered_blocks == 4);
    /* The decode-filled blocks are what a prompt of the whole text hits. */
    uint32_t whole[8] = {500, 501, 502, 503, 504, 505, 900, 901}, hits, ids[8];
    kva_kv_content w = tokens_content(whole);
    CHECK_STATUS(kva_kv_lookup(kv, 1, &w, 8, ids, &hits), KVA_OK);
    CHECK(hits == 2 && ids[1] == table_of(kv, child)[1]);
    checked(kv);
    kva_kv_seq all[] = {s, parent, child, third};
    CHECK_STATUS(kva_kv_seq_free_many(kv, 4, all), KVA_OK);

    /* The older calls register nothing while decoding: no content reaches the append. */
    kva_kv_seq legacy;
    REQUIRE(kva_kv_seq_allocate(kv, 6, NULL, 0, tokens, 6, 3, 0, &legacy, NULL) == KVA_OK);
    uint32_t registered = stats(kv).registered_blocks;
    CHECK_STATUS(kva_kv_seq_append(kv, legacy, 2, &copy), KVA_OK);
    CHECK(stats(kv).registered_blocks == registered);
    CHECK_STATUS(kva_kv_seq_free(kv, legacy), KVA_OK);
    checked(kv);
    kva_kv_destroy(kv);
}

/* ---- the block calls ------------------------------------------------------------------------------ */

static kva_kv_event events[64];

static uint32_t drain(kva_kv *kv, uint64_t *dropped) {
    uint32_t n = 0;
    uint64_t lost = 0;
    REQUIRE(kva_kv_take_events(kv, events, 64, &n, &lost) == KVA_OK);
    if (dropped) *dropped = lost;
    return n;
}

static void test_block_calls(void) {
    kva_kv_config cfg = engine_config(8, 16, 64);
    kva_kv *kv = make_cache(&cfg);
    uint32_t ids[8], reg[3];
    uint8_t keys[4 * 16];
    make_key(keys, sizeof keys, 9);
    CHECK_STATUS(kva_kv_block_take(kv, 3, 2, ids), KVA_OK);
    CHECK(stats(kv).used_blocks == 3 && kv->loose_refs == 3);
    checked(kv);
    CHECK_STATUS(kva_kv_block_commit(kv, 4, ids, 3, keys, 16, NULL, 0, reg), KVA_OK);
    CHECK(memcmp(reg, ids, sizeof reg) == 0 && stats(kv).registered_blocks == 3);
    uint64_t dropped;
    CHECK(drain(kv, &dropped) == 3 && dropped == 0);
    for (uint32_t j = 0; j < 3; j++) {
        CHECK(events[j].kind == KVA_KV_EVENT_STORED && events[j].block == ids[j] && events[j].namespace_id == 4);
        CHECK(events[j].key_len == 16 && memcmp(events[j].key, keys + 16 * j, 16) == 0 && !events[j].library_key);
        CHECK(events[j].first_token == j * BT && events[j].num_tokens == BT);
        CHECK(events[j].parent_len == (j ? 16 : 0) && (!j || memcmp(events[j].parent, keys + 16 * (j - 1), 16) == 0));
    }
    /* A prompt hits what the engine committed, and the engine's references and the sequence's
     * add up. */
    kva_kv_content c = bytes_content(keys, 16);
    uint32_t cached;
    kva_kv_seq s = admit(kv, 12, 4, &c, 3, &cached);
    CHECK(cached == 12 && kv->blocks[ids[0]].refs == 2);
    checked(kv);
    /* Released tail first: ids[2] is evicted first. */
    uint32_t tail_first[3] = {ids[2], ids[1], ids[0]};
    CHECK_STATUS(kva_kv_block_unref(kv, tail_first, 3), KVA_OK);
    CHECK(stats(kv).cached_blocks == 0 && kv->loose_refs == 0);
    CHECK_STATUS(kva_kv_seq_free(kv, s), KVA_OK);
    CHECK(stats(kv).cached_blocks == 3);
    checked(kv);
    /* Taking 6 of 8 evicts one, the oldest: the sequence released its last block first. */
    uint32_t more[6];
    CHECK_STATUS(kva_kv_block_take(kv, 6, 0, more), KVA_OK);
    CHECK(drain(kv, NULL) == 1 && events[0].kind == KVA_KV_EVENT_REMOVED && events[0].block == ids[2]);
    CHECK(memcmp(events[0].key, keys + 32, 16) == 0 && stats(kv).evictions == 1);
    /* A touch takes a cached block off the LRU lists. */
    CHECK_STATUS(kva_kv_block_ref(kv, &ids[1], 1), KVA_OK);
    CHECK(stats(kv).cached_blocks == 1 && kv->blocks[ids[1]].state == KV_USED);
    checked(kv);
    /* A duplicate commit reports the holder and leaves its block unregistered, freed at release. */
    uint32_t holder = 0;
    CHECK_STATUS(kva_kv_block_commit(kv, 4, &more[0], 1, keys, 16, NULL, 0, &holder), KVA_OK);
    CHECK(holder == ids[0] && !kv->blocks[more[0]].registered && drain(kv, NULL) == 0);
    CHECK_STATUS(kva_kv_block_unref(kv, &more[0], 1), KVA_OK);
    CHECK(kv->blocks[more[0]].state == KV_FREE);
    /* Eviction by block: a cached one is freed, a used one unregistered, an unregistered one
     * passed over. */
    uint32_t evicted = 99, which[3] = {ids[0], ids[1], more[1]};
    CHECK_STATUS(kva_kv_evict_blocks(kv, which, 3, &evicted), KVA_OK);
    CHECK(evicted == 2 && kv->blocks[ids[0]].state == KV_FREE && kv->blocks[ids[1]].state == KV_USED);
    CHECK(!kv->blocks[ids[1]].registered && drain(kv, NULL) == 2 && events[1].block == ids[1]);
    checked(kv);
    /* Eviction by key, and a reset. */
    CHECK_STATUS(kva_kv_block_commit(kv, 4, &more[1], 2, keys + 16, 16, keys, 4, reg), KVA_OK);
    CHECK(drain(kv, NULL) == 2 && events[0].parent_len == 16 && memcmp(events[0].parent, keys, 16) == 0);
    CHECK(events[0].first_token == 4 && events[1].first_token == 8);
    CHECK_STATUS(kva_kv_evict_keys(kv, 4, keys + 16, 16, 1, &evicted), KVA_OK);
    CHECK(evicted == 1 && !kv->blocks[more[1]].registered && kv->blocks[more[2]].registered);
    CHECK_STATUS(kva_kv_evict_keys(kv, 5, keys + 32, 16, 1, &evicted), KVA_OK); /* another namespace */
    CHECK(evicted == 0);
    CHECK_STATUS(kva_kv_block_unref(kv, &more[2], 1), KVA_OK);
    CHECK(stats(kv).cached_blocks == 1);
    drain(kv, NULL);
    CHECK_STATUS(kva_kv_reset_prefix_cache(kv), KVA_OK);
    kva_kv_stats st = stats(kv);
    CHECK(st.registered_blocks == 0 && st.cached_blocks == 0 && drain(kv, NULL) == 1);
    CHECK(events[0].kind == KVA_KV_EVENT_CLEARED && events[0].block == KVA_KV_NO_BLOCK);
    checked(kv);
    /* Compaction moves the engine's blocks with their references. */
    uint32_t held[5] = {ids[1], more[1], more[3], more[4], more[5]}, moves_needed;
    kva_kv_move moves[8];
    CHECK_STATUS(kva_kv_compact(kv, moves, 8, &moves_needed), KVA_OK);
    for (uint32_t m = 0; m < moves_needed; m++)
        for (int i = 0; i < 5; i++)
            if (held[i] == moves[m].src_block) held[i] = moves[m].dst_block;
    for (int i = 0; i < 5; i++) CHECK(held[i] < 5 && kv->loose[held[i]] == 1);
    checked(kv);
    CHECK_STATUS(kva_kv_block_unref(kv, held, 5), KVA_OK);
    CHECK(stats(kv).free_blocks == 8);
    checked(kv);
    kva_kv_destroy(kv);
}

/* ---- batches ---------------------------------------------------------------------------------- */

static void test_batches(void) {
    kva_kv_config cfg = engine_config(1024, 0, 0);
    kva_kv *kv = make_cache(&cfg);
    /* Four prompts; the second shares the first's first block and hits it in the same call. */
    uint32_t tokens[] = {1, 2, 3, 4, 5, 6, 7, 8, /**/ 1, 2, 3, 4, 9, /**/ 20, 21, 22, 23, /**/ 30};
    uint64_t offsets[] = {0, 8, 13, 17, 18};
    uint32_t num_tokens[] = {8, 5, 4, 1}, cached[4], done = 99;
    uint64_t namespaces[] = {0, 0, 1, 0};
    uint8_t priorities[] = {0, 1, 2, 3};
    kva_kv_seq seqs[4];
    kva_kv_content c = tokens_content(tokens);
    CHECK_STATUS(kva_kv_seq_admit_many(kv, 4, num_tokens, namespaces, priorities, &c, offsets, seqs, cached, &done),
                 KVA_OK);
    CHECK(done == 4 && cached[0] == 0 && cached[1] == 4 && cached[2] == 0 && cached[3] == 0);
    CHECK(table_of(kv, seqs[1])[0] == table_of(kv, seqs[0])[0] && stats(kv).registered_blocks == 3);
    uint32_t hits[4], ids[18];
    CHECK_STATUS(kva_kv_lookup_many(kv, 4, namespaces, &c, offsets, hits, ids), KVA_OK);
    CHECK(hits[0] == 2 && hits[1] == 1 && hits[2] == 1 && hits[3] == 0 && ids[8] == table_of(kv, seqs[0])[0]);
    CHECK_STATUS(kva_kv_seq_free_many(kv, 4, seqs), KVA_OK);
    checked(kv);

    /* One decode step for 256 sequences, each keyed by its tokens: every one fills its first
     * block and commits it. */
    enum {
        N = 256
    };
    static uint32_t prompt[N * 3], next[N], ones[N];
    static uint64_t prompt_off[N + 1], next_off[N + 1];
    static kva_kv_seq running[N];
    static kva_kv_block_copy copies[N];
    for (uint32_t i = 0; i < N; i++) {
        for (uint32_t t = 0; t < 3; t++) prompt[i * 3 + t] = i * 10 + t;
        next[i] = i * 10 + 3;
        ones[i] = 1;
        prompt_off[i + 1] = (i + 1) * 3;
        next_off[i + 1] = i + 1;
    }
    static uint32_t threes[N];
    for (uint32_t i = 0; i < N; i++) threes[i] = 3;
    kva_kv_content pc = tokens_content(prompt), nc = tokens_content(next);
    CHECK_STATUS(kva_kv_seq_admit_many(kv, N, threes, NULL, NULL, &pc, prompt_off, running, NULL, &done), KVA_OK);
    CHECK(done == N && stats(kv).registered_blocks == 3); /* the first prompts' */
    /* Four of them forked: their partial blocks are shared, so those four copy on write. */
    kva_kv_seq forks[4];
    for (int f = 0; f < 4; f++) REQUIRE(kva_kv_seq_fork(kv, running[f * 60], &forks[f]) == KVA_OK);
    uint32_t ncopies = 99;
    CHECK_STATUS(kva_kv_seq_extend_many(kv, N, running, ones, &nc, next_off, copies, &ncopies, &done), KVA_OK);
    CHECK(done == N && ncopies == 4 && stats(kv).registered_blocks == N + 3);
    for (uint32_t f = 0; f < 4 && f < ncopies; f++) {
        CHECK(copies[f].request == f * 60 && copies[f].tokens == 3);
        CHECK(copies[f].dst_block == table_of(kv, running[f * 60])[0] &&
              copies[f].src_block == table_of(kv, forks[f])[0]);
    }
    checked(kv);
    CHECK_STATUS(kva_kv_seq_free_many(kv, 4, forks), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free_many(kv, N, running), KVA_OK);
    CHECK(stats(kv).cached_blocks == N + 3); /* and the first prompts' three */
    checked(kv);
    kva_kv_destroy(kv);
}

/* A batch that runs out of blocks stops at the first request that does not fit: the ones
 * before are done as single calls would have done them, the rest untouched. */
static void test_batch_runs_out(void) {
    kva_kv_config cfg = engine_config(10, 0, 0);
    kva_kv *kv = make_cache(&cfg);
    uint32_t num_tokens[] = {16, 12, 16, 4}, cached[4] = {7, 7, 7, 7}, done = 99;
    kva_kv_seq seqs[4] = {1, 1, 1, 1};
    CHECK_STATUS(kva_kv_seq_admit_many(kv, 4, num_tokens, NULL, NULL, NULL, NULL, seqs, cached, &done), KVA_OK);
    CHECK(done == 2 && seqs[2] == 1 && seqs[3] == 1 && cached[2] == 7 && strstr(kva_last_error(), "needs 4") != NULL);
    kva_kv_stats st = stats(kv);
    CHECK(st.sequences == 2 && st.used_blocks == 7 && st.alloc_failures == 1);
    /* Extension: the first needs 2 blocks (of 3 free), the second 2 more: it stops there. */
    uint32_t grow[] = {8, 8};
    kva_kv_block_copy copies[2];
    uint32_t ncopies = 99;
    uint64_t before_second;
    {
        const uint32_t *t;
        uint32_t len;
        REQUIRE(kva_kv_seq_block_table(kv, seqs[1], &t, &len) == KVA_OK);
        before_second = len;
    }
    CHECK_STATUS(kva_kv_seq_extend_many(kv, 2, seqs, grow, NULL, NULL, copies, &ncopies, &done), KVA_OK);
    CHECK(done == 1 && ncopies == 0 && table_len(kv, seqs[0]) == 6 && table_len(kv, seqs[1]) == before_second);
    checked(kv);
    CHECK_STATUS(kva_kv_seq_free_many(kv, 2, seqs), KVA_OK);
    kva_kv_destroy(kv);
}

/* ---- events ------------------------------------------------------------------------------------ */

static void test_events(void) {
    kva_kv_config cfg = engine_config(16, 0, 4);
    cfg.event_medium = KVA_KV_MEDIUM_CPU;
    kva_kv *kv = make_cache(&cfg);
    uint32_t tokens[24];
    for (uint32_t i = 0; i < 24; i++) tokens[i] = 40 + i;
    kva_kv_content c = tokens_content(tokens);
    kva_kv_seq a = admit(kv, 12, 3, &c, 12, NULL);
    const uint32_t *t = table_of(kv, a);
    uint32_t n;
    uint64_t dropped;
    kva_kv_event two[2];
    CHECK_STATUS(kva_kv_take_events(kv, two, 2, &n, &dropped), KVA_OK);
    CHECK(n == 2 && dropped == 0);
    for (uint32_t j = 0; j < 2; j++) {
        const kva_kv_block *blk = &kv->blocks[t[j]];
        uint8_t key[16];
        for (int i = 0; i < 8; i++)
            key[i] = (uint8_t)(blk->key.lo >> (8 * i)), key[8 + i] = (uint8_t)(blk->key.hi >> (8 * i));
        CHECK(two[j].kind == KVA_KV_EVENT_STORED && two[j].block == t[j] && two[j].library_key && two[j].key_len == 16);
        CHECK(memcmp(two[j].key, key, 16) == 0 && two[j].medium == KVA_KV_MEDIUM_CPU && two[j].namespace_id == 3);
        CHECK(two[j].parent_len == (j ? 16 : 0) && two[j].first_token == j * BT);
        if (j) CHECK(memcmp(two[j].parent, two[j - 1].key, 16) == 0);
    }
    /* The third stays; three more fill the ring, a fourth is dropped. */
    kva_kv_content d = tokens_content(tokens + 12);
    kva_kv_seq b = admit(kv, 12, 3, &d, 12, NULL);
    kva_kv_seq extra = admit(kv, 4, 4, &c, 4, NULL);
    CHECK(drain(kv, &dropped) == 4 && dropped == 1);
    CHECK(events[0].block == t[2] && events[0].parent_len == 16 && events[1].block == table_of(kv, b)[0]);
    CHECK(events[1].parent_len == 0 && events[3].block == table_of(kv, b)[2]);
    CHECK(drain(kv, &dropped) == 0 && dropped == 0);
    /* Removed events in eviction order: the freed sequence's tail first. */
    CHECK_STATUS(kva_kv_seq_free(kv, a), KVA_OK);
    uint32_t evicted;
    CHECK_STATUS(kva_kv_evict(kv, 2, &evicted), KVA_OK);
    CHECK(drain(kv, NULL) == 2 && events[0].kind == KVA_KV_EVENT_REMOVED && events[0].block == t[2] &&
          events[1].block == t[1]);
    checked(kv);
    kva_kv_seq rest[] = {b, extra};
    CHECK_STATUS(kva_kv_seq_free_many(kv, 2, rest), KVA_OK);
    kva_kv_destroy(kv);
}

int main(void) {
    test_engine_keys();
    decode_turns(KVA_KV_KEY_TOKENS);
    decode_turns(KVA_KV_KEY_U64);
    decode_turns(KVA_KV_KEY_BYTES);
    test_chains();
    test_block_calls();
    test_batches();
    test_batch_runs_out();
    test_events();
    return CHECK_DONE();
}
