/*
 * test_kv_view.c — the figures a KV cache shows of itself beyond its block counts: pinned blocks
 * (distinct blocks held by live pins), re-admissions counted apart (KVA_KV_AGAIN), and each
 * namespace's share (kva_kv_namespaces). Fixed cases for each, then a random stream of every call
 * that moves them, against figures the test keeps itself from the handles it holds, with
 * kva_kv_check after each step.
 */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "kv_cache.h"
#include "kv_test.h"

#define ROWS (KVA_KV_NAMESPACE_SLOTS + 1)

static uint32_t namespaces(kva_kv *kv, kva_kv_namespace_share *rows) {
    uint32_t n = 0;
    REQUIRE(kva_kv_namespaces(kv, rows, ROWS, &n) == KVA_OK);
    REQUIRE(n <= ROWS);
    return n;
}

/* The row of namespace ns among rows[0 .. n), the other row for ns UINT64_MAX; NULL if none. */
static const kva_kv_namespace_share *row_of(const kva_kv_namespace_share *rows, uint32_t n, uint64_t ns) {
    for (uint32_t i = 0; i < n; i++)
        if (ns == UINT64_MAX ? rows[i].is_other : !rows[i].is_other && rows[i].namespace_id == ns) return &rows[i];
    return NULL;
}

static kva_kv_seq pin_keys(kva_kv *kv, const uint64_t *keys, uint32_t n, uint32_t ns) {
    kva_kv_seq pin = 0;
    REQUIRE(kva_kv_pin(kv, keys, n, NULL, 0, ns, &pin, NULL) == KVA_OK);
    return pin;
}

static void test_pinned_blocks(void) {
    kva_kv_config cfg = small_config(32, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {11, 12, 13, 14};
    kva_kv_seq a = alloc_keys(kv, 16, keys, 4, 0, 0, NULL);
    CHECK(stats(kv).pinned_blocks == 0);
    kva_kv_seq p1 = pin_keys(kv, keys, 3, 0); /* blocks of 11, 12, 13 */
    kva_kv_seq p2 = pin_keys(kv, keys, 2, 0); /* 11, 12 again: overlapping */
    CHECK(stats(kv).pinned_blocks == 3);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, a), KVA_OK); /* pinned blocks stay used, still pinned */
    kva_kv_stats st = stats(kv);
    CHECK(st.pinned_blocks == 3 && st.used_blocks == 3 && st.cached_blocks == 1);
    CHECK_STATUS(kva_kv_unpin(kv, p1), KVA_OK);
    CHECK(stats(kv).pinned_blocks == 2); /* 13 lost its only pin; 11 and 12 keep p2's */
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);

    /* Compaction renames the pinned blocks with their counts: fill low ids, free them, pin high
     * ones, compact. */
    kva_kv_seq filler = alloc_plain(kv, 4 * 20);
    uint64_t high[] = {91, 92};
    kva_kv_seq h = alloc_keys(kv, 8, high, 2, 7, 0, NULL);
    kva_kv_seq hp = pin_keys(kv, high, 2, 7);
    CHECK_STATUS(kva_kv_seq_free(kv, h), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, filler), KVA_OK);
    CHECK(stats(kv).pinned_blocks == 4);
    kva_kv_move moves[32];
    uint32_t count = 0;
    CHECK_STATUS(kva_kv_compact(kv, moves, 32, &count), KVA_OK);
    CHECK(count > 0);
    CHECK(stats(kv).pinned_blocks == 4);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, hp, &table, &len) == KVA_OK && len == 2);
    st = stats(kv);
    for (uint32_t i = 0; i < len; i++)
        CHECK(kv->pin_refs[table[i]] == 1 && table[i] < st.used_blocks + st.cached_blocks);
    CHECK_STATUS(kva_kv_unpin(kv, hp), KVA_OK);
    CHECK_STATUS(kva_kv_unpin(kv, p2), KVA_OK);
    st = stats(kv);
    CHECK(st.pinned_blocks == 0 && st.pins == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);

    /* A broken count is named by the check (K11). */
    kva_kv_seq p3 = pin_keys(kv, keys, 1, 0);
    kv->pin_refs[0] += 1;
    kv->pin_refs[31] += 1;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "K11") != NULL);
    kv->pin_refs[0] -= 1;
    kv->pin_refs[31] -= 1;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_kv_unpin(kv, p3), KVA_OK);
    kva_kv_destroy(kv);
}

static void test_readmissions(void) {
    kva_kv_config cfg = small_config(64, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {1, 2, 3, 4};
    kva_kv_content c = u64_content(keys);
    kva_kv_seq first = 0, again = 0;
    uint32_t cached = 0;
    CHECK_STATUS(kva_kv_seq_admit(kv, 16, 0, 3, &c, 4, &first, &cached), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, first), KVA_OK);
    /* Preempted and admitted again: its blocks are cached, and the hit is a re-admission's. */
    CHECK_STATUS(kva_kv_seq_admit(kv, 18, 0, 3 | KVA_KV_AGAIN, &c, 4, &again, &cached), KVA_OK);
    CHECK(cached == 16);
    kva_kv_stats st = stats(kv);
    CHECK(st.hit_tokens == 16 && st.query_tokens == 34);
    CHECK(st.readmit_hit_tokens == 16 && st.readmit_query_tokens == 18);
    kva_kv_seq_info info;
    REQUIRE(kva_kv_seq_get_info(kv, again, &info) == KVA_OK);
    CHECK(info.priority == 3); /* the flag is not part of the priority */
    CHECK(kv->blocks[kv->seqs[(uint32_t)again ^ kv->handle_key].table[4]].priority == 3);

    /* The older call takes the flag too. */
    kva_kv_seq old = 0;
    CHECK_STATUS(kva_kv_seq_allocate(kv, 8, keys, 2, NULL, 0, 0, KVA_KV_AGAIN, &old, &cached), KVA_OK);
    st = stats(kv);
    CHECK(st.readmit_hit_tokens == 24 && st.readmit_query_tokens == 26);

    /* admit_many: bit 7 of each request's priority. */
    uint32_t tokens[] = {8, 8, 4};
    uint8_t prios[] = {1, KVA_KV_AGAIN | 2, KVA_KV_AGAIN};
    kva_kv_seq seqs[3];
    uint32_t hits[3], done = 0;
    uint64_t offsets[] = {0, 2, 4, 4};
    uint64_t many_keys[] = {1, 2, 1, 9};
    kva_kv_content mc = u64_content(many_keys);
    CHECK_STATUS(kva_kv_seq_admit_many(kv, 3, tokens, NULL, prios, &mc, offsets, seqs, hits, &done), KVA_OK);
    CHECK(done == 3 && hits[0] == 8 && hits[1] == 4 && hits[2] == 0);
    st = stats(kv);
    CHECK(st.readmit_hit_tokens == 24 + 4 && st.readmit_query_tokens == 26 + 8 + 4);
    CHECK(st.hit_tokens == 16 + 8 + 8 + 4 && st.query_tokens == 34 + 8 + 20);

    /* Any other bit beyond the priority is refused, with nothing changed. */
    uint64_t before = kv_state_hash(kv);
    kva_kv_seq s = 0;
    uint32_t bad[] = {8, 0x40, 0x100, KVA_KV_AGAIN | 8, 0x80000000u, KVA_KV_AGAIN | 0x100};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CHECK_STATUS(kva_kv_seq_admit(kv, 4, 0, bad[i], NULL, 0, &s, NULL), KVA_ERR_INVALID);
        CHECK_STATUS(kva_kv_seq_allocate(kv, 4, NULL, 0, NULL, 0, 0, bad[i], &s, NULL), KVA_ERR_INVALID);
    }
    /* A batch's refusal names the request refused, and is counted once. */
    uint64_t rejected = stats(kv).rejected_calls;
    uint8_t bad_many[] = {0, 0x40};
    CHECK_STATUS(kva_kv_seq_admit_many(kv, 2, tokens, NULL, bad_many, NULL, NULL, seqs, NULL, &done), KVA_ERR_INVALID);
    CHECK(strstr(kva_last_error(), "request 1: priority 64 ") != NULL);
    uint8_t bad_many2[] = {KVA_KV_AGAIN | 9, 0};
    CHECK_STATUS(kva_kv_seq_admit_many(kv, 2, tokens, NULL, bad_many2, NULL, NULL, seqs, NULL, &done), KVA_ERR_INVALID);
    CHECK(strstr(kva_last_error(), "request 0: priority 137 ") != NULL);
    CHECK(stats(kv).rejected_calls == rejected + 2);
    CHECK(kv_state_hash(kv) == before);
    CHECK(stats(kv).readmit_query_tokens == 26 + 12);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);

    /* Contiguous mode counts the queried tokens of a re-admission (no hits there). */
    kva_kv_config cc = small_config(0, 4);
    cc.mode = KVA_KV_CONTIGUOUS;
    cc.max_context = 256;
    cc.capacity_bytes = 1 << 20;
    cc.num_blocks = 0;
    kv = make_cache(&cc);
    CHECK_STATUS(kva_kv_seq_admit(kv, 100, 0, KVA_KV_AGAIN | 1, NULL, 0, &s, NULL), KVA_OK);
    st = stats(kv);
    CHECK(st.readmit_query_tokens == 100 && st.query_tokens == 100 && st.readmit_hit_tokens == 0);
    kva_kv_namespace_share rows[ROWS];
    CHECK(namespaces(kv, rows) == 1 && rows[0].sequences == 1 && rows[0].blocks == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

static void test_namespace_rows(void) {
    kva_kv_config cfg = small_config(256, 4);
    kva_kv *kv = make_cache(&cfg);
    kva_kv_namespace_share rows[ROWS];
    uint32_t n = 0;
    CHECK(namespaces(kv, rows) == 0);
    /* Bad arguments. */
    CHECK_STATUS(kva_kv_namespaces(NULL, rows, ROWS, &n), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_namespaces(kv, rows, ROWS, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_namespaces(kv, NULL, 1, &n), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_namespaces(kv, NULL, 0, &n), KVA_OK);

    /* 40 namespaces, one sequence of two registered blocks each: the first 31 get the slots
     * after namespace 0's, the 32nd that one (empty, so free to take), the last 8 share the
     * other row. */
    kva_kv_seq seqs[40];
    for (uint32_t i = 0; i < 40; i++) {
        uint64_t keys[] = {1000 + i, 2000 + i};
        seqs[i] = alloc_keys(kv, 10, keys, 2, 100 + i, 0, NULL); /* 3 blocks, 2 registered */
    }
    CHECK(namespaces(kv, rows) == ROWS);
    for (uint32_t i = 0; i < 32; i++) {
        const kva_kv_namespace_share *r = row_of(rows, ROWS, 100 + i);
        CHECK(r && r->sequences == 1 && r->pins == 0 && r->blocks == 3 && r->registered_blocks == 2);
    }
    const kva_kv_namespace_share *other = row_of(rows, ROWS, UINT64_MAX);
    CHECK(other && other == &rows[ROWS - 1] && other->namespace_id == 0);
    CHECK(other && other->sequences == 8 && other->blocks == 24 && other->registered_blocks == 16);
    CHECK(row_of(rows, ROWS, 132) == NULL);
    /* Fewer rows than there are: the first ones, and the count of all. */
    CHECK_STATUS(kva_kv_namespaces(kv, rows, 2, &n), KVA_OK);
    CHECK(n == ROWS && rows[0].namespace_id == 131 && rows[1].namespace_id == 100); /* slot order */
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);

    /* A tracked namespace emptied: while the other row holds anything its slot is not reused,
     * so namespace 500 goes to the other row. */
    CHECK_STATUS(kva_kv_seq_free(kv, seqs[0]), KVA_OK);
    CHECK_STATUS(kva_kv_evict(kv, 256, NULL), KVA_OK); /* its registrations too */
    kva_kv_seq late = alloc_plain(kv, 4);              /* namespace 0, never tracked: the other row too */
    kva_kv_seq s500 = alloc_keys(kv, 4, NULL, 0, 500, 0, NULL);
    n = namespaces(kv, rows);
    CHECK(row_of(rows, n, 500) == NULL && row_of(rows, n, 100) == NULL);
    other = row_of(rows, n, UINT64_MAX);
    CHECK(other && other->sequences == 10);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    /* The other row emptied (sequences freed, registrations dropped): a new namespace takes the
     * emptied slot. */
    for (uint32_t i = 32; i < 40; i++) CHECK_STATUS(kva_kv_seq_free(kv, seqs[i]), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, s500), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, late), KVA_OK);
    CHECK_STATUS(kva_kv_evict(kv, 256, NULL), KVA_OK);
    n = namespaces(kv, rows);
    CHECK(row_of(rows, n, UINT64_MAX) == NULL);
    kva_kv_seq s600 = alloc_keys(kv, 4, NULL, 0, 600, 0, NULL);
    n = namespaces(kv, rows);
    CHECK(row_of(rows, n, 600) != NULL && row_of(rows, n, UINT64_MAX) == NULL);
    CHECK(kv->ns.rows[1].ns == 600); /* slot 1, namespace 100's, was the first all zero */
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);

    /* Forks and pins count in their namespace; a reset drops every registered count. */
    uint64_t k2[] = {7, 8};
    kva_kv_seq a = alloc_keys(kv, 8, k2, 2, 600, 0, NULL);
    kva_kv_seq child = 0;
    CHECK_STATUS(kva_kv_seq_fork(kv, a, &child), KVA_OK);
    kva_kv_seq p = pin_keys(kv, k2, 2, 600);
    n = namespaces(kv, rows);
    const kva_kv_namespace_share *r600 = row_of(rows, n, 600);
    CHECK(r600 && r600->sequences == 3 && r600->pins == 1 && r600->blocks == 1 + 2 + 2 + 2 &&
          r600->registered_blocks == 2);
    CHECK_STATUS(kva_kv_reset_prefix_cache(kv), KVA_OK);
    n = namespaces(kv, rows);
    for (uint32_t i = 0; i < n; i++) CHECK(rows[i].registered_blocks == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);

    /* A broken row is named by the check (K12). */
    kv->ns.rows[KV_NS_OTHER].blocks++;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "K12") != NULL);
    kv->ns.rows[KV_NS_OTHER].blocks--;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    CHECK_STATUS(kva_kv_unpin(kv, p), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, s600), KVA_OK);
    kva_kv_destroy(kv);
}

/* ---- the random stream ------------------------------------------------------------------- */

#define NB 160
#define BT 4
#define MAXH 96
#define NSPACES 44 /* more than the slots */

typedef struct held {
    kva_kv_seq handle;
    uint64_t ns;
    int pin;
} held;

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(uint32_t n) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

typedef struct expect {
    uint64_t ns;
    uint64_t sequences, pins, blocks, registered;
} expect;

/* The test's own figures per namespace, from the handles it holds and the registered blocks,
 * against the cache's rows: a tracked namespace's row equals its figures, the other row the sum
 * over the namespaces without one. */
static void compare(kva_kv *kv, const held *h, uint32_t nh) {
    expect e[NSPACES];
    memset(e, 0, sizeof e);
    for (uint32_t i = 0; i < NSPACES; i++) e[i].ns = i;
    uint32_t pinned[NB];
    memset(pinned, 0, sizeof pinned);
    for (uint32_t i = 0; i < nh; i++) {
        kva_kv_seq_info info;
        REQUIRE(kva_kv_seq_get_info(kv, h[i].handle, &info) == KVA_OK);
        expect *x = &e[h[i].ns];
        x->sequences += !h[i].pin;
        x->pins += h[i].pin;
        x->blocks += info.num_blocks;
        if (h[i].pin) {
            const uint32_t *t;
            uint32_t len;
            REQUIRE(kva_kv_seq_block_table(kv, h[i].handle, &t, &len) == KVA_OK);
            for (uint32_t j = 0; j < len; j++) pinned[t[j]] = 1;
        }
    }
    for (uint32_t b = 0; b < NB; b++)
        if (kv->blocks[b].registered) e[kv->blocks[b].ns].registered++;
    uint32_t distinct = 0;
    for (uint32_t b = 0; b < NB; b++) distinct += pinned[b];
    CHECK(stats(kv).pinned_blocks == distinct);

    kva_kv_namespace_share rows[ROWS];
    uint32_t n = namespaces(kv, rows);
    expect rest = {0};
    uint32_t tracked = 0;
    for (uint32_t i = 0; i < NSPACES; i++) {
        const kva_kv_namespace_share *r = row_of(rows, n, i);
        int any = (e[i].sequences | e[i].pins | e[i].blocks | e[i].registered) != 0;
        if (r) {
            tracked++;
            CHECK(r->sequences == e[i].sequences && r->pins == e[i].pins && r->blocks == e[i].blocks &&
                  r->registered_blocks == e[i].registered);
        } else if (any) {
            rest.sequences += e[i].sequences;
            rest.pins += e[i].pins;
            rest.blocks += e[i].blocks;
            rest.registered += e[i].registered;
        }
    }
    const kva_kv_namespace_share *o = row_of(rows, n, UINT64_MAX);
    if (rest.sequences | rest.pins | rest.blocks | rest.registered) {
        CHECK(o && o->sequences == rest.sequences && o->pins == rest.pins && o->blocks == rest.blocks &&
              o->registered_blocks == rest.registered);
        /* the other row holds only when every slot is given (some may be empty now, kept until
         * the other row empties) */
        CHECK(kv->ns.assigned == KVA_KV_NAMESPACE_SLOTS && tracked <= KVA_KV_NAMESPACE_SLOTS);
    } else {
        CHECK(o == NULL);
    }
    CHECK(n == tracked + (o != NULL)); /* no row of a namespace never seen */
}

static void test_random_stream(void) {
    kva_kv_config cfg = small_config(NB, BT);
    kva_kv *kv = make_cache(&cfg);
    held h[MAXH];
    uint32_t nh = 0;
    uint64_t again_hit = 0, again_query = 0;
    int saw_other = 0, saw_reuse = 0;
    for (int step = 0; step < 20000; step++) {
        uint32_t op = rnd(100);
        /* runs of a few namespaces that move on, and any of them at times */
        uint64_t ns = rnd(2) == 0 ? rnd(NSPACES) : rnd(6) + (uint64_t)(step / 5000) * 10;
        if (ns >= NSPACES) ns = NSPACES - 1;
        uint64_t keys[8];
        uint32_t nkeys = 1 + rnd(6);
        uint64_t family = rnd(5);
        for (uint32_t i = 0; i < nkeys; i++) keys[i] = family * 100 + i;
        if (op < 30 && nh < MAXH) { /* admit, maybe again */
            int again = rnd(3) == 0;
            uint32_t tokens = nkeys * BT + rnd(2 * BT);
            kva_kv_content c = u64_content(keys);
            kva_kv_seq s = 0;
            uint32_t cached = 0;
            kva_status st = kva_kv_seq_admit(kv, tokens, ns, rnd(8) | (again ? KVA_KV_AGAIN : 0), &c, nkeys, &s,
                                             &cached);
            if (st == KVA_OK) {
                h[nh++] = (held){s, ns, 0};
                if (again) {
                    again_hit += cached;
                    again_query += tokens;
                }
            } else {
                CHECK(st == KVA_ERR_NOMEM);
            }
        } else if (op < 40 && nh < MAXH - 4) { /* admit_many over several namespaces */
            uint32_t tokens[3], count = 1 + rnd(3);
            uint64_t nss[3], offsets[4] = {0};
            uint8_t prios[3];
            uint64_t mk[24];
            int again[3];
            for (uint32_t i = 0; i < count; i++) {
                tokens[i] = nkeys * BT;
                nss[i] = (ns + i * 7) % NSPACES;
                again[i] = rnd(2);
                prios[i] = (uint8_t)(rnd(8) | (again[i] ? KVA_KV_AGAIN : 0));
                for (uint32_t j = 0; j < nkeys; j++) mk[offsets[i] + j] = keys[j];
                offsets[i + 1] = offsets[i] + nkeys;
            }
            kva_kv_seq seqs[3];
            uint32_t cached[3], done = 0;
            kva_kv_content c = u64_content(mk);
            CHECK_STATUS(kva_kv_seq_admit_many(kv, count, tokens, nss, prios, &c, offsets, seqs, cached, &done),
                         KVA_OK);
            for (uint32_t i = 0; i < done; i++) {
                h[nh++] = (held){seqs[i], nss[i], 0};
                if (again[i]) {
                    again_hit += cached[i];
                    again_query += tokens[i];
                }
            }
        } else if (op < 48 && nh < MAXH) { /* pin */
            kva_kv_seq p = 0;
            CHECK_STATUS(kva_kv_pin(kv, keys, nkeys, NULL, 0, (uint32_t)ns, &p, NULL), KVA_OK);
            h[nh++] = (held){p, ns, 1};
        } else if (op < 55 && nh && nh < MAXH) { /* fork */
            held *x = &h[rnd(nh)];
            kva_kv_seq child = 0;
            kva_status st = x->pin ? KVA_ERR_INVALID : kva_kv_seq_fork(kv, x->handle, &child);
            if (st == KVA_OK) h[nh++] = (held){child, x->ns, 0};
        } else if (op < 70 && nh) { /* extend */
            held *x = &h[rnd(nh)];
            kva_kv_copy copy;
            if (!x->pin) {
                kva_status st = kva_kv_seq_append(kv, x->handle, 1 + rnd(3 * BT), &copy);
                CHECK(st == KVA_OK || st == KVA_ERR_NOMEM);
            }
        } else if (op < 92 && nh) { /* free or unpin */
            uint32_t i = rnd(nh);
            CHECK_STATUS(h[i].pin ? kva_kv_unpin(kv, h[i].handle) : kva_kv_seq_free(kv, h[i].handle), KVA_OK);
            h[i] = h[--nh];
        } else if (op < 96) { /* evict some */
            CHECK_STATUS(kva_kv_evict(kv, rnd(20), NULL), KVA_OK);
        } else if (op < 98) {
            kva_kv_move moves[NB];
            uint32_t count;
            CHECK_STATUS(kva_kv_compact(kv, moves, NB, &count), KVA_OK);
        } else if (op < 99) {
            CHECK_STATUS(kva_kv_reset_prefix_cache(kv), KVA_OK);
        } else if (rnd(3) == 0) { /* drop everything: the slots become reusable */
            for (uint32_t i = 0; i < nh; i++)
                CHECK_STATUS(h[i].pin ? kva_kv_unpin(kv, h[i].handle) : kva_kv_seq_free(kv, h[i].handle), KVA_OK);
            nh = 0;
            CHECK_STATUS(kva_kv_reset_prefix_cache(kv), KVA_OK);
            saw_reuse += kv->ns.assigned == KVA_KV_NAMESPACE_SLOTS;
        }
        saw_other += (kv->ns.rows[KV_NS_OTHER].live[0] | kv->ns.rows[KV_NS_OTHER].registered) != 0;
        kva_status st = kva_kv_check(kv);
        CHECK_STATUS(st, KVA_OK);
        if (st != KVA_OK) break;
        compare(kv, h, nh);
        kva_kv_stats s = stats(kv);
        CHECK(s.readmit_hit_tokens == again_hit && s.readmit_query_tokens == again_query);
        if (check_failures) break;
    }
    printf("random stream: %d steps with the other row in use, %d full reuses\n", saw_other, saw_reuse);
    CHECK(saw_other > 100); /* steps with the other row in use */
    CHECK(saw_reuse > 3);   /* every slot given, then all emptied */
    for (uint32_t i = 0; i < nh; i++)
        CHECK_STATUS(h[i].pin ? kva_kv_unpin(kv, h[i].handle) : kva_kv_seq_free(kv, h[i].handle), KVA_OK);
    kva_kv_destroy(kv);
}

/* Past the 32 tracked namespaces, a registration, its drop and an admission cost what they cost
 * in a tracked one: finding a namespace's row (or that it has none) walks no slots, however the
 * namespaces of consecutive calls change. */
static void test_untracked_namespaces_walk_no_slots(void) {
    kva_kv_config cfg = small_config(128, 4);
    kva_kv *kv = make_cache(&cfg);
    kva_kv_seq tenant[40];
    for (uint32_t t = 0; t < 40; t++) tenant[t] = alloc_keys(kv, 4, NULL, 0, 100 + t, 0, NULL);
    kva_kv_namespace_share rows[ROWS];
    CHECK(namespaces(kv, rows) == ROWS); /* every slot taken, the other row counting 8 */
    uint64_t scans = kv->ns.scans;
    for (uint32_t i = 0; i < 2000; i++) {
        /* 4 new keys a round, cached at the free and evicted rounds later, in two untracked
         * namespaces and a tracked one in turn. */
        uint64_t keys[4];
        for (uint32_t j = 0; j < 4; j++) keys[j] = ((uint64_t)1 << 40) + i * 4 + j;
        uint32_t ns = i % 3 == 2 ? 100 + i % 32 : 138 + i % 2;
        kva_kv_seq s = alloc_keys(kv, 16, keys, 4, ns, 0, NULL);
        CHECK_STATUS(kva_kv_seq_free(kv, s), KVA_OK);
    }
    CHECK(kv->ns.scans - scans <= 2);
    if (kv->ns.scans - scans > 2) fprintf(stderr, "%llu slot walks\n", (unsigned long long)(kv->ns.scans - scans));
    CHECK(stats(kv).evictions > 1000);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    /* K12 sees an index that lost a slot, or names one where a probe does not find it. */
    uint32_t at = 0;
    while (kv->ns.index[at] == KV_NS_HOLE) at++;
    uint8_t held = kv->ns.index[at];
    kv->ns.index[at] = KV_NS_HOLE;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    kv->ns.index[at] = held;
    uint32_t hole = 0;
    while (kv->ns.index[hole] != KV_NS_HOLE) hole++;
    kv->ns.index[hole] = held;
    kv->ns.index[at] = KV_NS_HOLE;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    kv->ns.index[at] = held;
    kv->ns.index[hole] = KV_NS_HOLE;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    for (uint32_t t = 0; t < 40; t++) CHECK_STATUS(kva_kv_seq_free(kv, tenant[t]), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* Namespaces whose index probes start at two neighbouring entries (wrapping around the end):
 * one run of up to 32 entries, taken apart and put together again as slots change hands, a
 * sequence admitted and freed in a random one of 64 of them at each step, kva_kv_check (K12,
 * the index among it) after each. */
static void test_colliding_namespaces(void) {
    uint64_t ns[64];
    uint32_t found = 0;
    for (uint64_t c = 1; found < 64; c++)
        if (kv_ns_home(c) == KV_NS_INDEX - 1 || kv_ns_home(c) == 0) ns[found++] = c;
    kva_kv_config cfg = small_config(512, 4);
    kva_kv *kv = make_cache(&cfg);
    kva_kv_seq live[64] = {0};
    uint64_t rng = 12345;
    uint32_t reuses = 0, others = 0, count = 0;
    uint64_t held_ns[KVA_KV_NAMESPACE_SLOTS] = {0};
    for (uint32_t step = 0; step < 4000; step++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        /* Up to 40 live ones, then down to none, and again: the other row fills and empties. */
        uint32_t i = (uint32_t)(rng >> 33) % 64, want_free = step / 100 % 2 ? count > 0 : count >= 40;
        while ((live[i] != 0) != want_free) i = (i + 1) % 64;
        if (live[i]) {
            CHECK_STATUS(kva_kv_seq_free(kv, live[i]), KVA_OK);
            live[i] = 0;
            count--;
            CHECK_STATUS(kva_kv_evict(kv, 512, NULL), KVA_OK); /* its registration goes too */
        } else {
            uint64_t keys[] = {ns[i] * 7 + step};
            kva_kv_seq s = 0;
            kva_kv_content content = {.kind = KVA_KV_KEY_U64, .keys = keys};
            CHECK_STATUS(kva_kv_seq_admit(kv, 4, ns[i], 0, &content, 1, &s, NULL), KVA_OK);
            live[i] = s;
            count++;
        }
        CHECK_STATUS(kva_kv_check(kv), KVA_OK);
        for (uint32_t slot = 0; slot < KVA_KV_NAMESPACE_SLOTS; slot++) {
            reuses += kv->ns.rows[slot].ns != held_ns[slot];
            held_ns[slot] = kv->ns.rows[slot].ns;
        }
        others += !(kv->ns.rows[KV_NS_OTHER].live[0] == 0 && kv->ns.rows[KV_NS_OTHER].registered == 0);
    }
    printf("colliding namespaces: %u slots given to another namespace, %u steps with the other row in use\n", reuses,
           others);
    CHECK(others > 100 && reuses > 100);
    for (uint32_t i = 0; i < 64; i++)
        if (live[i]) CHECK_STATUS(kva_kv_seq_free(kv, live[i]), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

int main(void) {
    test_pinned_blocks();
    test_readmissions();
    test_namespace_rows();
    test_random_stream();
    test_untracked_namespaces_walk_no_slots();
    test_colliding_namespaces();
    if (check_failures) fprintf(stderr, "%d checks failed\n", check_failures);
    return check_failures ? 1 : 0;
}
