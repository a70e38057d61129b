/*
 * publish.h — filling a pool's statistics segment, and the hook through which a KV-cache
 * manager built on the pool adds its own section and paints its blocks into the heap map.
 */
#ifndef KVA_PUBLISH_H
#define KVA_PUBLISH_H

#include "internal.h"
#include "kvalloc_stats.h"

typedef struct kva_kv_publisher {
    /* Fills *kv and, when map is not NULL (a full publish), repaints the heap-map cells
     * (state[i], fill[i] for i < map->cells) its blocks cover. Called with the segment's
     * sequence lock held; must not call into the pool. If it cannot read its state safely now,
     * it leaves *kv as it was. */
    void (*publish)(void *ctx, kva_shm_kv *kv, const kva_shm_heapmap *map, uint8_t *state, uint8_t *fill);
    void *ctx;
} kva_kv_publisher;

/* Attaches a KV cache's publisher: 1, or 0 when another cache's is attached (the segment has
 * one KV section; the first cache keeps it). */
int kva_pool_attach_kv(kva_pool *pool, const kva_kv_publisher *publisher);
/* Detaches the publisher whose ctx is `ctx`, if it is the one attached. */
void kva_pool_detach_kv(kva_pool *pool, const void *ctx);

/* Writes the pool's segment under the sequence lock: the cheap sections always, the heap map and
 * slab strips too when full is set. */
void kva_publish(kva_pool *pool, int full);

/* Reads the clock under the publish lock and publishes when the pool's interval has passed; the
 * callers (the pool's slow paths, a KV cache's calls) come here every KVA_SEGMENT_CHECK_EVERY
 * calls of a thread (kva_segment_tick). A no-op for an anonymous pool. */
void kva_publish_due(kva_pool *pool);

/* A slow-path call's tick (kva_segment_tick), then kva_publish_due when it says so. */
void kva_publish_tick(kva_pool *pool);

#endif
