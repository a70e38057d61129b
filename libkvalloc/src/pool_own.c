/*
 * pool_own.c — creating the pools the library makes for itself (pool_own.h).
 */
#include "os.h"
#include "pool_own.h"

kva_status kva_pool_create_own(kva_config *cfg, kva_pool **out) {
    if (cfg->pages == KVA_PAGES_THP && cfg->backend == KVA_BACKEND_HOST && kva_os_thp_unavailable())
        cfg->pages = KVA_PAGES_SMALL;
    return kva_pool_create(cfg, out);
}
