/*
 * var_pool.c — a variable-size pool's life (var_pool.h): its configuration, creation over a pool
 * (its own or a caller's) and destruction; and the small queries: the base, a range's usable
 * size, the sizes of the public structs; the process-wide list of those over shared memory,
 * which a forked child stops (kva_vars_forsake).
 */
#include <pthread.h>
#include <stdlib.h>

#include "config.h"
#include "os.h"
#include "pool_own.h"
#include "pool_range.h"
#include "var_pool.h"

void kva_var_config_init(kva_var_config *cfg) {
    if (!cfg) return;
    *cfg = (kva_var_config){.capacity = (size_t)64 << 20,
                            .alignment = 256,
                            .policy = KVA_VAR_TLSF,
                            .pages = KVA_PAGES_THP};
}

static kva_status validate(const kva_var_config *cfg) {
    if (!cfg) return kva_fail(KVA_ERR_INVALID, "config is NULL");
    if (!kva_is_pow2(cfg->alignment) || cfg->alignment < 16 || cfg->alignment > ((size_t)1 << 30))
        return kva_fail(KVA_ERR_INVALID, "alignment %zu is not a power of two in [16 B, 1 GiB]", cfg->alignment);
    if (cfg->capacity < cfg->alignment)
        return kva_fail(KVA_ERR_INVALID, "capacity %zu is less than one alignment unit (%zu)", cfg->capacity,
                        cfg->alignment);
    if (cfg->capacity / cfg->alignment > KVA_VAR_MAX_UNITS)
        return kva_fail(KVA_ERR_INVALID, "capacity %zu is 2^31 alignment units or more; raise the alignment",
                        cfg->capacity);
    if ((unsigned)cfg->policy > KVA_VAR_WORST_FIT)
        return kva_fail(KVA_ERR_INVALID, "unknown policy %d", (int)cfg->policy);
    if ((unsigned)cfg->pages > KVA_PAGES_SMALL)
        return kva_fail(KVA_ERR_INVALID, "unknown page mode %d", (int)cfg->pages);
    return KVA_OK;
}

/* A host pool whose largest block holds `bytes`: the next power of two above it, in blocks of
 * the default size or larger where a pool's u32 block indices need it (from 16 TiB up, where
 * 4 KiB blocks number 2^32): the caller never wrote that pool's config, so it must not be
 * refused for it. */
static kva_status create_own_pool(const kva_var_config *cfg, size_t bytes, kva_pool **out) {
    kva_config pc;
    kva_config_init(&pc);
    size_t capacity = (size_t)1 << 20;
    while (capacity < bytes) capacity <<= 1;
    while ((capacity >> kva_log2(pc.min_block)) >= KVA_NIL && pc.min_block < KVA_MIN_BLOCK_MAX) pc.min_block <<= 1;
    pc.capacity = capacity;
    pc.pages = cfg->pages;
    return kva_pool_create_own(&pc, out);
}

static pthread_mutex_t shared_vars_lock = PTHREAD_MUTEX_INITIALIZER;
static kva_var *shared_vars; /* the pools over shared memory: kva_var's shared_next */

void kva_vars_lock(void) { pthread_mutex_lock(&shared_vars_lock); }
void kva_vars_unlock(void) { pthread_mutex_unlock(&shared_vars_lock); }

void kva_vars_forsake(void) {
    for (kva_var *v = shared_vars; v; v = v->shared_next) {
        v->inherited = 1;
        v->bytes = 0;
    }
}

kva_status kva_var_refuse_inherited(void) {
    return kva_fail(KVA_ERR_BACKEND, "the pool's memory is shared with the process this one was forked from, "
                                     "whose pool this is a copy of: a child neither allocates from it nor frees "
                                     "into it (kva_shared_attach maps the memory)");
}

static void list_shared(kva_var *v) {
    v->over_shared = 1;
    kva_vars_lock();
    v->shared_next = shared_vars;
    if (shared_vars) shared_vars->shared_prev = v;
    shared_vars = v;
    kva_vars_unlock();
}

static void unlist_shared(kva_var *v) {
    if (!v->over_shared) return;
    kva_vars_lock();
    if (v->shared_prev) v->shared_prev->shared_next = v->shared_next;
    else shared_vars = v->shared_next;
    if (v->shared_next) v->shared_next->shared_prev = v->shared_prev;
    kva_vars_unlock();
}

kva_status kva_var_create(const kva_var_config *cfg, kva_pool *backing, kva_var **out) {
    kva_status st = validate(cfg);
    if (st != KVA_OK) return st;
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");
    kva_var *v = calloc(1, sizeof *v);
    if (!v) return kva_fail(KVA_ERR_NOMEM, "no host memory for the variable-size pool descriptor");
    v->align_shift = kva_log2(cfg->alignment);
    v->units = (uint32_t)(cfg->capacity >> v->align_shift);
    v->policy = cfg->policy;
    size_t bytes = (size_t)v->units << v->align_shift;
    v->bytes = bytes;
    v->align_mask = cfg->alignment - 1;
    v->alignment = cfg->alignment;

    v->ranges_bytes = ((size_t)v->units + 1) * sizeof(kva_var_range); /* and the sentinel */
    void *ranges;
    st = kva_os_map_metadata(v->ranges_bytes, &ranges);
    if (st != KVA_OK) goto fail_descriptor;
    v->ranges = ranges;

    v->pool = backing;
    if (!backing) {
        st = create_own_pool(cfg, bytes, &v->pool);
        if (st != KVA_OK) goto fail_ranges;
        v->owns_pool = 1;
    }
    void *base;
    st = kva_alloc_exact(v->pool, bytes, &base);
    if (st == KVA_ERR_INVALID) /* the request is valid; the pool's largest block is too small */
        st = kva_fail(KVA_ERR_NOMEM, "the backing pool cannot hold %zu bytes in one range", bytes);
    if (st != KVA_OK) goto fail_pool;
    if ((uintptr_t)base & v->align_mask) { /* a checked pool: 16 B past its red zone */
        kva_free(v->pool, base);
        st = kva_fail(KVA_ERR_INVALID, "the backing pool aligns ranges to less than %zu bytes (a checked pool: 16)",
                      cfg->alignment);
        goto fail_pool;
    }
    v->base = base;

    v->head = v->tail = KVA_NIL;
    for (unsigned cls = 0; cls < KVA_TLSF_FL * KVA_TLSF_SL; cls++) v->bins[cls] = KVA_NIL;
    v->ranges[0] = (kva_var_range){.length = v->units | KVA_VAR_FREE_BIT, .prev = v->units};
    v->ranges[v->units] = (kva_var_range){.prev = 0}; /* the sentinel */
    if (v->policy == KVA_VAR_TLSF) kva_var_tlsf_insert(v, 0);
    else kva_var_fit_insert(v, 0);
    v->free_units = v->low_free_units = v->units;
    v->free_ranges = 1;
    if (kva_pool_range_shared(v->pool)) list_shared(v);
    *out = v;
    return KVA_OK;

fail_pool:
    if (v->owns_pool) kva_pool_destroy(v->pool);
fail_ranges:
    kva_os_unmap(v->ranges, v->ranges_bytes);
fail_descriptor:
    free(v);
    return st;
}

void kva_var_destroy(kva_var *v) {
    if (!v) return;
    /* No other call on this pool may be running (documented): the lock is not taken. */
    unlist_shared(v);
    if (v->owns_pool) kva_pool_destroy(v->pool);
    else kva_free(v->pool, v->base);
    kva_os_unmap(v->ranges, v->ranges_bytes);
    free(v);
}

size_t kva_var_usable_size(kva_var *v, const void *ptr) {
    if (!v || !ptr) return 0;
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)v->base;
    if (offset >= (uint64_t)v->units << v->align_shift || (offset & (((uint64_t)1 << v->align_shift) - 1))) return 0;
    int token = kva_lock_acquire(&v->lock);
    const kva_var_range *r = &v->ranges[offset >> v->align_shift];
    size_t usable = r->length == 0 || kva_var_is_free(r) ? 0 : (size_t)r->length << v->align_shift;
    kva_lock_release(&v->lock, token);
    return usable;
}

kva_status kva_var_base(kva_var *v, void **base) {
    /* base is fixed at creation: no lock. */
    if (!v || !base) return kva_fail(KVA_ERR_INVALID, "variable-size pool or base is NULL");
    *base = v->base;
    return KVA_OK;
}

size_t kva_var_struct_size(int which) {
    switch (which) {
    case 1: return sizeof(kva_var_config);
    case 2: return sizeof(kva_var_stats);
    default: return 0;
    }
}
