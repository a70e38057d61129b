/*
 * fuzz_kv.c — libFuzzer harness for the KV-cache manager: input bytes become allocations with
 * prefix keys drawn from a small alphabet (so prefixes are shared), appends, forks, frees, pins,
 * evictions, compactions, trims and stale-handle calls on a small paged cache.
 *
 * The oracle acts as the engine would. Every token a sequence holds is stamped, in every layer
 * and both parts, with a tag that says what it is: a keyed (prefix-cached) block's tokens get a
 * tag derived from the prefix of keys alone, so any block the cache hands out as a hit must
 * already hold exactly those tags; every other token gets a tag unique to the sequence that
 * wrote it and its position. The harness performs each copy on write and each compaction move
 * the cache asks for, poisons what the cache says is free, and then reads every live block
 * table back through the memory: a table entry that names the wrong block, a copy the cache
 * forgot to ask for, a move it did not report, or a block two sequences wrongly share shows up
 * as a tag that is not where the model expects it. On top of that: kva_kv_check after every
 * operation, the statuses, the block counts, failed calls leaving out-parameters untouched.
 *
 * The prefix cache has a model of its own (model_block): which block ids hold which prefix of
 * keys, which of them no table names (cached, evictable), their priorities and the order in
 * which they were released. Evictions are followed exactly although the library names no
 * victim: kva_kv_evict and the stats count them, and the header fixes the order (lowest
 * priority first, then least recently released; a call evicts only what it needs beyond the
 * free and trimmed blocks). So every allocation's and pin's cached_tokens, hit block ids and
 * status (NOMEM exactly when free, trimmed and evictable blocks fall short) are predicted, as
 * are the stats' cached, registered, evictions and hit_tokens; a victim the model did not
 * expect shows up as a block still registered in the model being handed out as new.
 *
 * The memory model reads no input bytes of its own, so the seed corpus decodes to the same
 * operations with it as without.
 */
#include <stdint.h>
#include <string.h>

#include "fuzz_input.h"
#include "kvalloc.h"

#define MAX_SEQS 64
#define BLOCK_TOKENS 4
#define LAYERS 2                            /* two, so that per-layer addressing and regions matter */
#define MAX_BLOCKS 64                       /* num_blocks is 32 .. 63 */
#define MAX_TOKENS (MAX_BLOCKS * BLOCK_TOKENS) /* no sequence can hold more blocks than the cache */
#define POISON 0xa5
#define MAX_KEYS 16                         /* a prompt keys at most 40 / BLOCK_TOKENS blocks */

/* What the model knows of one live sequence or pin. */
typedef struct model_seq {
    kva_kv_seq handle;
    int is_pin;
    uint32_t tokens;
    uint32_t keyed_blocks;    /* its first blocks given prefix keys: they may be registered */
    uint64_t id;              /* names the tokens this sequence writes itself */
    uint64_t tag[MAX_TOKENS]; /* what token t holds (before the per-layer, per-part salt) */
} model_seq;

/* What the model knows of one block id in the prefix cache. A registered block holds the
 * prefix keys path[0 .. depth) of namespace ns; while no live table names it, it is cached
 * (evictable), else used. An unregistered block is free, or used without a key. */
typedef struct model_block {
    uint8_t registered;
    uint8_t ns, depth;
    uint8_t priority;         /* the highest of the sequences that referenced it since taken */
    uint8_t path[MAX_KEYS];   /* the caller keys of its prefix, first block first */
    uint64_t released_at;     /* while cached: when its last reference went (its LRU place) */
} model_block;

typedef struct harness {
    kva_kv *kv;
    kva_kv_info info;
    uint8_t *part[MAX_BLOCKS][LAYERS][2]; /* kva_kv_block_address of every block, layer, part */
    uint64_t next_id;
    model_seq live[MAX_SEQS];
    size_t nlive;
    kva_kv_seq dead[MAX_SEQS];
    size_t ndead;
    model_block block[MAX_BLOCKS];
    uint64_t clock;           /* counts releases of registered blocks: the LRU order */
    uint64_t evictions;       /* what kva_kv_stats.evictions must say */
    uint64_t hit_tokens;      /* what kva_kv_stats.hit_tokens must say */
} harness;

/* Static: the model is 130 KiB, and only its used part is written per input. */
static harness H;

/* The oracle's own loops over tags and memory are not what the fuzzer should steer by: left
 * uninstrumented, they cost no coverage callbacks and put no random 64-bit tags into the
 * fuzzer's comparison tables. */
#define UNGUIDED __attribute__((no_sanitize("coverage")))

/* ---- tags ----------------------------------------------------------------------------------- */

UNGUIDED static uint64_t mix64(uint64_t x) {
    x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27, x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The identity of the prefix keys[0 .. i] in namespace ns: equal prefixes, equal content. */
UNGUIDED static uint64_t prefix_hash(uint32_t ns, const uint64_t *keys, uint32_t i) {
    uint64_t h = mix64(0x5eed0000ull + ns);
    for (uint32_t j = 0; j <= i; j++) h = mix64(h ^ mix64(keys[j] + 1));
    return h;
}

/* A token of a keyed block: its content follows from the prefix alone, whoever wrote it. */
UNGUIDED static uint64_t keyed_tag(uint32_t ns, const uint64_t *keys, uint32_t t) {
    return mix64(prefix_hash(ns, keys, t / BLOCK_TOKENS) + t % BLOCK_TOKENS);
}

/* A token that only its writer has: unique to (sequence id, position). */
UNGUIDED static uint64_t private_tag(uint64_t id, uint32_t t) { return mix64(id << 16 | t) | 1; }

/* Each layer and part holds a differently salted tag, so a copy that skips a layer or part, or
 * addresses that overlap, are seen. */
UNGUIDED static uint64_t salted(uint64_t tag, unsigned layer, unsigned part) {
    return tag ^ mix64(0x1000 + layer * 2 + part);
}

/* ---- memory, as the engine touches it -------------------------------------------------------- */

/* The geometry: kva_kv_block_address of everything, checked against the documented formula. */
UNGUIDED static void map_blocks(harness *h) {
    const kva_kv_info *g = &h->info;
    ORACLE(g->num_blocks <= MAX_BLOCKS && g->layers == LAYERS && g->block_tokens == BLOCK_TOKENS);
    ORACLE(g->slot_bytes >= sizeof(uint64_t) && g->part_bytes == g->slot_bytes * BLOCK_TOKENS);
    for (uint32_t b = 0; b < g->num_blocks; b++)
        for (unsigned l = 0; l < LAYERS; l++)
            for (unsigned p = 0; p < 2; p++) {
                void *at;
                ORACLE(kva_kv_block_address(h->kv, b, l, (kva_kv_part)p, &at) == KVA_OK);
                ORACLE((uint8_t *)at == (uint8_t *)g->base + b * g->block_stride + l * g->layer_stride +
                                            p * g->part_bytes);
                h->part[b][l][p] = at;
            }
    void *at;
    ORACLE(kva_kv_block_address(h->kv, g->num_blocks, 0, KVA_KV_K, &at) == KVA_ERR_INVALID);
}

UNGUIDED static void write_token(harness *h, uint32_t block, uint32_t slot, uint64_t tag) {
    for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned p = 0; p < 2; p++) {
            uint64_t v = salted(tag, l, p);
            memcpy(h->part[block][l][p] + slot * h->info.slot_bytes, &v, sizeof v);
        }
}

UNGUIDED static int token_holds(const harness *h, uint32_t block, uint32_t slot, uint64_t tag) {
    for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned p = 0; p < 2; p++) {
            uint64_t v;
            memcpy(&v, h->part[block][l][p] + slot * h->info.slot_bytes, sizeof v);
            if (v != salted(tag, l, p)) return 0;
        }
    return 1;
}

/* Copy on write as kva_kv_copy says: the first `tokens` tokens of every layer's K and V. */
UNGUIDED static void copy_tokens(harness *h, uint32_t src, uint32_t dst, uint32_t tokens) {
    for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned p = 0; p < 2; p++) memcpy(h->part[dst][l][p], h->part[src][l][p], tokens * h->info.slot_bytes);
}

/* A compaction move as kva_kv_move says: all layers, K and V. */
static void copy_block(harness *h, uint32_t src, uint32_t dst) { copy_tokens(h, src, dst, BLOCK_TOKENS); }

/* A block the cache calls free holds nothing: overwrite it so that a table still naming it is
 * caught by the next content check. */
UNGUIDED static void poison_block(harness *h, uint32_t block) {
    for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned p = 0; p < 2; p++) memset(h->part[block][l][p], POISON, h->info.part_bytes);
}

/* ---- reading the cache back ------------------------------------------------------------------ */

static uint32_t blocks_for(uint32_t tokens) { return (tokens + BLOCK_TOKENS - 1) / BLOCK_TOKENS; }

/* Tokens of the sequence in its block at position pos. */
static uint32_t block_fill(const model_seq *m, uint32_t pos) {
    uint32_t rest = m->tokens - pos * BLOCK_TOKENS;
    return rest < BLOCK_TOKENS ? rest : BLOCK_TOKENS;
}

/* The live table of a modelled sequence: it must be there, its length must follow from the
 * token count, and every id must name a block of the cache. */
UNGUIDED static const uint32_t *read_table(const harness *h, const model_seq *m) {
    const uint32_t *table;
    uint32_t len;
    ORACLE(kva_kv_seq_block_table(h->kv, m->handle, &table, &len) == KVA_OK);
    ORACLE(len == blocks_for(m->tokens));
    for (uint32_t i = 0; i < len; i++) ORACLE(table[i] < h->info.num_blocks);
    return table;
}

UNGUIDED static int table_equal(const uint32_t *a, const uint32_t *b, uint32_t len) {
    return len == 0 || memcmp(a, b, len * sizeof *a) == 0;
}

/* Every live table, read once per check. */
UNGUIDED static void read_tables(const harness *h, const uint32_t **tables) {
    for (size_t i = 0; i < h->nlive; i++) tables[i] = read_table(h, &h->live[i]);
}

/* How many live table entries name each block: its reference count, as the cache must have it. */
UNGUIDED static void count_refs(const harness *h, const uint32_t *const *tables, uint8_t *refs) {
    memset(refs, 0, MAX_BLOCKS);
    for (size_t i = 0; i < h->nlive; i++)
        for (uint32_t pos = 0; pos < blocks_for(h->live[i].tokens); pos++) refs[tables[i][pos]]++;
}

/* Every token of the sequence holds what the model says, through its current table. */
UNGUIDED static void check_contents(const harness *h, const model_seq *m, const uint32_t *table) {
    for (uint32_t t = 0; t < m->tokens; t++)
        ORACLE(token_holds(h, table[t / BLOCK_TOKENS], t % BLOCK_TOKENS, m->tag[t]));
}

/* Sharing is legal only as prefix caching and fork make it: a block named by two table entries
 * is at the same position in both and holds the same number of tokens for both (a partly
 * filled shared block is copied before anyone writes to it). Two sequences' private blocks
 * that collide break this (their tags differ, and one of them breaks check_contents). Also: the
 * blocks named are exactly the used ones, and none is trimmed. */
UNGUIDED static void check_sharing(const harness *h, const uint32_t *const *tables) {
    uint8_t owner[MAX_BLOCKS], position[MAX_BLOCKS], fill[MAX_BLOCKS];
    memset(owner, 0xff, sizeof owner);
    uint32_t named = 0;
    for (size_t i = 0; i < h->nlive; i++) {
        const model_seq *m = &h->live[i];
        for (uint32_t pos = 0; pos < blocks_for(m->tokens); pos++) {
            uint32_t b = tables[i][pos];
            if (owner[b] == 0xff) {
                owner[b] = (uint8_t)i, position[b] = (uint8_t)pos, fill[b] = (uint8_t)block_fill(m, pos);
                named++;
                continue;
            }
            ORACLE(owner[b] != i && position[b] == pos && fill[b] == block_fill(m, pos));
        }
    }
    kva_kv_stats st;
    ORACLE(kva_kv_get_stats(h->kv, &st) == KVA_OK);
    ORACLE(named == st.used_blocks);
    for (uint32_t b = st.num_blocks - st.trimmed_blocks; b < st.num_blocks; b++) ORACLE(owner[b] == 0xff);
}

UNGUIDED static void check_all(const harness *h, const uint32_t *const *tables) {
    for (size_t i = 0; i < h->nlive; i++) check_contents(h, &h->live[i], tables[i]);
    check_sharing(h, tables);
}

/* ---- the model ------------------------------------------------------------------------------- */

static model_seq *model_add(harness *h, kva_kv_seq handle, int is_pin, uint32_t tokens, uint32_t keyed_blocks) {
    model_seq *m = &h->live[h->nlive++];
    m->handle = handle;
    m->is_pin = is_pin;
    m->tokens = tokens;
    m->keyed_blocks = keyed_blocks;
    m->id = ++h->next_id;
    return m;
}

/* Tags of a new sequence: keyed blocks' tokens from their prefix, the rest its own. */
UNGUIDED static void model_tag_prompt(model_seq *m, uint32_t ns, const uint64_t *keys, uint32_t nkeys) {
    ORACLE(m->tokens <= MAX_TOKENS);
    for (uint32_t t = 0; t < m->tokens; t++)
        m->tag[t] = t / BLOCK_TOKENS < nkeys ? keyed_tag(ns, keys, t) : private_tag(m->id, t);
}

/* A freed sequence's blocks at positions no key was given for are never registered, so once
 * no live table names them they are free: poison them. Keyed ones may stay cached, with their
 * content, for later hits. */
UNGUIDED static void poison_released(harness *h, const model_seq *gone, const uint32_t *table, const uint8_t *refs) {
    for (uint32_t pos = gone->keyed_blocks; pos < blocks_for(gone->tokens); pos++)
        if (refs[table[pos]] == 1) poison_block(h, table[pos]);
}

static void model_remove(harness *h, size_t i) {
    if (h->ndead < MAX_SEQS) h->dead[h->ndead++] = h->live[i].handle;
    h->live[i] = h->live[--h->nlive];
}

/* ---- the prefix cache's model ---------------------------------------------------------------- */

/* The block the model holds under the prefix keys[0 .. depth) of namespace ns, or none. */
UNGUIDED static uint32_t model_lookup(const harness *h, uint32_t ns, const uint64_t *keys, uint32_t depth) {
    for (uint32_t b = 0; b < h->info.num_blocks; b++) {
        const model_block *mb = &h->block[b];
        if (!mb->registered || mb->ns != ns || mb->depth != depth) continue;
        uint32_t j = 0;
        while (j < depth && mb->path[j] == keys[j]) j++;
        if (j == depth) return b;
    }
    return KVA_KV_NO_BLOCK;
}

/* The header's hit: the longest prefix of the given blocks held under their keys, used or
 * cached, stopping at the first miss; hit[0 .. n) are its blocks. Nothing caps it: a prompt
 * whose every block is given and held is a hit of all its tokens. */
UNGUIDED static uint32_t model_hits(const harness *h, uint32_t ns, const uint64_t *keys, uint32_t nkeys, uint32_t *hit) {
    uint32_t n = 0;
    while (n < nkeys && (hit[n] = model_lookup(h, ns, keys, n + 1)) != KVA_KV_NO_BLOCK) n++;
    return n;
}

UNGUIDED static int model_cached(const harness *h, uint32_t b, const uint8_t *refs) {
    return h->block[b].registered && refs[b] == 0;
}

UNGUIDED static uint32_t model_count(const harness *h, const uint8_t *refs, int cached_only) {
    uint32_t n = 0;
    for (uint32_t b = 0; b < h->info.num_blocks; b++)
        n += cached_only ? model_cached(h, b, refs) : h->block[b].registered;
    return n;
}

/* Evicts `count` cached blocks (the caller knows there are that many) in the header's order:
 * lowest priority first, within it least recently released first. refs says which blocks
 * are referenced, hence not evictable. */
UNGUIDED static void model_evict(harness *h, const uint8_t *refs, uint32_t count) {
    for (uint32_t k = 0; k < count; k++) {
        uint32_t victim = KVA_KV_NO_BLOCK;
        for (uint32_t b = 0; b < h->info.num_blocks; b++) {
            if (!model_cached(h, b, refs)) continue;
            const model_block *mb = &h->block[b], *v = &h->block[victim == KVA_KV_NO_BLOCK ? b : victim];
            if (victim == KVA_KV_NO_BLOCK || mb->priority < v->priority ||
                (mb->priority == v->priority && mb->released_at < v->released_at))
                victim = b;
        }
        ORACLE(victim != KVA_KV_NO_BLOCK);
        h->block[victim].registered = 0;
        h->evictions++;
    }
}

/* A call that takes new blocks evicts only what it needs beyond the free blocks and the
 * trimmed ones (whose memory comes back first): `spare` is their sum before the call. */
UNGUIDED static void model_make_room(harness *h, const uint8_t *refs, uint32_t need, uint32_t spare) {
    model_evict(h, refs, need > spare ? need - spare : 0);
}

/* A block the cache hands out as new was free or has just been evicted: the model must not
 * hold it as registered. A victim other than the model's is caught here, when it is taken. */
UNGUIDED static void model_take(const harness *h, uint32_t b) { ORACLE(!h->block[b].registered); }

/* Registers block b for the prefix keys[0 .. depth), given at allocation after the hits.
 * That key cannot be held already: the lookup missed at a prefix of it, and the held prefixes
 * are closed under taking prefixes (every table naming a block names its prefix's block too,
 * and a block's prefix is released after it and has no lower priority, so it is evicted
 * after it). So the rule of kv_cache.h for a taken key (the new block stays unregistered),
 * which the header leaves unsaid, never applies here. */
UNGUIDED static void model_register(harness *h, uint32_t b, uint32_t ns, const uint64_t *keys, uint32_t depth,
                                    uint32_t priority) {
    ORACLE(depth <= MAX_KEYS && model_lookup(h, ns, keys, depth) == KVA_KV_NO_BLOCK);
    model_block *mb = &h->block[b];
    *mb = (model_block){.registered = 1, .ns = (uint8_t)ns, .depth = (uint8_t)depth, .priority = (uint8_t)priority};
    for (uint32_t j = 0; j < depth; j++) mb->path[j] = (uint8_t)keys[j];
}

/* A release as kva_kv_seq_free documents it: last block first, and a registered block left
 * without references joins the newest end of its priority's LRU list. refs (the counts before
 * the release) is updated. */
UNGUIDED static void model_release(harness *h, const uint32_t *table, uint32_t len, uint8_t *refs) {
    for (uint32_t pos = len; pos-- > 0;) {
        uint32_t b = table[pos];
        if (--refs[b] == 0 && h->block[b].registered) h->block[b].released_at = ++h->clock;
    }
}

/* The model against the cache's figures: blocks registered and cached, evictions, hits. */
UNGUIDED static void check_prefix_model(const harness *h, const uint32_t *const *tables) {
    uint8_t refs[MAX_BLOCKS];
    count_refs(h, tables, refs);
    kva_kv_stats st;
    ORACLE(kva_kv_get_stats(h->kv, &st) == KVA_OK);
    ORACLE(st.registered_blocks == model_count(h, refs, 0) && st.cached_blocks == model_count(h, refs, 1));
    ORACLE(st.evictions == h->evictions && st.hit_tokens == h->hit_tokens);
}

/* ---- operations ------------------------------------------------------------------------------ */

/* A prompt whose full blocks are keyed from a 4-letter alphabet (prefixes repeat): a sequence
 * (allocate) or a pin of the cached prefix. The model predicts the status, the hit (its
 * length and its blocks) and the evictions; the hits must already hold their prefix's tags;
 * the rest is stamped as the engine's prefill would. */
static void op_prompt(harness *h, input *in, int pin) {
    uint32_t tokens = next_byte(in) % 40 + 1, full = tokens / BLOCK_TOKENS, nkeys = next_byte(in) % (full + 1);
    uint64_t keys[MAX_KEYS];
    for (uint32_t i = 0; i < nkeys && i < MAX_KEYS; i++) keys[i] = next_byte(in) % 4;
    if (nkeys > MAX_KEYS) nkeys = MAX_KEYS;
    /* Read in this order explicitly (argument order is unspecified; clang reads left to right).
     * A pin has namespace 0 and no priority: it leaves its blocks' priorities as they are. */
    uint32_t ns = pin ? 0 : next_byte(in) % 2, priority = pin ? 0 : next_byte(in) % KVA_KV_PRIORITIES;

    const uint32_t *tables[MAX_SEQS];
    uint8_t refs[MAX_BLOCKS];
    read_tables(h, tables);
    count_refs(h, tables, refs);
    uint32_t hit[MAX_KEYS], hits = model_hits(h, ns, keys, nkeys, hit), cached_hits = 0;
    for (uint32_t i = 0; i < hits; i++) cached_hits += refs[hit[i]] == 0;
    kva_kv_stats before;
    kva_kv_get_stats(h->kv, &before);
    /* A pin takes no block; a sequence's new blocks come from the free, trimmed and cached
     * blocks, its own hits excepted (it references them before anything is evicted). The
     * header's other NOMEM, host memory for the table, does not happen at this size. */
    uint32_t need = pin ? 0 : blocks_for(tokens) - hits, spare = before.free_blocks + before.trimmed_blocks;
    int room = need <= spare + model_count(h, refs, 1) - cached_hits;

    const kva_kv_seq untouched = 0x5151515151515151ull;
    kva_kv_seq seq = untouched;
    uint32_t cached = UINT32_MAX;
    kva_status st = pin ? kva_kv_pin(h->kv, nkeys ? keys : NULL, nkeys, NULL, 0, ns, &seq, &cached)
                        : kva_kv_seq_allocate(h->kv, tokens, nkeys ? keys : NULL, nkeys, NULL, 0, ns, priority, &seq,
                                              &cached);
    ORACLE(st == (room ? KVA_OK : KVA_ERR_NOMEM));
    if (st != KVA_OK) {
        ORACLE(seq == untouched && cached == UINT32_MAX); /* a failed call leaves its out-parameters */
        return;
    }
    ORACLE(cached == hits * BLOCK_TOKENS);
    model_seq *m = model_add(h, seq, pin, pin ? cached : tokens, pin ? hits : nkeys);
    model_tag_prompt(m, ns, keys, nkeys);
    const uint32_t *table = read_table(h, m);
    for (uint32_t i = 0; i < hits; i++) {
        ORACLE(table[i] == hit[i]);
        refs[hit[i]]++;
        if (priority > h->block[hit[i]].priority) h->block[hit[i]].priority = (uint8_t)priority;
    }
    if (!pin) {
        model_make_room(h, refs, need, spare);
        for (uint32_t pos = hits; pos < blocks_for(tokens); pos++) model_take(h, table[pos]);
        for (uint32_t i = hits; i < nkeys; i++) model_register(h, table[i], ns, keys, i + 1, priority);
        h->hit_tokens += cached; /* pins are not counted */
    }
    for (uint32_t t = 0; t < m->tokens; t++) {
        uint32_t b = table[t / BLOCK_TOKENS], slot = t % BLOCK_TOKENS;
        if (t < cached) ORACLE(token_holds(h, b, slot, m->tag[t])); /* a hit holds its prefix */
        else write_token(h, b, slot, m->tag[t]);
    }
}

/* Decoding: the engine applies the copy on write kva_kv_seq_append reports, then writes the new
 * tokens. The copy must be reported exactly when the last block was shared and partly filled. */
static void op_append(harness *h, input *in) {
    size_t i = next_byte(in) % h->nlive;
    uint32_t add = next_byte(in) % 9 + 1;
    model_seq *m = &h->live[i];
    uint32_t old_tokens = m->tokens, old_len = blocks_for(old_tokens), fill = old_tokens % BLOCK_TOKENS;
    const uint32_t *tables[MAX_SEQS];
    uint8_t refs[MAX_BLOCKS];
    read_tables(h, tables);
    count_refs(h, tables, refs);
    uint32_t before[MAX_BLOCKS];
    memcpy(before, tables[i], old_len * sizeof *before);
    int expect_cow = !m->is_pin && fill != 0 && refs[before[old_len - 1]] > 1;
    kva_kv_stats stats;
    kva_kv_get_stats(h->kv, &stats);
    uint32_t need = blocks_for(old_tokens + add) - old_len + (uint32_t)expect_cow;
    uint32_t spare = stats.free_blocks + stats.trimmed_blocks;
    int room = need <= spare + model_count(h, refs, 1);

    kva_kv_copy copy;
    memset(&copy, 0x5a, sizeof copy);
    const kva_kv_copy untouched = copy;
    kva_status st = kva_kv_seq_append(h->kv, m->handle, add, &copy);
    ORACLE(st == (m->is_pin ? KVA_ERR_INVALID : room ? KVA_OK : KVA_ERR_NOMEM));
    if (st != KVA_OK) { /* nothing changed */
        ORACLE(memcmp(&copy, &untouched, sizeof copy) == 0);
        ORACLE(table_equal(read_table(h, m), before, old_len));
        return;
    }
    ORACLE(old_tokens + add <= MAX_TOKENS);
    m->tokens = old_tokens + add;
    const uint32_t *table = read_table(h, m);
    model_make_room(h, refs, need, spare);
    for (uint32_t pos = old_len - (uint32_t)expect_cow; pos < blocks_for(m->tokens); pos++) model_take(h, table[pos]);
    ORACLE(old_len == 0 || table_equal(table, before, old_len - 1));
    if (expect_cow) {
        ORACLE(copy.src_block == before[old_len - 1] && copy.dst_block == table[old_len - 1]);
        ORACLE(copy.dst_block != copy.src_block && copy.tokens == fill);
        copy_tokens(h, copy.src_block, copy.dst_block, copy.tokens);
    } else {
        ORACLE(copy.tokens == 0 && copy.src_block == KVA_KV_NO_BLOCK && copy.dst_block == KVA_KV_NO_BLOCK);
        ORACLE(old_len == 0 || table[old_len - 1] == before[old_len - 1]);
    }
    for (uint32_t t = old_tokens; t < m->tokens; t++) {
        m->tag[t] = private_tag(m->id, t);
        write_token(h, table[t / BLOCK_TOKENS], t % BLOCK_TOKENS, m->tag[t]);
    }
}

/* A fork shares the parent's table entry for entry; it writes under its own id from now on. */
static void op_fork(harness *h, input *in) {
    size_t i = next_byte(in) % h->nlive;
    kva_kv_seq child;
    kva_status st = kva_kv_seq_fork(h->kv, h->live[i].handle, &child);
    ORACLE(h->live[i].is_pin ? st == KVA_ERR_INVALID : st == KVA_OK);
    if (st != KVA_OK) return;
    model_seq *c = &h->live[h->nlive];
    *c = h->live[i];
    h->nlive++;
    c->handle = child;
    c->id = ++h->next_id;
    ORACLE(table_equal(read_table(h, c), read_table(h, &h->live[i]), blocks_for(c->tokens)));
}

static void op_release(harness *h, input *in) {
    size_t i = next_byte(in) % h->nlive;
    model_seq *m = &h->live[i];
    const uint32_t *tables[MAX_SEQS];
    uint8_t refs[MAX_BLOCKS];
    read_tables(h, tables);
    count_refs(h, tables, refs);
    uint32_t table[MAX_BLOCKS];
    memcpy(table, tables[i], blocks_for(m->tokens) * sizeof *table);
    ORACLE((m->is_pin ? kva_kv_unpin(h->kv, m->handle) : kva_kv_seq_free(h->kv, m->handle)) == KVA_OK);
    poison_released(h, m, table, refs);
    model_release(h, table, blocks_for(m->tokens), refs);
    model_remove(h, i);
}

/* A stale handle: refused by every call, nothing changes. */
static void op_stale(harness *h, input *in) {
    kva_kv_stats before, after;
    kva_kv_get_stats(h->kv, &before);
    kva_kv_copy copy;
    kva_kv_seq stale = h->dead[next_byte(in) % h->ndead], child;
    const uint32_t *table;
    uint32_t len;
    ORACLE(kva_kv_seq_free(h->kv, stale) != KVA_OK);
    ORACLE(kva_kv_seq_append(h->kv, stale, 1, &copy) != KVA_OK);
    ORACLE(kva_kv_seq_block_table(h->kv, stale, &table, &len) != KVA_OK);
    ORACLE(kva_kv_seq_fork(h->kv, stale, &child) != KVA_OK);
    kva_kv_get_stats(h->kv, &after);
    ORACLE(after.used_blocks == before.used_blocks && after.free_blocks == before.free_blocks);
}

/* The moves of a compaction into n data blocks: each from an id >= n to a hole < n that no
 * table named (it was free), sources and destinations each ascending (lowest to lowest), so
 * no id is both. */
UNGUIDED static void check_moves(const harness *h, const kva_kv_move *moves, uint32_t count, uint32_t n,
                        const uint8_t *named_before) {
    for (uint32_t k = 0; k < count; k++) {
        const kva_kv_move *mv = &moves[k];
        ORACLE(mv->dst_block < mv->src_block && mv->dst_block < n && mv->src_block >= n);
        ORACLE(mv->src_block < h->info.num_blocks && !named_before[mv->dst_block]);
        ORACLE(k == 0 || (mv->src_block > moves[k - 1].src_block && mv->dst_block > moves[k - 1].dst_block));
    }
}

/* Each table after compaction is the one before with every moved id renamed, in the same
 * array, and names only blocks below n. */
UNGUIDED static void check_renamed(const harness *h, const uint32_t (*before)[MAX_BLOCKS], const uint32_t *const *array,
                          const kva_kv_move *moves, uint32_t count, uint32_t n) {
    uint32_t renamed[MAX_BLOCKS];
    for (uint32_t b = 0; b < MAX_BLOCKS; b++) renamed[b] = b < n ? b : KVA_KV_NO_BLOCK;
    for (uint32_t k = 0; k < count; k++) renamed[moves[k].src_block] = moves[k].dst_block;
    for (size_t i = 0; i < h->nlive; i++) {
        const uint32_t *table = read_table(h, &h->live[i]);
        ORACLE(table == array[i]); /* rewritten in place */
        for (uint32_t pos = 0; pos < blocks_for(h->live[i].tokens); pos++)
            ORACLE(table[pos] == renamed[before[i][pos]]);
    }
}

/* Compaction as the engine runs it: ask the size, compact, copy every move, then trim. The
 * sources are free at once (poisoned here), so a table the cache did not rewrite, or a move it
 * did not report, is caught by the content check after the op (the other free blocks were free
 * before, so nothing may name them: check_sharing sees to that); trimming must not take memory
 * from any block that holds data, and the trimmed blocks are exactly the free ones above it. */
static void op_compact(harness *h) {
    static uint32_t before[MAX_SEQS][MAX_BLOCKS];
    const uint32_t *array[MAX_SEQS];
    uint8_t named_before[MAX_BLOCKS] = {0};
    for (size_t i = 0; i < h->nlive; i++) {
        array[i] = read_table(h, &h->live[i]);
        uint32_t len = blocks_for(h->live[i].tokens);
        memcpy(before[i], array[i], len * sizeof *array[i]);
        for (uint32_t pos = 0; pos < len; pos++) named_before[array[i][pos]] = 1;
    }
    kva_kv_stats st;
    kva_kv_get_stats(h->kv, &st);
    uint32_t n = st.used_blocks + st.cached_blocks;

    kva_kv_move moves[MAX_BLOCKS];
    uint32_t needed = UINT32_MAX, count = 0, trimmed = 0;
    kva_status sizing = kva_kv_compact(h->kv, NULL, 0, &needed);
    ORACLE(needed < MAX_BLOCKS && (needed == 0 ? sizing == KVA_OK : sizing == KVA_ERR_NOMEM));
    ORACLE(kva_kv_compact(h->kv, moves, MAX_BLOCKS, &count) == KVA_OK && count == needed);
    check_moves(h, moves, count, n, named_before);
    for (uint32_t k = 0; k < count; k++) copy_block(h, moves[k].src_block, moves[k].dst_block);
    for (uint32_t k = 0; k < count; k++) { /* a moved block keeps its key, priority and LRU place */
        ORACLE(!h->block[moves[k].dst_block].registered);
        h->block[moves[k].dst_block] = h->block[moves[k].src_block];
        h->block[moves[k].src_block].registered = 0;
    }
    for (uint32_t k = 0; k < count; k++) poison_block(h, moves[k].src_block);
    check_renamed(h, (const uint32_t(*)[MAX_BLOCKS])before, array, moves, count, n);

    kva_kv_stats after;
    kva_kv_get_stats(h->kv, &after);
    ORACLE(after.used_blocks + after.cached_blocks == n && after.free_blocks == st.free_blocks);
    ORACLE(kva_kv_trim(h->kv, &trimmed) == KVA_OK);
    ORACLE(trimmed == after.free_blocks + after.trimmed_blocks);
}

/* Eviction on request: as many as asked and cached, the model's victims. */
static void op_evict(harness *h, input *in) {
    const uint32_t *tables[MAX_SEQS];
    uint8_t refs[MAX_BLOCKS];
    read_tables(h, tables);
    count_refs(h, tables, refs);
    uint32_t asked = next_byte(in) % 8, cached = model_count(h, refs, 1), evicted = UINT32_MAX;
    ORACLE(kva_kv_evict(h->kv, asked, &evicted) == KVA_OK);
    ORACLE(evicted == (asked < cached ? asked : cached));
    model_evict(h, refs, evicted);
}

/* The checks after every operation: the cache's own walk, the counts, the memory and the
 * prefix cache's model. */
UNGUIDED static void check_step(const harness *h) {
    ORACLE(kva_kv_check(h->kv) == KVA_OK);
    kva_kv_stats st;
    kva_kv_get_stats(h->kv, &st);
    ORACLE(st.free_blocks + st.used_blocks + st.cached_blocks + st.trimmed_blocks == st.num_blocks);
    ORACLE(st.sequences + st.pins == h->nlive);
    const uint32_t *tables[MAX_SEQS];
    read_tables(h, tables);
    check_all(h, tables);
    check_prefix_model(h, tables);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input in = {data, size, 0};
    harness *h = &H;
    h->nlive = h->ndead = 0;
    h->next_id = 0;
    memset(h->block, 0, sizeof h->block);
    h->clock = h->evictions = h->hit_tokens = 0;
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = LAYERS, cfg.kv_heads = 1, cfg.head_dim = 4, cfg.block_tokens = BLOCK_TOKENS;
    cfg.num_blocks = 32 + next_byte(&in) % 32;
    cfg.layout = next_byte(&in) & 1 ? KVA_KV_LAYOUT_BLOCKS : KVA_KV_LAYOUT_LAYERS;
    cfg.pages = KVA_PAGES_SMALL;
    ORACLE(kva_kv_create(&cfg, NULL, &h->kv) == KVA_OK);
    ORACLE(kva_kv_get_info(h->kv, &h->info) == KVA_OK);
    map_blocks(h);

    while (in.at < in.size) {
        unsigned op = next_byte(&in) % 8;
        if (op <= 1 && h->nlive < MAX_SEQS) op_prompt(h, &in, op == 1);
        else if (op == 2 && h->nlive) op_append(h, &in);
        else if (op == 3 && h->nlive && h->nlive < MAX_SEQS) op_fork(h, &in);
        else if (op <= 5 && h->nlive) op_release(h, &in);
        else if (op == 6 && h->ndead) op_stale(h, &in);
        else if (op == 7 && next_byte(&in) % 2 == 0) op_evict(h, &in);
        else if (op == 7) op_compact(h);
        check_step(h);
    }
    for (size_t i = 0; i < h->nlive; i++)
        ORACLE((h->live[i].is_pin ? kva_kv_unpin(h->kv, h->live[i].handle) : kva_kv_seq_free(h->kv, h->live[i].handle)) ==
               KVA_OK);
    /* With every sequence gone, each block the model holds registered is cached: all go. */
    uint32_t evicted = UINT32_MAX;
    ORACLE(kva_kv_evict(h->kv, UINT32_MAX, &evicted) == KVA_OK);
    uint8_t no_refs[MAX_BLOCKS] = {0};
    ORACLE(evicted == model_count(h, no_refs, 0));
    kva_kv_stats end;
    kva_kv_get_stats(h->kv, &end);
    ORACLE(end.free_blocks + end.trimmed_blocks == end.num_blocks);
    ORACLE(kva_kv_check(h->kv) == KVA_OK);
    kva_kv_destroy(h->kv);
    return 0;
}
