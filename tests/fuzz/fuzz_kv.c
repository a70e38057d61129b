/*
 * fuzz_kv.c — libFuzzer harness for the KV-cache manager: input bytes become allocations with
 * prefix keys drawn from a small alphabet (so prefixes are shared), as u64 keys or as engine keys
 * of two lengths, in three namespaces (one beyond 32 bits); appends, with and without the keys of
 * the blocks they fill; forks, frees, pins, singly and in batches; the block calls (take, commit,
 * ref, unref, evict by block and by key, reset); evictions, compactions, trims, stale-handle
 * calls and event drains on a small paged cache.
 *
 * The oracle acts as the engine would. Every token a sequence holds is stamped, in every layer
 * and both parts, with a tag that says what it is: a keyed block's tokens (a prompt's given
 * blocks, and every block of a sequence that keeps its chain) get a tag derived from its key
 * alone (namespace, key length, path of keys), so any block the cache hands out as a hit must
 * already hold exactly those tags; every other token gets a tag unique to the sequence that
 * wrote it and its position. A block the engine commits through the block calls is stamped
 * with its key's tags first, as an engine fills a block before committing it. The harness
 * performs each copy on write and each compaction move the cache asks for, poisons every block
 * the model holds free, and then reads every live block table back through the memory: a table
 * entry that names the wrong block, a copy the cache forgot to ask for, a move it did not
 * report, or a block two sequences wrongly share shows up as a tag that is not where the model
 * expects it. On top of that: kva_kv_check after every operation, the statuses, the block
 * counts, failed calls leaving out-parameters untouched.
 *
 * The prefix cache has a model of its own (model_block): which block ids hold which key, how
 * many references the engine holds on each, which are cached (evictable), their priorities and
 * the order in which they were released. Evictions are followed exactly although the library
 * names no victim: kva_kv_evict and the stats count them, and the header fixes the order (lowest
 * priority first, then least recently released; a call evicts only what it needs beyond the free
 * and trimmed blocks). So every allocation's and pin's cached_tokens, hit block ids and status
 * (NOMEM exactly when free, trimmed and evictable blocks fall short) are predicted, as are each
 * registration or duplicate (a commit of a key registered already reports its holder), the
 * stats' cached, registered, evictions, hit_tokens and their re-admissions' part (prompts marked
 * KVA_KV_AGAIN at times), the pinned blocks, each namespace's row of kva_kv_namespaces, and every
 * event in the ring: its kind,
 * block, namespace, key and parent (engine keys byte for byte; the library's keys by the bytes
 * their first event showed), first token, and which events a full ring dropped. A victim the
 * model did not expect shows up as a block still registered in the model being handed out as
 * new.
 *
 * The keys of blocks beyond a prompt's given ones, which a sequence that keeps its chain commits
 * as it fills them, follow from the sequence and the position (next_key), so the memory model
 * reads no input bytes of its own.
 */
#include <stdint.h>
#include <string.h>

#include "fuzz_input.h"
#include "kvalloc.h"

#define MAX_SEQS 64
#define BLOCK_TOKENS 4
#define LAYERS 2                               /* two, so that per-layer addressing and regions matter */
#define MAX_BLOCKS 64                          /* num_blocks is 32 .. 63 */
#define MAX_TOKENS (MAX_BLOCKS * BLOCK_TOKENS) /* no sequence can hold more blocks than the cache */
#define POISON 0xa5
#define MAX_KEYS 16 /* a prompt keys at most 40 / BLOCK_TOKENS blocks */
#define EVENTS 24   /* the cache's ring: small, so that it fills and drops */
#define MAX_LEARNED 512
#define NAMESPACES 3

/* A key space: a namespace's index and the key's length (0: the library's u64-keyed chain). */
static const uint64_t namespace_of[NAMESPACES] = {0, 1, (uint64_t)1 << 40 | 1};
static const uint32_t engine_lengths[2] = {20, 32};
static uint32_t space_of(uint32_t ns, uint32_t len) { return ns | len << 8; }
static uint64_t space_ns(uint32_t space) { return namespace_of[space & 0xff]; }
static uint32_t space_len(uint32_t space) { return space >> 8; }

/* What the model knows of one live sequence or pin. */
typedef struct model_seq {
    kva_kv_seq handle;
    int is_pin;
    int keyed; /* it keeps its chain: the blocks it fills are committed */
    uint32_t tokens;
    uint32_t space; /* its keys' */
    uint32_t priority;
    uint64_t id;              /* names the tokens this sequence writes itself */
    uint8_t path[MAX_BLOCKS]; /* while keyed: the key of each block, the partial one's included */
    uint64_t tag[MAX_TOKENS]; /* what token t holds (before the per-layer, per-part salt) */
} model_seq;

/* What the model knows of one block id. A registered block holds the key path[0 .. depth) of
 * its space; while no live table names it and the engine holds no reference, it is cached
 * (evictable), else used. An unregistered block is free, or used without a key. */
typedef struct model_block {
    uint8_t registered;
    uint8_t depth;
    uint8_t priority; /* the highest of its holders since taken */
    uint8_t loose;    /* references the engine holds (the block calls) */
    uint32_t space;
    uint8_t path[MAX_BLOCKS];
    uint64_t released_at; /* while cached: when its last reference went (its LRU place) */
} model_block;

typedef struct model_event {
    uint32_t kind, block, space, first_token;
    uint8_t depth, has_parent;
    uint8_t path[MAX_BLOCKS];
} model_event;

typedef struct harness {
    kva_kv *kv;
    kva_kv_info info;
    uint8_t *part[MAX_BLOCKS][LAYERS][2]; /* kva_kv_block_address of every block, layer, part */
    kva_kv_layer layer[LAYERS];           /* kva_kv_layer_info (the layers differ with groups) */
    uint64_t next_id;
    model_seq live[MAX_SEQS];
    size_t nlive;
    kva_kv_seq dead[MAX_SEQS];
    size_t ndead;
    model_block block[MAX_BLOCKS];
    uint64_t clock;                                    /* counts releases of registered blocks: the LRU order */
    uint64_t evictions;                                /* what kva_kv_stats.evictions must say */
    uint64_t hit_tokens;                               /* what kva_kv_stats.hit_tokens must say */
    uint64_t readmit_hit_tokens, readmit_query_tokens; /* and its readmit_* (KVA_KV_AGAIN) */
    model_event ring[EVENTS];                          /* the cache's event ring, as it must be */
    uint32_t ring_head, ring_count;
    uint64_t dropped;
    struct {
        uint32_t space;
        uint8_t depth;
        uint8_t path[MAX_BLOCKS];
        uint8_t bytes[16];
    } learned[MAX_LEARNED]; /* the library's keys' bytes, from the first event naming each */
    uint32_t nlearned;
} harness;

/* Static: the model is 190 KiB, and only its used part is written per input. */
static harness H;

/* The oracle's own loops over tags and memory are not what the fuzzer should steer by: left
 * uninstrumented, they cost no coverage callbacks and put no random 64-bit tags into the
 * fuzzer's comparison tables. */
#define UNGUIDED __attribute__((no_sanitize("coverage")))

/* ---- tags and keys -------------------------------------------------------------------------- */

UNGUIDED static uint64_t mix64(uint64_t x) {
    x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27, x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The identity of the key path[0 .. i] in a space: equal keys, equal content. */
UNGUIDED static uint64_t prefix_hash(uint32_t space, const uint8_t *path, uint32_t i) {
    uint64_t h = mix64(0x5eed0000ull + space);
    for (uint32_t j = 0; j <= i; j++) h = mix64(h ^ mix64(path[j] + 1u));
    return h;
}

/* A token of a keyed block: its content follows from the key alone, whoever wrote it. */
UNGUIDED static uint64_t keyed_tag(uint32_t space, const uint8_t *path, uint32_t t) {
    return mix64(prefix_hash(space, path, t / BLOCK_TOKENS) + t % BLOCK_TOKENS);
}

/* A token that only its writer has: unique to (sequence id, position). */
UNGUIDED static uint64_t private_tag(uint64_t id, uint32_t t) { return mix64(id << 16 | t) | 1; }

/* Each layer and part holds a differently salted tag, so a copy that skips a layer or part, or
 * addresses that overlap, are seen. */
UNGUIDED static uint64_t salted(uint64_t tag, unsigned layer, unsigned part) {
    return tag ^ mix64(0x1000 + layer * 2 + part);
}

/* The key a keyed sequence gives block pos beyond its prompt's keys. */
UNGUIDED static uint8_t next_key(const model_seq *m, uint32_t pos) { return (uint8_t)(mix64(m->id << 8 | pos) % 4); }

/* An engine's key for path[0 .. depth), of len bytes: the depth, the path at two bits a key,
 * then padding, so that distinct paths never share bytes. */
UNGUIDED static void engine_key(const uint8_t *path, uint32_t depth, uint32_t len, uint8_t *out) {
    memset(out, 0xc3, len);
    out[0] = (uint8_t)depth;
    memset(out + 1, 0, MAX_BLOCKS / 4);
    for (uint32_t j = 0; j < depth; j++) out[1 + j / 4] |= (uint8_t)(path[j] << (2 * (j % 4)));
}

/* ---- memory, as the engine touches it -------------------------------------------------------- */

/* The geometry: kva_kv_block_address of everything, checked against the documented formula
 * (kva_kv_layer's, and kva_kv_info's where the layers have one shape). */
UNGUIDED static void map_blocks(harness *h) {
    const kva_kv_info *g = &h->info;
    ORACLE(g->num_blocks <= MAX_BLOCKS && g->layers == LAYERS && g->block_tokens == BLOCK_TOKENS);
    for (unsigned l = 0; l < LAYERS; l++) {
        kva_kv_layer *layer = &h->layer[l];
        ORACLE(kva_kv_layer_info(h->kv, l, layer) == KVA_OK);
        ORACLE(layer->slot_bytes >= sizeof(uint64_t) && layer->part_bytes == layer->slot_bytes * BLOCK_TOKENS);
        if (g->kv_heads)
            ORACLE(layer->offset == l * g->layer_stride && layer->block_stride == g->block_stride &&
                   layer->part_bytes == g->part_bytes);
    }
    for (uint32_t b = 0; b < g->num_blocks; b++)
        for (unsigned l = 0; l < LAYERS; l++)
            for (unsigned p = 0; p < 2; p++) {
                const kva_kv_layer *layer = &h->layer[l];
                void *at = NULL;
                if (p >= layer->parts) {
                    ORACLE(kva_kv_block_address(h->kv, b, l, (kva_kv_part)p, &at) == KVA_ERR_INVALID);
                    h->part[b][l][p] = NULL;
                    continue;
                }
                ORACLE(kva_kv_block_address(h->kv, b, l, (kva_kv_part)p, &at) == KVA_OK);
                ORACLE((uint8_t *)at ==
                       (uint8_t *)g->base + layer->offset + b * layer->block_stride + p * layer->part_bytes);
                h->part[b][l][p] = at;
            }
    void *at;
    ORACLE(kva_kv_block_address(h->kv, g->num_blocks, 0, KVA_KV_K, &at) == KVA_ERR_INVALID);
}

UNGUIDED static void write_token(harness *h, uint32_t block, uint32_t slot, uint64_t tag) {
    for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned p = 0; p < h->layer[l].parts; p++) {
            uint64_t v = salted(tag, l, p);
            memcpy(h->part[block][l][p] + slot * h->layer[l].slot_bytes, &v, sizeof v);
        }
}

UNGUIDED static int token_holds(const harness *h, uint32_t block, uint32_t slot, uint64_t tag) {
    for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned p = 0; p < h->layer[l].parts; p++) {
            uint64_t v;
            memcpy(&v, h->part[block][l][p] + slot * h->layer[l].slot_bytes, sizeof v);
            if (v != salted(tag, l, p)) return 0;
        }
    return 1;
}

/* Copy on write as kva_kv_copy says: the first `tokens` tokens of every layer's K and V. */
UNGUIDED static void copy_tokens(harness *h, uint32_t src, uint32_t dst, uint32_t tokens) {
    for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned p = 0; p < h->layer[l].parts; p++)
            memcpy(h->part[dst][l][p], h->part[src][l][p], tokens * h->layer[l].slot_bytes);
}

/* A compaction move as kva_kv_move says: all layers, K and V. */
static void copy_block(harness *h, uint32_t src, uint32_t dst) { copy_tokens(h, src, dst, BLOCK_TOKENS); }

/* A block the cache calls free holds nothing: overwrite it so that a table still naming it is
 * caught by the next content check. */
UNGUIDED static void poison_block(const harness *h, uint32_t block) {
    for (unsigned l = 0; l < LAYERS; l++)
        for (unsigned p = 0; p < h->layer[l].parts; p++) memset(h->part[block][l][p], POISON, h->layer[l].part_bytes);
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

/* Each block's references as the cache must count them: the live table entries naming it and
 * the engine's. */
UNGUIDED static void count_refs(const harness *h, const uint32_t *const *tables, uint8_t *refs) {
    for (uint32_t b = 0; b < MAX_BLOCKS; b++) refs[b] = h->block[b].loose;
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
 * blocks named or held by the engine are exactly the used ones, and none is trimmed. */
UNGUIDED static void check_sharing(const harness *h, const uint32_t *const *tables) {
    uint8_t owner[MAX_BLOCKS], position[MAX_BLOCKS], fill[MAX_BLOCKS];
    memset(owner, 0xff, sizeof owner);
    uint32_t used = 0;
    for (size_t i = 0; i < h->nlive; i++) {
        const model_seq *m = &h->live[i];
        for (uint32_t pos = 0; pos < blocks_for(m->tokens); pos++) {
            uint32_t b = tables[i][pos];
            if (owner[b] == 0xff) {
                owner[b] = (uint8_t)i, position[b] = (uint8_t)pos, fill[b] = (uint8_t)block_fill(m, pos);
                used++;
                continue;
            }
            ORACLE(owner[b] != i && position[b] == pos && fill[b] == block_fill(m, pos));
        }
    }
    for (uint32_t b = 0; b < h->info.num_blocks; b++) used += owner[b] == 0xff && h->block[b].loose;
    kva_kv_stats st;
    ORACLE(kva_kv_get_stats(h->kv, &st) == KVA_OK);
    ORACLE(used == st.used_blocks);
    for (uint32_t b = st.num_blocks - st.trimmed_blocks; b < st.num_blocks; b++)
        ORACLE(owner[b] == 0xff && !h->block[b].loose);
}

UNGUIDED static void check_all(const harness *h, const uint32_t *const *tables) {
    for (size_t i = 0; i < h->nlive; i++) check_contents(h, &h->live[i], tables[i]);
    check_sharing(h, tables);
}

/* ---- the model ------------------------------------------------------------------------------- */

static model_seq *model_add(harness *h, kva_kv_seq handle, int is_pin, uint32_t tokens, uint32_t space,
                            uint32_t priority) {
    model_seq *m = &h->live[h->nlive++];
    m->handle = handle;
    m->is_pin = is_pin;
    m->keyed = 0;
    m->tokens = tokens;
    m->space = space;
    m->priority = priority;
    m->id = ++h->next_id;
    return m;
}

/* The tag of token t of m, written now: its key's while m keeps its chain or the token's block
 * is one of the `keyed` first, else its own. */
UNGUIDED static uint64_t tag_for(const model_seq *m, uint32_t t, uint32_t keyed) {
    return m->keyed || t / BLOCK_TOKENS < keyed ? keyed_tag(m->space, m->path, t) : private_tag(m->id, t);
}

/* Keys for the blocks of a keyed sequence from `from` through the one holding its last token. */
UNGUIDED static void extend_path(model_seq *m, uint32_t from) {
    for (uint32_t pos = from; pos <= m->tokens / BLOCK_TOKENS && pos < MAX_BLOCKS; pos++)
        m->path[pos] = next_key(m, pos);
}

static void model_remove(harness *h, size_t i) {
    if (h->ndead < MAX_SEQS) h->dead[h->ndead++] = h->live[i].handle;
    h->live[i] = h->live[--h->nlive];
}

/* ---- the prefix cache's model ---------------------------------------------------------------- */

/* The block the model holds under the key path[0 .. depth) of a space, or none. */
UNGUIDED static uint32_t model_lookup(const harness *h, uint32_t space, const uint8_t *path, uint32_t depth) {
    for (uint32_t b = 0; b < h->info.num_blocks; b++) {
        const model_block *mb = &h->block[b];
        if (mb->registered && mb->space == space && mb->depth == depth && memcmp(mb->path, path, depth) == 0) return b;
    }
    return KVA_KV_NO_BLOCK;
}

/* The header's hit: the longest prefix of the given blocks held under their keys, used or
 * cached, stopping at the first miss; hit[0 .. n) are its blocks. Nothing caps it: a prompt
 * whose every block is given and held is a hit of all its tokens. */
UNGUIDED static uint32_t model_hits(const harness *h, uint32_t space, const uint8_t *path, uint32_t nkeys,
                                    uint32_t *hit) {
    uint32_t n = 0;
    while (n < nkeys && (hit[n] = model_lookup(h, space, path, n + 1)) != KVA_KV_NO_BLOCK) n++;
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

/* An event into the model's ring, or dropped when it is full, as the cache does. */
UNGUIDED static void model_event_push(harness *h, uint32_t kind, uint32_t b, uint32_t space, const uint8_t *path,
                                      uint32_t depth, int has_parent) {
    if (h->ring_count == EVENTS) {
        h->dropped++;
        return;
    }
    model_event *e = &h->ring[(h->ring_head + h->ring_count++) % EVENTS];
    *e = (model_event){.kind = kind,
                       .block = b,
                       .space = space,
                       .depth = (uint8_t)depth,
                       .has_parent = (uint8_t)has_parent,
                       .first_token = depth ? (depth - 1) * BLOCK_TOKENS : 0};
    if (depth) memcpy(e->path, path, depth);
}

/* Drops b's registration: a removed event, an eviction. */
UNGUIDED static void model_forget(harness *h, uint32_t b) {
    model_block *mb = &h->block[b];
    model_event_push(h, KVA_KV_EVENT_REMOVED, b, mb->space, mb->path, mb->depth, 0);
    mb->registered = 0;
    h->evictions++;
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
        model_forget(h, victim);
    }
}

/* A call that takes new blocks evicts only what it needs beyond the free blocks and the
 * trimmed ones (whose memory comes back first): `spare` is their sum before the call. */
UNGUIDED static void model_make_room(harness *h, const uint8_t *refs, uint32_t need, uint32_t spare) {
    model_evict(h, refs, need > spare ? need - spare : 0);
}

/* A block the cache hands out as new was free or has just been evicted: the model must not
 * hold it as registered. A victim other than the model's is caught here, when it is taken. */
UNGUIDED static void model_take(harness *h, uint32_t b, uint32_t priority) {
    ORACLE(!h->block[b].registered && !h->block[b].loose);
    h->block[b].priority = (uint8_t)priority;
}

/* Registers block b under path[0 .. depth) of a space unless that key is registered already
 * (then b stays unregistered, a duplicate); a stored event, its parent the key one shorter. */
UNGUIDED static void model_commit(harness *h, uint32_t b, uint32_t space, const uint8_t *path, uint32_t depth) {
    ORACLE(depth <= MAX_BLOCKS && !h->block[b].registered);
    if (model_lookup(h, space, path, depth) != KVA_KV_NO_BLOCK) return;
    model_block *mb = &h->block[b];
    mb->registered = 1;
    mb->space = space;
    mb->depth = (uint8_t)depth;
    memcpy(mb->path, path, depth);
    model_event_push(h, KVA_KV_EVENT_STORED, b, space, path, depth, depth > 1);
}

/* One reference to b gone (refs updated): the newest end of its LRU list if it was the last. */
UNGUIDED static void model_released(harness *h, uint32_t b, const uint8_t *refs) {
    if (refs[b] == 0 && h->block[b].registered) h->block[b].released_at = ++h->clock;
}

/* A release as kva_kv_seq_free documents it: last block first. refs (the counts before the
 * release) is updated. */
UNGUIDED static void model_release(harness *h, const uint32_t *table, uint32_t len, uint8_t *refs) {
    for (uint32_t pos = len; pos-- > 0;) {
        refs[table[pos]]--;
        model_released(h, table[pos], refs);
    }
}

/* The model against the cache's figures: blocks registered and cached, evictions, hits (and
 * re-admissions'), pinned blocks, and each namespace's row (three namespaces: each has a slot). */
UNGUIDED static void check_prefix_model(const harness *h, const uint32_t *const *tables) {
    uint8_t refs[MAX_BLOCKS];
    count_refs(h, tables, refs);
    kva_kv_stats st;
    ORACLE(kva_kv_get_stats(h->kv, &st) == KVA_OK);
    ORACLE(st.registered_blocks == model_count(h, refs, 0) && st.cached_blocks == model_count(h, refs, 1));
    ORACLE(st.evictions == h->evictions && st.hit_tokens == h->hit_tokens);
    ORACLE(st.readmit_hit_tokens == h->readmit_hit_tokens && st.readmit_query_tokens == h->readmit_query_tokens);
    uint8_t pinned[MAX_BLOCKS] = {0};
    uint64_t want[NAMESPACES][4] = {{0}}; /* sequences, pins, table blocks, registered */
    uint32_t npinned = 0;
    for (size_t i = 0; i < h->nlive; i++) {
        const model_seq *m = &h->live[i];
        uint64_t *w = want[m->space & 0xff];
        w[m->is_pin ? 1 : 0]++;
        w[2] += blocks_for(m->tokens);
        for (uint32_t pos = 0; m->is_pin && pos < blocks_for(m->tokens); pos++) {
            npinned += !pinned[tables[i][pos]];
            pinned[tables[i][pos]] = 1;
        }
    }
    for (uint32_t b = 0; b < h->info.num_blocks; b++)
        if (h->block[b].registered) want[h->block[b].space & 0xff][3]++;
    ORACLE(st.pinned_blocks == npinned);
    kva_kv_namespace_share rows[KVA_KV_NAMESPACE_SLOTS + 1];
    uint32_t n = 0, listed = 0;
    ORACLE(kva_kv_namespaces(h->kv, rows, KVA_KV_NAMESPACE_SLOTS + 1, &n) == KVA_OK);
    for (uint32_t ns = 0; ns < NAMESPACES; ns++) {
        const uint64_t *w = want[ns];
        const kva_kv_namespace_share *row = NULL;
        for (uint32_t r = 0; r < n; r++)
            if (!rows[r].is_other && rows[r].namespace_id == namespace_of[ns]) row = &rows[r];
        if (!(w[0] | w[1] | w[2] | w[3])) {
            ORACLE(row == NULL);
            continue;
        }
        listed++;
        ORACLE(row && row->sequences == w[0] && row->pins == w[1] && row->blocks == w[2] &&
               row->registered_blocks == w[3]);
    }
    ORACLE(n == listed); /* no other row, no namespace the model does not know */
}

/* ---- events ---------------------------------------------------------------------------------- */

/* The bytes of a key as an event must carry them: an engine key's exactly; a library key's as
 * its first event showed them (learned then), distinct from every other key's. */
UNGUIDED static void check_key(harness *h, uint32_t space, const uint8_t *path, uint32_t depth, const uint8_t *bytes,
                               uint32_t len, uint32_t library) {
    if (space_len(space)) {
        uint8_t want[KVA_KV_MAX_KEY_BYTES];
        engine_key(path, depth, space_len(space), want);
        ORACLE(!library && len == space_len(space) && memcmp(bytes, want, len) == 0);
        return;
    }
    ORACLE(library && len == 16);
    for (uint32_t i = 0; i < h->nlearned; i++) {
        int same = h->learned[i].space == space && h->learned[i].depth == depth &&
                   memcmp(h->learned[i].path, path, depth) == 0;
        ORACLE(same == (memcmp(h->learned[i].bytes, bytes, 16) == 0));
        if (same) return;
    }
    if (h->nlearned == MAX_LEARNED) return;
    h->learned[h->nlearned].space = space;
    h->learned[h->nlearned].depth = (uint8_t)depth;
    memcpy(h->learned[h->nlearned].path, path, depth);
    memcpy(h->learned[h->nlearned++].bytes, bytes, 16);
}

/* Drains up to capacity events and checks each against the model's ring, in order. */
UNGUIDED static void drain_events(harness *h, uint32_t capacity) {
    kva_kv_event got[EVENTS];
    uint32_t n = UINT32_MAX;
    uint64_t dropped = UINT64_MAX;
    ORACLE(kva_kv_take_events(h->kv, got, capacity, &n, &dropped) == KVA_OK);
    ORACLE(n == (h->ring_count < capacity ? h->ring_count : capacity) && dropped == h->dropped);
    h->dropped = 0;
    for (uint32_t i = 0; i < n; i++) {
        const model_event *e = &h->ring[h->ring_head];
        const kva_kv_event *g = &got[i];
        h->ring_head = (h->ring_head + 1) % EVENTS;
        h->ring_count--;
        ORACLE(g->kind == e->kind && g->block == e->block && g->medium == KVA_KV_MEDIUM_STORAGE);
        if (e->kind == KVA_KV_EVENT_CLEARED) {
            ORACLE(g->namespace_id == 0 && g->key_len == 0);
            continue;
        }
        ORACLE(g->namespace_id == space_ns(e->space));
        check_key(h, e->space, e->path, e->depth, g->key, g->key_len, g->library_key);
        if (e->kind == KVA_KV_EVENT_REMOVED) continue;
        ORACLE(g->first_token == e->first_token && g->num_tokens == BLOCK_TOKENS);
        ORACLE(g->parent_len == (e->has_parent ? g->key_len : 0));
        if (e->has_parent) check_key(h, e->space, e->path, e->depth - 1u, g->parent, g->parent_len, g->library_key);
    }
}

/* ---- operations ------------------------------------------------------------------------------ */

/* What the model reads of the cache before a call: each block's references and the free and
 * trimmed blocks. A batch's requests are predicted one after the other from it, each updating
 * it as the cache did. */
typedef struct before_call {
    uint8_t refs[MAX_BLOCKS];
    uint32_t spare;
} before_call;

UNGUIDED static void snapshot(const harness *h, before_call *pre) {
    const uint32_t *tables[MAX_SEQS];
    read_tables(h, tables);
    count_refs(h, tables, pre->refs);
    kva_kv_stats st;
    kva_kv_get_stats(h->kv, &st);
    pre->spare = st.free_blocks + st.trimmed_blocks;
}

/* need blocks taken: evicted what the spare ones lacked, then all of them used. */
UNGUIDED static void take_blocks(harness *h, before_call *pre, uint32_t need) {
    model_make_room(h, pre->refs, need, pre->spare);
    pre->spare = need > pre->spare ? 0 : pre->spare - need;
}

/* A prompt as the model sees it: tokens, its given keys and their space. */
typedef struct prompt {
    uint32_t tokens, nkeys, space, priority;
    uint32_t again; /* KVA_KV_AGAIN for a re-admission, else 0 (ORed into the priority) */
    uint8_t path[MAX_KEYS + 1];
} prompt;

/* Reads a prompt whose full blocks are keyed from a 4-letter alphabet (prefixes repeat). The
 * older calls' namespaces are 0 and 1; the others' also 2^40 + 1. */
static void read_prompt(input *in, prompt *p, int pin, int wide, int engine) {
    p->tokens = next_byte(in) % 40 + 1;
    uint32_t full = p->tokens / BLOCK_TOKENS;
    p->nkeys = next_byte(in) % (full + 1);
    if (p->nkeys > MAX_KEYS) p->nkeys = MAX_KEYS;
    for (uint32_t i = 0; i < p->nkeys; i++) p->path[i] = (uint8_t)(next_byte(in) % 4);
    /* Read in this order explicitly (argument order is unspecified; clang reads left to right).
     * A pin has namespace 0 and no priority: it leaves its blocks' priorities as they are. */
    uint32_t ns = pin ? 0 : next_byte(in) % (wide ? NAMESPACES : 2);
    uint32_t pb = pin ? 0 : next_byte(in);
    p->priority = pb % KVA_KV_PRIORITIES;
    p->again = pb / KVA_KV_PRIORITIES % 4 == 1 ? KVA_KV_AGAIN : 0; /* a re-admission at times */
    p->space = space_of(ns, engine ? engine_lengths[next_byte(in) % 2] : 0);
}

/* The content of a prompt's keys: u64 keys or engine keys, into the given arrays. */
static kva_kv_content prompt_content(const prompt *p, uint32_t from, uint32_t to, uint64_t *keys, uint8_t *bytes) {
    uint32_t len = space_len(p->space);
    for (uint32_t i = from; i < to; i++) {
        keys[i - from] = p->path[i];
        if (len) engine_key(p->path, i + 1, len, bytes + (i - from) * len);
    }
    return (kva_kv_content){.kind = len ? KVA_KV_KEY_BYTES : KVA_KV_KEY_U64,
                            .key_len = len,
                            .keys = keys,
                            .key_bytes = bytes};
}

/* The model's side of an admission (chain 1 if the prompt's content keeps a chain when it
 * keys every full block, 0 if not) or a pin (chain -1) that the cache has answered with st, seq
 * and cached: the status (NOMEM exactly when free, trimmed and evictable blocks fall short, the
 * prompt's own cached hits excepted: it references them before anything is evicted; the other
 * NOMEM, host memory for the table, does not happen at this size), the hit and its blocks, the
 * evictions, the registrations; the prompt is stamped as the engine's prefill would. Returns
 * whether it was admitted. */
static int model_prompt(harness *h, const prompt *p, int chain, kva_status st, kva_kv_seq seq, uint32_t cached,
                        before_call *pre) {
    int pin = chain < 0;
    uint8_t *refs = pre->refs;
    uint32_t hit[MAX_KEYS], hits = model_hits(h, p->space, p->path, p->nkeys, hit), cached_hits = 0;
    for (uint32_t i = 0; i < hits; i++) cached_hits += refs[hit[i]] == 0;
    uint32_t need = pin ? 0 : blocks_for(p->tokens) - hits;
    int room = need <= pre->spare + model_count(h, refs, 1) - cached_hits;
    ORACLE(st == (room ? KVA_OK : KVA_ERR_NOMEM));
    if (st != KVA_OK) return 0;
    ORACLE(cached == hits * BLOCK_TOKENS);
    model_seq *m = model_add(h, seq, pin, pin ? cached : p->tokens, p->space, p->priority);
    memcpy(m->path, p->path, p->nkeys);
    m->keyed = chain > 0 && p->nkeys == p->tokens / BLOCK_TOKENS;
    if (m->keyed) extend_path(m, p->nkeys);
    const uint32_t *table = read_table(h, m);
    for (uint32_t i = 0; i < hits; i++) {
        ORACLE(table[i] == hit[i]);
        refs[hit[i]]++;
        if (p->priority > h->block[hit[i]].priority) h->block[hit[i]].priority = (uint8_t)p->priority;
    }
    if (!pin) {
        take_blocks(h, pre, need);
        for (uint32_t pos = hits; pos < blocks_for(p->tokens); pos++) {
            model_take(h, table[pos], p->priority);
            refs[table[pos]] = 1;
        }
        for (uint32_t i = hits; i < p->nkeys; i++) model_commit(h, table[i], p->space, p->path, i + 1);
        h->hit_tokens += cached; /* pins are not counted */
        if (p->again) {
            h->readmit_hit_tokens += cached;
            h->readmit_query_tokens += p->tokens;
        }
    }
    for (uint32_t t = 0; t < m->tokens; t++) {
        m->tag[t] = tag_for(m, t, p->nkeys);
        uint32_t b = table[t / BLOCK_TOKENS], slot = t % BLOCK_TOKENS;
        if (t < cached) ORACLE(token_holds(h, b, slot, m->tag[t])); /* a hit holds its prefix */
        else write_token(h, b, slot, m->tag[t]);
    }
    return 1;
}

/* A prompt through the older calls (u64 keys, 32-bit namespaces): a sequence or a pin. */
static void op_prompt(harness *h, input *in, int pin) {
    prompt p;
    read_prompt(in, &p, pin, 0, 0);
    uint64_t keys[MAX_KEYS];
    for (uint32_t i = 0; i < p.nkeys; i++) keys[i] = p.path[i];
    const kva_kv_seq untouched = 0x5151515151515151ull;
    kva_kv_seq seq = untouched;
    uint32_t cached = UINT32_MAX, ns = (uint32_t)space_ns(p.space);
    before_call pre;
    snapshot(h, &pre);
    kva_status st = pin ? kva_kv_pin(h->kv, p.nkeys ? keys : NULL, p.nkeys, NULL, 0, ns, &seq, &cached)
                        : kva_kv_seq_allocate(h->kv, p.tokens, p.nkeys ? keys : NULL, p.nkeys, NULL, 0, ns,
                                              p.priority | p.again, &seq, &cached);
    /* The older calls say nothing of a key kind without keys: a prompt of no full block has no
     * chain there. */
    if (!model_prompt(h, &p, pin ? -1 : p.nkeys > 0, st, seq, cached, &pre))
        ORACLE(seq == untouched && cached == UINT32_MAX); /* a failed call leaves its out-parameters */
}

/* One or two prompts through kva_kv_seq_admit or kva_kv_seq_admit_many, keyed by u64 or engine
 * keys in any namespace; in a batch the second may hit what the first registered. */
static void op_admit(harness *h, input *in) {
    unsigned how = next_byte(in);
    uint32_t count = how % 2 && h->nlive + 1 < MAX_SEQS ? 2 : 1, engine = how / 2 % 2;
    prompt p[2];
    for (uint32_t r = 0; r < count; r++) read_prompt(in, &p[r], 0, 1, engine);
    if (count == 2) p[1].space = p[0].space; /* one batch, one key length */
    uint64_t keys[2 * MAX_KEYS], offsets[3] = {0};
    uint8_t bytes[2 * MAX_KEYS * KVA_KV_MAX_KEY_BYTES];
    kva_kv_content c = {0};
    for (uint32_t r = 0; r < count; r++) {
        c = prompt_content(&p[r], 0, p[r].nkeys, keys + offsets[r], bytes + offsets[r] * space_len(p[r].space));
        offsets[r + 1] = offsets[r] + p[r].nkeys;
    }
    c.keys = keys;
    c.key_bytes = bytes;
    const kva_kv_seq untouched = 0x5151515151515151ull;
    kva_kv_seq seqs[2] = {untouched, untouched};
    uint32_t cached[2] = {UINT32_MAX, UINT32_MAX}, done = UINT32_MAX;
    before_call pre;
    snapshot(h, &pre);
    if (count == 1 && how / 4 % 2) {
        kva_status st = kva_kv_seq_admit(h->kv, p[0].tokens, space_ns(p[0].space), p[0].priority | p[0].again, &c,
                                         p[0].nkeys, &seqs[0], &cached[0]);
        ORACLE(st == KVA_OK || st == KVA_ERR_NOMEM);
        done = st == KVA_OK;
    } else {
        uint32_t num_tokens[2];
        uint64_t namespaces[2];
        uint8_t priorities[2];
        for (uint32_t r = 0; r < count; r++) {
            num_tokens[r] = p[r].tokens;
            namespaces[r] = space_ns(p[r].space);
            priorities[r] = (uint8_t)(p[r].priority | p[r].again);
        }
        ORACLE(kva_kv_seq_admit_many(h->kv, count, num_tokens, namespaces, priorities, &c, offsets, seqs, cached,
                                     &done) == KVA_OK);
    }
    for (uint32_t r = 0; r < count; r++) {
        int admitted = model_prompt(h, &p[r], 1, r < done ? KVA_OK : KVA_ERR_NOMEM, seqs[r], cached[r], &pre);
        if (admitted) continue;
        ORACLE(r == done && seqs[r] == untouched && cached[r] == UINT32_MAX);
        break;
    }
}

/* The model's side of an extension of live sequence i by `add` tokens, with the keys of the
 * blocks it fills given or not, that the cache has answered with st and copy: the status, the
 * copy on write (reported exactly when the last block was shared and partly filled), the new
 * blocks, the commits of a sequence that keeps its chain (or the chain broken when no keys
 * came), and the tokens written as the engine would. Returns whether it was extended. */
static int model_extend(harness *h, size_t i, uint32_t add, int given, kva_status st, const kva_kv_copy *copy,
                        before_call *pre, const uint32_t *before) {
    model_seq *m = &h->live[i];
    uint8_t *refs = pre->refs;
    uint32_t old_tokens = m->tokens, old_len = blocks_for(old_tokens), fill = old_tokens % BLOCK_TOKENS;
    int expect_cow = !m->is_pin && add && fill != 0 && refs[before[old_len - 1]] > 1;
    uint32_t need = blocks_for(old_tokens + add) - old_len + (uint32_t)expect_cow;
    int room = need <= pre->spare + model_count(h, refs, 1);
    ORACLE(st == (m->is_pin ? KVA_ERR_INVALID : room ? KVA_OK : KVA_ERR_NOMEM));
    if (st != KVA_OK) return 0;
    ORACLE(old_tokens + add <= MAX_TOKENS);
    m->tokens = old_tokens + add;
    const uint32_t *table = read_table(h, m);
    take_blocks(h, pre, need);
    for (uint32_t pos = old_len - (uint32_t)expect_cow; pos < blocks_for(m->tokens); pos++) {
        model_take(h, table[pos], m->priority);
        refs[table[pos]] = 1;
    }
    ORACLE(old_len == 0 || table_equal(table, before, old_len - 1));
    if (expect_cow) {
        ORACLE(copy->src_block == before[old_len - 1] && copy->dst_block == table[old_len - 1]);
        ORACLE(copy->dst_block != copy->src_block && copy->tokens == fill);
        copy_tokens(h, copy->src_block, copy->dst_block, copy->tokens);
        refs[copy->src_block]--;
        model_released(h, copy->src_block, refs);
    } else {
        ORACLE(copy->tokens == 0 && copy->src_block == KVA_KV_NO_BLOCK && copy->dst_block == KVA_KV_NO_BLOCK);
        ORACLE(old_len == 0 || table[old_len - 1] == before[old_len - 1]);
    }
    uint32_t first = old_tokens / BLOCK_TOKENS, end = m->tokens / BLOCK_TOKENS;
    if (m->keyed && given) {
        extend_path(m, first + 1);
        for (uint32_t pos = first; pos < end; pos++) model_commit(h, table[pos], m->space, m->path, pos + 1);
    } else if (m->keyed && end != first) {
        m->keyed = 0; /* what the new tokens hold is not known */
    } else if (m->keyed) {
        extend_path(m, first + 1);
    }
    for (uint32_t t = old_tokens; t < m->tokens; t++) {
        m->tag[t] = tag_for(m, t, 0);
        write_token(h, table[t / BLOCK_TOKENS], t % BLOCK_TOKENS, m->tag[t]);
    }
    return 1;
}

/* Decoding through the older call: no keys, so a sequence that keeps its chain loses it when
 * the append fills a block. */
static void op_append(harness *h, input *in) {
    size_t i = next_byte(in) % h->nlive;
    uint32_t add = next_byte(in) % 9 + 1;
    model_seq *m = &h->live[i];
    uint32_t old_len = blocks_for(m->tokens);
    uint32_t before[MAX_BLOCKS];
    memcpy(before, read_table(h, m), old_len * sizeof *before);
    kva_kv_copy copy;
    memset(&copy, 0x5a, sizeof copy);
    const kva_kv_copy untouched = copy;
    before_call pre;
    snapshot(h, &pre);
    kva_status st = kva_kv_seq_append(h->kv, m->handle, add, &copy);
    if (!model_extend(h, i, add, 0, st, &copy, &pre, before)) { /* nothing changed */
        ORACLE(memcmp(&copy, &untouched, sizeof copy) == 0);
        ORACLE(table_equal(read_table(h, m), before, old_len));
    }
}

/* Decoding with the keys of the blocks the new tokens fill (for a sequence that keeps its
 * chain; a byte may withhold them), one or two sequences, singly or in a batch. */
static void op_extend(harness *h, input *in) {
    unsigned how = next_byte(in);
    size_t pick[2] = {next_byte(in) % h->nlive, next_byte(in) % h->nlive};
    uint32_t count = how % 2 && pick[0] != pick[1] ? 2 : 1, add[2], items[2];
    int given[2];
    uint64_t keys[2 * MAX_BLOCKS], offsets[3] = {0};
    uint8_t bytes[2 * 4 * KVA_KV_MAX_KEY_BYTES];
    kva_kv_seq handles[2];
    uint32_t space = h->live[pick[0]].space, before[2][MAX_BLOCKS];
    for (uint32_t r = 0; r < count; r++) {
        model_seq *m = &h->live[pick[r]];
        memcpy(before[r], read_table(h, m), blocks_for(m->tokens) * sizeof **before);
        add[r] = next_byte(in) % 9 + 1;
        if (m->tokens + add[r] > MAX_TOKENS) add[r] = MAX_TOKENS - m->tokens;
        given[r] = m->keyed && !m->is_pin && m->space == space && next_byte(in) % 4 != 0;
        uint32_t first = m->tokens / BLOCK_TOKENS, end = (m->tokens + add[r]) / BLOCK_TOKENS;
        items[r] = given[r] ? end - first : 0;
        given[r] &= items[r] != 0;
        /* The keys the new blocks take, as the model will have them (extend_path). */
        uint8_t path[MAX_BLOCKS];
        memcpy(path, m->path, first + 1 <= MAX_BLOCKS ? first + 1 : MAX_BLOCKS);
        for (uint32_t pos = first + 1; pos <= end && pos < MAX_BLOCKS; pos++) path[pos] = next_key(m, pos);
        for (uint32_t pos = first; pos < first + items[r]; pos++) {
            keys[offsets[r] + pos - first] = path[pos];
            if (space_len(space))
                engine_key(path, pos + 1, space_len(space), bytes + (offsets[r] + pos - first) * space_len(space));
        }
        offsets[r + 1] = offsets[r] + items[r];
        handles[r] = m->handle;
    }
    kva_kv_content c = {.kind = space_len(space) ? KVA_KV_KEY_BYTES : KVA_KV_KEY_U64,
                        .key_len = space_len(space),
                        .keys = keys,
                        .key_bytes = bytes};
    kva_kv_copy copies[2];
    memset(copies, 0x5a, sizeof copies);
    uint32_t done = UINT32_MAX;
    kva_status st[2] = {KVA_OK, KVA_OK};
    before_call pre;
    snapshot(h, &pre);
    if (count == 1 && how / 2 % 2) {
        st[0] = kva_kv_seq_extend(h->kv, handles[0], add[0], &c, items[0], &copies[0]);
        done = st[0] == KVA_OK;
    } else if (!h->live[pick[0]].is_pin && (count == 1 || !h->live[pick[1]].is_pin)) {
        kva_kv_block_copy out[2];
        uint32_t ncopies = UINT32_MAX;
        ORACLE(kva_kv_seq_extend_many(h->kv, count, handles, add, &c, offsets, out, &ncopies, &done) == KVA_OK);
        for (uint32_t r = 0, k = 0; r < count; r++) {
            copies[r] = (kva_kv_copy){KVA_KV_NO_BLOCK, KVA_KV_NO_BLOCK, 0, 0, 0, NULL, NULL};
            if (k < ncopies && out[k].request == r)
                copies[r].src_block = out[k].src_block, copies[r].dst_block = out[k].dst_block,
                copies[r].tokens = out[k].tokens, k++;
        }
        if (done < count) st[done] = KVA_ERR_NOMEM;
    } else { /* a pin in the batch: refused as a whole */
        uint32_t ncopies = UINT32_MAX;
        kva_kv_block_copy out[2];
        ORACLE(kva_kv_seq_extend_many(h->kv, count, handles, add, &c, offsets, out, &ncopies, &done) ==
                   KVA_ERR_INVALID &&
               done == UINT32_MAX && ncopies == UINT32_MAX);
        return;
    }
    for (uint32_t r = 0; r < count && r <= done; r++)
        if (!model_extend(h, pick[r], add[r], given[r], st[r], &copies[r], &pre, before[r])) break;
}

/* A fork shares the parent's table entry for entry (and its chain); it writes under its own id
 * from now on. */
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

/* Frees one sequence or pin, or two sequences with kva_kv_seq_free_many. */
static void op_release(harness *h, input *in) {
    size_t i = next_byte(in) % h->nlive, j = next_byte(in) % h->nlive;
    int two = next_byte(in) % 2 && i != j && !h->live[i].is_pin && !h->live[j].is_pin;
    const uint32_t *tables[MAX_SEQS];
    before_call pre;
    read_tables(h, tables);
    snapshot(h, &pre);
    uint8_t *refs = pre.refs;
    uint32_t table[2][MAX_BLOCKS];
    memcpy(table[0], tables[i], blocks_for(h->live[i].tokens) * sizeof **table);
    memcpy(table[1], tables[j], blocks_for(h->live[j].tokens) * sizeof **table);
    if (two) {
        kva_kv_seq pair[2] = {h->live[i].handle, h->live[j].handle};
        ORACLE(kva_kv_seq_free_many(h->kv, 2, pair) == KVA_OK);
    } else {
        model_seq *m = &h->live[i];
        ORACLE((m->is_pin ? kva_kv_unpin(h->kv, m->handle) : kva_kv_seq_free(h->kv, m->handle)) == KVA_OK);
    }
    model_release(h, table[0], blocks_for(h->live[i].tokens), refs);
    if (two) model_release(h, table[1], blocks_for(h->live[j].tokens), refs);
    if (two && j > i) model_remove(h, j);
    model_remove(h, i);
    if (two && j < i) model_remove(h, j);
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
    ORACLE(kva_kv_seq_free_many(h->kv, 1, &stale) != KVA_OK);
    ORACLE(kva_kv_seq_append(h->kv, stale, 1, &copy) != KVA_OK);
    ORACLE(kva_kv_seq_block_table(h->kv, stale, &table, &len) != KVA_OK);
    ORACLE(kva_kv_seq_fork(h->kv, stale, &child) != KVA_OK);
    kva_kv_get_stats(h->kv, &after);
    ORACLE(after.used_blocks == before.used_blocks && after.free_blocks == before.free_blocks);
}

/* ---- the block calls ------------------------------------------------------------------------- */

/* The engine takes up to four blocks; each holds one reference of the engine's. */
static void op_take(harness *h, input *in) {
    uint32_t count = next_byte(in) % 5, priority = next_byte(in) % KVA_KV_PRIORITIES, ids[4];
    before_call pre;
    snapshot(h, &pre);
    memset(ids, 0x5a, sizeof ids);
    kva_status st = kva_kv_block_take(h->kv, count, priority, ids);
    ORACLE(st == (count <= pre.spare + model_count(h, pre.refs, 1) ? KVA_OK : KVA_ERR_NOMEM));
    if (st != KVA_OK) {
        ORACLE(ids[0] == 0x5a5a5a5au);
        return;
    }
    take_blocks(h, &pre, count);
    for (uint32_t k = 0; k < count; k++) {
        ORACLE(ids[k] < h->info.num_blocks);
        model_take(h, ids[k], priority);
        h->block[ids[k]].loose = 1;
    }
}

/* Up to three blocks only the engine holds, stamped with their keys' tags and committed as a
 * chain of engine keys, which may continue a key the input names. */
static void op_commit(harness *h, input *in) {
    uint32_t want = next_byte(in) % 3 + 1, from = next_byte(in) % h->info.num_blocks, start = next_byte(in) % 3;
    uint32_t space = space_of(next_byte(in) % NAMESPACES, engine_lengths[next_byte(in) % 2]), len = space_len(space);
    uint8_t path[8];
    for (uint32_t j = 0; j < start + want; j++) path[j] = (uint8_t)(next_byte(in) % 4);
    before_call pre;
    snapshot(h, &pre);
    uint32_t run[3], n = 0;
    for (uint32_t k = 0; k < h->info.num_blocks && n < want; k++) {
        uint32_t b = (from + k) % h->info.num_blocks;
        if (h->block[b].loose && pre.refs[b] == h->block[b].loose && !h->block[b].registered) run[n++] = b;
    }
    if (!n) return;
    uint8_t keys[3 * KVA_KV_MAX_KEY_BYTES], parent[KVA_KV_MAX_KEY_BYTES];
    for (uint32_t j = 0; j < n; j++) {
        engine_key(path, start + j + 1, len, keys + j * len);
        for (uint32_t t = (start + j) * BLOCK_TOKENS; t < (start + j + 1) * BLOCK_TOKENS; t++)
            write_token(h, run[j], t % BLOCK_TOKENS, keyed_tag(space, path, t));
    }
    engine_key(path, start, len, parent);
    uint32_t registered[3];
    ORACLE(kva_kv_block_commit(h->kv, space_ns(space), run, n, keys, len, start ? parent : NULL, start * BLOCK_TOKENS,
                               registered) == KVA_OK);
    for (uint32_t j = 0; j < n; j++) {
        uint32_t holder = model_lookup(h, space, path, start + j + 1);
        ORACLE(registered[j] == (holder == KVA_KV_NO_BLOCK ? run[j] : holder));
        model_commit(h, run[j], space, path, start + j + 1);
    }
}

/* Drops up to four of the engine's references in the input's order; now and then one more that
 * the engine does not hold, which is refused with nothing changed. */
static void op_unref(harness *h, input *in) {
    uint32_t want = next_byte(in) % 4 + 1, ids[5], n = 0, taken[MAX_BLOCKS] = {0};
    for (uint32_t k = 0; k < want; k++) {
        uint32_t b = next_byte(in) % h->info.num_blocks;
        if (taken[b] < h->block[b].loose) ids[n++] = b, taken[b]++;
    }
    before_call pre;
    snapshot(h, &pre);
    uint8_t *refs = pre.refs;
    uint32_t bad = next_byte(in) % h->info.num_blocks;
    if (next_byte(in) % 4 == 0 && taken[bad] == h->block[bad].loose) {
        ids[n] = bad;
        kva_kv_stats before, after;
        kva_kv_get_stats(h->kv, &before);
        kva_status st = kva_kv_block_unref(h->kv, ids, n + 1);
        ORACLE(st == (refs[bad] > h->block[bad].loose ? KVA_ERR_INVALID : KVA_ERR_DOUBLE_FREE));
        kva_kv_get_stats(h->kv, &after);
        ORACLE(after.used_blocks == before.used_blocks && after.cached_blocks == before.cached_blocks &&
               after.free_blocks == before.free_blocks);
        return;
    }
    if (!n) return;
    ORACLE(kva_kv_block_unref(h->kv, ids, n) == KVA_OK);
    for (uint32_t k = 0; k < n; k++) {
        h->block[ids[k]].loose--;
        refs[ids[k]]--;
        model_released(h, ids[k], refs);
    }
}

/* The engine's other calls on blocks: a touch, eviction by block or by key, a reset. */
static void op_block_misc(harness *h, input *in) {
    unsigned what = next_byte(in) % 8;
    before_call pre;
    snapshot(h, &pre);
    if (what < 3) { /* touch: a block that holds something (a trimmed one does not) */
        uint32_t b = next_byte(in) % h->info.num_blocks;
        int holds = pre.refs[b] || h->block[b].registered;
        ORACLE(kva_kv_block_ref(h->kv, &b, 1) == (holds ? KVA_OK : KVA_ERR_INVALID));
        if (holds) h->block[b].loose++;
    } else if (what < 5) { /* by block */
        uint32_t ids[2] = {next_byte(in) % h->info.num_blocks, next_byte(in) % h->info.num_blocks}, evicted = 0, n = 0;
        ORACLE(kva_kv_evict_blocks(h->kv, ids, 2, &evicted) == KVA_OK);
        for (uint32_t k = 0; k < 2; k++)
            if (h->block[ids[k]].registered) model_forget(h, ids[k]), n++;
        ORACLE(evicted == n);
    } else if (what < 7) { /* by key */
        uint32_t space = space_of(next_byte(in) % NAMESPACES, engine_lengths[next_byte(in) % 2]);
        uint32_t depth = next_byte(in) % 3 + 1, evicted = UINT32_MAX;
        uint8_t path[3], key[KVA_KV_MAX_KEY_BYTES];
        for (uint32_t j = 0; j < depth; j++) path[j] = (uint8_t)(next_byte(in) % 4);
        engine_key(path, depth, space_len(space), key);
        ORACLE(kva_kv_evict_keys(h->kv, space_ns(space), key, space_len(space), 1, &evicted) == KVA_OK);
        uint32_t b = model_lookup(h, space, path, depth);
        ORACLE(evicted == (b != KVA_KV_NO_BLOCK));
        if (b != KVA_KV_NO_BLOCK) model_forget(h, b);
    } else { /* reset */
        ORACLE(kva_kv_reset_prefix_cache(h->kv) == KVA_OK);
        for (uint32_t b = 0; b < h->info.num_blocks; b++)
            if (h->block[b].registered) h->block[b].registered = 0, h->evictions++;
        model_event_push(h, KVA_KV_EVENT_CLEARED, KVA_KV_NO_BLOCK, 0, NULL, 0, 0);
    }
}

static void op_events(harness *h, input *in) { drain_events(h, next_byte(in) % EVENTS + 1); }

/* ---- compaction and eviction ----------------------------------------------------------------- */

/* The moves of a compaction into n data blocks: each from an id >= n to a hole < n that no
 * table named and the engine did not hold (it was free), sources and destinations each
 * ascending (lowest to lowest), so no id is both. */
UNGUIDED static void check_moves(const harness *h, const kva_kv_move *moves, uint32_t count, uint32_t n,
                                 const uint8_t *named_before) {
    for (uint32_t k = 0; k < count; k++) {
        const kva_kv_move *mv = &moves[k];
        ORACLE(mv->dst_block < mv->src_block && mv->dst_block < n && mv->src_block >= n);
        ORACLE(mv->src_block < h->info.num_blocks && !named_before[mv->dst_block] && !h->block[mv->dst_block].loose);
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

/* Compaction as the engine runs it: ask the size, compact, copy every move (renaming the blocks
 * it holds itself), then trim. The sources are free at once (poisoned with the other free
 * blocks after the op), so a table the cache did not rewrite, or a move it did not report, is
 * caught by the content check (the other free blocks were free before, so nothing may name
 * them: check_sharing sees to that); trimming must not take memory from any block that holds
 * data, and the trimmed blocks are exactly the free ones above it. */
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
    for (uint32_t k = 0; k < count; k++) { /* a moved block keeps its key, references, priority, LRU place */
        ORACLE(!h->block[moves[k].dst_block].registered);
        h->block[moves[k].dst_block] = h->block[moves[k].src_block];
        h->block[moves[k].src_block].registered = 0;
        h->block[moves[k].src_block].loose = 0;
    }
    check_renamed(h, (const uint32_t(*)[MAX_BLOCKS])before, array, moves, count, n);

    kva_kv_stats after;
    kva_kv_get_stats(h->kv, &after);
    ORACLE(after.used_blocks + after.cached_blocks == n && after.free_blocks == st.free_blocks);
    ORACLE(kva_kv_trim(h->kv, &trimmed) == KVA_OK);
    ORACLE(trimmed == after.free_blocks + after.trimmed_blocks);
}

/* Eviction on request: as many as asked and cached, the model's victims. */
static void op_evict(harness *h, input *in) {
    before_call pre;
    snapshot(h, &pre);
    uint32_t asked = next_byte(in) % 8, cached = model_count(h, pre.refs, 1), evicted = UINT32_MAX;
    ORACLE(kva_kv_evict(h->kv, asked, &evicted) == KVA_OK);
    ORACLE(evicted == (asked < cached ? asked : cached));
    model_evict(h, pre.refs, evicted);
}

/* Every backed block the model holds free is poisoned: a table or a hit still reaching it
 * would read the poison. */
UNGUIDED static void poison_free(const harness *h, const uint32_t *const *tables) {
    uint8_t refs[MAX_BLOCKS];
    count_refs(h, tables, refs);
    kva_kv_stats st;
    kva_kv_get_stats(h->kv, &st);
    for (uint32_t b = 0; b < st.num_blocks - st.trimmed_blocks; b++)
        if (!refs[b] && !h->block[b].registered) poison_block(h, b);
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
    poison_free(h, tables);
    check_all(h, tables);
    check_prefix_model(h, tables);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input in = {data, size, 0};
    harness *h = &H;
    h->nlive = h->ndead = 0;
    h->next_id = 0;
    memset(h->block, 0, sizeof h->block);
    h->clock = h->evictions = h->hit_tokens = h->dropped = 0;
    h->readmit_hit_tokens = h->readmit_query_tokens = 0;
    h->ring_head = h->ring_count = h->nlearned = 0;
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = LAYERS, cfg.kv_heads = 1, cfg.head_dim = 4, cfg.block_tokens = BLOCK_TOKENS;
    cfg.num_blocks = 32 + next_byte(&in) % 32;
    unsigned shape = next_byte(&in);
    cfg.layout = shape & 1 ? KVA_KV_LAYOUT_BLOCKS : KVA_KV_LAYOUT_LAYERS;
    /* Half the runs: a K/V layer beside an MLA layer of another width (groups of two shapes). */
    static const kva_kv_group hybrid[] = {{.layers = 1, .parts = 2, .kv_heads = 1, .head_dim = 4},
                                          {.layers = LAYERS - 1, .parts = 1, .kv_heads = 1, .head_dim = 12}};
    if (shape & 2) {
        cfg.layers = cfg.kv_heads = cfg.head_dim = 0;
        cfg.groups = hybrid;
        cfg.num_groups = 2;
    }
    cfg.pages = KVA_PAGES_SMALL;
    cfg.max_key_bytes = KVA_KV_MAX_KEY_BYTES;
    cfg.event_capacity = EVENTS;
    cfg.event_medium = KVA_KV_MEDIUM_STORAGE;
    ORACLE(kva_kv_create(&cfg, NULL, &h->kv) == KVA_OK);
    ORACLE(kva_kv_get_info(h->kv, &h->info) == KVA_OK);
    map_blocks(h);

    while (in.at < in.size) {
        unsigned op = next_byte(&in) % 16;
        if (op <= 1 && h->nlive < MAX_SEQS) op_prompt(h, &in, op == 1);
        else if (op == 2 && h->nlive) op_append(h, &in);
        else if (op == 3 && h->nlive && h->nlive < MAX_SEQS) op_fork(h, &in);
        else if (op <= 5 && h->nlive) op_release(h, &in);
        else if (op == 6 && h->ndead) op_stale(h, &in);
        else if (op == 7 && next_byte(&in) % 2 == 0) op_evict(h, &in);
        else if (op == 7) op_compact(h);
        else if (op == 8 && h->nlive + 1 < MAX_SEQS) op_admit(h, &in);
        else if (op == 9 && h->nlive) op_extend(h, &in);
        else if (op == 10) op_take(h, &in);
        else if (op == 11) op_commit(h, &in);
        else if (op == 12) op_unref(h, &in);
        else if (op == 13) op_block_misc(h, &in);
        else if (op == 14) op_events(h, &in);
        check_step(h);
    }
    drain_events(h, EVENTS);
    for (size_t i = 0; i < h->nlive; i++)
        ORACLE((h->live[i].is_pin ? kva_kv_unpin(h->kv, h->live[i].handle)
                                  : kva_kv_seq_free(h->kv, h->live[i].handle)) == KVA_OK);
    for (uint32_t b = 0; b < h->info.num_blocks; b++)
        for (; h->block[b].loose; h->block[b].loose--) ORACLE(kva_kv_block_unref(h->kv, &b, 1) == KVA_OK);
    /* With every sequence and reference gone, each block the model holds registered is cached:
     * all go. */
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
