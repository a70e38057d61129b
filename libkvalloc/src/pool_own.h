/*
 * pool_own.h — the pools the library makes for itself (pool_own.c): a KV cache's own and a
 * variable-size pool's own, beneath their owners.
 */
#ifndef KVA_POOL_OWN_H
#define KVA_POOL_OWN_H

#include "internal.h"

/* kva_pool_create for a pool the library makes for itself (a KV cache's or a variable-size
 * pool's own, whose configs default to transparent huge pages): where this process gets none
 * (a container runtime or a parent may deny them, kva_os_thp_unavailable), base pages instead,
 * since the caller asked for a pool and THP was only its page preference. cfg->pages says which
 * was used. */
kva_status kva_pool_create_own(kva_config *cfg, kva_pool **out);

#endif
