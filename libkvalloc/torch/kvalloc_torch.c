/*
 * kvalloc_torch.c — the PyTorch allocator of kvalloc_torch.h: per GPU one variable-size pool
 * over a CUDA pool, and per stream a list of frees waiting for that stream's work.
 *
 * A pending block stays allocated in the variable-size pool until its event completes, so the
 * pool itself can never hand it to anyone; only this file decides when it goes back. Each
 * stream's list is in free order, so its events complete in list order and a sweep stops at the
 * first one not done: the cost is one cuEventQuery per stream plus one per block returned.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvalloc.h"
#include "kvalloc_torch.h"

#define MAX_DEVICES 64
#define MAX_STREAMS 64  /* per device; a free on one more stream waits for its work at once */
#define ALIGNMENT 512   /* what torch's caching allocator aligns to */
#define REUSE_WINDOW 16 /* the last frees of a stream an allocation on it may take back */
#define IDLE_EVENTS 256 /* events kept for the next frees instead of destroyed and made anew */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_NOT_READY = 600,
    CU_EVENT_DISABLE_TIMING = 2
};

static struct {
    void *library;
    CUresult (*cuInit)(unsigned);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuCtxPushCurrent)(CUcontext);
    CUresult (*cuCtxPopCurrent)(CUcontext *);
    CUresult (*cuEventCreate)(CUevent *, unsigned);
    CUresult (*cuEventRecord)(CUevent, kva_torch_stream);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuStreamSynchronize)(kva_torch_stream);
} cu;

typedef struct pending {
    void *ptr;
    size_t bytes; /* its usable size in the pool */
    CUevent event;
    struct pending *prev, *next;
} pending;

typedef struct stream_list {
    kva_torch_stream stream;
    pending *head, *tail; /* oldest free first */
} stream_list;

typedef struct device_pool {
    int ready;
    CUcontext context;
    kva_pool *backing;
    kva_var *var;
    stream_list streams[MAX_STREAMS];
    unsigned nstreams;
    size_t live_bytes, pending_bytes, pending_blocks;
    CUevent idle[IDLE_EVENTS]; /* recorded once, done with: cuEventRecord makes one new again */
    unsigned nidle;
} device_pool;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static device_pool devices[MAX_DEVICES];
static size_t configured_capacity;
static int any_pool;
static unsigned long rejected_frees;
static char last_error[256];

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
}

static int load_driver(void) {
    if (cu.library) return 1;
    const char *path = getenv("KVA_CUDA_DRIVER");
    void *lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fail("no CUDA driver: %s", dlerror());
        return 0;
    }
    struct {
        const char *name;
        void **slot;
    } symbols[] = {
        {"cuInit", (void **)&cu.cuInit},
        {"cuDeviceGet", (void **)&cu.cuDeviceGet},
        {"cuDeviceTotalMem_v2", (void **)&cu.cuDeviceTotalMem},
        {"cuDevicePrimaryCtxRetain", (void **)&cu.cuDevicePrimaryCtxRetain},
        {"cuCtxPushCurrent_v2", (void **)&cu.cuCtxPushCurrent},
        {"cuCtxPopCurrent_v2", (void **)&cu.cuCtxPopCurrent},
        {"cuEventCreate", (void **)&cu.cuEventCreate},
        {"cuEventRecord", (void **)&cu.cuEventRecord},
        {"cuEventQuery", (void **)&cu.cuEventQuery},
        {"cuEventSynchronize", (void **)&cu.cuEventSynchronize},
        {"cuEventDestroy_v2", (void **)&cu.cuEventDestroy},
        {"cuStreamSynchronize", (void **)&cu.cuStreamSynchronize},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        *symbols[i].slot = dlsym(lib, symbols[i].name);
        if (!*symbols[i].slot) {
            fail("the CUDA driver lacks %s", symbols[i].name);
            dlclose(lib);
            memset(&cu, 0, sizeof cu);
            return 0;
        }
    }
    if (cu.cuInit(0) != CUDA_SUCCESS) {
        fail("cuInit failed");
        dlclose(lib);
        memset(&cu, 0, sizeof cu);
        return 0;
    }
    cu.library = lib;
    return 1;
}

/* The pool of `device`, made on first use; NULL with last_error set if it cannot be. */
static device_pool *pool_of(int device, int create) {
    if (device < 0 || device >= MAX_DEVICES) {
        fail("device %d is out of range", device);
        return NULL;
    }
    device_pool *d = &devices[device];
    if (d->ready || !create) return d->ready ? d : NULL;
    if (!load_driver()) return NULL;
    CUdevice dev;
    size_t total = 0;
    if (cu.cuDeviceGet(&dev, device) != CUDA_SUCCESS || cu.cuDeviceTotalMem(&total, dev) != CUDA_SUCCESS ||
        cu.cuDevicePrimaryCtxRetain(&d->context, dev) != CUDA_SUCCESS) {
        fail("no CUDA device %d", device);
        return NULL;
    }
    kva_var_config vc;
    kva_var_config_init(&vc);
    vc.capacity = configured_capacity ? configured_capacity : total / 2;
    vc.alignment = ALIGNMENT;
    kva_config pc;
    kva_config_init(&pc);
    pc.backend = KVA_BACKEND_CUDA;
    pc.device = device;
    kva_status st = kva_var_backing_config(&vc, &pc);
    if (st == KVA_OK) st = kva_pool_create(&pc, &d->backing);
    if (st == KVA_OK) {
        st = kva_var_create(&vc, d->backing, &d->var);
        if (st != KVA_OK) kva_pool_destroy(d->backing);
    }
    if (st != KVA_OK) {
        fail("a %zu-byte pool on CUDA device %d: %s", vc.capacity, device, kva_last_error());
        return NULL;
    }
    d->ready = 1;
    any_pool = 1;
    return d;
}

static stream_list *list_of(device_pool *d, kva_torch_stream stream, int create) {
    for (unsigned i = 0; i < d->nstreams; i++)
        if (d->streams[i].stream == stream) return &d->streams[i];
    if (!create || d->nstreams == MAX_STREAMS) return NULL;
    stream_list *l = &d->streams[d->nstreams++];
    *l = (stream_list){.stream = stream};
    return l;
}

static void unlink_pending(device_pool *d, stream_list *l, pending *p) {
    if (p->prev) p->prev->next = p->next;
    else l->head = p->next;
    if (p->next) p->next->prev = p->prev;
    else l->tail = p->prev;
    d->pending_bytes -= p->bytes;
    d->pending_blocks--;
}

/* An event that is done with: kept for a later free while there is room. */
static void retire_event(device_pool *d, CUevent event) {
    if (d->nidle < IDLE_EVENTS) d->idle[d->nidle++] = event;
    else cu.cuEventDestroy(event);
}

/* Gives a pending block back to the pool (its stream's work is done). */
static void release(device_pool *d, stream_list *l, pending *p) {
    unlink_pending(d, l, p);
    retire_event(d, p->event);
    kva_var_free(d->var, p->ptr);
    d->live_bytes -= p->bytes;
    free(p);
}

/* Returns to the pool every pending block whose stream's work is done; with wait, waits for all
 * of them first. The device's context is current. */
static void sweep(device_pool *d, int wait) {
    for (unsigned i = 0; i < d->nstreams; i++) {
        stream_list *l = &d->streams[i];
        while (l->head) {
            CUresult r = wait ? cu.cuEventSynchronize(l->head->event) : cu.cuEventQuery(l->head->event);
            if (r == CUDA_ERROR_NOT_READY) break;
            /* Another refusal (a broken event): the stream is waited for as a whole instead. */
            if (r != CUDA_SUCCESS && cu.cuStreamSynchronize(l->stream) != CUDA_SUCCESS) break;
            release(d, l, l->head);
        }
    }
}

/* A pending block of this stream that holds bytes without wasting more than an eighth. */
static void *take_back(device_pool *d, kva_torch_stream stream, size_t bytes) {
    stream_list *l = list_of(d, stream, 0);
    if (!l) return NULL;
    unsigned looked = 0;
    for (pending *p = l->tail; p && looked < REUSE_WINDOW; p = p->prev, looked++) {
        if (p->bytes < bytes || p->bytes - bytes > bytes / 8) continue;
        void *ptr = p->ptr;
        unlink_pending(d, l, p);
        retire_event(d, p->event);
        free(p);
        return ptr;
    }
    return NULL;
}

void *kva_torch_alloc(size_t size, int device, kva_torch_stream stream) {
    if (size == 0) return NULL;
    pthread_mutex_lock(&lock);
    void *ptr = NULL;
    device_pool *d = pool_of(device, 1);
    if (d && cu.cuCtxPushCurrent(d->context) == CUDA_SUCCESS) {
        size_t bytes = (size + ALIGNMENT - 1) & ~(size_t)(ALIGNMENT - 1);
        if (bytes >= size) {
            sweep(d, 0);
            ptr = take_back(d, stream, bytes);
            if (!ptr) {
                kva_status st = kva_var_alloc(d->var, size, &ptr);
                if (st == KVA_ERR_NOMEM && d->pending_blocks) {
                    sweep(d, 1);
                    st = kva_var_alloc(d->var, size, &ptr);
                }
                if (st == KVA_OK) d->live_bytes += kva_var_usable_size(d->var, ptr);
                else {
                    ptr = NULL;
                    fail("%zu bytes on CUDA device %d: %s", size, device, kva_last_error());
                }
            }
        } else {
            fail("%zu bytes cannot be aligned", size);
        }
        cu.cuCtxPopCurrent(NULL);
    } else if (d) {
        fail("the context of CUDA device %d cannot be made current", device);
    }
    pthread_mutex_unlock(&lock);
    return ptr;
}

/* Whether ptr is pending on some stream of d already. */
static int is_pending(const device_pool *d, const void *ptr) {
    for (unsigned i = 0; i < d->nstreams; i++)
        for (const pending *p = d->streams[i].head; p; p = p->next)
            if (p->ptr == ptr) return 1;
    return 0;
}

void kva_torch_free(void *ptr, size_t size, int device, kva_torch_stream stream) {
    (void)size; /* the pool knows the range's size */
    if (!ptr) return;
    pthread_mutex_lock(&lock);
    device_pool *d = pool_of(device, 0);
    size_t bytes = d ? kva_var_usable_size(d->var, ptr) : 0;
    if (!d || bytes == 0 || is_pending(d, ptr)) {
        rejected_frees++;
        fail("free of %p on device %d: not a live allocation of this allocator", ptr, device);
        pthread_mutex_unlock(&lock);
        return;
    }
    pending *p = malloc(sizeof *p);
    stream_list *l = list_of(d, stream, 1);
    int pushed = cu.cuCtxPushCurrent(d->context) == CUDA_SUCCESS;
    CUevent event = NULL;
    int recorded = pushed && p && l;
    if (recorded && d->nidle) event = d->idle[--d->nidle];
    else if (recorded) recorded = cu.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS;
    if (recorded && cu.cuEventRecord(event, stream) != CUDA_SUCCESS) {
        cu.cuEventDestroy(event);
        recorded = 0;
    }
    if (recorded) {
        *p = (pending){.ptr = ptr, .bytes = bytes, .event = event, .prev = l->tail};
        if (l->tail) l->tail->next = p;
        else l->head = p;
        l->tail = p;
        d->pending_bytes += bytes;
        d->pending_blocks++;
    } else if (pushed && cu.cuStreamSynchronize(stream) == CUDA_SUCCESS) {
        /* No event to wait on (no memory, too many streams, a refusal): the stream's work is
         * waited for now, and the block goes back at once. */
        free(p);
        kva_var_free(d->var, ptr);
        d->live_bytes -= bytes;
    } else {
        /* Nothing tells when the stream is done with it: the block is never reused. */
        free(p);
        fail("free of %p on device %d: the stream's work cannot be waited for; the block stays "
             "allocated",
             ptr, device);
    }
    if (pushed) cu.cuCtxPopCurrent(NULL);
    pthread_mutex_unlock(&lock);
}

int kva_torch_configure(size_t capacity) {
    /* kva_var_config's rule for the pools' alignment: refused now, not at every allocation. */
    if (capacity && (capacity < ALIGNMENT || capacity / ALIGNMENT >= (size_t)1 << 31)) {
        pthread_mutex_lock(&lock);
        fail("capacity %zu is not one of a pool of 512-byte units (at least one, fewer than 2^31)", capacity);
        pthread_mutex_unlock(&lock);
        return -2;
    }
    pthread_mutex_lock(&lock);
    int result = any_pool ? -1 : 0;
    if (!any_pool) configured_capacity = capacity;
    pthread_mutex_unlock(&lock);
    return result;
}

int kva_torch_stats(int device, size_t *live_bytes, size_t *pending_bytes, size_t *pending_blocks) {
    pthread_mutex_lock(&lock);
    device_pool *d = device >= 0 && device < MAX_DEVICES && devices[device].ready ? &devices[device] : NULL;
    if (d) {
        if (live_bytes) *live_bytes = d->live_bytes;
        if (pending_bytes) *pending_bytes = d->pending_bytes;
        if (pending_blocks) *pending_blocks = d->pending_blocks;
    }
    pthread_mutex_unlock(&lock);
    return d ? 0 : -1;
}

unsigned long kva_torch_rejected_frees(void) {
    pthread_mutex_lock(&lock);
    unsigned long n = rejected_frees;
    pthread_mutex_unlock(&lock);
    return n;
}

const char *kva_torch_last_error(void) { return last_error; }
