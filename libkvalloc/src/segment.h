/*
 * segment.h — a named pool's live statistics segment (layout in kvalloc_stats.h).
 *
 * Writers are serialized by the lock of the pool's publisher (publish.h). A publish happens between segment_begin and
 * segment_end, the sequence lock readers copy under; a trace record and the latency counters are
 * written outside it, the ring by its own protocol (kvalloc_stats.h, "The trace ring").
 */
#ifndef KVA_SEGMENT_H
#define KVA_SEGMENT_H

#include "internal.h"
#include "kvalloc_stats.h"

#define KVA_TRACE_RECORDS 1024

typedef struct kva_segment {
    char name[KVA_NAME_MAX + 32]; /* "/kvalloc.<pid>.<name>" */
    unsigned char *base;
    size_t size;
    int fd; /* kept open: it holds the writer's liveness lock */
    kva_shm_header *header;
    kva_shm_summary *summary;
    kva_shm_heapmap *heapmap;
    uint8_t *cell_state, *cell_fill;
    kva_shm_classes *classes;
    kva_shm_slabs *slabs;
    kva_shm_arenas *arenas;
    kva_shm_latency *latency;
    kva_shm_kv *kv;
    kva_shm_trace *trace;
    kva_shm_kv_sequences *kv_sequences;
    kva_shm_kv_namespaces *kv_namespaces;
    uint64_t interval_ns;
    uint64_t next_publish_ns; /* monotonic */
    uint64_t next_full_ns;    /* monotonic: when the heap map is refreshed next */
    /* this process is a child forked from the segment's writer (kva_segment_disown): nothing is
     * mapped any more */
    int inherited;
    struct kva_segment *next_live; /* the process-wide list removed at exit */
} kva_segment;

/* The geometry the segment is sized for. */
typedef struct kva_segment_geometry {
    uint32_t nblocks; /* minimum blocks of the pool */
    uint32_t nchunks; /* slab descriptors */
    uint32_t narenas;
} kva_segment_geometry;

/* Creates, maps and registers the segment of pool `pool_name`. */
kva_status kva_segment_open(const char *pool_name, const kva_segment_geometry *geo, int trace_all, unsigned interval_ms,
                            kva_segment **out);
/* Unlinks and unmaps it (an inherited one is only forgotten). NULL is ignored. */
void kva_segment_close(kva_segment *seg);

/* In a child forked from the writer: the segment is the parent's. The child neither writes it
 * nor removes it (at close or at exit), and lets go of the mapping and the descriptor, each of
 * which holds the open file and with it the parent's liveness lock: kept, they would make a
 * dead parent look alive for as long as the child runs. */
void kva_segment_disown(kva_segment *seg);

/* The lock of the process-wide list of segments, for fork (fork.c): taken last before a fork
 * and released after it in both processes, so that a child never inherits it held (its exit
 * takes it to remove its own segments). */
void kva_segments_lock(void);
void kva_segments_unlock(void);

/* In a forked child, with the list's lock held: disowns every segment of the list. The list,
 * not the live pools, because a segment stays listed until its destruction, after its pool has
 * left the live pools (kva_pool_destroy). */
void kva_segments_disown_all(void);

void kva_segment_begin(kva_segment *seg);
void kva_segment_end(kva_segment *seg);

/* Appends one record to the trace ring and, when latency_ns is not UINT64_MAX, to the
 * latency histogram of its kind. */
void kva_segment_record(kva_segment *seg, uint8_t op, kva_status status, uint64_t offset, uint64_t size,
                        uint64_t latency_ns);

/* Reads the clock: what to publish now: 0 nothing, 1 the cheap sections (the publish interval
 * has passed), 2 everything (a second has passed since the last full publish). */
int kva_segment_clock_due(kva_segment *seg);

#endif
