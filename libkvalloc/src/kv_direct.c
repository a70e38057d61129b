/*
 * kv_direct.c — the block calls, for an engine that keeps its own prefix structure (a vLLM
 * BlockPool, a radix tree): it takes blocks and holds references to them directly, commits them
 * under its own keys, evicts by block or key, and resets the prefix cache.
 *
 * References the engine holds are counted per block in loose[] (K2: a block's refs are its
 * table entries plus loose[b]), so a release can tell the engine's references from a
 * sequence's: an engine cannot drop what a sequence holds, and the count stays exact. They go
 * through the same paths as a sequence's (kv_take, kv_block_ref, kv_unref), so a block the
 * engine releases is cached or freed exactly as a sequence's would be.
 *
 * Every call checks its whole list before changing anything. A block listed twice where that
 * is an error (kva_kv_block_commit) is found with KV_LOOSE_MARK, set in the loose counts of the
 * listed blocks and cleared before the call returns; a list that drops references
 * (kva_kv_block_unref) is checked by taking the references off one by one and putting them
 * back if one is missing.
 */
#include "kv_cache.h"

#define INVALID(...) kv_reject(kv, kva_fail(KVA_ERR_INVALID, __VA_ARGS__))

/* Keys committed per round: enough loads in flight to cover a memory latency. */
#define KV_COMMIT_BATCH 16

static kva_status paged_only(kva_kv *kv) {
    return kv->info.mode == KVA_KV_PAGED ? KVA_OK
                                         : INVALID("the block calls need paged mode; this cache is contiguous");
}

/* A paged cache and a list of count block ids, each in range. */
static kva_status ids_check(kva_kv *kv, const uint32_t *ids, uint32_t count) {
    kva_status st = paged_only(kv);
    if (st != KVA_OK) return st;
    if (count && !ids) return INVALID("ids is NULL but count is %u", count);
    for (uint32_t i = 0; i < count; i++)
        if (ids[i] >= kv->num_blocks) return INVALID("block %u (entry %u) is not below %u", ids[i], i, kv->num_blocks);
    return KVA_OK;
}

/* ---- take, drop and add references --------------------------------------------------------- */

static kva_status take_locked(kva_kv *kv, uint32_t count, uint32_t priority, uint32_t *ids) {
    kva_status st = paged_only(kv);
    if (st != KVA_OK) return st;
    if (count && !ids) return INVALID("ids is NULL but count is %u", count);
    if (priority >= KVA_KV_PRIORITIES) return INVALID("priority %u is not in 0..%d", priority, KVA_KV_PRIORITIES - 1);
    uint32_t available = kv_blocks_available(kv);
    if (count > available) {
        kv->counters.alloc_failures++;
        return kva_fail(KVA_ERR_NOMEM, "%u blocks asked; %u are free or evictable (of %u)", count, available,
                        kv->num_blocks);
    }
    st = kv_ensure_backed(kv, count, kv->cached_count);
    if (st != KVA_OK) return st;
    kv_make_room(kv, count);
    kv_take(kv, ids, count, (uint8_t)priority);
    for (uint32_t i = 0; i < count; i++) kv->loose[ids[i]] = 1;
    kv->loose_refs += count;
    kv->loose_touched |= count != 0;
    return KVA_OK;
}

kva_status kva_kv_block_take(kva_kv *kv, uint32_t count, uint32_t priority, uint32_t *ids) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_ALLOCATE);
    if (st == KVA_OK) st = take_locked(kv, count, priority, ids);
    kv_unlock(kv);
    return st;
}

static kva_status unref_locked(kva_kv *kv, const uint32_t *ids, uint32_t count) {
    kva_status st = ids_check(kv, ids, count);
    if (st != KVA_OK) return st;
    /* Checked by taking each reference off the counts, all put back if one is missing. */
    for (uint32_t i = 0; i < count; i++) {
        uint32_t b = ids[i];
        if (kv->loose[b] != 0) {
            kv->loose[b]--;
            continue;
        }
        for (uint32_t j = 0; j < i; j++) kv->loose[ids[j]]++;
        uint32_t engine = kv->loose[b], tables = kv->blocks[b].refs - engine;
        if (tables == 0)
            return kv_reject(kv, kva_fail(KVA_ERR_DOUBLE_FREE,
                                          "block %u (entry %u): a double unref, the engine holds %u "
                                          "references to it and no sequence any",
                                          b, i, engine));
        return INVALID("block %u (entry %u): the engine holds %u references to it; its other %u are sequences'", b, i,
                       engine, tables);
    }
    for (uint32_t i = 0; i < count; i++) kv_unref(kv, ids[i]);
    kv->loose_refs -= count;
    return KVA_OK;
}

kva_status kva_kv_block_unref(kva_kv *kv, const uint32_t *ids, uint32_t count) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_FREE);
    if (st == KVA_OK) st = unref_locked(kv, ids, count);
    kv_unlock(kv);
    return st;
}

static kva_status ref_locked(kva_kv *kv, const uint32_t *ids, uint32_t count) {
    kva_status st = ids_check(kv, ids, count);
    if (st != KVA_OK) return st;
    for (uint32_t i = 0; i < count; i++) {
        const kva_kv_block *blk = &kv->blocks[ids[i]];
        if (blk->state != KV_USED && blk->state != KV_CACHED)
            return INVALID("block %u (entry %u) is free: it holds nothing to reference", ids[i], i);
        __builtin_prefetch(&kv->loose[ids[i]], 1);
        if (blk->state == KV_CACHED) { /* it leaves its LRU list below: its entry starts loading */
            __builtin_prefetch(&kv->lru_ids[blk->lru_slot], 1);
            __builtin_prefetch(&kv->lru_segs[blk->lru_slot / KV_LRU_SEG], 1);
        }
    }
    /* Priority 0 leaves each block's priority as it is. */
    for (uint32_t i = 0; i < count; i++) {
        kv_block_ref(kv, ids[i], 0);
        kv->loose[ids[i]]++;
    }
    kv->loose_refs += count;
    kv->loose_touched |= count != 0;
    return KVA_OK;
}

kva_status kva_kv_block_ref(kva_kv *kv, const uint32_t *ids, uint32_t count) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK) st = ref_locked(kv, ids, count);
    kv_unlock(kv);
    return st;
}

/* ---- commit -------------------------------------------------------------------------------- */

static kva_status key_len_check(kva_kv *kv, uint32_t key_len) {
    if (kv->max_key_bytes == 0) return INVALID("this cache takes no engine keys (created with max_key_bytes 0)");
    if (key_len == 0 || key_len > kv->max_key_bytes)
        return INVALID("key_len %u is not in 1 .. %u (max_key_bytes)", key_len, kv->max_key_bytes);
    return KVA_OK;
}

/* Each listed block is used, held by the engine alone, unregistered, and listed once. */
static kva_status commit_check(kva_kv *kv, const uint32_t *blocks, uint32_t count) {
    kva_status st = KVA_OK;
    uint32_t i = 0;
    for (; i < count && st == KVA_OK; i++) {
        uint32_t b = blocks[i];
        const kva_kv_block *blk = &kv->blocks[b];
        if (kv->loose[b] & KV_LOOSE_MARK) st = kva_fail(KVA_ERR_INVALID, "block %u is listed twice (entry %u)", b, i);
        else if (blk->state != KV_USED || kv->loose[b] != blk->refs)
            st = kva_fail(KVA_ERR_INVALID,
                          "block %u (entry %u) is not held by the engine alone: state %u, %u references, "
                          "%u of them the engine's",
                          b, i, blk->state, blk->refs, kv->loose[b]);
        else if (blk->registered) st = kva_fail(KVA_ERR_INVALID, "block %u (entry %u) is registered already", b, i);
        else kv->loose[b] |= KV_LOOSE_MARK;
    }
    for (uint32_t j = 0; j < i; j++) kv->loose[blocks[j]] &= ~KV_LOOSE_MARK;
    return st == KVA_OK ? KVA_OK : kv_reject(kv, st);
}

static kva_status commit_locked(kva_kv *kv, uint64_t ns, const uint32_t *blocks, uint32_t count, const uint8_t *keys,
                                uint32_t key_len, const uint8_t *parent, uint32_t first_token, uint32_t *registered) {
    kva_status st = paged_only(kv);
    if (st == KVA_OK) st = key_len_check(kv, key_len);
    if (st == KVA_OK && count && !keys) st = INVALID("keys is NULL but count is %u", count);
    if (st == KVA_OK) st = ids_check(kv, blocks, count);
    if (st == KVA_OK) st = commit_check(kv, blocks, count);
    if (st != KVA_OK) return st;
    /* In rounds whose keys, buckets, the records that head them and the key bytes written are
     * all loaded at once, as a lookup's are. */
    kv_ident prev = {{0, 0}, ns, parent, key_len};
    for (uint32_t done = 0; done < count;) {
        kv_ident ids[KV_COMMIT_BATCH];
        uint32_t n = count - done < KV_COMMIT_BATCH ? count - done : KV_COMMIT_BATCH;
        for (uint32_t j = 0; j < n; j++) {
            ids[j] = kv_ident_engine(kv, ns, keys + (size_t)(done + j) * key_len, key_len);
            __builtin_prefetch(&kv->buckets[ids[j].key.lo & kv->bucket_mask]);
            __builtin_prefetch(kv_key_store(kv, blocks[done + j]), 1);
        }
        for (uint32_t j = 0; j < n; j++) {
            uint32_t head = kv->buckets[ids[j].key.lo & kv->bucket_mask];
            if (head != KVA_NIL) __builtin_prefetch(&kv->blocks[head]);
        }
        for (uint32_t j = 0; j < n; j++, done++) {
            uint32_t holder = kv_commit(kv, blocks[done], &ids[j], prev.bytes ? &prev : NULL,
                                        first_token + done * kv->block_tokens);
            if (registered) registered[done] = holder;
            prev = ids[j];
        }
    }
    return KVA_OK;
}

kva_status kva_kv_block_commit(kva_kv *kv, uint64_t namespace_id, const uint32_t *blocks, uint32_t count,
                               const uint8_t *keys, uint32_t key_len, const uint8_t *parent, uint32_t first_token,
                               uint32_t *registered) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK)
        st = commit_locked(kv, namespace_id, blocks, count, keys, key_len, parent, first_token, registered);
    kv_unlock(kv);
    return st;
}

/* ---- eviction by block, by key; reset -------------------------------------------------------- */

static kva_status evict_blocks_locked(kva_kv *kv, const uint32_t *ids, uint32_t count, uint32_t *evicted) {
    kva_status st = ids_check(kv, ids, count);
    if (st != KVA_OK) return st;
    uint32_t dropped = 0;
    for (uint32_t i = 0; i < count; i++)
        if (kv->blocks[ids[i]].registered) {
            kv_forget(kv, ids[i]);
            dropped++;
        }
    if (evicted) *evicted = dropped;
    return KVA_OK;
}

kva_status kva_kv_evict_blocks(kva_kv *kv, const uint32_t *ids, uint32_t count, uint32_t *evicted) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_EVICT);
    if (st == KVA_OK) st = evict_blocks_locked(kv, ids, count, evicted);
    kv_unlock(kv);
    return st;
}

static kva_status evict_keys_locked(kva_kv *kv, uint64_t ns, const uint8_t *keys, uint32_t key_len, uint32_t count,
                                    uint32_t *evicted) {
    kva_status st = paged_only(kv);
    if (st == KVA_OK) st = key_len_check(kv, key_len);
    if (st == KVA_OK && count && !keys) st = INVALID("keys is NULL but count is %u", count);
    if (st != KVA_OK) return st;
    uint32_t dropped = 0;
    for (uint32_t j = 0; j < count; j++) {
        kv_ident id = kv_ident_engine(kv, ns, keys + (size_t)j * key_len, key_len);
        uint32_t b = kv_prefix_find(kv, &id);
        if (b == KVA_NIL) continue;
        kv_forget(kv, b);
        dropped++;
    }
    if (evicted) *evicted = dropped;
    return KVA_OK;
}

kva_status kva_kv_evict_keys(kva_kv *kv, uint64_t namespace_id, const uint8_t *keys, uint32_t key_len, uint32_t count,
                             uint32_t *evicted) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_EVICT);
    if (st == KVA_OK) st = evict_keys_locked(kv, namespace_id, keys, key_len, count, evicted);
    kv_unlock(kv);
    return st;
}

static kva_status reset_locked(kva_kv *kv) {
    kva_status st = paged_only(kv);
    if (st != KVA_OK) return st;
    /* The cached blocks in eviction order, then the used ones still registered, chain by chain:
     * O(cached + buckets). */
    kv_evict(kv, kv->cached_count, 0); /* counted as evictions there */
    for (uint32_t bucket = 0; bucket <= kv->bucket_mask; bucket++) {
        for (uint32_t b = kv->buckets[bucket], next; b != KVA_NIL; b = next) {
            next = kv->blocks[b].hash_next;
            kv->blocks[b].registered = 0;
            kv->blocks[b].hash_next = KVA_NIL;
        }
        kv->buckets[bucket] = KVA_NIL;
    }
    kv->counters.evictions += kv->registered_count;
    kv->registered_count = 0;
    kv_ns_forget_all(kv);
    if (kv->events) kv_event_cleared(kv);
    return KVA_OK;
}

kva_status kva_kv_reset_prefix_cache(kva_kv *kv) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK) st = reset_locked(kv);
    kv_unlock(kv);
    return st;
}
