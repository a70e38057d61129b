/*
 * region_host.c — host memory for a pool: the huge-page fallback chain, then NUMA binding,
 * first-touch faults, mlock and registration with the CUDA driver, each as the config asks.
 * The memory is private, or (kva_config.shared) a shared memory object mapped over the same
 * reservation, made anew for each page kind the chain tries (a hugetlb memfd, or a normal one
 * advised for transparent huge pages or not).
 */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_driver.h"
#include "numa.h"
#include "os.h"
#include "region.h"

static size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

/* Commits the reserved range [base, base+length) with one page kind; a range the config will
 * touch whole (prefault, lock, and pin: registration with the CUDA driver page-locks every
 * page) is counted by the kernel at once (KVA_OS_CHARGED). */
static kva_status commit_kind(const kva_config *cfg, unsigned char *base, size_t length, kva_page_kind kind) {
    kva_os_backing backing = cfg->prefault || cfg->lock || cfg->pin ? KVA_OS_CHARGED : KVA_OS_LAZY;
    if (kind == KVA_PAGE_KIND_THP && cfg->shared) {
        /* Whether a shared object gets huge pages is shmem's own setting. */
        kva_status st = kva_os_advise_thp(base, length);
        if (st != KVA_OK) return st;
        const char *why = kva_os_shmem_thp_unavailable();
        return why ? kva_fail(KVA_ERR_BACKEND, "transparent huge pages are %s", why) : KVA_OK;
    }
    if (cfg->shared) return KVA_OK; /* base pages or hugetlb: the object's own, mapped already */
    switch (kind) {
    case KVA_PAGE_KIND_HUGETLB: return kva_os_commit(base, length, KVA_OS_HUGETLB);
    case KVA_PAGE_KIND_THP: {
        kva_status st = kva_os_commit(base, length, backing);
        return st == KVA_OK ? kva_os_advise_thp(base, length) : st;
    }
    case KVA_PAGE_KIND_SMALL: return kva_os_commit(base, length, backing);
    case KVA_PAGE_KIND_DEVICE:
    case KVA_PAGE_KIND_EXTERNAL: break;
    }
    return kva_fail(KVA_ERR_INVALID, "unknown page kind %d", (int)kind);
}

/* Bytes per page of the kind: what prefault, the KV trim and the statistics count in. */
static size_t page_size_of(kva_page_kind kind) {
    return kind == KVA_PAGE_KIND_SMALL ? kva_os_page_size() : KVA_HUGE_PAGE_SIZE;
}

/* The bytes mapped for a capacity of length: whole pages of the kind. Only hugetlb needs whole
 * 2 MiB pages; a transparent huge page range ends at the base page after the capacity, since a
 * huge page in the tail would be memory the pool never uses (faulted in by prefault, counted
 * against RLIMIT_MEMLOCK by lock). Its last partial 2 MiB gets base pages. */
static size_t mapped_length(size_t length, kva_page_kind kind) {
    return round_up(length, kind == KVA_PAGE_KIND_HUGETLB ? KVA_HUGE_PAGE_SIZE : kva_os_page_size());
}

/* A shared region's object for one attempt of the chain, mapped over the reservation: hugetlb
 * pages or normal ones (which commit_kind then advises for transparent huge pages or not). */
static kva_status map_shared(void *reserved, size_t mapped, kva_page_kind kind, int *fd_out) {
    int fd;
    kva_status st = kva_os_shared_create(mapped, kind == KVA_PAGE_KIND_HUGETLB, &fd);
    if (st != KVA_OK) return st;
    st = kva_os_shared_commit(reserved, mapped, fd);
    if (st != KVA_OK) {
        kva_os_close(fd);
        return st;
    }
    *fd_out = fd;
    return KVA_OK;
}

/* One attempt of the chain: reserve, commit with `kind`, bind, prefault. On failure nothing
 * stays mapped or open; *fall_through says whether the next page kind may still succeed.
 * *fd_out: the shared object's descriptor, -1 for private memory. */
static kva_status map_kind(const kva_config *cfg, size_t length, size_t alignment, kva_page_kind kind,
                           unsigned char **out, int *fd_out, int *fall_through) {
    /* A fresh reservation per attempt: a failed MAP_FIXED may already have discarded part of the
     * range it was meant to replace, so a reservation is never reused after one. */
    void *reserved;
    size_t mapped = mapped_length(length, kind);
    *fall_through = 0;
    kva_status st = kva_os_reserve(mapped, alignment, &reserved);
    if (st != KVA_OK) return st;
    *fall_through = 1;
    int fd = -1;
    if (cfg->shared) st = map_shared(reserved, mapped, kind, &fd);
    if (st == KVA_OK) st = commit_kind(cfg, reserved, mapped, kind);
    /* The policy is set before anything touches the memory, so every page obeys it. A refusal
     * is no matter of page size: the chain stops. */
    if (st == KVA_OK && cfg->numa_node >= 0) {
        st = kva_numa_bind(reserved, mapped, cfg->numa_node, cfg->numa_policy);
        *fall_through = st == KVA_OK;
    }
    if (st == KVA_OK && cfg->prefault) st = kva_os_populate(reserved, mapped);
    if (st != KVA_OK) {
        kva_os_unmap(reserved, mapped);
        kva_os_close(fd);
        return st;
    }
    *out = reserved;
    *fd_out = fd;
    return KVA_OK;
}

kva_status kva_region_host_create(const kva_config *cfg, size_t length, size_t alignment, kva_region *out) {
    static const kva_page_kind chain[] = {KVA_PAGE_KIND_HUGETLB, KVA_PAGE_KIND_THP, KVA_PAGE_KIND_SMALL};
    size_t first = 0, last = 2;
    switch (cfg->pages) {
    case KVA_PAGES_AUTO: break;
    case KVA_PAGES_HUGETLB: first = last = 0; break;
    case KVA_PAGES_THP: first = last = 1; break;
    case KVA_PAGES_SMALL: first = last = 2; break;
    default: return kva_fail(KVA_ERR_INVALID, "unknown page mode %d", (int)cfg->pages);
    }
    /* Checked before anything is mapped: a node that does not exist is a bad config. */
    kva_status st = cfg->numa_node >= 0 ? kva_numa_check_node(cfg->numa_node) : KVA_OK;
    if (st != KVA_OK) return st;

    /* 2 MiB-aligned whatever the kind, so that every whole 2 MiB of a huge-page pool can be one
     * page; the pool still manages exactly its capacity. */
    if (alignment < KVA_HUGE_PAGE_SIZE) alignment = KVA_HUGE_PAGE_SIZE;
    unsigned char *base = NULL;
    int fd = -1;
    size_t i = first;
    for (int fall_through = 1; i <= last; i++) {
        st = map_kind(cfg, length, alignment, chain[i], &base, &fd, &fall_through);
        if (st == KVA_OK || !fall_through) break;
    }
    if (st != KVA_OK) return st;

    size_t mapped = mapped_length(length, chain[i]);
    kva_region region = {.base = base,
                         .length = mapped,
                         .backend = KVA_BACKEND_HOST,
                         .page_kind = chain[i],
                         .page_size = page_size_of(chain[i]),
                         .numa_node = cfg->numa_node,
                         .shared_fd = fd};
    if (cfg->lock) {
        st = kva_os_lock(base, mapped);
        if (st != KVA_OK) goto fail;
        region.locked = 1;
    }
    if (cfg->pin) {
        kva_cuda_device *dev = calloc(1, sizeof *dev);
        if (!dev) {
            st = kva_fail(KVA_ERR_NOMEM, "no host memory for the CUDA device record");
            goto fail;
        }
        st = kva_cuda_device_open(cfg->device, 0, dev);
        if (st == KVA_OK) {
            st = kva_cuda_pin(dev, base, mapped);
            if (st != KVA_OK) kva_cuda_device_close(dev);
        }
        if (st != KVA_OK) {
            free(dev);
            char why[200];
            snprintf(why, sizeof why, "%s", kva_last_error());
            st = kva_fail(st, "pin (register the pool with the CUDA driver): %s", why);
            goto fail;
        }
        region.pinned = dev;
    }
    *out = region;
    return KVA_OK;

fail:
    kva_os_unmap(base, mapped);
    kva_os_close(fd);
    return st;
}

void kva_region_host_destroy(kva_region *region) {
    if (region->pinned) {
        kva_cuda_unpin(region->pinned, region->base);
        kva_cuda_device_close(region->pinned);
        free(region->pinned);
        region->pinned = NULL;
    }
    kva_os_unmap(region->base, region->length);
    kva_os_close(region->shared_fd);
    region->shared_fd = -1;
    region->base = NULL;
    region->length = 0;
}
