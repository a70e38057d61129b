/*
 * evict_floor.c — what any eviction design pays in memory time, measured the way bench_kv
 * measures kva_kv_evict, so the two can be read side by side (docs/benchmarks.md, "KV manager").
 *
 * It is not the library. It models the best case an array-based LRU could reach: the victims'
 * ids sit in an array in eviction order (no list to chase), each victim's 40-byte record is
 * prefetched RECORD_AHEAD evictions early and its prefix-table bucket BUCKET_AHEAD early (the
 * bucket's index needs the record's key). Each eviction then does the memory work kva_kv_evict
 * must do: read the record, unlink it from its bucket's chain, clear it and append it to a free
 * list. The tables have bench_kv's shapes: n records of 40 bytes, a power of two of u32 buckets,
 * at least two per block, on transparent huge pages.
 *
 * If this floor is not flat from 10^4 to 10^6 cached blocks, no layout of the LRU makes the
 * library's eviction time flat there: what grows is the cost of reaching 2 random cache lines
 * per eviction in a larger table, not any work that grows with the cache.
 *
 * Usage: evict_floor   (a Markdown table: ns per eviction, median of 9 runs of 2,048)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "bench_clock.h"
#include "bench_random.h"

#define RUNS 9
#define EVICTIONS 2048
#define RECORD_AHEAD 16
#define BUCKET_AHEAD 8
#define NIL UINT32_MAX

typedef struct record { /* the library's kva_kv_block, field for field in size */
    uint64_t key_lo, key_hi;
    uint32_t refs, hash_next, prev, next, ns;
    uint8_t state, priority, registered, reserved;
} record;

_Static_assert(sizeof(record) == 40, "the same 40 bytes as a block record");

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_random(void) { return bench_xorshift64(&rng); }

static void *map_table(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("evict_floor: mmap");
        exit(2);
    }
    madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

/* One run: n cached blocks, victims in block order or a random order; ns per eviction. */
static double run(uint32_t n, int shuffled, int cold) {
    uint32_t nbuckets = 1;
    while (nbuckets < 2 * n) nbuckets <<= 1;
    record *recs = map_table((size_t)n * sizeof *recs);
    uint32_t *buckets = map_table((size_t)nbuckets * sizeof *buckets);
    uint32_t *order = map_table((size_t)n * sizeof *order);
    memset(buckets, 0xff, (size_t)nbuckets * sizeof *buckets);
    for (uint32_t b = 0; b < n; b++) { /* registered at the end of its chain, as the library does */
        recs[b] =
            (record){.key_lo = next_random(), .key_hi = next_random(), .hash_next = NIL, .state = 2, .registered = 1};
        uint32_t *link = &buckets[recs[b].key_lo & (nbuckets - 1)];
        while (*link != NIL) link = &recs[*link].hash_next;
        *link = b;
        order[b] = b;
    }
    if (shuffled)
        for (uint32_t i = n - 1; i > 0; i--) {
            uint32_t j = (uint32_t)(next_random() % (i + 1)), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
    if (cold) bench_flush_caches();

    uint32_t free_bottom = NIL;
    double t0 = bench_now_ns();
    for (uint32_t i = 0; i < EVICTIONS; i++) {
        if (i + RECORD_AHEAD < n) __builtin_prefetch(&recs[order[i + RECORD_AHEAD]], 1);
        if (i + BUCKET_AHEAD < n)
            __builtin_prefetch(&buckets[recs[order[i + BUCKET_AHEAD]].key_lo & (nbuckets - 1)], 1);
        uint32_t victim = order[i];
        record *r = &recs[victim];
        uint32_t *link = &buckets[r->key_lo & (nbuckets - 1)];
        while (*link != victim) link = &recs[*link].hash_next;
        *link = r->hash_next;
        r->registered = 0;
        r->state = 0;
        r->next = NIL;
        if (free_bottom != NIL) recs[free_bottom].next = victim;
        free_bottom = victim;
    }
    double ns = (bench_now_ns() - t0) / EVICTIONS;
    munmap(recs, (size_t)n * sizeof *recs);
    munmap(buckets, (size_t)nbuckets * sizeof *buckets);
    munmap(order, (size_t)n * sizeof *order);
    return ns;
}

int main(void) {
    static const uint32_t sizes[3] = {10000, 100000, 1000000};
    static const char *temperature[2] = {"warm", "cold"}, *order[2] = {"block order", "random order"};
    printf("| floor of an eviction (ns) | 10^4 blocks | 10^5 | 10^6 | 10^6 / 10^4 |\n|---|---:|---:|---:|---:|\n");
    for (int cold = 0; cold < 2; cold++)
        for (int shuffled = 0; shuffled < 2; shuffled++) {
            double med[3];
            for (int s = 0; s < 3; s++) {
                double runs[RUNS];
                for (int k = 0; k < RUNS; k++) runs[k] = run(sizes[s], shuffled, cold);
                med[s] = bench_median(runs, RUNS);
            }
            printf("| %s, victims in %s | %.1f | %.1f | %.1f | %.2fx |\n", temperature[cold], order[shuffled], med[0],
                   med[1], med[2], med[2] / med[0]);
        }
    return 0;
}
