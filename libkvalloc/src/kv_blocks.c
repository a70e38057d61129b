/*
 * kv_blocks.c — the life of a paged block: taken, referenced, released to the LRU lists or the
 * free stack, evicted; and its entry in the prefix table. Every function here is O(1) (the
 * prefix-table chain is about one block long: at least two buckets per block).
 */
#include "kv_cache.h"

int kv_prefix_register(kva_kv *kv, uint32_t b, kva_kv_key key, uint32_t ns) {
    if (kv_prefix_find(kv, key, ns) != KVA_NIL) return 0;
    kva_kv_block *blk = &kv->blocks[b];
    uint32_t *bucket = &kv->buckets[key.lo & kv->bucket_mask];
    blk->key = key;
    blk->ns = ns;
    blk->registered = 1;
    blk->hash_next = *bucket;
    *bucket = b;
    kv->registered_count++;
    return 1;
}

static void prefix_unregister(kva_kv *kv, uint32_t b) {
    kva_kv_block *blk = &kv->blocks[b];
    uint32_t *link = &kv->buckets[blk->key.lo & kv->bucket_mask];
    while (*link != b) link = &kv->blocks[*link].hash_next;
    *link = blk->hash_next;
    blk->hash_next = KVA_NIL;
    blk->registered = 0;
    kv->registered_count--;
}

uint32_t kv_evict_one(kva_kv *kv) {
    if (kv_unlikely(kv->lru_nonempty == 0)) return KVA_NIL;
    unsigned p = (unsigned)__builtin_ctz(kv->lru_nonempty);
    uint32_t b = kv->lru_head[p];
    uint32_t after = kv->blocks[b].next;
    /* The next victim's record and bucket are needed by the next eviction: start loading them
     * now, so a long run of evictions does not wait on memory once per block. */
    if (after != KVA_NIL) {
        __builtin_prefetch(&kv->blocks[after]);
        __builtin_prefetch(&kv->buckets[kv->blocks[after].key.lo & kv->bucket_mask]);
    }
    kv_lru_unlink(kv, b);
    prefix_unregister(kv, b);
    kv->counters.evictions++;
    return b;
}

uint32_t kv_block_take(kva_kv *kv, uint8_t priority) {
    /* Hot path: a pop from the free stack, a few stores. */
    uint32_t b = kv_likely(kv->free_count != 0) ? kv_free_pop(kv) : kv_evict_one(kv);
    kva_kv_block *blk = &kv->blocks[b];
    blk->state = KV_USED;
    blk->refs = 1;
    blk->priority = priority;
    kv->used_count++;
    return b;
}

void kv_block_ref(kva_kv *kv, uint32_t b, uint8_t priority) {
    kva_kv_block *blk = &kv->blocks[b];
    if (blk->state == KV_CACHED) {
        kv_lru_unlink(kv, b);
        blk->state = KV_USED;
        kv->used_count++;
    }
    blk->refs++;
    if (priority > blk->priority) blk->priority = priority;
}

void kv_block_unref(kva_kv *kv, uint32_t b) {
    kva_kv_block *blk = &kv->blocks[b];
    if (--blk->refs != 0) return;
    kv->used_count--;
    if (blk->registered) kv_lru_push(kv, b);
    else kv_free_push(kv, b);
}
