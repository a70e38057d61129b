/*
 * kv_lookup.c — content, the way a request names its blocks, and how it is matched against the
 * prefix table: checking content (its kind, array and key length), cutting a batch's content
 * into its requests, the prefix probe every admission, pin and lookup runs, and the lookups
 * themselves (kva_kv_lookup, kva_kv_lookup_many), which change nothing.
 *
 * A probe computes the keys of a round of blocks first (they depend only on the content), then
 * loads their buckets and records in parallel, so a long prefix in a large cache waits on memory
 * about once per round instead of twice per block.
 */
#include "kv_cache.h"

#define INVALID(...) kv_reject(kv, kva_fail(KVA_ERR_INVALID, __VA_ARGS__))

kva_status kv_content_check(kva_kv *kv, const kva_kv_content *content, uint64_t items, uint64_t ns, kv_content *out) {
    *out = (kv_content){.kind = KVA_KV_KEY_NONE, .ns = ns};
    if (!content)
        return items ? INVALID("content is NULL but %llu items are given", (unsigned long long)items) : KVA_OK;
    if (content->kind > KVA_KV_KEY_BYTES) return INVALID("unknown content kind %u", content->kind);
    if (content->kind == KVA_KV_KEY_NONE)
        return items ? INVALID("content of kind NONE with %llu items", (unsigned long long)items) : KVA_OK;
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("prefix keys need paged mode; this cache is contiguous");
    const void *array = content->kind == KVA_KV_KEY_TOKENS ? (const void *)content->tokens
                        : content->kind == KVA_KV_KEY_U64  ? (const void *)content->keys
                                                           : (const void *)content->key_bytes;
    if (!array && items) return INVALID("the content's array of its kind %u is NULL", content->kind);
    if (content->kind == KVA_KV_KEY_BYTES) {
        if (kv->max_key_bytes == 0) return INVALID("this cache takes no engine keys (created with max_key_bytes 0)");
        if (content->key_len == 0 || content->key_len > kv->max_key_bytes)
            return INVALID("key_len %u is not in 1 .. %u (max_key_bytes)", content->key_len, kv->max_key_bytes);
    }
    out->kind = content->kind;
    out->key_len = content->kind == KVA_KV_KEY_BYTES ? content->key_len : 0;
    /* Only the kind's array is read (and moved by kv_content_slice). */
    out->tokens = content->kind == KVA_KV_KEY_TOKENS ? content->tokens : NULL;
    out->keys = content->kind == KVA_KV_KEY_U64 ? content->keys : NULL;
    out->bytes = content->kind == KVA_KV_KEY_BYTES ? content->key_bytes : NULL;
    return KVA_OK;
}

kva_status kv_offsets_check(kva_kv *kv, const uint64_t *offsets, uint32_t count, uint64_t *total) {
    if (!offsets) return INVALID("offsets is NULL");
    if (offsets[0] != 0) return INVALID("offsets[0] is %llu, not 0", (unsigned long long)offsets[0]);
    for (uint32_t i = 0; i < count; i++)
        if (offsets[i + 1] < offsets[i] || offsets[i + 1] - offsets[i] > UINT32_MAX)
            return INVALID("request %u's items [%llu, %llu) are not a range of at most 2^32-1", i,
                           (unsigned long long)offsets[i], (unsigned long long)offsets[i + 1]);
    *total = offsets[count];
    return KVA_OK;
}

/* Blocks looked up per round. */
#define KV_PROBE_BATCH 16

/* Given block i's key, as the probe matches it: its 128 bits and, for engine keys, its bytes in
 * the content. */
KVA_INLINE kv_ident given_key(const kv_content *c, kva_kv_key key, uint32_t i, const int engine) {
    return (kv_ident){key, c->ns, engine ? c->bytes + (size_t)i * c->key_len : NULL, engine ? c->key_len : 0};
}

/* The probe for one kind of content, a constant, so that each kind compiles to its own loop with
 * nothing of the others'. Each round keeps only the 128-bit keys: a block's key as the table
 * matches it is rebuilt from them and the content where it is needed. */
KVA_INLINE uint32_t probe(const kva_kv *kv, const kv_content *c, uint32_t *table, kv_ident *last, uint32_t *cached_hits,
                          const uint32_t kind) {
    const int engine = kind == KVA_KV_KEY_BYTES;
    kva_kv_key at = kv->root; /* the last hit's key, what the next block chains on */
    uint32_t hits = 0, cached = 0;
    while (hits < c->blocks) {
        kva_kv_key keys[KV_PROBE_BATCH];
        uint32_t heads[KV_PROBE_BATCH];
        uint32_t n = c->blocks - hits < KV_PROBE_BATCH ? c->blocks - hits : KV_PROBE_BATCH;
        kva_kv_key k = at;
        for (uint32_t j = 0; j < n; j++) {
            k = kv_content_key(kv, c, hits + j, k, kind).key;
            keys[j] = k;
            __builtin_prefetch(&kv->buckets[k.lo & kv->bucket_mask]);
        }
        for (uint32_t j = 0; j < n; j++) {
            heads[j] = kv->buckets[keys[j].lo & kv->bucket_mask];
            if (heads[j] != KVA_NIL) {
                __builtin_prefetch(&kv->blocks[heads[j]]);
                __builtin_prefetch((const char *)&kv->blocks[heads[j]] + sizeof(kva_kv_block) - 1);
                if (engine) __builtin_prefetch(kv_key_store(kv, heads[j])); /* the compare reads it */
            }
        }
        for (uint32_t j = 0; j < n; j++) {
            kv_ident id = given_key(c, keys[j], hits, engine);
            uint32_t b = kv_prefix_find_from(kv, heads[j], &id);
            if (b == KVA_NIL) goto done;
            if (table) table[hits] = b;
            at = keys[j];
            hits++;
            if (kv->blocks[b].state == KV_CACHED) {
                /* A hit that references it takes it off its LRU list (kv_block_ref): its entry
                 * starts loading. */
                uint32_t slot = kv->blocks[b].lru_slot;
                __builtin_prefetch(&kv->lru_ids[slot], 1);
                __builtin_prefetch(&kv->lru_segs[slot / KV_LRU_SEG], 1);
                cached++;
            }
        }
    }
done:
    *last = hits ? given_key(c, at, hits - 1, engine) : kv_ident_library(kv->root, c->ns);
    *cached_hits = cached;
    return hits;
}

uint32_t kv_prefix_probe(const kva_kv *kv, const kv_content *c, uint32_t *table, kv_ident *last,
                         uint32_t *cached_hits) {
    switch (c->kind) {
    case KVA_KV_KEY_U64: return probe(kv, c, table, last, cached_hits, KVA_KV_KEY_U64);
    case KVA_KV_KEY_TOKENS: return probe(kv, c, table, last, cached_hits, KVA_KV_KEY_TOKENS);
    case KVA_KV_KEY_BYTES: return probe(kv, c, table, last, cached_hits, KVA_KV_KEY_BYTES);
    }
    *last = kv_ident_library(kv->root, c->ns); /* no content: no block given */
    *cached_hits = 0;
    return 0;
}

static kva_status lookup_locked(kva_kv *kv, uint64_t ns, const kva_kv_content *content, uint32_t count, uint32_t *ids,
                                uint32_t *hits) {
    kv_content c;
    kva_status st = kv_content_check(kv, content, count, ns, &c);
    if (st != KVA_OK) return st;
    if (!hits) return INVALID("hits is NULL");
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("lookups need paged mode; this cache is contiguous");
    kv_content_slice(kv, &c, 0, count);
    kv_ident last;
    uint32_t cached;
    *hits = kv_prefix_probe(kv, &c, ids, &last, &cached);
    return KVA_OK;
}

kva_status kva_kv_lookup(kva_kv *kv, uint64_t namespace_id, const kva_kv_content *content, uint32_t count,
                         uint32_t *ids, uint32_t *hits) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv, KVA_KV_CALL_LOOKUP);
    kva_status st = lookup_locked(kv, namespace_id, content, count, ids, hits);
    kv_unlock(kv);
    return st;
}

static kva_status lookup_many_locked(kva_kv *kv, uint32_t count, const uint64_t *namespaces,
                                     const kva_kv_content *content, const uint64_t *offsets, uint32_t *hits,
                                     uint32_t *ids) {
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("lookups need paged mode; this cache is contiguous");
    if (count && !hits) return INVALID("hits is NULL");
    if (!content || !offsets) return INVALID("content or offsets is NULL");
    uint64_t total;
    kva_status st = kv_offsets_check(kv, offsets, count, &total);
    kv_content all;
    if (st == KVA_OK) st = kv_content_check(kv, content, total, 0, &all);
    if (st != KVA_OK) return st;
    for (uint32_t i = 0; i < count; i++) {
        kv_content c = all;
        c.ns = namespaces ? namespaces[i] : 0;
        kv_content_slice(kv, &c, offsets[i], (uint32_t)(offsets[i + 1] - offsets[i]));
        kv_ident last;
        uint32_t cached;
        hits[i] = kv_prefix_probe(kv, &c, ids ? ids + offsets[i] : NULL, &last, &cached);
    }
    return KVA_OK;
}

kva_status kva_kv_lookup_many(kva_kv *kv, uint32_t count, const uint64_t *namespaces, const kva_kv_content *content,
                              const uint64_t *offsets, uint32_t *hits, uint32_t *ids) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv, KVA_KV_CALL_LOOKUP);
    kva_status st = lookup_many_locked(kv, count, namespaces, content, offsets, hits, ids);
    kv_unlock(kv);
    return st;
}
