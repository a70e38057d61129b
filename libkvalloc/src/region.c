/*
 * region.c — the region interface (region.h) dispatched to its backend.
 */
#include "os.h"
#include "region.h"
#include "region_cuda.h"

kva_status kva_region_create(const kva_config *cfg, size_t length, size_t alignment, kva_region *out) {
    if (cfg->external) return kva_region_external_create(cfg, length, alignment, out);
    return cfg->backend == KVA_BACKEND_CUDA ? kva_region_cuda_create(cfg, length, alignment, out)
                                            : kva_region_host_create(cfg, length, alignment, out);
}

void kva_region_destroy(kva_region *region) {
    if (region->external) kva_region_external_destroy(region);
    else if (region->device) kva_region_cuda_destroy(region);
    else kva_region_host_destroy(region);
}

kva_status kva_region_trim(kva_region *region) {
    return region->device ? kva_cuda_region_trim(region->device) : KVA_OK;
}

size_t kva_region_mapped_bytes(const kva_region *region) {
    return region->device ? kva_cuda_region_mapped_bytes(region->device) : region->length;
}

kva_status kva_region_share(kva_region *region, int *fd) {
    if (region->device && region->device->shareable) return kva_cuda_region_export(region->device, fd);
    if (region->shared_fd < 0) return kva_fail(KVA_ERR_INVALID, "the pool is not shared (kva_config.shared)");
    return kva_os_shared_dup(region->shared_fd, fd);
}
