/*
 * publish.h — a named pool's statistics: kva_pool_create gives a named pool a publisher, which
 * owns the pool's statistics segment and watches the pool as its observer (pool.h): it records
 * the calls the pool hands it and fills the segment when the interval has passed. And the hook
 * through which a KV-cache manager built on the pool adds its own section and paints its blocks
 * into the heap map.
 */
#ifndef KVA_PUBLISH_H
#define KVA_PUBLISH_H

#include <pthread.h>

#include "internal.h"
#include "kvalloc_stats.h"
#include "segment.h"

/* Where a KV cache's publish writes, in the segment. */
typedef struct kva_kv_publish_to {
    kva_shm_kv *kv;
    kva_shm_kv_namespaces *namespaces;
    kva_shm_kv_sequences *sequences; /* NULL but at a full publish */
    const kva_shm_heapmap *map;      /* NULL but at a full publish */
    uint8_t *state, *fill;           /* the heap map's cells */
} kva_kv_publish_to;

typedef struct kva_kv_publisher {
    /* Fills the KV section and the namespaces section and, at a full publish (to->map and
     * to->sequences not NULL), the sequences section and the heap-map cells (state[i], fill[i]
     * for i < map->cells) its blocks cover. Called with the segment's sequence lock held; must
     * not call into the pool. If it cannot read its state safely now, it leaves the sections as
     * they were. */
    void (*publish)(void *ctx, const kva_kv_publish_to *to);
    void *ctx;
} kva_kv_publisher;

/* A named pool's publisher, the context of the pool's observer. */
typedef struct kva_publisher {
    kva_pool *pool;
    kva_segment *segment;
    /* The segment's writers (trace records, publishing) and the KV publisher hook. Taken before
     * any other lock of the pool. */
    pthread_mutex_t lock;
    kva_kv_publisher kv; /* set by a KV cache built on this pool */
} kva_publisher;

/* The pool's publisher; NULL for an anonymous pool. */
kva_publisher *kva_publisher_of(const kva_pool *pool);

/* Attaches a KV cache's publisher: 1, or 0 when another cache's is attached (the segment has
 * one KV section; the first cache keeps it). */
int kva_pool_attach_kv(kva_pool *pool, const kva_kv_publisher *publisher);
/* Detaches the publisher whose ctx is `ctx`, if it is the one attached. */
void kva_pool_detach_kv(kva_pool *pool, const void *ctx);

/* A KV cache's call on the pool: the thread's countdown (kva_pool_tick) and, when it says so,
 * a publish if the pool's interval has passed, as the pool's own slow calls do. A no-op for an
 * anonymous pool. */
void kva_publish_tick(kva_pool *pool);

#endif
