/*
 * test_kv_compact.c — kva_kv_compact. Two caches take the same calls; one is compacted. Each
 * block of the compacted one carries a tag in a host shadow (its id in the other cache), the
 * moves are applied to the shadow as the engine would apply them to the KV memory, and then
 * every table, every prefix hit and the eviction order must name the same tagged blocks as the
 * cache that never moved. Also: the free blocks are exactly the top ids, the moves are disjoint,
 * sizing and bad input change nothing.
 */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "kv_cache.h"
#include "kv_test.h"

#define NB 96
#define BT 4
#define NSEQ 24

typedef struct twin {
    kva_kv *ref, *kv;    /* ref never compacts */
    uint32_t shadow[NB]; /* kv's block b holds the KV of ref's block shadow[b] */
    kva_kv_seq rseq[2 * NSEQ + 8], seq[2 * NSEQ + 8];
    int live[2 * NSEQ + 8];
    int nseq;
} twin;

static uint64_t family_key(int family, int i) { return 0x1000u * (uint64_t)(family + 1) + (uint64_t)i; }

/* Request s of fragment(): two blocks of family s % 4, then blocks of its own; returns how many. */
static uint32_t request_keys(int s, uint64_t *keys) {
    uint32_t nkeys = 2 + (uint32_t)(s % 5);
    for (uint32_t j = 0; j < nkeys; j++) keys[j] = j < 2 ? family_key(s % 4, (int)j) : family_key(100 + s, (int)j);
    return nkeys;
}

/* Tags kv's blocks of entries [from, len) of sequence i, new in both caches, with ref's ids, and
 * checks entries [0, from), which must be the same data in both. */
static void sync_new_blocks(twin *t, int i, uint32_t from) {
    uint32_t a[NB], b[NB];
    uint32_t la = copy_table(t->ref, t->rseq[i], a, NB), lb = copy_table(t->kv, t->seq[i], b, NB);
    REQUIRE(la == lb && from <= la);
    for (uint32_t j = 0; j < from; j++) CHECK(t->shadow[b[j]] == a[j]);
    for (uint32_t j = from; j < la; j++) t->shadow[b[j]] = a[j];
}

/* Allocates the same request in both caches; returns its index. */
static int both_alloc(twin *t, uint32_t tokens, const uint64_t *keys, uint32_t nkeys, uint32_t priority) {
    uint32_t c1 = 0, c2 = 0;
    int i = t->nseq++;
    REQUIRE(i < 2 * NSEQ + 8);
    REQUIRE(kva_kv_seq_allocate(t->ref, tokens, keys, nkeys, NULL, 0, 0, priority, &t->rseq[i], &c1) == KVA_OK);
    REQUIRE(kva_kv_seq_allocate(t->kv, tokens, keys, nkeys, NULL, 0, 0, priority, &t->seq[i], &c2) == KVA_OK);
    CHECK(c1 == c2);
    t->live[i] = 1;
    sync_new_blocks(t, i, c1 / BT);
    return i;
}

static int both_fork(twin *t, int parent) {
    int i = t->nseq++;
    REQUIRE(i < 2 * NSEQ + 8);
    REQUIRE(kva_kv_seq_fork(t->ref, t->rseq[parent], &t->rseq[i]) == KVA_OK);
    REQUIRE(kva_kv_seq_fork(t->kv, t->seq[parent], &t->seq[i]) == KVA_OK);
    t->live[i] = 1;
    return i;
}

static void both_append(twin *t, int i, uint32_t tokens) {
    kva_kv_copy a, b;
    uint32_t len = table_len(t->kv, t->seq[i]);
    REQUIRE(kva_kv_seq_append(t->ref, t->rseq[i], tokens, &a) == KVA_OK);
    REQUIRE(kva_kv_seq_append(t->kv, t->seq[i], tokens, &b) == KVA_OK);
    CHECK((a.src_block == KVA_KV_NO_BLOCK) == (b.src_block == KVA_KV_NO_BLOCK));
    if (a.src_block != KVA_KV_NO_BLOCK) {
        CHECK(t->shadow[b.src_block] == a.src_block && b.tokens == a.tokens);
        len--; /* the copy is the new last block of the old length */
    }
    sync_new_blocks(t, i, len);
}

static void both_free(twin *t, int i) {
    REQUIRE(kva_kv_seq_free(t->ref, t->rseq[i]) == KVA_OK);
    REQUIRE(kva_kv_seq_free(t->kv, t->seq[i]) == KVA_OK);
    t->live[i] = 0;
}

/* Every live table of kv names, through the shadow, the blocks of ref's table. */
static void same_tables(twin *t) {
    for (int i = 0; i < t->nseq; i++) {
        if (!t->live[i]) continue;
        uint32_t a[NB], b[NB];
        uint32_t la = copy_table(t->ref, t->rseq[i], a, NB), lb = copy_table(t->kv, t->seq[i], b, NB);
        CHECK(la == lb);
        for (uint32_t j = 0; j < la && j < lb; j++) CHECK(t->shadow[b[j]] == a[j]);
    }
}

/* Requests with shared prefixes, forks with copies on write, every other one freed: used and
 * cached blocks scattered over the ids with free ones between them. */
static void fragment(twin *t) {
    uint64_t keys[8];
    for (int s = 0; s < NSEQ; s++) {
        uint32_t nkeys = request_keys(s, keys);
        both_alloc(t, nkeys * BT + (uint32_t)(s % 3), keys, nkeys, (uint32_t)(s % 3));
    }
    int f1 = both_fork(t, 3), f2 = both_fork(t, 7);
    both_append(t, f1, 1); /* seq 3 has a partial last block: copy on write */
    both_append(t, f2, 2 * BT);
    both_append(t, 5, 3 * BT);
    for (int s = 0; s < NSEQ; s += 2) both_free(t, s);
    /* Evict the blocks released first (the low ids): holes below, cached blocks above. */
    uint32_t e1 = 0, e2 = 0;
    CHECK_STATUS(kva_kv_evict(t->ref, 10, &e1), KVA_OK);
    CHECK_STATUS(kva_kv_evict(t->kv, 10, &e2), KVA_OK);
    CHECK(e1 == 10 && e2 == 10);
    /* A pin on a cached prefix. */
    uint64_t pin_keys[2] = {family_key(0, 0), family_key(0, 1)};
    uint32_t p1 = 0, p2 = 0;
    int i = t->nseq++;
    REQUIRE(kva_kv_pin(t->ref, pin_keys, 2, NULL, 0, 0, &t->rseq[i], &p1) == KVA_OK);
    REQUIRE(kva_kv_pin(t->kv, pin_keys, 2, NULL, 0, 0, &t->seq[i], &p2) == KVA_OK);
    CHECK(p1 == 2 * BT && p2 == p1);
    t->live[i] = 1;
}

static void twin_init(twin *t, kva_kv_layout layout) {
    memset(t, 0, sizeof *t);
    kva_kv_config cfg = small_config(NB, BT);
    cfg.layout = layout;
    t->ref = make_cache(&cfg);
    t->kv = make_cache(&cfg);
    for (uint32_t b = 0; b < NB; b++) t->shadow[b] = b;
}

static void test_compaction(kva_kv_layout layout) {
    twin t;
    twin_init(&t, layout);
    fragment(&t);
    same_tables(&t);
    kva_kv_stats before = stats(t.kv);
    uint32_t n = before.used_blocks + before.cached_blocks;
    CHECK(before.cached_blocks > 0 && before.used_blocks > 0 && before.free_blocks > 0);
    uint32_t high = 0; /* blocks holding data at ids >= n */
    for (uint32_t b = n; b < NB; b++) high += t.kv->blocks[b].state != KV_FREE;
    CHECK(high > 0);

    /* Sizing: NULL, then one too few; nothing changes. */
    uint32_t count = 12345;
    CHECK_STATUS(kva_kv_compact(t.kv, NULL, 0, &count), KVA_ERR_NOMEM);
    CHECK(count == high);
    kva_kv_move moves[NB];
    count = 0;
    CHECK_STATUS(kva_kv_compact(t.kv, moves, high - 1, &count), KVA_ERR_NOMEM);
    CHECK(count == high);
    CHECK_STATUS(kva_kv_compact(t.kv, NULL, NB, &count), KVA_ERR_NOMEM); /* NULL: capacity 0 */
    CHECK(count == high);
    same_tables(&t);
    kva_kv_stats sized = stats(t.kv);
    CHECK(sized.free_blocks == before.free_blocks && sized.used_blocks == before.used_blocks &&
          sized.cached_blocks == before.cached_blocks && sized.moves == 0 &&
          sized.rejected_calls == before.rejected_calls &&
          sized.alloc_failures == before.alloc_failures); /* the sizing answer is no failure */
    for (uint32_t b = 0; b < NB; b++) CHECK((t.kv->blocks[b].state == KV_FREE) == (t.ref->blocks[b].state == KV_FREE));
    CHECK_STATUS(kva_kv_check(t.kv), KVA_OK);

    /* Compact and apply the moves to the shadow, in the order given (any order works). */
    count = 0;
    CHECK_STATUS(kva_kv_compact(t.kv, moves, NB, &count), KVA_OK);
    CHECK(count == high);
    uint8_t is_src[NB] = {0}, is_dst[NB] = {0};
    for (uint32_t i = 0; i < count; i++) {
        CHECK(moves[i].src_block >= n && moves[i].src_block < NB && moves[i].dst_block < n);
        CHECK(!is_src[moves[i].src_block]++ && !is_dst[moves[i].dst_block]++);
        if (i) CHECK(moves[i].src_block > moves[i - 1].src_block && moves[i].dst_block > moves[i - 1].dst_block);
        t.shadow[moves[i].dst_block] = t.shadow[moves[i].src_block];
    }
    for (uint32_t b = 0; b < NB; b++) CHECK(!(is_src[b] && is_dst[b]));
    CHECK_STATUS(kva_kv_check(t.kv), KVA_OK);
    same_tables(&t);

    /* The free blocks are exactly the top ids: every chunk that can be freed is. */
    kva_kv_stats after = stats(t.kv);
    CHECK(after.free_blocks == before.free_blocks && after.used_blocks == before.used_blocks &&
          after.cached_blocks == before.cached_blocks && after.registered_blocks == before.registered_blocks);
    for (uint32_t b = 0; b < NB; b++) CHECK((t.kv->blocks[b].state == KV_FREE) == (b >= n));
    CHECK(after.moves == high && after.moved_bytes == (uint64_t)high * block_bytes(t.kv));
    kva_kv_info info;
    REQUIRE(kva_kv_get_info(t.kv, &info) == KVA_OK);
    void *first_free;
    REQUIRE(kva_kv_block_address(t.kv, n, 0, KVA_KV_K, &first_free) == KVA_OK);
    if (layout == KVA_KV_LAYOUT_BLOCKS)
        CHECK((unsigned char *)info.base + info.kv_bytes - (unsigned char *)first_free ==
              (ptrdiff_t)after.free_blocks * (ptrdiff_t)info.block_bytes);

    /* A second compaction has nothing to move. */
    CHECK_STATUS(kva_kv_compact(t.kv, NULL, 0, &count), KVA_OK);
    CHECK(count == 0);
    CHECK_STATUS(kva_kv_check(t.kv), KVA_OK);

    /* New blocks come from the low end of the free ids. */
    int fresh = both_alloc(&t, 2 * BT, NULL, 0, 0);
    uint32_t table[4];
    CHECK(copy_table(t.kv, t.seq[fresh], table, 4) == 2 && table[0] == n && table[1] == n + 1);

    /* Prefix hits: every family's prefix and every freed request's own blocks still hit, on the
     * same (moved) blocks. */
    uint64_t keys[8];
    for (int s = 0; s < NSEQ; s += 2) {
        uint32_t nkeys = request_keys(s, keys);
        int i = both_alloc(&t, nkeys * BT, keys, nkeys, 0);
        kva_kv_seq_info ri, ci;
        REQUIRE(kva_kv_seq_get_info(t.ref, t.rseq[i], &ri) == KVA_OK);
        REQUIRE(kva_kv_seq_get_info(t.kv, t.seq[i], &ci) == KVA_OK);
        CHECK(ri.cached_tokens == ci.cached_tokens && ci.cached_tokens > 0);
        uint32_t a[8], b[8];
        copy_table(t.ref, t.rseq[i], a, 8);
        copy_table(t.kv, t.seq[i], b, 8);
        for (uint32_t j = 0; j < nkeys; j++) CHECK(t.shadow[b[j]] == a[j]);
        both_free(&t, i);
    }
    same_tables(&t);

    /* Eviction order survived: evict the cached blocks one at a time in both, and after each
     * the same prefixes hit. */
    for (uint32_t round = 0; round < 6; round++) {
        uint32_t e1 = 0, e2 = 0;
        CHECK_STATUS(kva_kv_evict(t.ref, 3, &e1), KVA_OK);
        CHECK_STATUS(kva_kv_evict(t.kv, 3, &e2), KVA_OK);
        CHECK(e1 == e2);
        for (int s = 1; s < NSEQ; s += 2) {
            uint32_t nkeys = request_keys(s, keys);
            kva_kv_seq p1, p2;
            uint32_t c1 = 0, c2 = 0;
            REQUIRE(kva_kv_pin(t.ref, keys, nkeys, NULL, 0, 0, &p1, &c1) == KVA_OK);
            REQUIRE(kva_kv_pin(t.kv, keys, nkeys, NULL, 0, 0, &p2, &c2) == KVA_OK);
            CHECK(c1 == c2);
            REQUIRE(kva_kv_unpin(t.ref, p1) == KVA_OK);
            REQUIRE(kva_kv_unpin(t.kv, p2) == KVA_OK);
        }
        for (int s = 0; s < NSEQ; s += 2) {
            uint32_t nkeys = request_keys(s, keys);
            kva_kv_seq p1, p2;
            uint32_t c1 = 0, c2 = 0;
            REQUIRE(kva_kv_pin(t.ref, keys, nkeys, NULL, 0, 0, &p1, &c1) == KVA_OK);
            REQUIRE(kva_kv_pin(t.kv, keys, nkeys, NULL, 0, 0, &p2, &c2) == KVA_OK);
            CHECK(c1 == c2);
            REQUIRE(kva_kv_unpin(t.ref, p1) == KVA_OK);
            REQUIRE(kva_kv_unpin(t.kv, p2) == KVA_OK);
        }
    }
    CHECK_STATUS(kva_kv_check(t.kv), KVA_OK);

    /* Free everything, compact again: an empty cache, every block free, nothing to move. */
    for (int i = 0; i < t.nseq; i++) {
        if (!t.live[i]) continue;
        kva_kv_seq_info ci;
        REQUIRE(kva_kv_seq_get_info(t.kv, t.seq[i], &ci) == KVA_OK);
        if (ci.is_pin) {
            REQUIRE(kva_kv_unpin(t.ref, t.rseq[i]) == KVA_OK);
            REQUIRE(kva_kv_unpin(t.kv, t.seq[i]) == KVA_OK);
            t.live[i] = 0;
        } else {
            both_free(&t, i);
        }
    }
    CHECK_STATUS(kva_kv_evict(t.kv, UINT32_MAX, NULL), KVA_OK);
    CHECK_STATUS(kva_kv_compact(t.kv, moves, NB, &count), KVA_OK);
    CHECK(count == 0 && stats(t.kv).free_blocks == NB);
    CHECK_STATUS(kva_kv_check(t.kv), KVA_OK);
    kva_kv_destroy(t.ref);
    kva_kv_destroy(t.kv);
}

/* Random rounds: allocate, fork, append, free, compact; the twin must agree every time. */
static void test_random_rounds(void) {
    twin t;
    twin_init(&t, KVA_KV_LAYOUT_LAYERS);
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    uint64_t keys[6];
    for (int round = 0; round < 4000; round++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t r = (uint32_t)(rng >> 33);
        /* Reuse finished slots: keep the index space small. */
        int live = 0;
        for (int i = 0; i < t.nseq; i++) live += t.live[i];
        if (t.nseq >= NSEQ + 6) {
            int j = 0;
            for (int i = 0; i < t.nseq; i++)
                if (t.live[i]) {
                    t.rseq[j] = t.rseq[i];
                    t.seq[j] = t.seq[i];
                    t.live[j++] = 1;
                }
            t.nseq = j;
        }
        kva_kv_stats s = stats(t.kv);
        int room = t.nseq < NSEQ + 6 && s.free_blocks + s.cached_blocks >= 6;
        uint32_t op = r % 10;
        if (op < 4 && room) {
            uint32_t nkeys = 1 + r % 4;
            for (uint32_t j = 0; j < nkeys; j++)
                keys[j] = family_key((int)(r >> 8) % 3, (int)j) + (j >= 1 ? (r >> 4) % 5 : 0);
            both_alloc(&t, nkeys * BT + (r >> 12) % BT, keys, nkeys, (r >> 16) % 8);
        } else if ((op == 4 || op == 9) && live && room) {
            int i = (int)((r >> 8) % (uint32_t)t.nseq);
            if (t.live[i]) {
                kva_kv_seq_info ci;
                REQUIRE(kva_kv_seq_get_info(t.kv, t.seq[i], &ci) == KVA_OK);
                if (!ci.is_pin) {
                    if (op == 4) i = both_fork(&t, i);
                    both_append(&t, i, 1 + (r >> 12) % 6);
                }
            }
        } else if ((op == 5 || op == 6) && live) {
            int i = (int)((r >> 8) % (uint32_t)t.nseq);
            if (t.live[i]) both_free(&t, i);
        } else if (op == 7) {
            uint32_t e1 = 0, e2 = 0;
            CHECK_STATUS(kva_kv_evict(t.ref, 1 + (r >> 8) % 4, &e1), KVA_OK);
            CHECK_STATUS(kva_kv_evict(t.kv, 1 + (r >> 8) % 4, &e2), KVA_OK);
            CHECK(e1 == e2);
        } else {
            uint32_t count;
            kva_kv_move moves[NB];
            CHECK_STATUS(kva_kv_compact(t.kv, moves, NB, &count), KVA_OK);
            for (uint32_t i = 0; i < count; i++) t.shadow[moves[i].dst_block] = t.shadow[moves[i].src_block];
            REQUIRE(kva_kv_check(t.kv) == KVA_OK);
            s = stats(t.kv);
            for (uint32_t b = 0; b < NB; b++)
                CHECK((t.kv->blocks[b].state == KV_FREE) == (b >= s.used_blocks + s.cached_blocks));
        }
        same_tables(&t);
        if (round % 20 == 0) CHECK_STATUS(kva_kv_check(t.kv), KVA_OK);
    }
    CHECK_STATUS(kva_kv_check(t.kv), KVA_OK);
    kva_kv_destroy(t.ref);
    kva_kv_destroy(t.kv);
}

static void test_bad_input(void) {
    uint32_t count = 7;
    kva_kv_move moves[4];
    CHECK_STATUS(kva_kv_compact(NULL, moves, 4, &count), KVA_ERR_INVALID);
    kva_kv_config cfg = small_config(8, 4);
    kva_kv *kv = make_cache(&cfg);
    CHECK_STATUS(kva_kv_compact(kv, moves, 4, NULL), KVA_ERR_INVALID);
    CHECK(stats(kv).rejected_calls == 1);
    /* A fresh cache is compact already. */
    CHECK_STATUS(kva_kv_compact(kv, NULL, 0, &count), KVA_OK);
    CHECK(count == 0);
    kva_kv_destroy(kv);

    cfg = small_config(0, 4);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.capacity_bytes = 1 << 20;
    kv = make_cache(&cfg);
    kva_kv_seq seq = alloc_plain(kv, 10);
    count = 7;
    CHECK_STATUS(kva_kv_compact(kv, moves, 4, &count), KVA_ERR_INVALID);
    CHECK(count == 7);
    CHECK_STATUS(kva_kv_seq_free(kv, seq), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* Trim on host memory: after compaction the pages of the free tail of every layer's region are
 * discarded (mincore says they left memory), the blocks count as trimmed, and taking them again
 * works; kva_kv_trim refuses a contiguous cache. */
static int resident_pages(const unsigned char *start, size_t length) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const unsigned char *first = (const unsigned char *)((uintptr_t)start / page * page);
    size_t pages = (size_t)(start + length - first + page - 1) / page;
    unsigned char vec[4096];
    REQUIRE(pages <= sizeof vec && mincore((void *)first, pages * page, vec) == 0);
    int n = 0;
    for (size_t i = 0; i < pages; i++) n += vec[i] & 1;
    return n;
}

static void test_trim_on_host(void) {
    kva_kv_config cfg = small_config(4096, 16); /* 512 B per block and layer: 2 MiB per region */
    cfg.layout = KVA_KV_LAYOUT_LAYERS;
    kva_kv *kv = make_cache(&cfg);
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    enum {
        SEQS = 16,
        BLOCKS = 256
    };
    kva_kv_seq seqs[SEQS];
    for (int i = 0; i < SEQS; i++)
        CHECK_STATUS(kva_kv_seq_allocate(kv, BLOCKS * 16, NULL, 0, NULL, 0, 0, 0, &seqs[i], NULL), KVA_OK);
    memset(info.base, 7, info.kv_bytes); /* every page resident */
    for (int i = 0; i < SEQS; i += 2) CHECK_STATUS(kva_kv_seq_free(kv, seqs[i]), KVA_OK);
    static kva_kv_move moves[4096];
    uint32_t count, trimmed = 0;
    CHECK_STATUS(kva_kv_compact(kv, moves, 4096, &count), KVA_OK);
    CHECK_STATUS(kva_kv_trim(kv, &trimmed), KVA_OK);
    CHECK(trimmed == 2048 && stats(kv).trimmed_blocks == 2048);
    size_t half = (size_t)2048 * info.block_stride;
    for (uint32_t layer = 0; layer < info.layers; layer++) {
        unsigned char *region = (unsigned char *)info.base + layer * info.layer_stride;
        CHECK(resident_pages(region + half, half) == 0);                                    /* given back */
        CHECK(resident_pages(region, half) == (int)(half / (size_t)sysconf(_SC_PAGESIZE))); /* kept */
    }
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    for (int i = 0; i < SEQS; i += 2)
        CHECK_STATUS(kva_kv_seq_allocate(kv, BLOCKS * 16, NULL, 0, NULL, 0, 0, 0, &seqs[i], NULL), KVA_OK);
    CHECK(stats(kv).trimmed_blocks == 0 && stats(kv).free_blocks == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);

    kva_kv_config contig = small_config(64, 16);
    contig.mode = KVA_KV_CONTIGUOUS;
    kva_kv *c = make_cache(&contig);
    CHECK_STATUS(kva_kv_trim(c, NULL), KVA_ERR_INVALID);
    CHECK(strstr(kva_last_error(), "paged") != NULL);
    kva_kv_destroy(c);
    CHECK_STATUS(kva_kv_trim(NULL, NULL), KVA_ERR_INVALID);
}

int main(void) {
    test_compaction(KVA_KV_LAYOUT_BLOCKS);
    test_compaction(KVA_KV_LAYOUT_LAYERS);
    test_random_rounds();
    test_bad_input();
    test_trim_on_host();
    return check_failures ? 1 : 0;
}
