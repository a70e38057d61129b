/*
 * kvalloc_torch.h — libkvalloc_torch.so, a CUDA allocator for PyTorch over libkvalloc's
 * variable-size pools (kva_var_*) on the CUDA backend: the two entry points that
 * torch.cuda.memory.CUDAPluggableAllocator loads, and a few calls to configure and inspect it.
 * pykvalloc.torch turns it on. A companion of libkvalloc.so, which it links; the core library
 * knows nothing of it.
 *
 * Memory. One variable-size pool per GPU, made at the first allocation on that GPU: a CUDA pool
 * of kva_torch_configure's capacity (default: half the GPU's total memory), ranges aligned to
 * 512 bytes (what torch's own allocator gives). The variable-size pool takes its whole capacity
 * as one range of the CUDA pool, so all of it is mapped at that first allocation. The driver is libcuda.so.1, or the library $KVA_CUDA_DRIVER names (as for libkvalloc).
 *
 * Streams. A block freed on stream S may still be in use by work queued on S. So a free does not
 * return the block to the pool: it records an event on S (cuEventRecord) and keeps the block
 * pending on S's list. A later allocation on S may take a pending block of S at once (S's own
 * order makes that safe, as in torch's caching allocator); an allocation on any stream first
 * returns to the pool every pending block whose event has completed (cuEventQuery, the oldest of
 * each stream first: one stream's events complete in order), so that no other stream gets a
 * block before the work of the stream that freed it is done. When the pool has no room, the
 * allocation waits for the pending blocks' events (cuEventSynchronize) and tries again before it
 * gives up. Events are kept for reuse once done (up to 256 per GPU), so a free costs one
 * cuEventRecord and no cuEventCreate in the steady state. A tensor used on other streams through Tensor.record_stream is not tracked: torch
 * hands a pluggable allocator no record_stream hook through its Python API (the freeing stream's
 * work is what is waited for).
 *
 * Threads: every entry point may be called from any thread; one lock serializes them.
 */
#ifndef KVALLOC_TORCH_H
#define KVALLOC_TORCH_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVA_BUILDING_LIBRARY)
#define KVA_TORCH_API __attribute__((visibility("default")))
#else
#define KVA_TORCH_API
#endif

typedef struct CUstream_st *kva_torch_stream; /* cudaStream_t, CUstream */

/* torch's alloc entry point: size bytes on GPU device for use on stream. NULL when the pool
 * has no room even after waiting for pending frees, for size 0, a device that does not exist or
 * a driver that refuses (kva_torch_last_error says which). */
KVA_TORCH_API void *kva_torch_alloc(size_t size, int device, kva_torch_stream stream);

/* torch's free entry point: ptr (from kva_torch_alloc on device) is released once the work
 * queued on stream before this call is done (see "Streams" above). A pointer this allocator did
 * not hand out, or one freed already, is ignored and counted (kva_torch_rejected_frees): torch
 * gives a free no way to fail. */
KVA_TORCH_API void kva_torch_free(void *ptr, size_t size, int device, kva_torch_stream stream);

/* The capacity of the pools made from now on (0: half the GPU's total memory). -2 for a
 * capacity no pool can have (below one 512-byte unit, or 2^31 units or more: 1 TiB), -1 once a
 * pool exists (its capacity is fixed), else 0; nothing changes unless it is 0. */
KVA_TORCH_API int kva_torch_configure(size_t capacity);

/* Figures of device's pool: bytes handed out and live, bytes freed but pending on their
 * stream's work, blocks pending. -1 if the device has no pool yet, else 0. */
KVA_TORCH_API int kva_torch_stats(int device, size_t *live_bytes, size_t *pending_bytes, size_t *pending_blocks);

/* Frees that were ignored (not this allocator's pointer, or freed already), since the load. */
KVA_TORCH_API unsigned long kva_torch_rejected_frees(void);

/* Why the last failed kva_torch_alloc, or the last ignored free, failed ("" if none has). */
KVA_TORCH_API const char *kva_torch_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
