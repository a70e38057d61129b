/*
 * kv_seq.c — the sequence calls: admission with prefix lookup and registration, extension with
 * copy on write and the commit of the blocks decoding fills, fork, free, pins, block tables.
 * Paged mode is here; contiguous mode is kv_contig.c; the batch forms are kv_batch.c.
 *
 * Every call checks everything first, then counts the blocks it needs against the free and
 * evictable ones and reserves host memory for the table, and only then changes state, so a
 * failure changes nothing. The per-block work of a call is a loop of O(1) steps under one lock.
 *
 * Each public function checks the cache pointer, then runs its static *_locked implementation
 * between kv_lock and kv_unlock: the cache's lock is held for the whole call and released on
 * every return path.
 */
#include <stdlib.h>
#include <string.h>

#include "kv_cache.h"

#define INVALID(...) kv_reject(kv, kva_fail(KVA_ERR_INVALID, __VA_ARGS__))

kva_kv_seqrec *kv_live_seq(kva_kv *kv, kva_kv_seq seq, kva_status *st) {
    kva_kv_seqrec *rec = kv_seq_lookup(kv, seq, st);
    if (!rec && *st == KVA_ERR_DOUBLE_FREE)
        *st = kva_fail(KVA_ERR_INVALID, "sequence %#llx was freed", (unsigned long long)seq);
    if (!rec) kv_reject(kv, *st);
    return rec;
}

static kva_status no_room(kva_kv *kv, uint32_t need, uint32_t available, const char *what) {
    kv->counters.alloc_failures++;
    return kva_fail(KVA_ERR_NOMEM, "%s needs %u new blocks; %u are free or evictable (of %u)", what, need, available,
                    kv->num_blocks);
}

/* Whether content given at admission of num_tokens tokens, full blocks of them, covers the
 * whole sequence, so that it keeps its chain. */
static int keeps_chain(const kv_content *c, uint32_t num_tokens, uint32_t full) {
    if (c->kind == KVA_KV_KEY_TOKENS) return c->items == num_tokens;
    if (c->kind == KVA_KV_KEY_U64 || c->kind == KVA_KV_KEY_BYTES) return c->items == full;
    return 0;
}

/* Room for the tokens of a partial block in a slot; 0 (KVA_ERR_NOMEM recorded and counted) if
 * host memory runs out. */
static int partial_reserve(kva_kv *kv, kva_kv_seqrec *rec) {
    if (!rec->partial) rec->partial = malloc(kv->block_tokens * sizeof *rec->partial);
    if (rec->partial) return 1;
    kv->counters.alloc_failures++;
    kva_fail(KVA_ERR_NOMEM, "no host memory for %u token ids", kv->block_tokens);
    return 0;
}

/* The key a sequence holds for its last full block, the parent of its next one. */
static kv_ident chain_parent(const kva_kv_seqrec *rec) {
    if (rec->key_kind == KVA_KV_KEY_BYTES) return (kv_ident){{0, 0}, rec->ns, rec->last_key, rec->key_len};
    return kv_ident_library(rec->chain, rec->ns);
}

/* Takes id as the key of the sequence's last full block. */
static void chain_advance(kva_kv_seqrec *rec, const kv_ident *id) {
    if (rec->key_kind == KVA_KV_KEY_BYTES) {
        memcpy(rec->last_key, id->bytes, id->len);
        rec->has_last = 1;
    } else {
        rec->chain = id->key;
    }
}

/* Blocks committed per round of commit_given: 16 rounds were 10 % slower at 1.76M blocks, 64
 * no faster than 32. */
#define KV_COMMIT_ROUND 32

/*
 * Commits the given blocks [first, c->blocks) of a new sequence, table[i] under the key of given
 * block i, each chained on the one before (`parent`: the last hit, NULL for none); *end receives
 * the last one's key. In rounds: the round's keys are computed first (they depend only on the
 * content), their buckets and the taken blocks' records and key bytes start loading together,
 * then the bucket heads' records; the commits then find their lines in cache, instead of
 * waiting on two or three misses a block in a large cache.
 */
static void commit_given(kva_kv *kv, const kv_content *c, const uint32_t *table, uint32_t first, const kv_ident *parent,
                         kv_ident *end) {
    kv_ident ids[KV_COMMIT_ROUND];
    const int engine = c->kind == KVA_KV_KEY_BYTES;
    for (uint32_t i = first; i < c->blocks;) {
        uint32_t n = c->blocks - i < KV_COMMIT_ROUND ? c->blocks - i : KV_COMMIT_ROUND;
        kva_kv_key k = parent ? parent->key : kv->root;
        for (uint32_t j = 0; j < n; j++) {
            ids[j] = kv_content_ident(kv, c, i + j, k);
            k = ids[j].key;
            __builtin_prefetch(&kv->buckets[k.lo & kv->bucket_mask]);
            __builtin_prefetch(&kv->blocks[table[i + j]], 1);
            if (engine) __builtin_prefetch(kv_key_store(kv, table[i + j]), 1);
        }
        for (uint32_t j = 0; j < n; j++) {
            uint32_t head = kv->buckets[ids[j].key.lo & kv->bucket_mask];
            if (head == KVA_NIL) continue;
            __builtin_prefetch(&kv->blocks[head]);
            if (engine) __builtin_prefetch(kv_key_store(kv, head));
        }
        for (uint32_t j = 0; j < n; j++)
            kv_commit(kv, table[i + j], &ids[j], j ? &ids[j - 1] : parent, (i + j) * kv->block_tokens);
        /* The round's last key, which the next round chains on: copied once a round. */
        *end = ids[n - 1];
        parent = end;
        i += n;
    }
}

/* The implementations below are inlined into the single calls (a call boundary is a tenth of an
 * append) and wrapped for the batches (kv_batch.c). */

/* A priority argument of an admission: 0 .. KVA_KV_PRIORITIES-1, KVA_KV_AGAIN ORed in or not. */
KVA_INLINE kva_status priority_check(kva_kv *kv, uint32_t priority) {
    if ((priority & ~KVA_KV_AGAIN) >= KVA_KV_PRIORITIES)
        return INVALID("priority %u is not in 0..%d, KVA_KV_AGAIN (%#x) ORed in or not", priority,
                       KVA_KV_PRIORITIES - 1, KVA_KV_AGAIN);
    return KVA_OK;
}

KVA_INLINE kva_status admit_check(kva_kv *kv, uint32_t num_tokens, uint32_t priority, const kv_content *c) {
    kva_status st = priority_check(kv, priority);
    if (st != KVA_OK) return st;
    if (c->kind == KVA_KV_KEY_TOKENS && c->items > num_tokens)
        return INVALID("%u token ids for a sequence of %u tokens", c->items, num_tokens);
    /* A division only for keys: a request without content pays none. */
    if (c->kind != KVA_KV_KEY_TOKENS && c->items && c->items > num_tokens / kv->block_tokens)
        return INVALID("%u block keys but %u tokens fill only %u blocks of %u", c->items, num_tokens,
                       num_tokens / kv->block_tokens, kv->block_tokens);
    return KVA_OK;
}

KVA_INLINE kva_status admit(kva_kv *kv, uint32_t num_tokens, const kv_content *c, uint8_t flagged, kva_kv_seq *seq,
                            uint32_t *cached_tokens) {
    uint8_t priority = (uint8_t)(flagged & ~KVA_KV_AGAIN);
    uint32_t bt = kv->block_tokens, full = num_tokens / bt, blocks = full + (num_tokens % bt != 0); /* one division */
    if (blocks > kv->num_blocks) return no_room(kv, blocks, kv->num_blocks, "the sequence");
    int keyed = keeps_chain(c, num_tokens, full);

    kva_kv_seqrec *rec = kv_seq_reserve(kv, blocks);
    if (!rec) {
        kv->counters.alloc_failures++;
        return KVA_ERR_NOMEM;
    }
    if (keyed && c->kind == KVA_KV_KEY_TOKENS && !partial_reserve(kv, rec)) return KVA_ERR_NOMEM;
    uint32_t *table = rec->table;
    kv_ident last = kv_ident_library(kv->root, c->ns);
    uint32_t cached_hits = 0, hits = c->blocks ? kv_prefix_probe(kv, c, table, &last, &cached_hits) : 0;
    uint32_t need = blocks - hits, available = kv_blocks_available(kv) - cached_hits;
    if (need > available) return no_room(kv, need, available, "the sequence");
    kva_status backed = kv_ensure_backed(kv, need, kv->cached_count - cached_hits);
    if (backed != KVA_OK) return backed;

    for (uint32_t i = 0; i < hits; i++) kv_block_ref(kv, table[i], priority);
    kv_make_room(kv, need);
    kv_take(kv, table + hits, need, priority);
    kv_ident end = last;
    if (hits < c->blocks) commit_given(kv, c, table, hits, hits ? &last : NULL, &end);
    const kv_ident *parent = c->blocks ? &end : NULL;
    rec->len = blocks;
    rec->num_tokens = num_tokens;
    rec->cached_tokens = hits * bt;
    rec->ns = c->ns;
    rec->priority = priority;
    rec->is_pin = 0;
    rec->key_kind = (uint8_t)(keyed ? c->kind : KVA_KV_KEY_NONE);
    rec->key_len = (uint8_t)c->key_len;
    rec->chain = parent ? parent->key : kv->root;
    rec->has_last = 0;
    if (keyed && c->kind == KVA_KV_KEY_BYTES && full) chain_advance(rec, parent);
    if (keyed && c->kind == KVA_KV_KEY_TOKENS)
        memcpy(rec->partial, c->tokens + (size_t)full * bt, (num_tokens - full * bt) * sizeof *rec->partial);
    *seq = kv_seq_publish(kv, rec);
    if (cached_tokens) *cached_tokens = hits * bt;
    kv->counters.allocations++;
    kv->counters.query_tokens += num_tokens;
    kv->counters.hit_tokens += (uint64_t)hits * bt;
    if (flagged & KVA_KV_AGAIN) {
        kv->counters.readmit_query_tokens += num_tokens;
        kv->counters.readmit_hit_tokens += (uint64_t)hits * bt;
    }
    return KVA_OK;
}

kva_status kv_admit_check(kva_kv *kv, uint32_t num_tokens, uint32_t priority, const kv_content *c) {
    return admit_check(kv, num_tokens, priority, c);
}

kva_status kv_admit(kva_kv *kv, uint32_t num_tokens, const kv_content *c, uint8_t priority, kva_kv_seq *seq,
                    uint32_t *cached_tokens) {
    return admit(kv, num_tokens, c, priority, seq, cached_tokens);
}

/* Inlined into both entry points that admit (kva_kv_seq_admit and the older kva_kv_seq_allocate). */
KVA_INLINE kva_status admit_locked(kva_kv *kv, uint32_t num_tokens, uint64_t ns, uint32_t priority,
                                   const kva_kv_content *content, uint32_t count, kva_kv_seq *seq,
                                   uint32_t *cached_tokens) {
    kv_content c;
    kva_status st = kv_content_check(kv, content, count, ns, &c);
    if (st != KVA_OK) return st;
    if (!seq) return INVALID("seq is NULL");
    st = priority_check(kv, priority);
    if (st != KVA_OK) return st;
    if (kv->info.mode == KVA_KV_CONTIGUOUS) {
        st = kv_contig_allocate(kv, num_tokens, priority & ~KVA_KV_AGAIN, seq);
        if (st == KVA_OK && cached_tokens) *cached_tokens = 0;
        if (st == KVA_OK && (priority & KVA_KV_AGAIN)) kv->counters.readmit_query_tokens += num_tokens;
        return st;
    }
    kv_content_slice(kv, &c, 0, count);
    st = admit_check(kv, num_tokens, priority, &c);
    if (st != KVA_OK) return st;
    return admit(kv, num_tokens, &c, (uint8_t)priority, seq, cached_tokens);
}

kva_status kva_kv_seq_admit(kva_kv *kv, uint32_t num_tokens, uint64_t namespace_id, uint32_t priority,
                            const kva_kv_content *content, uint32_t count, kva_kv_seq *seq, uint32_t *cached_tokens) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_ALLOCATE);
    if (st == KVA_OK) st = admit_locked(kv, num_tokens, namespace_id, priority, content, count, seq, cached_tokens);
    kv_unlock(kv);
    return st;
}

/* The content of the older calls: caller keys or token ids, not both. */
static kva_status legacy_content(const uint64_t *keys, uint32_t num_keys, const uint32_t *tokens,
                                 uint32_t num_token_ids, kva_kv_content *out, uint32_t *count) {
    if (num_keys && num_token_ids) return kva_fail(KVA_ERR_INVALID, "give block keys or token ids, not both");
    *out = (kva_kv_content){.kind = num_keys        ? KVA_KV_KEY_U64
                                    : num_token_ids ? KVA_KV_KEY_TOKENS
                                                    : KVA_KV_KEY_NONE,
                            .tokens = tokens,
                            .keys = keys};
    *count = num_keys + num_token_ids;
    return KVA_OK;
}

kva_status kva_kv_seq_allocate(kva_kv *kv, uint32_t num_tokens, const uint64_t *block_keys, uint32_t num_keys,
                               const uint32_t *tokens, uint32_t num_token_ids, uint32_t namespace_id, uint32_t priority,
                               kva_kv_seq *seq, uint32_t *cached_tokens) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_kv_content content;
    uint32_t count = 0;
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_ALLOCATE);
    if (st == KVA_OK) {
        st = legacy_content(block_keys, num_keys, tokens, num_token_ids, &content, &count);
        st = st != KVA_OK ? kv_reject(kv, st)
                          : admit_locked(kv, num_tokens, namespace_id, priority, &content, count, seq, cached_tokens);
    }
    kv_unlock(kv);
    return st;
}

/* ---- extension ---------------------------------------------------------------------------- */

/* Blocks an extension of n tokens fills. */
static uint32_t blocks_filled(const kva_kv *kv, const kva_kv_seqrec *rec, uint32_t n) {
    return (uint32_t)(((uint64_t)rec->num_tokens + n) / kv->block_tokens - rec->num_tokens / kv->block_tokens);
}

KVA_INLINE kva_status extend_check(kva_kv *kv, const kva_kv_seqrec *rec, kva_kv_seq seq, uint32_t n,
                                   const kv_content *c) {
    if (rec->is_pin) return INVALID("sequence %#llx is a pin; pins do not grow", (unsigned long long)seq);
    if ((uint64_t)rec->num_tokens + n > UINT32_MAX) return INVALID("%u + %u tokens exceed 2^32-1", rec->num_tokens, n);
    if (rec->key_kind == KVA_KV_KEY_NONE || !c || c->items == 0) return KVA_OK; /* content not read */
    if (c->kind != rec->key_kind || c->key_len != (rec->key_kind == KVA_KV_KEY_BYTES ? rec->key_len : 0))
        return INVALID("content of kind %u (key_len %u) for sequence %#llx, keyed by kind %u (key_len %u)", c->kind,
                       c->key_len, (unsigned long long)seq, rec->key_kind, rec->key_len);
    uint32_t want = rec->key_kind == KVA_KV_KEY_TOKENS ? n : blocks_filled(kv, rec, n);
    if (c->items != want)
        return INVALID("%u content items for sequence %#llx; this extension needs %u (or 0)", c->items,
                       (unsigned long long)seq, want);
    return KVA_OK;
}

/* Registers table[i], which the sequence has just filled, under id (as a prompt's block). */
static void commit_filled_block(kva_kv *kv, kva_kv_seqrec *rec, uint32_t i, const kv_ident *id) {
    kv_ident parent = chain_parent(rec);
    kv_commit(kv, rec->table[i], id, i ? &parent : NULL, i * kv->block_tokens);
    chain_advance(rec, id);
}

/* Commits the blocks an extension of a chained sequence from old_tokens by n tokens filled, with
 * content c (checked: the tokens appended, or a key per filled block). Each filled block is the
 * sequence's own: a fresh block, or its partial last block, private once the extension has
 * copied it on write. */
static void commit_filled(kva_kv *kv, kva_kv_seqrec *rec, uint32_t old_tokens, uint32_t n, const kv_content *c) {
    uint32_t bt = kv->block_tokens, fill = old_tokens % bt, first = old_tokens / bt;
    uint32_t end = (uint32_t)(((uint64_t)old_tokens + n) / bt);
    if (c->kind != KVA_KV_KEY_TOKENS) {
        for (uint32_t i = first; i < end; i++) {
            kv_ident id = kv_content_ident(kv, c, i - first, rec->chain);
            commit_filled_block(kv, rec, i, &id);
        }
        return;
    }
    const uint32_t *src = c->tokens, *stop = c->tokens + n;
    for (uint32_t i = first; i < end; i++) {
        memcpy(rec->partial + fill, src, (bt - fill) * sizeof *src);
        src += bt - fill;
        fill = 0;
        kv_ident id = kv_ident_library(kv_key_chain(rec->chain, kv_digest_tokens(rec->partial, bt), rec->ns), rec->ns);
        commit_filled_block(kv, rec, i, &id);
    }
    memcpy(rec->partial + fill, src, (size_t)(stop - src) * sizeof *src);
}

KVA_INLINE kva_status extend(kva_kv *kv, kva_kv_seqrec *rec, uint32_t num_tokens, const kv_content *c,
                             kva_kv_copy *copy) {
    uint32_t bt = kv->block_tokens;
    uint32_t old_tokens = rec->num_tokens, new_tokens = old_tokens + num_tokens;
    uint32_t new_len = new_tokens / bt + (new_tokens % bt != 0);     /* one division */
    uint32_t fill = rec->len ? old_tokens - (rec->len - 1) * bt : 0; /* len = ceil(old_tokens / bt) */
    if (fill == bt) fill = 0;
    int cow = num_tokens != 0 && fill != 0 && kv->blocks[rec->table[rec->len - 1]].refs > 1;
    uint32_t need = new_len - rec->len + (uint32_t)cow, available = kv_blocks_available(kv);
    if (need > available) return no_room(kv, need, available, "the append");
    if (!kv_table_reserve(rec, new_len)) {
        kv->counters.alloc_failures++;
        return kva_fail(KVA_ERR_NOMEM, "no host memory for a table of %u blocks", new_len);
    }
    kva_status backed = kv_ensure_backed(kv, need, kv->cached_count);
    if (backed != KVA_OK) return backed;

    kva_kv_copy out = {KVA_KV_NO_BLOCK, KVA_KV_NO_BLOCK, 0, 0, 0, NULL, NULL};
    kv_make_room(kv, need);
    if (cow) {
        uint32_t src = rec->table[rec->len - 1], dst;
        kv_take(kv, &dst, 1, rec->priority);
        kv_release(kv, &src, 1); /* shared: it keeps its other references */
        rec->table[rec->len - 1] = dst;
        out.src_block = src;
        out.dst_block = dst;
        out.tokens = fill;
        kv->counters.cow_copies++;
    }
    kv_take(kv, rec->table + rec->len, new_len - rec->len, rec->priority);
    if (new_len != rec->len) kv->ns.rows[rec->ns_slot].blocks += new_len - rec->len; /* mostly not: no store */
    rec->len = new_len;
    if (rec->key_kind != KVA_KV_KEY_NONE) {
        if (c && c->items) commit_filled(kv, rec, old_tokens, num_tokens, c);
        else if (rec->key_kind == KVA_KV_KEY_TOKENS ? num_tokens != 0 : new_tokens / bt != old_tokens / bt)
            rec->key_kind = KVA_KV_KEY_NONE; /* what the new tokens hold is not known */
    }
    rec->num_tokens = new_tokens;
    *copy = out;
    return KVA_OK;
}

kva_status kv_extend_check(kva_kv *kv, const kva_kv_seqrec *rec, kva_kv_seq seq, uint32_t n, const kv_content *c) {
    return extend_check(kv, rec, seq, n, c);
}

kva_status kv_extend(kva_kv *kv, kva_kv_seqrec *rec, uint32_t num_tokens, const kv_content *c, kva_kv_copy *copy) {
    return extend(kv, rec, num_tokens, c, copy);
}

/* Inlined into both entry points that extend (kva_kv_seq_extend and kva_kv_seq_append). */
KVA_INLINE kva_status extend_locked(kva_kv *kv, kva_kv_seq seq, uint32_t num_tokens, const kva_kv_content *content,
                                    uint32_t count, kva_kv_copy *copy) {
    kva_status st;
    kva_kv_seqrec *rec = kv_live_seq(kv, seq, &st);
    if (!rec) return st;
    if (!copy) return INVALID("copy is NULL");
    kv_content c, *given = NULL; /* none: the decode step of an engine that keys nothing */
    if (content || count) {
        st = kv_content_check(kv, content, count, rec->ns, &c);
        if (st != KVA_OK) return st;
        kv_content_slice(kv, &c, 0, count);
        given = &c;
    }
    st = extend_check(kv, rec, seq, num_tokens, given);
    if (st != KVA_OK) return st;
    st = kv->info.mode == KVA_KV_CONTIGUOUS ? kv_contig_append(kv, rec, num_tokens, copy)
                                            : extend(kv, rec, num_tokens, given, copy);
    if (st == KVA_OK) kv->counters.appends++;
    return st;
}

kva_status kva_kv_seq_extend(kva_kv *kv, kva_kv_seq seq, uint32_t num_tokens, const kva_kv_content *content,
                             uint32_t count, kva_kv_copy *copy) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_APPEND);
    if (st == KVA_OK) st = extend_locked(kv, seq, num_tokens, content, count, copy);
    kv_unlock(kv);
    return st;
}

kva_status kva_kv_seq_append(kva_kv *kv, kva_kv_seq seq, uint32_t num_tokens, kva_kv_copy *copy) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_APPEND);
    if (st == KVA_OK) st = extend_locked(kv, seq, num_tokens, NULL, 0, copy);
    kv_unlock(kv);
    return st;
}

/* ---- fork, free, pins --------------------------------------------------------------------- */

static kva_status seq_fork_locked(kva_kv *kv, kva_kv_seq seq, kva_kv_seq *child) {
    kva_status st;
    kva_kv_seqrec *parent = kv_live_seq(kv, seq, &st);
    if (!parent) return st;
    if (!child) return INVALID("child is NULL");
    if (kv->info.mode != KVA_KV_PAGED || parent->is_pin)
        return INVALID("fork needs a paged sequence that is not a pin");
    size_t parent_slot = (size_t)(parent - kv->seqs);
    kva_kv_seqrec *rec = kv_seq_reserve(kv, parent->len);
    if (!rec) {
        kv->counters.alloc_failures++;
        return KVA_ERR_NOMEM;
    }
    parent = &kv->seqs[parent_slot]; /* reserving may have moved the slots */
    if (parent->key_kind == KVA_KV_KEY_TOKENS && !partial_reserve(kv, rec)) return KVA_ERR_NOMEM;
    for (uint32_t i = 0; i < parent->len; i++) {
        rec->table[i] = parent->table[i];
        kv_block_ref(kv, parent->table[i], parent->priority);
    }
    rec->len = parent->len;
    rec->num_tokens = parent->num_tokens;
    rec->cached_tokens = parent->cached_tokens;
    rec->ns = parent->ns;
    rec->priority = parent->priority;
    rec->is_pin = 0;
    /* The child holds the same content: it keeps the parent's chain. */
    rec->key_kind = parent->key_kind;
    rec->key_len = parent->key_len;
    rec->chain = parent->chain;
    rec->has_last = parent->has_last;
    memcpy(rec->last_key, parent->last_key, sizeof rec->last_key);
    if (parent->key_kind == KVA_KV_KEY_TOKENS)
        memcpy(rec->partial, parent->partial, parent->num_tokens % kv->block_tokens * sizeof *rec->partial);
    *child = kv_seq_publish(kv, rec);
    kv->counters.forks++;
    return KVA_OK;
}

kva_status kva_kv_seq_fork(kva_kv *kv, kva_kv_seq seq, kva_kv_seq *child) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK) st = seq_fork_locked(kv, seq, child);
    kv_unlock(kv);
    return st;
}

static kva_status release_locked(kva_kv *kv, kva_kv_seq seq, int pin) {
    kva_status st;
    kva_kv_seqrec *rec = kv_seq_lookup(kv, seq, &st);
    if (!rec) return kv_reject(kv, st);
    if (rec->is_pin != pin)
        return INVALID(pin ? "%#llx is a sequence, not a pin; use kva_kv_seq_free" : "%#llx is a pin; use kva_kv_unpin",
                       (unsigned long long)seq);
    kv_seq_release(kv, rec);
    return KVA_OK;
}

void kv_seq_release(kva_kv *kv, kva_kv_seqrec *rec) {
    if (kv->info.mode == KVA_KV_CONTIGUOUS) {
        kv_contig_release(kv, rec);
    } else {
        if (kva_unlikely(rec->is_pin)) kv_pin_drop(kv, rec->table, rec->len);
        kv_release(kv, rec->table, rec->len);
    }
    if (!rec->is_pin) kv->counters.frees++;
    kv_seq_retire(kv, rec);
}

static kva_status release(kva_kv *kv, kva_kv_seq seq, int pin) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_FREE);
    if (st == KVA_OK) st = release_locked(kv, seq, pin);
    kv_unlock(kv);
    return st;
}

kva_status kva_kv_seq_free(kva_kv *kv, kva_kv_seq seq) { return release(kv, seq, 0); }

kva_status kva_kv_unpin(kva_kv *kv, kva_kv_seq pin) { return release(kv, pin, 1); }

static kva_status pin_locked(kva_kv *kv, uint64_t ns, const kva_kv_content *content, uint32_t count, kva_kv_seq *pin,
                             uint32_t *pinned_tokens) {
    kv_content c;
    kva_status st = kv_content_check(kv, content, count, ns, &c);
    if (st != KVA_OK) return st;
    if (!pin) return INVALID("pin is NULL");
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("pins need paged mode");
    kv_content_slice(kv, &c, 0, count);
    kva_kv_seqrec *rec = kv_seq_reserve(kv, c.blocks);
    if (!rec) {
        kv->counters.alloc_failures++;
        return KVA_ERR_NOMEM;
    }
    kv_ident last;
    uint32_t cached_hits;
    uint32_t hits = kv_prefix_probe(kv, &c, rec->table, &last, &cached_hits);
    /* Priority 0 leaves each block's priority as it is. */
    for (uint32_t i = 0; i < hits; i++) kv_block_ref(kv, rec->table[i], 0);
    kv_pin_hold(kv, rec->table, hits);
    rec->len = hits;
    rec->num_tokens = hits * kv->block_tokens;
    rec->cached_tokens = rec->num_tokens;
    rec->ns = ns;
    rec->priority = 0;
    rec->is_pin = 1;
    rec->key_kind = KVA_KV_KEY_NONE;
    *pin = kv_seq_publish(kv, rec);
    if (pinned_tokens) *pinned_tokens = rec->num_tokens;
    return KVA_OK;
}

kva_status kva_kv_pin_content(kva_kv *kv, uint64_t namespace_id, const kva_kv_content *content, uint32_t count,
                              kva_kv_seq *pin, uint32_t *pinned_tokens) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK) st = pin_locked(kv, namespace_id, content, count, pin, pinned_tokens);
    kv_unlock(kv);
    return st;
}

kva_status kva_kv_pin(kva_kv *kv, const uint64_t *block_keys, uint32_t num_keys, const uint32_t *tokens,
                      uint32_t num_token_ids, uint32_t namespace_id, kva_kv_seq *pin, uint32_t *pinned_tokens) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_kv_content content;
    uint32_t count = 0;
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK) {
        st = legacy_content(block_keys, num_keys, tokens, num_token_ids, &content, &count);
        st = st != KVA_OK ? kv_reject(kv, st) : pin_locked(kv, namespace_id, &content, count, pin, pinned_tokens);
    }
    kv_unlock(kv);
    return st;
}

/* ---- queries ------------------------------------------------------------------------------ */

static kva_status seq_block_table_locked(kva_kv *kv, kva_kv_seq seq, const uint32_t **table, uint32_t *len) {
    kva_status st;
    kva_kv_seqrec *rec = kv_live_seq(kv, seq, &st);
    if (!rec) return st;
    if (!table || !len) return INVALID("table or len is NULL");
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("block tables need paged mode");
    *table = rec->table;
    *len = rec->len;
    return KVA_OK;
}

kva_status kva_kv_seq_block_table(kva_kv *kv, kva_kv_seq seq, const uint32_t **table, uint32_t *len) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv, KVA_KV_CALL_OTHER);
    kva_status st = seq_block_table_locked(kv, seq, table, len);
    kv_unlock(kv);
    return st;
}

static kva_status seq_get_info_locked(kva_kv *kv, kva_kv_seq seq, kva_kv_seq_info *out) {
    kva_status st;
    kva_kv_seqrec *rec = kv_live_seq(kv, seq, &st);
    if (!rec) return st;
    if (!out) return INVALID("out is NULL");
    *out = (kva_kv_seq_info){
        .num_tokens = rec->num_tokens,
        .num_blocks = rec->len,
        .cached_tokens = rec->cached_tokens,
        .namespace_id = (uint32_t)rec->ns,
        .namespace_hi = (uint32_t)(rec->ns >> 32),
        .priority = rec->priority,
        .is_pin = rec->is_pin,
        .bucket_tokens = rec->bucket_tokens,
        .buffer = rec->buffer,
    };
    return KVA_OK;
}

kva_status kva_kv_seq_get_info(kva_kv *kv, kva_kv_seq seq, kva_kv_seq_info *out) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv, KVA_KV_CALL_OTHER);
    kva_status st = seq_get_info_locked(kv, seq, out);
    kv_unlock(kv);
    return st;
}
