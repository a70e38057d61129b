/*
 * bench_child.c — one measured run: one allocator, one pattern, in a process of its own.
 *
 * The parent (bench_alloc.c) starts this as `bench_alloc --child NAME --pattern PATTERN ...`
 * with LD_PRELOAD already set for a peer allocator; the report format is in bench_protocol.h.
 * Peers are measured through plain malloc/free, the way they are used; libkvalloc through
 * kva_alloc/kva_free on a pool of its own.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "bench_clock.h"
#include "bench_host.h"
#include "bench_protocol.h"
#include "kvalloc.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

/* Batch patterns: this many allocations are live at the end of each alloc phase. */
#define BATCH_OBJECTS 1000

/* Large-block pattern: sizes 1 MiB << (0..6), at most LARGE_LIVE_LIMIT live at once in a
 * LARGE_POOL pool, so that about half the pool is always free and a request fails only
 * through fragmentation. */
#define LARGE_MIN_SHIFT 20
#define LARGE_SHIFTS 7
#define LARGE_LIVE_LIMIT (512 * MIB)
#define LARGE_MAX_LIVE (LARGE_LIVE_LIMIT >> LARGE_MIN_SHIFT)
#define LARGE_POOL GIB

/* First-touch pattern: TOUCH_BLOCKS blocks of TOUCH_BLOCK live together, so every page the
 * pass writes is a page the process has never written, whatever the allocator caches. The
 * libkvalloc pool is exactly that big, so prefault=1 faults in exactly what is then used. */
#define TOUCH_BLOCK (64 * MIB)
#define TOUCH_BLOCKS 8
#define TOUCH_STRIDE (4 * KIB)

struct child_options {
    enum bench_allocator allocator;
    const char *pattern;
    unsigned rounds;  /* batch rounds per repetition */
    unsigned reps;    /* measured repetitions; one more, unmeasured, warms up first */
    unsigned samples; /* large-block allocations per repetition */
    int prefault;     /* kvalloc: kva_config.prefault of the pool */
};

static const char *g_name = "?";

static void report(enum bench_metric metric, double value)
{
    bench_report(g_name, bench_metric_keys[metric], value);
}

/* ---- the two backends ------------------------------------------------------------------ */


/* The pool is named, as an engine's would be: it then publishes its statistics to shared
 * memory now and then from the checked paths (tracing stays off, the default), and that cost
 * belongs in the figures. publish_ms 0 keeps the default interval. */
static void create_pool(size_t capacity, int prefault, unsigned publish_ms)
{
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.prefault = prefault;
    cfg.name = "bench";
    if (publish_ms != 0)
        cfg.publish_interval_ms = publish_ms;
    kva_status st = kva_pool_create(&cfg, &bench_pool);
    if (st != KVA_OK)
        bench_die("kva_pool_create(%zu MiB, prefault=%d): %s: %s", capacity / MIB, prefault,
                  kva_strerror(st), kva_last_error());
}

/* Reads the pool's statistics at a moment the caller knows to be its largest live set, so the
 * metadata fraction reported is the peak one. Never called inside a timed section. */
static void report_pool_peak(void)
{
    kva_stats st;
    kva_status status = kva_get_stats(bench_pool, &st);
    if (status != KVA_OK)
        bench_die("kva_get_stats: %s: %s", kva_strerror(status), kva_last_error());
    report(BENCH_METADATA_BYTES, (double)st.metadata_bytes);
    report(BENCH_CAPACITY, (double)st.capacity);
    report(BENCH_METADATA_FRACTION, (double)st.metadata_bytes / (double)st.capacity);
    report(BENCH_PAGE_KIND, (double)st.page_kind);
    report(BENCH_PAGE_SIZE, (double)st.page_size);
}

/* The pool filled with objects of one size until it takes no more: the metadata at its
 * largest for that size, since slab bitmaps grow with the objects (an l0 bit, a remote bit and
 * a share of a word's owner entry, about 2.5 bits per object) where the rest is fixed. The
 * objects are never freed: the pool goes with the process. */
static void report_full_pool(size_t size)
{
    void *p;
    while (kva_alloc(bench_pool, size, &p) == KVA_OK) {
    }
    kva_stats st;
    kva_status status = kva_get_stats(bench_pool, &st);
    if (status != KVA_OK)
        bench_die("kva_get_stats: %s: %s", kva_strerror(status), kva_last_error());
    report(BENCH_METADATA_FULL_FRACTION, (double)st.metadata_bytes / (double)st.capacity);
}

/* ---- measurement helpers ---------------------------------------------------------------- */

/* CLOCK_MONOTONIC is read through the vDSO on this kind of machine (tsc clocksource), so it
 * costs tens of nanoseconds and no system call. */
static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Minor page faults of this process so far. The memory of the large-block pattern is never
 * touched, so faults there are the allocator writing to its own bookkeeping for the first
 * time: they explain tail latencies that are not system calls. */
static double minor_faults(void)
{
    struct rusage u;
    return getrusage(RUSAGE_SELF, &u) == 0 ? (double)u.ru_minflt : 0;
}

/* Sorts v. The middle value, or the mean of the two middle ones. */
static double median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, bench_cmp_double);
    return bench_median_mean_sorted(v, n);
}

/* Nearest-rank percentile of a sorted array: the smallest sample that at least q of all
 * samples do not exceed. */
static double percentile_sorted(const double *v, size_t n, double q)
{
    size_t rank = (size_t)(q * (double)n + 0.999999);
    if (rank < 1)
        rank = 1;
    return v[(rank > n ? n : rank) - 1];
}

static double timer_overhead_ns(void)
{
    enum { N = 1001 };
    static double v[N];
    for (int i = 0; i < N; i++) {
        uint64_t t0 = now_ns();
        uint64_t t1 = now_ns();
        v[i] = (double)(t1 - t0);
    }
    return median(v, N);
}

/* Bookkeeping written in a timed loop, its pages faulted in now: a first touch in the loop would
 * count as the allocator's page fault. A volatile store per page, since a compiler may turn
 * malloc and a memset of zero into calloc, which leaves memory fresh from the kernel untouched. */
static void *xmalloc_touched(size_t count, size_t size)
{
    volatile unsigned char *p = bench_xmalloc(count * size);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t off = 0; off < count * size; off += page)
        p[off] = 0;
    if (count * size > 0)
        p[count * size - 1] = 0;
    return (void *)p;
}

/* xorshift64*: the same seed gives every allocator the same request sequence. */
static uint64_t next_random(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* ---- pattern 1 and 2: batches ----------------------------------------------------------- */

struct batch_time {
    uint64_t alloc_ns, free_ns;
};

/* What a batch allocates and in which order it frees: object i has size sizes[i % nsizes], and
 * the i-th free is of object order[i] (allocation order when order is NULL). */
struct batch_shape {
    const size_t *sizes;
    unsigned nsizes;
    const unsigned *order;
};

/* Mixed: token metadata, small tensors' headers and scratch records of eight sizes, 16 B to
 * 1 KiB, one after the other, so that every free changes size class. */
#define MIXED_SIZES 8
static const size_t mixed_sizes[MIXED_SIZES] = {16, 48, 64, 96, 128, 256, 512, 1024};

/* A shape laid out for the timed loop: each object's size read from an array, so that the loop
 * has no division (i % nsizes is a hardware divide in every call; at one size the divider
 * returns early, at eight it is a cost of the loop, not of the allocator). */
struct batch_plan {
    size_t size[BATCH_OBJECTS];
    const unsigned *order;
};

static void plan_batch(const struct batch_shape *shape, struct batch_plan *plan)
{
    for (int i = 0; i < BATCH_OBJECTS; i++)
        plan->size[i] = shape->sizes[i % shape->nsizes];
    plan->order = shape->order;
}

/* One round: BATCH_OBJECTS allocations, then the same objects freed in the shape's order,
 * timed. ALLOC(size, slot) stores an object's pointer into *slot and is nonzero when the
 * allocation failed; RELEASE(ptr) is nonzero when the free was refused. Each backend's round
 * calls its allocator's own entry points (struct backend). */
#define BATCH_ROUND(ALLOC, RELEASE)                                                                \
    do {                                                                                           \
        uint64_t t0 = now_ns();                                                                    \
        for (int i = 0; i < BATCH_OBJECTS; i++) {                                                  \
            size_t size = plan->size[i];                                                           \
            if (ALLOC(size, &slots[i]))                                                            \
                bench_die("allocation of %zu bytes failed", size);                                 \
        }                                                                                          \
        uint64_t t1 = now_ns();                                                                    \
        int refused = 0;                                                                           \
        if (plan->order == NULL)                                                                   \
            for (int i = 0; i < BATCH_OBJECTS; i++)                                                \
                refused |= RELEASE(slots[i]);                                                      \
        else                                                                                       \
            for (int i = 0; i < BATCH_OBJECTS; i++)                                                \
                refused |= RELEASE(slots[plan->order[i]]);                                         \
        uint64_t t2 = now_ns();                                                                    \
        if (refused)                                                                               \
            bench_die("a free of a batch object was refused");                                     \
        t->alloc_ns += t1 - t0;                                                                    \
        t->free_ns += t2 - t1;                                                                     \
    } while (0)

static void batch_round_malloc(const struct backend *b, const struct batch_plan *plan, void **slots,
                               struct batch_time *t)
{
    void *(*alloc)(size_t) = b->malloc_fn;
    void (*release)(void *) = b->free_fn;
#define MALLOC_INTO(size, slot) ((*(slot) = alloc(size)) == NULL)
#define FREE_OK(ptr) (release(ptr), 0)
    BATCH_ROUND(MALLOC_INTO, FREE_OK);
#undef MALLOC_INTO
#undef FREE_OK
}

static void batch_round_kvalloc(const struct backend *b, const struct batch_plan *plan,
                                void **slots, struct batch_time *t)
{
    kva_pool *pool = bench_pool;
    kva_status (*alloc)(kva_pool *, size_t, void **) = b->kva_alloc_fn;
    kva_status (*release)(kva_pool *, void *) = b->kva_free_fn;
#define KVA_INTO(size, slot) (alloc(pool, size, slot) != KVA_OK)
#define KVA_RELEASE(ptr) (release(pool, ptr) != KVA_OK)
    BATCH_ROUND(KVA_INTO, KVA_RELEASE);
#undef KVA_INTO
#undef KVA_RELEASE
}

static void batch_round(const struct backend *b, const struct batch_plan *plan, void **slots,
                        struct batch_time *t)
{
    if (b->kva_alloc_fn != NULL)
        batch_round_kvalloc(b, plan, slots, t);
    else
        batch_round_malloc(b, plan, slots, t);
}

/* The figures of one batch pattern. */
struct batch_metrics {
    enum bench_metric op, alloc, free, faults;
};

static void run_batch(const struct backend *b, const struct child_options *o,
                      const struct batch_shape *shape, const struct batch_metrics *m)
{
    void **slots = bench_xmalloc(BATCH_OBJECTS * sizeof *slots);
    struct batch_plan *plan = bench_xmalloc(sizeof *plan);
    plan_batch(shape, plan);
    double *per_op = xmalloc_touched(o->reps, sizeof *per_op);
    double *per_alloc = xmalloc_touched(o->reps, sizeof *per_alloc);
    double *per_free = xmalloc_touched(o->reps, sizeof *per_free);

    /* Warm-up: brings the allocator's caches and, for kvalloc, the slabs into being; the live
     * set is at its peak halfway through, which is when the pool is inspected. */
    struct batch_time warm = {0, 0};
    batch_round(b, plan, slots, &warm);
    if (bench_pool != NULL) {
        for (int i = 0; i < BATCH_OBJECTS; i++)
            if (bench_alloc_into(b, plan->size[i], &slots[i]))
                bench_die("allocation failed");
        report_pool_peak();
        for (int i = 0; i < BATCH_OBJECTS; i++)
            if (bench_release(b, slots[i]))
                bench_die("a free of a batch object was refused");
    }
    for (unsigned r = 0; r < o->rounds; r++)
        batch_round(b, plan, slots, &warm);

    double ops = (double)o->rounds * BATCH_OBJECTS;
    double faults_before = minor_faults();
    for (unsigned rep = 0; rep < o->reps; rep++) {
        struct batch_time t = {0, 0};
        for (unsigned r = 0; r < o->rounds; r++)
            batch_round(b, plan, slots, &t);
        per_op[rep] = (double)(t.alloc_ns + t.free_ns) / (2 * ops);
        per_alloc[rep] = (double)t.alloc_ns / ops;
        per_free[rep] = (double)t.free_ns / ops;
    }
    report(m->faults, minor_faults() - faults_before);
    report(m->op, median(per_op, o->reps));
    report(m->alloc, median(per_alloc, o->reps));
    report(m->free, median(per_free, o->reps));
    free(per_free);
    free(per_alloc);
    free(per_op);
    free(plan);
    free(slots);
}

/* A fixed permutation of the batch (Fisher-Yates), the same for every allocator. */
static const unsigned *shuffled_order(void)
{
    static unsigned order[BATCH_OBJECTS];
    uint64_t state = 0x9E3779B97F4A7C15ULL;
    for (unsigned i = 0; i < BATCH_OBJECTS; i++)
        order[i] = i;
    for (unsigned i = BATCH_OBJECTS - 1; i > 0; i--) {
        unsigned j = (unsigned)(next_random(&state) % (i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    return order;
}

/* ---- pattern 3: large blocks ------------------------------------------------------------ */

struct live_set {
    void *ptr[LARGE_MAX_LIVE];
    size_t size[LARGE_MAX_LIVE];
    size_t count, bytes;
};

static void live_release(const struct backend *b, struct live_set *live, size_t i)
{
    if (bench_release(b, live->ptr[i]))
        bench_die("a free of a %zu MiB block was refused", live->size[i] / MIB);
    live->bytes -= live->size[i];
    live->count--;
    live->ptr[i] = live->ptr[live->count];
    live->size[i] = live->size[live->count];
}

static void live_release_random(const struct backend *b, struct live_set *live, uint64_t *rng)
{
    live_release(b, live, (size_t)(next_random(rng) % live->count));
}

/* The next request of the sequence: a random power-of-two size, after random frees have made
 * room for it under the live limit. Shared with the syscall check so both make the same
 * calls. */
static size_t large_next_size(const struct backend *b, struct live_set *live, uint64_t *rng)
{
    size_t size = (size_t)1 << (LARGE_MIN_SHIFT + next_random(rng) % LARGE_SHIFTS);
    while (live->bytes + size > LARGE_LIVE_LIMIT)
        live_release_random(b, live, rng);
    return size;
}

/* Allocates size bytes into live. libkvalloc may answer NOMEM although half the pool is
 * free (buddy fragmentation): then free one more random block and retry, counting the
 * failure. Returns the latency of the successful call, in ns, or 0 if timed is 0. */
static uint64_t large_alloc(const struct backend *b, struct live_set *live, size_t size,
                            uint64_t *rng, uint64_t *failures, int timed)
{
    for (;;) {
        uint64_t t0 = timed ? now_ns() : 0;
        void *p;
        int failed = bench_alloc_into(b, size, &p);
        uint64_t t1 = timed ? now_ns() : 0;
        if (!failed) {
            live->ptr[live->count] = p;
            live->size[live->count] = size;
            live->count++;
            live->bytes += size;
            return t1 - t0;
        }
        if (bench_pool == NULL || live->count == 0)
            bench_die("allocation of %zu MiB failed", size / MIB);
        (*failures)++;
        live_release_random(b, live, rng);
    }
}

static void run_large(const struct backend *b, const struct child_options *o)
{
    static struct live_set live;
    double *lat = bench_xmalloc(o->samples * sizeof *lat);
    double *p50 = bench_xmalloc(o->reps * sizeof *p50);
    double *p99 = bench_xmalloc(o->reps * sizeof *p99);
    double *p999 = bench_xmalloc(o->reps * sizeof *p999);
    double worst = 0;
    uint64_t rng = 0x9E3779B97F4A7C15ULL, failures = 0;
    double faults = 0; /* in the timed allocation loops only: not the frees, not the sorting */

    report(BENCH_TIMER_NS, timer_overhead_ns());
    /* Repetition 0 warms up and is not recorded; each repetition starts from an empty set. */
    for (unsigned rep = 0; rep <= o->reps; rep++) {
        double faults_before = minor_faults();
        for (unsigned i = 0; i < o->samples; i++) {
            size_t size = large_next_size(b, &live, &rng);
            lat[i] = (double)large_alloc(b, &live, size, &rng, &failures, 1);
        }
        if (rep > 0)
            faults += minor_faults() - faults_before;
        if (rep == 0 && bench_pool != NULL)
            report_pool_peak();
        while (live.count > 0)
            live_release(b, &live, live.count - 1);
        if (rep == 0)
            continue;
        qsort(lat, o->samples, sizeof *lat, bench_cmp_double);
        p50[rep - 1] = percentile_sorted(lat, o->samples, 0.50);
        p99[rep - 1] = percentile_sorted(lat, o->samples, 0.99);
        p999[rep - 1] = percentile_sorted(lat, o->samples, 0.999);
        if (lat[o->samples - 1] > worst)
            worst = lat[o->samples - 1];
    }
    report(BENCH_LARGE_P50_NS, median(p50, o->reps));
    report(BENCH_LARGE_P99_NS, median(p99, o->reps));
    report(BENCH_LARGE_P999_NS, median(p999, o->reps));
    report(BENCH_LARGE_MAX_NS, worst);
    report(BENCH_LARGE_FAULTS, 1000 * faults / ((double)o->samples * o->reps));
    report(BENCH_LARGE_FAULT_COUNT, faults);
    if (bench_pool != NULL)
        report(BENCH_LARGE_FAILURES, (double)failures);
    free(p999);
    free(p99);
    free(p50);
    free(lat);
}

/* ---- pattern 4: a fresh pool ------------------------------------------------------------ */

/* The large-block requests of a pool made just before: FRESH_LIVE blocks live, each allocation
 * replacing one at random with a random power of two from 1 to 64 MiB. libkvalloc's pool holds
 * FRESH_POOL, a peer's heap is as new as its process. Nothing warms up, since the first calls
 * are what is measured; the frees between the timed allocations are in the fault count. */
#define FRESH_POOL (2 * GIB)
#define FRESH_LIVE 16

static void run_fresh(const struct backend *b, const struct child_options *o)
{
    static struct live_set live;
    double *lat = xmalloc_touched(o->samples, sizeof *lat);
    uint64_t rng = 0x9E3779B97F4A7C15ULL, failures = 0;
    /* What the loop writes besides the allocator, and the clock, touched before it. */
    memset(&live, 0, sizeof live);
    (void)now_ns();
    if (o->allocator == BENCH_KVALLOC)
        create_pool(FRESH_POOL, o->prefault, 0);
    double faults_before = minor_faults();
    for (unsigned i = 0; i < o->samples; i++) {
        while (live.count >= FRESH_LIVE)
            live_release_random(b, &live, &rng);
        size_t size = (size_t)1 << (LARGE_MIN_SHIFT + next_random(&rng) % LARGE_SHIFTS);
        lat[i] = (double)large_alloc(b, &live, size, &rng, &failures, 1);
    }
    double faults = minor_faults() - faults_before;
    while (live.count > 0)
        live_release(b, &live, live.count - 1);
    qsort(lat, o->samples, sizeof *lat, bench_cmp_double);
    report(BENCH_FRESH_P50_NS, percentile_sorted(lat, o->samples, 0.50));
    report(BENCH_FRESH_P99_NS, percentile_sorted(lat, o->samples, 0.99));
    report(BENCH_FRESH_P999_NS, percentile_sorted(lat, o->samples, 0.999));
    report(BENCH_FRESH_MAX_NS, lat[o->samples - 1]);
    report(BENCH_FRESH_FAULTS, faults);
    if (bench_pool != NULL)
        report(BENCH_FRESH_FAILURES, (double)failures);
    free(lat);
}

/* ---- pattern 5: first touch ------------------------------------------------------------- */

/* One pass over fresh memory: allocate every block and write one byte per 4 KiB page (that
 * write is the page fault a real first use pays), then free everything. The pass is timed
 * whole, frees included, since returning the memory is part of the cycle. The parent runs
 * this in a new process per repetition: a second pass would reuse memory and fault less. */
static void run_touch(const struct backend *b, const struct child_options *o)
{
    int is_kvalloc = o->allocator == BENCH_KVALLOC;
    if (is_kvalloc) {
        uint64_t c0 = now_ns();
        create_pool(TOUCH_BLOCK * TOUCH_BLOCKS, o->prefault, 0);
        uint64_t c1 = now_ns();
        report(o->prefault ? BENCH_CREATE_PREFAULT_MS : BENCH_CREATE_MS, (double)(c1 - c0) / 1e6);
    }
    void *blocks[TOUCH_BLOCKS];
    double faults_before = minor_faults();
    uint64_t t0 = now_ns();
    for (int i = 0; i < TOUCH_BLOCKS; i++) {
        if (bench_alloc_into(b, TOUCH_BLOCK, &blocks[i]))
            bench_die("allocation of %zu MiB failed", TOUCH_BLOCK / MIB);
        volatile unsigned char *bytes = blocks[i];
        for (size_t off = 0; off < TOUCH_BLOCK; off += TOUCH_STRIDE)
            bytes[off] = 1;
    }
    for (int i = 0; i < TOUCH_BLOCKS; i++)
        if (bench_release(b, blocks[i]))
            bench_die("a free of a %zu MiB block was refused", TOUCH_BLOCK / MIB);
    uint64_t t1 = now_ns();
    double faults = minor_faults() - faults_before;
    /* bytes per ns is GB/s (10^9 bytes per second). */
    double gbps = (double)(TOUCH_BLOCK * TOUCH_BLOCKS) / (double)(t1 - t0);
    report(is_kvalloc && o->prefault ? BENCH_TOUCH_PREFAULT_FAULTS : BENCH_TOUCH_FAULTS, faults);
    if (is_kvalloc) {
        report(o->prefault ? BENCH_TOUCH_PREFAULT_GBPS : BENCH_TOUCH_GBPS, gbps);
        kva_stats st;
        if (kva_get_stats(bench_pool, &st) == KVA_OK)
            report(BENCH_PAGE_KIND, (double)st.page_kind);
    } else {
        report(BENCH_TOUCH_GBPS, gbps);
    }
}

/* ---- the syscall check ------------------------------------------------------------------ */

/* A marker is one write(2) of one line, so it is exactly one line of strace's log. */
static void mark(const char *line)
{
    size_t len = strlen(line);
    if (write(STDOUT_FILENO, line, len) != (ssize_t)len)
        bench_die("cannot write the marker %s", line);
}

/* The allocation paths of patterns 1-3, untimed (a clock read could itself be a system call
 * on a machine without a vDSO clock), between two markers that strace will show. Everything
 * the calls need is allocated before the first marker; nothing is printed until the last.
 * The parent runs it for kvalloc; run by hand for a peer, it shows the check does see calls
 * (glibc's 4 KiB rounds move the heap top with brk). */
static void run_syscall_check(const struct backend *b, const struct child_options *o)
{
    static struct live_set live;
    void **slots = bench_xmalloc(BATCH_OBJECTS * sizeof *slots);
    uint64_t rng = 0x9E3779B97F4A7C15ULL, failures = 0, calls = 0;
    /* The calls of every timed batch pattern: 64 B, 4 KiB, the mixed sizes, and 64 B freed in
     * the shuffled order. */
    static const size_t size64[] = {64}, size4k[] = {4096};
    const struct batch_shape shapes[] = {{size64, 1, NULL},
                                         {size4k, 1, NULL},
                                         {mixed_sizes, MIXED_SIZES, NULL},
                                         {size64, 1, shuffled_order()}};

    mark(BENCH_MARK_BEGIN "\n");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const struct batch_shape *shape = &shapes[s];
        for (unsigned r = 0; r < o->rounds; r++) {
            for (int i = 0; i < BATCH_OBJECTS; i++)
                if (bench_alloc_into(b, shape->sizes[(size_t)i % shape->nsizes], &slots[i]))
                    bench_die("allocation of %zu bytes failed",
                              shape->sizes[(size_t)i % shape->nsizes]);
            for (int i = 0; i < BATCH_OBJECTS; i++)
                if (bench_release(b, slots[shape->order ? shape->order[i] : (unsigned)i]))
                    bench_die("a free was refused");
            calls += 2 * BATCH_OBJECTS;
        }
    }
    for (unsigned i = 0; i < o->samples; i++) {
        size_t size = large_next_size(b, &live, &rng);
        large_alloc(b, &live, size, &rng, &failures, 0);
    }
    /* Every block allocated is freed before the end marker; a failed attempt is one call. */
    calls += 2 * (uint64_t)o->samples + failures;
    while (live.count > 0)
        live_release(b, &live, live.count - 1);
    mark(BENCH_MARK_END "\n");
    report(BENCH_SYSCALL_CHECK_OPS, (double)calls);
    free(slots);
}

/* ---- entry ------------------------------------------------------------------------------ */

static void parse_child_options(int argc, char **argv, struct child_options *o)
{
    *o = (struct child_options){BENCH_ALLOCATOR_COUNT, NULL, 100, 3, 1000, 0};
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i];
        if (i + 1 >= argc)
            bench_die("%s wants a value", flag);
        const char *value = argv[++i];
        if (strcmp(flag, "--child") == 0) {
            static char identity[64];
            g_name = value;
            snprintf(identity, sizeof identity, "bench_alloc --child %s", value);
            bench_set_identity(identity, 2);
            for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
                if (strcmp(value, bench_allocators[a].name) == 0)
                    o->allocator = (enum bench_allocator)a;
        } else if (strcmp(flag, "--pattern") == 0) {
            o->pattern = value;
        } else if (strcmp(flag, "--rounds") == 0) {
            o->rounds = bench_parse_count(flag, value, 100000000);
        } else if (strcmp(flag, "--reps") == 0) {
            o->reps = bench_parse_count(flag, value, 100000000);
        } else if (strcmp(flag, "--samples") == 0) {
            o->samples = bench_parse_count(flag, value, 100000000);
        } else if (strcmp(flag, "--prefault") == 0) {
            o->prefault = strcmp(value, "0") != 0;
        } else {
            bench_die("unknown option %s", flag);
        }
    }
    if (o->allocator == BENCH_ALLOCATOR_COUNT)
        bench_die("unknown allocator");
    if (o->pattern == NULL)
        bench_die("--pattern is required (batch64, batch4k, shuffled64, mixed, large, fresh, "
                  "touch, syscalls)");
}

int bench_child_main(int argc, char **argv)
{
    struct child_options o;
    bench_set_identity("bench_alloc --child ?", 2);
    parse_child_options(argc, argv, &o);
    bench_verify_allocator(o.allocator);

    int is_kvalloc = o.allocator == BENCH_KVALLOC;
    const struct backend *b = is_kvalloc ? &bench_kvalloc_backend : &bench_malloc_backend;
    /* The touch and fresh patterns create their own pools, because the creation and the
     * pool's youth are part of what they report; the others use a 1 GiB pool. The syscall
     * check's publishes every millisecond, so that publishing, which runs on the allocation
     * path too, happens inside its window. */
    if (is_kvalloc && strcmp(o.pattern, "touch") != 0 && strcmp(o.pattern, "fresh") != 0)
        create_pool(LARGE_POOL, o.prefault, strcmp(o.pattern, "syscalls") == 0 ? 1 : 0);

    static const size_t size64[] = {64}, size4k[] = {4096};
    if (strcmp(o.pattern, "batch64") == 0)
        run_batch(b, &o, &(struct batch_shape){size64, 1, NULL},
                  &(struct batch_metrics){BENCH_BATCH64_NS, BENCH_BATCH64_ALLOC_NS,
                                          BENCH_BATCH64_FREE_NS, BENCH_BATCH64_FAULTS});
    else if (strcmp(o.pattern, "batch4k") == 0)
        run_batch(b, &o, &(struct batch_shape){size4k, 1, NULL},
                  &(struct batch_metrics){BENCH_BATCH4K_NS, BENCH_BATCH4K_ALLOC_NS,
                                          BENCH_BATCH4K_FREE_NS, BENCH_BATCH4K_FAULTS});
    else if (strcmp(o.pattern, "shuffled64") == 0)
        run_batch(b, &o, &(struct batch_shape){size64, 1, shuffled_order()},
                  &(struct batch_metrics){BENCH_SHUFFLED64_NS, BENCH_SHUFFLED64_ALLOC_NS,
                                          BENCH_SHUFFLED64_FREE_NS, BENCH_SHUFFLED64_FAULTS});
    else if (strcmp(o.pattern, "mixed") == 0)
        run_batch(b, &o, &(struct batch_shape){mixed_sizes, MIXED_SIZES, NULL},
                  &(struct batch_metrics){BENCH_MIXED_NS, BENCH_MIXED_ALLOC_NS, BENCH_MIXED_FREE_NS,
                                          BENCH_MIXED_FAULTS});
    else if (strcmp(o.pattern, "large") == 0)
        run_large(b, &o);
    else if (strcmp(o.pattern, "fresh") == 0)
        run_fresh(b, &o);
    else if (strcmp(o.pattern, "touch") == 0)
        run_touch(b, &o);
    else if (strcmp(o.pattern, "syscalls") == 0)
        run_syscall_check(b, &o);
    else
        bench_die("unknown pattern '%s'", o.pattern);
    /* After the timed part, the metadata of the pool full of the pattern's smallest size. */
    if (bench_pool != NULL && strcmp(o.pattern, "batch64") == 0)
        report_full_pool(64);
    else if (bench_pool != NULL && strcmp(o.pattern, "batch4k") == 0)
        report_full_pool(4096);
    else if (bench_pool != NULL && strcmp(o.pattern, "mixed") == 0)
        report_full_pool(16);

    kva_pool_destroy(bench_pool);
    return fflush(stdout) == 0 ? 0 : 2;
}
