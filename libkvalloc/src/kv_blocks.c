/*
 * kv_blocks.c — the life of a paged block: taken, referenced, released to the LRU lists or the
 * free stack, evicted; and its entry in the prefix table. Every step is O(1) per block (a
 * prefix-table chain is about one block long: at least 1.5 buckets per block).
 *
 * Eviction happens in batches, before a call takes its blocks: the call evicts as many cached
 * blocks as it needs beyond the free ones, lowest priority and least recently released first,
 * and appends them below the free blocks, so the call takes the free blocks first and the
 * evicted ones after, in eviction order. The victims come from the LRU segments (kv_lru.c)
 * KV_EVICT_BATCH at a time, before any of their records is read, so their records and then
 * their prefix-table buckets load in parallel instead of one cache miss after another.
 */
#include <string.h>

#include "kv_cache.h"

/* Victims collected and loaded together: enough independent loads in flight to cover a memory
 * latency. */
#define KV_EVICT_BATCH 32

uint32_t kv_commit(kva_kv *kv, uint32_t b, const kv_ident *id, const kv_ident *parent, uint32_t first_token) {
    /* Appended at the end of its chain: chains then run oldest first, and eviction, which takes
     * the oldest, mostly unlinks a chain's head and touches no other block's record. */
    uint32_t *link = &kv->buckets[id->key.lo & kv->bucket_mask];
    while (*link != KVA_NIL) {
        if (kv_block_holds(kv, *link, id)) return *link;
        link = &kv->blocks[*link].hash_next;
    }
    kva_kv_block *blk = &kv->blocks[b];
    blk->key = id->key;
    blk->ns = id->ns;
    blk->key_len = (uint8_t)id->len;
    if (id->len) memcpy(kv_key_store(kv, b), id->bytes, id->len);
    blk->registered = 1;
    blk->hash_next = KVA_NIL;
    *link = b;
    kv->registered_count++;
    kv->ns.rows[kv_ns_slot(kv, id->ns)].registered++;
    if (kva_unlikely(kv->events != NULL)) kv_event_stored(kv, b, id, parent, first_token);
    return b;
}

static void prefix_unregister(kva_kv *kv, uint32_t b) {
    kva_kv_block *blk = &kv->blocks[b];
    uint32_t *link = &kv->buckets[blk->key.lo & kv->bucket_mask];
    while (*link != b) link = &kv->blocks[*link].hash_next;
    *link = blk->hash_next;
    blk->hash_next = KVA_NIL;
    blk->registered = 0;
    kv->registered_count--;
    kv->ns.rows[kv_ns_slot(kv, blk->ns)].registered--;
}

/* Appends a block below every free block: it is taken after them. */
static void free_append(kva_kv *kv, uint32_t b) {
    kva_kv_block *blk = &kv->blocks[b];
    blk->state = KV_FREE;
    blk->next = KVA_NIL;
    if (kv->free_count == 0) kv->free_top = b;
    else kv->blocks[kv->free_bottom].next = b;
    kv->free_bottom = b;
    kv->free_count++;
}

uint32_t kv_evict(kva_kv *kv, uint32_t count, int announce) {
    if (count > kv->cached_count) count = kv->cached_count;
    uint32_t victims[KV_EVICT_BATCH], bucket[KV_EVICT_BATCH];
    for (uint32_t done = 0; done < count;) {
        uint32_t want = count - done < KV_EVICT_BATCH ? count - done : KV_EVICT_BATCH;
        uint32_t n = kv_lru_collect(kv, victims, want);
        /* Passes: the records start loading together; their keys give the buckets, which start
         * loading together; a victim that is not first on its chain (about one in five) has its
         * unlink walk from the chain's first block, whose record starts loading; then the
         * evictions find everything in cache. */
        for (uint32_t i = 0; i < n; i++) { /* both lines of a record that straddles two */
            __builtin_prefetch(&kv->blocks[victims[i]], 1);
            __builtin_prefetch((const char *)&kv->blocks[victims[i]] + sizeof(kva_kv_block) - 1, 1);
        }
        for (uint32_t i = 0; i < n; i++) {
            bucket[i] = (uint32_t)(kv->blocks[victims[i]].key.lo & kv->bucket_mask);
            __builtin_prefetch(&kv->buckets[bucket[i]], 1);
        }
        for (uint32_t i = 0; i < n; i++) {
            uint32_t first = kv->buckets[bucket[i]];
            if (first != victims[i]) __builtin_prefetch(&kv->blocks[first].hash_next, 1);
        }
        for (uint32_t i = 0; i < n; i++) {
            uint32_t b = victims[i];
            if (kva_unlikely(announce && kv->events != NULL)) kv_event_removed(kv, b);
            kv_lru_remove(kv, b);
            prefix_unregister(kv, b);
            free_append(kv, b);
        }
        done += n;
    }
    kv->counters.evictions += count;
    return count;
}

void kv_forget(kva_kv *kv, uint32_t b) {
    if (kv->events) kv_event_removed(kv, b);
    prefix_unregister(kv, b);
    if (kv->blocks[b].state == KV_CACHED) {
        kv_lru_remove(kv, b);
        free_append(kv, b);
    }
    kv->counters.evictions++;
}

void kv_make_room(kva_kv *kv, uint32_t need) {
    if (need > kv->free_count) kv_evict(kv, need - kv->free_count, 1);
}

void kv_take(kva_kv *kv, uint32_t *table, uint32_t n, uint8_t priority) {
    /* Hot path: a pop from the free stack and three stores per block. */
    kva_kv_block *blocks = kv->blocks;
    uint32_t top = kv->free_top;
    for (uint32_t i = 0; i < n; i++) {
        kva_kv_block *blk = &blocks[top];
        table[i] = top;
        top = blk->next;
        blk->state = KV_USED;
        blk->refs = 1;
        blk->priority = priority;
    }
    kv->free_top = top;
    kv->free_count -= n;
    if (kv->free_count == 0) kv->free_bottom = KVA_NIL;
    kv->used_count += n;
    if (kv->used_count > kv->peak_used) kv->peak_used = kv->used_count;
}

void kv_block_ref(kva_kv *kv, uint32_t b, uint8_t priority) {
    kva_kv_block *blk = &kv->blocks[b];
    if (blk->state == KV_CACHED) {
        kv_lru_remove(kv, b);
        blk->state = KV_USED;
        if (++kv->used_count > kv->peak_used) kv->peak_used = kv->used_count;
    }
    blk->refs++;
    if (priority > blk->priority) blk->priority = priority;
}

void kv_release(kva_kv *kv, const uint32_t *table, uint32_t n) {
    /* Last block first: the tail of a released sequence reaches the LRU lists before its head
     * and is evicted first. */
    for (uint32_t i = n; i-- > 0;) kv_unref(kv, table[i]);
}
