/*
 * kv_seq.c — the sequence calls: allocate with prefix lookup and registration, append with copy
 * on write, fork, free, pins, block tables. Paged mode is here; contiguous mode is kv_contig.c.
 *
 * Every call checks everything first, then counts the blocks it needs against the free and
 * evictable ones and reserves host memory for the table, and only then changes state, so a
 * failure changes nothing. The per-block work of a call is a loop of O(1) steps under one lock.
 *
 * Each public function checks the cache pointer, then runs its static *_locked implementation
 * between kv_lock and kv_unlock: the cache's lock is held for the whole call and released on
 * every return path.
 */
#include <string.h>

#include "kv_cache.h"

#define INVALID(...) kv_reject(kv, kva_fail(KVA_ERR_INVALID, __VA_ARGS__))

/* The content of a request's first full blocks: caller keys or token ids, or nothing. */
typedef struct kv_content {
    const uint64_t *keys;
    const uint32_t *tokens;
    uint32_t blocks;    /* full blocks whose content is given */
    uint32_t token_ids; /* token ids given (their whole blocks are the content) */
    uint32_t ns;
} kv_content;

KVA_INLINE kva_kv_key content_digest(const kva_kv *kv, const kv_content *c, uint32_t i) {
    if (c->keys) return kv_digest_caller(c->keys[i]);
    return kv_digest_tokens(c->tokens + (size_t)i * kv->block_tokens, kv->block_tokens);
}

/* Checks the content arguments shared by allocation and pins. */
static kva_status content_check(kva_kv *kv, const uint64_t *keys, uint32_t num_keys, const uint32_t *tokens,
                                uint32_t num_token_ids, uint32_t ns, kv_content *out) {
    if (!keys && num_keys) return INVALID("block_keys is NULL but num_keys is %u", num_keys);
    if (!tokens && num_token_ids) return INVALID("tokens is NULL but num_token_ids is %u", num_token_ids);
    if (num_keys && num_token_ids) return INVALID("give block keys or token ids, not both");
    if (kv->info.mode != KVA_KV_PAGED && (num_keys || num_token_ids))
        return INVALID("prefix keys need paged mode; this cache is contiguous");
    out->keys = num_keys ? keys : NULL;
    out->tokens = num_token_ids ? tokens : NULL;
    out->blocks = num_keys ? num_keys : num_token_ids / kv->block_tokens;
    out->token_ids = num_token_ids;
    out->ns = ns;
    return KVA_OK;
}

/* Blocks looked up per round: their keys are computed first (they depend only on the content),
 * then their buckets and records load in parallel, so a long prefix in a large cache waits on
 * memory about once per round instead of twice per block. */
#define KV_PROBE_BATCH 16

/* Looks the given blocks up in order, stopping at the first miss. The hits go to
 * table[0 .. hits); *key receives the last hit's key (the root if none) and *cached_hits how
 * many hits are CACHED (they leave the LRU lists when referenced). Changes nothing else. */
static uint32_t prefix_probe(const kva_kv *kv, const kv_content *c, uint32_t *table, kva_kv_key *key,
                             uint32_t *cached_hits) {
    kva_kv_key at = kv->root;
    uint32_t hits = 0, cached = 0;
    while (hits < c->blocks) {
        kva_kv_key keys[KV_PROBE_BATCH];
        uint32_t heads[KV_PROBE_BATCH];
        uint32_t n = c->blocks - hits < KV_PROBE_BATCH ? c->blocks - hits : KV_PROBE_BATCH;
        kva_kv_key k = at;
        for (uint32_t j = 0; j < n; j++) {
            k = kv_key_chain(k, content_digest(kv, c, hits + j), c->ns);
            keys[j] = k;
            __builtin_prefetch(&kv->buckets[k.lo & kv->bucket_mask]);
        }
        for (uint32_t j = 0; j < n; j++) {
            heads[j] = kv->buckets[keys[j].lo & kv->bucket_mask];
            if (heads[j] != KVA_NIL) {
                __builtin_prefetch(&kv->blocks[heads[j]]);
                __builtin_prefetch((const char *)&kv->blocks[heads[j]] + sizeof(kva_kv_block) - 1);
            }
        }
        for (uint32_t j = 0; j < n; j++) {
            uint32_t b = kv_prefix_find_from(kv, heads[j], keys[j], c->ns);
            if (b == KVA_NIL) goto done;
            table[hits++] = b;
            if (kv->blocks[b].state == KV_CACHED) {
                /* The hit takes it off its LRU list (kv_block_ref): its entry starts loading. */
                uint32_t slot = kv->blocks[b].lru_slot;
                __builtin_prefetch(&kv->lru_ids[slot], 1);
                __builtin_prefetch(&kv->lru_segs[slot / KV_LRU_SEG], 1);
                cached++;
            }
            at = keys[j];
        }
    }
done:
    *key = at;
    *cached_hits = cached;
    return hits;
}

/* The live sequence a handle names, for every call but free: a freed one is simply invalid. */
static kva_kv_seqrec *live_seq(kva_kv *kv, kva_kv_seq seq, kva_status *st) {
    kva_kv_seqrec *rec = kv_seq_lookup(kv, seq, st);
    if (!rec && *st == KVA_ERR_DOUBLE_FREE)
        *st = kva_fail(KVA_ERR_INVALID, "sequence %#llx was freed", (unsigned long long)seq);
    if (!rec) kv_reject(kv, *st);
    return rec;
}

static kva_status no_room(kva_kv *kv, uint32_t need, uint32_t available, const char *what) {
    kv->counters.alloc_failures++;
    return kva_fail(KVA_ERR_NOMEM, "%s needs %u new blocks; %u are free or evictable (of %u)", what, need,
                    available, kv->num_blocks);
}

static kva_status paged_allocate(kva_kv *kv, uint32_t num_tokens, const kv_content *c, uint8_t priority,
                                 kva_kv_seq *seq, uint32_t *cached_tokens) {
    uint32_t bt = kv->block_tokens;
    uint32_t full = num_tokens / bt;
    uint64_t blocks = ((uint64_t)num_tokens + bt - 1) / bt;
    if (c->keys && c->blocks > full)
        return INVALID("%u block keys but %u tokens fill only %u blocks of %u", c->blocks, num_tokens, full, bt);
    if (c->token_ids > num_tokens)
        return INVALID("%u token ids for a sequence of %u tokens", c->token_ids, num_tokens);
    if (blocks > kv->num_blocks) return no_room(kv, (uint32_t)blocks, kv->num_blocks, "the sequence");

    kva_kv_seqrec *rec = kv_seq_reserve(kv, (uint32_t)blocks);
    if (!rec) {
        kv->counters.alloc_failures++;
        return KVA_ERR_NOMEM;
    }
    uint32_t *table = rec->table;
    kva_kv_key key;
    uint32_t cached_hits;
    uint32_t hits = prefix_probe(kv, c, table, &key, &cached_hits);
    uint32_t need = (uint32_t)blocks - hits, available = kv_blocks_available(kv) - cached_hits;
    if (need > available) return no_room(kv, need, available, "the sequence");
    kva_status backed = kv_ensure_backed(kv, need, kv->cached_count - cached_hits);
    if (backed != KVA_OK) return backed;

    for (uint32_t i = 0; i < hits; i++) kv_block_ref(kv, table[i], priority);
    kv_make_room(kv, need);
    kv_take(kv, table + hits, need, priority);
    for (uint32_t i = hits; i < c->blocks; i++) {
        key = kv_key_chain(key, content_digest(kv, c, i), c->ns);
        kv_prefix_register(kv, table[i], key, c->ns);
    }
    rec->len = (uint32_t)blocks;
    rec->num_tokens = num_tokens;
    rec->cached_tokens = hits * bt;
    rec->ns = c->ns;
    rec->priority = priority;
    rec->is_pin = 0;
    *seq = kv_seq_publish(kv, rec);
    if (cached_tokens) *cached_tokens = hits * bt;
    kv->counters.allocations++;
    kv->counters.query_tokens += num_tokens;
    kv->counters.hit_tokens += (uint64_t)hits * bt;
    return KVA_OK;
}

static kva_status seq_allocate_locked(kva_kv *kv, uint32_t num_tokens, const uint64_t *block_keys,
                                      uint32_t num_keys, const uint32_t *tokens, uint32_t num_token_ids,
                                      uint32_t namespace_id, uint32_t priority, kva_kv_seq *seq,
                                      uint32_t *cached_tokens) {
    kv_content c;
    kva_status st = content_check(kv, block_keys, num_keys, tokens, num_token_ids, namespace_id, &c);
    if (st != KVA_OK) return st;
    if (!seq) return INVALID("seq is NULL");
    if (priority >= KVA_KV_PRIORITIES) return INVALID("priority %u is not in 0..%d", priority, KVA_KV_PRIORITIES - 1);
    if (kv->info.mode == KVA_KV_CONTIGUOUS) {
        st = kv_contig_allocate(kv, num_tokens, priority, seq);
        if (st == KVA_OK && cached_tokens) *cached_tokens = 0;
        return st;
    }
    return paged_allocate(kv, num_tokens, &c, (uint8_t)priority, seq, cached_tokens);
}

kva_status kva_kv_seq_allocate(kva_kv *kv, uint32_t num_tokens, const uint64_t *block_keys, uint32_t num_keys,
                               const uint32_t *tokens, uint32_t num_token_ids, uint32_t namespace_id,
                               uint32_t priority, kva_kv_seq *seq, uint32_t *cached_tokens) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv);
    kva_status st = seq_allocate_locked(kv, num_tokens, block_keys, num_keys, tokens, num_token_ids, namespace_id,
                                        priority, seq, cached_tokens);
    kv_unlock(kv);
    return st;
}

/* ---- append ------------------------------------------------------------------------------- */

static kva_status paged_append(kva_kv *kv, kva_kv_seqrec *rec, uint32_t num_tokens, kva_kv_copy *copy) {
    uint32_t bt = kv->block_tokens;
    uint32_t new_tokens = rec->num_tokens + num_tokens;
    uint32_t new_len = (uint32_t)(((uint64_t)new_tokens + bt - 1) / bt);
    uint32_t fill = rec->num_tokens % bt;
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
    rec->len = new_len;
    rec->num_tokens = new_tokens;
    *copy = out;
    return KVA_OK;
}

static kva_status seq_append_locked(kva_kv *kv, kva_kv_seq seq, uint32_t num_tokens, kva_kv_copy *copy) {
    kva_status st;
    kva_kv_seqrec *rec = live_seq(kv, seq, &st);
    if (!rec) return st;
    if (!copy) return INVALID("copy is NULL");
    if (rec->is_pin) return INVALID("sequence %#llx is a pin; pins do not grow", (unsigned long long)seq);
    if ((uint64_t)rec->num_tokens + num_tokens > UINT32_MAX)
        return INVALID("%u + %u tokens exceed 2^32-1", rec->num_tokens, num_tokens);
    st = kv->info.mode == KVA_KV_CONTIGUOUS ? kv_contig_append(kv, rec, num_tokens, copy)
                                           : paged_append(kv, rec, num_tokens, copy);
    if (st == KVA_OK) kv->counters.appends++;
    return st;
}

kva_status kva_kv_seq_append(kva_kv *kv, kva_kv_seq seq, uint32_t num_tokens, kva_kv_copy *copy) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv);
    kva_status st = seq_append_locked(kv, seq, num_tokens, copy);
    kv_unlock(kv);
    return st;
}

/* ---- fork, free, pins --------------------------------------------------------------------- */

static kva_status seq_fork_locked(kva_kv *kv, kva_kv_seq seq, kva_kv_seq *child) {
    kva_status st;
    kva_kv_seqrec *parent = live_seq(kv, seq, &st);
    if (!parent) return st;
    if (!child) return INVALID("child is NULL");
    if (kv->info.mode != KVA_KV_PAGED || parent->is_pin) return INVALID("fork needs a paged sequence that is not a pin");
    size_t parent_slot = (size_t)(parent - kv->seqs);
    kva_kv_seqrec *rec = kv_seq_reserve(kv, parent->len);
    if (!rec) {
        kv->counters.alloc_failures++;
        return KVA_ERR_NOMEM;
    }
    parent = &kv->seqs[parent_slot]; /* reserving may have moved the slots */
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
    *child = kv_seq_publish(kv, rec);
    kv->counters.forks++;
    return KVA_OK;
}

kva_status kva_kv_seq_fork(kva_kv *kv, kva_kv_seq seq, kva_kv_seq *child) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv);
    kva_status st = seq_fork_locked(kv, seq, child);
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
    if (kv->info.mode == KVA_KV_CONTIGUOUS) kv_contig_release(kv, rec);
    else kv_release(kv, rec->table, rec->len);
    kv_seq_retire(kv, rec);
    if (!pin) kv->counters.frees++;
    return KVA_OK;
}

static kva_status release(kva_kv *kv, kva_kv_seq seq, int pin) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv);
    kva_status st = release_locked(kv, seq, pin);
    kv_unlock(kv);
    return st;
}

kva_status kva_kv_seq_free(kva_kv *kv, kva_kv_seq seq) { return release(kv, seq, 0); }

kva_status kva_kv_unpin(kva_kv *kv, kva_kv_seq pin) { return release(kv, pin, 1); }

static kva_status pin_locked(kva_kv *kv, const uint64_t *block_keys, uint32_t num_keys, const uint32_t *tokens,
                             uint32_t num_token_ids, uint32_t namespace_id, kva_kv_seq *pin, uint32_t *pinned_tokens) {
    kv_content c;
    kva_status st = content_check(kv, block_keys, num_keys, tokens, num_token_ids, namespace_id, &c);
    if (st != KVA_OK) return st;
    if (!pin) return INVALID("pin is NULL");
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("pins need paged mode");
    kva_kv_seqrec *rec = kv_seq_reserve(kv, c.blocks);
    if (!rec) {
        kv->counters.alloc_failures++;
        return KVA_ERR_NOMEM;
    }
    kva_kv_key key;
    uint32_t cached_hits;
    uint32_t hits = prefix_probe(kv, &c, rec->table, &key, &cached_hits);
    /* Priority 0 leaves each block's priority as it is. */
    for (uint32_t i = 0; i < hits; i++) kv_block_ref(kv, rec->table[i], 0);
    rec->len = hits;
    rec->num_tokens = hits * kv->block_tokens;
    rec->cached_tokens = rec->num_tokens;
    rec->ns = namespace_id;
    rec->priority = 0;
    rec->is_pin = 1;
    *pin = kv_seq_publish(kv, rec);
    if (pinned_tokens) *pinned_tokens = rec->num_tokens;
    return KVA_OK;
}

kva_status kva_kv_pin(kva_kv *kv, const uint64_t *block_keys, uint32_t num_keys, const uint32_t *tokens,
                      uint32_t num_token_ids, uint32_t namespace_id, kva_kv_seq *pin, uint32_t *pinned_tokens) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv);
    kva_status st = pin_locked(kv, block_keys, num_keys, tokens, num_token_ids, namespace_id, pin, pinned_tokens);
    kv_unlock(kv);
    return st;
}

/* ---- queries ------------------------------------------------------------------------------ */

static kva_status seq_block_table_locked(kva_kv *kv, kva_kv_seq seq, const uint32_t **table, uint32_t *len) {
    kva_status st;
    kva_kv_seqrec *rec = live_seq(kv, seq, &st);
    if (!rec) return st;
    if (!table || !len) return INVALID("table or len is NULL");
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("block tables need paged mode");
    *table = rec->table;
    *len = rec->len;
    return KVA_OK;
}

kva_status kva_kv_seq_block_table(kva_kv *kv, kva_kv_seq seq, const uint32_t **table, uint32_t *len) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv);
    kva_status st = seq_block_table_locked(kv, seq, table, len);
    kv_unlock(kv);
    return st;
}

static kva_status seq_get_info_locked(kva_kv *kv, kva_kv_seq seq, kva_kv_seq_info *out) {
    kva_status st;
    kva_kv_seqrec *rec = live_seq(kv, seq, &st);
    if (!rec) return st;
    if (!out) return INVALID("out is NULL");
    *out = (kva_kv_seq_info){
        .num_tokens = rec->num_tokens,
        .num_blocks = rec->len,
        .cached_tokens = rec->cached_tokens,
        .namespace_id = rec->ns,
        .priority = rec->priority,
        .is_pin = rec->is_pin,
        .bucket_tokens = rec->bucket_tokens,
        .buffer = rec->buffer,
    };
    return KVA_OK;
}

kva_status kva_kv_seq_get_info(kva_kv *kv, kva_kv_seq seq, kva_kv_seq_info *out) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv);
    kva_status st = seq_get_info_locked(kv, seq, out);
    kv_unlock(kv);
    return st;
}
