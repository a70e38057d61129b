/*
 * cuda_driver.h — the CUDA driver API, found at run time.
 *
 * Nothing of CUDA is needed to build the library or to use host pools. The few driver types and
 * constants used here are spelled below as the driver API defines them (cuda.h, CUDA 11 and
 * later); the functions are looked up with dlsym in libcuda.so.1, or in the library that
 * $KVA_CUDA_DRIVER names (how the tests put a fake driver in its place). The driver is loaded
 * once per process, on the first use, and never unloaded; a failed load is not remembered, so a
 * later pool tries again.
 *
 * Every pool that uses a GPU holds that device's primary context (the one the CUDA runtime uses
 * too) for its whole life, and makes it current only around its own driver calls
 * (kva_cuda_enter / kva_cuda_leave), so the caller's current context is never changed.
 */
#ifndef KVA_CUDA_DRIVER_H
#define KVA_CUDA_DRIVER_H

#include <stddef.h>

#include "internal.h"

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ALREADY_MAPPED = 208,
    CUDA_ERROR_NOT_MAPPED = 211,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999
};

#define CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define CU_MEM_HANDLE_TYPE_NONE 0x0
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_READ 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0x0
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103
#define CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED 110

typedef struct CUmemLocation_st {
    int type; /* CUmemLocationType */
    int id;   /* the device ordinal for CU_MEM_LOCATION_TYPE_DEVICE */
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

/* The driver reads these structs; a wrong layout would be read silently, so pin it down. */
_Static_assert(sizeof(CUmemAllocationProp) == 32 && offsetof(CUmemAllocationProp, win32HandleMetaData) == 16,
               "CUmemAllocationProp must match the driver's layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc must match the driver's layout");

/* The functions used, each under its API name; the symbol looked up is in cuda_driver.c (some
 * carry a _v2 suffix in the library). */
typedef struct kva_cuda_driver {
    CUresult (*cuInit)(unsigned flags);
    CUresult (*cuDeviceGetCount)(int *count);
    CUresult (*cuDeviceGet)(CUdevice *device, int ordinal);
    CUresult (*cuDeviceGetAttribute)(int *value, int attribute, CUdevice device);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *context, CUdevice device);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice device);
    CUresult (*cuCtxPushCurrent)(CUcontext context);
    CUresult (*cuCtxPopCurrent)(CUcontext *context);
    CUresult (*cuMemGetAllocationGranularity)(size_t *granularity, const CUmemAllocationProp *prop, int option);
    CUresult (*cuMemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags);
    CUresult (*cuMemAddressFree)(CUdeviceptr ptr, size_t size);
    CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags);
    CUresult (*cuMemRelease)(CUmemGenericAllocationHandle handle);
    CUresult (*cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags);
    CUresult (*cuMemUnmap)(CUdeviceptr ptr, size_t size);
    CUresult (*cuMemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
    CUresult (*cuMemHostRegister)(void *p, size_t size, unsigned flags);
    CUresult (*cuMemHostUnregister)(void *p);
    /* Shareable handles (shared CUDA pools); may be NULL in an old driver, and then such a
     * pool is refused with KVA_ERR_BACKEND. For CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the
     * exported handle is an int written at shareableHandle, and the imported one is passed as
     * the descriptor's value cast to a pointer. */
    CUresult (*cuMemExportToShareableHandle)(void *shareableHandle, CUmemGenericAllocationHandle handle, int handleType,
                                             unsigned long long flags);
    CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle, void *osHandle, int shHandleType);
    CUresult (*cuGetErrorName)(CUresult error, const char **name); /* may be NULL */
    void *library;
    char path[256];
} kva_cuda_driver;

/* One GPU as a pool uses it. */
typedef struct kva_cuda_device {
    const kva_cuda_driver *driver;
    int ordinal;
    CUdevice device;
    CUcontext context;   /* its primary context, retained */
    unsigned fork_depth; /* kva_os_fork_depth() when it was opened */
} kva_cuda_device;

/* Whether the device was opened by an ancestor of this process: CUDA does not survive fork
 * (the driver's state is the parent's, and NVIDIA documents no use of it in a child), so a
 * forked child makes no driver call for such a device. Its pools refuse what needs one with
 * KVA_ERR_BACKEND (kva_cuda_enter) and are destroyed without one; the memory is the parent's. */
int kva_cuda_inherited(const kva_cuda_device *dev);

/* Loads the driver if needed and opens GPU `ordinal`, retaining its primary context. With
 * need_vmm the device must support virtual memory management. Errors: KVA_ERR_BACKEND (no
 * driver library, a function missing, cuInit failing, no GPU, no VMM support) and
 * KVA_ERR_INVALID (no GPU of that ordinal), each saying which. */
kva_status kva_cuda_device_open(int ordinal, int need_vmm, kva_cuda_device *out);
/* The lock held while the driver is loaded and initialized, a leaf taken around fork (fork.c):
 * a child forked during a load finds it free, and the driver loaded by its parent. */
void kva_cuda_load_lock(void);
void kva_cuda_load_unlock(void);
void kva_cuda_device_close(kva_cuda_device *dev);

/* Makes the device's context current for the calls that follow; kva_cuda_leave gives the
 * caller its own back. Between the two the calling thread must make no other CUDA call. */
kva_status kva_cuda_enter(const kva_cuda_device *dev);
void kva_cuda_leave(const kva_cuda_device *dev);

/* The status of a failed driver call, KVA_ERR_NOMEM for CUDA_ERROR_OUT_OF_MEMORY and
 * KVA_ERR_BACKEND otherwise, with kva_last_error() reading "<what>: <error name>". */
kva_status kva_cuda_fail(const kva_cuda_driver *driver, CUresult result, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), cold, noinline));

/* Registers host memory with the driver as page-locked memory every context can copy from at
 * full speed (cuMemHostRegister, CU_MEMHOSTREGISTER_PORTABLE); kva_cuda_unpin undoes it. */
kva_status kva_cuda_pin(const kva_cuda_device *dev, void *addr, size_t length);
void kva_cuda_unpin(const kva_cuda_device *dev, void *addr);

#endif
