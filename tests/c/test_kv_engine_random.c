/*
 * test_kv_engine_random.c — a random stream of the engine calls against a model of their
 * semantics: admissions and extensions (single and batched) keyed by token ids, u64 keys or
 * engine keys, in two namespaces, whose decoding commits blocks; forks, frees, pins; the block
 * calls (take, commit, ref, unref, evict by block and by key, reset); lookups; eviction. The
 * model predicts every status, every hit and its blocks, every lookup, which cached block each
 * eviction takes (lowest priority, then least recently released), every registration (or
 * duplicate), every copy on write, and every event in order; the cache's block tables, counts
 * and kva_kv_check are compared after every operation.
 *
 * Content is drawn so that prefixes repeat: each block of a request holds one of four
 * "elements", a request's first blocks follow one of a few families, and an element decides the
 * block's tokens (element * 7 + position), its u64 key (the element) and, with the elements
 * before it, its engine key (engine_key: the path written out, so distinct paths never share
 * bytes). A model key is (kind, namespace, path). The library's 128-bit keys cannot be computed
 * here: each one's bytes are learned from its first stored event, and every later event naming
 * that key, as a key or a parent, must carry the same bytes.
 *
 * Usage: test_kv_engine_random [operations] [seed]
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kv_test.h"

#define NB 40u      /* blocks */
#define BT 4u       /* tokens per block */
#define MAXB 16u    /* blocks a sequence may hold */
#define MAXS 12u    /* sequences and pins */
#define KEY_LEN 16u /* engine keys */
#define NS2 ((uint64_t)1 << 33 | 1)
#define MAX_EVENTS 4096u

static uint64_t rng_state;
static uint32_t rnd(uint32_t n) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((rng_state >> 33) % n);
}

/* ---- the model ------------------------------------------------------------------------------- */

typedef struct mkey {
    uint8_t kind; /* kva_kv_key_kind of the content that named it */
    uint8_t depth;
    uint64_t ns;
    uint8_t path[MAXB];
} mkey;

typedef struct mblock {
    int registered;
    mkey key;
    uint8_t priority;
    uint64_t released_at; /* while cached: its place in the LRU order */
    uint32_t trefs;       /* table entries naming it */
    uint32_t loose;       /* references the engine holds */
} mblock;

typedef struct mseq {
    kva_kv_seq handle;
    int live, is_pin, keyed;
    uint8_t kind, priority;
    uint64_t ns;
    uint32_t tokens, len;
    uint8_t elem[MAXB + 1]; /* each block's element, the partial one included */
    uint32_t table[MAXB + 1];
} mseq;

typedef struct mevent {
    uint32_t kind, block, first_token;
    uint64_t ns;
    mkey key, parent;
    int has_parent;
} mevent;

static kva_kv *kv;
static mblock blocks[NB];
static mseq seqs[MAXS];
static uint64_t lru_clock, evictions, hit_tokens;
static mevent expected[MAX_EVENTS];
static uint32_t nexpected;

static int key_equal(const mkey *a, const mkey *b) {
    return a->kind == b->kind && a->depth == b->depth && a->ns == b->ns && memcmp(a->path, b->path, a->depth) == 0;
}

static mkey make_key(uint8_t kind, uint64_t ns, const uint8_t *elems, uint32_t depth) {
    mkey k = {.kind = kind, .depth = (uint8_t)depth, .ns = ns};
    memcpy(k.path, elems, depth);
    return k;
}

/* An engine's key for a path: its depth and elements, padded. */
static void engine_key(const uint8_t *elems, uint32_t depth, uint8_t *out) {
    memset(out, 0xee, KEY_LEN);
    out[0] = (uint8_t)depth;
    memcpy(out + 1, elems, depth);
}

static uint32_t refs(uint32_t b) { return blocks[b].trefs + blocks[b].loose; }
static int is_cached(uint32_t b) { return refs(b) == 0 && blocks[b].registered; }
static int is_free(uint32_t b) { return refs(b) == 0 && !blocks[b].registered; }

static uint32_t count(int (*pred)(uint32_t)) {
    uint32_t n = 0;
    for (uint32_t b = 0; b < NB; b++) n += pred(b);
    return n;
}

static uint32_t find(const mkey *k) {
    for (uint32_t b = 0; b < NB; b++)
        if (blocks[b].registered && key_equal(&blocks[b].key, k)) return b;
    return KVA_KV_NO_BLOCK;
}

static void expect(uint32_t kind, uint32_t block, uint64_t ns, const mkey *key, const mkey *parent, uint32_t first) {
    REQUIRE(nexpected < MAX_EVENTS);
    mevent *e = &expected[nexpected++];
    *e = (mevent){.kind = kind, .block = block, .ns = ns, .first_token = first, .has_parent = parent != NULL};
    if (key) e->key = *key;
    if (parent) e->parent = *parent;
}

static void forget(uint32_t b) {
    expect(KVA_KV_EVENT_REMOVED, b, blocks[b].key.ns, &blocks[b].key, NULL, 0);
    blocks[b].registered = 0;
    evictions++;
}

/* Evicts n cached blocks: lowest priority first, then least recently released. */
static void evict(uint32_t n) {
    for (uint32_t k = 0; k < n; k++) {
        uint32_t victim = KVA_KV_NO_BLOCK;
        for (uint32_t b = 0; b < NB; b++) {
            if (!is_cached(b)) continue;
            if (victim == KVA_KV_NO_BLOCK || blocks[b].priority < blocks[victim].priority ||
                (blocks[b].priority == blocks[victim].priority && blocks[b].released_at < blocks[victim].released_at))
                victim = b;
        }
        REQUIRE(victim != KVA_KV_NO_BLOCK);
        forget(victim);
    }
}

static void make_room(uint32_t need) {
    uint32_t free_now = count(is_free);
    if (need > free_now) evict(need - free_now);
}

/* A block handed out as new must be free in the model (after the evictions it predicted). */
static void take(uint32_t b, uint8_t priority) {
    CHECK(b < NB && is_free(b));
    blocks[b].priority = priority;
}

/* One reference dropped (already taken off trefs or loose): cached at the newest end if it was
 * the last and the block is registered. */
static void released(uint32_t b) {
    if (refs(b) == 0 && blocks[b].registered) blocks[b].released_at = ++lru_clock;
}

/* Registers b under k unless k is registered already; the stored event names its parent. */
static void commit(uint32_t b, const mkey *k, const mkey *parent, uint32_t first_token) {
    if (find(k) != KVA_KV_NO_BLOCK) return;
    blocks[b].registered = 1;
    blocks[b].key = *k;
    expect(KVA_KV_EVENT_STORED, b, k->ns, k, parent, first_token);
}

/* ---- content --------------------------------------------------------------------------------- */

/* A request's elements: a family's head, then its own. */
static void draw_elems(uint8_t *elems, uint32_t n) {
    uint32_t family = rnd(3), shared = rnd(n + 1);
    for (uint32_t i = 0; i < n; i++) elems[i] = (uint8_t)(i < shared ? (family + i * (family + 1)) % 4 : rnd(4));
}

static uint32_t token_at(const uint8_t *elems, uint32_t t) { return elems[t / BT] * 7u + t % BT; }

/* The content items of blocks (or tokens) [from, to) of a request with these elements. */
static void put_items(uint8_t kind, const uint8_t *elems, uint32_t from, uint32_t to, uint32_t *tokens, uint64_t *keys,
                      uint8_t *bytes) {
    for (uint32_t i = from; i < to; i++) {
        if (kind == KVA_KV_KEY_TOKENS) tokens[i - from] = token_at(elems, i);
        else if (kind == KVA_KV_KEY_U64) keys[i - from] = elems[i];
        else if (kind == KVA_KV_KEY_BYTES) engine_key(elems, i + 1, bytes + (size_t)(i - from) * KEY_LEN);
    }
}

static kva_kv_content content_of(uint8_t kind, const uint32_t *tokens, const uint64_t *keys, const uint8_t *bytes) {
    return (kva_kv_content){.kind = kind, .key_len = KEY_LEN, .tokens = tokens, .keys = keys, .key_bytes = bytes};
}

/* Flattened content of a batch. */
static uint32_t flat_tokens[MAXS * MAXB * BT];
static uint64_t flat_keys[MAXS * MAXB * BT];
static uint8_t flat_bytes[MAXS * MAXB * BT * KEY_LEN];

static void put_flat(uint8_t kind, const uint8_t *elems, uint32_t from, uint32_t to, uint64_t at) {
    put_items(kind, elems, from, to, flat_tokens + at, flat_keys + at, flat_bytes + at * KEY_LEN);
}

/* ---- reading the cache back ------------------------------------------------------------------ */

static void read_table(mseq *m, uint32_t *out, uint32_t *len) {
    const uint32_t *table;
    REQUIRE(kva_kv_seq_block_table(kv, m->handle, &table, len) == KVA_OK);
    REQUIRE(*len <= MAXB + 1);
    memcpy(out, table, *len * sizeof *out);
}

static mseq *free_slot(void) {
    for (uint32_t i = 0; i < MAXS; i++)
        if (!seqs[i].live) return &seqs[i];
    return NULL;
}

static mseq *pick_live(int pins) {
    uint32_t start = rnd(MAXS);
    for (uint32_t k = 0; k < MAXS; k++) {
        mseq *m = &seqs[(start + k) % MAXS];
        if (m->live && m->is_pin == pins) return m;
    }
    return NULL;
}

/* ---- operations ------------------------------------------------------------------------------ */

typedef struct request {
    uint32_t tokens, given; /* given: items */
    uint8_t kind, priority;
    uint64_t ns;
    uint8_t elems[MAXB + 1];
} request;

static void draw_request(request *r, uint8_t kind) {
    r->tokens = rnd(8 * BT + 1);
    uint32_t full = r->tokens / BT;
    draw_elems(r->elems, full + 1);
    r->kind = kind;
    r->ns = rnd(2) ? NS2 : 0;
    r->priority = (uint8_t)rnd(KVA_KV_PRIORITIES);
    int whole = rnd(3) != 0;
    if (kind == KVA_KV_KEY_NONE) r->given = 0;
    else if (kind == KVA_KV_KEY_TOKENS) r->given = whole ? r->tokens : rnd(r->tokens + 1);
    else r->given = whole ? full : rnd(full + 1);
}

/* The model's admission of r; 0 if it does not fit (nothing changes). seq_table is read back. */
static int model_admit(const request *r, mseq *m, kva_kv_seq handle, uint32_t cached) {
    uint32_t full = r->tokens / BT, len = (r->tokens + BT - 1) / BT;
    uint32_t given_blocks = r->kind == KVA_KV_KEY_TOKENS ? r->given / BT : r->given;
    uint32_t hits = 0, hit[MAXB], cached_hits = 0;
    while (hits < given_blocks) {
        mkey k = make_key(r->kind, r->ns, r->elems, hits + 1);
        if ((hit[hits] = find(&k)) == KVA_KV_NO_BLOCK) break;
        cached_hits += is_cached(hit[hits]);
        hits++;
    }
    if (len - hits > count(is_free) + count(is_cached) - cached_hits) return 0;
    CHECK(cached == hits * BT);
    for (uint32_t i = 0; i < hits; i++) {
        blocks[hit[i]].trefs++;
        if (r->priority > blocks[hit[i]].priority) blocks[hit[i]].priority = r->priority;
    }
    make_room(len - hits);
    *m =
        (mseq){.handle = handle, .live = 1, .kind = r->kind, .priority = r->priority, .ns = r->ns, .tokens = r->tokens};
    memcpy(m->elem, r->elems, sizeof m->elem);
    read_table(m, m->table, &m->len);
    CHECK(m->len == len);
    for (uint32_t i = 0; i < hits && i < m->len; i++) CHECK(m->table[i] == hit[i]);
    for (uint32_t i = hits; i < m->len; i++) {
        take(m->table[i], r->priority);
        blocks[m->table[i]].trefs = 1;
    }
    for (uint32_t i = hits; i < given_blocks; i++) {
        mkey k = make_key(r->kind, r->ns, r->elems, i + 1), parent = make_key(r->kind, r->ns, r->elems, i);
        commit(m->table[i], &k, i ? &parent : NULL, i * BT);
    }
    m->keyed = r->kind != KVA_KV_KEY_NONE && r->given == (r->kind == KVA_KV_KEY_TOKENS ? r->tokens : full);
    hit_tokens += hits * BT;
    return 1;
}

static void op_admit(void) {
    uint32_t n = 1 + rnd(3);
    uint8_t kind = (uint8_t)rnd(4);
    request rs[3];
    mseq *slots[3];
    uint32_t reserved = 0;
    for (; reserved < n; reserved++) {
        if (!(slots[reserved] = free_slot())) break;
        slots[reserved]->live = 2; /* reserved for this batch */
        draw_request(&rs[reserved], kind);
    }
    for (uint32_t i = 0; i < reserved; i++) slots[i]->live = 0;
    if (reserved < n) return;
    kva_kv_seq handles[3] = {0, 0, 0};
    uint32_t cached[3] = {0, 0, 0}, done = 0;
    if (n == 1 && rnd(2)) {
        static uint32_t tokens[MAXB * BT];
        static uint64_t keys[MAXB];
        static uint8_t bytes[MAXB * KEY_LEN];
        put_items(kind, rs[0].elems, 0, rs[0].given, tokens, keys, bytes);
        kva_kv_content c = content_of(kind, tokens, keys, bytes);
        kva_status st = kva_kv_seq_admit(kv, rs[0].tokens, rs[0].ns, rs[0].priority, &c, rs[0].given, &handles[0],
                                         &cached[0]);
        REQUIRE(st == KVA_OK || st == KVA_ERR_NOMEM);
        done = st == KVA_OK;
    } else {
        uint32_t num_tokens[3];
        uint64_t namespaces[3], offsets[4] = {0};
        uint8_t priorities[3];
        for (uint32_t i = 0; i < n; i++) {
            num_tokens[i] = rs[i].tokens;
            namespaces[i] = rs[i].ns;
            priorities[i] = rs[i].priority;
            put_flat(kind, rs[i].elems, 0, rs[i].given, offsets[i]);
            offsets[i + 1] = offsets[i] + rs[i].given;
        }
        kva_kv_content c = content_of(kind, flat_tokens, flat_keys, flat_bytes);
        REQUIRE(kva_kv_seq_admit_many(kv, n, num_tokens, namespaces, priorities, &c, offsets, handles, cached, &done) ==
                KVA_OK);
    }
    uint32_t admitted = 0;
    while (admitted < n && model_admit(&rs[admitted], slots[admitted], handles[admitted], cached[admitted])) admitted++;
    CHECK(admitted == done);
}

/* The model's extension of m by n tokens; content: whether the keys of its filled blocks (or
 * its tokens) were given. 0 if it does not fit. */
static int model_extend(mseq *m, uint32_t n, int content, uint32_t request_index, kva_kv_block_copy *copy) {
    uint32_t old = m->tokens, fill = old % BT, new_tokens = old + n, new_len = (new_tokens + BT - 1) / BT;
    int cow = n && fill && refs(m->table[m->len - 1]) > 1;
    uint32_t need = new_len - m->len + (uint32_t)cow;
    if (need > count(is_free) + count(is_cached)) return 0;
    make_room(need);
    uint32_t table[MAXB + 1], len;
    read_table(m, table, &len);
    CHECK(len == new_len);
    *copy = (kva_kv_block_copy){request_index, KVA_KV_NO_BLOCK, KVA_KV_NO_BLOCK, 0};
    if (cow) {
        uint32_t src = m->table[m->len - 1], dst = table[m->len - 1];
        take(dst, m->priority);
        blocks[dst].trefs = 1;
        blocks[src].trefs--;
        released(src);
        *copy = (kva_kv_block_copy){request_index, src, dst, fill};
        m->table[m->len - 1] = dst;
    }
    for (uint32_t i = 0; i < m->len; i++) CHECK(table[i] == m->table[i]);
    for (uint32_t i = m->len; i < new_len; i++) {
        take(table[i], m->priority);
        blocks[table[i]].trefs = 1;
        m->table[i] = table[i];
    }
    m->len = new_len;
    if (m->keyed && content) {
        for (uint32_t i = old / BT; i < new_tokens / BT; i++) {
            mkey k = make_key(m->kind, m->ns, m->elem, i + 1), parent = make_key(m->kind, m->ns, m->elem, i);
            commit(m->table[i], &k, i ? &parent : NULL, i * BT);
        }
    } else if (m->keyed && (m->kind == KVA_KV_KEY_TOKENS ? n != 0 : new_tokens / BT != old / BT)) {
        m->keyed = 0;
    }
    m->tokens = new_tokens;
    return 1;
}

static void op_extend(void) {
    uint32_t n = 1 + rnd(3), picked = 0;
    mseq *list[3];
    for (uint32_t k = 0; k < n; k++) {
        mseq *m = pick_live(0);
        if (!m) break;
        int dup = 0;
        for (uint32_t j = 0; j < picked; j++) dup |= list[j] == m;
        if (!dup) list[picked++] = m;
    }
    if (!picked) return;
    uint8_t kind = list[0]->kind;
    uint32_t add[3];
    int given[3];
    uint64_t offsets[4] = {0};
    kva_kv_seq handles[3];
    for (uint32_t i = 0; i < picked; i++) {
        mseq *m = list[i];
        add[i] = rnd(2 * BT + 1);
        if (m->tokens + add[i] > MAXB * BT) add[i] = 0;
        for (uint32_t b = m->tokens / BT + 1; b <= (m->tokens + add[i]) / BT && b <= MAXB; b++)
            m->elem[b] = (uint8_t)rnd(4);
        given[i] = m->keyed && m->kind == kind && kind != KVA_KV_KEY_NONE && rnd(5) != 0;
        uint32_t items = 0;
        if (given[i] && kind == KVA_KV_KEY_TOKENS) {
            items = add[i];
            put_flat(kind, m->elem, m->tokens, m->tokens + add[i], offsets[i]);
        } else if (given[i]) {
            items = (m->tokens + add[i]) / BT - m->tokens / BT;
            put_flat(kind, m->elem, m->tokens / BT, (m->tokens + add[i]) / BT, offsets[i]);
        }
        given[i] &= items != 0;
        offsets[i + 1] = offsets[i] + items;
        handles[i] = m->handle;
    }
    kva_kv_content c = content_of(kind, flat_tokens, flat_keys, flat_bytes);
    kva_kv_block_copy copies[3];
    uint32_t ncopies = 0, done = 0;
    if (picked == 1 && rnd(2)) {
        kva_kv_copy copy;
        kva_status st = kva_kv_seq_extend(kv, handles[0], add[0], &c, (uint32_t)offsets[1], &copy);
        REQUIRE(st == KVA_OK || st == KVA_ERR_NOMEM);
        done = st == KVA_OK;
        if (done && copy.tokens)
            copies[ncopies++] = (kva_kv_block_copy){0, copy.src_block, copy.dst_block, copy.tokens};
    } else {
        REQUIRE(kva_kv_seq_extend_many(kv, picked, handles, add, kind == KVA_KV_KEY_NONE ? NULL : &c,
                                       kind == KVA_KV_KEY_NONE ? NULL : offsets, copies, &ncopies, &done) == KVA_OK);
    }
    uint32_t extended = 0, copied = 0;
    for (; extended < picked; extended++) {
        kva_kv_block_copy copy;
        if (!model_extend(list[extended], add[extended], given[extended], extended, &copy)) break;
        if (copy.tokens) {
            CHECK(copied < ncopies && memcmp(&copies[copied], &copy, sizeof copy) == 0);
            copied++;
        }
    }
    CHECK(extended == done && copied == ncopies);
}

static void op_fork(void) {
    mseq *parent = pick_live(0), *child = free_slot();
    if (!parent || !child) return;
    kva_kv_seq handle;
    REQUIRE(kva_kv_seq_fork(kv, parent->handle, &handle) == KVA_OK);
    *child = *parent;
    child->handle = handle;
    for (uint32_t i = 0; i < child->len; i++) {
        blocks[child->table[i]].trefs++;
        if (parent->priority > blocks[child->table[i]].priority) blocks[child->table[i]].priority = parent->priority;
    }
}

static void model_release(mseq *m) {
    for (uint32_t i = m->len; i-- > 0;) {
        blocks[m->table[i]].trefs--;
        released(m->table[i]);
    }
    m->live = 0;
}

static void op_free(void) {
    uint32_t n = 1 + rnd(3), picked = 0;
    mseq *list[3];
    kva_kv_seq handles[3];
    for (uint32_t k = 0; k < n; k++) {
        mseq *m = pick_live(0);
        if (!m) break;
        int dup = 0;
        for (uint32_t j = 0; j < picked; j++) dup |= list[j] == m;
        if (!dup) list[picked] = m, handles[picked++] = m->handle;
    }
    if (!picked) return;
    if (picked == 1 && rnd(2)) REQUIRE(kva_kv_seq_free(kv, handles[0]) == KVA_OK);
    else REQUIRE(kva_kv_seq_free_many(kv, picked, handles) == KVA_OK);
    for (uint32_t i = 0; i < picked; i++) model_release(list[i]);
}

static void op_pin(void) {
    mseq *m = free_slot();
    if (!m) return;
    request r;
    draw_request(&r, (uint8_t)(1 + rnd(3)));
    static uint32_t tokens[MAXB * BT];
    static uint64_t keys[MAXB];
    static uint8_t bytes[MAXB * KEY_LEN];
    put_items(r.kind, r.elems, 0, r.given, tokens, keys, bytes);
    kva_kv_content c = content_of(r.kind, tokens, keys, bytes);
    kva_kv_seq handle;
    uint32_t pinned;
    REQUIRE(kva_kv_pin_content(kv, r.ns, &c, r.given, &handle, &pinned) == KVA_OK);
    uint32_t given_blocks = r.kind == KVA_KV_KEY_TOKENS ? r.given / BT : r.given, hits = 0;
    *m = (mseq){.handle = handle, .live = 1, .is_pin = 1, .ns = r.ns};
    read_table(m, m->table, &m->len);
    while (hits < given_blocks) {
        mkey k = make_key(r.kind, r.ns, r.elems, hits + 1);
        uint32_t b = find(&k);
        if (b == KVA_KV_NO_BLOCK) break;
        CHECK(hits < m->len && m->table[hits] == b);
        blocks[b].trefs++;
        hits++;
    }
    CHECK(pinned == hits * BT && m->len == hits);
    m->tokens = pinned;
}

static void op_unpin(void) {
    mseq *m = pick_live(1);
    if (!m) return;
    REQUIRE(kva_kv_unpin(kv, m->handle) == KVA_OK);
    model_release(m);
}

static void op_take(void) {
    uint32_t n = rnd(4), ids[4];
    uint8_t priority = (uint8_t)rnd(KVA_KV_PRIORITIES);
    kva_status st = kva_kv_block_take(kv, n, priority, ids);
    int fits = n <= count(is_free) + count(is_cached);
    CHECK_STATUS(st, fits ? KVA_OK : KVA_ERR_NOMEM);
    if (st != KVA_OK) return;
    make_room(n);
    for (uint32_t i = 0; i < n; i++) {
        take(ids[i], priority);
        blocks[ids[i]].loose = 1;
    }
}

/* Up to three blocks only the engine holds, unregistered, committed as a chain of engine keys. */
static void op_commit(void) {
    uint32_t run[3], n = 0, start = rnd(4), want = 1 + rnd(3);
    for (uint32_t b = rnd(NB), k = 0; k < NB && n < want; k++, b = (b + 1) % NB)
        if (blocks[b].loose && !blocks[b].trefs && !blocks[b].registered) run[n++] = b;
    if (!n) return;
    uint8_t elems[MAXB];
    draw_elems(elems, start + n);
    uint64_t ns = rnd(2) ? NS2 : 0;
    uint8_t keys[3 * KEY_LEN], parent[KEY_LEN];
    for (uint32_t j = 0; j < n; j++) engine_key(elems, start + j + 1, keys + j * KEY_LEN);
    engine_key(elems, start, parent);
    uint32_t registered[3];
    REQUIRE(kva_kv_block_commit(kv, ns, run, n, keys, KEY_LEN, start ? parent : NULL, start * BT, registered) ==
            KVA_OK);
    for (uint32_t j = 0; j < n; j++) {
        mkey k = make_key(KVA_KV_KEY_BYTES, ns, elems, start + j + 1),
             p = make_key(KVA_KV_KEY_BYTES, ns, elems, start + j);
        uint32_t holder = find(&k);
        CHECK(registered[j] == (holder == KVA_KV_NO_BLOCK ? run[j] : holder));
        commit(run[j], &k, start + j ? &p : NULL, (start + j) * BT);
    }
}

/* Drops references the engine holds, in a random order; now and then one it does not hold. */
static void op_unref(void) {
    uint32_t ids[4], n = 0, want = 1 + rnd(4), taken[NB];
    for (uint32_t b = 0; b < NB; b++) taken[b] = 0;
    for (uint32_t k = 0; k < 4 * NB && n < want; k++) {
        uint32_t b = rnd(NB);
        if (taken[b] < blocks[b].loose) ids[n++] = b, taken[b]++;
    }
    uint32_t bad = rnd(NB);
    if (rnd(8) == 0 && n < 4 && taken[bad] == 0 && blocks[bad].loose == 0) {
        /* an entry the engine does not hold, after good ones: refused, nothing changed */
        ids[n] = bad;
        uint64_t before = kv_state_hash(kv);
        CHECK_STATUS(kva_kv_block_unref(kv, ids, n + 1), blocks[bad].trefs ? KVA_ERR_INVALID : KVA_ERR_DOUBLE_FREE);
        CHECK(kv_state_hash(kv) == before);
        return;
    }
    if (!n) return;
    REQUIRE(kva_kv_block_unref(kv, ids, n) == KVA_OK);
    for (uint32_t i = 0; i < n; i++) {
        blocks[ids[i]].loose--;
        released(ids[i]);
    }
}

static void op_ref(void) {
    uint32_t b = rnd(NB);
    kva_status st = kva_kv_block_ref(kv, &b, 1);
    CHECK_STATUS(st, is_free(b) ? KVA_ERR_INVALID : KVA_OK);
    if (st == KVA_OK) blocks[b].loose++;
}

static void op_lookup(void) {
    uint32_t n = 1 + rnd(3), hits[3], ids[3 * MAXB * BT];
    uint8_t kind = (uint8_t)(1 + rnd(3));
    request rs[3];
    uint64_t namespaces[3], offsets[4] = {0};
    for (uint32_t i = 0; i < n; i++) {
        draw_request(&rs[i], kind);
        namespaces[i] = rs[i].ns;
        put_flat(kind, rs[i].elems, 0, rs[i].given, offsets[i]);
        offsets[i + 1] = offsets[i] + rs[i].given;
    }
    kva_kv_content c = content_of(kind, flat_tokens, flat_keys, flat_bytes);
    if (n == 1) REQUIRE(kva_kv_lookup(kv, namespaces[0], &c, rs[0].given, ids, &hits[0]) == KVA_OK);
    else REQUIRE(kva_kv_lookup_many(kv, n, namespaces, &c, offsets, hits, ids) == KVA_OK);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t given_blocks = kind == KVA_KV_KEY_TOKENS ? rs[i].given / BT : rs[i].given, h = 0;
        for (; h < given_blocks; h++) {
            mkey k = make_key(kind, rs[i].ns, rs[i].elems, h + 1);
            uint32_t b = find(&k);
            if (b == KVA_KV_NO_BLOCK) break;
            CHECK(h >= hits[i] || ids[offsets[i] + h] == b);
        }
        CHECK(hits[i] == h);
    }
}

static void op_evict(void) {
    uint32_t what = rnd(4), evicted = 0;
    if (what == 0) {
        uint32_t asked = rnd(4), cached = count(is_cached);
        REQUIRE(kva_kv_evict(kv, asked, &evicted) == KVA_OK);
        CHECK(evicted == (asked < cached ? asked : cached));
        evict(asked < cached ? asked : cached);
    } else if (what == 1) {
        uint32_t ids[3], n = 1 + rnd(3), expect_n = 0;
        for (uint32_t i = 0; i < n; i++) ids[i] = rnd(NB);
        REQUIRE(kva_kv_evict_blocks(kv, ids, n, &evicted) == KVA_OK);
        for (uint32_t i = 0; i < n; i++)
            if (blocks[ids[i]].registered) forget(ids[i]), expect_n++;
        CHECK(evicted == expect_n);
    } else if (what == 2) {
        uint8_t elems[MAXB], keys[KEY_LEN];
        uint32_t depth = 1 + rnd(4);
        uint64_t ns = rnd(2) ? NS2 : 0;
        draw_elems(elems, depth);
        engine_key(elems, depth, keys);
        REQUIRE(kva_kv_evict_keys(kv, ns, keys, KEY_LEN, 1, &evicted) == KVA_OK);
        mkey k = make_key(KVA_KV_KEY_BYTES, ns, elems, depth);
        uint32_t b = find(&k);
        CHECK(evicted == (b != KVA_KV_NO_BLOCK));
        if (b != KVA_KV_NO_BLOCK) forget(b);
    } else if (rnd(4) == 0) {
        REQUIRE(kva_kv_reset_prefix_cache(kv) == KVA_OK);
        for (uint32_t b = 0; b < NB; b++)
            if (blocks[b].registered) blocks[b].registered = 0, evictions++;
        expect(KVA_KV_EVENT_CLEARED, KVA_KV_NO_BLOCK, 0, NULL, NULL, 0);
    }
}

/* ---- checks ---------------------------------------------------------------------------------- */

/* The library's key bytes, learned from the first event that names each key. */
static struct learned {
    mkey key;
    uint8_t bytes[16];
} learned[4096];
static uint32_t nlearned;

static void check_key_bytes(const mkey *k, const uint8_t *bytes, uint32_t len, int library) {
    if (k->kind == KVA_KV_KEY_BYTES) {
        uint8_t want[KEY_LEN];
        engine_key(k->path, k->depth, want);
        CHECK(!library && len == KEY_LEN && memcmp(bytes, want, KEY_LEN) == 0);
        return;
    }
    CHECK(library && len == 16);
    for (uint32_t i = 0; i < nlearned; i++)
        if (key_equal(&learned[i].key, k)) {
            CHECK(memcmp(learned[i].bytes, bytes, 16) == 0);
            return;
        }
    for (uint32_t i = 0; i < nlearned; i++) CHECK(memcmp(learned[i].bytes, bytes, 16) != 0); /* distinct keys */
    if (nlearned == 4096) return; /* enough learned: later keys go unchecked */
    learned[nlearned].key = *k;
    memcpy(learned[nlearned++].bytes, bytes, 16);
}

static void check_events(void) {
    static kva_kv_event got[MAX_EVENTS];
    uint32_t taken = 0, n;
    do { /* drained in pieces of random sizes, until none is left */
        uint64_t dropped;
        REQUIRE(kva_kv_take_events(kv, got + taken, 1 + rnd(MAX_EVENTS - taken), &n, &dropped) == KVA_OK);
        CHECK(dropped == 0);
        taken += n;
    } while (n != 0 && taken < MAX_EVENTS);
    CHECK(taken == nexpected);
    for (uint32_t i = 0; i < taken && i < nexpected; i++) {
        const kva_kv_event *g = &got[i];
        const mevent *e = &expected[i];
        CHECK(g->kind == e->kind && g->block == e->block && g->namespace_id == e->ns);
        if (e->kind == KVA_KV_EVENT_CLEARED || g->kind != e->kind) continue;
        check_key_bytes(&e->key, g->key, g->key_len, g->library_key);
        if (e->kind == KVA_KV_EVENT_REMOVED) continue;
        CHECK(g->first_token == e->first_token && g->num_tokens == BT &&
              g->parent_len == (e->has_parent ? g->key_len : 0));
        if (e->has_parent) check_key_bytes(&e->parent, g->parent, g->parent_len, g->library_key);
    }
    nexpected = 0;
}

static void check_step(void) {
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_stats st = stats(kv);
    uint32_t used = 0, registered = 0;
    for (uint32_t b = 0; b < NB; b++) {
        used += refs(b) > 0;
        registered += blocks[b].registered;
        CHECK(kv->loose[b] == blocks[b].loose);
    }
    CHECK(st.used_blocks == used && st.cached_blocks == count(is_cached) && st.free_blocks == count(is_free));
    CHECK(st.registered_blocks == registered && st.evictions == evictions && st.hit_tokens == hit_tokens);
    for (uint32_t i = 0; i < MAXS; i++) {
        mseq *m = &seqs[i];
        if (!m->live) continue;
        uint32_t table[MAXB + 1], len;
        read_table(m, table, &len);
        CHECK(len == m->len && memcmp(table, m->table, len * sizeof *table) == 0);
    }
    check_events();
}

int main(int argc, char **argv) {
    long operations = argc > 1 ? atol(argv[1]) : 200000;
    rng_state = argc > 2 ? strtoull(argv[2], NULL, 0) : 2026;
    kva_kv_config cfg = small_config(NB, BT);
    cfg.max_key_bytes = KEY_LEN;
    cfg.event_capacity = MAX_EVENTS;
    kv = make_cache(&cfg);
    static void (*const ops[])(void) = {op_admit, op_admit, op_admit,  op_extend, op_extend, op_extend,
                                        op_fork,  op_free,  op_free,   op_free,   op_pin,    op_unpin,
                                        op_take,  op_take,  op_commit, op_commit, op_unref,  op_unref,
                                        op_unref, op_ref,   op_lookup, op_evict};
    for (long i = 0; i < operations && check_failures < 20; i++) {
        ops[rnd(sizeof ops / sizeof ops[0])]();
        check_step();
    }
    kva_kv_stats st = stats(kv);
    printf("%ld operations: %llu allocations, %llu hit tokens, %llu evictions, %llu copies on write, %llu failed for "
           "want of blocks; at the end %u registered, %u cached, %u used, %llu references held by the engine\n",
           operations, (unsigned long long)st.allocations, (unsigned long long)st.hit_tokens,
           (unsigned long long)st.evictions, (unsigned long long)st.cow_copies, (unsigned long long)st.alloc_failures,
           st.registered_blocks, st.cached_blocks, st.used_blocks, (unsigned long long)kv->loose_refs);
    CHECK(st.hit_tokens > 0 && st.evictions > 0 && st.cow_copies > 0);
    for (uint32_t i = 0; i < MAXS; i++)
        if (seqs[i].live)
            REQUIRE((seqs[i].is_pin ? kva_kv_unpin(kv, seqs[i].handle) : kva_kv_seq_free(kv, seqs[i].handle)) ==
                    KVA_OK);
    for (uint32_t b = 0; b < NB; b++)
        while (blocks[b].loose--) REQUIRE(kva_kv_block_unref(kv, &b, 1) == KVA_OK);
    st = stats(kv);
    CHECK(st.used_blocks == 0 && kv->loose_refs == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
    return CHECK_DONE();
}
