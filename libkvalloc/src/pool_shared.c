/*
 * pool_shared.c — a shared pool's memory seen from other processes (kva_config.shared): the
 * descriptor its owner exports, and the maps an attaching process makes of it. An attached map
 * is memory only; the allocator and its metadata stay in the owning process.
 */
#include <stdlib.h>

#include "os.h"
#include "pool.h"

struct kva_shared_map {
    void *base;
    size_t length;
};

kva_status kva_pool_shared_fd(kva_pool *pool, int *fd) {
    if (!pool || !fd) return kva_fail(KVA_ERR_INVALID, "pool or fd is NULL");
    if (pool->region.shared_fd < 0)
        return kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID, "the pool is not shared (kva_config.shared)"));
    return kva_os_shared_dup(pool->region.shared_fd, fd);
}

kva_status kva_shared_attach(int fd, kva_shared_map **out) {
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");
    if (fd < 0) return kva_fail(KVA_ERR_INVALID, "descriptor %d is negative", fd);
    kva_shared_map *map = malloc(sizeof *map);
    if (!map) return kva_fail(KVA_ERR_NOMEM, "no host memory for the shared map record");
    kva_status st = kva_os_shared_map(fd, &map->base, &map->length);
    if (st != KVA_OK) {
        free(map);
        return st;
    }
    *out = map;
    return KVA_OK;
}

void *kva_shared_base(const kva_shared_map *map) { return map ? map->base : NULL; }
size_t kva_shared_length(const kva_shared_map *map) { return map ? map->length : 0; }

void kva_shared_detach(kva_shared_map *map) {
    if (!map) return;
    kva_os_unmap(map->base, map->length);
    free(map);
}
