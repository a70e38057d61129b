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
 * are kept in a prefix cache under their keys with reference counts; a block nobody references
 * stays cached until a new block is needed and no free one is left, then the least recently
 * used goes first. A contiguous mode gives each sequence one buffer instead.
 *
 * Two ways in, over one block store. The sequence calls (kva_kv_seq_*) keep each request's
 * block table, look its prompt up, register its full blocks (the prompt's, and those its
 * decoding fills) and copy on write after a fork. The block calls (kva_kv_block_*) serve an
 * engine that keeps its own prefix structure (a vLLM BlockPool, a radix tree): it takes blocks,
 * holds and drops references to them itself, and commits them under its own keys. Either way a
 * block is referenced, cached (registered, unreferenced, evictable) or free, and both ways hit
 * the same prefix cache.
 *
 * Keys. A block's key names its content and everything before it, within a 64-bit namespace
 * (a tenant, a LoRA adapter, a cache salt: blocks of different namespaces never match). Content
 * comes in one of four forms (kva_kv_key_kind): nothing; token ids, which the library hashes and
 * chains into a 128-bit key; one u64 per block (a trace's hash id), chained the same way; or the
 * engine's own keys, 1 to KVA_KV_MAX_KEY_BYTES bytes each, already chained by the engine and
 * stored exactly (cache created with max_key_bytes): two distinct engine keys never alias, and
 * the library does not chain them again. A key is registered at most once: a block whose key is
 * registered already stays unregistered (its KV is a duplicate) and is freed, not cached, when
 * released.
 *
 * Per-step work is batched: one call admits, extends, frees or looks up many sequences, with
 * every per-request figure in a plain array (u32, u64, u8) and variable-length content
 * flattened into one array with u64 offsets, so a numpy caller hands its arrays over as they
 * are. A batch checks every argument before it changes anything.
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
 *
 * Fork: a child forked from the process that made a cache over a shared pool (kva_config.shared)
 * holds a copy of the cache whose blocks are that process's memory. There every call that would
 * change the cache returns KVA_ERR_BACKEND; lookups, block tables, kva_kv_check and the figures
 * answer from the copy as it stood at the fork (kvalloc.h, shared).
 */

typedef struct kva_kv kva_kv;
typedef uint64_t kva_kv_seq; /* 0 is never a valid handle */

#define KVA_KV_NO_BLOCK UINT32_MAX
#define KVA_KV_PRIORITIES 8 /* sequence priorities 0 (evicted first) .. 7 */
/* ORed into the priority of an admission (kva_kv_seq_admit, kva_kv_seq_allocate, and each
 * uint8_t of kva_kv_seq_admit_many's priorities: the one bit fits both) when the request is a
 * re-admission, a preempted request admitted again: its hit and queried tokens are counted in
 * kva_kv_stats' readmit_hit_tokens / readmit_query_tokens besides hit_tokens / query_tokens.
 * Any other bit beyond the priority is KVA_ERR_INVALID. */
#define KVA_KV_AGAIN 0x80u
/* Namespaces tracked one by one in kva_kv_namespaces; the rest share one row. */
#define KVA_KV_NAMESPACE_SLOTS 32
#define KVA_KV_MIN_BUCKET 64    /* contiguous mode: the smallest bucket, in tokens */
#define KVA_KV_MAX_KEY_BYTES 32 /* the longest engine key */

typedef enum kva_kv_mode {
    KVA_KV_PAGED = 0,     /* blocks, block tables, prefix caching, fork */
    KVA_KV_CONTIGUOUS = 1 /* one buffer per sequence, a power-of-two bucket of tokens */
} kva_kv_mode;

/* Where (block, layer, K|V) lives. In both layouts the KV memory is one allocation and, when
 * every layer has one shape,
 *     address(block, layer, part) = base + block * block_stride + layer * layer_stride
 *                                        + part * part_bytes
 * with part_bytes = block_tokens * kv_heads * head_dim * dtype_bytes, each part laid out
 * [token][kv_head][head_dim] (the library never reads or copies a part's contents in paged mode:
 * an engine may keep its tokens in another order, such as FlashInfer's HND [kv_head][token]).
 * With groups of different shapes each layer has its own (kva_kv_layer_info): in the blocks
 * layout a block holds every layer's parts in layer order; in the layers layout layer l's region
 * of num_blocks blocks of its own size follows layer l - 1's. */
typedef enum kva_kv_layout {
    KVA_KV_LAYOUT_BLOCKS = 0, /* a block holds all its layers: [block][layer][K|V] */
    KVA_KV_LAYOUT_LAYERS = 1  /* one region per layer, a block id indexes each: [layer][block][K|V] */
} kva_kv_layout;

typedef enum kva_kv_part {
    KVA_KV_K = 0,
    KVA_KV_V = 1
} kva_kv_part;

/* A group of layers of one shape (kva_kv_config.groups): a model whose layers differ (a hybrid
 * model, sliding-window and full-attention layers of different head counts) is a list of groups,
 * and its layers are numbered through them in order. */
typedef struct kva_kv_group {
    uint32_t layers; /* layers in the group, at least 1 */
    /* vectors kept per token and layer: 2, K and V (KVA_KV_K, KVA_KV_V); 1, one (DeepSeek's MLA
     * keeps one latent vector of kv_lora_rank + qk_rope_head_dim elements: kv_heads 1, head_dim
     * their sum; its part is KVA_KV_K) */
    uint32_t parts;
    uint32_t kv_heads, head_dim; /* each part is [token][kv_head][head_dim] (see kva_kv_layout) */
} kva_kv_group;

#define KVA_KV_MAX_GROUPS 64
#define KVA_KV_MAX_LAYERS 4096 /* in all groups together */

typedef struct kva_kv_config {
    /* one group of `layers` layers of K and V (parts 2) of kv_heads x head_dim; no defaults: 0 is
     * refused, unless groups are given, when all three must be 0 */
    uint32_t layers, kv_heads, head_dim;
    uint32_t dtype_bytes;  /* bytes per element: 1, 2, 4 or 8. Default 2 */
    uint32_t block_tokens; /* tokens per block (paged mode). Default 16 */
    uint32_t num_blocks;   /* capacity in blocks; 0: capacity_bytes decides */
    /* capacity in bytes when num_blocks is 0: paged mode keeps the whole blocks that fit;
     * contiguous mode sizes its own pool */
    size_t capacity_bytes;
    kva_kv_mode mode;     /* default KVA_KV_PAGED */
    kva_kv_layout layout; /* default KVA_KV_LAYOUT_LAYERS */
    /* contiguous mode: the largest bucket, tokens, a power of two >= KVA_KV_MIN_BUCKET; 0
     * (default): the largest the pool holds */
    uint32_t max_context;
    /* paged mode: the longest engine key the cache takes, 1 .. KVA_KV_MAX_KEY_BYTES; that many host
     * bytes per block hold the keys. 0 (default): no engine keys, and no bytes */
    uint32_t max_key_bytes;
    /* mixed into every prefix key; a secret random value keeps clients from precomputing keys.
     * Default 0 */
    uint64_t hash_seed;
    /* pages of the pool the cache creates when given none. Default KVA_PAGES_THP (see
     * kva_kv_create); where this process gets no transparent huge pages, THP means base pages here */
    kva_page_mode pages;
    /* paged mode: KV events (kva_kv_take_events) kept until the engine drains them, at most 2^20;
     * 96 host bytes each. 0 (default): events off, at no cost */
    uint32_t event_capacity;
    /* the name of the pool the cache creates (NULL: anonymous). A named cache publishes its pool's
     * statistics and its own (block states, hits, evictions) for kvalloc top; with a pool given,
     * that pool's name counts and this must be NULL. A segment has one KV section: of several
     * caches on one named pool, the first created publishes there until it is destroyed, the others
     * do not */
    const char *name;
    int trace; /* the created pool's trace setting (kva_config.trace) */
    /* copied into every event: where these blocks live, as the engine names tiers
     * (KVA_KV_MEDIUM_GPU, the default, 0; or another) */
    uint32_t event_medium;
    /* paged mode: the layers as groups of different shapes, num_groups (1 .. KVA_KV_MAX_GROUPS) of
     * them; the array is read during kva_kv_create and kva_kv_block_bytes only. NULL and 0
     * (default): one group from layers, kv_heads and head_dim */
    const kva_kv_group *groups;
    uint32_t num_groups;
} kva_kv_config;
/* max_key_bytes, event_capacity and event_medium sit where the fields before them left
 * alignment padding, so every other field has the offset it has without them; groups and
 * num_groups come last. */

/* Fills every field of *cfg with its default. */
KVA_API void kva_kv_config_init(kva_kv_config *cfg);

/* Bytes of one block: the sum over layers of parts * kv_heads * head_dim * dtype_bytes *
 * block_tokens (2 * layers * kv_heads * head_dim * dtype_bytes * block_tokens without groups),
 * after checking the geometry (KVA_ERR_INVALID for a zero or unsupported field or an overflow). */
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

/* The geometry fields of kva_kv_info (kv_heads, head_dim, slot_bytes, part_bytes, block_stride,
 * layer_stride) describe a cache whose layers all have one shape; where they differ (groups of
 * different shapes) those fields are 0, and kva_kv_layer_info gives each layer's. */
typedef struct kva_kv_info {
    kva_kv_mode mode;
    kva_kv_layout layout;
    uint32_t layers, kv_heads, head_dim, dtype_bytes, block_tokens;
    uint32_t num_blocks;               /* paged mode; 0 in contiguous mode */
    uint32_t max_context;              /* contiguous mode: the largest bucket; 0 in paged mode */
    size_t block_bytes;                /* all layers, all parts, of one block */
    size_t token_bytes;                /* all layers, all parts, of one token */
    size_t slot_bytes;                 /* K (or V) of one token in one layer: kv_heads*head_dim*dtype */
    size_t part_bytes;                 /* K (or V) of one block in one layer: slot_bytes*block_tokens */
    size_t block_stride, layer_stride; /* see kva_kv_layout */
    void *base;                        /* paged mode: the KV memory (address of block 0, layer 0, K) */
    size_t kv_bytes;                   /* paged: num_blocks * block_bytes; contiguous: pool capacity */
    kva_pool *pool;                    /* the pool the memory comes from */
} kva_kv_info;

KVA_API kva_status kva_kv_get_info(kva_kv *kv, kva_kv_info *out);

/* One layer's geometry (paged mode): in both layouts
 *     address(block, layer, part) = base + offset + block * block_stride + part * part_bytes */
typedef struct kva_kv_layer {
    uint32_t group; /* its index in kva_kv_config.groups (0 without groups) */
    uint32_t parts; /* 2: K and V; 1: one vector per token (MLA) */
    uint32_t kv_heads, head_dim;
    size_t slot_bytes;   /* one part of one token: kv_heads * head_dim * dtype_bytes */
    size_t part_bytes;   /* one part of one block: slot_bytes * block_tokens */
    size_t block_stride; /* from a block of this layer to the next block's */
    size_t offset;       /* block 0, part 0 of this layer, from base */
} kva_kv_layer;

/* The geometry of `layer` (paged mode). O(1), no lock. KVA_ERR_INVALID for a layer out of range
 * or a cache in contiguous mode. */
KVA_API kva_status kva_kv_layer_info(kva_kv *kv, uint32_t layer, kva_kv_layer *out);

/* The address of one part (K or V; K only in a layer of one part) of one layer of one block
 * (paged mode). O(1), no lock. */
KVA_API kva_status kva_kv_block_address(kva_kv *kv, uint32_t block, uint32_t layer, kva_kv_part part, void **out);

/* What the engine must copy after a call that moved KV (kva_kv_seq_append).
 * Paged mode: copy on write. The sequence's last block was shared (after a fork) and partly
 * filled; the writer now holds dst_block instead and must copy the first `tokens` tokens of
 * every layer's parts (K and V; an MLA layer's one vector) from src_block. Contiguous mode: the
 * sequence outgrew its bucket and moved to dst; for every layer l and part p, copy `tokens`
 * slots from src + (2l + p) * src_bucket * slot_bytes to dst + (2l + p) * dst_bucket * slot_bytes.
 * src stays allocated until the sequence's next append or free.
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

/* How the content of a request's blocks is given. */
typedef enum kva_kv_key_kind {
    KVA_KV_KEY_NONE = 0,   /* nothing: no block is looked up or registered */
    KVA_KV_KEY_TOKENS = 1, /* token ids, hashed and chained here into 128-bit keys */
    KVA_KV_KEY_U64 = 2,    /* one u64 per block (a trace's hash id), chained here */
    /* one engine key per block, key_len bytes, already chained by the engine: taken and stored as
     * given (max_key_bytes) */
    KVA_KV_KEY_BYTES = 3
} kva_kv_key_kind;

/* Content, for one request or, with offsets, many. Only the array of `kind` is read; its items
 * are token ids, u64 keys, or keys of key_len bytes each (item i at key_bytes + i * key_len). */
typedef struct kva_kv_content {
    uint32_t kind;            /* kva_kv_key_kind */
    uint32_t key_len;         /* KVA_KV_KEY_BYTES: bytes per key, 1 .. the cache's max_key_bytes */
    const uint32_t *tokens;   /* KVA_KV_KEY_TOKENS */
    const uint64_t *keys;     /* KVA_KV_KEY_U64 */
    const uint8_t *key_bytes; /* KVA_KV_KEY_BYTES */
} kva_kv_content;

/* Creates a sequence of num_tokens tokens: ceil(num_tokens / block_tokens) blocks (paged) or
 * one buffer of the smallest bucket that holds them (contiguous), in namespace_id.
 * Prefix caching (paged mode): content gives `count` items of its kind: token ids (at most
 * num_tokens; their whole blocks are the blocks given) or keys (one per block, at most the
 * sequence's full blocks). The longest cached prefix of the given blocks is reused (each hit
 * block gains a reference) and *cached_tokens (may be NULL) receives its length in tokens; the
 * request's other given blocks are registered under their keys for later requests (unless a
 * key is registered already: that block stays unregistered). content NULL, or kind NONE with
 * count 0: nothing is looked up or registered. priority (0 .. KVA_KV_PRIORITIES-1) sets the
 * eviction class of the blocks (see kva_kv_seq_free); KVA_KV_AGAIN ORed into it says the
 * request is a re-admission (counted apart in kva_kv_stats).
 * A sequence given the content of all of it (all num_tokens token ids, or a key for each of
 * its full blocks, none when it has none) keeps its chain: the blocks its decoding fills are
 * registered too (kva_kv_seq_extend).
 * The engine writes a new sequence's blocks after the hits (the prefill), never the hit blocks:
 * they hold the registered prefix other sequences share, and a registered block stays full
 * (an append past it starts a new block; one into a shared, partly filled block copies first).
 * New blocks come from the free blocks, then by evicting cached ones.
 * Errors: KVA_ERR_INVALID (seq NULL; an unknown kind; count beyond what the sequence holds;
 * content NULL, or its array, with count nonzero; engine keys in a cache without them, or
 * key_len 0 or beyond max_key_bytes; content in contiguous mode; a bucket beyond max_context; a
 * bad priority); KVA_ERR_NOMEM (not enough free and evictable blocks, or pool or host memory).
 * Nothing changes on an error. */
KVA_API kva_status kva_kv_seq_admit(kva_kv *kv, uint32_t num_tokens, uint64_t namespace_id, uint32_t priority,
                                    const kva_kv_content *content, uint32_t count, kva_kv_seq *seq,
                                    uint32_t *cached_tokens);

/* kva_kv_seq_admit with a 32-bit namespace and the content as block_keys (num_keys u64 keys,
 * kind U64) or token ids (num_token_ids, kind TOKENS), not both; neither: no content.
 * Errors: those of kva_kv_seq_admit, and KVA_ERR_INVALID for keys and tokens both. */
KVA_API kva_status kva_kv_seq_allocate(kva_kv *kv, uint32_t num_tokens, const uint64_t *block_keys, uint32_t num_keys,
                                       const uint32_t *tokens, uint32_t num_token_ids, uint32_t namespace_id,
                                       uint32_t priority, kva_kv_seq *seq, uint32_t *cached_tokens);

/* Grows a sequence by num_tokens tokens (decoding). Paged: a new block only when the last one
 * is full; if the last block is shared and partly filled, the writer first gets a private copy
 * (*copy says what to copy). Contiguous: moves to a larger bucket when needed (*copy again).
 * Blocks it fills are committed to the prefix cache when the sequence keeps its chain
 * (kva_kv_seq_admit) and content says what they hold: `count` items of the sequence's kind, the
 * num_tokens token ids appended (token ids), or one key for each block this call fills (u64 or
 * engine keys, of the sequence's key_len). Each filled block is then registered under its key
 * (its tokens or u64 key chained on the sequence's previous block, or the engine's key) as a
 * prompt's blocks are, so a later request (turn two of a conversation) hits the output of this
 * one; a key registered already leaves the block unregistered. With count 0 a sequence that
 * this call makes fill a block, or, keyed by token ids, append any token, stops keeping its
 * chain: none of its later blocks is registered. Content given to a sequence that keeps no
 * chain is not read.
 * Errors: KVA_ERR_INVALID (unknown or freed sequence, a pin, copy NULL, a length beyond 2^32-1
 * tokens or beyond max_context; for a sequence that keeps its chain, a kind or key_len other
 * than its own, count neither 0 nor the count above, content or its array NULL with count
 * nonzero), KVA_ERR_NOMEM; nothing changed on either. */
KVA_API kva_status kva_kv_seq_extend(kva_kv *kv, kva_kv_seq seq, uint32_t num_tokens, const kva_kv_content *content,
                                     uint32_t count, kva_kv_copy *copy);

/* kva_kv_seq_extend with no content. */
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
    uint32_t num_blocks;    /* paged: entries in the block table */
    uint32_t cached_tokens; /* tokens found in the prefix cache at allocation */
    uint32_t namespace_id;  /* the namespace's low 32 bits */
    uint32_t priority;
    uint32_t is_pin;
    uint32_t bucket_tokens; /* contiguous: the buffer's capacity in tokens */
    uint32_t namespace_hi;  /* the namespace's high 32 bits (in what is otherwise padding) */
    void *buffer;           /* contiguous: the buffer; layer l part p at (2l+p)*bucket*slot_bytes */
} kva_kv_seq_info;

KVA_API kva_status kva_kv_seq_get_info(kva_kv *kv, kva_kv_seq seq, kva_kv_seq_info *out);

/* Pins the longest cached prefix of the given blocks (keys or token ids, as for allocation) so
 * that it is never evicted until kva_kv_unpin: a pin is a sequence that holds a reference on
 * each of those blocks and allocates nothing. *pinned_tokens (may be NULL) says how much was
 * cached and is now pinned (0, an empty pin, when no key or token is given or nothing of them
 * is cached). Pins are not counted in the hit statistics. */
KVA_API kva_status kva_kv_pin(kva_kv *kv, const uint64_t *block_keys, uint32_t num_keys, const uint32_t *tokens,
                              uint32_t num_token_ids, uint32_t namespace_id, kva_kv_seq *pin, uint32_t *pinned_tokens);

/* kva_kv_pin with a 64-bit namespace and the blocks given as content (count items, as for
 * kva_kv_seq_admit: token ids, of which the whole blocks count, or keys). Paged mode. Errors:
 * KVA_ERR_INVALID (pin NULL; content as kva_kv_seq_admit refuses it), KVA_ERR_NOMEM (host
 * memory); nothing changed. */
KVA_API kva_status kva_kv_pin_content(kva_kv *kv, uint64_t namespace_id, const kva_kv_content *content, uint32_t count,
                                      kva_kv_seq *pin, uint32_t *pinned_tokens);

/* Looks a chain of blocks up without changing anything (no reference, no LRU order, no
 * statistic): the given blocks (content as for kva_kv_pin_content) are matched in order in
 * namespace_id, stopping at the first miss; *hits receives the number of blocks matched and
 * ids[0 .. *hits) their ids (ids may be NULL; else it has room for one id per block given).
 * The blocks found are registered, used or cached; a later call that references them (an
 * admission, kva_kv_block_ref) makes them its own. Paged mode. Errors: KVA_ERR_INVALID (hits
 * NULL; content as kva_kv_seq_admit refuses it). */
KVA_API kva_status kva_kv_lookup(kva_kv *kv, uint64_t namespace_id, const kva_kv_content *content, uint32_t count,
                                 uint32_t *ids, uint32_t *hits);

/* Releases a pin as kva_kv_seq_free releases a sequence. */
KVA_API kva_status kva_kv_unpin(kva_kv *kv, kva_kv_seq pin);

/* Evicts up to max_blocks cached blocks now, least recently used and lowest priority first
 * (UINT32_MAX: the whole prefix cache, as after new weights). *evicted may be NULL. */
KVA_API kva_status kva_kv_evict(kva_kv *kv, uint32_t max_blocks, uint32_t *evicted);

/* ---- batches: one call per scheduler step ------------------------------------------------- */
/*
 * Each call does what its single form does for every request, in array order, under one lock.
 * Per-request arguments are arrays of count entries; content is one kva_kv_content whose array
 * holds every request's items one after the other, request i's being items
 * [offsets[i], offsets[i + 1]) (offsets has count + 1 entries, non-decreasing; NULL when
 * content is NULL). Every argument of every request is checked before anything changes: on an
 * error status nothing changed and no out-parameter was written. Paged mode only.
 * Running out of blocks is not an error: admission and extension go through the requests in
 * order and stop at the first that does not fit (fewer free and evictable blocks than it needs,
 * or no host memory for its table). They return KVA_OK with *done the number of requests done:
 * requests [0, *done) are done and their out entries written, exactly as if each had been its
 * own call; requests [*done, count) are untouched (no block taken, no entry written), and when
 * *done < count kva_last_error says why request *done did not fit (counted in alloc_failures).
 */

/* Admits count sequences, request i of num_tokens[i] tokens in namespaces[i] (NULL: all 0)
 * with priorities[i] (NULL: all 0; KVA_KV_AGAIN, bit 7, marks a re-admission), its content items [offsets[i], offsets[i + 1]) of content
 * (NULL: none), as kva_kv_seq_admit; a request hits the blocks an earlier one registered.
 * seqs[i] receives its handle and cached_tokens[i] (cached_tokens may be NULL) its hit. Errors:
 * KVA_ERR_INVALID (any request's arguments as kva_kv_seq_admit refuses them; seqs, done or, with
 * count nonzero, num_tokens NULL; offsets NULL with content, or decreasing). */
KVA_API kva_status kva_kv_seq_admit_many(kva_kv *kv, uint32_t count, const uint32_t *num_tokens,
                                         const uint64_t *namespaces, const uint8_t *priorities,
                                         const kva_kv_content *content, const uint64_t *offsets, kva_kv_seq *seqs,
                                         uint32_t *cached_tokens, uint32_t *done);

/* A copy on write of a batch extension: request `request` (its index in the batch) must copy the
 * first `tokens` tokens of every layer's parts from src_block to dst_block, as kva_kv_copy
 * says. Four u32, no padding: numpy reads an array of them as uint32 of shape (n, 4). */
typedef struct kva_kv_block_copy {
    uint32_t request, src_block, dst_block, tokens;
} kva_kv_block_copy;

/* One decode step: extends seqs[i] by num_tokens[i] tokens with its content items
 * [offsets[i], offsets[i + 1]) of content (NULL: none), as kva_kv_seq_extend. Every copy on
 * write goes to copies, in request order, and *num_copies says how many: at most one per
 * request, so copies has room for count. Errors: KVA_ERR_INVALID (a handle never given, freed,
 * a pin, or listed twice; any request's arguments as kva_kv_seq_extend refuses them; seqs,
 * copies, num_copies or done NULL with count nonzero, or num_tokens). */
KVA_API kva_status kva_kv_seq_extend_many(kva_kv *kv, uint32_t count, const kva_kv_seq *seqs,
                                          const uint32_t *num_tokens, const kva_kv_content *content,
                                          const uint64_t *offsets, kva_kv_block_copy *copies, uint32_t *num_copies,
                                          uint32_t *done);

/* A decode step's arrays, for kva_kv_seq_extend_step: an engine that keeps its step buffers
 * where they are (as it keeps its kernels' input buffers) fills this once and passes it, with a
 * count, every step. The fields are kva_kv_seq_extend_many's arguments; num_copies and done
 * receive its results. */
typedef struct kva_kv_step {
    const kva_kv_seq *seqs;
    const uint32_t *num_tokens;
    const kva_kv_content *content; /* NULL: none */
    const uint64_t *offsets;       /* with content: count + 1 of them */
    kva_kv_block_copy *copies;     /* room for count */
    uint32_t num_copies;           /* out */
    uint32_t done;                 /* out */
} kva_kv_step;

/* kva_kv_seq_extend_many over the first count entries of step's arrays: one pointer and a count
 * a step instead of nine arguments (what a binding pays per argument is more than the library
 * spends on a dozen sequences). Errors: those of kva_kv_seq_extend_many, and KVA_ERR_INVALID for
 * a NULL step; a refused step leaves num_copies and done as they were. */
KVA_API kva_status kva_kv_seq_extend_step(kva_kv *kv, kva_kv_step *step, uint32_t count);

/* Frees count sequences, in order, as kva_kv_seq_free. All or nothing: KVA_ERR_DOUBLE_FREE (a
 * sequence freed before, or listed twice), KVA_ERR_INVALID (a handle this cache never gave, a
 * pin, seqs NULL with count nonzero) and nothing is freed. */
KVA_API kva_status kva_kv_seq_free_many(kva_kv *kv, uint32_t count, const kva_kv_seq *seqs);

/* Looks up count chains as kva_kv_lookup, request i's in namespaces[i] (NULL: all 0) with its
 * content items [offsets[i], offsets[i + 1]): hits[i] receives its hit in blocks, and when ids
 * is not NULL, ids[offsets[i] .. offsets[i] + hits[i]) its hit blocks (ids has offsets[count]
 * entries, one per item; token ids use the first of theirs). Changes nothing. Errors:
 * KVA_ERR_INVALID (any request's content as kva_kv_lookup refuses it; content, offsets or, with
 * count nonzero, hits NULL). */
KVA_API kva_status kva_kv_lookup_many(kva_kv *kv, uint32_t count, const uint64_t *namespaces,
                                      const kva_kv_content *content, const uint64_t *offsets, uint32_t *hits,
                                      uint32_t *ids);

/* ---- the block calls: an engine that keeps its own prefix structure ---------------------- */
/*
 * The engine holds references to blocks directly, not through a sequence's table: each call
 * below that takes or adds one gives the engine one more, and kva_kv_block_unref drops them.
 * The cache counts them per block, so a block's references are its table entries plus the
 * engine's, and kva_kv_check checks both. The engine may hold references on a block a sequence
 * uses too, and a sequence's prompt may hit a block the engine committed. Compaction moves
 * these blocks as it moves every other: the engine renames its ids by the moves it returns.
 * Paged mode only.
 */

/* Takes count blocks for the engine: free ones first, then cached ones evicted (lowest
 * priority, least recently released first), as a sequence's new blocks are. Each is used and
 * unregistered, with one reference the engine holds, and ids[0 .. count) receives them.
 * priority (0 .. KVA_KV_PRIORITIES-1) is the eviction class it is cached in when released.
 * All or nothing: KVA_ERR_NOMEM when fewer blocks are free and evictable than count. Errors:
 * KVA_ERR_INVALID (ids NULL with count nonzero, a bad priority). Nothing changes on an error. */
KVA_API kva_status kva_kv_block_take(kva_kv *kv, uint32_t count, uint32_t priority, uint32_t *ids);

/* Drops one of the engine's references to each listed block, in the order given (an id listed
 * n times drops n). A block left with none joins the newest end of its priority's LRU list if
 * registered, so the order given is the order of eviction (vLLM frees a request's blocks last
 * first), or else is free at once, taken before the others. Checked first: KVA_ERR_INVALID for
 * an id out of range or a block the engine holds fewer references to than listed while others
 * (sequences) hold it; KVA_ERR_DOUBLE_FREE for one that no one holds (a double unref); nothing
 * changed. */
KVA_API kva_status kva_kv_block_unref(kva_kv *kv, const uint32_t *ids, uint32_t count);

/* Adds one reference the engine holds to each listed block (vLLM's touch), in order; an id may
 * be listed more than once. A cached block leaves the LRU lists and is used again; a used one
 * (by the engine or by sequences) gains a reference. Errors: KVA_ERR_INVALID (an id out of
 * range, a free block, which holds nothing), nothing changed. */
KVA_API kva_status kva_kv_block_ref(kva_kv *kv, const uint32_t *ids, uint32_t count);

/* Commits full blocks the engine has filled under its own keys, a chain of them (vLLM's
 * cache_full_blocks): blocks[j] under the key of key_len bytes at keys + j * key_len, in
 * namespace_id. A key not registered yet is registered on its block: later lookups, prompts and
 * kva_kv_block_ref find it, and the block is cached, not freed, when its last reference goes. A
 * key registered already leaves its block unregistered (a duplicate, freed when released).
 * registered[j] (registered may be NULL) receives the block registered under key j: blocks[j],
 * or the block that held the key before. Each registration is a stored event whose parent is
 * key j - 1, or `parent` (key_len bytes; NULL: none) for j = 0, and whose tokens are
 * [first_token + j * block_tokens, first_token + (j + 1) * block_tokens).
 * Checked first: each block must be used, held by the engine alone (no sequence's table names
 * it: a sequence commits its own blocks through kva_kv_seq_extend), unregistered and listed
 * once; key_len 1 .. max_key_bytes; else KVA_ERR_INVALID and nothing changed. */
KVA_API kva_status kva_kv_block_commit(kva_kv *kv, uint64_t namespace_id, const uint32_t *blocks, uint32_t count,
                                       const uint8_t *keys, uint32_t key_len, const uint8_t *parent,
                                       uint32_t first_token, uint32_t *registered);

/* Drops the registration of each listed block that has one (vLLM's evict_blocks): a cached
 * block becomes free (below the free blocks: taken after them), a used one stays with its
 * holders, unregistered, and is freed when released. A block without a registration is passed
 * over. *evicted (may be NULL) counts the registrations dropped, each a removed event and an
 * eviction in the statistics. Errors: KVA_ERR_INVALID (an id out of range), nothing changed. */
KVA_API kva_status kva_kv_evict_blocks(kva_kv *kv, const uint32_t *ids, uint32_t count, uint32_t *evicted);

/* kva_kv_evict_blocks by engine key: each key (key_len bytes at keys + j * key_len) registered
 * in namespace_id has its block's registration dropped; keys not registered are passed over.
 * Errors: KVA_ERR_INVALID (key_len 0 or beyond max_key_bytes, keys NULL with count nonzero). */
KVA_API kva_status kva_kv_evict_keys(kva_kv *kv, uint64_t namespace_id, const uint8_t *keys, uint32_t key_len,
                                     uint32_t count, uint32_t *evicted);

/* Empties the prefix cache: every registration is dropped, cached blocks become free, used ones
 * stay with their holders, unregistered. One cleared event (no removed events); the dropped
 * registrations count as evictions. Sequences keep their chains: what their later extensions
 * fill is registered afresh. Errors: KVA_ERR_INVALID (contiguous mode). */
KVA_API kva_status kva_kv_reset_prefix_cache(kva_kv *kv);

/* ---- KV events, for KV-aware routing -------------------------------------------------------- */

typedef enum kva_kv_event_kind {
    KVA_KV_EVENT_STORED = 1,  /* a block was registered under a key */
    KVA_KV_EVENT_REMOVED = 2, /* a key's registration was dropped (eviction) */
    KVA_KV_EVENT_CLEARED = 3  /* every registration was dropped (kva_kv_reset_prefix_cache) */
} kva_kv_event_kind;

/* Tiers, as vLLM names them; event_medium may be any value the engine gives tiers. */
#define KVA_KV_MEDIUM_GPU 0
#define KVA_KV_MEDIUM_CPU 1
#define KVA_KV_MEDIUM_STORAGE 2

/* One event. 96 bytes, fixed-width fields, no padding: numpy reads an array of them with a
 * structured dtype of these fields in this order. */
typedef struct kva_kv_event {
    uint32_t kind;  /* kva_kv_event_kind */
    uint32_t block; /* the block's id then; KVA_KV_NO_BLOCK for CLEARED */
    uint64_t namespace_id;
    uint32_t first_token; /* STORED: the block holds tokens [first_token, first_token + */
    uint32_t num_tokens;  /*   num_tokens) of the request that filled it (block_tokens) */
    uint32_t medium;      /* the cache's event_medium */
    uint8_t key_len;      /* bytes of key: the engine key's length, or 16 for a library key */
    uint8_t parent_len;   /* STORED: bytes of parent; 0 for the first block of a chain */
    /* 1: key and parent are the library's 128-bit keys (token ids or u64 keys chained here), low 64
     * bits first, each little-endian; 0: the engine's keys as it gave them */
    uint8_t library_key;
    uint8_t reserved;
    uint8_t key[KVA_KV_MAX_KEY_BYTES];    /* key_len bytes; the rest 0 */
    uint8_t parent[KVA_KV_MAX_KEY_BYTES]; /* parent_len bytes; the rest 0 */
} kva_kv_event;

/* A cache created with event_capacity keeps its events in a ring of that many, in the order
 * they happen: a stored event for each registration (a prompt's blocks, the blocks an extension
 * fills, kva_kv_block_commit), a removed event for each registration dropped (eviction to make
 * room, kva_kv_evict, kva_kv_evict_blocks and _keys; a block renamed by kva_kv_compact keeps its
 * key and makes no event), a cleared event for kva_kv_reset_prefix_cache. An event that finds
 * the ring full is dropped and counted; those before it are kept.
 * This call moves the oldest events, as many as fit in capacity, into buf in order, sets *count
 * to how many, and leaves the rest for the next call. *dropped receives the events dropped since
 * the previous call (then 0 again): when it is nonzero the engine's view (a router's) misses
 * some and should be rebuilt. Errors: KVA_ERR_INVALID (a cache without events, buf NULL,
 * capacity 0, count or dropped NULL), nothing changed. */
KVA_API kva_status kva_kv_take_events(kva_kv *kv, kva_kv_event *buf, uint32_t capacity, uint32_t *count,
                                      uint64_t *dropped);

/* One block the engine must copy after kva_kv_compact: all layers, all parts, of src_block to
 * dst_block. */
typedef struct kva_kv_move {
    uint32_t src_block, dst_block;
} kva_kv_move;

/* Compaction (paged mode): moves every block that holds data (used by sequences, pins or the
 * engine directly, or cached for prefix hits: cached blocks are moved, not dropped, so their hits survive; call
 * kva_kv_evict first to drop them instead) to the lowest ids, so that afterwards blocks
 * [0, n) hold data and [n, num_blocks) are free, n = used_blocks + cached_blocks. With the blocks
 * layout the free blocks are then the last free_blocks * block_bytes bytes of the KV memory;
 * with the layers layout, the last free_blocks * block_stride bytes of each layer's region (the
 * layer's own block_stride, kva_kv_layer_info, when layers differ in shape)
 * (kva_kv_trim then hands that memory back).
 * It rewrites every sequence's and pin's block table in place, the prefix table and the LRU
 * lists (a block keeps its references, key, priority and place in eviction order), and
 * rebuilds the free stack as n, n+1, ... from the top. Blocks the engine holds through the
 * block calls move too: the engine renames its own ids by the moves. Only blocks at ids >= n move, each to a
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

/* The kinds of call whose latencies a cache keeps apart (kva_kv_stats.kind_ns_log2). */
typedef enum kva_kv_call_kind {
    KVA_KV_CALL_ALLOCATE = 0, /* kva_kv_seq_admit, _allocate, _admit_many, kva_kv_block_take */
    KVA_KV_CALL_APPEND = 1,   /* kva_kv_seq_append, _extend, _extend_many */
    KVA_KV_CALL_FREE = 2,     /* kva_kv_seq_free, _free_many, kva_kv_unpin, kva_kv_block_unref */
    KVA_KV_CALL_LOOKUP = 3,   /* kva_kv_lookup, _lookup_many */
    KVA_KV_CALL_EVICT = 4,    /* kva_kv_evict, _evict_blocks, _evict_keys */
    KVA_KV_CALL_OTHER = 5     /* every other call that takes the cache's lock */
} kva_kv_call_kind;
#define KVA_KV_CALL_KINDS 6
#define KVA_KV_LATENCY_BUCKETS 40
/* Without trace a cache times one call in this many on average, spaced at random, so that each
 * kind of call is sampled at this rate whatever the pattern of the calls. */
#define KVA_KV_CALL_SAMPLE_PERIOD 128

typedef struct kva_kv_stats {
    uint32_t num_blocks;
    uint32_t free_blocks;       /* hold nothing */
    uint32_t used_blocks;       /* referenced by live sequences, pins or the engine directly */
    uint32_t cached_blocks;     /* referenced by none, kept for prefix hits, evictable */
    uint32_t registered_blocks; /* with a key in the prefix table (cached ones and used ones) */
    uint32_t sequences;         /* live sequences, pins excluded */
    uint32_t pins;
    uint32_t trimmed_blocks; /* free, their memory given back (kva_kv_trim) */
    uint64_t hit_tokens;     /* cached_tokens summed over allocations */
    uint64_t query_tokens;   /* num_tokens summed over allocations */
    uint64_t evictions;      /* registrations dropped: eviction, kva_kv_evict*, reset */
    uint64_t cow_copies;
    uint64_t forks;
    uint64_t allocations, frees, appends;
    /* contiguous mode: bucket changes; paged mode: compaction moves (kva_kv_compact); and the bytes
     * to copy */
    uint64_t moves, moved_bytes;
    /* calls that returned KVA_ERR_NOMEM for want of blocks or memory (not kva_kv_compact's sizing
     * answer, which is no failure) */
    uint64_t alloc_failures;
    uint64_t rejected_calls; /* calls that returned KVA_ERR_INVALID or KVA_ERR_DOUBLE_FREE */
    size_t bytes_in_use;     /* KV bytes held by sequences (paged: used blocks) */
    /* host bytes of per-block metadata: records, prefix table, LRU segments in use, engine keys,
     * the engine's references once it has held one */
    size_t block_metadata_bytes;
    size_t metadata_bytes; /* all host bytes of the cache's bookkeeping */
    /* Calls timed from taking the cache's lock to giving it up, over every kind: with trace every
     * call (the time the engine spends in the KV manager), otherwise a sample (call_sample_period
     * below). The sums of the per-kind figures at the end. */
    uint64_t timed_calls;
    uint64_t timed_ns;
    uint64_t call_ns_log2[KVA_KV_LATENCY_BUCKETS]; /* calls that took [2^i, 2^(i+1)) ns (bucket 0 also 0 ns) */
    /* Peaks: the most at the end of any call since creation or the last kva_kv_reset_peaks. */
    uint32_t peak_used_blocks;
    uint32_t peak_cached_blocks;
    size_t peak_bytes_in_use;
    /* 1 with trace (every call timed), else KVA_KV_CALL_SAMPLE_PERIOD: on average one call in
     * this many is timed. Timing costs two clock reads (about 20 ns each on a VM's TSC), more
     * than a decode append costs, so an untraced cache samples. */
    uint32_t call_sample_period;
    uint32_t reserved;
    /* Per kva_kv_call_kind: calls timed, their total ns, their log2 histogram. */
    uint64_t kind_timed_calls[KVA_KV_CALL_KINDS];
    uint64_t kind_timed_ns[KVA_KV_CALL_KINDS];
    uint64_t kind_ns_log2[KVA_KV_CALL_KINDS][KVA_KV_LATENCY_BUCKETS];
    /* Distinct blocks referenced by at least one live pin (kva_kv_pin): a subset of used_blocks. */
    uint32_t pinned_blocks;
    uint32_t reserved2;
    /* The part of hit_tokens and query_tokens that re-admissions (KVA_KV_AGAIN) made; first
     * admissions made the rest. */
    uint64_t readmit_hit_tokens;
    uint64_t readmit_query_tokens;
} kva_kv_stats;

KVA_API kva_status kva_kv_get_stats(kva_kv *kv, kva_kv_stats *out);

/* Starts the peaks of kva_kv_stats afresh from the figures as they stand now (torch's
 * reset_peak_memory_stats): peak_used_blocks = used_blocks, and so on. KVA_ERR_INVALID for a
 * NULL cache. */
KVA_API kva_status kva_kv_reset_peaks(kva_kv *kv);

/* One namespace's share of the cache (kva_kv_namespaces). */
typedef struct kva_kv_namespace_share {
    uint64_t namespace_id; /* 0 in the other row */
    uint32_t is_other;     /* 1: the row pooling every namespace not tracked in a slot of its own */
    uint32_t sequences;    /* live sequences, pins excluded */
    uint32_t pins;         /* live pins */
    uint32_t reserved;
    uint64_t blocks;            /* their block tables' lengths summed (a shared block counts per table) */
    uint64_t registered_blocks; /* its keys in the prefix table */
} kva_kv_namespace_share;

/* Each namespace's share of the cache, exact and kept as the cache changes (a sequence's
 * admission, growth and free, a registration and its drop cost a compare and an add).
 * Namespace 0 and the first KVA_KV_NAMESPACE_SLOTS - 1 other namespaces seen get a row of their
 * own; a namespace seen while every slot is taken is counted in the other row. A slot whose counts are all zero is given to
 * a new namespace only while the other row is all zero, so a namespace is never counted in both.
 * Rows with any nonzero count are listed, tracked ones in slot order, then the other row:
 * *count receives how many there are (at most KVA_KV_NAMESPACE_SLOTS + 1), and the first
 * min(*count, max) are written to out. Errors: KVA_ERR_INVALID (NULL cache or count; out NULL
 * with max nonzero). */
KVA_API kva_status kva_kv_namespaces(kva_kv *kv, kva_kv_namespace_share *out, uint32_t max, uint32_t *count);

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
    KVA_KV_STRUCT_STATS = 5,
    KVA_KV_STRUCT_CONTENT = 6,
    KVA_KV_STRUCT_BLOCK_COPY = 7,
    KVA_KV_STRUCT_EVENT = 8,
    KVA_KV_STRUCT_GROUP = 9,
    KVA_KV_STRUCT_LAYER = 10,
    KVA_KV_STRUCT_STEP = 11,
    KVA_KV_STRUCT_NAMESPACE_SHARE = 12
} kva_kv_struct_id;

KVA_API size_t kva_kv_struct_size(kva_kv_struct_id which);

#ifdef __cplusplus
}
#endif

#endif /* KVALLOC_KV_H */
