/*
 * fake_cuda.c — a stand-in for the CUDA driver (libcuda.so.1), so that the CUDA backend's
 * mapping, trimming and error paths run in CI without a GPU. libkvalloc loads it when
 * $KVA_CUDA_DRIVER names it.
 *
 * It exports the driver functions libkvalloc calls, and the few tools/gpu_check.py adds, with the
 * semantics the driver API documents, and checks their arguments at least as strictly:
 *  - nothing works before cuInit, and with no GPU cuInit fails with CUDA_ERROR_NO_DEVICE;
 *  - memory calls need a current context (cuCtxPushCurrent / cuCtxSetCurrent on this thread);
 *  - cuMemAddressReserve returns real addresses, reserved PROT_NONE in this process, so a CPU
 *    access to "device memory" faults as it would on a GPU;
 *  - cuMemCreate sizes and cuMemMap addresses must be multiples of the granularity; a mapping
 *    must lie inside one reservation, over nothing already mapped, at offset 0 of its handle;
 *  - cuMemSetAccess needs the whole range mapped; cuMemUnmap must cover whole mappings;
 *  - cuMemRelease of a mapped handle succeeds, and the memory is freed at its last unmap (as
 *    the driver documents); cuMemAddressFree refuses a range that still has mappings;
 *  - device memory is finite: cuMemCreate beyond it returns CUDA_ERROR_OUT_OF_MEMORY;
 *  - the last release of a device's primary context resets the device: its memory is freed,
 *    mapped or not (reservations stay).
 *  - shareable allocations (requestedHandleTypes CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) are
 *    backed by a memfd: cuMemExportToShareableHandle gives a new descriptor of it, only for an
 *    allocation that asked for that handle type, flags 0; cuMemImportFromShareableHandle takes
 *    only such a descriptor (anything else is CUDA_ERROR_INVALID_VALUE) and makes a handle of
 *    this process over the same memory, which another process's copies then see; imported
 *    memory is counted on the exporter's device, not again. allocFlags.gpuDirectRDMACapable is
 *    refused (CUDA_ERROR_NOT_SUPPORTED) unless the device reports
 *    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED (FAKE_CUDA_RDMA=1).
 *  - streams and events: a stream's work completes at once unless a test holds the stream
 *    (fake_cuda_stream_hold), and then only when it is released or waited for (cuEventSynchronize,
 *    cuStreamSynchronize, cuCtxSynchronize); cuEventQuery says CUDA_ERROR_NOT_READY while the
 *    work recorded before the event is not done; an unknown stream or event, or an event never
 *    recorded where one is needed, is CUDA_ERROR_INVALID_HANDLE; the streams 0, CU_STREAM_LEGACY
 *    (1) and CU_STREAM_PER_THREAD (2) always exist.
 *  - a gate (fake_cuda_gate): while a test keeps it closed, calls of the one function named wait at
 *    its entry, before taking the fake's lock, so that a test can hold a caller inside a driver call
 *    (fake_cuda_gate_await returns once one waits).
 * cuMemcpyHtoD/DtoH copy to and from a host shadow of each allocation, made on first use (the
 * memfd's pages for a shareable one).
 *
 * Control. The environment, read when the library is loaded:
 *   FAKE_CUDA_DEVICES=n        GPUs (default 1; 0 is a machine without one)
 *   FAKE_CUDA_MEMORY=bytes     memory of each GPU (default 1 GiB)
 *   FAKE_CUDA_GRANULARITY=b    allocation granularity, a power of two (default 2 MiB)
 *   FAKE_CUDA_NO_VMM=1         devices without virtual memory management
 *   FAKE_CUDA_RDMA=1           devices that report GPUDirect RDMA with VMM allocations
 *   FAKE_CUDA_FAIL=fn:n:code[,fn:n:code...]   the n-th call of fn returns code ("*": of any fn)
 *   FAKE_CUDA_ALIAS=n          a broken driver: the n-th cuMemMap (n >= 2) maps the memory the
 *                              one before it mapped instead of the allocation named, so that two
 *                              granules share memory (for the test that tools/gpu_check.py
 *                              notices)
 * and, for C tests that dlopen this same library, the fake_cuda_* functions at the end.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_driver.h"

#define SHAREABLE_NAME "fake-cuda-allocation" /* the memfd behind a shareable allocation */

typedef struct CUstream_st *CUstream_fake;
typedef struct CUevent_st *CUevent_fake;

#define API __attribute__((visibility("default")))
#define MAX_DEVICES 16
#define MAX_RULES 16
#define MAX_CALL_NAMES 64
#define CONTEXT_STACK 16
#define HANDLE_BASE 0x4000u /* handles are index + HANDLE_BASE: a 0 or a small number is no handle */

struct CUctx_st {
    int device;
    unsigned retains;
};

typedef struct {
    uintptr_t base;
    size_t size;
} reservation;

typedef struct {
    size_t size;
    int device;
    int released; /* the handle is gone; the memory lives on while mapped */
    int freed;    /* the memory is gone too */
    unsigned maps;
    unsigned char *shadow;
    int fd;       /* shareable: the memfd holding the memory; -1 otherwise */
    int imported; /* made by cuMemImportFromShareableHandle: counted on the exporter's device */
    int rdma;     /* allocFlags.gpuDirectRDMACapable */
} allocation;

typedef struct {
    uintptr_t va;
    size_t size;
    size_t alloc; /* index into allocs */
    int access;   /* CUmemAccess_flags; 0 until cuMemSetAccess */
    int legacy;   /* made by cuMemAlloc: reservation and handle are its own */
} mapping;

typedef struct {
    void *p;
    size_t size;
} registration;

typedef struct {
    char name[48];
    unsigned long target; /* fires when the counter of name reaches it */
    CUresult code;
} rule;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int devices;
    size_t memory, granularity;
    int vmm;
    int rdma;
    unsigned long alias;
} config, env_config;
static int initialized;
static struct CUctx_st contexts[MAX_DEVICES];
static size_t used[MAX_DEVICES];
static reservation *reservations;
static size_t nreservations, reservations_cap;
static allocation *allocs;
static size_t nallocs, allocs_cap;
static mapping *mappings;
static size_t nmappings, mappings_cap;
static registration *registrations;
static size_t nregistrations, registrations_cap;
static struct {
    char name[48];
    unsigned long count;
} calls[MAX_CALL_NAMES];
static unsigned long total_calls;
static rule rules[MAX_RULES];
static size_t nrules;
static char last_fired[48];
static _Thread_local CUcontext stack[CONTEXT_STACK];
static _Thread_local int depth;

/* Grows a dynamic array by one element; 0 if host memory ran out. */
static int grow(void **array, size_t *count, size_t *cap, size_t elem) {
    if (*count == *cap) {
        size_t next = *cap ? *cap * 2 : 64;
        void *p = realloc(*array, next * elem);
        if (!p) return 0;
        *array = p;
        *cap = next;
    }
    (*count)++;
    return 1;
}

static unsigned long *counter(const char *name) {
    for (size_t i = 0; i < MAX_CALL_NAMES; i++) {
        if (calls[i].name[0] == '\0') snprintf(calls[i].name, sizeof calls[i].name, "%s", name);
        if (strcmp(calls[i].name, name) == 0) return &calls[i].count;
    }
    return NULL;
}

/* Counts the call and returns the code an armed rule makes it fail with, else CUDA_SUCCESS. */
static CUresult enter_call(const char *name) {
    unsigned long *count = counter(name);
    unsigned long mine = count ? ++*count : 0;
    ++total_calls;
    for (size_t i = 0; i < nrules; i++) {
        int any = strcmp(rules[i].name, "*") == 0;
        int due = any ? total_calls == rules[i].target : strcmp(rules[i].name, name) == 0 && mine == rules[i].target;
        if (due) {
            CUresult code = rules[i].code;
            snprintf(last_fired, sizeof last_fired, "%s", name);
            rules[i] = rules[--nrules];
            return code;
        }
    }
    return CUDA_SUCCESS;
}

/* The gate (fake_cuda_gate): calls of gate_function wait here while it is closed. */
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_changed = PTHREAD_COND_INITIALIZER;
static char gate_function[64];
static int gate_closed;
static unsigned gate_waiting;

static void gate_pass(const char *function) {
    pthread_mutex_lock(&gate_lock);
    if (gate_closed && strcmp(function, gate_function) == 0) {
        gate_waiting++;
        pthread_cond_broadcast(&gate_changed);
        while (gate_closed) pthread_cond_wait(&gate_changed, &gate_lock);
        gate_waiting--;
    }
    pthread_mutex_unlock(&gate_lock);
}

/* Every entry point starts here: locks, counts, applies injected failures, and (need > 0)
 * checks cuInit and (need > 1) a current context. */
#define BEGIN(need)                                                                                  \
    pthread_mutex_lock(&lock);                                                                       \
    CUresult result_ = enter_call(__func__);                                                         \
    if (result_ == CUDA_SUCCESS && (need) > 0 && !initialized) result_ = CUDA_ERROR_NOT_INITIALIZED; \
    if (result_ == CUDA_SUCCESS && (need) > 1 && (depth == 0 || stack[depth - 1] == NULL))           \
        result_ = CUDA_ERROR_INVALID_CONTEXT;                                                        \
    if (result_ != CUDA_SUCCESS) return finish(result_)
#define NEED_INIT 1
#define NEED_CONTEXT 2

static CUresult finish(CUresult result) {
    pthread_mutex_unlock(&lock);
    return result;
}

static size_t parse_size(const char *text, size_t fallback) {
    if (!text || !*text) return fallback;
    char *end;
    unsigned long long v = strtoull(text, &end, 0);
    return end != text ? (size_t)v : fallback;
}

/* Arms the rules of a "fn:n:code,..." list. */
static void parse_rules(const char *text) {
    while (text && *text && nrules < MAX_RULES) {
        rule r = {0};
        int used_chars = 0;
        unsigned long nth;
        int code;
        if (sscanf(text, "%47[^:]:%lu:%d%n", r.name, &nth, &code, &used_chars) != 3) return;
        unsigned long *count = strcmp(r.name, "*") == 0 ? &total_calls : counter(r.name);
        r.target = (count ? *count : 0) + nth;
        r.code = code;
        rules[nrules++] = r;
        text += used_chars;
        if (*text == ',') text++;
    }
}

__attribute__((constructor)) static void read_environment(void) {
    const char *devices = getenv("FAKE_CUDA_DEVICES");
    env_config.devices = devices && *devices ? atoi(devices) : 1;
    if (env_config.devices > MAX_DEVICES) env_config.devices = MAX_DEVICES;
    env_config.memory = parse_size(getenv("FAKE_CUDA_MEMORY"), (size_t)1 << 30);
    env_config.granularity = parse_size(getenv("FAKE_CUDA_GRANULARITY"), (size_t)2 << 20);
    const char *no_vmm = getenv("FAKE_CUDA_NO_VMM");
    env_config.vmm = !(no_vmm && *no_vmm && strcmp(no_vmm, "0") != 0);
    const char *alias = getenv("FAKE_CUDA_ALIAS");
    env_config.alias = alias && *alias ? strtoul(alias, NULL, 10) : 0;
    const char *rdma = getenv("FAKE_CUDA_RDMA");
    env_config.rdma = rdma && *rdma && strcmp(rdma, "0") != 0;
    config = env_config;
    parse_rules(getenv("FAKE_CUDA_FAIL"));
}

static int valid_device(int device) { return device >= 0 && device < config.devices; }

static int valid_context(CUcontext ctx) {
    return ctx >= contexts && ctx < contexts + MAX_DEVICES && valid_device(ctx->device) && ctx->retains > 0;
}

static int current_device(void) { return stack[depth - 1]->device; }

static int valid_prop(const CUmemAllocationProp *prop) {
    return prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
           (prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_NONE ||
            prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) &&
           prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->win32HandleMetaData == NULL &&
           prop->allocFlags.gpuDirectRDMACapable <= 1;
}

static int aligned(uintptr_t value) { return (value & (config.granularity - 1)) == 0; }

static allocation *alloc_of(CUmemGenericAllocationHandle handle) {
    if (handle < HANDLE_BASE || handle - HANDLE_BASE >= nallocs) return NULL;
    allocation *a = &allocs[handle - HANDLE_BASE];
    return a->released ? NULL : a;
}

static reservation *reservation_holding(uintptr_t va, size_t size) {
    for (size_t i = 0; i < nreservations; i++)
        if (va >= reservations[i].base && va - reservations[i].base + size <= reservations[i].size)
            return &reservations[i];
    return NULL;
}

static int overlaps(uintptr_t a, size_t asize, uintptr_t b, size_t bsize) { return a < b + bsize && b < a + asize; }

static void free_if_done(allocation *a) {
    if (!a->released || a->maps || a->freed) return;
    a->freed = 1;
    if (!a->imported) used[a->device] -= a->size;
    if (a->shadow) munmap(a->shadow, a->size);
    a->shadow = NULL;
    if (a->fd >= 0) close(a->fd);
    a->fd = -1;
}

/* ---- initialization, devices, contexts ---------------------------------------------------- */

API CUresult cuInit(unsigned flags) {
    gate_pass(__func__);
    BEGIN(0);
    if (flags != 0) return finish(CUDA_ERROR_INVALID_VALUE);
    if (config.devices <= 0) return finish(CUDA_ERROR_NO_DEVICE);
    initialized = 1;
    return finish(CUDA_SUCCESS);
}

API CUresult cuDriverGetVersion(int *version) {
    BEGIN(0);
    if (!version) return finish(CUDA_ERROR_INVALID_VALUE);
    *version = 12040;
    return finish(CUDA_SUCCESS);
}

API CUresult cuDeviceGetCount(int *count) {
    BEGIN(NEED_INIT);
    if (!count) return finish(CUDA_ERROR_INVALID_VALUE);
    *count = config.devices;
    return finish(CUDA_SUCCESS);
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    BEGIN(NEED_INIT);
    if (!device) return finish(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(ordinal)) return finish(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    return finish(CUDA_SUCCESS);
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    BEGIN(NEED_INIT);
    if (!name || len <= 0) return finish(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(device)) return finish(CUDA_ERROR_INVALID_DEVICE);
    snprintf(name, (size_t)len, "Fake CUDA GPU %d", device);
    return finish(CUDA_SUCCESS);
}

API CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    BEGIN(NEED_INIT);
    if (!value) return finish(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(device)) return finish(CUDA_ERROR_INVALID_DEVICE);
    switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *value = config.vmm; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: *value = config.vmm; break;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: *value = config.vmm && config.rdma; break;
    default: return finish(CUDA_ERROR_INVALID_VALUE);
    }
    return finish(CUDA_SUCCESS);
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice device) {
    BEGIN(NEED_INIT);
    if (!bytes) return finish(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(device)) return finish(CUDA_ERROR_INVALID_DEVICE);
    *bytes = config.memory;
    return finish(CUDA_SUCCESS);
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    BEGIN(NEED_INIT);
    if (!ctx) return finish(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(device)) return finish(CUDA_ERROR_INVALID_DEVICE);
    contexts[device].device = device;
    contexts[device].retains++;
    *ctx = &contexts[device];
    return finish(CUDA_SUCCESS);
}

static void unmap_at(size_t m);

/* The last release of a device's primary context resets it, as the driver documents ("the
 * context is automatically reset once the last reference to it is released"): its device memory
 * goes, mapped or not, handle or not. Address reservations stay: they are the process's address
 * space, given back by cuMemAddressFree alone. */
static void reset_device(int device) {
    for (size_t m = nmappings; m-- > 0;) {
        if (allocs[mappings[m].alloc].device != device) continue;
        uintptr_t va = mappings[m].va;
        size_t size = mappings[m].size;
        int legacy = mappings[m].legacy;
        unmap_at(m);
        if (legacy) munmap((void *)va, size);
    }
    for (size_t i = 0; i < nallocs; i++) {
        if (allocs[i].device != device || allocs[i].freed) continue;
        allocs[i].released = 1;
        free_if_done(&allocs[i]);
    }
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    BEGIN(NEED_INIT);
    if (!valid_device(device)) return finish(CUDA_ERROR_INVALID_DEVICE);
    if (contexts[device].retains == 0) return finish(CUDA_ERROR_INVALID_CONTEXT);
    if (--contexts[device].retains == 0) reset_device(device);
    return finish(CUDA_SUCCESS);
}

API CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    BEGIN(NEED_INIT);
    if (!valid_context(ctx)) return finish(CUDA_ERROR_INVALID_CONTEXT);
    if (depth == CONTEXT_STACK) return finish(CUDA_ERROR_UNKNOWN);
    stack[depth++] = ctx;
    return finish(CUDA_SUCCESS);
}

API CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
    BEGIN(NEED_INIT);
    if (depth == 0) return finish(CUDA_ERROR_INVALID_CONTEXT);
    CUcontext top = stack[--depth];
    if (ctx) *ctx = top;
    return finish(CUDA_SUCCESS);
}

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    BEGIN(NEED_INIT);
    if (ctx && !valid_context(ctx)) return finish(CUDA_ERROR_INVALID_CONTEXT);
    if (depth == 0) {
        if (ctx) stack[depth++] = ctx;
    } else {
        stack[depth - 1] = ctx;
        if (!ctx) depth--;
    }
    return finish(CUDA_SUCCESS);
}

static void complete_all_streams(void);

API CUresult cuCtxSynchronize(void) {
    BEGIN(NEED_CONTEXT);
    complete_all_streams();
    return finish(CUDA_SUCCESS);
}

/* ---- virtual memory management ------------------------------------------------------------ */

API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
    BEGIN(NEED_INIT);
    if (!granularity || !valid_prop(prop) || (option != 0 && option != 1)) return finish(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(prop->location.id)) return finish(CUDA_ERROR_INVALID_DEVICE);
    *granularity = config.granularity;
    return finish(CUDA_SUCCESS);
}

/* Reserves size bytes of PROT_NONE address space aligned to alignment; 0 if mmap refused. */
static uintptr_t reserve_space(size_t size, size_t alignment) {
    size_t span = size + alignment;
    void *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return 0;
    uintptr_t start = (uintptr_t)raw, base = (start + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (base > start) munmap(raw, base - start);
    if (start + span > base + size) munmap((void *)(base + size), start + span - (base + size));
    return base;
}

API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                 unsigned long long flags) {
    BEGIN(NEED_CONTEXT);
    (void)addr; /* a hint only */
    if (!ptr || size == 0 || !aligned(size) || flags != 0 || (alignment & (alignment - 1)))
        return finish(CUDA_ERROR_INVALID_VALUE);
    if (alignment < config.granularity) alignment = config.granularity;
    uintptr_t base = reserve_space(size, alignment);
    if (!base) return finish(CUDA_ERROR_OUT_OF_MEMORY);
    if (!grow((void **)&reservations, &nreservations, &reservations_cap, sizeof *reservations)) {
        munmap((void *)base, size);
        return finish(CUDA_ERROR_OUT_OF_MEMORY);
    }
    reservations[nreservations - 1] = (reservation){.base = base, .size = size};
    *ptr = base;
    return finish(CUDA_SUCCESS);
}

API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    BEGIN(NEED_INIT);
    for (size_t i = 0; i < nreservations; i++) {
        if (reservations[i].base != ptr || reservations[i].size != size) continue;
        for (size_t m = 0; m < nmappings; m++)
            if (overlaps(mappings[m].va, mappings[m].size, ptr, size)) return finish(CUDA_ERROR_INVALID_VALUE);
        munmap((void *)(uintptr_t)ptr, size);
        reservations[i] = reservations[--nreservations];
        return finish(CUDA_SUCCESS);
    }
    return finish(CUDA_ERROR_INVALID_VALUE);
}

/* A new allocation of size bytes on device; CUDA_SUCCESS and its index, or why not. */
static CUresult create(size_t size, int device, size_t *index) {
    if (size == 0 || !aligned(size)) return CUDA_ERROR_INVALID_VALUE;
    if (used[device] + size > config.memory) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!grow((void **)&allocs, &nallocs, &allocs_cap, sizeof *allocs)) return CUDA_ERROR_OUT_OF_MEMORY;
    allocs[nallocs - 1] = (allocation){.size = size, .device = device, .fd = -1};
    used[device] += size;
    *index = nallocs - 1;
    return CUDA_SUCCESS;
}

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                         unsigned long long flags) {
    BEGIN(NEED_CONTEXT);
    if (!handle || !valid_prop(prop) || flags != 0) return finish(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(prop->location.id)) return finish(CUDA_ERROR_INVALID_DEVICE);
    if (prop->allocFlags.gpuDirectRDMACapable && !config.rdma) return finish(CUDA_ERROR_NOT_SUPPORTED);
    int fd = -1;
    if (prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        fd = memfd_create(SHAREABLE_NAME, MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
            if (fd >= 0) close(fd);
            return finish(CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    size_t index;
    CUresult r = create(size, prop->location.id, &index);
    if (r != CUDA_SUCCESS) {
        if (fd >= 0) close(fd);
        return finish(r);
    }
    allocs[index].fd = fd;
    allocs[index].rdma = prop->allocFlags.gpuDirectRDMACapable;
    *handle = index + HANDLE_BASE;
    return finish(CUDA_SUCCESS);
}

API CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle, int type,
                                          unsigned long long flags) {
    BEGIN(NEED_INIT);
    allocation *a = alloc_of(handle);
    if (!shareable || !a || flags != 0) return finish(CUDA_ERROR_INVALID_VALUE);
    /* Only the type the allocation was made for can be exported. */
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || a->fd < 0) return finish(CUDA_ERROR_INVALID_VALUE);
    int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return finish(CUDA_ERROR_OUT_OF_MEMORY);
    *(int *)shareable = fd;
    return finish(CUDA_SUCCESS);
}

/* Whether fd is a descriptor this fake exported: a memfd of SHAREABLE_NAME. */
static int exported_here(int fd, size_t *size) {
    struct stat st;
    char link[64], target[128];
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return 0;
    target[n] = '\0';
    if (strcmp(target, "/memfd:" SHAREABLE_NAME " (deleted)") != 0) return 0;
    *size = (size_t)st.st_size;
    return 1;
}

API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type) {
    gate_pass(__func__);
    BEGIN(NEED_INIT);
    int fd = (int)(intptr_t)os_handle;
    size_t size;
    if (!handle || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !exported_here(fd, &size))
        return finish(CUDA_ERROR_INVALID_VALUE);
    int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0) return finish(CUDA_ERROR_OUT_OF_MEMORY);
    if (!grow((void **)&allocs, &nallocs, &allocs_cap, sizeof *allocs)) {
        close(mine);
        return finish(CUDA_ERROR_OUT_OF_MEMORY);
    }
    /* The device the memory lives on is the exporter's; this fake has one numbering for all. */
    allocs[nallocs - 1] = (allocation){.size = size, .device = 0, .fd = mine, .imported = 1};
    *handle = nallocs - 1 + HANDLE_BASE;
    return finish(CUDA_SUCCESS);
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    BEGIN(NEED_INIT);
    allocation *a = alloc_of(handle);
    if (!a) return finish(CUDA_ERROR_INVALID_VALUE);
    a->released = 1;
    free_if_done(a);
    return finish(CUDA_SUCCESS);
}

static CUresult map(uintptr_t va, size_t size, size_t index, int legacy) {
    for (size_t m = 0; m < nmappings; m++)
        if (overlaps(mappings[m].va, mappings[m].size, va, size)) return CUDA_ERROR_ALREADY_MAPPED;
    if (!grow((void **)&mappings, &nmappings, &mappings_cap, sizeof *mappings)) return CUDA_ERROR_OUT_OF_MEMORY;
    mappings[nmappings - 1] = (mapping){.va = va, .size = size, .alloc = index, .legacy = legacy};
    allocs[index].maps++;
    return CUDA_SUCCESS;
}

API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags) {
    BEGIN(NEED_CONTEXT);
    allocation *a = alloc_of(handle);
    if (!a || flags != 0 || offset != 0 || size == 0 || !aligned(ptr) || !aligned(size) || size > a->size)
        return finish(CUDA_ERROR_INVALID_VALUE);
    if (!reservation_holding(ptr, size)) return finish(CUDA_ERROR_INVALID_VALUE);
    size_t index = (size_t)(a - allocs);
    static unsigned long vmm_maps;
    static size_t previous; /* the allocation the map before this one mapped */
    if (config.alias >= 2 && ++vmm_maps == config.alias && allocs[previous].size >= size && !allocs[previous].freed)
        index = previous;
    previous = index;
    return finish(map(ptr, size, index, 0));
}

/* Whether [va, va+size) is covered by mappings, each at least `access`. */
static int covered(uintptr_t va, size_t size, int access) {
    uintptr_t at = va, end = va + size;
    while (at < end) {
        size_t m = 0;
        while (m < nmappings && !(mappings[m].va <= at && at < mappings[m].va + mappings[m].size)) m++;
        if (m == nmappings || (mappings[m].access & access) != access) return 0;
        at = mappings[m].va + mappings[m].size;
    }
    return 1;
}

API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    BEGIN(NEED_CONTEXT);
    if (!desc || count == 0 || size == 0) return finish(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return finish(CUDA_ERROR_INVALID_VALUE);
        if (!valid_device(desc[i].location.id)) return finish(CUDA_ERROR_INVALID_DEVICE);
        if (desc[i].flags != 0 && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return finish(CUDA_ERROR_INVALID_VALUE);
    }
    if (!covered(ptr, size, 0)) return finish(CUDA_ERROR_INVALID_VALUE);
    for (size_t m = 0; m < nmappings; m++)
        if (mappings[m].va >= ptr && mappings[m].va < ptr + size) mappings[m].access = desc[count - 1].flags;
    return finish(CUDA_SUCCESS);
}

static void unmap_at(size_t m) {
    allocation *a = &allocs[mappings[m].alloc];
    a->maps--;
    free_if_done(a);
    mappings[m] = mappings[--nmappings];
}

API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    BEGIN(NEED_INIT);
    if (size == 0 || !aligned(ptr) || !aligned(size) || !covered(ptr, size, 0)) return finish(CUDA_ERROR_INVALID_VALUE);
    for (size_t m = 0; m < nmappings; m++) {
        const mapping *mp = &mappings[m];
        if (overlaps(mp->va, mp->size, ptr, size) && (mp->va < ptr || mp->va + mp->size > ptr + size || mp->legacy))
            return finish(CUDA_ERROR_INVALID_VALUE);
    }
    for (size_t m = nmappings; m-- > 0;)
        if (overlaps(mappings[m].va, mappings[m].size, ptr, size)) unmap_at(m);
    return finish(CUDA_SUCCESS);
}

/* ---- streams and events --------------------------------------------------------------------- */

#define MAX_STREAMS 64
#define MAX_EVENTS 4096
#define BUILTIN_STREAMS 3 /* 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD */
#define CUDA_ERROR_NOT_READY_ 600

typedef struct {
    int live, held;
    unsigned long submitted, completed; /* work items recorded and done */
} stream_state;

typedef struct {
    int live, recorded;
    size_t stream;
    unsigned long seq;
} event_state;

static stream_state streams[MAX_STREAMS] = {{1, 0, 0, 0}, {1, 0, 0, 0}, {1, 0, 0, 0}};
static event_state events[MAX_EVENTS];
static unsigned long live_events;

/* The index of a stream handle (0, 1, 2 or one cuStreamCreate made), or MAX_STREAMS. */
static size_t stream_index(CUstream_fake s) {
    uintptr_t v = (uintptr_t)s;
    size_t i = v < BUILTIN_STREAMS ? v : v >= 0x1000 && v < 0x1000 + MAX_STREAMS ? v - 0x1000 : MAX_STREAMS;
    return i < MAX_STREAMS && streams[i].live ? i : MAX_STREAMS;
}

static event_state *event_of(CUevent_fake e) {
    uintptr_t v = (uintptr_t)e;
    if (v < 0x100000 || v - 0x100000 >= MAX_EVENTS) return NULL;
    event_state *ev = &events[v - 0x100000];
    return ev->live ? ev : NULL;
}

static void complete(size_t i) { streams[i].completed = streams[i].submitted; }

API CUresult cuStreamCreate(CUstream_fake *out, unsigned flags) {
    BEGIN(NEED_CONTEXT);
    if (!out || flags > 1) return finish(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = BUILTIN_STREAMS; i < MAX_STREAMS; i++) {
        if (streams[i].live) continue;
        streams[i] = (stream_state){.live = 1};
        *out = (CUstream_fake)(uintptr_t)(0x1000 + i);
        return finish(CUDA_SUCCESS);
    }
    return finish(CUDA_ERROR_OUT_OF_MEMORY);
}

API CUresult cuStreamDestroy_v2(CUstream_fake s) {
    BEGIN(NEED_INIT);
    size_t i = stream_index(s);
    if (i == MAX_STREAMS || i < BUILTIN_STREAMS) return finish(CUDA_ERROR_INVALID_HANDLE);
    streams[i].live = 0; /* its work still completes, as the driver documents */
    return finish(CUDA_SUCCESS);
}

API CUresult cuStreamSynchronize(CUstream_fake s) {
    BEGIN(NEED_CONTEXT);
    size_t i = stream_index(s);
    if (i == MAX_STREAMS) return finish(CUDA_ERROR_INVALID_HANDLE);
    complete(i);
    return finish(CUDA_SUCCESS);
}

API CUresult cuEventCreate(CUevent_fake *out, unsigned flags) {
    BEGIN(NEED_CONTEXT);
    if (!out || (flags & ~0x7u)) return finish(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < MAX_EVENTS; i++) {
        if (events[i].live) continue;
        events[i] = (event_state){.live = 1};
        live_events++;
        *out = (CUevent_fake)(uintptr_t)(0x100000 + i);
        return finish(CUDA_SUCCESS);
    }
    return finish(CUDA_ERROR_OUT_OF_MEMORY);
}

API CUresult cuEventRecord(CUevent_fake e, CUstream_fake s) {
    BEGIN(NEED_CONTEXT);
    event_state *ev = event_of(e);
    size_t i = stream_index(s);
    if (!ev || i == MAX_STREAMS) return finish(CUDA_ERROR_INVALID_HANDLE);
    ev->recorded = 1;
    ev->stream = i;
    ev->seq = ++streams[i].submitted;
    if (!streams[i].held) complete(i);
    return finish(CUDA_SUCCESS);
}

API CUresult cuEventQuery(CUevent_fake e) {
    BEGIN(NEED_INIT);
    event_state *ev = event_of(e);
    if (!ev) return finish(CUDA_ERROR_INVALID_HANDLE);
    /* An event never recorded has no work to wait for: done, as the driver says. */
    int done = !ev->recorded || streams[ev->stream].completed >= ev->seq;
    return finish(done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY_);
}

API CUresult cuEventSynchronize(CUevent_fake e) {
    BEGIN(NEED_INIT);
    event_state *ev = event_of(e);
    if (!ev) return finish(CUDA_ERROR_INVALID_HANDLE);
    /* The wait ends when the work is done: here, the work is done by waiting. */
    if (ev->recorded && streams[ev->stream].completed < ev->seq) streams[ev->stream].completed = ev->seq;
    return finish(CUDA_SUCCESS);
}

API CUresult cuEventDestroy_v2(CUevent_fake e) {
    BEGIN(NEED_INIT);
    event_state *ev = event_of(e);
    if (!ev) return finish(CUDA_ERROR_INVALID_HANDLE);
    ev->live = 0;
    live_events--;
    return finish(CUDA_SUCCESS);
}

static void complete_all_streams(void) {
    for (size_t i = 0; i < MAX_STREAMS; i++) complete(i);
}

/* A held stream's work stays pending until it is released (or waited for). */
API void fake_cuda_stream_hold(CUstream_fake s, int held) {
    pthread_mutex_lock(&lock);
    size_t i = stream_index(s);
    if (i < MAX_STREAMS) {
        streams[i].held = held;
        if (!held) complete(i);
    }
    pthread_mutex_unlock(&lock);
}

/* Events created and not yet destroyed. */
API unsigned long fake_cuda_live_events(void) { return live_events; }

/* ---- the classic allocator and copies, for tools/gpu_check.py ----------------------------- */

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    BEGIN(NEED_CONTEXT);
    if (!dptr || bytesize == 0) return finish(CUDA_ERROR_INVALID_VALUE);
    size_t size = (bytesize + config.granularity - 1) & ~(config.granularity - 1), index;
    CUresult r = create(size, current_device(), &index);
    if (r != CUDA_SUCCESS) return finish(r);
    uintptr_t base = reserve_space(size, config.granularity);
    if (!base || map(base, size, index, 1) != CUDA_SUCCESS) {
        if (base) munmap((void *)base, size);
        allocs[index].released = 1;
        free_if_done(&allocs[index]);
        return finish(CUDA_ERROR_OUT_OF_MEMORY);
    }
    mappings[nmappings - 1].access = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    allocs[index].released = 1; /* lives while mapped, like a VMM allocation released early */
    *dptr = base;
    return finish(CUDA_SUCCESS);
}

API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    BEGIN(NEED_CONTEXT);
    for (size_t m = 0; m < nmappings; m++) {
        if (mappings[m].va != dptr || !mappings[m].legacy) continue;
        size_t size = mappings[m].size;
        unmap_at(m);
        munmap((void *)(uintptr_t)dptr, size);
        return finish(CUDA_SUCCESS);
    }
    return finish(CUDA_ERROR_INVALID_VALUE);
}

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    BEGIN(NEED_CONTEXT);
    if (!free_bytes || !total_bytes) return finish(CUDA_ERROR_INVALID_VALUE);
    *total_bytes = config.memory;
    *free_bytes = config.memory - used[current_device()];
    return finish(CUDA_SUCCESS);
}

/* Copies between host memory and the shadows of the mappings over [va, va+size). */
static CUresult copy(uintptr_t va, unsigned char *host, size_t size, int to_device) {
    if (!covered(va, size, to_device ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ))
        return CUDA_ERROR_INVALID_VALUE;
    while (size) {
        size_t m = 0;
        while (!(mappings[m].va <= va && va < mappings[m].va + mappings[m].size)) m++;
        allocation *a = &allocs[mappings[m].alloc];
        if (!a->shadow) {
            void *p = a->fd >= 0 ? mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0)
                                 : mmap(NULL, a->size, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
            a->shadow = p;
        }
        size_t at = va - mappings[m].va, n = mappings[m].size - at < size ? mappings[m].size - at : size;
        if (to_device) memcpy(a->shadow + at, host, n);
        else memcpy(host, a->shadow + at, n);
        va += n;
        host += n;
        size -= n;
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t size) {
    BEGIN(NEED_CONTEXT);
    if (!src) return finish(CUDA_ERROR_INVALID_VALUE);
    return finish(size ? copy(dst, (unsigned char *)(uintptr_t)src, size, 1) : CUDA_SUCCESS);
}

API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t size) {
    BEGIN(NEED_CONTEXT);
    if (!dst) return finish(CUDA_ERROR_INVALID_VALUE);
    return finish(size ? copy(src, dst, size, 0) : CUDA_SUCCESS);
}

/* ---- page-locked host memory ---------------------------------------------------------------- */

API CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned flags) {
    BEGIN(NEED_CONTEXT);
    if (!p || size == 0 || (flags & ~0x0fu)) return finish(CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < nregistrations; i++)
        if (overlaps((uintptr_t)registrations[i].p, registrations[i].size, (uintptr_t)p, size))
            return finish(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    if (!grow((void **)&registrations, &nregistrations, &registrations_cap, sizeof *registrations))
        return finish(CUDA_ERROR_OUT_OF_MEMORY);
    registrations[nregistrations - 1] = (registration){.p = p, .size = size};
    return finish(CUDA_SUCCESS);
}

API CUresult cuMemHostUnregister(void *p) {
    BEGIN(NEED_CONTEXT);
    for (size_t i = 0; i < nregistrations; i++) {
        if (registrations[i].p != p) continue;
        registrations[i] = registrations[--nregistrations];
        return finish(CUDA_SUCCESS);
    }
    return finish(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
}

/* ---- errors ------------------------------------------------------------------------------- */

static const struct {
    CUresult code;
    const char *name, *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult describe(CUresult error, const char **out, int name) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++) {
        if (errors[i].code != error) continue;
        *out = name ? errors[i].name : errors[i].text;
        return CUDA_SUCCESS;
    }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* Like the driver's, these two work before cuInit and are not counted. */
API CUresult cuGetErrorName(CUresult error, const char **name) { return describe(error, name, 1); }
API CUresult cuGetErrorString(CUresult error, const char **text) { return describe(error, text, 0); }

/* ---- control, for the tests ------------------------------------------------------------------ */

/* Closes the gate on `function` (cuInit or cuMemImportFromShareableHandle: the entry points that
 * pass it), or opens it (closed 0) and lets every waiting call go on. */
API void fake_cuda_gate(const char *function, int closed) {
    pthread_mutex_lock(&gate_lock);
    if (closed) snprintf(gate_function, sizeof gate_function, "%s", function);
    gate_closed = closed;
    pthread_cond_broadcast(&gate_changed);
    pthread_mutex_unlock(&gate_lock);
}

/* Waits until at least one call waits at the closed gate. */
API void fake_cuda_gate_await(void) {
    pthread_mutex_lock(&gate_lock);
    while (gate_waiting == 0) pthread_cond_wait(&gate_changed, &gate_lock);
    pthread_mutex_unlock(&gate_lock);
}

/* Back to the state of a fresh load, except that cuInit stays done: every reservation, mapping,
 * allocation and context reference forgotten (their address space returned), counters zero,
 * rules disarmed, the environment's configuration. */
API void fake_cuda_reset(void) {
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nreservations; i++) munmap((void *)reservations[i].base, reservations[i].size);
    for (size_t m = 0; m < nmappings; m++)
        if (mappings[m].legacy) munmap((void *)mappings[m].va, mappings[m].size);
    for (size_t i = 0; i < nallocs; i++) {
        if (allocs[i].shadow) munmap(allocs[i].shadow, allocs[i].size);
        if (allocs[i].fd >= 0 && !allocs[i].freed) close(allocs[i].fd);
    }
    nreservations = nallocs = nmappings = nregistrations = 0;
    memset(events, 0, sizeof events);
    live_events = 0;
    for (size_t i = 0; i < MAX_STREAMS; i++) streams[i] = (stream_state){.live = i < BUILTIN_STREAMS};
    memset(used, 0, sizeof used);
    memset(contexts, 0, sizeof contexts);
    memset(calls, 0, sizeof calls);
    total_calls = 0;
    nrules = 0;
    last_fired[0] = '\0';
    config = env_config;
    pthread_mutex_unlock(&lock);
}

API void fake_cuda_set_devices(int n) {
    pthread_mutex_lock(&lock);
    config.devices = n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
    pthread_mutex_unlock(&lock);
}

API void fake_cuda_set_memory(size_t bytes) {
    pthread_mutex_lock(&lock);
    config.memory = bytes;
    pthread_mutex_unlock(&lock);
}

API void fake_cuda_set_granularity(size_t bytes) {
    pthread_mutex_lock(&lock);
    config.granularity = bytes;
    pthread_mutex_unlock(&lock);
}

API void fake_cuda_set_rdma(int supported) {
    pthread_mutex_lock(&lock);
    config.rdma = supported;
    pthread_mutex_unlock(&lock);
}

/* Live allocations made GPUDirect RDMA capable. */
API size_t fake_cuda_rdma_allocations(void) {
    pthread_mutex_lock(&lock);
    size_t n = 0;
    for (size_t i = 0; i < nallocs; i++) n += allocs[i].rdma && !allocs[i].freed;
    pthread_mutex_unlock(&lock);
    return n;
}

API void fake_cuda_set_vmm(int supported) {
    pthread_mutex_lock(&lock);
    config.vmm = supported;
    pthread_mutex_unlock(&lock);
}

/* The nth call from now of `function` ("*": of any) returns code. */
API void fake_cuda_fail(const char *function, unsigned long nth, int code) {
    char text[96];
    snprintf(text, sizeof text, "%s:%lu:%d", function, nth, code);
    pthread_mutex_lock(&lock);
    parse_rules(text);
    pthread_mutex_unlock(&lock);
}

/* Disarms every rule not yet fired. */
API void fake_cuda_disarm(void) {
    pthread_mutex_lock(&lock);
    nrules = 0;
    pthread_mutex_unlock(&lock);
}

/* The function whose injected failure fired last ("" if none has). */
API const char *fake_cuda_last_fired(void) { return last_fired; }

/* Calls of `function` (its exported name) since the load or the last reset; "*": of all. */
API unsigned long fake_cuda_calls(const char *function) {
    pthread_mutex_lock(&lock);
    unsigned long n = 0;
    if (strcmp(function, "*") == 0) n = total_calls;
    else
        for (size_t i = 0; i < MAX_CALL_NAMES && calls[i].name[0]; i++)
            if (strcmp(calls[i].name, function) == 0) n = calls[i].count;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Device memory not yet freed, over all devices. */
API size_t fake_cuda_used_bytes(void) {
    pthread_mutex_lock(&lock);
    size_t n = 0;
    for (int d = 0; d < MAX_DEVICES; d++) n += used[d];
    pthread_mutex_unlock(&lock);
    return n;
}

/* Handles made by cuMemCreate and not yet released. */
API size_t fake_cuda_live_handles(void) {
    pthread_mutex_lock(&lock);
    size_t n = 0;
    for (size_t i = 0; i < nallocs; i++) n += !allocs[i].released;
    pthread_mutex_unlock(&lock);
    return n;
}

API size_t fake_cuda_mappings(void) { return nmappings; }
API size_t fake_cuda_reservations(void) { return nreservations; }
API size_t fake_cuda_registrations(void) { return nregistrations; }
API unsigned fake_cuda_retains(int device) { return valid_device(device) ? contexts[device].retains : 0; }
API int fake_cuda_context_depth(void) { return depth; }
