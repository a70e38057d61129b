/*
 * kv_cache.h — the state of a KV-cache manager: block records, the free stack, the LRU lists,
 * the prefix table and the sequences. Nothing here is public.
 *
 * Paged mode. The KV memory is one exact allocation from a pool cut into num_blocks blocks.
 * Metadata per block: a 40-byte record indexed by its id, 1.5 to 3 u32 prefix-table buckets
 * (6 to 12 bytes), at most 8.4 bytes of LRU segments in a large cache (kv_lru.c): 46 to 61
 * bytes (bench_kv measures 50.8 at 10^4 blocks, 52.2 at 2^20). Beside them, only where used:
 * max_key_bytes bytes of engine keys (a cache created with them), 4 bytes of the engine's
 * references once the block calls have held one and 4 of pin counts once a pin has held one
 * (each mapped at creation, touched only then): with
 * 32-byte keys and the block calls, 88.2 bytes at 2^20. A block is in exactly one state:
 *   FREE    on the free stack (linked through `next`; released blocks go on top, evicted
 *           ones below the rest); holds nothing.
 *   USED    refs > 0: that many references, each a block-table entry of a live sequence (pins
 *           included) or one the engine holds directly through the block calls (loose[b]).
 *   CACHED  refs == 0, registered, on the LRU list of its priority: its KV is kept for a future
 *           prefix hit and is given up only when a block is needed and the free stack is empty.
 * LRU lists run from the least recently released block (head, evicted first) to the most
 * recent (tail). Each is a doubly linked list of segments, arrays of KV_LRU_SEG block ids in
 * release order, with KVA_NIL (a tombstone) where a block left; a CACHED block records its
 * position (lru_slot). Eviction takes the oldest entries of the lowest nonempty priority: the
 * victims are known from the arrays before their records are read, so their records and
 * prefix-table buckets load in parallel (kv_lru.c explains the segments).
 *
 * A block is registered, with its key in the prefix table, only while it is full in every
 * table that names it: appends write only into a sequence's partial last block, so cached KV
 * is never written. A registered key is unique: a new block whose key is already registered
 * stays unregistered and is freed, not cached, when released. A key is the library's chained
 * 128-bit key (key_len 0) or the engine's own bytes (key_len 1 .. max_key_bytes, kept in
 * key_store at b * max_key_bytes; the record holds their fingerprint): kv_key.h.
 *
 * Commits. Blocks are registered by a prompt (those given after the hits), by an extension of a
 * sequence that keeps its chain (each block it fills: the sequence remembers its last full
 * block's key, and when keyed by token ids the tokens of its partial block), and by
 * kva_kv_block_commit (blocks no table names). Every registration and dropped registration
 * goes into the event ring when the cache has one (kv_events.c).
 *
 * Compaction (kv_compact.c) renumbers the blocks: those holding data (USED and CACHED) go to
 * ids [0, n) and the free stack is rebuilt as n, n+1, ... from the top; every record, link and
 * table entry is renamed with its block, so every invariant below holds across it.
 *
 * Invariants (kva_kv_check verifies each):
 *  K1  Every block is FREE, USED, CACHED or TRIMMED; all but USED ones have refs == 0, USED
 *      ones refs > 0; the TRIMMED blocks are exactly [backed_blocks, num_blocks);
 *      free_count + used_count + cached_count + trimmed == num_blocks; peak_used >= used_count
 *      and peak_cached >= cached_count.
 *  K2  A block's refs equals the number of entries naming it in live sequences' tables plus
 *      loose[b], the references the engine holds directly; loose_refs sums loose[]; no loose
 *      count carries KV_LOOSE_MARK (a mark lives only inside one call).
 *  K3  The free stack holds exactly the FREE blocks, each once, free_count of them, and ends at
 *      free_bottom (KVA_NIL when empty).
 *  K4  The segments of LRU list p are doubly linked from lru_head[p] to lru_tail[p]; each holds
 *      fill <= KV_LRU_SEG entries, tombstones before `first`, `live` entries that are not
 *      tombstones (at least one, but for a tail with fill 0), and every live entry names a
 *      CACHED block of priority p
 *      whose lru_slot is that entry's position, and the last of `fill` is live; two adjacent
 *      segments, unless the second is the tail, hold more than KV_LRU_SEG live entries between
 *      them. The lists hold exactly the CACHED blocks, p's
 *      lru_count[p] of them; bit p of lru_nonempty is set iff list p is not empty. Every other
 *      segment below lru_used is on the free-segment list, with fill 0.
 *  K5  Every CACHED block is registered; no FREE block is. Each registered block is on the chain
 *      of bucket (key.lo & bucket_mask) exactly once, every chained block is registered, and no
 *      two registered blocks share (key, namespace, key_len, key bytes); registered_count
 *      counts them. A registered engine key has 1 <= key_len <= max_key_bytes and its key is
 *      the fingerprint of its namespace and bytes (kv_key_engine).
 *  K6  A registered block is full in every table naming it: at entry i of a sequence of n
 *      tokens, (i + 1) * block_tokens <= n.
 *  K7  A live sequence has len == ceil(num_tokens / block_tokens) <= cap (paged) and a
 *      nonzero generation; free slots are on the free-slot list, each once; live_seqs and
 *      live_pins count the live slots.
 *  K8  Contiguous mode: a live sequence owns a live pool allocation of at least bucket_tokens *
 *      token_bytes, bucket_tokens is a power of two in [KVA_KV_MIN_BUCKET, max_context] holding
 *      num_tokens; contig_bytes sums the usable sizes of every buffer and retired buffer.
 *  K9  A live sequence's key_kind is a kva_kv_key_kind, NONE for pins and in contiguous mode;
 *      one keyed by token ids has its partial buffer, one keyed by engine keys a key_len in
 *      [1, max_key_bytes] and has_last == (num_tokens >= block_tokens). While it keeps its
 *      chain, its last full block, when registered, is registered under the key the sequence
 *      holds for it: chain (key_len 0) or last_key, in its namespace.
 *  K10 The event ring holds event_count <= event_capacity events from event_head on, each of a
 *      known kind with key_len and parent_len at most KVA_KV_MAX_KEY_BYTES.
 *  K11 Pins: pin_refs[b] equals the number of entries naming b in live pins' tables, and
 *      pinned_count the blocks with a nonzero pin_refs (all of them USED, by K1 and K2).
 *  K12 Namespaces (kv_ns): slots [0, ns.assigned) hold distinct namespaces (at least slot 0,
 *      namespace 0's from creation), the rest are all zero; a live sequence's ns_slot is the slot holding its namespace, or KV_NS_OTHER when
 *      none does; each row's sequences, pins and blocks (table lengths) sum the live sequences
 *      and pins whose ns_slot is that row, and its registered count the registered blocks whose
 *      namespace is in that slot (the other row: in none). When the other row is not all zero,
 *      every slot is assigned. The memo names an assigned slot, the one holding memo_ns. The
 *      index holds each assigned slot once, where probing from its namespace's hash finds it.
 *
 * Threads. One mutex per cache (`lock`) guards everything below except the fields marked
 * "fixed at creation", which are written before the cache is handed out and only read after,
 * so kva_kv_get_info and kva_kv_block_address read them without it. Every other public entry
 * point is a thin wrapper: NULL check, kv_lock, a static *_locked implementation, kv_unlock,
 * so the lock is held for the whole call and released on every return path. kva_kv_destroy
 * must not run concurrently with any other call on the cache.
 * Lock order: the cache's lock, then the pool's locks (a cache calls kva_alloc_exact, kva_free,
 * kva_usable_size and kva_check under its lock). The pool calls back into the cache only through
 * the publisher hook (kv_publish.c), which never blocks on the cache's lock: it uses it when its
 * own thread holds it at the end of a call (kv_publish_due), else takes it with trylock and
 * leaves the KV section as it was when the lock is busy; so no cycle can form.
 */
#ifndef KVA_KV_CACHE_H
#define KVA_KV_CACHE_H

#include <pthread.h>

#include "kv_key.h"
#include "os.h"

enum {
    KV_FREE = 0,
    KV_USED = 1,
    KV_CACHED = 2,
    KV_TRIMMED = 3 /* free, its memory given back (kv_trim.c) */
};

typedef struct kva_kv_block {
    kva_kv_key key;     /* while registered: the chained key, or the engine key's fingerprint */
    uint64_t ns;        /* while registered: the namespace of the key */
    uint32_t refs;      /* table entries naming it + loose[b] */
    uint32_t hash_next; /* the next block on the same prefix-table bucket */
    union {
        uint32_t next;     /* while FREE: the next block on the free stack */
        uint32_t lru_slot; /* while CACHED: its entry in the LRU segments (segment * KV_LRU_SEG + i) */
    };
    uint8_t state;
    uint8_t priority; /* the highest priority of its holders since leaving FREE */
    uint8_t registered;
    uint8_t key_len; /* while registered: 0 for a library key, else the engine key's bytes */
} kva_kv_block;

_Static_assert(sizeof(kva_kv_block) == 40, "a block record is 40 bytes");

/* A key as the prefix table matches it: its 128 bits and namespace, and for an engine key its
 * bytes (the record keeps a copy in key_store). */
typedef struct kv_ident {
    kva_kv_key key;
    uint64_t ns;
    const uint8_t *bytes; /* len bytes; NULL for a library key */
    uint32_t len;         /* 0: a library key */
} kv_ident;

/* Set in a loose count only while one call checks its arguments (a block listed twice). */
#define KV_LOOSE_MARK 0x80000000u

/* One segment of an LRU list (kv_lru.c). */
#define KV_LRU_SEG 64 /* block ids per segment: one 256-byte array */
typedef struct kv_lru_seg {
    uint32_t prev, next; /* the segments before and after it in its list; next links free ones */
    uint8_t first;       /* entries [0, first) are tombstones */
    uint8_t fill;        /* entries [0, fill) are written */
    uint8_t live;        /* entries that are not tombstones */
    uint8_t priority;    /* the list it is on */
} kv_lru_seg;

typedef struct kva_kv_seqrec {
    uint32_t *table;        /* paged: block ids; cap entries allocated, kept across reuse */
    unsigned char *buffer;  /* contiguous: the bucket */
    unsigned char *retired; /* contiguous: the previous bucket, freed at the next append/free */
    /* keyed by token ids: the tokens of its partial last block (block_tokens allocated, kept across
     * reuse) */
    uint32_t *partial;
    uint32_t len, cap;
    uint32_t num_tokens;
    uint32_t cached_tokens;
    uint32_t generation; /* of the handle that names this slot now (never 0) */
    uint32_t bucket_tokens;
    uint32_t next_free; /* free-slot list link */
    /* the batch call (kv->batch) that last listed it: one listing it again is listing it twice; any
     * value outside batch calls */
    uint32_t listed;
    uint64_t ns;
    kva_kv_key chain; /* keyed by tokens or u64 keys: its last full block's key (root before the first) */
    uint8_t live, priority, is_pin;
    /* kva_kv_key_kind of the content of its next blocks: NONE when it keeps no chain (none given,
     * or it broke) */
    uint8_t key_kind;
    uint8_t key_len;  /* keyed by engine keys: their length */
    uint8_t has_last; /* keyed by engine keys: last_key holds its last full block's key */
    uint8_t ns_slot;  /* while live: its row in the namespace table (kv_ns), KV_NS_OTHER if untracked */
    uint8_t last_key[KVA_KV_MAX_KEY_BYTES];
} kva_kv_seqrec;

/* The namespace table (kva_kv_namespaces, K12): a row per tracked namespace, then the other row. */
#define KV_NS_OTHER KVA_KV_NAMESPACE_SLOTS
typedef struct kv_ns_row {
    uint64_t ns;
    uint32_t live[2];    /* live sequences [0] and pins [1] (indexed by is_pin) */
    uint64_t blocks;     /* table lengths of its live sequences and pins */
    uint64_t registered; /* its registered blocks */
} kv_ns_row;
/* The assigned slots by their namespace's hash, linear probing in twice their number of
 * entries: a namespace's slot, or that it has none, is found in a probe or two. */
#define KV_NS_INDEX (2 * KVA_KV_NAMESPACE_SLOTS)
#define KV_NS_HOLE 0xFF
typedef struct kv_ns_table {
    kv_ns_row rows[KV_NS_OTHER + 1];
    uint32_t assigned; /* slots [0, assigned) hold a namespace */
    uint32_t memo;     /* the slot holding memo_ns, the namespace of the last lookup that found one */
    uint64_t memo_ns;
    uint64_t scans;             /* walks over the slots for an empty one, for tests to bound */
    uint8_t index[KV_NS_INDEX]; /* each assigned slot once, the rest KV_NS_HOLE */
} kv_ns_table;

typedef struct kva_kv_counters {
    uint64_t hit_tokens, query_tokens, evictions, cow_copies, forks;
    uint64_t readmit_hit_tokens, readmit_query_tokens; /* the part re-admissions made (KVA_KV_AGAIN) */
    uint64_t allocations, frees, appends, moves, moved_bytes;
    uint64_t alloc_failures, rejected_calls;
} kva_kv_counters;

struct kva_kv {
    pthread_mutex_t lock; /* guards every field not marked "fixed at creation" */
    /* Fixed at creation (read without the lock). */
    kva_kv_info info; /* geometry and addresses */
    /* Paged mode: the parts of every layer when all layers have one shape (info's strides hold
     * then); 0 when groups of different shapes make each layer's geometry its own (layer_geom,
     * num_layers entries). */
    uint32_t parts;
    kva_kv_layer *layer_geom;
    kva_pool *pool;
    int owns_pool;
    unsigned char *memory; /* paged: the KV allocation (info.base) */
    uint64_t hash_seed;
    uint64_t memory_offset; /* paged, publishing: memory - the pool's base (heap-map cells) */
    int publishing;         /* the cache's publisher is attached to a named pool */
    /* Under the pool's publish lock: the heap-map cells the paged KV memory covers as last
     * painted (their states, then their fills), put back when a full publish repaints the
     * map from the buddy while the cache's lock is busy (kv_publish.c). */
    uint8_t *painted;
    uint64_t painted_first; /* the first cell */
    uint32_t painted_cells;
    uint32_t sample_period; /* 1 (trace): every call timed; else one in this many per kind */
    /* kva_os_fork_depth() + 1 at creation when the pool's memory is shared with other processes
     * (kva_pool_range_shared), else 0: kv_lock_to_change */
    unsigned shared_depth;
    uint32_t max_key_bytes; /* the longest engine key; 0: none */
    uint32_t event_medium;  /* copied into every event */

    /* Everything below: under the lock. */

    /* Paged mode: read on every block operation. */
    kva_kv_block *blocks;
    uint32_t *buckets; /* head block of each prefix-table chain, or KVA_NIL */
    uint32_t bucket_mask;
    uint32_t num_blocks, block_tokens;
    uint32_t free_top, free_bottom; /* the free stack: taken from the top, evictions appended below */
    uint32_t free_count, used_count, cached_count, registered_count;
    uint32_t backed_blocks; /* blocks [0, backed_blocks) have memory; the rest are TRIMMED */
    uint32_t lru_nonempty;
    uint32_t lru_head[KVA_KV_PRIORITIES], lru_tail[KVA_KV_PRIORITIES]; /* segments, or KVA_NIL */
    uint32_t lru_count[KVA_KV_PRIORITIES];
    uint32_t *lru_ids; /* lru_segments * KV_LRU_SEG block ids (KVA_NIL: a tombstone) */
    kv_lru_seg *lru_segs;
    uint32_t lru_segments; /* reserved: enough for any cache state (kv_lru.c) */
    uint32_t lru_used;     /* segments [0, lru_used) have been handed out */
    uint32_t lru_free;     /* the free-segment list (of used ones) */
    kva_kv_key root;
    size_t blocks_length, buckets_length; /* bytes mapped for blocks and buckets */
    size_t lru_ids_length, lru_segs_length;
    uint8_t *key_store; /* num_blocks * max_key_bytes: registered engine keys' bytes */
    size_t key_store_length;
    uint32_t *loose; /* per block: references the engine holds directly */
    size_t loose_length;
    uint64_t loose_refs; /* sum of loose[] */
    int loose_touched;   /* some block has held a loose reference (its pages are resident) */
    /* per block: entries naming it in live pins' tables (K11); mapped like loose, touched only
     * once a pin has held a block */
    uint32_t *pin_refs;
    size_t pin_refs_length;
    uint32_t pinned_count; /* blocks with pin_refs[b] != 0 */
    int pins_touched;

    /* Events (kv_events.c): a ring of event_capacity, event_count of them from event_head. */
    kva_kv_event *events; /* NULL: events off */
    size_t events_length;
    uint32_t event_capacity, event_head, event_count;
    uint64_t events_dropped; /* since the last kva_kv_take_events */

    /* Sequences. */
    kva_kv_seqrec *seqs;
    uint32_t batch;        /* numbers the batch calls that list sequences (kv_batch.c) from 1 */
    uint32_t handle_key;   /* XORed into a handle's slot bits: kv_slots.c */
    uint32_t seq_slots;    /* slots in use or on the free-slot list */
    uint32_t seq_capacity; /* slots allocated */
    uint32_t free_slot;
    uint32_t live_seqs, live_pins;
    kv_ns_table ns; /* each namespace's share (kv_ns.c) */

    /* Contiguous mode. */
    size_t contig_bytes;
    uint32_t max_context;

    kva_kv_counters counters;
    /* Peaks, raised where the figures rise: kv_take and kv_block_ref (used), kv_lru_push
     * (cached), buffer_alloc (contiguous mode's bytes). */
    uint32_t peak_used, peak_cached;
    size_t peak_contig_bytes;
    /* Call latency (kv_lock, kv_unlock): the calls left before the next one timed, whatever
     * their kind (the spacing is random, so each kind is sampled at the same rate whatever the
     * pattern of the calls); the kind being timed plus one (0: none); when it started. */
    uint32_t countdown;
    uint32_t timing;
    uint64_t call_start_ns;
    uint64_t sample_state; /* xorshift state spacing the samples */
    uint64_t kind_timed_calls[KVA_KV_CALL_KINDS], kind_timed_ns[KVA_KV_CALL_KINDS];
    uint64_t kind_ns_log2[KVA_KV_CALL_KINDS][KVA_KV_LATENCY_BUCKETS];
};

/* ---- handles ----------------------------------------------------------------------------- */

KVA_INLINE kva_kv_seq kv_handle(const kva_kv *kv, uint32_t slot, uint32_t generation) {
    return (uint64_t)generation << 32 | (slot ^ kv->handle_key);
}

/* The key of the n-th cache of the process (kv_slots.c says why this one). */
KVA_INLINE uint32_t kv_handle_key(uint32_t n) { return n * 0x9e3779b9u; }

/* A key for a new cache's handles: kv_handle_key of the next n. */
uint32_t kv_new_handle_key(void);

/* Why a handle names no live sequence: KVA_ERR_DOUBLE_FREE in *why for a handle of a sequence
 * that was freed, KVA_ERR_INVALID for one never given (recorded); returns NULL. */
kva_kv_seqrec *kv_seq_refused(const kva_kv *kv, kva_kv_seq seq, kva_status *why);

/* The live sequence a handle names, or NULL with the reason (kv_seq_refused). Inline: every
 * sequence call, and a batch's twice per entry, start here. */
KVA_INLINE kva_kv_seqrec *kv_seq_lookup(kva_kv *kv, kva_kv_seq seq, kva_status *why) {
    uint32_t slot = (uint32_t)seq ^ kv->handle_key, generation = (uint32_t)(seq >> 32);
    if (kva_likely(slot < kv->seq_slots)) {
        kva_kv_seqrec *rec = &kv->seqs[slot];
        if (kva_likely(rec->live && rec->generation == generation && generation != 0)) return rec;
    }
    return kv_seq_refused(kv, seq, why);
}

/* Counts a refused call and returns its status. */
kva_status kv_reject(kva_kv *kv, kva_status status);

/* A slot for a new sequence with room for `blocks` table entries, not yet live; NULL (and
 * KVA_ERR_NOMEM recorded) if host memory runs out. Changes nothing the caller can see. */
kva_kv_seqrec *kv_seq_reserve(kva_kv *kv, uint32_t blocks);
/* Makes the reserved slot live and returns its handle. */
kva_kv_seq kv_seq_publish(kva_kv *kv, kva_kv_seqrec *rec);
/* Returns a live slot to the free-slot list; its handle goes stale. */
void kv_seq_retire(kva_kv *kv, kva_kv_seqrec *rec);
/* Grows a table to hold `blocks` entries; 0 if host memory runs out (nothing changed). */
int kv_table_reserve(kva_kv_seqrec *rec, uint32_t blocks);

/* ---- the LRU lists (kv_lru.c) ------------------------------------------------------------ */

/* Host memory for a per-block array, committed (kv_cache.c). */
kva_status kv_metadata_map(size_t bytes, void **out, size_t *length);
/* The geometry of a layer below info.layers (paged mode). */
void kv_layer_geometry(const kva_kv *kv, uint32_t layer, kva_kv_layer *out);

/* Maps the segments for a cache of num_blocks blocks; unmaps them. */
kva_status kv_lru_init(kva_kv *kv);
void kv_lru_release(kva_kv *kv);
/* The slow halves of push and remove: the tail segment of list p, s, is full (returns the
 * tail to append to); segment s lost an entry and may merge with a neighbour (K4). */
uint32_t kv_lru_make_room(kva_kv *kv, uint32_t s, unsigned p);
void kv_lru_settle(kva_kv *kv, uint32_t s);

KVA_INLINE uint32_t *kv_lru_seg_ids(const kva_kv *kv, uint32_t s) { return kv->lru_ids + (size_t)s * KV_LRU_SEG; }

/* Whether segments a and b (either may be KVA_NIL) hold few enough live entries to merge. */
KVA_INLINE int kv_lru_mergeable(const kva_kv *kv, uint32_t a, uint32_t b) {
    return a != KVA_NIL && b != KVA_NIL && kv->lru_segs[a].live + kv->lru_segs[b].live <= KV_LRU_SEG;
}

/* Whether K4 requires them to merge: b, after a, is not its list's tail (kv_lru.c). */
KVA_INLINE int kv_lru_must_merge(const kva_kv *kv, uint32_t a, uint32_t b) {
    return kv_lru_mergeable(kv, a, b) && kv->lru_segs[b].next != KVA_NIL;
}

/* Appends a block at the newest end of the LRU list of its priority: CACHED. O(1), or
 * O(KV_LRU_SEG) when the tail segment is compacted. */
KVA_INLINE void kv_lru_push(kva_kv *kv, uint32_t b) {
    kva_kv_block *blk = &kv->blocks[b];
    unsigned p = blk->priority;
    uint32_t s = kv->lru_tail[p];
    if (kva_unlikely(s == KVA_NIL || kv->lru_segs[s].fill == KV_LRU_SEG)) s = kv_lru_make_room(kv, s, p);
    kv_lru_seg *g = &kv->lru_segs[s];
    uint32_t at = g->fill;
    kv_lru_seg_ids(kv, s)[at] = b;
    blk->lru_slot = s * KV_LRU_SEG + at;
    g->fill = (uint8_t)(at + 1);
    g->live++;
    blk->state = KV_CACHED;
    kv->lru_count[p]++;
    kv->lru_nonempty |= 1u << p;
    if (++kv->cached_count > kv->peak_cached) kv->peak_cached = kv->cached_count;
}

/* Takes a CACHED block off its list (a hit, or its eviction), leaving a tombstone; the caller
 * sets its new state. O(1), or O(KV_LRU_SEG) when two segments merge. */
KVA_INLINE void kv_lru_remove(kva_kv *kv, uint32_t b) {
    kva_kv_block *blk = &kv->blocks[b];
    uint32_t s = blk->lru_slot / KV_LRU_SEG, i = blk->lru_slot % KV_LRU_SEG;
    kv_lru_seg *g = &kv->lru_segs[s];
    uint32_t *ids = kv_lru_seg_ids(kv, s);
    unsigned p = g->priority;
    ids[i] = KVA_NIL;
    blk->lru_slot = KVA_NIL;
    g->live--;
    if (i == g->first)
        while (g->first < g->fill && ids[g->first] == KVA_NIL) g->first++;
    if (i + 1 == g->fill)
        while (g->fill > g->first && ids[g->fill - 1] == KVA_NIL) g->fill--;
    if (kva_unlikely(g->live == 0 || kv_lru_must_merge(kv, g->prev, s) || kv_lru_must_merge(kv, s, g->next)))
        kv_lru_settle(kv, s);
    if (--kv->lru_count[p] == 0) kv->lru_nonempty &= ~(1u << p);
    kv->cached_count--;
}
/* Copies up to max of the next victims, in eviction order, into out; returns how many. Reads
 * only the segments. */
uint32_t kv_lru_collect(const kva_kv *kv, uint32_t *out, uint32_t max);
/* Renames every listed block through fwd (compaction, kv_compact.c). */
void kv_lru_rename(kva_kv *kv, uint32_t (*fwd)(const kva_kv *kv, uint32_t b, uint32_t n), uint32_t n);
/* K4 (kv_check.c calls it): marks each listed block in seen. */
kva_status kv_lru_check(const kva_kv *kv, uint8_t *seen);

/* ---- the prefix table and the blocks (kv_blocks.c) ---------------------------------------- */

/* Block b's room in key_store: max_key_bytes bytes. */
KVA_INLINE uint8_t *kv_key_store(const kva_kv *kv, uint32_t b) { return kv->key_store + (size_t)b * kv->max_key_bytes; }

KVA_INLINE kv_ident kv_ident_library(kva_kv_key key, uint64_t ns) { return (kv_ident){key, ns, NULL, 0}; }

KVA_INLINE kv_ident kv_ident_engine(const kva_kv *kv, uint64_t ns, const uint8_t *bytes, uint32_t len) {
    return (kv_ident){kv_key_engine(kv->root, ns, bytes, len), ns, bytes, len};
}

/* The key registered block b holds, as an identity (its bytes in key_store). */
KVA_INLINE kv_ident kv_block_ident(const kva_kv *kv, uint32_t b) {
    const kva_kv_block *blk = &kv->blocks[b];
    return (kv_ident){blk->key, blk->ns, blk->key_len ? kv_key_store(kv, b) : NULL, blk->key_len};
}

/* Whether registered block b holds the key id: the 128 bits first (they differ for almost
 * every other key), then the namespace, the length and, for an engine key, its bytes. */
KVA_INLINE int kv_block_holds(const kva_kv *kv, uint32_t b, const kv_ident *id) {
    const kva_kv_block *blk = &kv->blocks[b];
    return kv_key_equal(blk->key, id->key) && blk->ns == id->ns && blk->key_len == id->len &&
           (id->len == 0 || memcmp(kv_key_store(kv, b), id->bytes, id->len) == 0);
}

/* The registered block with this key on the chain starting at b, or KVA_NIL. */
KVA_INLINE uint32_t kv_prefix_find_from(const kva_kv *kv, uint32_t b, const kv_ident *id) {
    while (b != KVA_NIL) {
        if (kv_block_holds(kv, b, id)) return b;
        b = kv->blocks[b].hash_next;
    }
    return KVA_NIL;
}

KVA_INLINE uint32_t kv_prefix_find(const kva_kv *kv, const kv_ident *id) {
    return kv_prefix_find_from(kv, kv->buckets[id->key.lo & kv->bucket_mask], id);
}

/* Registers unregistered block b under id unless the key is registered already; returns the
 * block registered under it now (b, or the one that held it). A registration is a stored event
 * with the given parent (NULL: none) and first token. */
uint32_t kv_commit(kva_kv *kv, uint32_t b, const kv_ident *id, const kv_ident *parent, uint32_t first_token);
/* Drops registered block b's registration (a removed event, an eviction): a CACHED block goes
 * below the free blocks, a USED one stays USED. */
void kv_forget(kva_kv *kv, uint32_t b);

KVA_INLINE uint32_t kv_blocks_available(const kva_kv *kv) {
    return kv->free_count + kv->cached_count + (kv->num_blocks - kv->backed_blocks);
}

/* Before a call takes `need` blocks (within kv_blocks_available): when the free blocks with
 * memory do not cover it, as many trimmed ones as it lacks get their memory back (rather than
 * cached blocks being evicted). When that memory cannot be had, the call goes on if the free
 * blocks and the `evictable` cached ones cover it (eviction then serves it, as before any
 * trim); otherwise it fails, with nothing changed. */
kva_status kv_ensure_backed(kva_kv *kv, uint32_t need, uint32_t evictable);

/* Evicts up to count cached blocks, lowest priority and least recently released first, and
 * appends them below the free blocks, each a removed event when `announce`. Returns how many
 * it evicted. */
uint32_t kv_evict(kva_kv *kv, uint32_t count, int announce);
/* Evicts what a call needs beyond the free blocks (the caller checked kv_blocks_available). */
void kv_make_room(kva_kv *kv, uint32_t need);
/* Takes n free blocks from the top of the free stack into table[0 .. n), each USED with one
 * reference (kv_make_room made room). */
void kv_take(kva_kv *kv, uint32_t *table, uint32_t n, uint8_t priority);
/* Adds a reference from a holder of the given priority to a USED or CACHED block. */
void kv_block_ref(kva_kv *kv, uint32_t b, uint8_t priority);

/* Drops one reference from block b; left with none, it is cached if registered, else free (on
 * top of the free stack). */
KVA_INLINE void kv_unref(kva_kv *kv, uint32_t b) {
    kva_kv_block *blk = &kv->blocks[b];
    if (--blk->refs != 0) return;
    kv->used_count--;
    if (blk->registered) {
        kv_lru_push(kv, b);
    } else {
        blk->state = KV_FREE;
        blk->next = kv->free_top;
        if (kv->free_count == 0) kv->free_bottom = b;
        kv->free_top = b;
        kv->free_count++;
    }
}

/* Drops one reference from each of table[0 .. n), last first. */
void kv_release(kva_kv *kv, const uint32_t *table, uint32_t n);

/* ---- namespaces (kv_ns.c) and pins --------------------------------------------------------- */

/* The row of namespace ns: its slot, one given to it now if it has none and one may be (K12), or
 * KV_NS_OTHER. The search and the assignment are out of line. */
__attribute__((cold)) uint32_t kv_ns_lookup(kva_kv *kv, uint64_t ns);
KVA_INLINE uint32_t kv_ns_slot(kva_kv *kv, uint64_t ns) {
    /* Registrations come in runs of one namespace: a compare, mostly. The memo always names a
     * slot (namespace 0 holds slot 0 from creation). */
    if (kva_likely(kv->ns.memo_ns == ns)) return kv->ns.memo;
    return kv_ns_lookup(kv, ns);
}
/* Where a probe of the namespace index for ns starts (Fibonacci hashing). */
KVA_INLINE uint32_t kv_ns_home(uint64_t ns) {
    return (uint32_t)((ns * 0x9E3779B97F4A7C15ull) >> (64 - __builtin_ctz(KV_NS_INDEX)));
}
/* Empties the table (creation). */
void kv_ns_init(kva_kv *kv);
/* Every registration dropped at once (kva_kv_reset_prefix_cache). */
void kv_ns_forget_all(kva_kv *kv);
/* K11 and K12, for kv_check.c. */
kva_status kv_ns_check(const kva_kv *kv);
kva_status kv_pins_check(const kva_kv *kv);

/* A live pin's table entries, counted in pin_refs (K11): taken at pin, given back at unpin. Out
 * of line: a sequence's free pays only the test of is_pin. */
void kv_pin_hold(kva_kv *kv, const uint32_t *table, uint32_t n);
void kv_pin_drop(kva_kv *kv, const uint32_t *table, uint32_t n);

/* ---- content: how a request's blocks are named (kv_lookup.c) ------------------------------ */

/* Content checked against the cache: kind, key length and array, `items` of them. */
typedef struct kv_content {
    uint32_t kind;          /* kva_kv_key_kind */
    uint32_t key_len;       /* engine keys */
    const uint32_t *tokens; /* the array of `kind`, at the request's first item */
    const uint64_t *keys;
    const uint8_t *bytes;
    uint32_t items;  /* items given */
    uint32_t blocks; /* full blocks whose content is given (token ids: whole blocks) */
    uint64_t ns;
} kv_content;

/* Checks content of `items` items (content NULL: none, with items 0) for this cache: a known
 * kind, its array, an engine key length; fills *out for namespace ns. KVA_ERR_INVALID, counted,
 * when refused. */
kva_status kv_content_check(kva_kv *kv, const kva_kv_content *content, uint64_t items, uint64_t ns, kv_content *out);

/* Narrows checked content (its arrays at item 0) to items [first, first + items). In place, field
 * by field: a copy of the whole struct just written field by field would wait on the stores. */
KVA_INLINE void kv_content_slice(const kva_kv *kv, kv_content *c, uint64_t first, uint32_t items) {
    if (c->kind == KVA_KV_KEY_NONE) return;
    c->items = items;
    c->blocks = c->kind == KVA_KV_KEY_TOKENS ? items / kv->block_tokens : items;
    if (first == 0) return; /* the array may be NULL then (no items at all) */
    if (c->kind == KVA_KV_KEY_TOKENS) c->tokens += first;
    else if (c->kind == KVA_KV_KEY_U64) c->keys += first;
    else c->bytes += first * c->key_len;
}

/* Checks a batch's offsets: count + 1 non-decreasing entries from 0, each request's items
 * fitting a u32, the last `total`. KVA_ERR_INVALID, counted, when refused. */
kva_status kv_offsets_check(kva_kv *kv, const uint64_t *offsets, uint32_t count, uint64_t *total);

/* The key of given block i of content of this kind (c->kind; a constant where a caller makes one
 * loop per kind), whose parent's chained key is `parent` (unused by engine keys). */
KVA_INLINE kv_ident kv_content_key(const kva_kv *kv, const kv_content *c, uint32_t i, kva_kv_key parent,
                                   uint32_t kind) {
    if (kind == KVA_KV_KEY_BYTES) return kv_ident_engine(kv, c->ns, c->bytes + (size_t)i * c->key_len, c->key_len);
    kva_kv_key digest = kind == KVA_KV_KEY_U64
                            ? kv_digest_caller(c->keys[i])
                            : kv_digest_tokens(c->tokens + (size_t)i * kv->block_tokens, kv->block_tokens);
    return kv_ident_library(kv_key_chain(parent, digest, c->ns), c->ns);
}

KVA_INLINE kv_ident kv_content_ident(const kva_kv *kv, const kv_content *c, uint32_t i, kva_kv_key parent) {
    return kv_content_key(kv, c, i, parent, c->kind);
}

/* Looks the given blocks up in order, stopping at the first miss. The hits go to
 * table[0 .. hits) (table may be NULL); *last receives the last hit's key (the root as a library key if none:
 * what the first block given chains on) and *cached_hits how many hits are CACHED. Changes
 * nothing. */
uint32_t kv_prefix_probe(const kva_kv *kv, const kv_content *c, uint32_t *table, kv_ident *last, uint32_t *cached_hits);

/* ---- sequences (kv_seq.c), for the batch calls (kv_batch.c) -------------------------------- */

/* The live sequence a handle names, for every call but free (a freed one is simply invalid);
 * NULL with *st set, the refusal counted. */
kva_kv_seqrec *kv_live_seq(kva_kv *kv, kva_kv_seq seq, kva_status *st);
/* Checks a paged admission's arguments beyond its content. */
kva_status kv_admit_check(kva_kv *kv, uint32_t num_tokens, uint32_t priority, const kv_content *c);
/* A paged admission, arguments checked: KVA_OK, or KVA_ERR_NOMEM with nothing changed. priority
 * may carry KVA_KV_AGAIN (a re-admission, counted apart). */
kva_status kv_admit(kva_kv *kv, uint32_t num_tokens, const kv_content *c, uint8_t priority, kva_kv_seq *seq,
                    uint32_t *cached_tokens);
/* Checks an extension of a live sequence by n tokens with content c (NULL: none). */
kva_status kv_extend_check(kva_kv *kv, const kva_kv_seqrec *rec, kva_kv_seq seq, uint32_t n, const kv_content *c);
/* A paged extension, arguments checked: KVA_OK, or KVA_ERR_NOMEM with nothing changed. */
kva_status kv_extend(kva_kv *kv, kva_kv_seqrec *rec, uint32_t n, const kv_content *c, kva_kv_copy *copy);
/* Frees a live sequence or pin (paged or contiguous). */
void kv_seq_release(kva_kv *kv, kva_kv_seqrec *rec);

/* ---- events (kv_events.c) ------------------------------------------------------------------ */

kva_status kv_events_init(kva_kv *kv, uint32_t capacity);
void kv_events_release(kva_kv *kv);
/* Each records one event when events are on (kv->events): block b registered under id, with
 * its parent (NULL: none) and first token; registered block b's registration dropped (its key
 * read from the block); every registration dropped. */
void kv_event_stored(kva_kv *kv, uint32_t b, const kv_ident *id, const kv_ident *parent, uint32_t first_token);
void kv_event_removed(kva_kv *kv, uint32_t b);
void kv_event_cleared(kva_kv *kv);

/* ---- modes ------------------------------------------------------------------------------- */

/* Contiguous mode (kv_contig.c); called with the lock held and the arguments checked. */
kva_status kv_contig_allocate(kva_kv *kv, uint32_t num_tokens, uint32_t priority, kva_kv_seq *seq);
kva_status kv_contig_append(kva_kv *kv, kva_kv_seqrec *rec, uint32_t num_tokens, kva_kv_copy *copy);
void kv_contig_release(kva_kv *kv, kva_kv_seqrec *rec);

/* Attaches the cache's publisher to its pool when the pool is named, and detaches it. */
void kv_publish_attach(kva_kv *kv);
void kv_publish_detach(kva_kv *kv);
/* Publishes the pool and the cache's section when the pool's interval has passed; called with
 * the lock held, at the end of every locked call (kv_unlock), when the state is consistent. */
void kv_publish_due(kva_kv *kv);

/* Starts timing this call of the kind and draws how many calls of it pass before the next
 * one timed; records a timed call's time (slow paths, out of line). */
void kv_time_start(kva_kv *kv, kva_kv_call_kind kind);
uint32_t kv_next_sample(kva_kv *kv);
void kv_time_call(kva_kv *kv);

/* Every locked call begins here. Sampling costs the untimed calls one decrement. */
KVA_INLINE void kv_lock(kva_kv *kv, kva_kv_call_kind kind) {
    pthread_mutex_lock(&kv->lock);
    if (kva_unlikely(--kv->countdown == 0)) kv_time_start(kv, kind);
}
/* Why a call that would change a forked child's copy of a cache over a shared pool is refused
 * (kv_lock_to_change): KVA_ERR_BACKEND, the reason recorded. */
kva_status kv_refuse_inherited(void);

/* Every call that changes the cache begins here instead (all but those that only read it:
 * lookups, block tables, the check, the figures). In a child forked from the process that made
 * a cache over a shared pool, the cache is a copy of the owner's whose blocks are the owner's
 * memory: what it would hand out the owner hands out too, so the call is refused (the lock
 * held, as after kv_lock: the caller unlocks). One compare on every other cache. */
KVA_INLINE kva_status kv_lock_to_change(kva_kv *kv, kva_kv_call_kind kind) {
    kv_lock(kv, kind);
    if (kva_unlikely(kv->shared_depth != 0) && kv->shared_depth != kva_os_fork_depth() + 1)
        return kv_refuse_inherited();
    return KVA_OK;
}

/* And ends here, the state consistent: the call's time when it is timed, a publish when due. */
KVA_INLINE void kv_unlock(kva_kv *kv) {
    if (kva_unlikely(kv->timing)) kv_time_call(kv);
    /* In paged mode the cache never calls the pool after creation, so the pool's own slow paths
     * would never publish: the cache's calls do it (a countdown, then a clock read when due). */
    if (kv->publishing) kv_publish_due(kv);
    pthread_mutex_unlock(&kv->lock);
}

#endif
