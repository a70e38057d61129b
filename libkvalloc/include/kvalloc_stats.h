/*
 * kvalloc_stats.h — the layout of the live statistics segment a named pool publishes.
 *
 * A pool created with a name publishes its state in a POSIX shared-memory object
 * "/kvalloc.<pid>.<name>" (on Linux the file /dev/shm/kvalloc.<pid>.<name>), mode 0600, removed
 * when the pool is destroyed and at normal process exit. Any process of the same user can map it
 * read-only and watch the pool live; the engine never waits for a reader.
 *
 * Layout rules, so a reader in any language can parse it without trusting it:
 *  - Little-endian, every field naturally aligned, no pointers: sections are found through the
 *    section table by (offset, size) from the start of the segment. A reader bounds-checks
 *    every offset and size against the segment's real size before using it.
 *  - A reader accepts the same abi_major; a newer abi_minor only adds fields at the end of a
 *    struct or new section kinds, which an older reader ignores. Section sizes are exact, and
 *    the array sections state their entry size, so a reader finds each entry of a newer,
 *    longer struct.
 *  - Liveness: with KVA_SHM_CAP_LIVENESS_LOCK the writer holds a shared flock on the segment for
 *    its whole life, dropped by the kernel however the process ends. A reader that can take an
 *    exclusive flock (LOCK_EX | LOCK_NB, then released) knows the writer is gone, whatever pid
 *    namespace either lives in; writer_pid is for display.
 *  - Consistency is a sequence lock: the writer makes `sequence` odd, writes, makes it even.
 *    A reader copies the segment between two reads of `sequence` and keeps the copy only if
 *    both reads are equal and even; otherwise it retries (a bounded number of times). The lock
 *    covers every section but the trace ring and the latency histogram (since 1.3), which a
 *    traced pool writes at every call: see "The trace ring" below for how a reader takes
 *    records from a copy; the histogram's counters are read as they stand.
 */
#ifndef KVALLOC_STATS_H
#define KVALLOC_STATS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVA_SHM_MAGIC 0x315441545341564bull /* "KVASTAT1" read as a little-endian u64 */
#define KVA_SHM_ABI_MAJOR 1
/* Minor versions add to the layout without moving what was there. 1.1: the summary's publish
 * interval and backing fields, entry sizes of the array sections, the liveness lock. 1.2: one
 * arenas entry per arena, with slab and claim figures. 1.3: the trace ring and the latency
 * histogram outside the sequence lock. 1.4: peaks in the summary and the KV section, the KV
 * section's per-kind call latency histograms. 1.5: pinned blocks and re-admission counters at
 * the end of the KV section; the KV sequences and KV namespaces sections; the heap-map cell
 * state KVA_SHM_CELL_KV_PINNED. */
#define KVA_SHM_ABI_MINOR 5
#define KVA_SHM_MAX_SECTIONS 16
#define KVA_SHM_PREFIX "kvalloc." /* the name in /dev/shm is kvalloc.<pid>.<pool name> */

/* Capability bits: which sections this writer publishes. */
enum {
    KVA_SHM_CAP_SUMMARY = 1u << 0,
    KVA_SHM_CAP_HEAPMAP = 1u << 1,
    KVA_SHM_CAP_CLASSES = 1u << 2,
    KVA_SHM_CAP_SLABS = 1u << 3,
    KVA_SHM_CAP_ARENAS = 1u << 4,
    KVA_SHM_CAP_LATENCY = 1u << 5,
    KVA_SHM_CAP_KV = 1u << 6,
    KVA_SHM_CAP_TRACE = 1u << 7,
    KVA_SHM_CAP_TRACE_ALL = 1u << 8,    /* trace on: every call is recorded and timed */
    KVA_SHM_CAP_LIVENESS_LOCK = 1u << 9 /* the writer holds a shared flock while alive */
};

/* Section kinds, in the section table. */
enum {
    KVA_SHM_SECTION_SUMMARY = 1,
    KVA_SHM_SECTION_HEAPMAP = 2,
    KVA_SHM_SECTION_CLASSES = 3,
    KVA_SHM_SECTION_SLABS = 4,
    KVA_SHM_SECTION_ARENAS = 5,
    KVA_SHM_SECTION_LATENCY = 6,
    KVA_SHM_SECTION_KV = 7,
    KVA_SHM_SECTION_TRACE = 8,
    KVA_SHM_SECTION_KV_SEQUENCES = 9,  /* 1.5 */
    KVA_SHM_SECTION_KV_NAMESPACES = 10 /* 1.5 */
};

typedef struct kva_shm_section {
    uint32_t kind; /* KVA_SHM_SECTION_* ; 0 marks an unused entry */
    uint32_t reserved;
    uint64_t offset; /* bytes from the start of the segment */
    uint64_t size;   /* bytes */
} kva_shm_section;

typedef struct kva_shm_header {
    uint64_t magic; /* KVA_SHM_MAGIC */
    uint16_t abi_major;
    uint16_t abi_minor;
    uint32_t header_size;  /* sizeof(kva_shm_header) as written */
    uint64_t capabilities; /* KVA_SHM_CAP_* */
    uint64_t sequence;     /* odd while the writer is publishing */
    uint64_t segment_size; /* bytes of the whole segment */
    uint32_t writer_pid;
    uint32_t section_count; /* entries used in sections[] */
    uint64_t start_time_ns; /* CLOCK_REALTIME when the pool was created */
    uint64_t heartbeat_ns;  /* CLOCK_REALTIME of the latest publish */
    uint64_t publish_count; /* publishes so far */
    char pool_name[64];     /* NUL-terminated */
    kva_shm_section sections[KVA_SHM_MAX_SECTIONS];
} kva_shm_header;

/* KVA_SHM_SECTION_SUMMARY: the pool at a glance (the same figures as kva_stats). */
typedef struct kva_shm_summary {
    uint64_t capacity, min_block, slab_chunk, max_alloc_size;
    uint64_t bytes_in_use, bytes_free, slab_bytes, slab_free_bytes, largest_free;
    uint64_t live_allocations, alloc_count, free_count, alloc_failures, rejected_calls;
    uint64_t slab_count, metadata_bytes, page_size;
    uint32_t page_kind; /* kva_page_kind */
    uint32_t num_orders;
    double fragmentation;     /* 1 - largest free / total free */
    uint64_t free_blocks[48]; /* per buddy order */
    /* The kernel's unusable-free-space index per order k: the fraction of free memory in blocks
     * too small to serve an order-k request (0 = all usable, 1 = none). */
    double unusable_index[48];
    /* 1.1 */
    /* the writer publishes on its own at most this often, and only from its slow paths: a quiet
     * heartbeat means idle, not dead */
    uint32_t publish_interval_ms;
    uint32_t backend;      /* kva_backend */
    int32_t numa_node;     /* the node the region is bound to, -1 if none */
    uint32_t flags;        /* bit 0: memory locked (mlock), bit 1: pinned for CUDA */
    uint64_t mapped_bytes; /* CUDA: device memory mapped now; host: the region */
    /* 1.4: kva_stats' peaks (kvalloc.h says how exact each is) */
    uint64_t peak_block_bytes;
    uint64_t peak_bytes_in_use;
} kva_shm_summary;

/* KVA_SHM_SECTION_HEAPMAP: the pool as `cells` equal cells in address order, each
 * cell_blocks minimum blocks (cell_bytes bytes). state[] then fill[] follow the header. */
enum {
    KVA_SHM_CELL_FREE = 0,      /* all free */
    KVA_SHM_CELL_BLOCK = 1,     /* mostly a live buddy allocation */
    KVA_SHM_CELL_SLAB = 2,      /* a slab chunk */
    KVA_SHM_CELL_MIXED = 3,     /* partly free, partly in use */
    KVA_SHM_CELL_KV_USED = 4,   /* KV blocks referenced by sequences (or the engine), not pinned */
    KVA_SHM_CELL_KV_CACHED = 5, /* KV blocks kept only by the prefix cache */
    KVA_SHM_CELL_KV_PINNED = 6  /* 1.5: KV blocks held by a pin (kva_kv_pin), never evicted */
};
/* A KV cache paints the cells its blocks cover: of the blocks a cell covers (64 of them at most,
 * evenly spread, when it covers more), it takes the in-use kind most of them are, the kinds being
 * pinned, used and not pinned, and cached, a tie going to the first of these (the order the KV
 * bar draws them: pinned, used, cached, free); free only when none of them is in use. fill is
 * the share of them in use, whatever kind. A reader that meets a state it does not know (a newer
 * writer's) shows it as mixed. */
typedef struct kva_shm_heapmap {
    uint32_t cells;
    uint32_t cell_blocks;
    uint64_t cell_bytes;
    /* uint8_t state[cells]; uint8_t fill[cells];  fill: in-use share of the cell, 0..255 */
} kva_shm_heapmap;

/* KVA_SHM_SECTION_CLASSES: count entries follow. */
typedef struct kva_shm_class {
    uint32_t object_size;
    uint32_t objects_per_slab;
    uint64_t live_objects;
    uint64_t slabs;
    uint64_t allocs;
    uint64_t frees;
} kva_shm_class;
typedef struct kva_shm_classes {
    uint32_t count;
    uint32_t entry_size; /* sizeof(kva_shm_class) as written */
    /* kva_shm_class classes[count]; */
} kva_shm_classes;

/* KVA_SHM_SECTION_SLABS: one entry per live slab (count of capacity entries are valid; the
 * section is exactly sizeof(kva_shm_slabs) + capacity entries, which gives the entry size), in
 * chunk order. Each slab's occupancy is a strip of strip_cells cells, each the in-use share of its
 * objects 0..255. capacity is at most KVA_SHM_SLABS_MAX: a pool with more slabs lists its first
 * ones (the summary's slab_count counts them all), so that the segment stays a few MiB however
 * large the pool (a 1 TiB pool of 64 KiB chunks would have needed 1.3 GB). */
#define KVA_SHM_SLABS_MAX 65536
#define KVA_SHM_STRIP_CELLS 64
typedef struct kva_shm_slab {
    uint32_t chunk; /* chunk index: offset = chunk * slab_chunk */
    uint16_t size_class;
    uint16_t reserved;
    uint32_t inuse;
    uint32_t objects;
    uint8_t strip[KVA_SHM_STRIP_CELLS];
} kva_shm_slab;
typedef struct kva_shm_slabs {
    uint32_t count;
    uint32_t capacity;
    /* kva_shm_slab slabs[capacity]; */
} kva_shm_slabs;

/* KVA_SHM_SECTION_ARENAS: one entry per arena. Allocations and frees are counted per thread,
 * not per arena: what an arena has is slabs, and the words of objects it hands to threads. */
typedef struct kva_shm_arena {
    uint64_t slabs; /* slabs of every class that belong to the arena */
    uint64_t slab_bytes;
    uint64_t spare_slabs; /* empty slabs it keeps, one per class at most */
    uint64_t word_claims; /* words of objects handed to thread caches since creation */
    int64_t numa_node;    /* the node its slabs' memory is bound to, -1 for none */
} kva_shm_arena;
typedef struct kva_shm_arenas {
    uint32_t count;
    uint32_t entry_size; /* sizeof(kva_shm_arena) as written */
    /* kva_shm_arena arenas[count]; */
} kva_shm_arenas;

/* KVA_SHM_SECTION_LATENCY: log2 histograms of call latency; bucket i counts calls that took
 * [2^i, 2^(i+1)) nanoseconds (bucket 0 also counts 0 ns). Only a pool created with trace on
 * (KVA_SHM_CAP_TRACE_ALL) times its calls, every one of them; otherwise the histograms stay
 * empty, since reading a clock would double the cost of the calls themselves. */
#define KVA_SHM_LATENCY_BUCKETS 40
typedef struct kva_shm_latency {
    uint64_t alloc[KVA_SHM_LATENCY_BUCKETS];
    uint64_t free[KVA_SHM_LATENCY_BUCKETS];
} kva_shm_latency;

/* KVA_SHM_SECTION_KV: the KV-cache manager attached to the pool, if any. */
#define KVA_SHM_KV_CALL_KINDS 6 /* kva_kv_call_kind: allocate, append, free, lookup, evict, other */
typedef struct kva_shm_kv {
    uint32_t present; /* 0: no KV cache attached; the rest is zero */
    uint32_t block_tokens;
    uint64_t total_blocks, free_blocks, used_blocks, cached_blocks;
    uint64_t hit_tokens, query_tokens, evictions, cow_copies, forks, live_sequences;
    uint64_t block_bytes;
    /* 1.4: kva_kv_stats' peaks and bytes in use */
    uint64_t peak_used_blocks, peak_cached_blocks, peak_bytes_in_use, bytes_in_use;
    /* The latency of the cache's calls per kva_kv_call_kind, as kva_kv_stats has it: calls
     * timed, their total ns, log2 histograms as the latency section's. Timed calls are a sample
     * of one in call_sample_period of each kind on average (1: every call, trace on). Copied at
     * each publish, under the sequence lock. */
    uint32_t call_sample_period;
    uint32_t call_kinds; /* KVA_SHM_KV_CALL_KINDS: the arrays' first dimension */
    uint64_t call_timed[KVA_SHM_KV_CALL_KINDS];
    uint64_t call_ns[KVA_SHM_KV_CALL_KINDS];
    uint64_t call_ns_log2[KVA_SHM_KV_CALL_KINDS][KVA_SHM_LATENCY_BUCKETS];
    /* 1.5: kva_kv_stats' pinned_blocks (distinct blocks held by live pins, a subset of the used
     * ones) and the part of hit_tokens / query_tokens that re-admissions made (KVA_KV_AGAIN);
     * first admissions made the rest. */
    uint64_t pinned_blocks;
    uint64_t readmit_hit_tokens, readmit_query_tokens;
} kva_shm_kv;

/* KVA_SHM_SECTION_KV_SEQUENCES (1.5): the longest live sequences of the KV cache, then its
 * longest pins in the room they leave, with the start of their block tables. Written only at
 * full publishes (at most once a second, and at kva_stats_publish): the scan that finds them
 * walks the live sequences and pins, never the blocks. Zero (count 0, live 0) when no KV cache
 * is attached. `count` entries of the section's `capacity` are valid: the sequences longest
 * (num_tokens) first, then the pins (KVA_SHM_KV_SEQ_PIN) longest first; each entry is entry_size bytes,
 * its table[] at the same offset in every minor version, table_capacity ids long. */
#define KVA_SHM_KV_SEQ_ENTRIES 16 /* entries the section has room for */
#define KVA_SHM_KV_SEQ_TABLE 128  /* block ids each entry holds */
enum {
    KVA_SHM_KV_SEQ_PIN = 1u << 0 /* the entry is a pin (kva_kv_pin), not a sequence */
};
typedef struct kva_shm_kv_sequence {
    uint64_t handle;       /* the kva_kv_seq */
    uint64_t namespace_id; /* its namespace, all 64 bits */
    uint64_t num_tokens;
    uint64_t cached_tokens;               /* tokens its admission found in the prefix cache */
    uint32_t blocks;                      /* the length of its block table */
    uint32_t priority;                    /* its eviction class, 0 .. KVA_KV_PRIORITIES-1 */
    uint32_t flags;                       /* KVA_SHM_KV_SEQ_* */
    uint32_t table_len;                   /* ids in table[]: min(blocks, table_capacity); below blocks: cut */
    uint32_t table[KVA_SHM_KV_SEQ_TABLE]; /* the first table_len block ids of its table */
} kva_shm_kv_sequence;
typedef struct kva_shm_kv_sequences {
    uint32_t count;          /* valid entries */
    uint32_t entry_size;     /* sizeof(kva_shm_kv_sequence) as written */
    uint32_t capacity;       /* entries the section has room for (KVA_SHM_KV_SEQ_ENTRIES) */
    uint32_t table_capacity; /* ids in each entry's table[] (KVA_SHM_KV_SEQ_TABLE) */
    uint64_t live_sequences; /* over all, not just the entries */
    uint64_t live_pins;
    uint64_t longest_tokens; /* the longest live sequence's tokens (pins not counted); 0: none */
    uint64_t longest_handle; /* its handle; 0: none */
    /* kva_shm_kv_sequence entries[capacity]; */
} kva_shm_kv_sequences;

/* KVA_SHM_SECTION_KV_NAMESPACES (1.5): each namespace's share of the KV cache (kva_kv_namespaces
 * in kvalloc_kv.h has the rules): up to KVA_SHM_KV_NAMESPACE_SLOTS tracked namespaces, then the
 * row of all the others pooled, flagged KVA_SHM_KV_NS_OTHER. Rows whose counts are all zero are
 * left out. Written at every publish; count 0 when no KV cache is attached. */
#define KVA_SHM_KV_NAMESPACE_SLOTS 32
#define KVA_SHM_KV_NAMESPACE_ROWS (KVA_SHM_KV_NAMESPACE_SLOTS + 1)
enum {
    KVA_SHM_KV_NS_OTHER = 1u << 0 /* the pooled row of untracked namespaces; namespace_id is 0 */
};
typedef struct kva_shm_kv_namespace {
    uint64_t namespace_id;
    uint32_t flags; /* KVA_SHM_KV_NS_* */
    uint32_t reserved;
    uint64_t sequences;         /* live sequences of the namespace */
    uint64_t pins;              /* live pins */
    uint64_t blocks;            /* the lengths of their block tables, summed */
    uint64_t registered_blocks; /* its keys in the prefix table */
} kva_shm_kv_namespace;
typedef struct kva_shm_kv_namespaces {
    uint32_t count;      /* valid rows */
    uint32_t entry_size; /* sizeof(kva_shm_kv_namespace) as written */
    uint32_t capacity;   /* rows the section has room for (KVA_SHM_KV_NAMESPACE_ROWS) */
    uint32_t reserved;
    /* kva_shm_kv_namespace rows[capacity]; */
} kva_shm_kv_namespaces;

/* KVA_SHM_SECTION_TRACE: a ring of the latest calls. Record i of the ring is at index
 * i % capacity; `written` counts all records ever written, so the newest is (written - 1). */
enum {
    KVA_SHM_OP_ALLOC = 1,
    KVA_SHM_OP_FREE = 2,
    KVA_SHM_OP_ALLOC_ALIGNED = 3,
    KVA_SHM_OP_ALLOC_EXACT = 4,
    KVA_SHM_OP_TRIM = 5
};
typedef struct kva_shm_trace_record {
    uint64_t time_ns; /* CLOCK_REALTIME */
    uint64_t offset;  /* offset of the result or of the freed address; UINT64_MAX if none */
    uint64_t size;    /* bytes asked for (0 for a free) */
    uint32_t thread;  /* the kernel thread id */
    uint8_t op;       /* KVA_SHM_OP_* */
    uint8_t status;   /* kva_status */
    uint16_t reserved;
} kva_shm_trace_record;
/* The trace ring: record i (counting from 0 since the pool was created) sits in slot
 * i % capacity. The writer, outside the sequence lock, makes a release fence, stores record i,
 * then `written` = i + 1 (a release store). A reader loads `written` with acquire before its
 * copy (w1), and after it, past an acquire fence, loads it again (w2): the copy holds records
 * [w1 - capacity, w1) whole except those whose slots the writer may have written over meanwhile,
 * the records below w2 + 1 - capacity. So it keeps records [max(w1, w2 + 1) - capacity, w1)
 * (and none below 0). (On x86-64 the fences are no instructions: a reader without them, such as
 * pykvalloc's, is right there.) */
typedef struct kva_shm_trace {
    uint32_t capacity;
    uint32_t entry_size; /* sizeof(kva_shm_trace_record) as written */
    uint64_t written;    /* records written since creation */
    /* kva_shm_trace_record records[capacity]; */
} kva_shm_trace;

#ifdef __cplusplus
}
#endif

#endif /* KVALLOC_STATS_H */
