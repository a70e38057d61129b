/*
 * tcache_registry.c — thread caches' lifetime: a pool's registry of them, a thread's lookup and
 * creation of its cache, the caches' end at the thread's exit or the pool's destruction, and the
 * totals the statistics read. See tcache.h.
 */
#include <stdlib.h>

#include "os.h"
#include "tcache.h"

const char kva_tc_nowhere;
static kva_tcache dummy = {.pool = KVA_TC_NO_POOL}; /* matches no pool */

__thread kva_tcache *kva_tc_current __attribute__((tls_model("initial-exec"))) = &dummy;
static __thread kva_tcache *thread_caches; /* every cache of this thread, dead ones included */

static pthread_mutex_t registry = PTHREAD_MUTEX_INITIALIZER;
static pthread_key_t exit_key;
static int exit_key_made;

void kva_tc_registry_lock(void) { pthread_mutex_lock(&registry); }
void kva_tc_registry_unlock(void) { pthread_mutex_unlock(&registry); }

static kva_pool *pool_of(const kva_tcache *tc) { return __atomic_load_n(&tc->pool, __ATOMIC_ACQUIRE); }

/* ---- the test hook ------------------------------------------------------------------------- */

void (*kva_tc_test_fn)(int point, void *ctx);
void *kva_tc_test_ctx;

void kva_tc_test_hook(void (*fn)(int point, void *ctx), void *ctx) {
    __atomic_store_n(&kva_tc_test_ctx, ctx, __ATOMIC_SEQ_CST);
    __atomic_store_n(&kva_tc_test_fn, fn, __ATOMIC_SEQ_CST);
}

/* ---- lifetime ------------------------------------------------------------------------------ */

/* Folds a live cache's counters into its registry and unlinks it (registry lock held). */
static void retire(kva_tc_registry *reg, kva_tcache *tc) {
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        reg->retired_allocs[c] += tc->hot[c].allocs;
        reg->retired_frees[c] += tc->frees[c] + tc->merged[c];
    }
    reg->retired_remote_frees += tc->remote_frees;
    /* Its words are all given back: the id is free for the next cache (ids are never reused
     * while a cache holds them, and never wrap into KVA_NO_OWNER). */
    if (reg->free_ids_count == reg->free_ids_capacity) {
        uint32_t capacity = reg->free_ids_capacity ? 2 * reg->free_ids_capacity : 64;
        uint32_t *grown = realloc(reg->free_ids, capacity * sizeof *grown);
        if (grown) {
            reg->free_ids = grown;
            reg->free_ids_capacity = capacity;
        }
    }
    if (reg->free_ids_count < reg->free_ids_capacity) reg->free_ids[reg->free_ids_count++] = tc->id;
    if (tc->pool_prev) tc->pool_prev->pool_next = tc->pool_next;
    else reg->caches = tc->pool_next;
    if (tc->pool_next) tc->pool_next->pool_prev = tc->pool_prev;
    reg->ncaches--;
    __atomic_store_n(&tc->pool, KVA_TC_NO_POOL, __ATOMIC_RELEASE);
}

/* The thread is exiting: every cache gives its words back and goes. */
static void thread_exit(void *unused) {
    (void)unused;
    kva_tcache *tc = thread_caches;
    thread_caches = NULL;
    kva_tc_current = &dummy;
    while (tc) {
        kva_tcache *next = tc->thread_next;
        pthread_mutex_lock(&registry);
        if (pool_of(tc) != KVA_TC_NO_POOL) {
            kva_tc_flush(tc->registry, tc);
            retire(tc->registry, tc);
        }
        pthread_mutex_unlock(&registry);
        free(tc);
        tc = next;
    }
}

/* At load time rather than with pthread_once on a first call: the once costs a futex wake
 * inside the first call of the process. */
__attribute__((constructor)) static void make_key(void) {
    exit_key_made = pthread_key_create(&exit_key, thread_exit) == 0;
}

kva_tcache *kva_tc_find(const kva_pool *pool) {
    if (pool_of(kva_tc_current) == pool) return kva_tc_current;
    for (kva_tcache **at = &thread_caches; *at;) {
        kva_tcache *tc = *at;
        kva_pool *owner = pool_of(tc);
        if (owner == KVA_TC_NO_POOL) { /* its pool is gone */
            *at = tc->thread_next;
            if (kva_tc_current == tc) kva_tc_current = &dummy;
            free(tc);
            continue;
        }
        if (owner == pool) return kva_tc_current = tc;
        at = &tc->thread_next;
    }
    return NULL;
}

void kva_tc_forsake(const kva_pool *pool) {
    for (kva_tcache **at = &thread_caches; *at; at = &(*at)->thread_next) {
        kva_tcache *tc = *at;
        if (pool_of(tc) != pool) continue;
        *at = tc->thread_next;
        if (kva_tc_current == tc) kva_tc_current = &dummy;
        return;
    }
}

/* A zeroed cache record with its pages faulted in (kva_tc_registry_init says why). */
static kva_tcache *make_spare(void) {
    kva_tcache *tc = calloc(1, sizeof *tc);
    if (!tc) return NULL;
    /* calloc leaves memory fresh from the kernel untouched: a store in each page the record
     * spans faults it in now (volatile: not dropped as a store of the zero calloc promised). */
    volatile unsigned char *bytes = (volatile unsigned char *)tc;
    size_t page = kva_os_page_size();
    for (size_t off = 0; off < sizeof *tc; off += page) bytes[off] = 0;
    bytes[sizeof *tc - 1] = 0;
    return tc;
}

void kva_tc_registry_init(kva_tc_registry *reg, kva_pool *pool, kva_slabs *slabs, unsigned char *base) {
    reg->pool = pool;
    reg->slabs = slabs;
    reg->base = base;
    reg->spare = make_spare();
}

kva_tcache *kva_tc_get(kva_tc_registry *reg) {
    kva_tcache *tc = kva_tc_find(reg->pool);
    if (tc || !exit_key_made) return tc;
    tc = __atomic_exchange_n(&reg->spare, NULL, __ATOMIC_ACQ_REL);
    if (!tc) tc = calloc(1, sizeof *tc);
    if (!tc) return NULL;
    /* Any non-NULL value makes the exit run thread_exit, which walks all the thread's caches:
     * a constant, so that no later failure here has anything to undo (a NULL set on one would
     * have cancelled the exit of the thread's other caches). */
    if (pthread_setspecific(exit_key, &dummy) != 0) {
        free(tc);
        return NULL;
    }
    kva_tc_init_classes(tc, reg->slabs);
    tc->registry = reg;
    pthread_mutex_lock(&registry);
    if (reg->free_ids_count > 0) {
        tc->id = reg->free_ids[--reg->free_ids_count];
    } else if (reg->next_id < UINT32_MAX) {
        tc->id = ++reg->next_id;
    } else {
        /* 2^32 - 1 ids handed out and none free for reuse: refuse a new cache rather than
         * hand out an id in use (the thread then frees without one, and allocation says
         * KVA_ERR_NOMEM). */
        pthread_mutex_unlock(&registry);
        free(tc);
        return NULL;
    }
    tc->pool_next = reg->caches;
    if (reg->caches) reg->caches->pool_prev = tc;
    reg->caches = tc;
    reg->ncaches++;
    __atomic_store_n(&tc->pool, reg->pool, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&registry);
    tc->thread_next = thread_caches;
    thread_caches = tc;
    return kva_tc_current = tc;
}

void kva_tc_registry_fini(kva_tc_registry *reg) {
    pthread_mutex_lock(&registry);
    /* Each cache's successor is read before the cache is marked: once marked, its thread may
     * free it at any moment (kva_tc_find, which takes no lock). */
    for (kva_tcache *tc = reg->caches, *next; tc; tc = next) {
        next = tc->pool_next;
        __atomic_store_n(&tc->pool, KVA_TC_NO_POOL, __ATOMIC_RELEASE);
        kva_tc_test_point(KVA_TC_POINT_MARKED);
    }
    reg->caches = NULL;
    reg->ncaches = 0;
    pthread_mutex_unlock(&registry);
    free(reg->spare);
    free(reg->free_ids);
}

void kva_tc_totals_locked(const kva_tc_registry *reg, kva_tc_totals *out) {
    const kva_slabs *sl = reg->slabs;
    *out = (kva_tc_totals){0};
    /* Three passes: the free counts, the remote frees waiting in owned words, then the
     * allocation counts. An object's free is seen after its allocation, often by another
     * thread whose cache may come first in the list, so read the other way round (or cache by
     * cache) the frees of objects handed between threads could outrun their allocations and
     * live counts wrap below zero. The free counts and remote words are read with acquire,
     * pairing with the release that counts or passes each free: what a thread did before it,
     * such as taking the object from its allocating thread, is seen by the reads that follow.
     * Retired counts do not move: the registry lock is held. */
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++)
        out->frees[c] = reg->retired_frees[c] + __atomic_load_n(&reg->uncached_frees[c], __ATOMIC_ACQUIRE);
    out->remote_frees = reg->retired_remote_frees;
    /* Every walk stops at the registry's count of caches: kva_check reads these totals before
     * it has checked the list, which must not make it loop. */
    uint32_t n = 0;
    for (const kva_tcache *tc = reg->caches; tc && n < reg->ncaches; tc = tc->pool_next, n++) {
        out->remote_frees += kva_load(&tc->remote_frees);
        for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++)
            out->frees[c] += __atomic_load_n(&tc->frees[c], __ATOMIC_ACQUIRE) +
                             __atomic_load_n(&tc->merged[c], __ATOMIC_ACQUIRE);
        kva_tc_test_point(KVA_TC_POINT_COUNTED);
    }
    const kva_tcache *mine = NULL;
    for (const kva_tcache *tc = thread_caches; tc && !mine; tc = tc->thread_next)
        if (pool_of(tc) == reg->pool) mine = tc;
    n = 0;
    for (const kva_tcache *tc = reg->caches; tc && n < reg->ncaches; tc = tc->pool_next, n++) {
        out->caches++;
        if (tc != mine) out->foreign_caches++;
        for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
            const kva_tc_class *k = &tc->cls[c];
            /* Another thread may change its set meanwhile: bounded reads, an estimate. The
             * word's place comes from the class's geometry, not from the slab descriptor's
             * copies, which kva_check has not verified yet when it asks. */
            const kva_class_geometry *g = &sl->geom[c];
            uint32_t owned = kva_load(&k->nowned);
            for (uint32_t i = 0; i < owned && i < KVA_TC_WORDS; i++) {
                uint32_t s = kva_load(&k->slab[i]), w = kva_load(&k->word[i]);
                if (s >= sl->nchunks || __atomic_load_n(&sl->slabs[s].cls, __ATOMIC_ACQUIRE) != c || w >= g->l0_words)
                    continue;
                const uint64_t *l0 = kva_slab_bitmap(sl, s) + g->l1_words + w;
                uint64_t remote = __atomic_load_n(l0 + g->l0_words, __ATOMIC_ACQUIRE), bits = kva_load(l0);
                out->pending[c] += kva_slab_newly_freed(remote, bits);
                out->cached[c] += (uint64_t)__builtin_popcountll(bits | remote);
            }
        }
    }
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) out->allocs[c] = reg->retired_allocs[c];
    n = 0;
    for (const kva_tcache *tc = reg->caches; tc && n < reg->ncaches; tc = tc->pool_next, n++)
        for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) out->allocs[c] += kva_load(&tc->hot[c].allocs);
}
