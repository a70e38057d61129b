/*
 * kv_cache.c — a KV cache's life and geometry: configuration, creation on a pool (its own or a
 * caller's), destruction, addresses, eviction on request, statistics.
 *
 * Threads: creation builds the cache before any other thread can see it; destruction must not
 * overlap any other call on it; kva_kv_get_info and kva_kv_block_address read only fields fixed
 * at creation and take no lock; every other call holds the cache's lock throughout.
 */
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "kv_cache.h"
#include "os.h"
#include "pool_own.h"
#include "pool_range.h"

/* At most 2^30 blocks, so the prefix table (a power of two, at least 1.5 buckets per block)
 * keeps a u32 mask. */
#define KV_MAX_BLOCKS ((uint32_t)1 << 30)
/* Contiguous mode: buckets up to 2^30 tokens. */
#define KV_MAX_CONTEXT ((uint32_t)1 << 30)
/* The largest event ring: 96 MiB. */
#define KV_MAX_EVENTS ((uint32_t)1 << 20)

#if UINTPTR_MAX == UINT64_MAX
_Static_assert(sizeof(kva_kv_config) == 96, "the config's added fields fill its alignment holes, groups come last");
_Static_assert(sizeof(kva_kv_layer) == 48, "a layer's geometry is four u32 and four sizes");
#endif
_Static_assert(sizeof(kva_kv_group) == 16, "a group is four u32");
_Static_assert(sizeof(kva_kv_event) == 96, "an event is 96 bytes without padding");
_Static_assert(sizeof(kva_kv_block_copy) == 16, "a batch copy is four u32");
#define KV_POOL_MIN_BLOCK ((size_t)4096)

void kva_kv_config_init(kva_kv_config *cfg) {
    if (!cfg) return;
    *cfg = (kva_kv_config){
        .dtype_bytes = 2,
        .block_tokens = 16,
        .mode = KVA_KV_PAGED,
        .layout = KVA_KV_LAYOUT_LAYERS,
        .pages = KVA_PAGES_THP,
    };
}

static int mul_size(size_t a, size_t b, size_t *out) { return !__builtin_mul_overflow(a, b, out); }

/* The groups of a config: its own, or the one group its layers, kv_heads and head_dim make
 * (*single holds it). */
static kva_status config_groups(const kva_kv_config *cfg, kva_kv_group *single, const kva_kv_group **groups,
                                uint32_t *count) {
    if (!cfg->groups && !cfg->num_groups) {
        if (cfg->layers == 0 || cfg->kv_heads == 0 || cfg->head_dim == 0)
            return kva_fail(KVA_ERR_INVALID, "zero geometry: layers %u, kv_heads %u, head_dim %u", cfg->layers,
                            cfg->kv_heads, cfg->head_dim);
        *single =
            (kva_kv_group){.layers = cfg->layers, .parts = 2, .kv_heads = cfg->kv_heads, .head_dim = cfg->head_dim};
        *groups = single;
        *count = 1;
        return KVA_OK;
    }
    if (!cfg->groups || cfg->num_groups == 0 || cfg->num_groups > KVA_KV_MAX_GROUPS)
        return kva_fail(KVA_ERR_INVALID, "groups %s with num_groups %u: give both, 1 .. %d groups",
                        cfg->groups ? "given" : "NULL", cfg->num_groups, KVA_KV_MAX_GROUPS);
    if (cfg->layers || cfg->kv_heads || cfg->head_dim)
        return kva_fail(KVA_ERR_INVALID, "give layers, kv_heads and head_dim, or groups, not both");
    if (cfg->mode != KVA_KV_PAGED) return kva_fail(KVA_ERR_INVALID, "groups need paged mode");
    uint32_t layers = 0;
    for (uint32_t g = 0; g < cfg->num_groups; g++) {
        const kva_kv_group *group = &cfg->groups[g];
        if (group->layers == 0 || group->kv_heads == 0 || group->head_dim == 0)
            return kva_fail(KVA_ERR_INVALID, "group %u: zero geometry: layers %u, kv_heads %u, head_dim %u", g,
                            group->layers, group->kv_heads, group->head_dim);
        if (group->parts != 1 && group->parts != 2)
            return kva_fail(KVA_ERR_INVALID, "group %u: parts %u is not 1 (one vector, MLA) or 2 (K and V)", g,
                            group->parts);
        if (group->layers > KVA_KV_MAX_LAYERS - layers)
            return kva_fail(KVA_ERR_INVALID, "more than %d layers in the groups", KVA_KV_MAX_LAYERS);
        layers += group->layers;
    }
    *groups = cfg->groups;
    *count = cfg->num_groups;
    return KVA_OK;
}

static int same_shape(const kva_kv_group *a, const kva_kv_group *b) {
    return a->parts == b->parts && a->kv_heads == b->kv_heads && a->head_dim == b->head_dim;
}

/* Checks the geometry and fills the sizes of *info; *parts is the parts of every layer when all
 * have one shape, else 0. */
static kva_status geometry(const kva_kv_config *cfg, kva_kv_info *info, uint32_t *parts) {
    if (!cfg) return kva_fail(KVA_ERR_INVALID, "config is NULL");
    if (cfg->block_tokens == 0) return kva_fail(KVA_ERR_INVALID, "zero geometry: block_tokens 0");
    if (cfg->dtype_bytes != 1 && cfg->dtype_bytes != 2 && cfg->dtype_bytes != 4 && cfg->dtype_bytes != 8)
        return kva_fail(KVA_ERR_INVALID, "dtype_bytes %u is not 1, 2, 4 or 8", cfg->dtype_bytes);
    if ((unsigned)cfg->mode > KVA_KV_CONTIGUOUS) return kva_fail(KVA_ERR_INVALID, "unknown mode %d", (int)cfg->mode);
    if ((unsigned)cfg->layout > KVA_KV_LAYOUT_LAYERS)
        return kva_fail(KVA_ERR_INVALID, "unknown layout %d", (int)cfg->layout);
    if (cfg->max_key_bytes > KVA_KV_MAX_KEY_BYTES)
        return kva_fail(KVA_ERR_INVALID, "max_key_bytes %u is beyond %d", cfg->max_key_bytes, KVA_KV_MAX_KEY_BYTES);
    if (cfg->event_capacity > KV_MAX_EVENTS)
        return kva_fail(KVA_ERR_INVALID, "event_capacity %u is beyond %u", cfg->event_capacity, KV_MAX_EVENTS);
    if (cfg->mode != KVA_KV_PAGED && (cfg->max_key_bytes || cfg->event_capacity))
        return kva_fail(KVA_ERR_INVALID, "engine keys and events need paged mode");
    kva_kv_group single;
    const kva_kv_group *groups = NULL;
    uint32_t count = 0;
    kva_status st = config_groups(cfg, &single, &groups, &count);
    if (st != KVA_OK) return st;
    size_t token = 0, slot = 0;
    uint32_t layers = 0;
    int uniform = 1;
    for (uint32_t g = 0; g < count; g++) {
        size_t group_slot, group_token;
        if (!mul_size((size_t)groups[g].kv_heads * groups[g].head_dim, cfg->dtype_bytes, &group_slot) ||
            !mul_size(group_slot, (size_t)groups[g].parts * groups[g].layers, &group_token) ||
            __builtin_add_overflow(token, group_token, &token))
            return kva_fail(KVA_ERR_INVALID, "the geometry's bytes per block overflow");
        uniform &= same_shape(&groups[g], &groups[0]);
        slot = group_slot;
        layers += groups[g].layers;
    }
    size_t block;
    if (!mul_size(token, cfg->block_tokens, &block))
        return kva_fail(KVA_ERR_INVALID, "the geometry's bytes per block overflow");
    memset(info, 0, sizeof *info);
    info->mode = cfg->mode;
    info->layout = cfg->layout;
    info->layers = layers;
    info->dtype_bytes = cfg->dtype_bytes;
    info->block_tokens = cfg->block_tokens;
    info->token_bytes = token;
    info->block_bytes = block;
    *parts = uniform ? groups[0].parts : 0;
    if (uniform) { /* else each layer has its own (kva_kv_layer_info) */
        info->kv_heads = groups[0].kv_heads;
        info->head_dim = groups[0].head_dim;
        info->slot_bytes = slot;
        info->part_bytes = slot * cfg->block_tokens;
    }
    return KVA_OK;
}

/* Paged mode, layers of different shapes: each layer's geometry (kva_kv_layout). */
static kva_status layer_table(const kva_kv_config *cfg, const kva_kv_info *info, kva_kv_layer **out) {
    kva_kv_layer *table = calloc(info->layers, sizeof *table);
    if (!table) return kva_fail(KVA_ERR_NOMEM, "no host memory for the geometry of %u layers", info->layers);
    size_t before = 0; /* bytes of one block of the layers before */
    uint32_t l = 0;
    for (uint32_t g = 0; g < cfg->num_groups; g++) {
        const kva_kv_group *group = &cfg->groups[g];
        for (uint32_t i = 0; i < group->layers; i++, l++) {
            kva_kv_layer *layer = &table[l];
            layer->group = g;
            layer->parts = group->parts;
            layer->kv_heads = group->kv_heads;
            layer->head_dim = group->head_dim;
            layer->slot_bytes = (size_t)group->kv_heads * group->head_dim * info->dtype_bytes;
            layer->part_bytes = layer->slot_bytes * info->block_tokens;
            size_t own = layer->part_bytes * group->parts;
            /* Within the block's bytes, checked against overflow by geometry(). */
            if (info->layout == KVA_KV_LAYOUT_BLOCKS) {
                layer->block_stride = info->block_bytes;
                layer->offset = before;
            } else {
                layer->block_stride = own;
                layer->offset = before * info->num_blocks;
            }
            before += own;
        }
    }
    *out = table;
    return KVA_OK;
}

void kv_layer_geometry(const kva_kv *kv, uint32_t layer, kva_kv_layer *out) {
    if (kv->layer_geom) {
        *out = kv->layer_geom[layer];
        return;
    }
    const kva_kv_info *g = &kv->info;
    *out = (kva_kv_layer){.parts = kv->parts,
                          .kv_heads = g->kv_heads,
                          .head_dim = g->head_dim,
                          .slot_bytes = g->slot_bytes,
                          .part_bytes = g->part_bytes,
                          .block_stride = g->block_stride,
                          .offset = (size_t)layer * g->layer_stride};
}

kva_status kva_kv_block_bytes(const kva_kv_config *cfg, size_t *out) {
    kva_kv_info info;
    uint32_t parts;
    kva_status st = geometry(cfg, &info, &parts);
    if (st != KVA_OK) return st;
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");
    *out = info.block_bytes;
    return KVA_OK;
}

/* Paged mode: the number of blocks and the strides (of layers of one shape, with `parts` each;
 * else layer_table's). */
static kva_status paged_layout(const kva_kv_config *cfg, kva_kv_info *info, uint32_t parts) {
    uint64_t blocks = cfg->num_blocks ? cfg->num_blocks : cfg->capacity_bytes / info->block_bytes;
    if (blocks == 0 && cfg->capacity_bytes == 0)
        return kva_fail(KVA_ERR_INVALID,
                        "no size given: set num_blocks, or capacity_bytes (at least one block of %zu "
                        "bytes)",
                        info->block_bytes);
    if (blocks == 0)
        return kva_fail(KVA_ERR_INVALID, "capacity_bytes %zu holds no block of %zu bytes (num_blocks 0)",
                        cfg->capacity_bytes, info->block_bytes);
    if (blocks > KV_MAX_BLOCKS)
        return kva_fail(KVA_ERR_INVALID, "%llu blocks; at most %u", (unsigned long long)blocks, KV_MAX_BLOCKS);
    info->num_blocks = (uint32_t)blocks;
    if (!mul_size(info->block_bytes, info->num_blocks, &info->kv_bytes))
        return kva_fail(KVA_ERR_INVALID, "%u blocks of %zu bytes overflow", info->num_blocks, info->block_bytes);
    if (cfg->layout == KVA_KV_LAYOUT_BLOCKS) {
        info->block_stride = info->block_bytes;
        info->layer_stride = parts * info->part_bytes; /* 0 when layers differ in shape */
    } else if (parts) {                                /* else the strides differ from layer to layer */
        info->block_stride = parts * info->part_bytes;
        info->layer_stride = info->block_stride * info->num_blocks;
    }
    return KVA_OK;
}

/* The pool a cache creates for itself: paged mode needs one free block of the power of two
 * above its KV bytes (kva_alloc_exact takes the front of it); contiguous mode needs its bytes. */
static kva_status own_pool(const kva_kv_config *cfg, const kva_kv_info *info, size_t bytes, kva_pool **out) {
    kva_config pc;
    kva_config_init(&pc);
    pc.pages = cfg->pages;
    pc.name = cfg->name;
    pc.trace = cfg->trace;
    pc.min_block = KV_POOL_MIN_BLOCK;
    size_t units = bytes / pc.min_block + (bytes % pc.min_block != 0);
    /* Keep the pool's minimum blocks below 2^31 by coarsening them for huge caches, up to the
     * largest min_block a pool takes. */
    while (units >= ((size_t)1 << 31) && pc.min_block < KVA_MIN_BLOCK_MAX) {
        pc.min_block *= 2;
        units = bytes / pc.min_block + (bytes % pc.min_block != 0);
    }
    if (units >= ((size_t)1 << 31))
        return kva_fail(KVA_ERR_INVALID, "%zu bytes of KV are more than one pool can hold (%zu)", bytes,
                        (((size_t)1 << 31) - 1) * KVA_MIN_BLOCK_MAX);
    if (info->mode == KVA_KV_PAGED) {
        size_t pow2 = 1;
        while (pow2 < units) pow2 *= 2;
        units = pow2;
    }
    pc.capacity = units * pc.min_block;
    return kva_pool_create_own(&pc, out);
}

static kva_stats pool_stats(kva_pool *pool) {
    kva_stats ps;
    if (kva_get_stats(pool, &ps) != KVA_OK) memset(&ps, 0, sizeof ps);
    return ps;
}

/* Contiguous mode: the bytes of its own pool and the largest bucket. */
static kva_status contiguous_layout(const kva_kv_config *cfg, kva_kv_info *info, int own) {
    if (cfg->max_context &&
        (!kva_is_pow2(cfg->max_context) || cfg->max_context < KVA_KV_MIN_BUCKET || cfg->max_context > KV_MAX_CONTEXT))
        return kva_fail(KVA_ERR_INVALID, "max_context %u is not a power of two in [%d, %u]", cfg->max_context,
                        KVA_KV_MIN_BUCKET, KV_MAX_CONTEXT);
    size_t bytes = cfg->capacity_bytes;
    if (cfg->num_blocks && !mul_size(info->block_bytes, cfg->num_blocks, &bytes))
        return kva_fail(KVA_ERR_INVALID, "%u blocks of %zu bytes overflow", cfg->num_blocks, info->block_bytes);
    if (own && bytes < (size_t)KVA_KV_MIN_BUCKET * info->token_bytes)
        return kva_fail(KVA_ERR_INVALID, "capacity of %zu bytes holds no bucket of %d tokens (%zu bytes)", bytes,
                        KVA_KV_MIN_BUCKET, (size_t)KVA_KV_MIN_BUCKET * info->token_bytes);
    info->kv_bytes = bytes;
    info->max_context = cfg->max_context;
    return KVA_OK;
}

/* Fixes max_context against the pool's largest block. */
static kva_status contiguous_limit(kva_kv *kv, const kva_kv_config *cfg) {
    kva_stats ps = pool_stats(kv->pool);
    size_t largest = ps.max_alloc_size;
    size_t fits = largest / kv->info.token_bytes;
    if (fits < KVA_KV_MIN_BUCKET)
        return kva_fail(KVA_ERR_NOMEM, "the pool's largest block (%zu bytes) holds no bucket of %d tokens", largest,
                        KVA_KV_MIN_BUCKET);
    if (cfg->max_context) {
        if (cfg->max_context > fits)
            return kva_fail(KVA_ERR_NOMEM,
                            "a bucket of max_context %u tokens (%zu bytes) exceeds the pool's largest "
                            "block (%zu)",
                            cfg->max_context, (size_t)cfg->max_context * kv->info.token_bytes, largest);
        kv->max_context = cfg->max_context;
    } else {
        kv->max_context = KV_MAX_CONTEXT;
        while (kv->max_context > fits) kv->max_context /= 2;
    }
    kv->info.max_context = kv->max_context;
    kv->info.kv_bytes = ps.capacity;
    return KVA_OK;
}

/* Host memory for a per-block array. Arrays of 2 MiB and more are 2 MiB-aligned and advised to
 * transparent huge pages (without the advice THP set to "madvise" leaves them on 4 KiB pages):
 * over a million blocks a random record access then costs a cache miss but no TLB miss. */
kva_status kv_metadata_map(size_t bytes, void **out, size_t *length) {
    int huge = bytes >= KVA_HUGE_PAGE_SIZE;
    size_t unit = huge ? KVA_HUGE_PAGE_SIZE : kva_os_page_size();
    size_t len = (bytes + unit - 1) / unit * unit;
    void *p;
    kva_status st = kva_os_reserve(len, unit, &p);
    if (st != KVA_OK) return st;
    st = kva_os_commit(p, len, KVA_OS_LAZY);
    if (st != KVA_OK) {
        kva_os_unmap(p, len);
        return st;
    }
    if (huge) (void)kva_os_advise_thp(p, len); /* an optimisation: a refusal costs only speed */
    *out = p;
    *length = len;
    return KVA_OK;
}

static kva_status paged_init(kva_kv *kv) {
    uint32_t n = kv->info.num_blocks;
    void *memory;
    kva_status st = kva_alloc_exact(kv->pool, kv->info.kv_bytes, &memory);
    if (st == KVA_ERR_INVALID)
        return kva_fail(KVA_ERR_NOMEM, "the pool's largest block (%zu bytes) cannot hold the %zu bytes of KV",
                        pool_stats(kv->pool).max_alloc_size, kv->info.kv_bytes);
    if (st != KVA_OK) return st;
    kv->memory = memory;
    kv->info.base = memory;

    /* At least 1.5 buckets per block (a load factor of at most 2/3: chains of about one block),
     * a power of two so that a key's bucket is a mask: 1.5 to 3 buckets, 6 to 12 bytes. */
    uint32_t buckets = 2;
    while (buckets < n + n / 2) buckets *= 2;
    void *blocks, *heads;
    st = kv_metadata_map((size_t)n * sizeof *kv->blocks, &blocks, &kv->blocks_length);
    if (st != KVA_OK) return st;
    kv->blocks = blocks;
    st = kv_metadata_map((size_t)buckets * sizeof *kv->buckets, &heads, &kv->buckets_length);
    if (st != KVA_OK) return st;
    kv->buckets = heads;
    kv->bucket_mask = buckets - 1;
    memset(kv->buckets, 0xff, (size_t)buckets * sizeof *kv->buckets);
    kv->num_blocks = n;
    kv->backed_blocks = n;
    for (uint32_t b = 0; b < n; b++)
        kv->blocks[b] =
            (kva_kv_block){.refs = 0, .hash_next = KVA_NIL, .next = b + 1 < n ? b + 1 : KVA_NIL, .state = KV_FREE};
    /* Touched only where used: engine keys as blocks are registered under them, the engine's
     * references as it takes them. */
    void *loose;
    st = kv_metadata_map((size_t)n * sizeof *kv->loose, &loose, &kv->loose_length);
    if (st != KVA_OK) return st;
    kv->loose = loose;
    void *pin_refs;
    st = kv_metadata_map((size_t)n * sizeof *kv->pin_refs, &pin_refs, &kv->pin_refs_length);
    if (st != KVA_OK) return st;
    kv->pin_refs = pin_refs;
    if (kv->max_key_bytes) {
        void *keys;
        st = kv_metadata_map((size_t)n * kv->max_key_bytes, &keys, &kv->key_store_length);
        if (st != KVA_OK) return st;
        kv->key_store = keys;
    }
    kv->free_top = 0;
    kv->free_bottom = n - 1;
    kv->free_count = n;
    kv->root = kv_key_root(kv->hash_seed);
    return kv_lru_init(kv);
}

static void release_memory(kva_kv *kv) {
    for (uint32_t s = 0; s < kv->seq_slots; s++) {
        kva_kv_seqrec *rec = &kv->seqs[s];
        if (rec->live && kv->info.mode == KVA_KV_CONTIGUOUS) kv_contig_release(kv, rec);
        free(rec->table);
        free(rec->partial);
    }
    /* The slot at seq_slots may hold a table reserved by a call that then failed. */
    if (kv->seq_slots < kv->seq_capacity) {
        free(kv->seqs[kv->seq_slots].table);
        free(kv->seqs[kv->seq_slots].partial);
    }
    free(kv->seqs);
    free(kv->layer_geom);
    kva_os_unmap(kv->blocks, kv->blocks_length);
    kva_os_unmap(kv->buckets, kv->buckets_length);
    kva_os_unmap(kv->loose, kv->loose_length);
    kva_os_unmap(kv->pin_refs, kv->pin_refs_length);
    kva_os_unmap(kv->key_store, kv->key_store_length);
    kv_events_release(kv);
    kv_lru_release(kv);
    /* Trimmed or not: the pool's free forgets the granules given back (region_cuda.c). */
    if (kv->memory) kva_free(kv->pool, kv->memory);
    if (kv->owns_pool) kva_pool_destroy(kv->pool);
}

kva_status kva_kv_create(const kva_kv_config *cfg, kva_pool *pool, kva_kv **out) {
    kva_kv_info info;
    uint32_t parts;
    kva_status st = geometry(cfg, &info, &parts);
    if (st != KVA_OK) return st;
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");
    if (pool && cfg->name)
        return kva_fail(KVA_ERR_INVALID, "name is for the pool the cache creates; the given pool has its own");
    st = cfg->mode == KVA_KV_PAGED ? paged_layout(cfg, &info, parts) : contiguous_layout(cfg, &info, pool == NULL);
    if (st != KVA_OK) return st;
    kva_kv_layer *table = NULL;
    if (!parts && (st = layer_table(cfg, &info, &table)) != KVA_OK) return st;

    kva_kv *kv = calloc(1, sizeof *kv);
    if (!kv) {
        free(table);
        return kva_fail(KVA_ERR_NOMEM, "no host memory for the cache descriptor");
    }
    kv->info = info;
    kv_ns_init(kv);
    kv->parts = parts;
    kv->layer_geom = table;
    kv->block_tokens = info.block_tokens;
    kv->hash_seed = cfg->hash_seed;
    kv->max_key_bytes = cfg->max_key_bytes;
    kv->event_medium = cfg->event_medium;
    kv->handle_key = kv_new_handle_key();
    kv->free_slot = KVA_NIL;
    kv->free_top = kv->free_bottom = KVA_NIL;
    for (unsigned p = 0; p < KVA_KV_PRIORITIES; p++) kv->lru_head[p] = kv->lru_tail[p] = KVA_NIL;
    if (pool) {
        kv->pool = pool;
    } else {
        st = own_pool(cfg, &info, info.kv_bytes, &kv->pool);
        if (st != KVA_OK) {
            free(table);
            free(kv);
            return st;
        }
        kv->owns_pool = 1;
    }
    kv->info.pool = kv->pool;
    kv->shared_depth = kva_pool_range_shared(kv->pool) ? kva_os_fork_depth() + 1 : 0;
    st = cfg->mode == KVA_KV_PAGED ? paged_init(kv) : contiguous_limit(kv, cfg);
    if (st == KVA_OK && cfg->event_capacity) st = kv_events_init(kv, cfg->event_capacity);
    if (st == KVA_OK && pthread_mutex_init(&kv->lock, NULL) != 0)
        st = kva_fail(KVA_ERR_BACKEND, "pthread_mutex_init failed");
    if (st != KVA_OK) {
        release_memory(kv);
        free(kv);
        return st;
    }
    kv->sample_period = cfg->trace ? 1 : KVA_KV_CALL_SAMPLE_PERIOD;
    kv->sample_state = kv->hash_seed | 1;
    kv->countdown = kv_next_sample(kv);
    kv_publish_attach(kv);
    *out = kv;
    return KVA_OK;
}

kva_status kv_refuse_inherited(void) {
    return kva_fail(KVA_ERR_BACKEND, "the cache's pool is shared with the process this one was forked from, whose "
                                     "cache this is a copy of: its blocks are that process's, and a child changes "
                                     "nothing in it (kva_shared_attach maps the memory)");
}

void kva_kv_destroy(kva_kv *kv) {
    if (!kv) return;
    /* No other call on this cache may be running (documented): the lock is not taken. The
     * publisher goes first, so the pool's publishes stop reaching the cache. */
    kv_publish_detach(kv);
    release_memory(kv);
    pthread_mutex_destroy(&kv->lock);
    free(kv);
}

kva_status kva_kv_get_info(kva_kv *kv, kva_kv_info *out) {
    /* kv->info is fixed at creation: no lock. */
    if (!kv || !out) return kva_fail(KVA_ERR_INVALID, "cache or out is NULL");
    *out = kv->info;
    return KVA_OK;
}

kva_status kva_kv_block_address(kva_kv *kv, uint32_t block, uint32_t layer, kva_kv_part part, void **out) {
    /* Reads only geometry fixed at creation: no lock. */
    if (kva_unlikely(!kv || !out)) return kva_fail(KVA_ERR_INVALID, "cache or out is NULL");
    const kva_kv_info *g = &kv->info;
    if (kva_unlikely(g->mode != KVA_KV_PAGED)) return kva_fail(KVA_ERR_INVALID, "block addresses need paged mode");
    if (kva_unlikely(block >= g->num_blocks || layer >= g->layers || (unsigned)part > KVA_KV_V))
        return kva_fail(KVA_ERR_INVALID, "block %u, layer %u, part %d out of range (%u blocks, %u layers)", block,
                        layer, (int)part, g->num_blocks, g->layers);
    if (kva_likely(!kv->layer_geom)) {
        if (kva_unlikely((unsigned)part >= kv->parts))
            return kva_fail(KVA_ERR_INVALID, "part %d: the layers keep one vector per token (part 0)", (int)part);
        *out = kv->memory + block * g->block_stride + layer * g->layer_stride + (size_t)part * g->part_bytes;
        return KVA_OK;
    }
    const kva_kv_layer *l = &kv->layer_geom[layer];
    if (kva_unlikely((unsigned)part >= l->parts))
        return kva_fail(KVA_ERR_INVALID, "part %d: layer %u keeps one vector per token (part 0)", (int)part, layer);
    *out = kv->memory + l->offset + block * l->block_stride + (size_t)part * l->part_bytes;
    return KVA_OK;
}

kva_status kva_kv_layer_info(kva_kv *kv, uint32_t layer, kva_kv_layer *out) {
    /* Reads only geometry fixed at creation: no lock. */
    if (!kv || !out) return kva_fail(KVA_ERR_INVALID, "cache or out is NULL");
    if (kv->info.mode != KVA_KV_PAGED) return kva_fail(KVA_ERR_INVALID, "layer geometry needs paged mode");
    if (layer >= kv->info.layers)
        return kva_fail(KVA_ERR_INVALID, "layer %u out of range (%u layers)", layer, kv->info.layers);
    kv_layer_geometry(kv, layer, out);
    return KVA_OK;
}

static kva_status evict_locked(kva_kv *kv, uint32_t max_blocks, uint32_t *evicted) {
    uint32_t count = kv->info.mode == KVA_KV_PAGED ? kv_evict(kv, max_blocks, 1) : 0;
    if (evicted) *evicted = count;
    return KVA_OK;
}

kva_status kva_kv_evict(kva_kv *kv, uint32_t max_blocks, uint32_t *evicted) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_EVICT);
    if (st == KVA_OK) st = evict_locked(kv, max_blocks, evicted);
    kv_unlock(kv);
    return st;
}

/* A snapshot of the figures, taken under the lock. */
static void get_stats_locked(const kva_kv *kv, kva_kv_stats *out) {
    const kva_kv_counters *c = &kv->counters;
    kva_kv_stats st = {
        .num_blocks = kv->num_blocks,
        .free_blocks = kv->free_count,
        .used_blocks = kv->used_count,
        .cached_blocks = kv->cached_count,
        .registered_blocks = kv->registered_count,
        .sequences = kv->live_seqs,
        .pins = kv->live_pins,
        .trimmed_blocks = kv->info.mode == KVA_KV_PAGED ? kv->num_blocks - kv->backed_blocks : 0,
        .hit_tokens = c->hit_tokens,
        .query_tokens = c->query_tokens,
        .evictions = c->evictions,
        .cow_copies = c->cow_copies,
        .forks = c->forks,
        .allocations = c->allocations,
        .frees = c->frees,
        .appends = c->appends,
        .moves = c->moves,
        .moved_bytes = c->moved_bytes,
        .alloc_failures = c->alloc_failures,
        .rejected_calls = c->rejected_calls,
        .peak_used_blocks = kv->peak_used,
        .peak_cached_blocks = kv->peak_cached,
        .call_sample_period = kv->sample_period,
        .pinned_blocks = kv->pinned_count,
        .readmit_hit_tokens = c->readmit_hit_tokens,
        .readmit_query_tokens = c->readmit_query_tokens,
    };
    for (unsigned k = 0; k < KVA_KV_CALL_KINDS; k++) {
        st.kind_timed_calls[k] = kv->kind_timed_calls[k];
        st.kind_timed_ns[k] = kv->kind_timed_ns[k];
        st.timed_calls += kv->kind_timed_calls[k];
        st.timed_ns += kv->kind_timed_ns[k];
        for (unsigned b = 0; b < KVA_KV_LATENCY_BUCKETS; b++) {
            st.kind_ns_log2[k][b] = kv->kind_ns_log2[k][b];
            st.call_ns_log2[b] += kv->kind_ns_log2[k][b];
        }
    }
    int paged = kv->info.mode == KVA_KV_PAGED;
    st.bytes_in_use = paged ? (size_t)kv->used_count * kv->info.block_bytes : kv->contig_bytes;
    st.peak_bytes_in_use = paged ? (size_t)kv->peak_used * kv->info.block_bytes : kv->peak_contig_bytes;
    st.block_metadata_bytes = (size_t)kv->num_blocks * (sizeof *kv->blocks + kv->max_key_bytes +
                                                        (kv->loose_touched ? sizeof *kv->loose : 0) +
                                                        (kv->pins_touched ? sizeof *kv->pin_refs : 0)) +
                              (kv->buckets ? ((size_t)kv->bucket_mask + 1) * sizeof *kv->buckets : 0) +
                              (size_t)kv->lru_used * (KV_LRU_SEG * sizeof *kv->lru_ids + sizeof *kv->lru_segs);
    size_t tables = 0;
    for (uint32_t s = 0; s < kv->seq_slots; s++)
        tables += (size_t)kv->seqs[s].cap * sizeof(uint32_t) +
                  (kv->seqs[s].partial ? kv->block_tokens * sizeof(uint32_t) : 0);
    st.metadata_bytes = sizeof *kv + st.block_metadata_bytes + (size_t)kv->seq_capacity * sizeof *kv->seqs + tables +
                        (size_t)kv->event_capacity * sizeof(kva_kv_event);
    *out = st;
}

kva_status kva_kv_get_stats(kva_kv *kv, kva_kv_stats *out) {
    if (!kv || !out) return kva_fail(KVA_ERR_INVALID, "cache or out is NULL");
    /* The plain lock: reading the figures is neither timed nor a reason to publish. */
    kva_kv_stats st;
    pthread_mutex_lock(&kv->lock);
    get_stats_locked(kv, &st);
    pthread_mutex_unlock(&kv->lock);
    *out = st;
    return KVA_OK;
}

size_t kva_kv_struct_size(kva_kv_struct_id which) {
    switch (which) {
    case KVA_KV_STRUCT_CONFIG: return sizeof(kva_kv_config);
    case KVA_KV_STRUCT_INFO: return sizeof(kva_kv_info);
    case KVA_KV_STRUCT_COPY: return sizeof(kva_kv_copy);
    case KVA_KV_STRUCT_SEQ_INFO: return sizeof(kva_kv_seq_info);
    case KVA_KV_STRUCT_STATS: return sizeof(kva_kv_stats);
    case KVA_KV_STRUCT_CONTENT: return sizeof(kva_kv_content);
    case KVA_KV_STRUCT_BLOCK_COPY: return sizeof(kva_kv_block_copy);
    case KVA_KV_STRUCT_EVENT: return sizeof(kva_kv_event);
    case KVA_KV_STRUCT_GROUP: return sizeof(kva_kv_group);
    case KVA_KV_STRUCT_LAYER: return sizeof(kva_kv_layer);
    case KVA_KV_STRUCT_STEP: return sizeof(kva_kv_step);
    case KVA_KV_STRUCT_NAMESPACE_SHARE: return sizeof(kva_kv_namespace_share);
    }
    return 0;
}

kva_status kva_kv_reset_peaks(kva_kv *kv) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    pthread_mutex_lock(&kv->lock);
    kv->peak_used = kv->used_count;
    kv->peak_cached = kv->cached_count;
    kv->peak_contig_bytes = kv->contig_bytes;
    pthread_mutex_unlock(&kv->lock);
    return KVA_OK;
}

uint32_t kv_next_sample(kva_kv *kv) {
    if (kv->sample_period == 1) return 1;
    /* xorshift64: uniform in [1, 2 * period - 1], a mean of period */
    uint64_t x = kv->sample_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    kv->sample_state = x;
    return 1 + (uint32_t)(x % (2u * kv->sample_period - 1));
}

void kv_time_start(kva_kv *kv, kva_kv_call_kind kind) {
    kv->countdown = kv_next_sample(kv);
    kv->timing = (uint32_t)kind + 1;
    kv->call_start_ns = kva_os_monotonic_ns();
}

void kv_time_call(kva_kv *kv) {
    uint64_t ns = kva_os_monotonic_ns() - kv->call_start_ns;
    unsigned bucket = ns ? kva_log2(ns) : 0, kind = kv->timing - 1;
    kv->timing = 0;
    kv->kind_ns_log2[kind][bucket < KVA_KV_LATENCY_BUCKETS ? bucket : KVA_KV_LATENCY_BUCKETS - 1]++;
    kv->kind_timed_calls[kind]++;
    kv->kind_timed_ns[kind] += ns;
}
