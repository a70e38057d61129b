/*
 * os_linux.c — the Linux implementation of os.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "os.h"

#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif
#ifndef MAP_HUGE_2MB
#define MAP_HUGE_2MB (21 << MAP_HUGE_SHIFT)
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

size_t kva_os_page_size(void) {
    long size = sysconf(_SC_PAGESIZE);
    return size > 0 ? (size_t)size : 4096;
}

kva_status kva_os_reserve(size_t length, size_t alignment, void **out) {
    /* Over-reserve by the alignment, then trim both ends: the kernel only promises page
     * alignment, and buddy blocks must be aligned to their size in absolute addresses. */
    size_t span = length + alignment;
    if (span < length) return kva_fail(KVA_ERR_INVALID, "reservation of %zu bytes overflows", length);
    void *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return kva_fail(KVA_ERR_BACKEND, "mmap reserve of %zu bytes: %s", span, strerror(errno));
    uintptr_t start = (uintptr_t)raw;
    uintptr_t aligned = (start + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (aligned > start) munmap(raw, aligned - start);
    uintptr_t end = aligned + length;
    if (start + span > end) munmap((void *)end, start + span - end);
    *out = (void *)aligned;
    return KVA_OK;
}

kva_status kva_os_commit(void *addr, size_t length, int huge) {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED;
    if (huge) flags |= MAP_HUGETLB | MAP_HUGE_2MB;
    void *p = mmap(addr, length, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        return kva_fail(KVA_ERR_BACKEND, "mmap%s of %zu bytes: %s", huge ? " MAP_HUGETLB" : "", length,
                        strerror(err));
    }
    return KVA_OK;
}

kva_status kva_os_advise_thp(void *addr, size_t length) {
    if (madvise(addr, length, MADV_HUGEPAGE) != 0)
        return kva_fail(KVA_ERR_BACKEND, "madvise(MADV_HUGEPAGE): %s", strerror(errno));
    return KVA_OK;
}

kva_status kva_os_populate(void *addr, size_t length, size_t page_size) {
    if (madvise(addr, length, MADV_POPULATE_WRITE) == 0) return KVA_OK;
    if (errno != EINVAL)
        return kva_fail(KVA_ERR_BACKEND, "madvise(MADV_POPULATE_WRITE): %s", strerror(errno));
    /* Kernels before 5.14 lack MADV_POPULATE_WRITE: touch one byte per page instead. The memory
     * is fresh and zero, so writing zero changes nothing but the page tables. */
    volatile unsigned char *bytes = addr;
    for (size_t off = 0; off < length; off += page_size) bytes[off] = 0;
    return KVA_OK;
}

kva_status kva_os_map_metadata(size_t length, void **out) {
    void *p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return kva_fail(KVA_ERR_BACKEND, "mmap of %zu metadata bytes: %s", length, strerror(errno));
    *out = p;
    return KVA_OK;
}

void kva_os_unmap(void *addr, size_t length) {
    if (addr && length) munmap(addr, length);
}

kva_status kva_os_shm_create(const char *name, size_t length, void **out) {
    shm_unlink(name);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return kva_fail(KVA_ERR_BACKEND, "shm_open(%s): %s", name, strerror(errno));
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)length) != 0) {
        int err = errno;
        close(fd);
        shm_unlink(name);
        return kva_fail(KVA_ERR_BACKEND, "sizing %s to %zu bytes: %s", name, length, strerror(err));
    }
    void *p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(name);
        return kva_fail(KVA_ERR_BACKEND, "mmap of %s: %s", name, strerror(err));
    }
    *out = p;
    return KVA_OK;
}

void kva_os_shm_unlink(const char *name) { shm_unlink(name); }

static uint64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t kva_os_realtime_ns(void) { return clock_ns(CLOCK_REALTIME); }
uint64_t kva_os_monotonic_ns(void) { return clock_ns(CLOCK_MONOTONIC); }
/* Cached per thread: the trace path must not make a system call per record. */
unsigned kva_os_thread_id(void) {
    static _Thread_local unsigned tid;
    if (tid == 0) tid = (unsigned)syscall(SYS_gettid);
    return tid;
}
unsigned kva_os_pid(void) { return (unsigned)getpid(); }
