/*
 * pool_range.c — giving back, and taking again, the memory behind part of a live allocation
 * (pool_range.h).
 */
#include "os.h"
#include "pool.h"
#include "pool_range.h"

size_t kva_pool_range_unit(kva_pool *pool) {
    /* Prefaulted memory was promised to stay; locked or pinned host memory cannot be discarded;
     * a checked pool's free bytes must keep their poison; hugetlb pages were reserved up front
     * on purpose, and a discarded one may not come back (the reservation is not restored on
     * every kernel: a later touch would be a SIGBUS, not an error); an external range is the
     * caller's, never the library's to give back. */
    if (pool->config.prefault || pool->region.locked || pool->region.pinned || pool->checked ||
        pool->region.page_kind == KVA_PAGE_KIND_HUGETLB || pool->region.external)
        return 0;
    return pool->region.page_size;
}

int kva_pool_range_shared(const kva_pool *pool) { return pool->region.shared_fd >= 0; }

kva_status kva_pool_range_release(kva_pool *pool, void *start, size_t length) {
    if (length == 0) return KVA_OK;
    if (pool->inherited_shared) return kva_pool_refuse_inherited();
    uint64_t offset = (uint64_t)((unsigned char *)start - pool->base);
    pthread_mutex_lock(&pool->lock);
    kva_status st = KVA_OK;
    if (pool->region.device) {
        /* Its granules' references drop to 0 and they are unmapped and released now. */
        st = kva_cuda_region_release(pool->region.device, offset, length);
    } else if (pool->region.shared_fd >= 0) {
        /* MADV_DONTNEED would only drop this process's view of pages other processes map: the
         * shared object's own pages are freed, and every mapping reads zero there. */
        st = kva_os_discard_shared(start, length);
    } else {
        st = kva_os_discard(start, length);
    }
    pthread_mutex_unlock(&pool->lock);
    return st;
}

kva_status kva_pool_range_take(kva_pool *pool, void *start, size_t length) {
    if (length == 0) return KVA_OK;
    if (pool->inherited_shared) return kva_pool_refuse_inherited();
    /* Host pages are faulted in now, so that a shortage is this call's error rather than a
     * later page fault's. */
    if (!pool->region.device) return kva_os_populate(start, length);
    pthread_mutex_lock(&pool->lock);
    kva_status st = kva_cuda_region_take(pool->region.device, (uint64_t)((unsigned char *)start - pool->base), length);
    pthread_mutex_unlock(&pool->lock);
    return st;
}
