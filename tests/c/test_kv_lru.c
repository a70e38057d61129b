/*
 * test_kv_lru.c — the LRU lists in segments (kv_lru.c) against a plain model: after every
 * operation the victims in eviction order, as the segments give them, equal the model's lists
 * (lowest priority first, oldest first), and kva_kv_check passes (K4: links, positions, density).
 *
 * The operations are what moves blocks on and off the lists: a new one-block keyed prefix
 * released (appended; when no block is free it first evicts the oldest), a hit on a cached
 * block from a sequence of some priority, released again (a tombstone in the middle, an append
 * at the tail of the list of the block's priority, which a hit can raise), and explicit
 * evictions. A phase of hits alone leaves the segments full of tombstones, which must merge;
 * random seeds are printed so a failure can be replayed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kv_cache.h"
#include "kv_test.h"

#define BLOCKS 2048u
#define PRIORITIES 3u

static uint64_t rng;
static uint64_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* The model: each priority's list of block ids, oldest first; each block's key and priority. */
typedef struct model {
    uint32_t list[PRIORITIES][BLOCKS];
    uint32_t len[PRIORITIES];
    uint64_t key[BLOCKS];
    uint32_t prio[BLOCKS];
} model;

static model m;
static uint64_t next_key = 1;

static void model_append(uint32_t b, uint32_t p) {
    m.list[p][m.len[p]++] = b;
    m.prio[b] = p;
}

static void model_remove(uint32_t b) {
    uint32_t p = m.prio[b];
    for (uint32_t i = 0; i < m.len[p]; i++)
        if (m.list[p][i] == b) {
            memmove(&m.list[p][i], &m.list[p][i + 1], (m.len[p] - i - 1) * sizeof m.list[p][0]);
            m.len[p]--;
            return;
        }
    CHECK(!"a block the model lists");
}

static uint32_t model_cached(void) {
    uint32_t n = 0;
    for (uint32_t p = 0; p < PRIORITIES; p++) n += m.len[p];
    return n;
}

/* The oldest block of the lowest nonempty priority leaves the model. */
static void model_evict(void) {
    for (uint32_t p = 0; p < PRIORITIES; p++)
        if (m.len[p]) {
            model_remove(m.list[p][0]);
            return;
        }
}

static int same_order(kva_kv *kv) {
    static uint32_t got[BLOCKS];
    uint32_t n = kv_lru_collect(kv, got, BLOCKS), at = 0;
    if (n != model_cached()) return 0;
    for (uint32_t p = 0; p < PRIORITIES; p++)
        for (uint32_t i = 0; i < m.len[p]; i++)
            if (got[at++] != m.list[p][i]) return 0;
    return 1;
}

/* A one-block sequence for key at priority p, freed at once; returns its block. */
static uint32_t allocate_and_release(kva_kv *kv, uint64_t key, uint32_t p, uint32_t *hit) {
    kva_kv_seq seq;
    uint32_t table[1], cached;
    REQUIRE(kva_kv_seq_allocate(kv, 4, &key, 1, NULL, 0, 0, p, &seq, &cached) == KVA_OK);
    copy_table(kv, seq, table, 1);
    REQUIRE(kva_kv_seq_free(kv, seq) == KVA_OK);
    *hit = cached == 4;
    return table[0];
}

static void release_new(kva_kv *kv) {
    uint32_t p = (uint32_t)(rnd() % PRIORITIES), hit;
    if (stats(kv).free_blocks == 0) model_evict(); /* the allocation evicts one */
    uint64_t key = next_key++;
    uint32_t b = allocate_and_release(kv, key, p, &hit);
    CHECK(!hit);
    m.key[b] = key;
    model_append(b, p);
}

static void hit_cached(kva_kv *kv) {
    uint32_t cached = model_cached();
    if (!cached) return;
    uint32_t pick = (uint32_t)(rnd() % cached), p = 0;
    while (pick >= m.len[p]) pick -= m.len[p++];
    uint32_t b = m.list[p][pick], q = (uint32_t)(rnd() % PRIORITIES), hit;
    uint32_t got = allocate_and_release(kv, m.key[b], q, &hit);
    CHECK(hit && got == b);
    model_remove(b);
    model_append(b, q > p ? q : p); /* a block keeps the highest priority that used it */
}

static void evict_some(kva_kv *kv) {
    uint32_t want = (uint32_t)(rnd() % 200), evicted;
    REQUIRE(kva_kv_evict(kv, want, &evicted) == KVA_OK);
    uint32_t cached = model_cached();
    CHECK(evicted == (want < cached ? want : cached));
    for (uint32_t i = 0; i < evicted; i++) model_evict();
}

static void run(uint64_t seed, int ops) {
    rng = seed;
    memset(&m, 0, sizeof m);
    next_key = 1;
    printf("seed %llu\n", (unsigned long long)seed);
    kva_kv_config cfg = small_config(BLOCKS, 4);
    kva_kv *kv = make_cache(&cfg);
    int mismatches = 0;
    for (int op = 0; op < ops && mismatches < 3; op++) {
        /* Phases: fill, then hits alone (tombstones everywhere), then everything mixed. */
        int phase = op < ops / 4 ? 0 : op < ops / 2 ? 1 : 2;
        uint64_t r = rnd() % 100;
        if (phase == 0 || (phase == 2 && r < 45)) release_new(kv);
        else if (phase == 1 || r < 95) hit_cached(kv);
        else evict_some(kv);
        if (!same_order(kv)) {
            fprintf(stderr, "op %d: the segments' eviction order differs from the model's\n", op);
            mismatches++;
            check_failures++;
        }
        if (op % 97 == 0) CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    }
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    /* Space: the segments handed out stay within the bound kv_lru.c derives. */
    CHECK(kv->lru_used <= 2 * ((BLOCKS + KV_LRU_SEG - 1) / KV_LRU_SEG) + 3 * KVA_KV_PRIORITIES);
    CHECK(kv->lru_used <= kv->lru_segments);
    kva_kv_destroy(kv);
}

/* K4 names a broken segment. */
static void test_check_names_broken_segments(void) {
    kva_kv_config cfg = small_config(256, 4);
    kva_kv *kv = make_cache(&cfg);
    uint32_t hit;
    for (uint64_t key = 1; key <= 100; key++) allocate_and_release(kv, key, 0, &hit);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    uint32_t s = kv->lru_head[0];
    kv->lru_segs[s].live--;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    kv->lru_segs[s].live++;
    uint32_t b = kv->lru_ids[1];
    kv->blocks[b].lru_slot++;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    kv->blocks[b].lru_slot--;
    uint32_t *id = &kv->lru_ids[(size_t)s * KV_LRU_SEG];
    uint32_t saved = *id;
    *id = kv->lru_ids[2]; /* listed twice */
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    *id = saved;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* The free-segment list pointed at an LRU list's empty tail: that segment is on two lists, the
 * real free one on none, and the counts still add up (an empty tail has fill 0, as a free
 * segment has). */
static void test_check_finds_a_segment_on_two_lists(void) {
    kva_kv_config cfg = small_config(512, 4);
    kva_kv *kv = make_cache(&cfg);
    uint32_t hit;
    uint64_t lone = 5000, keys[200];
    /* List 1: one block released, then hit again, which leaves its tail segment empty. */
    kva_kv_seq s = alloc_keys(kv, 4, &lone, 1, 0, 1, &hit);
    REQUIRE(kva_kv_seq_free(kv, s) == KVA_OK);
    kva_kv_seq again = alloc_keys(kv, 4, &lone, 1, 0, 1, &hit);
    /* List 0: 200 blocks cached, then 128 of them hit, which frees whole segments. */
    for (int i = 0; i < 200; i++) keys[i] = 1 + (uint64_t)i;
    s = alloc_keys(kv, 800, keys, 200, 0, 0, &hit);
    REQUIRE(kva_kv_seq_free(kv, s) == KVA_OK);
    kva_kv_seq hits = alloc_keys(kv, 512, keys, 128, 0, 0, &hit);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    uint32_t tail = kv->lru_tail[1], free_head = kv->lru_free;
    REQUIRE(free_head != KVA_NIL && tail != KVA_NIL && kv->lru_segs[tail].fill == 0);
    kv->lru_free = tail;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "on an LRU list and on the free-segment list") != NULL);
    kv->lru_free = free_head;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    REQUIRE(kva_kv_seq_free(kv, again) == KVA_OK && kva_kv_seq_free(kv, hits) == KVA_OK);
    kva_kv_destroy(kv);
}

int main(void) {
    test_check_finds_a_segment_on_two_lists();
    test_check_names_broken_segments();
    run(0x9e3779b97f4a7c15ull, 20000);
    run(12345, 20000);
    return CHECK_DONE();
}
