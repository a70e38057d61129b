/*
 * cuda_driver.c — loading the CUDA driver, opening a GPU, and the driver's errors in words.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cuda_driver.h"
#include "os.h"

#define DRIVER_ENV "KVA_CUDA_DRIVER"
#define DRIVER_DEFAULT "libcuda.so.1"

/* Where each function is found. The _v2 names are those cuda.h maps the API names to. */
static const struct {
    const char *symbol;
    size_t offset;
    int optional;
} symbols[] = {
/* (clang-format 14 would move a macro's brace initializer onto a line of its own) */
/* clang-format off */
#define FN(field, symbol) {symbol, offsetof(kva_cuda_driver, field), 0}
    /* clang-format on */
    FN(cuInit, "cuInit"),
    FN(cuDeviceGetCount, "cuDeviceGetCount"),
    FN(cuDeviceGet, "cuDeviceGet"),
    FN(cuDeviceGetAttribute, "cuDeviceGetAttribute"),
    FN(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    FN(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
    FN(cuCtxPushCurrent, "cuCtxPushCurrent_v2"),
    FN(cuCtxPopCurrent, "cuCtxPopCurrent_v2"),
    FN(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity"),
    FN(cuMemAddressReserve, "cuMemAddressReserve"),
    FN(cuMemAddressFree, "cuMemAddressFree"),
    FN(cuMemCreate, "cuMemCreate"),
    FN(cuMemRelease, "cuMemRelease"),
    FN(cuMemMap, "cuMemMap"),
    FN(cuMemUnmap, "cuMemUnmap"),
    FN(cuMemSetAccess, "cuMemSetAccess"),
    FN(cuMemHostRegister, "cuMemHostRegister_v2"),
    FN(cuMemHostUnregister, "cuMemHostUnregister"),
#undef FN
    {"cuMemExportToShareableHandle", offsetof(kva_cuda_driver, cuMemExportToShareableHandle), 1},
    {"cuMemImportFromShareableHandle", offsetof(kva_cuda_driver, cuMemImportFromShareableHandle), 1},
    {"cuGetErrorName", offsetof(kva_cuda_driver, cuGetErrorName), 1},
};

/* The process's driver: valid once `library` is set, read-only from then on. */
static kva_cuda_driver loaded;
static unsigned loaded_fork_depth; /* kva_os_fork_depth() when the driver was loaded and initialized */
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

void kva_cuda_load_lock(void) { pthread_mutex_lock(&load_lock); }
void kva_cuda_load_unlock(void) { pthread_mutex_unlock(&load_lock); }

static const char *error_name(const kva_cuda_driver *driver, CUresult result, char *buf, size_t len) {
    const char *name = NULL;
    if (driver->cuGetErrorName && driver->cuGetErrorName(result, &name) == CUDA_SUCCESS && name) return name;
    snprintf(buf, len, "CUresult %d", result);
    return buf;
}

kva_status kva_cuda_fail(const kva_cuda_driver *driver, CUresult result, const char *fmt, ...) {
    char what[192], buf[32];
    va_list args;
    va_start(args, fmt);
    vsnprintf(what, sizeof what, fmt, args);
    va_end(args);
    kva_status status = result == CUDA_ERROR_OUT_OF_MEMORY ? KVA_ERR_NOMEM : KVA_ERR_BACKEND;
    return kva_fail(status, "%s: %s", what, error_name(driver, result, buf, sizeof buf));
}

/* Fills *d from the library at path and initializes the driver; on failure nothing stays loaded. */
static kva_status load(const char *path, kva_cuda_driver *d) {
    memset(d, 0, sizeof *d);
    void *library;
    kva_status st = kva_os_library_open(path, &library);
    if (st != KVA_OK) {
        char why[160];
        snprintf(why, sizeof why, "%s", kva_last_error());
        return kva_fail(KVA_ERR_BACKEND, "no CUDA driver: %s (install the NVIDIA driver, or set %s to its library)",
                        why, DRIVER_ENV);
    }
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        void *fn = kva_os_library_symbol(library, symbols[i].symbol);
        if (!fn && !symbols[i].optional) {
            kva_os_library_close(library);
            return kva_fail(KVA_ERR_BACKEND, "the CUDA driver %s has no %s (a driver older than CUDA 11?)", path,
                            symbols[i].symbol);
        }
        memcpy((char *)d + symbols[i].offset, &fn, sizeof fn);
    }
    CUresult r = d->cuInit(0);
    if (r != CUDA_SUCCESS) {
        if (r == CUDA_ERROR_NO_DEVICE)
            st = kva_fail(KVA_ERR_BACKEND, "no CUDA GPU: cuInit reports CUDA_ERROR_NO_DEVICE (none is visible to this "
                                           "process; see CUDA_VISIBLE_DEVICES)");
        else st = kva_cuda_fail(d, r, "the CUDA driver %s failed to initialize (cuInit)", path);
        kva_os_library_close(library);
        memset(d, 0, sizeof *d);
        return st == KVA_ERR_NOMEM ? KVA_ERR_BACKEND : st;
    }
    d->library = library;
    snprintf(d->path, sizeof d->path, "%s", path);
    return KVA_OK;
}

static kva_status driver_get(const kva_cuda_driver **out) {
    pthread_mutex_lock(&load_lock);
    kva_status st = KVA_OK;
    if (!loaded.library) {
        const char *path = kva_os_getenv(DRIVER_ENV);
        kva_cuda_driver fresh;
        st = load(path && *path ? path : DRIVER_DEFAULT, &fresh);
        if (st == KVA_OK) {
            loaded = fresh;
            loaded_fork_depth = kva_os_fork_depth();
        }
    } else if (loaded_fork_depth != kva_os_fork_depth()) {
        /* Initialized by an ancestor: CUDA does not survive fork, so this process may not use
         * the driver at all, for new pools either (kva_cuda_inherited). */
        st = kva_fail(KVA_ERR_BACKEND, "the CUDA driver was initialized before this process was forked; CUDA does "
                                       "not survive fork, so a forked child cannot use it");
    }
    pthread_mutex_unlock(&load_lock);
    if (st == KVA_OK) *out = &loaded;
    return st;
}

kva_status kva_cuda_device_open(int ordinal, int need_vmm, kva_cuda_device *out) {
    const kva_cuda_driver *d;
    kva_status st = driver_get(&d);
    if (st != KVA_OK) return st;
    int count = 0;
    CUresult r = d->cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS) return kva_cuda_fail(d, r, "cuDeviceGetCount");
    if (count == 0) return kva_fail(KVA_ERR_BACKEND, "no CUDA GPU: the driver %s reports 0 devices", d->path);
    if (ordinal < 0 || ordinal >= count)
        return kva_fail(KVA_ERR_INVALID, "CUDA device %d does not exist: %d GPU(s) visible", ordinal, count);
    CUdevice device;
    r = d->cuDeviceGet(&device, ordinal);
    if (r != CUDA_SUCCESS) return kva_cuda_fail(d, r, "cuDeviceGet(%d)", ordinal);
    if (need_vmm) {
        int vmm = 0;
        r = d->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device);
        if (r != CUDA_SUCCESS) return kva_cuda_fail(d, r, "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
        if (!vmm)
            return kva_fail(KVA_ERR_BACKEND,
                            "CUDA device %d does not support virtual memory management "
                            "(cuMemCreate/cuMemMap), which CUDA pools need",
                            ordinal);
    }
    CUcontext context;
    r = d->cuDevicePrimaryCtxRetain(&context, device);
    if (r != CUDA_SUCCESS) {
        st = kva_cuda_fail(d, r, "cuDevicePrimaryCtxRetain of device %d", ordinal);
        return st == KVA_ERR_NOMEM ? KVA_ERR_BACKEND : st;
    }
    *out = (kva_cuda_device){.driver = d,
                             .ordinal = ordinal,
                             .device = device,
                             .context = context,
                             .fork_depth = kva_os_fork_depth()};
    return KVA_OK;
}

int kva_cuda_inherited(const kva_cuda_device *dev) { return dev->fork_depth != kva_os_fork_depth(); }

void kva_cuda_device_close(kva_cuda_device *dev) {
    if (!dev->driver) return;
    if (!kva_cuda_inherited(dev)) dev->driver->cuDevicePrimaryCtxRelease(dev->device);
    dev->driver = NULL;
}

kva_status kva_cuda_enter(const kva_cuda_device *dev) {
    if (kva_cuda_inherited(dev))
        return kva_fail(KVA_ERR_BACKEND,
                        "CUDA device %d was opened before this process was forked from its "
                        "opener; CUDA does not survive fork, so its pools here can only be destroyed",
                        dev->ordinal);
    CUresult r = dev->driver->cuCtxPushCurrent(dev->context);
    return r == CUDA_SUCCESS ? KVA_OK : kva_cuda_fail(dev->driver, r, "cuCtxPushCurrent on device %d", dev->ordinal);
}

void kva_cuda_leave(const kva_cuda_device *dev) {
    CUcontext popped;
    dev->driver->cuCtxPopCurrent(&popped);
}

kva_status kva_cuda_pin(const kva_cuda_device *dev, void *addr, size_t length) {
    kva_status st = kva_cuda_enter(dev);
    if (st != KVA_OK) return st;
    CUresult r = dev->driver->cuMemHostRegister(addr, length, CU_MEMHOSTREGISTER_PORTABLE);
    kva_cuda_leave(dev);
    if (r == CUDA_SUCCESS) return KVA_OK;
    st = kva_cuda_fail(dev->driver, r, "cuMemHostRegister of %zu bytes", length);
    return st == KVA_ERR_NOMEM ? KVA_ERR_BACKEND : st;
}

void kva_cuda_unpin(const kva_cuda_device *dev, void *addr) {
    if (kva_cuda_enter(dev) != KVA_OK) return;
    dev->driver->cuMemHostUnregister(addr);
    kva_cuda_leave(dev);
}
