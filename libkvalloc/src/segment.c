/*
 * segment.c — creation, registration and sequence-locked writing of the statistics segment.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "os.h"
#include "segment.h"

/* Segments of live pools, so that normal process exit can remove them. */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static kva_segment *live_segments;
static int exit_hook_installed;

/* A forked child's exit leaves the parent's segments (inherited) alone: the parent lives on. */
static void unlink_all_at_exit(void) {
    pthread_mutex_lock(&live_lock);
    for (kva_segment *seg = live_segments; seg; seg = seg->next_live)
        if (!seg->inherited) kva_os_shm_unlink(seg->name);
    live_segments = NULL;
    pthread_mutex_unlock(&live_lock);
}

void kva_segments_lock(void) { pthread_mutex_lock(&live_lock); }
void kva_segments_unlock(void) { pthread_mutex_unlock(&live_lock); }

void kva_segments_disown_all(void) {
    for (kva_segment *seg = live_segments; seg; seg = seg->next_live) kva_segment_disown(seg);
}

static void register_segment(kva_segment *seg) {
    pthread_mutex_lock(&live_lock);
    if (!exit_hook_installed) exit_hook_installed = atexit(unlink_all_at_exit) == 0;
    seg->next_live = live_segments;
    live_segments = seg;
    pthread_mutex_unlock(&live_lock);
}

static void unregister_segment(kva_segment *seg) {
    pthread_mutex_lock(&live_lock);
    for (kva_segment **at = &live_segments; *at; at = &(*at)->next_live) {
        if (*at == seg) {
            *at = seg->next_live;
            break;
        }
    }
    pthread_mutex_unlock(&live_lock);
}

static size_t align8(size_t n) { return (n + 7) & ~(size_t)7; }

/* Lays out one section after `*end` and records it in the table. */
static void *add_section(kva_segment *seg, uint32_t kind, size_t size, size_t *end) {
    kva_shm_header *h = seg->header;
    kva_shm_section *entry = &h->sections[h->section_count++];
    entry->kind = kind;
    entry->offset = *end;
    entry->size = size;
    void *at = seg->base + *end;
    *end = align8(*end + size);
    return at;
}

static uint32_t heap_cells(uint32_t nblocks, uint32_t *cell_blocks) {
    uint64_t n = nblocks, per = 1;                /* 64-bit: nblocks + per - 1 passes 2^32 near the largest pools */
    while ((n + per - 1) / per > 16384) per *= 2; /* at most 16,384 cells */
    *cell_blocks = (uint32_t)per;
    return (uint32_t)((n + per - 1) / per);
}

/* Whether a file of this user, mode 0600, at this process's segment name is a segment a
 * writer with this pid made (kva_os_shm_own_fn): the header's magic, ABI, writer and size. */
static int is_own_segment(const void *head, size_t len, uint64_t size, char *why, size_t why_size) {
    _Static_assert(sizeof(kva_shm_header) <= KVA_OS_SHM_HEAD, "the header is within what is read");
    kva_shm_header h;
    if (len < sizeof h) {
        snprintf(why, why_size, "a file of %llu bytes, too short for a segment header", (unsigned long long)size);
        return 0;
    }
    memcpy(&h, head, sizeof h);
    if (h.magic != KVA_SHM_MAGIC) snprintf(why, why_size, "a file without the segment magic");
    else if (h.abi_major != KVA_SHM_ABI_MAJOR) snprintf(why, why_size, "a segment of ABI %u", (unsigned)h.abi_major);
    else if (h.writer_pid != kva_os_pid())
        snprintf(why, why_size, "a segment written by pid %u", (unsigned)h.writer_pid);
    else if (h.segment_size != size)
        snprintf(why, why_size, "a segment of %llu bytes in a file of %llu bytes", (unsigned long long)h.segment_size,
                 (unsigned long long)size);
    else return 1;
    return 0;
}

kva_status kva_segment_open(const char *pool_name, const kva_segment_geometry *geo, int trace_all, unsigned interval_ms,
                            kva_segment **out) {
    kva_segment *seg = calloc(1, sizeof *seg);
    if (!seg) return kva_fail(KVA_ERR_NOMEM, "no host memory for the stats segment descriptor");
    seg->fd = -1;
    snprintf(seg->name, sizeof seg->name, "/%s%u.%s", KVA_SHM_PREFIX, kva_os_pid(), pool_name);

    uint32_t cell_blocks, cells = heap_cells(geo->nblocks, &cell_blocks);
    uint32_t slabs_listed = geo->nchunks < KVA_SHM_SLABS_MAX ? geo->nchunks : KVA_SHM_SLABS_MAX;
    size_t sizes[] = {
        sizeof(kva_shm_summary),
        sizeof(kva_shm_heapmap) + 2 * (size_t)cells,
        sizeof(kva_shm_classes) + KVA_NUM_SIZE_CLASSES * sizeof(kva_shm_class),
        sizeof(kva_shm_slabs) + (size_t)slabs_listed * sizeof(kva_shm_slab),
        sizeof(kva_shm_arenas) + (size_t)geo->narenas * sizeof(kva_shm_arena),
        sizeof(kva_shm_latency),
        sizeof(kva_shm_kv),
        sizeof(kva_shm_trace) + KVA_TRACE_RECORDS * sizeof(kva_shm_trace_record),
        /* sized for the maxima: the KV cache attaches after the segment is made */
        sizeof(kva_shm_kv_sequences) + KVA_SHM_KV_SEQ_ENTRIES * sizeof(kva_shm_kv_sequence),
        sizeof(kva_shm_kv_namespaces) + KVA_SHM_KV_NAMESPACE_ROWS * sizeof(kva_shm_kv_namespace),
    };
    size_t total = align8(sizeof(kva_shm_header));
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += align8(sizes[i]);

    void *base;
    kva_status st = kva_os_shm_create(seg->name, total, is_own_segment, &base, &seg->fd);
    if (st != KVA_OK) {
        free(seg);
        return st;
    }
    seg->base = base;
    seg->size = total;
    seg->header = base;
    kva_shm_header *h = seg->header;
    h->abi_major = KVA_SHM_ABI_MAJOR;
    h->abi_minor = KVA_SHM_ABI_MINOR;
    h->header_size = sizeof *h;
    h->segment_size = total;
    h->writer_pid = kva_os_pid();
    h->start_time_ns = h->heartbeat_ns = kva_os_realtime_ns();
    snprintf(h->pool_name, sizeof h->pool_name, "%s", pool_name);
    h->capabilities = KVA_SHM_CAP_SUMMARY | KVA_SHM_CAP_HEAPMAP | KVA_SHM_CAP_CLASSES | KVA_SHM_CAP_SLABS |
                      KVA_SHM_CAP_ARENAS | KVA_SHM_CAP_LATENCY | KVA_SHM_CAP_KV | KVA_SHM_CAP_TRACE |
                      KVA_SHM_CAP_LIVENESS_LOCK | (trace_all ? KVA_SHM_CAP_TRACE_ALL : 0);

    size_t end = align8(sizeof *h);
    seg->summary = add_section(seg, KVA_SHM_SECTION_SUMMARY, sizes[0], &end);
    seg->heapmap = add_section(seg, KVA_SHM_SECTION_HEAPMAP, sizes[1], &end);
    seg->heapmap->cells = cells;
    seg->heapmap->cell_blocks = cell_blocks;
    seg->cell_state = (uint8_t *)(seg->heapmap + 1);
    seg->cell_fill = seg->cell_state + cells;
    seg->classes = add_section(seg, KVA_SHM_SECTION_CLASSES, sizes[2], &end);
    seg->classes->count = KVA_NUM_SIZE_CLASSES;
    seg->classes->entry_size = sizeof(kva_shm_class);
    seg->slabs = add_section(seg, KVA_SHM_SECTION_SLABS, sizes[3], &end);
    seg->slabs->capacity = slabs_listed;
    seg->arenas = add_section(seg, KVA_SHM_SECTION_ARENAS, sizes[4], &end);
    seg->arenas->count = geo->narenas;
    seg->arenas->entry_size = sizeof(kva_shm_arena);
    seg->latency = add_section(seg, KVA_SHM_SECTION_LATENCY, sizes[5], &end);
    seg->kv = add_section(seg, KVA_SHM_SECTION_KV, sizes[6], &end);
    seg->trace = add_section(seg, KVA_SHM_SECTION_TRACE, sizes[7], &end);
    seg->trace->capacity = KVA_TRACE_RECORDS;
    seg->trace->entry_size = sizeof(kva_shm_trace_record);
    seg->kv_sequences = add_section(seg, KVA_SHM_SECTION_KV_SEQUENCES, sizes[8], &end);
    seg->kv_sequences->entry_size = sizeof(kva_shm_kv_sequence);
    seg->kv_sequences->capacity = KVA_SHM_KV_SEQ_ENTRIES;
    seg->kv_sequences->table_capacity = KVA_SHM_KV_SEQ_TABLE;
    seg->kv_namespaces = add_section(seg, KVA_SHM_SECTION_KV_NAMESPACES, sizes[9], &end);
    seg->kv_namespaces->entry_size = sizeof(kva_shm_kv_namespace);
    seg->kv_namespaces->capacity = KVA_SHM_KV_NAMESPACE_ROWS;
    /* The magic goes last: a reader that opens the segment while it is being set up sees no
     * magic and retries, instead of reading half a header. */
    __atomic_store_n(&h->magic, KVA_SHM_MAGIC, __ATOMIC_RELEASE);

    seg->interval_ns = (uint64_t)interval_ms * 1000000u;
    seg->summary->publish_interval_ms = interval_ms;
    register_segment(seg);
    *out = seg;
    return KVA_OK;
}

void kva_segment_close(kva_segment *seg) {
    if (!seg) return;
    unregister_segment(seg);
    if (!seg->inherited) kva_os_shm_unlink(seg->name);
    kva_os_unmap(seg->base, seg->size);
    kva_os_close(seg->fd); /* drops the liveness lock */
    free(seg);
}

void kva_segment_disown(kva_segment *seg) {
    seg->inherited = 1;
    kva_os_unmap(seg->base, seg->size);
    kva_os_close(seg->fd);
    seg->base = NULL;
    seg->size = 0;
    seg->fd = -1;
}

void kva_segment_begin(kva_segment *seg) {
    /* Odd: a write is in progress. The release fence keeps the writes below from being seen
     * before the odd value. */
    __atomic_store_n(&seg->header->sequence, seg->header->sequence + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

void kva_segment_end(kva_segment *seg) {
    __atomic_store_n(&seg->header->sequence, seg->header->sequence + 1, __ATOMIC_RELEASE);
}

static unsigned latency_bucket(uint64_t ns) {
    unsigned b = ns ? kva_log2(ns) : 0;
    return b < KVA_SHM_LATENCY_BUCKETS ? b : KVA_SHM_LATENCY_BUCKETS - 1;
}

/* Outside the sequence lock (kvalloc_stats.h, "The trace ring"): a traced pool records every
 * call, and each record making the sequence odd left readers of a busy pool no window for a
 * consistent copy. The record is stored first, then `written` with release, so a reader that
 * reads `written` before and after its copy knows which records it holds whole. */
void kva_segment_record(kva_segment *seg, uint8_t op, kva_status status, uint64_t offset, uint64_t size,
                        uint64_t latency_ns) {
    kva_shm_trace *t = seg->trace;
    uint64_t n = t->written;
    /* The last `written` store before this record's: a reader whose copy holds any of this
     * record then reads `written` >= n afterwards, and so does not keep the record of the
     * slot's previous lap (the release fence pairs with the reader's acquire fence). */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    kva_shm_trace_record *r = (kva_shm_trace_record *)(t + 1) + n % t->capacity;
    *r = (kva_shm_trace_record){.time_ns = kva_os_realtime_ns(),
                                .offset = offset,
                                .size = size,
                                .thread = kva_os_thread_id(),
                                .op = op,
                                .status = (uint8_t)status};
    __atomic_store_n(&t->written, n + 1, __ATOMIC_RELEASE);
    if (latency_ns != UINT64_MAX) {
        uint64_t *bucket = &(op == KVA_SHM_OP_FREE ? seg->latency->free
                                                   : seg->latency->alloc)[latency_bucket(latency_ns)];
        __atomic_store_n(bucket, *bucket + 1, __ATOMIC_RELAXED); /* a counter: read as it stands */
    }
}

int kva_segment_clock_due(kva_segment *seg) {
    uint64_t now = kva_os_monotonic_ns();
    if (now < seg->next_publish_ns) return 0;
    seg->next_publish_ns = now + seg->interval_ns;
    if (now < seg->next_full_ns) return 1;
    seg->next_full_ns = now + 1000000000u;
    return 2;
}
