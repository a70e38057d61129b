/*
 * kvalloc_kv.h — the KV-cache manager of libkvalloc, public part. kvalloc.h includes it, so an
 * engine includes either; every name is kva_kv_*, and the statuses and the pool are kvalloc.h's.
 */
#ifndef KVALLOC_KV_H
#define KVALLOC_KV_H

#include "kvalloc.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * What an engine's scheduler calls on top of the allocator. The KV cache is cut into blocks of
 * block_tokens tokens named by u32 ids; a sequence (a request) owns a block table; full blocks
 * are kept in a prefix cache under 128-bit keys with reference counts; a block nobody references
 * stays cached until a new block is needed and no free one is left, then the least recently
 * used goes first. A contiguous mode gives each sequence one buffer instead.
 *
 * Sequences are named by kva_kv_seq handles (a slot and a generation): a handle of a freed
 * sequence is recognised and refused, never mistaken for the sequence that reuses its slot
 * (until that slot has been reused 2^32 times). Each cache keys its handles, so a handle of
 * another cache is refused as one this cache never gave.
 *
 * Errors follow the pool's rules: every call returns a status, a failed call changes nothing
 * and leaves its out-parameters untouched, kva_last_error() says why.
 *
 * Thread safety: every function may be called from any number of threads at once. Each cache
 * has one mutex, held for the whole of every call on it (batch work, such as a whole prompt's
 * blocks, happens inside one call), so calls on one cache are serialized and calls on different
 * caches are independent. kva_kv_get_info and kva_kv_block_address read only geometry fixed at
 * creation and take no lock. kva_kv_destroy must not overlap any other call on the same cache
 * (nor may one start after it). A cache calls its pool (kva_alloc_exact, kva_free,
 * kva_usable_size: at creation and destruction, and on sequence calls in contiguous mode) under
 * its own mutex; the pool is thread safe, so other threads may use the same pool meanwhile. The
 * sequence handles a thread holds are its to order: two threads that append to and free the same
 * sequence get one of the orders, each call atomic. A block table is read outside the lock: see
 * kva_kv_seq_block_table. A named cache's section of the statistics segment is filled by
 * whichever thread publishes the pool; publishing never waits for the cache's mutex (while a call
 * holds it, the section keeps its last contents until the next publish).
 */

typedef struct kva_kv kva_kv;
typedef uint64_t kva_kv_seq; /* 0 is never a valid handle */

#define KVA_KV_NO_BLOCK UINT32_MAX
#define KVA_KV_PRIORITIES 8      /* sequence priorities 0 (evicted first) .. 7 */
#define KVA_KV_MIN_BUCKET 64     /* contiguous mode: the smallest bucket, in tokens */

typedef enum kva_kv_mode {
    KVA_KV_PAGED = 0,     /* blocks, block tables, prefix caching, fork */
    KVA_KV_CONTIGUOUS = 1 /* one buffer per sequence, a power-of-two bucket of tokens */
} kva_kv_mode;

/* Where (block, layer, K|V) lives. In both layouts the KV memory is one allocation and
 *     address(block, layer, part) = base + block * block_stride + layer * layer_stride
 *                                        + part * part_bytes
 * with part_bytes = block_tokens * kv_heads * head_dim * dtype_bytes, each part laid out
 * [token][kv_head][head_dim]. */
typedef enum kva_kv_layout {
    KVA_KV_LAYOUT_BLOCKS = 0, /* a block holds all its layers: [block][layer][K|V] */
    KVA_KV_LAYOUT_LAYERS = 1  /* one region per layer, a block id indexes each: [layer][block][K|V] */
} kva_kv_layout;

typedef enum kva_kv_part { KVA_KV_K = 0, KVA_KV_V = 1 } kva_kv_part;

typedef struct kva_kv_config {
    uint32_t layers, kv_heads, head_dim; /* no defaults: 0 is refused */
    uint32_t dtype_bytes;    /* bytes per element: 1, 2, 4 or 8. Default 2 */
    uint32_t block_tokens;   /* tokens per block (paged mode). Default 16 */
    uint32_t num_blocks;     /* capacity in blocks; 0: capacity_bytes decides */
    size_t capacity_bytes;   /* capacity in bytes when num_blocks is 0: paged mode keeps the
                                whole blocks that fit; contiguous mode sizes its own pool */
    kva_kv_mode mode;        /* default KVA_KV_PAGED */
    kva_kv_layout layout;    /* default KVA_KV_LAYOUT_LAYERS */
    uint32_t max_context;    /* contiguous mode: the largest bucket, tokens, a power of two
                                >= KVA_KV_MIN_BUCKET; 0 (default): the largest the pool holds */
    uint64_t hash_seed;      /* mixed into every prefix key; a secret random value keeps
                                clients from precomputing keys. Default 0 */
    kva_page_mode pages;     /* pages of the pool the cache creates when given none.
                                Default KVA_PAGES_THP (see kva_kv_create); where this process
                                gets no transparent huge pages, THP means base pages here */
    const char *name;        /* the name of the pool the cache creates (NULL: anonymous). A
                                named cache publishes its pool's statistics and its own (block
                                states, hits, evictions) for kvalloc top; with a pool given, that
                                pool's name counts and this must be NULL. A segment has one KV
                                section: of several caches on one named pool, the first created
                                publishes there until it is destroyed, the others do not */
    int trace;               /* the created pool's trace setting (kva_config.trace) */
} kva_kv_config;

/* Fills every field of *cfg with its default. */
KVA_API void kva_kv_config_init(kva_kv_config *cfg);

/* Bytes of one block, 2 * layers * kv_heads * head_dim * dtype_bytes * block_tokens, after
 * checking the geometry (KVA_ERR_INVALID for a zero or unsupported field or an overflow). */
KVA_API kva_status kva_kv_block_bytes(const kva_kv_config *cfg, size_t *out);

/* Creates a cache. With pool NULL the cache creates a pool for itself and destroys it with the
 * cache. Paged mode takes its KV memory as one kva_alloc_exact of num_blocks * block_bytes
 * (its own pool then spans the next power of two of 4 KiB pages above that; the tail is never
 * touched, so with THP or small pages it costs address space only). Contiguous mode allocates
 * each sequence's buffer from the pool (its own pool is capacity_bytes, or num_blocks blocks).
 * Errors: KVA_ERR_INVALID (config), KVA_ERR_NOMEM (the pool or host memory is too small),
 * KVA_ERR_BACKEND. */
KVA_API kva_status kva_kv_create(const kva_kv_config *cfg, kva_pool *pool, kva_kv **out);

/* Frees every sequence's memory and the KV memory, then the pool if the cache created it.
 * NULL is ignored. No other call on this cache may be running or start afterwards. */
KVA_API void kva_kv_destroy(kva_kv *kv);

typedef struct kva_kv_info {
    kva_kv_mode mode;
    kva_kv_layout layout;
    uint32_t layers, kv_heads, head_dim, dtype_bytes, block_tokens;
    uint32_t num_blocks;     /* paged mode; 0 in contiguous mode */
    uint32_t max_context;    /* contiguous mode: the largest bucket; 0 in paged mode */
    size_t block_bytes;      /* all layers, K and V, of one block */
    size_t token_bytes;      /* all layers, K and V, of one token */
    size_t slot_bytes;       /* K (or V) of one token in one layer: kv_heads*head_dim*dtype */
    size_t part_bytes;       /* K (or V) of one block in one layer: slot_bytes*block_tokens */
    size_t block_stride, layer_stride; /* see kva_kv_layout */
    void *base;              /* paged mode: the KV memory (address of block 0, layer 0, K) */
    size_t kv_bytes;         /* paged: num_blocks * block_bytes; contiguous: pool capacity */
    kva_pool *pool;          /* the pool the memory comes from */
} kva_kv_info;

KVA_API kva_status kva_kv_get_info(kva_kv *kv, kva_kv_info *out);

/* The address of one part (K or V) of one layer of one block (paged mode). O(1), no lock. */
KVA_API kva_status kva_kv_block_address(kva_kv *kv, uint32_t block, uint32_t layer, kva_kv_part part,
                                        void **out);

/* What the engine must copy after a call that moved KV (kva_kv_seq_append).
 * Paged mode: copy on write. The sequence's last block was shared (after a fork) and partly
 * filled; the writer now holds dst_block instead and must copy the first `tokens` tokens of
 * every layer's K and V from src_block. Contiguous mode: the sequence outgrew its bucket and
 * moved to dst; for every layer l and part p, copy `tokens` slots from
 * src + (2l + p) * src_bucket * slot_bytes to dst + (2l + p) * dst_bucket * slot_bytes. src stays
 * allocated until the sequence's next append or free.
 * Nothing to copy: tokens == 0, blocks KVA_KV_NO_BLOCK and pointers NULL, except that a move of
 * a sequence of 0 tokens gives both pointers with tokens == 0.
 * In paged mode src_block stays allocated after the call: the sequences that still share it
 * hold it, so the engine may copy from it until then. */
typedef struct kva_kv_copy {
    uint32_t src_block, dst_block;
    uint32_t tokens;
    uint32_t src_bucket, dst_bucket;
    void *src, *dst;
} kva_kv_copy;

/* Creates a sequence of num_tokens tokens: ceil(num_tokens / block_tokens) blocks (paged) or
 * one buffer of the smallest bucket that holds them (contiguous).
 * Prefix caching (paged mode): the content of the first full blocks is given either as
 * block_keys (num_keys caller keys, one per block, such as a trace's hash ids) or as token ids
 * (num_token_ids of them, hashed by the library; their whole blocks are used), not both. The
 * longest cached prefix of those blocks is reused (each hit block gains a reference) and
 * *cached_tokens receives its length in tokens; the request's other given blocks are registered
 * under their keys for later requests. No keys and no tokens: nothing is looked up or
 * registered. Blocks are keyed within namespace_id only. priority (0 .. KVA_KV_PRIORITIES-1)
 * sets the eviction class of the blocks (see kva_kv_seq_free).
 * The engine writes a new sequence's blocks after the hits (the prefill), never the hit blocks:
 * they hold the registered prefix other sequences share, and a registered block stays full
 * (an append past it starts a new block; one into a shared, partly filled block copies first).
 * New blocks come from the free blocks, then by evicting cached ones.
 * Errors: KVA_ERR_INVALID (more keys or token ids than the sequence's full blocks or tokens,
 * keys and tokens both, a pointer NULL with its count nonzero, keys in contiguous mode, a
 * bucket beyond max_context, a bad priority); KVA_ERR_NOMEM (not enough free and evictable
 * blocks, or pool memory). cached_tokens may be NULL. */
KVA_API kva_status kva_kv_seq_allocate(kva_kv *kv, uint32_t num_tokens, const uint64_t *block_keys,
                                       uint32_t num_keys, const uint32_t *tokens, uint32_t num_token_ids,
                                       uint32_t namespace_id, uint32_t priority, kva_kv_seq *seq,
                                       uint32_t *cached_tokens);

/* Grows a sequence by num_tokens tokens (decoding). Paged: a new block only when the last one
 * is full; if the last block is shared and partly filled, the writer first gets a private copy
 * (*copy says what to copy). Contiguous: moves to a larger bucket when needed (*copy again).
 * Errors: KVA_ERR_INVALID (unknown or freed sequence, a pin, copy NULL, a length beyond 2^32-1
 * tokens or beyond max_context), KVA_ERR_NOMEM (nothing changed). */
KVA_API kva_status kva_kv_seq_append(kva_kv *kv, kva_kv_seq seq, uint32_t num_tokens, kva_kv_copy *copy);

/* A new sequence sharing every block of seq by reference (paged mode): same tokens, namespace
 * and priority. The first append into a shared, partly filled last block copies it. */
KVA_API kva_status kva_kv_seq_fork(kva_kv *kv, kva_kv_seq seq, kva_kv_seq *child);

/* Releases a sequence. Paged: each block loses a reference; a block left with none stays cached
 * if it holds a registered prefix block (on the LRU list of its priority, newest end), else it
 * is free at once. The blocks are released last to first, so a freed sequence's tail is
 * evicted before its head. A block's priority is the highest priority of the sequences that
 * referenced it since it was last taken from the free blocks; eviction empties lower
 * priorities first. Errors: KVA_ERR_DOUBLE_FREE (the sequence was already freed),
 * KVA_ERR_INVALID (a handle this cache never gave, or a pin). */
KVA_API kva_status kva_kv_seq_free(kva_kv *kv, kva_kv_seq seq);

/* The sequence's block table (paged mode): *len block ids in order. The array is owned by the
 * cache and stays valid and unchanged until the next call that changes this sequence (append,
 * free); other sequences' calls do not move it. kva_kv_compact rewrites every table in place
 * (the array stays where it is; its ids change). The caller reads the array after the call,
 * outside the cache's mutex: it must not read it while another thread appends to or frees this
 * sequence or runs kva_kv_compact, but orders those calls with its reads (an engine's scheduler
 * step does). */
KVA_API kva_status kva_kv_seq_block_table(kva_kv *kv, kva_kv_seq seq, const uint32_t **table, uint32_t *len);

typedef struct kva_kv_seq_info {
    uint32_t num_tokens;
    uint32_t num_blocks;     /* paged: entries in the block table */
    uint32_t cached_tokens;  /* tokens found in the prefix cache at allocation */
    uint32_t namespace_id;
    uint32_t priority;
    uint32_t is_pin;
    uint32_t bucket_tokens;  /* contiguous: the buffer's capacity in tokens */
    void *buffer;            /* contiguous: the buffer; layer l part p at (2l+p)*bucket*slot_bytes */
} kva_kv_seq_info;

KVA_API kva_status kva_kv_seq_get_info(kva_kv *kv, kva_kv_seq seq, kva_kv_seq_info *out);

/* Pins the longest cached prefix of the given blocks (keys or token ids, as for allocation) so
 * that it is never evicted until kva_kv_unpin: a pin is a sequence that holds a reference on
 * each of those blocks and allocates nothing. *pinned_tokens (may be NULL) says how much was
 * cached and is now pinned (0, an empty pin, when no key or token is given or nothing of them
 * is cached). Pins are not counted in the hit statistics. */
KVA_API kva_status kva_kv_pin(kva_kv *kv, const uint64_t *block_keys, uint32_t num_keys, const uint32_t *tokens,
                              uint32_t num_token_ids, uint32_t namespace_id, kva_kv_seq *pin,
                              uint32_t *pinned_tokens);

/* Releases a pin as kva_kv_seq_free releases a sequence. */
KVA_API kva_status kva_kv_unpin(kva_kv *kv, kva_kv_seq pin);

/* Evicts up to max_blocks cached blocks now, least recently used and lowest priority first
 * (UINT32_MAX: the whole prefix cache, as after new weights). *evicted may be NULL. */
KVA_API kva_status kva_kv_evict(kva_kv *kv, uint32_t max_blocks, uint32_t *evicted);

/* One block the engine must copy after kva_kv_compact: all layers, K and V, of src_block to
 * dst_block. */
typedef struct kva_kv_move {
    uint32_t src_block, dst_block;
} kva_kv_move;

/* Compaction (paged mode): moves every block that holds data (used by sequences or pins, or
 * cached for prefix hits: cached blocks are moved, not dropped, so their hits survive; call
 * kva_kv_evict first to drop them instead) to the lowest ids, so that afterwards blocks
 * [0, n) hold data and [n, num_blocks) are free, n = used_blocks + cached_blocks. With the blocks
 * layout the free blocks are then the last free_blocks * block_bytes bytes of the KV memory;
 * with the layers layout, the last free_blocks * block_stride bytes of each layer's region
 * (kva_kv_trim then hands that memory back).
 * It rewrites every sequence's and pin's block table in place, the prefix table and the LRU
 * lists (a block keeps its references, key, priority and place in eviction order), and
 * rebuilds the free stack as n, n+1, ... from the top. Only blocks at ids >= n move, each to a
 * free id < n, lowest to lowest: the fewest moves possible.
 * The moves go to moves[0 .. *count). No id is both a source and a destination, so the engine
 * may copy them in any order or all at once; it must copy every one before running kernels on
 * the new tables or writing into blocks allocated after this call (a source is free at once),
 * and must have applied any pending copy on write first.
 * Sizing: with moves NULL (capacity is then taken as 0) or capacity below the moves needed, it
 * changes nothing, sets *count to the number needed and returns KVA_ERR_NOMEM, so a call with
 * NULL, 0 asks the size (and says whether compaction would move anything). Counted in the
 * statistics' moves and moved_bytes. O(num_blocks + table entries).
 * Errors: KVA_ERR_INVALID (NULL cache or count, contiguous mode), KVA_ERR_NOMEM (see above). */
KVA_API kva_status kva_kv_compact(kva_kv *kv, kva_kv_move *moves, uint32_t capacity, uint32_t *count);

/* Gives back the memory of the free blocks at the top ids (paged mode): every block above the
 * highest one holding data becomes trimmed, and the memory behind the trimmed blocks goes back
 * to the pool's backing: whole CUDA granules are unmapped and released to the driver, whole
 * host pages discarded, in each layer's region in the layers layout. After kva_kv_compact every
 * free block is at the top, so compaction then trim frees every unit of memory that holds no
 * data.
 * The memory of a trimmed block is gone, content included (when it comes back for a new
 * sequence its content is undefined: zeros on host pages, whatever the driver maps on a GPU;
 * the engine writes it, as any new block): every copy kva_kv_compact returned
 * (their sources are free blocks at the top) and any kernel still reading a freed block must
 * have finished, the device synchronized, before this call. On host memory, memory the engine
 * registered itself (cudaHostRegister, ibv_reg_mr) must not include trimmed blocks: the device
 * would keep the old pages while the CPU gets new ones.
 * Trimmed blocks count as free for capacity: a call that needs more blocks than the free ones
 * with memory gets back the memory of as many trimmed ones as it lacks (before evicting cached
 * blocks; host pages are faulted in then, so a shortage is that call's error); if the memory
 * cannot be had, the call evicts cached blocks instead when they suffice, and otherwise fails
 * with KVA_ERR_NOMEM or KVA_ERR_BACKEND, nothing changed. A pool whose memory must stay
 * (prefault, lock, pin, checked, hugetlb pages) gives nothing back, but the blocks are trimmed
 * all the same. *trimmed_blocks (optional) is the number of trimmed blocks after the call.
 * Errors: KVA_ERR_INVALID (NULL cache, contiguous mode). */
KVA_API kva_status kva_kv_trim(kva_kv *kv, uint32_t *trimmed_blocks);

typedef struct kva_kv_stats {
    uint32_t num_blocks;
    uint32_t free_blocks;       /* hold nothing */
    uint32_t used_blocks;       /* referenced by live sequences or pins */
    uint32_t cached_blocks;     /* referenced by none, kept for prefix hits, evictable */
    uint32_t registered_blocks; /* with a key in the prefix table (cached ones and used ones) */
    uint32_t sequences;         /* live sequences, pins excluded */
    uint32_t pins;
    uint32_t trimmed_blocks;    /* free, their memory given back (kva_kv_trim) */
    uint64_t hit_tokens;        /* cached_tokens summed over allocations */
    uint64_t query_tokens;      /* num_tokens summed over allocations */
    uint64_t evictions;
    uint64_t cow_copies;
    uint64_t forks;
    uint64_t allocations, frees, appends;
    uint64_t moves, moved_bytes; /* contiguous mode: bucket changes; paged mode: compaction
                                    moves (kva_kv_compact); and the bytes to copy */
    uint64_t alloc_failures;    /* calls that returned KVA_ERR_NOMEM for want of blocks or
                                   memory (not kva_kv_compact's sizing answer, which is no
                                   failure) */
    uint64_t rejected_calls;    /* calls that returned KVA_ERR_INVALID or KVA_ERR_DOUBLE_FREE */
    size_t bytes_in_use;        /* KV bytes held by sequences (paged: used blocks) */
    size_t block_metadata_bytes; /* host bytes of per-block metadata: records, prefix table, LRU segments in use */
    size_t metadata_bytes;      /* all host bytes of the cache's bookkeeping */
    /* A cache created with trace on times every call that takes its lock, from taking the lock
     * to giving it up: the time the engine spends in the KV manager. Zero otherwise. */
    uint64_t timed_calls;
    uint64_t timed_ns;
    uint64_t call_ns_log2[40];  /* calls that took [2^i, 2^(i+1)) ns (bucket 0 also 0 ns) */
} kva_kv_stats;

KVA_API kva_status kva_kv_get_stats(kva_kv *kv, kva_kv_stats *out);

/* Walks every invariant of the cache (reference counts against the block tables, the free
 * blocks, the LRU lists, the prefix table, the sequences, the pool) and names the first one
 * broken: KVA_OK or KVA_ERR_CORRUPT. O(blocks + table entries); not for hot paths. */
KVA_API kva_status kva_kv_check(kva_kv *kv);

/* sizeof each public KV struct as this library was built (0 for an unknown id), for bindings
 * that mirror them; see kva_struct_size. */
typedef enum kva_kv_struct_id {
    KVA_KV_STRUCT_CONFIG = 1,
    KVA_KV_STRUCT_INFO = 2,
    KVA_KV_STRUCT_COPY = 3,
    KVA_KV_STRUCT_SEQ_INFO = 4,
    KVA_KV_STRUCT_STATS = 5
} kva_kv_struct_id;

KVA_API size_t kva_kv_struct_size(kva_kv_struct_id which);

#ifdef __cplusplus
}
#endif

#endif /* KVALLOC_KV_H */
