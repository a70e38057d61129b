/*
 * test_kv_random.c — random allocate (with shared prefixes, by keys or token ids, in three
 * namespaces), append, fork, free, pin, unpin and evict against one small cache, checking
 * end to end what an engine relies on: the KV memory each sequence sees is what was written
 * for it.
 *
 * The test plays the engine. Every block's first 8 bytes of (layer 0, K) hold a signature:
 * a new keyed block gets the identity of its prefix (namespace, mode, keys so far), any other
 * new block a fresh tag; an append into a partial last block rewrites its signature (the
 * tokens written there), after copying src to dst when the cache asks for a copy on write.
 * Each sequence remembers the signatures it expects. So a prefix hit on the wrong content, a
 * block reused while still referenced, or a shared block written without its copy shows up as
 * a wrong signature; kva_kv_check runs every few operations as well.
 *
 * Usage: test_kv_random [operations] [seed]
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kv_test.h"

#define MAX_SEQS 24
#define MAX_BLOCKS_PER_SEQ 40
#define BT 4u

typedef struct model_seq {
    kva_kv_seq handle;
    int live, is_pin;
    uint32_t tokens;
    uint32_t nblocks;
    uint64_t sig[MAX_BLOCKS_PER_SEQ];
} model_seq;

static uint64_t rng_state;
static uint32_t rnd(uint32_t n) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((rng_state >> 33) % n);
}

static uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ull + (h >> 29); }

static kva_kv *kv;
static model_seq seqs[MAX_SEQS];
static uint64_t next_tag = 1;

static uint64_t *sig_at(uint32_t block) {
    void *at;
    REQUIRE(kva_kv_block_address(kv, block, 0, KVA_KV_K, &at) == KVA_OK);
    return at;
}

static void verify(const model_seq *m) {
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, m->handle, &table, &len) == KVA_OK);
    CHECK(len == m->nblocks);
    for (uint32_t i = 0; i < len && i < m->nblocks; i++) {
        if (*sig_at(table[i]) != m->sig[i]) {
            fprintf(stderr, "sequence %#llx block %u (id %u): signature %#llx, expected %#llx\n",
                    (unsigned long long)m->handle, i, table[i], (unsigned long long)*sig_at(table[i]),
                    (unsigned long long)m->sig[i]);
            check_failures++;
            return;
        }
    }
}

/* A prompt: a family's shared head, then its own blocks. Keys and token ids say the same. */
static void make_prompt(uint32_t nfull, uint64_t *keys, uint32_t *tokens) {
    uint32_t family = rnd(4), shared = rnd(nfull + 1);
    for (uint32_t i = 0; i < nfull; i++) {
        keys[i] = i < shared ? family * 1000 + i : 1000000 + rnd(50);
        for (uint32_t j = 0; j < BT; j++) tokens[i * BT + j] = (uint32_t)keys[i] * 7 + j;
    }
}

static void op_allocate(model_seq *m, int pin) {
    uint32_t ntok = rnd(9 * BT), nfull = ntok / BT;
    uint64_t keys[16];
    uint32_t tokens[16 * BT];
    make_prompt(nfull, keys, tokens);
    uint32_t mode = rnd(3), ns = rnd(3); /* 0: keys, 1: token ids, 2: nothing */
    uint32_t nkeys = mode == 0 ? rnd(nfull + 1) : 0, nids = mode == 1 ? nfull * BT - rnd(2) * (nfull ? 1 : 0) : 0;
    uint32_t given = mode == 0 ? nkeys : nids / BT;
    kva_kv_seq handle;
    uint32_t cached = 0;
    kva_status st = pin ? kva_kv_pin(kv, mode == 0 ? keys : NULL, nkeys, mode == 1 ? tokens : NULL, nids, ns, &handle,
                                     &cached)
                        : kva_kv_seq_allocate(kv, ntok, mode == 0 ? keys : NULL, nkeys, mode == 1 ? tokens : NULL, nids,
                                              ns, rnd(KVA_KV_PRIORITIES), &handle, &cached);
    if (st == KVA_ERR_NOMEM) return;
    REQUIRE(st == KVA_OK);
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, handle, &table, &len) == KVA_OK);
    CHECK(cached % BT == 0 && cached / BT <= given);
    m->handle = handle;
    m->live = 1;
    m->is_pin = pin;
    m->tokens = pin ? cached : ntok;
    m->nblocks = len;
    uint64_t id = mix(mix(0x51ed, ns), mode);
    for (uint32_t i = 0; i < len; i++) {
        int keyed = i < given;
        if (keyed) id = mix(id, keys[i]);
        uint64_t expect = keyed ? id : mix(0xfeed, next_tag++);
        if (i < cached / BT) {
            CHECK(*sig_at(table[i]) == expect); /* a hit holds exactly this prefix's KV */
            m->sig[i] = *sig_at(table[i]);
        } else {
            *sig_at(table[i]) = expect; /* the engine computes the block */
            m->sig[i] = expect;
        }
    }
}

static void op_append(model_seq *m) {
    uint32_t n = rnd(2 * BT + 1);
    if (m->tokens + n > MAX_BLOCKS_PER_SEQ * BT) return;
    kva_kv_copy copy;
    uint32_t old_blocks = m->nblocks, fill = m->tokens % BT;
    kva_status st = kva_kv_seq_append(kv, m->handle, n, &copy);
    if (st == KVA_ERR_NOMEM) return;
    REQUIRE(st == KVA_OK);
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, m->handle, &table, &len) == KVA_OK);
    if (copy.tokens) {
        CHECK(fill != 0 && copy.tokens == fill && table[old_blocks - 1] == copy.dst_block);
        *sig_at(copy.dst_block) = *sig_at(copy.src_block);
    }
    if (n && fill) { /* tokens written into the partial last block */
        m->sig[old_blocks - 1] = mix(m->sig[old_blocks - 1], m->tokens);
        *sig_at(table[old_blocks - 1]) = m->sig[old_blocks - 1];
    }
    for (uint32_t i = old_blocks; i < len; i++) {
        m->sig[i] = mix(0xfeed, next_tag++);
        *sig_at(table[i]) = m->sig[i];
    }
    m->tokens += n;
    m->nblocks = len;
}

static void op_fork(model_seq *parent, model_seq *child) {
    kva_kv_seq handle;
    REQUIRE(kva_kv_seq_fork(kv, parent->handle, &handle) == KVA_OK);
    *child = *parent;
    child->handle = handle;
}

static void op_free(model_seq *m) {
    REQUIRE((m->is_pin ? kva_kv_unpin(kv, m->handle) : kva_kv_seq_free(kv, m->handle)) == KVA_OK);
    CHECK_STATUS(m->is_pin ? kva_kv_unpin(kv, m->handle) : kva_kv_seq_free(kv, m->handle), KVA_ERR_DOUBLE_FREE);
    m->live = 0;
}

int main(int argc, char **argv) {
    long operations = argc > 1 ? atol(argv[1]) : 100000;
    rng_state = argc > 2 ? strtoull(argv[2], NULL, 0) : 12345;
    kva_kv_config cfg = small_config(96, BT);
    kv = make_cache(&cfg);
    for (long op = 0; op < operations; op++) {
        model_seq *m = &seqs[rnd(MAX_SEQS)];
        uint32_t what = rnd(100);
        if (!m->live) {
            if (what < 85) op_allocate(m, what < 5);
            else if (what < 92) kva_kv_evict(kv, rnd(8), NULL);
        } else if (what < 45 && !m->is_pin) {
            op_append(m);
        } else if (what < 55 && !m->is_pin) {
            model_seq *child = &seqs[rnd(MAX_SEQS)];
            if (!child->live) op_fork(m, child);
        } else if (what < 85) {
            verify(m);
            op_free(m);
        } else {
            verify(m);
        }
        if (op % 64 == 0) {
            kva_kv_stats st = stats(kv);
            CHECK(st.free_blocks + st.used_blocks + st.cached_blocks == st.num_blocks);
            CHECK_STATUS(kva_kv_check(kv), KVA_OK);
        }
        if (check_failures > 20) break;
    }
    for (int i = 0; i < MAX_SEQS; i++)
        if (seqs[i].live) {
            verify(&seqs[i]);
            op_free(&seqs[i]);
        }
    kva_kv_stats st = stats(kv);
    CHECK(st.used_blocks == 0 && st.sequences == 0 && st.pins == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    printf("%ld operations: %llu allocations, %llu hit of %llu query tokens, %llu evictions, %llu forks, %llu "
           "copies on write\n",
           operations, (unsigned long long)st.allocations, (unsigned long long)st.hit_tokens,
           (unsigned long long)st.query_tokens, (unsigned long long)st.evictions, (unsigned long long)st.forks,
           (unsigned long long)st.cow_copies);
    CHECK(st.hit_tokens > 0 && st.evictions > 0 && st.cow_copies > 0 && st.forks > 0);
    kva_kv_destroy(kv);
    return CHECK_DONE();
}
