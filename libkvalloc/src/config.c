/*
 * config.c — defaults and validation of kva_config.
 */
#include <string.h>

#include "config.h"
#include "os.h"

#define MIN_BLOCK_LOW ((size_t)256)
#define CHUNK_LOW ((size_t)64 << 10)
#define DEFAULT_CHUNK ((size_t)2 << 20)

void kva_config_init(kva_config *cfg) {
    if (!cfg) return;
    *cfg = (kva_config){
        .capacity = (size_t)64 << 20,
        .min_block = 4096,
        .slab_chunk = 0,
        .name = NULL,
        .pages = KVA_PAGES_AUTO,
        .prefault = 0,
        .trace = 0,
        .publish_interval_ms = 200,
        .backend = KVA_BACKEND_HOST,
        .device = 0,
        .numa_node = -1,
        .numa_policy = KVA_NUMA_BIND,
        .lock = 0,
        .pin = 0,
        .trim_watermark = 0,
        .external = NULL,
        .shared = 0,
    };
}

/* The default slab size: 2 MiB, or capacity / 32 in a small pool so that it can hold slabs of
 * many size classes at once; never below 64 KiB nor below min_block. */
static size_t auto_chunk(size_t capacity, size_t min_block) {
    size_t chunk = DEFAULT_CHUNK;
    while (chunk > CHUNK_LOW && chunk > capacity / 32) chunk /= 2;
    return chunk < min_block ? min_block : chunk;
}

static int valid_name(const char *name) {
    size_t len = strnlen(name, KVA_NAME_MAX + 1);
    if (len == 0 || len > KVA_NAME_MAX) return 0;
    for (size_t i = 0; i < len; i++) {
        char ch = name[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                 ch == '-' || ch == '.';
        if (!ok) return 0;
    }
    return 1;
}

/* The backend and the options that belong to it; the machine-dependent checks (does the NUMA
 * node or the GPU exist) happen when the region is made. */
static kva_status validate_backing(const kva_config *cfg) {
    if (cfg->backend != KVA_BACKEND_HOST && cfg->backend != KVA_BACKEND_CUDA)
        return kva_fail(KVA_ERR_INVALID, "unknown backend %d", (int)cfg->backend);
    if (cfg->device < 0) return kva_fail(KVA_ERR_INVALID, "device %d is negative", cfg->device);
    if (cfg->numa_node < -1)
        return kva_fail(KVA_ERR_INVALID, "numa_node %d: a node id, or -1 for none", cfg->numa_node);
    if (cfg->numa_policy != KVA_NUMA_BIND && cfg->numa_policy != KVA_NUMA_PREFERRED)
        return kva_fail(KVA_ERR_INVALID, "unknown numa_policy %d", (int)cfg->numa_policy);
    if (cfg->backend == KVA_BACKEND_CUDA) {
        const char *host_only = cfg->numa_node >= 0            ? "numa_node"
                                : cfg->lock                    ? "lock"
                                : cfg->checked                 ? "checked"
                                : cfg->pin                     ? "pin"
                                : cfg->pages != KVA_PAGES_AUTO ? "pages"
                                                               : NULL;
        if (host_only)
            return kva_fail(KVA_ERR_INVALID, "%s applies to host memory; a CUDA pool cannot use it", host_only);
    } else if (cfg->trim_watermark && !cfg->external) {
        return kva_fail(KVA_ERR_INVALID, "trim_watermark applies to CUDA pools; host memory is never unmapped");
    }
    return KVA_OK;
}

/* An external range (kva_config.external): what does not apply to memory the library never
 * touches, the page rule, and the slab chunk the base's alignment allows. *chunk is the slab
 * size the config asked for, or 0 for automatic; it comes back as the one to use. */
static kva_status validate_external(const kva_config *cfg, size_t *chunk) {
    const char *not_here = cfg->pages != KVA_PAGES_AUTO ? "pages"
                           : cfg->prefault              ? "prefault"
                           : cfg->lock                  ? "lock"
                           : cfg->pin                   ? "pin"
                           : cfg->numa_node >= 0        ? "numa_node"
                           : cfg->trim_watermark        ? "trim_watermark"
                           : cfg->checked               ? "checked"
                           : cfg->shared                ? "shared"
                                                        : NULL;
    if (not_here)
        return kva_fail(KVA_ERR_INVALID, "%s does not apply to an external range: its memory is the caller's",
                        not_here);
    uintptr_t base = (uintptr_t)cfg->external;
    size_t page = kva_os_page_size();
    if (cfg->capacity % page)
        return kva_fail(KVA_ERR_INVALID, "external range of %zu bytes is not a multiple of the %zu-byte page",
                        cfg->capacity, page);
    if (base + cfg->capacity < base)
        return kva_fail(KVA_ERR_INVALID, "external range at %p of %zu bytes wraps around the address space",
                        cfg->external, cfg->capacity);
    size_t aligned = (size_t)1 << kva_ctz64(base);
    size_t want = *chunk ? *chunk : auto_chunk(cfg->capacity, cfg->min_block);
    if (!*chunk && want > aligned) want = aligned > cfg->min_block ? aligned : cfg->min_block;
    if (base % page || aligned < CHUNK_LOW || aligned < want)
        return kva_fail(KVA_ERR_INVALID,
                        "external base %p is not a multiple of the slab chunk (%zu bytes; at least 64 KiB, and "
                        "of the %zu-byte page)",
                        cfg->external, want < CHUNK_LOW ? CHUNK_LOW : want, page);
    *chunk = want;
    return KVA_OK;
}

kva_status kva_config_validate(const kva_config *cfg, kva_geometry *out) {
    if (!cfg) return kva_fail(KVA_ERR_INVALID, "config is NULL");
    if (!kva_is_pow2(cfg->min_block) || cfg->min_block < MIN_BLOCK_LOW || cfg->min_block > KVA_MIN_BLOCK_MAX)
        return kva_fail(KVA_ERR_INVALID, "min_block %zu is not a power of two in [%zu, %zu]", cfg->min_block,
                        MIN_BLOCK_LOW, KVA_MIN_BLOCK_MAX);
    size_t chunk = cfg->slab_chunk;
    if (cfg->external) {
        kva_status st = validate_external(cfg, &chunk);
        if (st != KVA_OK) return st;
    } else if (!chunk) {
        chunk = auto_chunk(cfg->capacity, cfg->min_block);
    }
    if (!kva_is_pow2(chunk) || chunk < CHUNK_LOW || chunk > KVA_SLAB_CHUNK_MAX)
        return kva_fail(KVA_ERR_INVALID, "slab_chunk %zu is not a power of two in [%zu, %zu]", chunk, CHUNK_LOW,
                        KVA_SLAB_CHUNK_MAX);
    if (chunk < cfg->min_block)
        return kva_fail(KVA_ERR_INVALID, "slab_chunk %zu is smaller than min_block %zu", chunk, cfg->min_block);
    if (cfg->capacity < cfg->min_block)
        return kva_fail(KVA_ERR_INVALID, "capacity %zu is below one block of %zu bytes", cfg->capacity, cfg->min_block);
    unsigned min_shift = kva_log2(cfg->min_block);
    size_t nblocks = cfg->capacity >> min_shift;
    /* Block indices are u32 with UINT32_MAX reserved as "none". */
    if (nblocks >= KVA_NIL)
        return kva_fail(KVA_ERR_INVALID, "capacity %zu needs %zu blocks of %zu bytes; at most %u fit", cfg->capacity,
                        nblocks, cfg->min_block, KVA_NIL - 1);
    if (cfg->pages < KVA_PAGES_AUTO || cfg->pages > KVA_PAGES_SMALL)
        return kva_fail(KVA_ERR_INVALID, "unknown page mode %d", (int)cfg->pages);
    if (cfg->name && !valid_name(cfg->name))
        return kva_fail(KVA_ERR_INVALID, "pool name must be 1..%d characters of [A-Za-z0-9_.-]", KVA_NAME_MAX);
    if (cfg->arenas > KVA_MAX_ARENAS)
        return kva_fail(KVA_ERR_INVALID, "arenas %u: at most %d (0: one per CPU)", cfg->arenas, KVA_MAX_ARENAS);
    kva_status st = validate_backing(cfg);
    if (st != KVA_OK) return st;
    out->min_shift = min_shift;
    out->nblocks = (uint32_t)nblocks;
    out->capacity = nblocks << min_shift;
    out->chunk_shift = kva_log2(chunk);
    out->num_orders = kva_log2((uint32_t)nblocks) + 1;
    if (cfg->external) {
        /* P1: the largest block divides the base. validate_external saw it holds a slab. */
        unsigned base_orders = kva_ctz64((uintptr_t)cfg->external) - min_shift + 1;
        if (base_orders < out->num_orders) out->num_orders = base_orders;
    }
    return KVA_OK;
}
