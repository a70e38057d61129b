/*
 * pool_make.c — a pool's life: made from a validated config (the region, the buddy, the slabs,
 * the metadata faulted in, the arenas placed), listed among the live pools, destroyed; and every
 * lock of a pool taken at once. See pool.h.
 */
#include <stdlib.h>
#include <string.h>

#include "checked_mode.h"
#include "config.h"
#include "numa.h"
#include "os.h"
#include "pool.h"

/* ---- the live pools ------------------------------------------------------------------------- */

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static kva_pool *live_pools;

void kva_pools_lock(void) { pthread_mutex_lock(&live_lock); }
void kva_pools_unlock(void) { pthread_mutex_unlock(&live_lock); }
kva_pool *kva_pools_first(void) { return live_pools; }

static void list_live(kva_pool *pool) {
    pthread_mutex_lock(&live_lock);
    pool->live_prev = NULL;
    pool->live_next = live_pools;
    if (live_pools) live_pools->live_prev = pool;
    live_pools = pool;
    pthread_mutex_unlock(&live_lock);
}

static void unlist_live(kva_pool *pool) {
    pthread_mutex_lock(&live_lock);
    if (pool->live_prev) pool->live_prev->live_next = pool->live_next;
    else live_pools = pool->live_next;
    if (pool->live_next) pool->live_next->live_prev = pool->live_prev;
    pthread_mutex_unlock(&live_lock);
}

/* ---- a pool's life ------------------------------------------------------------------------- */

__thread kva_pool_ticker kva_pool_tickers[KVA_POOL_TICK_SLOTS]; /* uids start at 1 */
static uint64_t next_uid;
/* Bytes of metadata the live pools of this process faulted in at creation within their share
 * (populate_metadata), taken back when they are destroyed. */
static size_t populated_total;

/* Under the live pools' lock: the pool is listed already, and the fork handlers read its
 * observer under that lock. */
void kva_pool_observe(kva_pool *pool, const kva_pool_observer *observer) {
    pthread_mutex_lock(&live_lock);
    pool->observer = *observer;
    pthread_mutex_unlock(&live_lock);
}

void kva_pool_destroy(kva_pool *pool) {
    if (!pool) return;
    unlist_live(pool);
    __atomic_sub_fetch(&populated_total, pool->populated_bytes, __ATOMIC_RELAXED);
    kva_tc_registry_fini(&pool->caches);
    free(pool->quarantine);
    if (pool->observer.close) pool->observer.close(pool->observer.ctx);
    kva_slabs_fini(&pool->slabs);
    kva_buddy_fini(&pool->buddy);
    kva_region_destroy(&pool->region);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

/* Per-arena NUMA placement (arena.h): for a host pool that chose no node itself, on a machine
 * with several nodes, unless everything was touched at creation (prefault) or the chunks are
 * smaller than the hugetlb pages mbind would have to split. A thread on CPU c uses arena
 * c % narenas: each arena takes the node of the first CPU this process may run on that maps to
 * it (so that under taskset or numactl the arenas follow the CPUs actually used). */
static void place_arenas(kva_pool *pool, const kva_config *cfg) {
    if (cfg->backend != KVA_BACKEND_HOST || cfg->numa_node >= 0 || cfg->prefault || cfg->external) return;
    if (pool->region.page_kind == KVA_PAGE_KIND_HUGETLB && (pool->slabs.chunk_mask + 1) % KVA_HUGE_PAGE_SIZE) return;
    if (!kva_numa_arenas_wanted()) return;
    unsigned cpus[1024], count = kva_cpu_allowed(cpus, 1024), n = pool->slabs.narenas;
    for (unsigned i = 0; i < count; i++) {
        kva_arena *arena = &pool->slabs.arenas[cpus[i] % n];
        if (arena->node < 0) arena->node = kva_numa_node_of_cpu(cpus[i]);
    }
}

/* The metadata of all of this process's pools may fault in at creation up to this share of
 * the memory it could still commit. */
#define METADATA_POPULATE_SHARE 16


/* The kernel commits the metadata mappings as they are first touched, and a first touch on an
 * allocation or free path is a page fault there (a microsecond or more; several in a virtual
 * machine): a fresh pool's block records and bitmaps would take one in every few dozen of its
 * first tens of thousands of calls. So they are faulted in here, whatever the config says of
 * the managed memory, and no call on the pool takes a fault in them. Up to a share of physical
 * memory, so that a pool whose metadata is of the order of memory (lazy commitment is what lets
 * one be made at all) does not meet the OOM killer here: first the records every block
 * allocation reaches (12 bytes per minimum block: 0.3% of the capacity at 4 KiB blocks), then
 * the slab bitmaps (2% at 2 MiB chunks), each only if it fits; beyond that they stay lazy. The
 * share is of the memory this process could still commit (a memory cgroup's limit counts: in
 * a container the OOM killer acts inside the populate, before any error could come back) and
 * covers all its pools together, so that many pools do not add up to memory. With
 * prefault, which promises no faults at all, all of it whatever its size. The slab descriptors
 * need nothing: kva_slabs_init has written every one. After the region, whose refusal when it
 * is more than memory can back comes before any of this is touched. */
static kva_status populate_metadata(kva_pool *pool, int prefault) {
    size_t budget = SIZE_MAX;
    if (!prefault) {
        size_t share = kva_os_available_memory() / METADATA_POPULATE_SHARE;
        size_t taken = __atomic_load_n(&populated_total, __ATOMIC_RELAXED);
        budget = share > taken ? share - taken : 0;
    }
    size_t records = pool->buddy.pages_bytes + pool->slabs.slabs_bytes;
    if (records > budget) return KVA_OK;
    kva_status st = kva_os_populate(pool->buddy.pages, pool->buddy.pages_bytes);
    if (st == KVA_OK) pool->populated_bytes = pool->buddy.pages_bytes;
    if (st == KVA_OK && pool->slabs.bitmaps_bytes <= budget - records) {
        st = kva_os_populate(pool->slabs.bitmaps, pool->slabs.bitmaps_bytes);
        pool->slabs.bitmaps_resident = st == KVA_OK;
        if (st == KVA_OK) pool->populated_bytes += pool->slabs.bitmaps_bytes;
    }
    if (prefault) pool->populated_bytes = 0; /* asked for whatever its size: not in the share */
    __atomic_add_fetch(&populated_total, pool->populated_bytes, __ATOMIC_RELAXED);
    /* Without prefault, populating is an optimisation: where the kernel (or a memory cgroup
     * below the machine's memory) will not commit the metadata now, the pages the populate
     * did not reach stay lazy, as they would be beyond the share, and the pool is made. */
    return prefault ? st : KVA_OK;
}

kva_status kva_pool_make(const kva_config *cfg, kva_pool **out) {
    kva_geometry geo;
    kva_status st = kva_config_validate(cfg, &geo);
    if (st != KVA_OK) return st;
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");

    kva_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return kva_fail(KVA_ERR_NOMEM, "no host memory for the pool descriptor");
    pool->capacity = geo.capacity;
    pool->config = *cfg;
    pool->config.name = NULL;
    if (cfg->name) {
        memcpy(pool->name, cfg->name, strlen(cfg->name) + 1);
        pool->config.name = pool->name;
    }

    pool->uid = __atomic_add_fetch(&next_uid, 1, __ATOMIC_RELAXED);
    pthread_mutex_init(&pool->lock, NULL);
    st = kva_buddy_init(&pool->buddy, geo.nblocks, geo.min_shift, geo.num_orders);
    if (st != KVA_OK) goto fail_pool;
    pool->max_alloc_size = (size_t)1 << (geo.min_shift + pool->buddy.num_orders - 1);
    size_t chunk = (size_t)1 << geo.chunk_shift;
    size_t alignment = pool->max_alloc_size > chunk ? pool->max_alloc_size : chunk;
    /* The region before the slab descriptors: kva_slabs_init writes every one of them (64 bytes
     * per chunk, a gigabyte for a 1 TiB pool of 64 KiB chunks), so a region the kernel will
     * not reserve is refused before any of that is written. */
    st = kva_region_create(cfg, geo.capacity, alignment, &pool->region);
    if (st != KVA_OK) goto fail_buddy;
    unsigned arenas = cfg->arenas ? cfg->arenas : kva_arena_default_count();
    st = kva_slabs_init(&pool->slabs, &pool->buddy, geo.capacity, geo.chunk_shift, arenas);
    if (st != KVA_OK) goto fail_region;
    pool->slabs.region = &pool->region;
    pool->slabs.pool_lock = &pool->lock;
    st = populate_metadata(pool, cfg->prefault);
    if (st != KVA_OK) goto fail_slabs;
    pool->base = pool->region.base;
    place_arenas(pool, cfg);
    pool->fast_limit = KVA_SLAB_MAX_SIZE;
    pool->fast_capacity = pool->capacity;
    if (cfg->checked) {
        /* Every free byte holds the poison from the start (invariant C1). */
        kva_poison(pool->base, pool->capacity);
        pool->checked = 1;
        pool->fast_limit = pool->fast_capacity = 0;
    }
    if (cfg->name && cfg->trace) {
        pool->trace = 1;
        pool->fast_limit = pool->fast_capacity = 0;
    }
    kva_tc_registry_init(&pool->caches, pool, &pool->slabs, pool->base);
    kva_assert(((uintptr_t)pool->base & (pool->max_alloc_size - 1)) == 0);              /* P1 */
    kva_assert(pool->capacity == (size_t)pool->buddy.nblocks << pool->buddy.min_shift); /* P2 */
    kva_assert_expensive(kva_buddy_check(&pool->buddy, NULL) == KVA_OK);
    list_live(pool);
    *out = pool;
    return KVA_OK;

fail_slabs:
    kva_slabs_fini(&pool->slabs);
fail_region:
    kva_region_destroy(&pool->region);
fail_buddy:
    kva_buddy_fini(&pool->buddy);
fail_pool:
    pthread_mutex_destroy(&pool->lock);
    free(pool);
    return st;
}

void kva_pool_lock_all(kva_pool *pool) {
    kva_tc_registry_lock();
    for (unsigned a = 0; a < pool->slabs.narenas; a++) pthread_mutex_lock(&pool->slabs.arenas[a].lock);
    pthread_mutex_lock(&pool->lock);
}

void kva_pool_unlock_all(kva_pool *pool) {
    pthread_mutex_unlock(&pool->lock);
    for (unsigned a = pool->slabs.narenas; a-- > 0;) pthread_mutex_unlock(&pool->slabs.arenas[a].lock);
    kva_tc_registry_unlock();
}
