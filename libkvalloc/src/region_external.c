/*
 * region_external.c — a range of memory the caller owns (kva_config.external), host or device
 * memory: the region is its address and length, nothing more. Creating and destroying it never
 * touch the range (no mapping, binding, locking, registration, write or free), and commit,
 * decommit and trim do nothing (region.h: no device state, and kva_pool_range_unit gives 0).
 *
 * The process keeps a registry of the live external ranges, so that one range of memory is
 * never managed by two pools at once: two allocators over the same bytes would hand out the
 * same block twice. Host and device ranges share it, as they share one address space under
 * unified addressing. Creation paths only: a list under a lock.
 */
#include <pthread.h>
#include <stdlib.h>

#include "os.h"
#include "region.h"

struct kva_external_range {
    uintptr_t start, end; /* [start, end) */
    struct kva_external_range *next;
};

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static struct kva_external_range *registry;

void kva_external_registry_lock(void) { pthread_mutex_lock(&registry_lock); }
void kva_external_registry_unlock(void) { pthread_mutex_unlock(&registry_lock); }

kva_status kva_region_external_create(const kva_config *cfg, size_t length, size_t alignment, kva_region *out) {
    (void)length; /* the pool's capacity, rounded down to min_block: the whole range is cfg's */
    uintptr_t start = (uintptr_t)cfg->external, end = start + cfg->capacity;
    /* kva_config_validate made sure of it (the largest block divides the base). */
    if (start & (alignment - 1))
        return kva_fail(KVA_ERR_INVALID, "external base %p is not aligned to %zu", cfg->external, alignment);
    struct kva_external_range *range = malloc(sizeof *range);
    if (!range) return kva_fail(KVA_ERR_NOMEM, "no host memory for the external range's record");
    *range = (struct kva_external_range){.start = start, .end = end};
    pthread_mutex_lock(&registry_lock);
    for (const struct kva_external_range *r = registry; r; r = r->next) {
        if (r->start < end && start < r->end) {
            pthread_mutex_unlock(&registry_lock);
            free(range);
            return kva_fail(KVA_ERR_INVALID,
                            "external range [%p, %p) overlaps [%p, %p), which another live pool of this process "
                            "manages",
                            (void *)start, (void *)end, (void *)r->start, (void *)r->end);
        }
    }
    range->next = registry;
    registry = range;
    pthread_mutex_unlock(&registry_lock);
    *out = (kva_region){.base = cfg->external,
                        .length = cfg->capacity,
                        .backend = cfg->backend,
                        .page_kind = KVA_PAGE_KIND_EXTERNAL,
                        .page_size = kva_os_page_size(),
                        .numa_node = -1,
                        .external = range,
                        .shared_fd = -1};
    return KVA_OK;
}

void kva_region_external_destroy(kva_region *region) {
    struct kva_external_range *range = region->external;
    pthread_mutex_lock(&registry_lock);
    for (struct kva_external_range **link = &registry; *link; link = &(*link)->next) {
        if (*link == range) {
            *link = range->next;
            break;
        }
    }
    pthread_mutex_unlock(&registry_lock);
    free(range);
    region->external = NULL;
    region->base = NULL;
    region->length = 0;
}
