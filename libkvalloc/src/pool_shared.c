/*
 * pool_shared.c — a shared pool's memory seen from other processes (kva_config.shared): the
 * descriptor its owner exports, and the maps an attaching process makes of it, host memory
 * (a memfd mapped here) or device memory (a CUDA allocation imported and mapped here). A map is
 * memory only; the allocator and its metadata stay in the owning process.
 *
 * A CUDA allocation is imported at most once per process at a time: the process keeps the
 * identity (device and inode) of each descriptor it imported while the map lives, and refuses
 * the same one again. Two imports would be two handles and two device addresses over one
 * memory (the driver does not promise to return the same handle), which a caller would take
 * for two independent maps.
 */
#include <pthread.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "os.h"
#include "pool.h"

struct kva_shared_map {
    void *base;
    size_t length;
    kva_cuda_import *import; /* device memory; NULL for host memory */
    dev_t file_dev;          /* the imported descriptor's identity (device memory) */
    ino_t file_ino;
    struct kva_shared_map *next; /* in the list of imports */
};

static pthread_mutex_t imports_lock = PTHREAD_MUTEX_INITIALIZER;
static kva_shared_map *imports;

void kva_shared_imports_lock(void) { pthread_mutex_lock(&imports_lock); }
void kva_shared_imports_unlock(void) { pthread_mutex_unlock(&imports_lock); }

kva_status kva_pool_shared_fd(kva_pool *pool, int *fd) {
    if (!pool || !fd) return kva_fail(KVA_ERR_INVALID, "pool or fd is NULL");
    pthread_mutex_lock(&pool->lock);
    kva_status st = kva_region_share(&pool->region, fd);
    pthread_mutex_unlock(&pool->lock);
    return st == KVA_ERR_INVALID ? kva_pool_reject(pool, st) : st;
}

kva_status kva_shared_attach(int fd, kva_shared_map **out) {
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");
    if (fd < 0) return kva_fail(KVA_ERR_INVALID, "descriptor %d is negative", fd);
    kva_shared_map *map = calloc(1, sizeof *map);
    if (!map) return kva_fail(KVA_ERR_NOMEM, "no host memory for the shared map record");
    kva_status st = kva_os_shared_map(fd, &map->base, &map->length);
    if (st != KVA_OK) {
        free(map);
        return st;
    }
    *out = map;
    return KVA_OK;
}

kva_status kva_shared_attach_cuda(int device, int fd, size_t length, kva_shared_map **out) {
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");
    if (fd < 0 || device < 0) return kva_fail(KVA_ERR_INVALID, "descriptor %d or device %d is negative", fd, device);
    struct stat st_fd;
    if (fstat(fd, &st_fd) != 0) return kva_fail(KVA_ERR_INVALID, "descriptor %d is not open", fd);
    kva_shared_map *map = calloc(1, sizeof *map);
    if (!map) return kva_fail(KVA_ERR_NOMEM, "no host memory for the shared map record");
    map->file_dev = st_fd.st_dev;
    map->file_ino = st_fd.st_ino;
    pthread_mutex_lock(&imports_lock);
    for (const kva_shared_map *m = imports; m; m = m->next) {
        if (m->file_dev == map->file_dev && m->file_ino == map->file_ino) {
            pthread_mutex_unlock(&imports_lock);
            free(map);
            return kva_fail(KVA_ERR_INVALID, "descriptor %d names an allocation this process imported already", fd);
        }
    }
    /* Imported under the lock, so that two threads cannot both import one allocation. */
    kva_status st = kva_cuda_import_map(device, fd, length, &map->base, &map->import);
    if (st == KVA_OK) {
        map->length = length;
        map->next = imports;
        imports = map;
    }
    pthread_mutex_unlock(&imports_lock);
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
    if (map->import) {
        pthread_mutex_lock(&imports_lock);
        for (kva_shared_map **link = &imports; *link; link = &(*link)->next) {
            if (*link == map) {
                *link = map->next;
                break;
            }
        }
        pthread_mutex_unlock(&imports_lock);
        kva_cuda_import_unmap(map->import);
    } else {
        kva_os_unmap(map->base, map->length);
    }
    free(map);
}
