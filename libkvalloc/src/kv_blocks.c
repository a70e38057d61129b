/*
 * kv_blocks.c — the life of a paged block: taken, referenced, released to the LRU lists or the
 * free stack, evicted; and its entry in the prefix table. Every step is O(1) per block (a
 * prefix-table chain is about one block long: at least two buckets per block).
 *
 * Eviction happens in batches, before a call takes its blocks: the call evicts as many cached
 * blocks as it needs beyond the free ones, lowest priority and least recently released first,
 * and appends them below the free blocks, so the call takes the free blocks first and the
 * evicted ones after, in eviction order. Batching lets the victims' prefix-table buckets load
 * in parallel instead of one cache miss after another, which keeps the cost per eviction flat
 * as the cache grows past the processor's caches.
 */
#include "kv_cache.h"

/* How far the victim walk runs ahead of the evictions: enough independent bucket loads in
 * flight to cover a memory latency. A power of two. */
#define KV_EVICT_AHEAD 32

int kv_prefix_register(kva_kv *kv, uint32_t b, kva_kv_key key, uint32_t ns) {
    /* Appended at the end of its chain: chains then run oldest first, and eviction, which takes
     * the oldest, mostly unlinks a chain's head and touches no other block's record. */
    uint32_t *link = &kv->buckets[key.lo & kv->bucket_mask];
    while (*link != KVA_NIL) {
        const kva_kv_block *other = &kv->blocks[*link];
        if (kv_key_equal(other->key, key) && other->ns == ns) return 0;
        link = &kv->blocks[*link].hash_next;
    }
    kva_kv_block *blk = &kv->blocks[b];
    blk->key = key;
    blk->ns = ns;
    blk->registered = 1;
    blk->hash_next = KVA_NIL;
    *link = b;
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

/* Walks the LRU lists in eviction order ahead of the evictions themselves. */
typedef struct kv_victim_walk {
    uint32_t mask;   /* priorities not yet walked past, the current one lowest */
    uint32_t cursor; /* the next block to collect, or KVA_NIL */
} kv_victim_walk;

static uint32_t walk_next(kva_kv *kv, kv_victim_walk *w) {
    while (w->cursor == KVA_NIL) {
        w->mask &= w->mask - 1;
        if (!w->mask) return KVA_NIL;
        w->cursor = kv->lru_head[__builtin_ctz(w->mask)];
    }
    uint32_t b = w->cursor;
    const kva_kv_block *blk = &kv->blocks[b];
    __builtin_prefetch(&kv->buckets[blk->key.lo & kv->bucket_mask], 1);
    w->cursor = blk->next;
    return b;
}

uint32_t kv_evict(kva_kv *kv, uint32_t count) {
    if (count > kv->cached_count) count = kv->cached_count;
    if (count == 0) return 0;
    /* A software pipeline: the victim KV_EVICT_AHEAD places ahead is collected (and its bucket
     * starts loading) while this one is evicted. Evicting a victim unlinks the head of its list,
     * which leaves the links ahead of it, and so the walk, intact. */
    uint32_t ahead[KV_EVICT_AHEAD];
    kv_victim_walk w = {kv->lru_nonempty, kv->lru_head[__builtin_ctz(kv->lru_nonempty)]};
    uint32_t collected = 0;
    while (collected < count && collected < KV_EVICT_AHEAD) ahead[collected++] = walk_next(kv, &w);
    for (uint32_t done = 0; done < count; done++) {
        uint32_t b = ahead[done % KV_EVICT_AHEAD];
        if (collected < count) ahead[collected++ % KV_EVICT_AHEAD] = walk_next(kv, &w);
        kv_lru_unlink(kv, b);
        prefix_unregister(kv, b);
        free_append(kv, b);
    }
    kv->counters.evictions += count;
    return count;
}

void kv_make_room(kva_kv *kv, uint32_t need) {
    if (need > kv->free_count) kv_evict(kv, need - kv->free_count);
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

void kv_release(kva_kv *kv, const uint32_t *table, uint32_t n) {
    /* Last block first: the tail of a released sequence reaches the LRU lists before its head
     * and is evicted first. */
    for (uint32_t i = n; i-- > 0;) {
        uint32_t b = table[i];
        kva_kv_block *blk = &kv->blocks[b];
        if (--blk->refs != 0) continue;
        kv->used_count--;
        if (blk->registered) {
            kv_lru_push(kv, b);
        } else {
            blk->state = KV_FREE;
            blk->next = kv->free_top;
            if (kv->free_count == 0) kv->free_bottom = b;
            kv->free_top = b;
            kv->free_count++;
        }
    }
}
